"""Spectra of symmetric PSD matrices and of Gram matrices, in float64 (docs/theory.md §2).

The condition number is taken over the NONZERO spectrum, ``κ(S) = ‖S‖₂‖S†‖₂`` (paper Eq. (1)),
because the matrices of this project are rank-deficient as a rule (constant columns of a
tabular split, always-zero MNIST pixels, N < D batches).  The numerical rank uses the tolerance
of ``numpy.linalg.matrix_rank``: ``σ_max · max(shape) · eps`` unless ``rtol`` is given, and is
always reported next to κ.

Two entry points:

* :func:`spectrum_info` / :func:`condition_number` for an explicit matrix ``S``; a symmetric
  matrix goes through ``eigh`` (its singular values are ``|λ|``), anything else through SVD.
* :func:`gram_spectrum` for ``H = ZᵀZ`` given the features ``Z``.  The SVD of ``Z`` gives the
  eigenvalues of ``H`` as ``s²`` with relative accuracy ``~eps·κ(Z) = eps·√κ(H)``, whereas
  ``eigvalsh(H)`` only resolves eigenvalues above ``eps·λ_max``: for the κ(H) ~ 1e10-1e12 that
  immunization produces, forming ``H`` first would lose most digits of ``λ_min``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import scipy.linalg.lapack

from pycore.validation import as_float_matrix, check_number

EPS = np.finfo(np.float64).eps

# A tie between the extreme and the next singular value makes R_ill/R_well non-differentiable.
# A NEAR-tie is a gap below sqrt(eps) relative to the extreme value itself (σ_max for R_well,
# σ_min for R_ill): there the gradient swings between the two singular vectors.  For σ_min the
# gap is also a tie when it is below the rank tolerance, where the two computed values cannot
# be told apart.  (Measuring the σ_min gap against σ_max instead would flag every step of an
# ill-conditioned matrix, whose small singular values all lie within sqrt(eps)·σ_max.)
TIE_RTOL = float(np.sqrt(EPS))


# Entry magnitudes beyond which spectrum_info rescales S before decomposing it (far from any
# matrix of this project; ~sqrt of the float64 limits, where squares over/underflow).
_BIG, _SMALL = 1e150, 1e-150


class SpectrumError(ValueError):
    """A spectrum-dependent quantity is undefined for this input (zero matrix, κ = 1, ...)."""


@dataclass(frozen=True)
class SpectrumInfo:
    """Nonzero-spectrum summary of a matrix (singular values, descending).

    ``sigma`` holds all singular values; ``rank`` of them are above ``tol``.  ``gap_max`` is
    ``σ₁ − σ₂`` and ``gap_min`` is ``σ_{k−1} − σ_k`` (``inf`` when there is no neighbour);
    ``tie_max`` / ``tie_min`` flag a near-tie, where the regularizers of docs/theory.md §3 are not
    differentiable: ``gap_max ≤ TIE_RTOL·σ_max`` and ``gap_min ≤ max(TIE_RTOL·σ_min, tol)``.
    """

    sigma: np.ndarray
    rank: int
    tol: float
    sigma_max: float
    sigma_min: float
    kappa: float
    gap_max: float
    gap_min: float
    tie_max: bool
    tie_min: bool
    vectors: np.ndarray | None = None  # right singular vectors / eigenvectors, columns, same order

    def as_dict(self) -> dict:
        return {
            "sigma_max": self.sigma_max, "sigma_min": self.sigma_min, "kappa": self.kappa,
            "rank": self.rank, "size": int(self.sigma.size), "tol": self.tol,
            "gap_max": self.gap_max, "gap_min": self.gap_min,
            "tie_max": self.tie_max, "tie_min": self.tie_min,
        }


def rank_tolerance(sigma_max: float, shape: tuple[int, ...], rtol: float | None = None) -> float:
    """Absolute cut-off below which a singular value counts as zero (numpy ``matrix_rank``).

    ``rtol`` must be a finite number in [0, 1): NaN would count no singular value as nonzero
    and rtol ≥ 1 would cut σ_max itself.
    """
    if rtol is None:
        rtol = max(shape) * EPS
    else:
        rtol = check_number(rtol, "rtol", low=0.0, high=1.0, high_open=True)
    return float(sigma_max) * float(rtol)


def _summarise(sigma: np.ndarray, shape, rtol, vectors=None, *, what: str = "matrix") -> SpectrumInfo:
    sigma = np.asarray(sigma, dtype=np.float64)
    smax = float(sigma[0]) if sigma.size else 0.0
    if not smax > 0.0:
        raise SpectrumError(f"{what} is zero: its condition number is undefined")
    tol = rank_tolerance(smax, shape, rtol)
    k = int(np.count_nonzero(sigma > tol))
    smin = float(sigma[k - 1])
    gap_max = float(sigma[0] - sigma[1]) if k >= 2 else np.inf
    gap_min = float(sigma[k - 2] - sigma[k - 1]) if k >= 2 else np.inf
    return SpectrumInfo(
        sigma=sigma, rank=k, tol=tol, sigma_max=smax, sigma_min=smin, kappa=smax / smin,
        gap_max=gap_max, gap_min=gap_min,
        tie_max=bool(k >= 2 and gap_max <= TIE_RTOL * smax),
        tie_min=bool(k >= 2 and gap_min <= max(TIE_RTOL * smin, tol)),
        vectors=vectors,
    )


def is_symmetric(S: np.ndarray) -> bool:
    """Exact-enough symmetry: ``‖S − Sᵀ‖_max ≤ 1e3·eps·‖S‖_max`` (round-off of a product θᵀKθ)."""
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        return False
    scale = float(np.max(np.abs(S))) if S.size else 0.0
    return bool(np.max(np.abs(S - S.T), initial=0.0) <= 1e3 * EPS * scale)


def spectrum_info(S, *, rtol: float | None = None, vectors: bool = False, name: str = "S") -> SpectrumInfo:
    """Singular values of ``S`` (``eigh`` when symmetric, SVD otherwise) with rank and ties.

    For symmetric ``S`` the singular values are ``|λ|`` and ``vectors`` (if asked) are the
    matching eigenvectors; for general ``S`` they are the right singular vectors.
    """
    S = as_float_matrix(S, name)
    if rtol is not None:
        check_number(rtol, "rtol", low=0.0, high=1.0, high_open=True)
    scale = float(np.max(np.abs(S)))
    if scale > _BIG or 0.0 < scale < _SMALL:
        # Entries near the float64 limits overflow (S + Sᵀ, LAPACK's norms) or underflow on the
        # way; singular values scale exactly with S and κ does not change, so decompose S/scale.
        info = spectrum_info(S / scale, rtol=rtol, vectors=vectors, name=name)
        with np.errstate(over="ignore", under="ignore"):
            sigma = info.sigma * scale
        if not np.isfinite(sigma[0]):
            raise SpectrumError(f"{name}'s largest singular value ({info.sigma[0]:.6g} × {scale:.6g}) "
                                "overflows float64; rescale it")
        return _summarise(sigma, S.shape, rtol, info.vectors, what=name)
    if is_symmetric(S):
        S = 0.5 * (S + S.T)
        if vectors:
            lam, V = np.linalg.eigh(S)
        else:
            lam, V = np.linalg.eigvalsh(S), None
        order = np.argsort(-np.abs(lam), kind="stable")
        sigma = np.abs(lam)[order]
        V = V[:, order] if V is not None else None
    elif vectors:
        _, sigma, Vt = np.linalg.svd(S, full_matrices=False)
        V = Vt.T
    else:
        sigma, V = np.linalg.svd(S, compute_uv=False), None
    return _summarise(sigma, S.shape, rtol, V, what=name)


def condition_number(S, *, rtol: float | None = None) -> float:
    """κ(S) = σ_max / σ_min over the nonzero spectrum (docs/theory.md §2, paper Eq. (1)).

    Raises :class:`SpectrumError` for the zero matrix.  Use :func:`spectrum_info` to also get
    the numerical rank and the tie flags.
    """
    return spectrum_info(S, rtol=rtol).kappa


_SQRT_MAX = float(np.sqrt(np.finfo(np.float64).max))
_SQRT_TINY = float(np.sqrt(np.finfo(np.float64).tiny))


def gram_spectrum(Z, *, rtol: float | None = None, vectors: bool = True, name: str = "Z") -> SpectrumInfo:
    """Spectrum of ``H = ZᵀZ`` from the SVD of ``Z`` (eigenvalues ``s²``, eigenvectors ``V``).

    The rank cut-off is applied to the singular values of ``Z`` (tolerance as in
    :func:`rank_tolerance` for ``Z``'s shape), then squared; see the module docstring for why.
    """
    Z = as_float_matrix(Z, name)
    if vectors:
        _, s, Vt = np.linalg.svd(Z, full_matrices=False)
        V = Vt.T
    else:
        s, V = np.linalg.svd(Z, compute_uv=False), None
    return _gram_info(s, V, Z.shape, rtol, name)


def _gram_info(s, V, shape, rtol, name) -> SpectrumInfo:
    """:class:`SpectrumInfo` of ``ZᵀZ`` from the singular values ``s`` of a ``shape`` matrix Z."""
    if not (s.size and s[0] > 0.0):
        raise SpectrumError(f"{name} is zero: the condition number of {name}ᵀ{name} is undefined")
    info_z = _summarise(s, shape, rtol, what=name)
    k = info_z.rank
    if not (s[0] < _SQRT_MAX and s[k - 1] > _SQRT_TINY):
        raise SpectrumError(
            f"the singular values of {name} ({s[0]:.3e} … {s[k - 1]:.3e}) square outside float64's range: "
            f"the eigenvalues of {name}ᵀ{name} cannot be represented; rescale {name}")
    lam = s * s
    tol = info_z.tol ** 2
    return SpectrumInfo(
        sigma=lam, rank=k, tol=tol, sigma_max=float(lam[0]), sigma_min=float(lam[k - 1]),
        kappa=float(lam[0] / lam[k - 1]),
        gap_max=float(lam[0] - lam[1]) if k >= 2 else np.inf,
        gap_min=float(lam[k - 2] - lam[k - 1]) if k >= 2 else np.inf,
        tie_max=info_z.tie_max, tie_min=info_z.tie_min, vectors=V,
    )


class ProductGramSpectrum:
    """Spectra of ``H(θ) = (Xθ)ᵀ(Xθ)`` for ONE data matrix X and many θ (the per-step κ's of a
    run), as accurate as :func:`gram_spectrum` of the features ``Xθ``.

    For tall X (N > D rows) the thin QR ``X = QR`` is taken once; Q has orthonormal columns, so
    ``Xθ = Q(Rθ)`` has the singular values of the D×D matrix ``Rθ``, whose SVD skips the QR step
    that LAPACK's SVD of the N×D ``Xθ`` repeats every time (``gesdd`` factors a tall matrix
    first).  Accuracy: the computed R is the exact factor of ``X + δX`` with ‖δX‖ ~ eps‖X‖, so
    the singular values are those of ``Xθ`` up to ~eps‖X‖‖θ‖, the same bound as the rounding
    of forming ``Xθ`` itself; κ is as accurate as from the SVD of ``Xθ`` (a test checks it at
    κ(H) = 1e14).  The rank cut-off uses X's shape (N×D), the rule of :func:`gram_spectrum`.
    Wide or square X: the SVD of ``Xθ`` itself.
    """

    def __init__(self, X, name: str = "Z"):
        X = as_float_matrix(X, "X")
        self.X, self.shape, self.name = X, X.shape, name
        self.R = np.linalg.qr(X, mode="r") if X.shape[0] > X.shape[1] else None

    def __call__(self, theta: np.ndarray) -> SpectrumInfo:
        """Eigenvalues of ``(Xθ)ᵀ(Xθ)`` (no vectors) for a finite D×D θ (not re-validated)."""
        F = self.X @ theta if self.R is None else self.R @ theta
        return _gram_info(np.linalg.svd(F, compute_uv=False), None, self.shape, None, self.name)


def gram_condition_number(Z, *, rtol: float | None = None) -> float:
    """κ(ZᵀZ) over the nonzero spectrum, computed as κ(Z)² (see :func:`gram_spectrum`)."""
    return gram_spectrum(Z, rtol=rtol, vectors=False).kappa


@functools.lru_cache(maxsize=None)
def _evr_workspace(n: int) -> tuple[int, int]:
    """(lwork, liwork) that ``scipy.linalg.eigh(driver="evr")`` passes to LAPACK ``dsyevr``."""
    lwork, liwork, _ = scipy.linalg.lapack.dsyevr_lwork(n, lower=1)
    return int(lwork), int(liwork)


# dsyevr rescales a matrix whose largest entry lies outside [RMIN, RMAX] before reducing it
# (RMIN = sqrt(safe_min/eps), RMAX = min(sqrt(big), safe_min^(-1/4)) ≈ 1e-146 and 8e76); the
# shared reduction below does not, so it hands such matrices to scipy (generous margins).
_EVR_SAFE_LOW, _EVR_SAFE_HIGH = 1e-140, 1e70


class SymmetricEigen:
    """All eigenvalues of a symmetric matrix and any of its eigenvectors, from ONE reduction.

    ``scipy.linalg.eigh(H, eigvals_only=True, driver="evr")`` and each
    ``eigh(H, subset_by_index=[j, j], driver="evr")`` run LAPACK ``dsyevr``, which reduces H
    to tridiagonal form (``dsytrd``, the O(n³) part) on every call, then takes the eigenvalues
    from the tridiagonal matrix (``dsterf``) or one eigenpair (``dstebz`` bisection, ``dstein``
    inverse iteration, ``dormtr`` back-transformation).  This class makes the same LAPACK calls
    with the same workspace sizes (so the same blocking), but the reduction once: ``values``
    and every :meth:`vector` are bit-for-bit those of the separate ``eigh`` calls (a test
    checks it), at the cost of one reduction instead of one per call.  Matrices dsyevr would
    rescale first (entries beyond ~1e70 or below ~1e-140), size 1, or any LAPACK failure go
    through ``scipy.linalg.eigh`` itself.  ``values`` are ascending (LAPACK order);
    :meth:`vector` takes an ascending index.
    """

    __slots__ = ("_H", "_c", "_d", "_e", "_tau", "_lwork", "values")

    def __init__(self, H: np.ndarray):
        self._H = H
        self._c = None
        n = H.shape[0]
        anrm = float(np.max(np.abs(H))) if n else 0.0
        if n >= 2 and _EVR_SAFE_LOW < anrm < _EVR_SAFE_HIGH:
            lwork, _ = _evr_workspace(n)
            # dsyevr hands dsytrd the workspace after its 5n of bookkeeping
            c, d, e, tau, info = scipy.linalg.lapack.dsytrd(H, lower=1, lwork=lwork - 5 * n)
            if info == 0:
                w, info = scipy.linalg.lapack.dsterf(d, e)
                if info == 0:
                    self._c, self._d, self._e, self._tau, self._lwork = c, d, e, tau, lwork
                    self.values = w
                    return
        self.values = scipy.linalg.eigh(H, eigvals_only=True, driver="evr", check_finite=False)

    def vector(self, j: int) -> np.ndarray:
        """Unit eigenvector for the j-th smallest eigenvalue (0-based, ascending)."""
        if self._c is not None:
            n = self._d.size
            lapack = scipy.linalg.lapack
            # range "I" (3) for one index, order "B" (by block), abstol 0: dsyevr's call for a vector
            m, w, iblock, isplit, info = lapack.dstebz(self._d, self._e, 3, 0.0, 1.0, j + 1, j + 1, 0.0, b"B")
            if info == 0 and m == 1:
                z, info = lapack.dstein(self._d, self._e, w[:1], iblock, isplit)
                if info == 0:
                    # dormtr (lower) = dormqr on rows 2..n with the reflectors below the subdiagonal,
                    # with the workspace dsyevr passes it (lwork − 2n)
                    cq, _, info = lapack.dormqr(b"L", b"N", self._c[1:, :n - 1], self._tau, z[1:, :],
                                                self._lwork - 2 * n)
                    if info == 0:
                        return np.concatenate([z[:1, 0], cq[:, 0]])
        _, v = scipy.linalg.eigh(self._H, subset_by_index=[j, j], driver="evr", check_finite=False)
        return v[:, 0]


def extreme_eigenpair(S, which: str = "max") -> tuple[float, np.ndarray]:
    """Largest (``"max"``) or smallest (``"min"``) eigenpair of a symmetric matrix.

    Uses LAPACK's ``evr`` on a one-index subset, which skips the other eigenvectors (about 3×
    cheaper than a full ``eigh`` at n≈800).  Note: ``"min"`` is the smallest eigenvalue, zero
    included; the smallest NONZERO one needs the rank, which :func:`spectrum_info` provides.
    """
    S = as_float_matrix(S, "S")
    if not is_symmetric(S):
        raise ValueError(f"extreme_eigenpair needs a symmetric matrix, "
                         f"got shape {S.shape} that is not symmetric")
    n = S.shape[0]
    idx = n - 1 if which == "max" else 0
    if which not in ("max", "min"):
        raise ValueError(f"which must be 'max' or 'min', got {which!r}")
    w, v = scipy.linalg.eigh(S, subset_by_index=[idx, idx], driver="evr", check_finite=False)
    return float(w[0]), v[:, 0]
