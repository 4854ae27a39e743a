"""Immunization metrics: RIR (paper Eq. (15)), its ceiling and exponent window, RIR_θ₀.

The ceiling and window are docs/theory.md §10's, the group sampling §8's. Every κ of a Hessian
``θᵀXᵀXθ`` is κ(Xθ)² from the SVD of the features (:func:`pycore._spectral.gram_spectrum`): RIR
multiplies four κ's that reach 1e10.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycore._spectral import gram_spectrum, numerical_rank
from pycore._threads import bounded_blas
from pycore._validation import (
    ParameterError,
    as_float_matrix,
    check_dense_size,
    check_number,
    check_theta,
    check_work,
)


@dataclass(frozen=True)
class RIR:
    """Relative immunization ratio (docs/theory.md §8).

    ``value`` = (i)/(ii) with ``harmful_ratio`` (i) = κ(H_H(θ))/κ(H_H(θ_ref)) and
    ``pretrain_ratio`` (ii) = κ(H_P(θ))/κ(H_P(θ_ref)).
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

    @classmethod
    def of(cls, sP, sH, rP, rH) -> RIR:
        """From the :class:`SpectrumInfo` of the features of P and H, at θ and at the reference."""
        hr, pr = sH.kappa / rH.kappa, sP.kappa / rP.kappa
        return cls(hr / pr, hr, pr, sH.kappa, sP.kappa, rH.kappa, rP.kappa, sH.rank, sP.rank)


def _check_pair(X_P, X_H, names=("X_P", "X_H")):
    X_P, X_H = as_float_matrix(X_P, names[0]), as_float_matrix(X_H, names[1])
    if X_P.shape[1] != X_H.shape[1]:
        raise ParameterError(
            names[1], f"{names[0]} has {X_P.shape[1]} columns but {names[1]} has {X_H.shape[1]}"
        )
    return X_P, X_H


def right_singular_vectors(X: np.ndarray, name: str = "X") -> tuple[np.ndarray, np.ndarray]:
    """``(s, Vt)``: the singular values of ``X`` (N×D) and ALL D right singular vectors.

    ``Vt``'s rows span range(XᵀX), then its complement. Sizes are checked up front: a full SVD of a
    tall X forms an N×N U (35k: 10 GB).
    """
    N, D = X.shape
    check_dense_size((D, D), f"the {D}×{D} basis of {name}'s row space ({name} is {N}×{D})")
    check_dense_size((N, min(N, D)), f"the left singular vectors of {name} ({N}×{D})")
    _, s, Vt = np.linalg.svd(X, full_matrices=N < D)
    return s, Vt


def row_space_basis(X: np.ndarray) -> np.ndarray:
    """Orthonormal basis V_r (D×r) of range(XᵀX) (rank rule of docs/theory.md §2)."""
    check_dense_size((X.shape[0], min(X.shape)), f"the left singular vectors of X {X.shape}")
    _, s, Vt = np.linalg.svd(X, full_matrices=False)
    return Vt[: numerical_rank(s, X.shape)].T


def _ratio(**features) -> RIR:
    """The RIR of four named feature matrices (P, H, P_ref, H_ref).

    κ's from :func:`gram_spectrum`.
    """
    return RIR.of(*(gram_spectrum(Z, vectors=False, name=n) for n, Z in features.items()))


