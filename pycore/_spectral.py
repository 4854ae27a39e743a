"""Spectra of matrices and of Gram matrices in float64 (docs/theory.md §2).

κ is over the NONZERO spectrum (paper Eq. (1)) with numpy's ``matrix_rank`` cut-off.  A Gram matrix
``H = ZᵀZ`` goes through the SVD of ``Z`` (eigenvalues ``s²``, accurate to ``eps·√κ(H)`` where
``eigvalsh(H)`` resolves only ``eps·λ_max``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import scipy.linalg.lapack

from pycore._validation import ParameterError, as_float_matrix, check_number

EPS = np.finfo(np.float64).eps

# Tie rule of docs/theory.md §3: a gap below √eps relative to the extreme value (σ_min: also below
# the rank tolerance) makes the regularizer gradient undefined.
TIE_RTOL = float(np.sqrt(EPS))

# Entries beyond which S is decomposed as S/max|S| (~√ of the float64 limits, where squares and
# LAPACK's norms over/underflow); singular values scale exactly with S.
_BIG = 1e150

# A product θᵀKθ is symmetric to ≲ D·eps ≈ 1e-12 relative: √eps leaves 4 orders of margin and still
# refuses a matrix not meant to be symmetric; within it ½(S + Sᵀ) moves no eigenvalue measurably.
SYMMETRY_RTOL = TIE_RTOL


class SpectrumError(ValueError):
    """A spectrum-dependent quantity is undefined for this input (zero matrix, κ = 1, ...)."""


@dataclass(frozen=True)
class SpectrumInfo:
    """Nonzero-spectrum summary.

    ``sigma`` all singular values (descending), ``rank`` of them above ``tol``; ``gap_max = σ₁ −
    σ₂``, ``gap_min = σ_{k−1} − σ_k`` (inf without a neighbour) and the tie flags of docs/theory.md
    §3; ``vectors`` the matching right singular vectors / eigenvectors.
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
    vectors: np.ndarray | None = None


def rank_tolerance(sigma_max: float, shape: tuple[int, ...], rtol: float | None = None) -> float:
    """The cut-off below which a singular value counts as zero (docs/theory.md §2).

    ``σ_max·max(shape)·eps``, or ``σ_max·rtol`` with ``rtol`` in [0, 1) (NaN would keep no value,
    rtol ≥ 1 would cut σ_max).

    Parameters
    ----------
    sigma_max : float
        The largest singular value.
    shape : tuple of int
        The matrix's shape.
    rtol : float, optional
        A relative tolerance in [0, 1) in place of ``max(shape)·eps``.

    Returns
    -------
    float
        The cut-off.

    Raises
    ------
    ParameterError
        ``rtol`` outside [0, 1) (``.parameter`` is ``"rtol"``).
    """
    rtol = (
        max(shape) * EPS
        if rtol is None
        else check_number(rtol, "rtol", low=0.0, high=1.0, high_open=True)
    )
    return float(sigma_max) * float(rtol)


def numerical_rank(s: np.ndarray, shape) -> int:
    """How many of the descending singular values of a matrix pass :func:`rank_tolerance`.

    ``s`` descending, of a ``shape`` matrix.
    """
    return int(np.count_nonzero(s > rank_tolerance(s[0], shape)))


def summarise(
    sigma: np.ndarray, shape, rtol, vectors=None, *, what: str = "matrix"
) -> SpectrumInfo:
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
        sigma=sigma,
        rank=k,
        tol=tol,
        sigma_max=smax,
        sigma_min=smin,
        kappa=smax / smin,
        gap_max=gap_max,
        gap_min=gap_min,
        tie_max=bool(k >= 2 and gap_max <= TIE_RTOL * smax),
        tie_min=bool(k >= 2 and gap_min <= max(TIE_RTOL * smin, tol)),
        vectors=vectors,
    )


def is_symmetric(S: np.ndarray, rtol: float = 1e3 * EPS) -> bool:
    """``‖S − Sᵀ‖_max ≤ rtol·‖S‖_max`` (default: the round-off of a product θᵀKθ)."""
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        return False
    scale = float(np.max(np.abs(S))) if S.size else 0.0
    return bool(np.max(np.abs(S - S.T), initial=0.0) <= rtol * scale)


