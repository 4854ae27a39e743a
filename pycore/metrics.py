"""Immunization metrics: RIR (paper Eq. (15)), its ceiling (docs/theory.md §10), RIR_θ₀ by group sampling.

Every condition number of a Hessian ``H = θᵀXᵀXθ`` is computed as ``κ(Xθ)²`` from the SVD of
the features (see :mod:`pycore.spectral`): RIR multiplies and divides four condition numbers
that reach 1e10 and more, and forming ``H`` first would leave only a few correct digits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycore.spectral import gram_spectrum, rank_tolerance
from pycore.threads import bounded_blas
from pycore.validation import as_float_matrix, check_dense_size, check_number, check_theta


@dataclass(frozen=True)
class RIR:
    """Relative immunization ratio and its two factors (docs/theory.md §8).

    ``harmful_ratio`` = κ(H_H(θ))/κ(H_H(θ_ref)) (i, ↑), ``pretrain_ratio`` =
    κ(H_P(θ))/κ(H_P(θ_ref)) (ii, ↓), ``value`` = (i)/(ii) (↑).  ``float(r)`` is the RIR.
    """

    value: float
    harmful_ratio: float
    pretrain_ratio: float
    kappa_H: float
    kappa_P: float
    kappa_H_ref: float
    kappa_P_ref: float
    rank_H: int
    rank_P: int

    def __float__(self) -> float:
        return self.value

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _check_pair(X_P, X_H):
    X_P = as_float_matrix(X_P, "X_P")
    X_H = as_float_matrix(X_H, "X_H")
    if X_P.shape[1] != X_H.shape[1]:
        raise ValueError(f"X_P has {X_P.shape[1]} columns but X_H has {X_H.shape[1]}")
    return X_P, X_H


def right_singular_vectors(X: np.ndarray, name: str = "X") -> tuple[np.ndarray, np.ndarray]:
    """``(s, Vt)``: the singular values of ``X`` (N×D) and ALL D of its right singular vectors
    (the rows of the D×D ``Vt``: a basis of the row space, range(XᵀX), then of its complement).

    The thin SVD already has all D of them when N ≥ D; only N < D needs the full SVD, whose U is
    then N×N, smaller than Vt.  Memory is O(N·D + D²) either way: a full SVD of a tall X would
    form an N×N U (35k held-out rows: 10 GB) that nothing uses.  The digits are those of the
    full SVD (LAPACK computes Vt the same way).  Refused up front, naming the sizes, when the
    arrays would not fit (:func:`pycore.validation.check_dense_size`).
    """
    N, D = X.shape
    check_dense_size((D, D), f"the {D}×{D} basis of {name}'s row space ({name} is {N}×{D})")
    check_dense_size((N, min(N, D)), f"the left singular vectors of {name} ({N}×{D})")
    _, s, Vt = np.linalg.svd(X, full_matrices=N < D)
    return s, Vt


@bounded_blas
def rir(theta, X_P, X_H, *, theta_ref=None) -> RIR:
    """RIR = [κ(H_H(θ))/κ(H_H(θ_ref))] / [κ(H_P(θ))/κ(H_P(θ_ref))], θ_ref = I by default.

    Paper Eq. (15); with ``theta_ref = θ₀`` it is the deep-net RIR_θ₀ on features.
    """
    X_P, X_H = _check_pair(X_P, X_H)
    theta = check_theta(theta, X_P.shape[1])
    sP = gram_spectrum(X_P @ theta, vectors=False, name="X_P·theta")
    sH = gram_spectrum(X_H @ theta, vectors=False, name="X_H·theta")
    if theta_ref is None:
        rP, rH = gram_spectrum(X_P, vectors=False, name="X_P"), gram_spectrum(X_H, vectors=False, name="X_H")
    else:
        ref = check_theta(theta_ref, X_P.shape[1], "theta_ref")
        rP = gram_spectrum(X_P @ ref, vectors=False, name="X_P·theta_ref")
        rH = gram_spectrum(X_H @ ref, vectors=False, name="X_H·theta_ref")
    hr = sH.kappa / rH.kappa
    pr = sP.kappa / rP.kappa
    return RIR(hr / pr, hr, pr, sH.kappa, sP.kappa, rH.kappa, rP.kappa, sH.rank, sP.rank)


@bounded_blas
def feature_rir(Z_P, Z_H, Z_P_ref, Z_H_ref) -> RIR:
    """RIR from extracted features (deep nets, docs/theory.md §8): κ(Z_HᵀZ_H)/κ(ref) over
    κ(Z_PᵀZ_P)/κ(ref)."""
    sP, sH = gram_spectrum(Z_P, vectors=False, name="Z_P"), gram_spectrum(Z_H, vectors=False, name="Z_H")
    rP = gram_spectrum(Z_P_ref, vectors=False, name="Z_P_ref")
    rH = gram_spectrum(Z_H_ref, vectors=False, name="Z_H_ref")
    hr, pr = sH.kappa / rH.kappa, sP.kappa / rP.kappa
    return RIR(hr / pr, hr, pr, sH.kappa, sP.kappa, rH.kappa, rP.kappa, sH.rank, sP.rank)


@bounded_blas
def range_null_split(theta, X_P) -> tuple[np.ndarray, np.ndarray]:
    """Split θ by what D_P's inputs see (docs/theory.md §8, range/null decomposition).

    With P_R the orthogonal projector onto range(K_P) = row space of ``X_P`` (the training rows)
    and P_N = I − P_R, returns ``(θ_range, θ_null) = (P_N + P_Rθ, P_R + P_Nθ)``: θ_range changes
    only the input directions D_P's rows vary in, θ_null only those they never vary in.  Both
    equal θ's own action on their part of the input space, so RIR(θ_range) and RIR(θ_null) say
    how much of a method's RIR comes from each.  The rank of X_P uses numpy's ``matrix_rank``
    tolerance on its singular values (the rule of :mod:`pycore.spectral`).
    """
    X_P = as_float_matrix(X_P, "X_P")
    theta = check_theta(theta, X_P.shape[1])
    check_dense_size((X_P.shape[0], min(X_P.shape)), f"the left singular vectors of X_P {X_P.shape}")
    _, s, Vt = np.linalg.svd(X_P, full_matrices=False)
    r = int(np.count_nonzero(s > rank_tolerance(s[0], X_P.shape)))
    V = Vt[:r].T
    P_R = V @ V.T
    P_N = np.eye(X_P.shape[1]) - P_R
    return P_N + P_R @ theta, P_R + P_N @ theta


@dataclass(frozen=True)
class Ceiling:
    """sup_θ RIR for linear extractors (docs/theory.md §10).

    ``exact`` is ``inf`` when null(K_P) ⊄ null(K_H) (θ may rescale directions D_P never varies
    in, without bound); ``reason`` then says so and ``offending`` lists how much of K_H lives
    on null(K_P).  ``range_restricted`` = κ(C)·κ(K_P)/κ(K_H) with
    ``C = K_P^{+½} K_H K_P^{+½}`` on range(K_P), attained by the closed-form immunizer.
    """

    exact: float
    range_restricted: float
    kappa_C: float
    kappa_K_P: float
    kappa_K_H: float
    rank_K_P: int
    rank_K_H: int
    rank_C: int
    null_leak: float       # ‖K_H N‖₂/‖K_H‖₂ for N an orthonormal basis of null(K_P)
    reason: str
    basis: np.ndarray | None = None     # D×r: U_r Λ_r^{-½} Q_C, columns ordered by λ_C (desc)
    lambda_C: np.ndarray | None = None  # the r eigenvalues of C, descending (exact 0 past rank_C)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("basis", "lambda_C")}
        return d


@bounded_blas
def rir_ceiling(X_P, X_H, *, null_rtol: float = 1e-10) -> Ceiling:
    """The supremum of RIR over linear extractors θ, exact and restricted to range(K_P).

    docs/theory.md §10: ``κ(H_H)/κ(H_P) ≤ κ(C)`` with equality at ``θ = K_P^{-½}``, so
    ``sup RIR = κ(C)·κ(K_P)/κ(K_H)`` when null(K_P) ⊆ null(K_H).  The inclusion is tested as
    ``‖K_H N‖₂ ≤ null_rtol·‖K_H‖₂`` for an orthonormal basis N of null(K_P); ``null_rtol`` is
    far above round-off (~1e-15 here) and far below any real leak (House Prices: ~1e-2).
    The κ's of K_P, K_H are taken from the SVD of X (κ(X)², see module docstring); C is formed
    on range(K_P) as ``Λ_r^{-½}(X_H U_r)ᵀ(X_H U_r)Λ_r^{-½}``, i.e. from ``X_H U_r Λ_r^{-½}``.
    """
    check_number(null_rtol, "null_rtol", low=0.0, high=1.0, high_open=True)
    X_P, X_H = _check_pair(X_P, X_H)
    # Right singular vectors of X_P give K_P's eigenvectors with eigenvalues s² (accurate); all D
    # of them: the last D − r are the basis of null(K_P).
    sP = gram_spectrum(X_P, vectors=False, name="X_P")
    s, Vt = right_singular_vectors(X_P, "X_P")
    sH = gram_spectrum(X_H, vectors=False, name="X_H")
    r = sP.rank
    U_r, U_null = Vt[:r].T, Vt[r:].T
    KH_norm = sH.sigma_max
    if U_null.shape[1]:
        null_leak = float(np.linalg.norm(X_H @ U_null, 2) ** 2 / KH_norm)
    else:
        null_leak = 0.0
    W = (X_H @ U_r) / s[:r]               # X_H K_P^{+½} restricted to range(K_P)
    # ALL r eigenvectors of C = WᵀW: with fewer harmful rows than r, the ones of C's null space
    # are needed too (full_matrices), or θ would drop directions of range(K_P) and change D_P's
    # best loss (Definition 3.1(c)); their eigenvalues λ_C are exact zeros.  With N_H ≥ r the
    # thin SVD already has all r, and full_matrices would only add an unused N_H×N_H U.
    _, c, Qt = np.linalg.svd(W, full_matrices=W.shape[0] < r)
    c = np.concatenate([c, np.zeros(r - c.size)])
    sC = gram_spectrum(W, vectors=False, name="X_H K_P^{+1/2}")
    restricted = sC.kappa * sP.kappa / sH.kappa
    if null_leak > null_rtol:
        exact = np.inf
        reason = (f"null(K_P) ⊄ null(K_H): {U_null.shape[1]} direction(s) are constant on D_P's rows but "
                  f"K_H has weight {null_leak:.3e}·‖K_H‖ there, so θ can rescale them without bound")
    else:
        exact = restricted
        reason = "null(K_P) ⊆ null(K_H): the supremum is attained on range(K_P)"
    basis = (U_r / s[:r]) @ Qt.T
    return Ceiling(exact, restricted, sC.kappa, sP.kappa, sH.kappa, r, sH.rank, sC.rank, null_leak,
                   reason, basis, c * c)


@dataclass(frozen=True)
class ExponentWindow:
    """Exponents a of the closed form (s² = λ_C^a) that satisfy Definition 3.1 (docs/theory.md §10).

    On the ceiling family θ = K_P^{-½}Q_C diag(s), s² = λ_C^a with a ≥ 0:  H_P = diag(λ_C^a) and
    H_H = diag(λ_C^{1+a}), so (i) = κ(C)^{1+a}/κ(K_H) and (ii) = κ(C)^a/κ(K_P) while the RIR
    stays at the ceiling (a < 0 reverses H_P's order and lowers the RIR to κ(C)^{1+2a}·κ(K_P)/κ(K_H)).
    (i) > 1 ⇔ a > ln κ(K_H)/ln κ(C) − 1 and (ii) < 1 ⇔ a < ``high`` = ln κ(K_P)/ln κ(C); ``low``
    is the first bound clamped at 0.  ``balanced`` = (ln κ(K_H) + ln κ(K_P) − ln κ(C))/(2 ln κ(C))
    is the middle of the unclamped window, where ln (i) = −ln (ii): (i) = 1/(ii) = √ceiling.
    ``empty`` when no a ≥ 0 satisfies both (then the ceiling is ≤ 1).
    """

    low: float
    high: float
    balanced: float
    empty: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def def31_exponent_window(ceiling: Ceiling) -> ExponentWindow:
    """The window of closed-form exponents that immunize by Definition 3.1 (see :class:`ExponentWindow`).

    Uses the nonzero-spectrum κ's of the ceiling (κ(C) over C's rank, as the closed form does);
    undefined when κ(C) = 1 (every exponent gives the same θ up to scale).
    """
    lc = np.log(ceiling.kappa_C)
    if not lc > 0:
        raise ValueError("κ(C) = 1: every closed-form exponent gives the same spectra, "
                         "no window to choose from")
    raw_low = np.log(ceiling.kappa_K_H) / lc - 1.0
    high = np.log(ceiling.kappa_K_P) / lc
    return ExponentWindow(float(max(raw_low, 0.0)), float(high), float(0.5 * (raw_low + high)),
                          bool(max(raw_low, 0.0) >= high))


@bounded_blas
def grouped_feature_rir(Z_P, Z_H, Z_P_ref, Z_H_ref, *, rng: np.random.Generator, groups: int = 20,
                        group_size: int = 100) -> dict:
    """RIR_θ₀ estimated over ``groups`` random groups of ``group_size`` rows (docs/theory.md §8, deep nets).

    The same row indices are used for the model and the reference so that each group compares
    the two extractors on identical samples.  Returns mean, std and per-group values of the
    RIR and its two factors.
    """
    check_number(groups, "groups", low=1, integer=True)
    check_number(group_size, "group_size", low=2, integer=True)
    Z_P, Z_H = as_float_matrix(Z_P, "Z_P"), as_float_matrix(Z_H, "Z_H")
    Z_P_ref, Z_H_ref = as_float_matrix(Z_P_ref, "Z_P_ref"), as_float_matrix(Z_H_ref, "Z_H_ref")
    nP, nH = Z_P.shape[0], Z_H.shape[0]
    if Z_P_ref.shape[0] != nP or Z_H_ref.shape[0] != nH:
        raise ValueError("reference features must have the same rows as the model's features")
    m = min(group_size, nP, nH)
    vals = []
    for _ in range(groups):
        iP = rng.choice(nP, size=m, replace=False)
        iH = rng.choice(nH, size=m, replace=False)
        vals.append(feature_rir(Z_P[iP], Z_H[iH], Z_P_ref[iP], Z_H_ref[iH]))
    out = {}
    for key in ("value", "harmful_ratio", "pretrain_ratio"):
        a = np.array([getattr(v, key) for v in vals])
        out[key] = {"mean": float(a.mean()), "std": float(a.std()), "per_group": a.tolist()}
    out["group_size"] = m
    out["groups"] = groups
    return out