@bounded_blas
def rir(theta, X_P, X_H, *, theta_ref=None) -> RIR:
    """The relative immunization ratio of θ (paper Eq. (15), docs/theory.md §8).

    RIR = [κ(H_H(θ))/κ(H_H(θ_ref))] / [κ(H_P(θ))/κ(H_P(θ_ref))] with ``H(θ) = θᵀXᵀXθ``: above 1
    when θ makes the harmful task's probing worse conditioned relative to the pre-training
    task's. Every κ is κ(Xθ)² from an SVD of the features, over the nonzero spectrum.

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The feature extractor.
    X_P, X_H : array_like, shape (N_P, D) and (N_H, D)
        Inputs of the pre-training and the harmful task.
    theta_ref : array_like, shape (D, D), optional
        The reference extractor (default I); the deep nets' RIR_θ₀ passes θ₀.

    Returns
    -------
    RIR
        ``value``, (i) ``harmful_ratio``, (ii) ``pretrain_ratio``, and the κ's and ranks behind
        them; ``float(r)`` is the value.

    Raises
    ------
    ParameterError
        X_P and X_H of different widths.
    ValueError
        θ not D×D, an input not finite.
    SpectrumError
        Features that are zero, or a spectrum beyond float64.

    Examples
    --------
    Shared eigenvectors, opposite eigenvalue order: θ = K_P^{-½} whitens D_P and reaches the
    ceiling κ(C)κ(K_P)/κ(K_H) = 9 (docs/theory.md §10).

    >>> import numpy as np
    >>> from pycore import rir
    >>> X_P, X_H = np.diag(np.sqrt([1.0, 2.0, 3.0])), np.diag(np.sqrt([3.0, 2.0, 1.0]))
    >>> r = rir(np.diag(1 / np.sqrt([1.0, 2.0, 3.0])), X_P, X_H)
    >>> round(r.value, 9), round(r.harmful_ratio, 9), round(r.pretrain_ratio, 9)
    (9.0, 3.0, 0.333333333)
    >>> float(rir(np.eye(3), X_P, X_H))
    1.0
    """
    X_P, X_H = _check_pair(X_P, X_H)
    theta = check_theta(theta, X_P.shape[1])
    if theta_ref is None:
        return _ratio(
            **{"X_P·theta": X_P @ theta, "X_H·theta": X_H @ theta, "X_P": X_P, "X_H": X_H}
        )
    ref = check_theta(theta_ref, X_P.shape[1], "theta_ref")
    return _ratio(
        **{
            "X_P·theta": X_P @ theta,
            "X_H·theta": X_H @ theta,
            "X_P·theta_ref": X_P @ ref,
            "X_H·theta_ref": X_H @ ref,
        }
    )


@bounded_blas
def feature_rir(Z_P, Z_H, Z_P_ref, Z_H_ref) -> RIR:
    """RIR from extracted features (deep nets, docs/theory.md §8).

    Parameters
    ----------
    Z_P, Z_H : array_like, shape (N_P, D) and (N_H, D)
        The model's features of D_P's and D_H's rows.
    Z_P_ref, Z_H_ref : array_like, shape (N_P, D') and (N_H, D')
        The reference model's features of the same rows.

    Returns
    -------
    RIR
        ``value`` (i)/(ii), ``harmful_ratio`` (i) = κ(Z_HᵀZ_H)/κ(Z_H_refᵀZ_H_ref) and
        ``pretrain_ratio`` (ii) = κ(Z_PᵀZ_P)/κ(Z_P_refᵀZ_P_ref).

    Raises
    ------
    ParameterError
        Features of mismatched widths, or a reference of other rows; ``.parameter`` names it.
    ValueError
        Features that are not finite real matrices.
    SpectrumError
        Features with no condition number (zero).

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import feature_rir
    >>> rng = np.random.default_rng(0)
    >>> Z_P, Z_H = rng.standard_normal((40, 3)), rng.standard_normal((30, 3))
    >>> r = feature_rir(2.0 * Z_P, Z_H @ np.diag([4.0, 1.0, 1.0]), Z_P, Z_H)
    >>> round(r.pretrain_ratio, 12), bool(r.harmful_ratio > 1)  # a scale keeps every κ
    (1.0, True)
    """
    return _ratio(**_check_features(Z_P, Z_H, Z_P_ref, Z_H_ref))


