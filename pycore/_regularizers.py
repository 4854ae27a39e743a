"""Condition-number regularizers R_well and R_ill (docs/theory.md §3), gradients and step bounds.

The gradients through θ are §4's (``∇_θR = 2KθG``, Theorem 4.2), the step-size bounds §5's
(corrected). Each needs ``‖S‖_F`` and ONE extreme singular pair, never a derivative of an
eigendecomposition; a (near-)tie there is a :class:`TieWarning`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from pycore._spectral import (
    EPS,
    SpectrumError,
    SpectrumInfo,
    SymmetricEigen,
    check_symmetric,
    rank_tolerance,
    scale_of,
    singular_parts,
    summarise,
)
from pycore._validation import (
    ParameterError,
    as_float_matrix,
    check_choice,
    check_number,
    check_theta,
)

# The two regularizers, R_ill (k = rank) and R_well (p = D), by name: the ``kind`` argument here
# and of the fused op (pycore._ops, csrc/), which checks its own input against the same names.
KINDS = ("ill", "well")


class TieWarning(RuntimeWarning):
    """The extreme singular value used by a regularizer gradient is (nearly) repeated."""


class _Tie:
    @property
    def tie(self) -> bool:  # at the singular pair the gradient uses
        return self.info.tie_min if self.kind == "ill" else self.info.tie_max


@dataclass(frozen=True)
class RegularizerEval(_Tie):
    """Value, gradient w.r.t. its matrix argument, and the spectrum it came from."""

    kind: str
    value: float
    grad: np.ndarray | None
    info: SpectrumInfo
    d: float | None = None  # R_ill's denominator; None for R_well


def r_ill_denominator(sigma: np.ndarray, k: int, fro2: float) -> float:
    """R_ill's denominator d = ‖S‖_F²/(2k) − σ_k²/2, or a SpectrumError where d = 0 (round-off).

    The k nonzero singular values are equal (κ = 1, rank 1 included; docs/theory.md §5, Thm
    4.1(1)).
    """
    d = fro2 / (2 * k) - 0.5 * sigma[k - 1] ** 2
    if k < 2 or d <= 4 * k * EPS * sigma[0] ** 2:
        raise SpectrumError(
            f"R_ill is undefined: the {k} nonzero singular value(s) are all equal (κ = 1"
            + (", rank 1" if k == 1 else "")
            + "); it needs two distinct ones"
        )
    return float(d)


def _unscaled(x, c: float, power: int, what: str):
    """``x·c**power`` for a quantity computed on S/c; an error where it over- or underflows."""
    with np.errstate(all="ignore"):
        y = x * np.float64(c) ** power
    if not np.all(np.isfinite(y)) or (np.ndim(x) == 0 and x != 0 and y == 0):
        raise SpectrumError(
            f"{what} of S is outside float64's range (max|S| = {c:.3e}); rescale S"
        )
    return y


def evaluate(
    S,
    kind: str,
    *,
    grad: bool = True,
    rtol: float | None = None,
    p: int | None = None,
    warn_tie: bool = True,
) -> RegularizerEval:
    """R_ill or R_well of a general matrix ``S`` and its gradient (docs/theory.md §3).

    ``p`` overrides R_well's normaliser ``min(S.shape)``.  Entries near the float64 limits are
    handled on S/max|S|.
    """
    check_choice(kind, "kind", KINDS)
    S = as_float_matrix(S, "S")
    check_number(p, "p", low=1, integer=True, none_ok=True)
    c = scale_of(S, 1e75) or 1.0  # R_ill's gradient divides by d² ~ σ⁴; ×1.0 changes no bit
    Ss = S / c if c != 1.0 else S
    sigma, U, V = singular_parts(Ss)
    info = summarise(_unscaled(sigma, c, 1, "a singular value"), S.shape, rtol, V, what="S")
    fro2, k, G, d = float(np.sum(sigma * sigma)), info.rank, None, None
    if kind == "well":
        p = min(S.shape) if p is None else p
        value = _unscaled(0.5 * sigma[0] ** 2 - fro2 / (2 * p), c, 2, "R_well")
        if grad:
            G = _unscaled(sigma[0] * np.outer(U[:, 0], V[:, 0]) - Ss / p, c, 1, "∇R_well")
    else:
        d = r_ill_denominator(sigma, k, fro2)
        value = _unscaled(1.0 / d, c, -2, "R_ill")
        if grad:
            G = (sigma[k - 1] * np.outer(U[:, k - 1], V[:, k - 1]) - Ss / k) / d**2
            G = _unscaled(G, c, -3, "∇R_ill")
        d = d if c == 1.0 else 1.0 / value
    out = RegularizerEval(kind, float(value), G, info, d)
    if grad and warn_tie and out.tie:
        gap, where = (info.gap_min, "σ_min") if kind == "ill" else (info.gap_max, "σ_max")
        warnings.warn(
            f"R_{kind} gradient at a (near-)tie: {where} is repeated (gap {gap:.3e}, σ_max "
            f"{info.sigma_max:.3e}); the gradient is not defined there",
            TieWarning,
            stacklevel=3,
        )
    return out


def r_well(S) -> float:
    """R_well(S) = ½σ_max² − ‖S‖_F²/(2p), p = min(m, n) (Nenov et al. 2024; paper Eq. (3)).

    Parameters
    ----------
    S : array_like, shape (m, n)
        A real finite matrix.

    Returns
    -------
    float
        R_well(S), computed on S/max|S| near the float64 limits.

    Raises
    ------
    ValueError
        ``S`` not a finite real 2-D array (the message names ``S``).
    SpectrumError
        S = 0, or a value outside float64.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import r_well
    >>> r_well(np.diag([3.0, 1.0])), r_well(2.0 * np.eye(3))  # 0 exactly at κ = 1
    (2.0, 0.0)
    """
    return evaluate(S, "well", grad=False).value


def r_ill(S) -> float:
    """R_ill(S) = 1/(‖S‖_F²/(2k) − ½σ_min²), k = rank S (paper Sec. 4.1; docs/theory.md §3).

    Parameters
    ----------
    S : array_like, shape (m, n)
        A real finite matrix with two distinct nonzero singular values.

    Returns
    -------
    float
        R_ill(S).

    Raises
    ------
    ValueError
        ``S`` not a finite real 2-D array (the message names ``S``).
    SpectrumError
        S = 0, all k nonzero singular values equal (κ = 1, rank 1 included: the denominator is 0),
        or a value outside float64.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import r_ill
    >>> r_ill(np.diag([3.0, 1.0]))  # 1/((9 + 1)/4 − 1/2)
    0.5
    """
    return evaluate(S, "ill", grad=False).value


def r_well_grad(S) -> np.ndarray:
    """∇_S R_well = σ₁u₁v₁ᵀ − S/p (Theorem A.1(3)).

    Warns :class:`TieWarning` at a σ_max tie, where R_well is not differentiable; refuses what
    :func:`r_well` refuses.
    """
    return evaluate(S, "well").grad


def r_ill_grad(S) -> np.ndarray:
    """∇_S R_ill = (σ_k u_k v_kᵀ − S/k)/d² (Theorem 4.1(3)), 0 where it underflows.

    Warns :class:`TieWarning` at a σ_min tie, where R_ill is not differentiable; refuses what
    :func:`r_ill` refuses, and a gradient that overflows float64.
    """
    return evaluate(S, "ill").grad


@dataclass(frozen=True)
class HessianRegularizer(_Tie):
    """R(H) and G = ∇_H R(H) for the linear-probing Hessian ``H = ZᵀZ`` (docs/theory.md §4)."""

    kind: str
    value: float
    G: np.ndarray  # symmetric D×D
    H: np.ndarray
    info: SpectrumInfo  # eigenvalues of H (descending); vectors not stored
    d: float | None
    _vectors: dict = None  # descending index -> unit eigenvector, filled lazily
    _eig: SymmetricEigen | None = None  # H's tridiagonal reduction, for further vectors

    def vector(self, i: int) -> np.ndarray:
        """Eigenvector of H for the i-th largest eigenvalue.

        Bit for bit one ``evr`` subset call on H.
        """
        if i not in self._vectors:
            if self._eig is None:  # N < D: the two extreme vectors are all there is
                raise ValueError(
                    f"eigenvector {i} of H was not kept (N < D keeps the extreme two)"
                )
            self._vectors[i] = _zero_on_dead_features(
                self._eig.vector(self.info.sigma.size - 1 - i), self.H
            )
        return self._vectors[i]


def _zero_on_dead_features(v: np.ndarray, H: np.ndarray) -> np.ndarray:
    """``v`` with ``v_j = 0`` exactly where ``H_jj = 0`` (e_j ∈ null(H)), renormalised.

    LAPACK's ~1e-17 there became full-size Adam steps of kernel-dependent sign (docs/design.md §7).
    """
    dead = np.diagonal(H) == 0
    if dead.any() and not dead.all():
        v = v.copy()
        v[dead] = 0.0
        v /= np.linalg.norm(v)
    return v


def hessian_regularizer(
    Z, kind: str, *, rtol: float | None = None, matrices: bool = True
) -> HessianRegularizer:
    """R_kind(ZᵀZ) and ``G = ∇_H R``, the immunizers' in-loop path.

    R_well with p = D (Theorem 4.2). N < D (MNIST): the spectrum of the N×N ``ZZᵀ``
    (``v = Zᵀu/√λ``), both extreme vectors kept, and ``matrices=False`` skips the D×D ``H`` and
    ``G``. Otherwise one reduction of H (:class:`pycore._spectral.SymmetricEigen`): 3-7× cheaper
    than the SVD of Z and exact enough for the gradient (λ_min to ``eps·κ(H)``). Exact metrics use
    ``gram_spectrum``.

    Parameters
    ----------
    Z : array_like, shape (N, D)
        The features.
    kind : {"ill", "well"}
        R_ill or R_well.
    rtol : float, optional
        The rank cut-off relative to the largest eigenvalue.
    matrices : bool, default True
        Form ``H`` and ``G`` (D×D).

    Returns
    -------
    HessianRegularizer
        ``value``, ``G``, ``H``, the spectrum's ``info`` and the extreme eigenvectors (``vector``).

    Raises
    ------
    SpectrumError
        R has no value at ``ZᵀZ`` (zero, or R_ill at κ = 1).

    Examples
    --------
    >>> import numpy as np
    >>> from pycore.linalg import hessian_regularizer
    >>> reg = hessian_regularizer(np.diag([3.0, 1.0]), "well")  # H = diag(9, 1)
    >>> reg.value, reg.G.shape  # ½·81 − (81 + 1)/4
    (20.0, (2, 2))
    """
    check_choice(kind, "kind", KINDS)
    Z = as_float_matrix(Z, "Z")
    N, D = Z.shape
    U = None  # eigenvectors of ZZᵀ (N < D), descending
    matrices = matrices or N >= D  # the D×D path needs H anyway
    H = Z.T @ Z if matrices else None
    if N < D:
        lam_g, U = np.linalg.eigh(Z @ Z.T)
        order = np.argsort(lam_g)[::-1]
        lam, U = np.zeros(D), U[:, order]
        lam[:N] = np.clip(lam_g[order], 0.0, None)
    else:
        eig = SymmetricEigen(H)
        lam = np.clip(eig.values[::-1], 0.0, None)
    info = summarise(lam, (D, D), rtol, None, what="ZᵀZ")
    k = info.rank
    fro2 = float(np.sum(lam * lam))

    def vec(i):
        if U is None:
            return _zero_on_dead_features(eig.vector(D - 1 - i), H)  # LAPACK orders ascending
        v = Z.T @ U[:, i]
        return v / np.linalg.norm(v)  # = Zᵀu/√λ up to round-off; normalised explicitly

    if kind == "well":
        v, d, idx = vec(0), None, 0
        value = 0.5 * lam[0] ** 2 - fro2 / (2 * D)
        G = lam[0] * np.outer(v, v) - H / D if matrices else None
    else:
        d = r_ill_denominator(lam, k, fro2)
        value, v, idx = 1.0 / d, vec(k - 1), k - 1
        G = (lam[k - 1] * np.outer(v, v) - H / k) / d**2 if matrices else None
    vectors = {idx: v}
    if U is not None:  # both extreme vectors are free here (Opt κ needs them)
        vectors.setdefault(0, vec(0))
        vectors.setdefault(k - 1, vec(k - 1))
    return HessianRegularizer(
        kind, float(value), G, H, info, d, vectors, None if U is not None else eig
    )


def grad_theta_and_regularizer(theta, K, kind: str):
    """(∇_θR(θᵀKθ) = 2KθG (Theorem 4.2), the :class:`HessianRegularizer` of H = θᵀKθ), K PSD."""
    check_choice(kind, "kind", KINDS)
    Ks, K = check_symmetric(K, "K"), as_float_matrix(K, "K")
    theta = check_theta(theta, K.shape[0])
    w, Q = np.linalg.eigh(Ks)
    if w[0] < -1e3 * EPS * max(abs(w[-1]), 1.0):
        raise ParameterError(
            "K", f"K must be positive semi-definite (smallest eigenvalue {w[0]:.3e})"
        )
    # Z with ZᵀZ = θᵀKθ from a symmetric square root of K (the SVD route of gram_spectrum); K's
    # round-off eigenvalues are zeroed first, or √(1e-16·λ_max) would be spurious singular values.
    w = np.where(w > rank_tolerance(max(w[-1], 0.0), K.shape), w, 0.0)
    reg = hessian_regularizer((np.sqrt(w)[:, None] * Q.T) @ theta, kind)
    return 2.0 * K @ theta @ reg.G, reg


def r_well_grad_theta(theta, K) -> np.ndarray:
    """∇_θ R_well(θᵀKθ) = 2Kθ(σ₁v₁v₁ᵀ − H/D) (Theorem 4.2(1))."""
    return grad_theta_and_regularizer(theta, K, "well")[0]


def r_ill_grad_theta(theta, K) -> np.ndarray:
    """∇_θ R_ill(θᵀKθ) = 2Kθ(σ_k v_k v_kᵀ − H/k)/d² (Theorem 4.2(2))."""
    return grad_theta_and_regularizer(theta, K, "ill")[0]


# Safe step sizes (docs/theory.md §5, corrected) for certified mode, of a matrix or its
# SpectrumInfo
def _spec(x, symmetric_name: str | None = None) -> SpectrumInfo:
    if isinstance(x, SpectrumInfo):
        return x
    S = as_float_matrix(x, "S") if symmetric_name is None else check_symmetric(x, symmetric_name)
    return summarise(singular_parts(S)[0], S.shape, None, what=symmetric_name or "S")


def r_well_step_bound(S, p: int | None = None) -> float:
    """The largest η* with κ(S − η∇R_well(S)) < κ(S) for all 0 < η < η*.

    Theorem A.1(4), corrected: ``η* = (1−ρ)/(1−(1−ρ)/p)``, ``ρ = σ₂σ_k/σ₁²``, for a matrix or its
    :class:`SpectrumInfo`; ``p`` defaults to ``min(S.shape)``. 0 when κ cannot drop (rank < 2, or a
    σ_max tie).
    """
    info = _spec(S)
    p = (info.sigma.size if isinstance(S, SpectrumInfo) else min(np.shape(S))) if p is None else p
    s, k = info.sigma, info.rank
    if k < 2 or info.tie_max:  # κ = 1 cannot drop; at a σ₁ tie σ₂ stays the maximum
        return 0.0
    rho = s[1] * s[k - 1] / s[0] ** 2
    return float((1 - rho) / (1 - (1 - rho) / p))


def r_ill_step_bound(S) -> float:
    """A sufficient η for κ(S − η∇R_ill(S)) > κ(S): ``η < k d²/(k−1)`` (Theorem 4.1(4)).

    For a matrix or its :class:`SpectrumInfo`; a SpectrumError where R_ill is undefined.
    """
    info = _spec(S)
    s, k = info.sigma, info.rank
    d = r_ill_denominator(s, k, float(np.sum(s * s)))
    return float(k * d**2 / (k - 1))


def preconditioned_r_well_step_bound(H, D: int | None = None) -> float:
    """A sufficient η for ``θ − ηK⁻¹∇_θR_well`` to lower κ(θᵀKθ) (Theorem 4.3(1), corrected).

    ``η ≤ (√σ₁ − √σ₂) / (2(1−1/D)σ₁^{3/2} + (2/D)σ₂^{3/2})``, σ the eigenvalues of the symmetric
    H = θᵀKθ (or its :class:`SpectrumInfo`), D defaulting to H's size; 0 when κ cannot drop.
    """
    info = _spec(H, "H")
    D = info.sigma.size if D is None else D
    if info.rank < 2 or info.tie_max:
        return 0.0  # as in r_well_step_bound
    s1, s2 = info.sigma[0], info.sigma[1]
    return float((np.sqrt(s1) - np.sqrt(s2)) / (2 * (1 - 1 / D) * s1**1.5 + (2 / D) * s2**1.5))


def preconditioned_r_ill_step_bound(H) -> float:
    """A strict upper bound on η for ``θ − ηK⁻¹∇_θR_ill`` to raise κ(θᵀKθ) (Thm 4.3(2), corrected).

    ``min(d²/((1−2/k)σ_min) [k > 2], k d²/(2(k−1)σ_min))`` for the symmetric H = θᵀKθ (or its
    :class:`SpectrumInfo`); at the second, σ_min reaches 0.
    """
    info = _spec(H, "H")
    s, k = info.sigma, info.rank
    d = r_ill_denominator(s, k, float(np.sum(s * s)))
    smin = s[k - 1]
    b2 = k * d**2 / (2 * (k - 1) * smin)
    b1 = d**2 / ((1 - 2 / k) * smin) if k > 2 else np.inf
    return float(min(b1, b2))