def check_symmetric(S, name: str) -> np.ndarray:
    """``½(S + Sᵀ)`` of an ``S`` symmetric within :data:`SYMMETRY_RTOL`, else a ParameterError."""
    S = as_float_matrix(S, name)
    if not is_symmetric(S, SYMMETRY_RTOL):
        gap = (
            f", max|{name} − {name}ᵀ| = {np.max(np.abs(S - S.T)):.3e}"
            if S.shape[0] == S.shape[1]
            else ""
        )
        raise ParameterError(name, f"{name} must be a symmetric matrix, got shape {S.shape}{gap}")
    return 0.5 * (S + S.T)


def scale_of(S: np.ndarray, big: float = _BIG) -> float | None:
    """max|S| when S must be decomposed as S/max|S|, else None.

    S must be when max|S| lies beyond ``big`` or below ``1/big``.
    """
    scale = float(np.max(np.abs(S)))
    return scale if scale > big or 0.0 < scale < 1 / big else None


def singular_parts(S: np.ndarray, vectors: bool = True):
    """``(σ descending, U, V)`` of ``S`` (U, V None unless ``vectors``).

    ``|λ|`` from ``eigh`` when S is symmetric (then ``u_i = sign(λ_i) v_i``), else the SVD.
    """
    if is_symmetric(S):
        S = 0.5 * (S + S.T)
        if not vectors:
            lam = np.linalg.eigvalsh(S)
            return np.abs(lam)[np.argsort(-np.abs(lam), kind="stable")], None, None
        lam, V = np.linalg.eigh(S)
        order = np.argsort(-np.abs(lam), kind="stable")
        lam, V = lam[order], V[:, order]
        return np.abs(lam), V * np.where(lam < 0, -1.0, 1.0), V
    if not vectors:
        return np.linalg.svd(S, compute_uv=False), None, None
    U, s, Vt = np.linalg.svd(S, full_matrices=False)
    return s, U, Vt.T


def spectrum_info(
    S, *, rtol: float | None = None, vectors: bool = False, name: str = "S"
) -> SpectrumInfo:
    """The singular values of a matrix, its rank, ties and (``vectors``) right singular vectors.

    Symmetric S from ``eigh`` (``|λ|``), any other from the SVD; entries near the float64 limits
    are decomposed as S/max|S|.

    Parameters
    ----------
    S : array_like, shape (m, n)
        A real finite matrix.
    rtol : float, optional
        The rank cut-off relative to σ_max, in [0, 1) (:func:`rank_tolerance`).
    vectors : bool, default False
        Also the right singular vectors (eigenvectors).
    name : str, default "S"
        The argument's name in errors.

    Returns
    -------
    SpectrumInfo
        ``sigma`` (descending), ``rank``, ``kappa``, the gaps and tie flags of docs/theory.md §3,
        and ``vectors``.

    Raises
    ------
    ValueError
        ``S`` not a finite real 2-D array (the message names it).
    ParameterError
        ``rtol`` out of bounds.
    SpectrumError
        S = 0, or σ_max overflows float64.
    """
    S = as_float_matrix(S, name)
    check_number(rtol, "rtol", low=0.0, high=1.0, high_open=True, none_ok=True)
    scale = scale_of(S) or 1.0  # singular values scale exactly with S
    sigma, _, V = singular_parts(S / scale if scale != 1.0 else S, vectors)
    with np.errstate(over="ignore", under="ignore"):
        unscaled = sigma * scale if scale != 1.0 else sigma
    if not np.isfinite(unscaled[0]):
        raise SpectrumError(
            f"{name}'s largest singular value ({sigma[0]:.6g} × {scale:.6g}) overflows "
            "float64; rescale it"
        )
    return summarise(unscaled, S.shape, rtol, V, what=name)


def condition_number(S, *, rtol: float | None = None) -> float:
    """κ(S) = σ_max/σ_min over the nonzero spectrum (paper Eq. (1)).

    Parameters
    ----------
    S : array_like, shape (m, n)
        The matrix, real and finite.
    rtol : float, optional
        Singular values below ``rtol·σ_max`` count as zero, ``rtol`` in [0, 1); default the rank
        rule of docs/theory.md §2 (``pycore._spectral.rank_tolerance``).

    Returns
    -------
    float
        κ(S) ≥ 1.

    Raises
    ------
    ValueError
        ``S`` not a finite real 2-D array (the message names ``S``).
    ParameterError
        ``rtol`` out of bounds.
    SpectrumError
        S = 0, or σ_max overflows float64.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import condition_number
    >>> condition_number(np.diag([4.0, 2.0, 0.0]))  # over the nonzero spectrum
    2.0
    """
    return spectrum_info(S, rtol=rtol).kappa


