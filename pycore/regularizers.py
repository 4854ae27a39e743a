"""Condition-number regularizers R_well and R_ill, closed-form gradients, safe step sizes.

docs/theory.md §3 (definitions), §4 (gradients through θ), §5 (corrected step-size bounds).  For a
matrix ``S`` with singular values ``σ₁ ≥ … ≥ σ_k > 0`` (``k`` = numerical rank, ``p`` = min
dimension)::

    R_well(S) = ½σ₁² − ‖S‖_F²/(2p)                 ∇_S R_well = σ₁u₁v₁ᵀ − S/p
    R_ill(S)  = 1/d,  d = ‖S‖_F²/(2k) − ½σ_k²       ∇_S R_ill  = (σ_k u_k v_kᵀ − S/k)/d²

(the R_ill gradient carries the outer ``−1/d²`` and ``∇d = S/k − σ_k u_k v_kᵀ``).  Gradients
are built from ONE extreme singular pair and ``S`` itself; nothing is differentiated through
an eigendecomposition, so close eigenvalues elsewhere in the spectrum do no harm.  A (near-)tie
at the extreme used makes the gradient undefined: it is reported in the diagnostics and, for
the gradient functions, raised as a :class:`TieWarning`.

Through a linear feature extractor, ``H(θ) = θᵀKθ`` and ``G = ∇_H R``:
``∇_θ R = 2KθG`` (Theorem 4.2) and the Algorithm-1 preconditioned direction
``K⁻¹∇_θ R = 2θG`` exactly (no solve); with a ridge it is ``2(K+λI)⁻¹KθG``.  The
preconditioners live in :mod:`pycore.precondition`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import scipy.linalg

from pycore.spectral import (EPS, SpectrumError, SpectrumInfo, SymmetricEigen, _summarise, is_symmetric,
                             rank_tolerance)
from pycore.validation import as_float_matrix, check_number, check_square, check_theta

KINDS = ("ill", "well")


class TieWarning(RuntimeWarning):
    """The extreme singular value used by a regularizer gradient is (nearly) repeated."""


@dataclass(frozen=True)
class RegularizerEval:
    """Value, gradient w.r.t. its matrix argument, and the spectrum it came from."""

    kind: str
    value: float
    grad: np.ndarray | None
    info: SpectrumInfo
    d: float | None = None  # R_ill's denominator; None for R_well

    @property
    def tie(self) -> bool:
        return self.info.tie_min if self.kind == "ill" else self.info.tie_max


def _singular_parts(S: np.ndarray, rtol):
    """σ (descending), U, V of ``S``; via ``eigh`` when symmetric (then ``u_i = sign(λ_i) v_i``)."""
    if is_symmetric(S):
        lam, V = np.linalg.eigh(0.5 * (S + S.T))
        order = np.argsort(-np.abs(lam), kind="stable")
        lam, V = lam[order], V[:, order]
        U = V * np.where(lam < 0, -1.0, 1.0)
        return np.abs(lam), U, V
    U, s, Vt = np.linalg.svd(S, full_matrices=False)
    return s, U, Vt.T


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"regularizer kind must be one of {KINDS}, got {kind!r}")
    return kind


def _r_ill_denominator(sigma: np.ndarray, k: int, fro2: float) -> float:
    """d = ‖S‖_F²/(2k) − σ_k²/2, or a :class:`SpectrumError` where R_ill is undefined.

    ``d ≥ 0`` with equality iff the ``k`` nonzero singular values are equal (κ = 1, including
    every rank-1 matrix): there R_ill is undefined, not zero (docs/theory.md §5, Thm 4.1(1) corrected).
    The threshold is the round-off level of ``fro2/k``.
    """
    d = fro2 / (2 * k) - 0.5 * sigma[k - 1] ** 2
    if k < 2 or d <= 4 * k * EPS * sigma[0] ** 2:
        raise SpectrumError(
            f"R_ill is undefined: the {k} nonzero singular value(s) are all equal (κ = 1"
            + (", rank 1" if k == 1 else "") + "); it needs at least two distinct nonzero singular values")
    return float(d)


def evaluate(S, kind: str, *, grad: bool = True, rtol: float | None = None, p: int | None = None,
             warn_tie: bool = True) -> RegularizerEval:
    """R_ill or R_well of a general matrix ``S`` and its gradient (docs/theory.md §3).

    ``p`` overrides the R_well normaliser (default ``min(S.shape)``, as in Nenov et al.).
    """
    kind = _check_kind(kind)
    S = as_float_matrix(S, "S")
    check_number(p, "p", low=1, integer=True, none_ok=True)
    sigma, U, V = _singular_parts(S, rtol)
    info = _summarise(sigma, S.shape, rtol, V, what="S")
    fro2 = float(np.sum(sigma * sigma))
    k = info.rank
    G = None
    if kind == "well":
        p = min(S.shape) if p is None else p
        value = 0.5 * sigma[0] ** 2 - fro2 / (2 * p)
        if grad:
            G = sigma[0] * np.outer(U[:, 0], V[:, 0]) - S / p
        d = None
    else:
        d = _r_ill_denominator(sigma, k, fro2)
        value = 1.0 / d
        if grad:
            G = (sigma[k - 1] * np.outer(U[:, k - 1], V[:, k - 1]) - S / k) / d**2
    out = RegularizerEval(kind, float(value), G, info, d)
    if grad and warn_tie and out.tie:
        _warn_tie(kind, info)
    return out


def _warn_tie(kind, info):
    where = "σ_min" if kind == "ill" else "σ_max"
    gap = info.gap_min if kind == "ill" else info.gap_max
    warnings.warn(f"R_{kind} gradient at a (near-)tie: {where} is repeated (gap {gap:.3e}, "
                  f"σ_max {info.sigma_max:.3e}); the gradient is not defined there", TieWarning, stacklevel=3)


def r_well(S) -> float:
    """R_well(S) = ½σ_max² − ‖S‖_F²/(2p) (Nenov et al. 2024; paper Eq. (3))."""
    return evaluate(S, "well", grad=False).value


def r_ill(S) -> float:
    """R_ill(S) = 1/(‖S‖_F²/(2k) − ½σ_min²), k = rank S (paper Sec. 4.1; docs/theory.md §3)."""
    return evaluate(S, "ill", grad=False).value


def r_well_grad(S) -> np.ndarray:
    """∇_S R_well = σ₁u₁v₁ᵀ − S/p (Theorem A.1(3)); warns :class:`TieWarning` at a σ_max tie."""
    return evaluate(S, "well").grad


def r_ill_grad(S) -> np.ndarray:
    """∇_S R_ill = (σ_k u_k v_kᵀ − S/k)/d² (Theorem 4.1(3)); warns at a σ_min tie."""
    return evaluate(S, "ill").grad


# --------------------------------------------------------------------------------------------
# Through a linear feature extractor: H(θ) = θᵀKθ = ZᵀZ with Z = Xθ.
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HessianRegularizer:
    """R(H) and G = ∇_H R(H) for the linear-probing Hessian ``H = ZᵀZ`` (docs/theory.md §4)."""

    kind: str
    value: float
    G: np.ndarray          # symmetric D×D
    H: np.ndarray
    info: SpectrumInfo     # eigenvalues of H (descending); vectors not stored
    d: float | None
    _vectors: dict = None  # descending index -> unit eigenvector, filled lazily
    _eig: SymmetricEigen | None = None  # H's tridiagonal reduction, for further vectors

    @property
    def tie(self) -> bool:
        return self.info.tie_min if self.kind == "ill" else self.info.tie_max

    def vector(self, i: int) -> np.ndarray:
        """Eigenvector of H for the i-th largest eigenvalue (from the kept tridiagonal
        reduction; bit-for-bit one LAPACK ``evr`` subset call on H)."""
        if i not in self._vectors:
            if self._eig is not None:
                self._vectors[i] = _zero_on_dead_features(self._eig.vector(self.info.sigma.size - 1 - i),
                                                          self.H)
            elif self.H is None:
                raise ValueError(f"eigenvector {i} was not kept and H was not formed (matrices=False)")
            else:
                self._vectors[i] = _eigvec_at(self.H, i)
        return self._vectors[i]


def _eigvec_at(H: np.ndarray, i: int) -> np.ndarray:
    """Unit eigenvector of the PSD ``H`` for its i-th largest eigenvalue, exactly zero where the
    math says zero: ``H_jj = 0`` means row j of H is zero (a feature that is identically zero),
    so ``e_j ∈ null(H)`` and every eigenvector of a nonzero eigenvalue has ``v_j = 0``.  LAPACK
    leaves round-off there (~1e-17), which a gradient built from ``v`` turns into entries of pure
    round-off, and Adam, which rescales each entry, into full-size steps of kernel-dependent sign
    (docs/reproducibility.md §3)."""
    n = H.shape[0]
    j = n - 1 - i  # LAPACK orders ascending
    _, v = scipy.linalg.eigh(H, subset_by_index=[j, j], driver="evr", check_finite=False)
    return _zero_on_dead_features(v[:, 0], H)


def _zero_on_dead_features(v: np.ndarray, H: np.ndarray) -> np.ndarray:
    """``v`` with the exact zeros of :func:`_eigvec_at` (``v_j = 0`` where ``H_jj = 0``), renormalised."""
    dead = np.diagonal(H) == 0
    if dead.any() and not dead.all():
        v = v.copy()
        v[dead] = 0.0
        v /= np.linalg.norm(v)
    return v


def hessian_regularizer(Z, kind: str, *, rtol: float | None = None,
                        matrices: bool = True) -> HessianRegularizer:
    """R_kind(ZᵀZ) and its gradient w.r.t. ``H = ZᵀZ`` (the in-loop path of the immunizers).

    R_well uses ``p = D`` (the Hessian's size, as in Theorem 4.2); R_ill uses ``k = rank H``.
    ``G`` is ``σ₁v₁v₁ᵀ − H/D`` or ``(σ_k v_k v_kᵀ − H/k)/d²`` with ``σ`` the eigenvalues of H.

    When N < D (MNIST: N ≤ 500 rows, D = 784) the spectrum comes from the N×N Gram matrix
    ZZᵀ instead (same nonzero eigenvalues; v = Zᵀu/√λ), and both extreme eigenvectors are kept.
    ``matrices=False`` (Gram path only) skips forming the D×D ``H`` and ``G`` (fields set to
    None) for callers that apply G through Z, as ``G = a·vvᵀ − b·ZᵀZ``.

    Otherwise H is reduced to tridiagonal form once (:class:`pycore.spectral.SymmetricEigen`):
    all eigenvalues from it, and each eigenvector asked for (one here, more later through
    :meth:`HessianRegularizer.vector`) by bisection and inverse iteration on it, bit-for-bit
    what separate ``evr`` calls give, without a full ``eigh`` or a reduction per vector.
    The spectrum comes from H (D×D) rather than the SVD of Z: 3-7× cheaper, and the gradient
    needs λ_min only to relative accuracy ``eps·κ(H)`` (1e-9 at κ = 1e7); the rank cut-off is
    then on H's scale (``λ_max·D·eps``), which resolves κ(H) up to ~1e13.  Metrics that must be
    exact at larger κ use :func:`pycore.spectral.gram_spectrum`.
    """
    kind = _check_kind(kind)
    Z = as_float_matrix(Z, "Z")
    N, D = Z.shape
    gram_vecs = None
    if not matrices and N >= D:
        matrices = True  # the D×D path needs H anyway
    H = Z.T @ Z if matrices else None
    if N < D:
        # Gram-space path (N < D, e.g. MNIST: N ≤ 500 rows, D = 784): ZZᵀ (N×N) has exactly
        # the nonzero eigenvalues of H = ZᵀZ, and an eigenvector u of ZZᵀ with eigenvalue λ > 0
        # maps to the unit eigenvector v = Zᵀu/√λ of H.  H's other D − N eigenvalues are zero,
        # so the zero-padded spectrum is H's spectrum and the rank cut-off below is unchanged.
        lam_g, U = np.linalg.eigh(Z @ Z.T)
        order = np.argsort(lam_g)[::-1]
        lam_g, U = np.clip(lam_g[order], 0.0, None), U[:, order]
        lam = np.zeros(D)
        lam[:N] = lam_g
        gram_vecs = (lam_g, U)
    else:
        # One tridiagonal reduction for the eigenvalues and every eigenvector asked for below
        # (bit-for-bit the separate scipy ``evr`` calls, :class:`pycore.spectral.SymmetricEigen`).
        eig = SymmetricEigen(H)
        lam = np.clip(eig.values[::-1], 0.0, None)
    info = _summarise(lam, (D, D), rtol, None, what="ZᵀZ")
    k = info.rank
    fro2 = float(np.sum(lam * lam))

    def vec(i):
        if gram_vecs is None:
            return _zero_on_dead_features(eig.vector(D - 1 - i), H)  # LAPACK orders ascending
        v = Z.T @ gram_vecs[1][:, i]
        return v / np.linalg.norm(v)  # = Zᵀu/√λ up to round-off; normalised explicitly

    if kind == "well":
        v = vec(0)
        value = 0.5 * lam[0] ** 2 - fro2 / (2 * D)
        G = lam[0] * np.outer(v, v) - H / D if matrices else None
        d, idx = None, 0
    else:
        d = _r_ill_denominator(lam, k, fro2)
        value = 1.0 / d
        v = vec(k - 1)
        G = (lam[k - 1] * np.outer(v, v) - H / k) / d**2 if matrices else None
        idx = k - 1
    vectors = {idx: v}
    if gram_vecs is not None:  # both extreme vectors are free here (Opt κ needs them)
        vectors.setdefault(0, vec(0))
        vectors.setdefault(k - 1, vec(k - 1))
    return HessianRegularizer(kind, float(value), G, H, info, d, vectors, None if gram_vecs else eig)


def grad_theta_and_regularizer(theta, K, kind: str):
    """(∇_θR(θᵀKθ) = 2KθG, the :class:`HessianRegularizer` of H = θᵀKθ) (Theorem 4.2)."""
    kind = _check_kind(kind)
    K = as_float_matrix(K, "K")
    check_square(K, "K")
    theta = check_theta(theta, K.shape[0])
    # Z with ZᵀZ = θᵀKθ: a symmetric square root of the PSD K keeps the SVD route of gram_spectrum.
    w, Q = np.linalg.eigh(0.5 * (K + K.T))
    if w[0] < -1e3 * EPS * max(abs(w[-1]), 1.0):
        raise ValueError(f"K must be positive semi-definite (smallest eigenvalue {w[0]:.3e})")
    # Eigenvalues of K at round-off level are zeroed BEFORE the square root: √(1e-16·λ_max)
    # would otherwise turn them into spurious nonzero singular values of Z (a rank change).
    w = np.where(w > rank_tolerance(max(w[-1], 0.0), K.shape), w, 0.0)
    Zk = (np.sqrt(w)[:, None] * Q.T) @ theta
    reg = hessian_regularizer(Zk, kind)
    return 2.0 * K @ theta @ reg.G, reg


def r_well_grad_theta(theta, K) -> np.ndarray:
    """∇_θ R_well(θᵀKθ) = 2Kθ(σ₁v₁v₁ᵀ − H/D) (Theorem 4.2(1))."""
    return grad_theta_and_regularizer(theta, K, "well")[0]


def r_ill_grad_theta(theta, K) -> np.ndarray:
    """∇_θ R_ill(θᵀKθ) = 2Kθ(σ_k v_k v_kᵀ − H/k)/d² (Theorem 4.2(2))."""
    return grad_theta_and_regularizer(theta, K, "ill")[0]


# --------------------------------------------------------------------------------------------
# Safe step sizes (docs/theory.md §5, corrected).  Library code so users can run certified-monotone mode.
# --------------------------------------------------------------------------------------------

def _spec(x) -> SpectrumInfo:
    if isinstance(x, SpectrumInfo):
        return x
    S = as_float_matrix(x, "S")
    sigma, _, _ = _singular_parts(S, None)
    return _summarise(sigma, S.shape, None, what="S")


def r_well_step_bound(S, p: int | None = None) -> float:
    """Largest η with κ(S − η∇R_well(S)) < κ(S) for all 0 < η < η* (Theorem A.1(4), corrected).

    The step maps σ₁ → (1−η+η/p)σ₁ and σᵢ → (1+η/p)σᵢ; κ drops iff the new σ₁ stays above
    ρσ₁ scaled, giving ``η* = (1−ρ)/(1−(1−ρ)/p)``, ``ρ = σ₂σ_k/σ₁²``.
    """
    info = _spec(S)
    p = min(_shape_of(S)) if p is None else p
    s, k = info.sigma, info.rank
    if k < 2 or info.tie_max:
        # κ = 1 (rank ≤ 1) cannot drop, and at a σ₁ tie the step lowers σ₁ only, so σ₂ stays
        # the maximum and κ does not move: no step size is safe, the honest bound is 0.
        return 0.0
    rho = s[1] * s[k - 1] / s[0] ** 2
    return float((1 - rho) / (1 - (1 - rho) / p))


def r_ill_step_bound(S) -> float:
    """Sufficient η for κ(S − η∇R_ill(S)) > κ(S): ``η < k d²/(k−1)`` (Theorem 4.1(4))."""
    info = _spec(S)
    s, k = info.sigma, info.rank
    d = _r_ill_denominator(s, k, float(np.sum(s * s)))
    return float(k * d**2 / (k - 1))


def preconditioned_r_well_step_bound(H, D: int | None = None) -> float:
    """Sufficient η for the preconditioned step ``θ − ηK⁻¹∇_θR_well`` to lower κ(θᵀKθ).

    Theorem 4.3(1) corrected (docs/theory.md §5): with eigenvalues σ of H,
    ``η ≤ (√σ₁ − √σ₂) / (2(1−1/D)σ₁^{3/2} + (2/D)σ₂^{3/2})``.  (The first term of the printed
    minimum alone is not enough.)  ``H`` may be the matrix or its :class:`SpectrumInfo`.
    """
    info = _spec(H)
    D = _shape_of(H)[0] if D is None else D
    if info.rank < 2 or info.tie_max:
        return 0.0  # as in r_well_step_bound: no step lowers κ at κ = 1 or at a σ₁ tie
    s1, s2 = info.sigma[0], info.sigma[1]
    return float((np.sqrt(s1) - np.sqrt(s2)) / (2 * (1 - 1 / D) * s1**1.5 + (2 / D) * s2**1.5))


def preconditioned_r_ill_step_bound(H) -> float:
    """Strict upper bound on η for ``θ − ηK⁻¹∇_θR_ill`` to raise κ(θᵀKθ) (Thm 4.3(2) corrected).

    ``η < min( d²/((1−2/k)σ_min)  [k > 2 only],  k d²/(2(k−1)σ_min) )``; at the second value the
    smallest eigenvalue of the new Hessian reaches 0 (rank drop).
    """
    info = _spec(H)
    s, k = info.sigma, info.rank
    d = _r_ill_denominator(s, k, float(np.sum(s * s)))
    smin = s[k - 1]
    b2 = k * d**2 / (2 * (k - 1) * smin)
    b1 = d**2 / ((1 - 2 / k) * smin) if k > 2 else np.inf
    return float(min(b1, b2))


def _shape_of(x):
    if isinstance(x, SpectrumInfo):
        return (x.sigma.size, x.sigma.size)
    return np.shape(x)