def _check_features(Z_P, Z_H, Z_P_ref, Z_H_ref) -> dict:
    """Each task's features and their reference of the same rows, both tasks of the same width."""
    Z_P, Z_H = _check_pair(Z_P, Z_H, ("Z_P", "Z_H"))
    Z_P_ref, Z_H_ref = _check_pair(Z_P_ref, Z_H_ref, ("Z_P_ref", "Z_H_ref"))
    for name, Z, ref in (("Z_P_ref", Z_P, Z_P_ref), ("Z_H_ref", Z_H, Z_H_ref)):
        if ref.shape[0] != Z.shape[0]:
            raise ParameterError(
                name, f"{name} has {ref.shape[0]} rows but {name[:3]} has {Z.shape[0]}"
            )
    return {"Z_P": Z_P, "Z_H": Z_H, "Z_P_ref": Z_P_ref, "Z_H_ref": Z_H_ref}


@dataclass(frozen=True)
class Ceiling:
    """sup_θ RIR for linear extractors (docs/theory.md §10).

    ``range_restricted`` = κ(C)κ(K_P)/κ(K_H) with ``C = K_P^{+½}K_HK_P^{+½}`` on range(K_P),
    attained by the closed form; ``exact`` equals it when null(K_P) ⊆ null(K_H), else inf
    (``reason`` says which).
    """

    exact: float
    range_restricted: float
    kappa_C: float
    kappa_K_P: float
    kappa_K_H: float
    rank_K_P: int
    rank_K_H: int
    rank_C: int
    null_leak: float  # ‖X_H N‖₂²/‖X_H‖₂² for N an orthonormal basis of null(K_P)
    reason: str
    basis: np.ndarray | None = None  # D×r: U_r Λ_r^{-½} Q_C, columns ordered by λ_C (desc)
    lambda_C: np.ndarray | None = None  # the r eigenvalues of C, descending (exact 0 past rank_C)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("basis", "lambda_C")}


@bounded_blas
def rir_ceiling(X_P, X_H, *, null_rtol: float = 1e-10) -> Ceiling:
    """The supremum of RIR over linear θ, exact and restricted to range(K_P) (docs/theory.md §10).

    With ``C = K_P^{+½} K_H K_P^{+½}`` on range(K_P), no θ has RIR above κ(C)κ(K_P)/κ(K_H), and
    the closed form attains it. When some direction is constant on D_P's rows but not on D_H's
    (null(K_P) ⊄ null(K_H)), θ can rescale it freely and the exact supremum is infinite; the
    range-restricted ceiling is then the one the strict protocol measures against.

    Parameters
    ----------
    X_P, X_H : array_like, shape (N_P, D) and (N_H, D)
        Inputs of the pre-training and the harmful task.
    null_rtol : float, default 1e-10
        null(K_P) ⊆ null(K_H) holds when ``null_leak`` ≤ this: far above round-off (~1e-15), far
        below any real leak (House Prices: ~1e-2).

    Returns
    -------
    Ceiling
        ``exact`` (inf when null(K_P) leaks into K_H), ``range_restricted``, κ(C), κ(K_P),
        κ(K_H), their ranks, ``null_leak``, the ``reason`` in one sentence, and the closed form's
        ``basis`` and ``lambda_C``.

    Raises
    ------
    ParameterError
        X_P and X_H of different widths, or ``null_rtol`` outside [0, 1).

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import rir_ceiling
    >>> X_P, X_H = np.diag(np.sqrt([1.0, 2.0, 3.0])), np.diag(np.sqrt([3.0, 2.0, 1.0]))
    >>> c = rir_ceiling(X_P, X_H)
    >>> round(c.exact, 9), round(c.range_restricted, 9)
    (9.0, 9.0)
    >>> leaky = rir_ceiling(X_P * [1.0, 1.0, 0.0], X_H)  # D_P never sees the third input
    >>> leaky.exact, round(leaky.range_restricted, 9)
    (inf, 2.0)
    """
    check_number(null_rtol, "null_rtol", low=0.0, high=1.0, high_open=True)
    X_P, X_H = _check_pair(X_P, X_H)
    check_work(X_P.shape[1], X_P.shape[0] + X_H.shape[0], 2, 3, "rir_ceiling")
    sP = gram_spectrum(X_P, vectors=False, name="X_P")
    s, Vt = right_singular_vectors(X_P, "X_P")  # K_P's eigenvectors; the last D − r span null(K_P)
    sH = gram_spectrum(X_H, vectors=False, name="X_H")
    r = sP.rank
    U_r, U_null = Vt[:r].T, Vt[r:].T
    null_leak = (
        float(np.linalg.norm(X_H @ U_null, 2) ** 2 / sH.sigma_max) if U_null.shape[1] else 0.0
    )
    W = (X_H @ U_r) / s[:r]  # X_H K_P^{+½} restricted to range(K_P)
    # ALL r eigenvectors of C = WᵀW: with fewer harmful rows than r, those of C's null space too
    # (λ_C = 0), or θ would drop directions of range(K_P) and change D_P's best loss (Def. 3.1(c)).
    _, c, Qt = np.linalg.svd(W, full_matrices=W.shape[0] < r)
    c = np.concatenate([c, np.zeros(r - c.size)])
    sC = gram_spectrum(W, vectors=False, name="X_H K_P^{+1/2}")
    restricted = sC.kappa * sP.kappa / sH.kappa
    if null_leak > null_rtol:
        exact = np.inf
        reason = (
            f"null(K_P) ⊄ null(K_H): {U_null.shape[1]} direction(s) are constant on "
            "D_P's rows but "
            f"K_H has weight {null_leak:.3e}·‖K_H‖ there, so θ can rescale them without bound"
        )
    else:
        exact, reason = restricted, "null(K_P) ⊆ null(K_H): the supremum is attained on range(K_P)"
    return Ceiling(
        exact,
        restricted,
        sC.kappa,
        sP.kappa,
        sH.kappa,
        r,
        sH.rank,
        sC.rank,
        null_leak,
        reason,
        (U_r / s[:r]) @ Qt.T,
        c * c,
    )