_SQRT_MAX = float(np.sqrt(np.finfo(np.float64).max))
_SQRT_TINY = float(np.sqrt(np.finfo(np.float64).tiny))


def gram_spectrum(
    Z, *, rtol: float | None = None, vectors: bool = True, name: str = "Z"
) -> SpectrumInfo:
    """The spectrum of ``H = ZᵀZ`` from the SVD of ``Z``.

    Eigenvalues ``s²``, eigenvectors ``V``, the rank cut-off applied to ``s`` with Z's shape
    (docs/theory.md §2): accurate where forming H is not (κ(H) = 1e14 to ~1e-8).

    Parameters
    ----------
    Z : array_like, shape (N, D)
        The features.
    rtol : float, optional
        The rank cut-off relative to σ_max, in [0, 1).
    vectors : bool, default True
        Also the eigenvectors of H.
    name : str, default "Z"
        The argument's name in errors.

    Returns
    -------
    SpectrumInfo
        The eigenvalues of H (descending), its rank, ``kappa`` = κ(H), gaps, ties, eigenvectors.

    Raises
    ------
    ValueError
        ``Z`` not a finite real 2-D array.
    ParameterError
        ``rtol`` out of bounds.
    SpectrumError
        Z = 0 (H has no condition number), or a spectrum outside float64.
    """
    Z = as_float_matrix(Z, name)
    if vectors:
        _, s, Vt = np.linalg.svd(Z, full_matrices=False)
        return _gram_info(s, Vt.T, Z.shape, rtol, name)
    return _gram_info(np.linalg.svd(Z, compute_uv=False), None, Z.shape, rtol, name)


def _gram_info(s, V, shape, rtol, name) -> SpectrumInfo:
    """:class:`SpectrumInfo` of ``ZᵀZ`` from the singular values ``s`` of a ``shape`` matrix Z."""
    if not (s.size and s[0] > 0.0):
        raise SpectrumError(f"{name} is zero: the condition number of {name}ᵀ{name} is undefined")
    info_z = summarise(s, shape, rtol, what=name)
    k = info_z.rank
    if not (s[0] < _SQRT_MAX and s[k - 1] > _SQRT_TINY):
        raise SpectrumError(
            f"the singular values of {name} ({s[0]:.3e} … {s[k - 1]:.3e}) square outside "
            f"float64's range: the eigenvalues of {name}ᵀ{name} cannot be represented; "
            f"rescale {name}"
        )
    lam = s * s
    gaps = (float(lam[0] - lam[1]), float(lam[k - 2] - lam[k - 1])) if k >= 2 else (np.inf, np.inf)
    return SpectrumInfo(
        lam,
        k,
        info_z.tol**2,
        float(lam[0]),
        float(lam[k - 1]),
        float(lam[0] / lam[k - 1]),
        *gaps,
        info_z.tie_max,
        info_z.tie_min,
        V,
    )


class ProductGramSpectrum:
    """Spectra of ``(Xθ)ᵀ(Xθ)`` for ONE X and many θ.

    As accurate as :func:`gram_spectrum` of ``Xθ``: for tall X, ``X = QR`` once and ``Xθ = Q(Rθ)``
    has the singular values of the D×D ``Rθ`` (to ~eps‖X‖‖θ‖, the rounding of ``Xθ`` itself); the
    rank cut-off uses X's shape.
    """

    def __init__(self, X, name: str = "Z"):
        X = as_float_matrix(X, "X")
        self.X, self.shape, self.name = X, X.shape, name
        self.R = np.linalg.qr(X, mode="r") if X.shape[0] > X.shape[1] else None

    def __call__(self, theta: np.ndarray) -> SpectrumInfo:  # θ finite D×D, not re-validated
        F = self.X @ theta if self.R is None else self.R @ theta
        return _gram_info(np.linalg.svd(F, compute_uv=False), None, self.shape, None, self.name)