@dataclass(frozen=True)
class ExponentWindow:
    """Closed-form exponents a ≥ 0 (s² = λ_C^a) that satisfy Definition 3.1 (docs/theory.md §10).

    (i) > 1 ⇔ a > ln κ(K_H)/ln κ(C) − 1 (``low``, clamped at 0), (ii) < 1 ⇔ a < ``high`` = ln
    κ(K_P)/ln κ(C). ``balanced`` is the exponent of largest margin min(ln(i), −ln(ii)), always in
    ``[low, high)`` when the window is not empty: the middle of the unclamped window ``m = (ln
    κ(K_H)/ln κ(C) − 1 + high)/2``, where (i) = 1/(ii) = √ceiling, when m ≥ ``low``; else ``low``
    (= 0: with m < 0, (i) > 1/(ii) at every a ≥ 0, and a = 0 gives H_P = I, the smallest (ii),
    1/κ(K_P)). ``empty`` when no a ≥ 0 satisfies both, or when the window exists only by round-off:
    its width is ln(ceiling)/ln κ(C), and a ceiling within :func:`ceiling_round_off` of 1 (both
    tasks of the same rows: κ(C) = 1 + 3e-15) opens none.
    """

    low: float
    high: float
    balanced: float
    empty: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def ceiling_round_off(ceiling: Ceiling) -> float:
    """The log-ceiling ln(κ(C)κ(K_P)/κ(K_H)) that round-off alone can produce.

    Each κ = κ(Z)² from an SVD errs by ≲ 2p·eps·√κ relative (p = 4, as
    :func:`pycore._methods.rir_change_tolerance`), so ``max(1e-9, 8·eps·Σ√κ)`` over the three.
    """
    kappas = (ceiling.kappa_C, ceiling.kappa_K_P, ceiling.kappa_K_H)
    return max(1e-9, 8.0 * float(np.finfo(np.float64).eps) * sum(np.sqrt(k) for k in kappas))