@dataclass(frozen=True, eq=False)
class RowFactor:
    """``X ≈ U diag(s) Vᵀ`` over the singular values K = XᵀX's rank rule keeps.

    ``X ≈ U diag(s) Vᵀ`` over the ``r`` singular values with ``s² > rank_tolerance(s₁², (D,))``
    (the rank rule of ``K = XᵀX``, docs/theory.md §2), computed once per data matrix.

    ``A = diag(s) Vᵀ`` (r×D) gives the small side of every Gram matrix of the features: ``Xθ =
    U(Aθ)``, so ``(Xθ)ᵀ(Xθ) = FᵀF`` and its nonzero spectrum is that of the r×r ``FFᵀ``, ``F =
    Aθ`` (docs/design.md §6); ``K = V diag(s²) Vᵀ``.  ``V``'s rows at the columns of X that are
    exactly zero (``live`` False) are set to exact zeros: LAPACK leaves ~1e-16 there, which Adam
    turns into full-size steps of kernel-dependent sign (docs/design.md §7).
    """

    U: np.ndarray  # N×r
    s: np.ndarray  # r, descending
    V: np.ndarray  # D×r
    A: np.ndarray  # r×D, diag(s) Vᵀ
    live: np.ndarray  # D booleans: the columns of X that are not all zero
    shape: tuple[int, int]

    @classmethod
    def of(cls, X: np.ndarray) -> RowFactor:
        X = as_float_matrix(X, "X")
        U, s, Vt = np.linalg.svd(X, full_matrices=False)
        r = int(np.count_nonzero(s * s > rank_tolerance(s[0] ** 2, (X.shape[1],)))) if s[0] else 0
        live = np.any(X != 0, axis=0)
        V = Vt[:r].T.copy()
        V[~live] = 0.0
        U, s = U[:, :r].copy(), s[:r].copy()
        A = np.ascontiguousarray(s[:, None] * V.T)
        for a in (U, s, V, A, live):
            a.setflags(write=False)
        return cls(U, s, V, A, live, X.shape)

    @property
    def rank(self) -> int:
        return self.s.size

    @functools.cached_property
    def _live_A(self):
        # A on the live columns only when enough columns are dead to pay for the copy of θ's live
        # rows that the product then needs (at D = 784, from ~40% dead on)
        idx = np.flatnonzero(self.live)
        if idx.size >= 0.6 * self.live.size:
            return None
        return idx, np.ascontiguousarray(self.A[:, idx])

    def restricted(self, cols) -> RowFactor:
        """The factor of ``X[:, cols]`` (the same U and s when X is zero off ``cols``)."""
        out = RowFactor(
            self.U,
            self.s,
            self.V[cols],
            np.ascontiguousarray(self.A[:, cols]),
            self.live[cols],
            (self.shape[0], len(cols)),
        )
        for a in (out.V, out.A, out.live):
            a.setflags(write=False)
        return out

    def features(self, theta: np.ndarray) -> np.ndarray:
        """``F = Aθ`` for one θ (D×D) or a stack (B×D×D).

        ``Xθ = UF``.  A's columns at X's zero columns are exact zeros, so only θ's rows at the live
        columns are read.
        """
        live = self._live_A
        if live is None:
            return self.A @ theta
        idx, A = live
        return A @ theta[..., idx, :]


@functools.cache
def _evr_workspace(n: int) -> tuple[int, int]:
    """(lwork, liwork) that ``scipy.linalg.eigh(driver="evr")`` passes to LAPACK ``dsyevr``."""
    lwork, liwork, _ = scipy.linalg.lapack.dsyevr_lwork(n, lower=1)
    return int(lwork), int(liwork)


# dsyevr rescales a matrix whose largest entry is outside ~[1e-146, 8e76] before reducing it; the
# shared reduction below does not, so it hands such matrices to scipy (generous margins).
_EVR_SAFE_LOW, _EVR_SAFE_HIGH = 1e-140, 1e70


class SymmetricEigen:
    """All eigenvalues of a symmetric matrix and any of its eigenvectors from ONE reduction.

    ``eigh(H, driver="evr")`` redoes ``dsytrd``, the O(n³) part, every call; this class makes
    dsyevr's own LAPACK calls with its workspace sizes once, so ``values`` (``dsterf``, ascending)
    and :meth:`vector` are bit for bit those of separate ``eigh`` calls (a test checks it).
    Matrices dsyevr would rescale, size 1 or a LAPACK failure go through ``scipy.linalg.eigh``
    itself.
    """

    __slots__ = ("_H", "_c", "_d", "_e", "_tau", "_lwork", "values")

    def __init__(self, H: np.ndarray, *, symmetric: bool = False):
        self._H, self._c = H, None
        n = H.shape[0]
        anrm = float(np.max(np.abs(H))) if n else 0.0
        if n >= 2 and _EVR_SAFE_LOW < anrm < _EVR_SAFE_HIGH:
            lwork, _ = _evr_workspace(n)
            # dsyevr hands dsytrd the workspace after its 5n of bookkeeping.  An exactly symmetric
            # C-ordered H (``symmetric``: the caller formed it with syrk, as numpy does ZᵀZ and
            # FFᵀ) goes in as its Fortran-ordered transpose, the same matrix that f2py would
            # otherwise copy: 30% faster at n = 73
            flip = (
                H.flags.c_contiguous
                and not H.flags.f_contiguous
                and (symmetric or np.array_equal(H, H.T))
            )
            Hf = H.T if flip else H
            c, d, e, tau, info = scipy.linalg.lapack.dsytrd(Hf, lower=1, lwork=lwork - 5 * n)
            if info == 0:
                w, info = scipy.linalg.lapack.dsterf(d, e)
                if info == 0:
                    self._c, self._d, self._e, self._tau, self._lwork = c, d, e, tau, lwork
                    self.values = w
                    return
        self.values = scipy.linalg.eigh(H, eigvals_only=True, driver="evr", check_finite=False)

    def vector_at_value(self, j: int) -> np.ndarray:
        """Unit eigenvector for the j-th smallest eigenvalue by inverse iteration.

        ``dstein`` at the ``dsterf`` eigenvalue already in :attr:`values`, without dsyevr's
        bisection (``dstebz``) for it: half the cost of :meth:`vector`, equal to it to round-off
        (both eigenvalues are accurate to eps·‖H‖).
        """
        if self._c is not None:
            n = self._d.size
            iblock, isplit = np.ones(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
            isplit[0] = n  # one block: dstein iterates on the whole tridiagonal
            w = np.zeros(n)
            w[0] = self.values[j]
            v = self._vector_at(w[:1], iblock, isplit)
            if v is not None:
                return v
        return self.vector(j)

    def vector(self, j: int) -> np.ndarray:
        """Unit eigenvector for the j-th smallest eigenvalue (0-based, ascending)."""
        if self._c is not None:
            # range "I" (3) for one index, order "B" (by block), abstol 0: dsyevr's call for a
            # vector
            m, w, iblock, isplit, info = scipy.linalg.lapack.dstebz(
                self._d, self._e, 3, 0.0, 1.0, j + 1, j + 1, 0.0, b"B"
            )
            if info == 0 and m == 1:
                v = self._vector_at(w[:1], iblock, isplit)
                if v is not None:
                    return v
        _, v = scipy.linalg.eigh(self._H, subset_by_index=[j, j], driver="evr", check_finite=False)
        return v[:, 0]

    def _vector_at(self, w, iblock, isplit) -> np.ndarray | None:
        """The eigenvector of H at the eigenvalue ``w[0]``.

        Inverse iteration on the tridiagonal (``dstein``), then back to H's basis by dsyevr's own
        ``dormtr`` (lower), which is ``dormqr`` on rows 2..n with the reflectors below the
        subdiagonal and the workspace dsyevr passes it (lwork − 2n). None where LAPACK reports a
        failure.
        """
        n, lapack = self._d.size, scipy.linalg.lapack
        z, info = lapack.dstein(self._d, self._e, w, iblock, isplit)
        if info != 0:
            return None
        cq, _, info = lapack.dormqr(
            b"L", b"N", self._c[1:, : n - 1], self._tau, z[1:, :], self._lwork - 2 * n
        )
        return np.concatenate([z[:1, 0], cq[:, 0]]) if info == 0 else None