def def31_exponent_window(ceiling: Ceiling) -> ExponentWindow:
    """The closed form's Definition 3.1 window of exponents (docs/theory.md §10).

    Parameters
    ----------
    ceiling : Ceiling
        The task's :func:`rir_ceiling`.

    Returns
    -------
    ExponentWindow
        ``low``, ``high``, ``balanced`` and ``empty``.

    Raises
    ------
    ValueError
        κ(C) = 1: every exponent gives the same spectra, there is no window.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import def31_exponent_window, rir_ceiling
    >>> rng = np.random.default_rng(0)
    >>> X_P = rng.standard_normal((30, 4)) * [1.0, 0.5, 0.2, 0.1]
    >>> X_H = rng.standard_normal((30, 4)) @ rng.standard_normal((4, 4))
    >>> w = def31_exponent_window(rir_ceiling(X_P, X_H))
    >>> w.empty, bool(w.low <= w.balanced < w.high)
    (False, True)
    """
    lc = np.log(ceiling.kappa_C)
    if not lc > 0:
        raise ValueError(
            "κ(C) = 1: every closed-form exponent gives the same spectra, no window to choose"
        )
    raw_low = np.log(ceiling.kappa_K_H) / lc - 1.0
    high = np.log(ceiling.kappa_K_P) / lc
    log_ceiling = lc + np.log(ceiling.kappa_K_P) - np.log(ceiling.kappa_K_H)
    low = max(raw_low, 0.0)
    # the middle of the unclamped window lies below 0 when κ(C)/κ(K_H) > κ(K_P): there (i) and
    # (ii) both grow with a, so the margin −ln(ii) is largest at the window's low end
    return ExponentWindow(
        float(low),
        float(high),
        float(max(0.5 * (raw_low + high), low)),
        bool(low >= high or log_ceiling <= ceiling_round_off(ceiling)),
    )


@bounded_blas
def grouped_feature_rir(
    Z_P,
    Z_H,
    Z_P_ref,
    Z_H_ref,
    *,
    rng: np.random.Generator,
    groups: int = 20,
    group_size: int = 100,
) -> dict:
    """RIR_θ₀ over random groups of rows, the same for model and reference (docs/theory.md §8).

    Parameters
    ----------
    Z_P, Z_H, Z_P_ref, Z_H_ref
        As for :func:`feature_rir`.
    rng : numpy.random.Generator
        Draws each group's rows (without replacement).
    groups : int, default 20
        The number of groups.
    group_size : int, default 100
        Rows per group and task, at least 2 (capped at the rows of the smaller task).

    Returns
    -------
    dict
        ``{"value", "harmful_ratio", "pretrain_ratio"}`` each ``{"mean", "std", "per_group"}``, and
        ``"group_size"`` (as used) and ``"groups"``.

    Raises
    ------
    ParameterError
        ``groups`` or ``group_size`` out of bounds, or features as :func:`feature_rir` refuses.
    SpectrumError
        A group's features with no condition number.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import grouped_feature_rir
    >>> rng = np.random.default_rng(0)
    >>> Z_P, Z_H = rng.standard_normal((40, 3)), rng.standard_normal((30, 3))
    >>> g = grouped_feature_rir(
    ...     2.0 * Z_P, Z_H, Z_P, Z_H, rng=np.random.default_rng(0), groups=5, group_size=10
    ... )
    >>> g["groups"], g["group_size"], round(g["value"]["mean"], 12)
    (5, 10, 1.0)
    """
    check_number(groups, "groups", low=1, integer=True)
    check_number(group_size, "group_size", low=2, integer=True)
    Z_P, Z_H, Z_P_ref, Z_H_ref = _check_features(Z_P, Z_H, Z_P_ref, Z_H_ref).values()
    nP, nH = Z_P.shape[0], Z_H.shape[0]
    m = min(group_size, nP, nH)
    vals = []
    for _ in range(groups):
        iP, iH = rng.choice(nP, size=m, replace=False), rng.choice(nH, size=m, replace=False)
        vals.append(feature_rir(Z_P[iP], Z_H[iH], Z_P_ref[iP], Z_H_ref[iH]))
    out = {}
    for key in ("value", "harmful_ratio", "pretrain_ratio"):
        a = np.array([getattr(v, key) for v in vals])
        out[key] = {"mean": float(a.mean()), "std": float(a.std()), "per_group": a.tolist()}
    return {**out, "group_size": m, "groups": groups}
