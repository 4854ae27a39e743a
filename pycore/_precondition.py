"""Preconditioning of Algorithm 1's regularizer steps ``∇_θR = 2KθG`` (docs/theory.md §4-§6).

``"exact"`` K⁻¹ → ``2θG``; ``"pinv"`` K⁺ → ``2ΠθG``, Π the projector on range(K) (K is singular on
real data); ``"ridge"`` the authors' ``(K+λI)⁻¹`` (:func:`ridge_factor`); ``"none"`` ``2KθG``.
"""

from __future__ import annotations

import numpy as np

from pycore._regularizers import grad_theta_and_regularizer
from pycore._spectral import rank_tolerance
from pycore._validation import as_float_matrix, check_choice, check_number

PRECONDITIONERS = ("exact", "pinv", "ridge", "none")


def precondition(
    theta: np.ndarray, G: np.ndarray, K: np.ndarray, mode: str = "exact", ridge: float = 0.0
) -> np.ndarray:
    """Direction of the Algorithm-1 regularizer step for ``∇_θR = 2KθG`` (docs/theory.md §4)."""
    return Preconditioner(K, mode, ridge)(theta, G)


def range_basis(K, rtol: float | None = None) -> np.ndarray:
    """Orthonormal basis (D×r) of range(K), symmetric PSD K (rank cut of docs/theory.md §2)."""
    check_number(rtol, "rtol", low=0.0, high=1.0, high_open=True, none_ok=True)
    w, Q = np.linalg.eigh(0.5 * (K + K.T))
    tol = rank_tolerance(max(abs(w[-1]), 0.0), K.shape, rtol)
    return Q[:, w > tol]


def ridge_factor(K, ridge: float, X=None) -> tuple[np.ndarray, np.ndarray]:
    """``(Q_r, f)`` with ``(K+λI)⁻¹K = Q_r diag(f) Q_rᵀ`` over K's nonzero eigenvalues.

    ``(Q_r, f)``, ``(K+λI)⁻¹K = Q_r diag(f) Q_rᵀ`` over K's nonzero eigenvalues μ, ``f =
    μ/(μ+λ)`` (from the SVD of ``X``, K = XᵀX, when N < D): exactly zero on null(K), where a
    Cholesky solve divides round-off by λ and Adam carries the noise into the range (docs/design.md
    §7).
    """
    check_number(ridge, "ridge", low=0.0, low_open=True)
    if X is not None and X.shape[0] < X.shape[1]:
        _, sv, Vt = np.linalg.svd(X, full_matrices=False)
        mu = sv * sv
        keep = mu > rank_tolerance(mu[0], (X.shape[1],))
        Q, mu = Vt[keep].T, mu[keep]
    else:
        mu, Q = np.linalg.eigh(0.5 * (K + K.T))
        keep = mu > rank_tolerance(max(mu[-1], 0.0), K.shape)
        Q, mu = Q[:, keep], mu[keep]
    return Q, mu / (mu + ridge)


def preconditioned_grad_theta(
    theta, K, kind: str, *, mode: str = "exact", ridge: float = 0.0
) -> np.ndarray:
    """The preconditioned regularizer gradient ``K⁻¹∇_θR(θᵀKθ)`` of Algorithm 1 line 6.

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The feature extractor.
    K : array_like, shape (D, D)
        ``XᵀX`` of the task whose Hessian ``θᵀKθ`` is regularized.
    kind : {"well", "ill"}
        R_well or R_ill.
    mode : str, default "exact"
        The preconditioner (docs/theory.md §4): ``"exact"`` (K⁻¹), ``"pinv"`` (K⁺), ``"ridge"``
        ((K + λI)⁻¹) or ``"none"``.
    ridge : float, default 0.0
        λ of ``"ridge"``.

    Returns
    -------
    ndarray, shape (D, D)
        The step direction.

    Raises
    ------
    ParameterError
        An unknown kind or mode, a K that is not symmetric, a ridge out of bounds.
    SpectrumError
        R undefined on ``θᵀKθ`` (zero, or rank ≤ 1 for R_ill).
    """
    K = as_float_matrix(K, "K")
    _, reg = grad_theta_and_regularizer(theta, K, kind)
    return precondition(np.asarray(theta, dtype=np.float64), reg.G, K, mode, ridge)


def G_parts(reg, D):
    """(a, b, v) with ``G = a·vvᵀ − b·H``.

    R_well a = σ₁, b = 1/D; R_ill a = σ_k/d², b = 1/(k d²).
    """
    lam = reg.info.sigma
    if reg.kind == "well":
        return lam[0], 1.0 / D, reg.vector(0)
    k, d2 = reg.info.rank, reg.d**2
    return lam[k - 1] / d2, 1.0 / (k * d2), reg.vector(k - 1)


def theta_G(theta, reg, Z):
    """θG for ``G = ∇_H R(H)``, ``H = ZᵀZ``.

    When N < D ``θG = a(θv)vᵀ − b(θZᵀ)Z`` (:func:`G_parts`).
    """
    N, D = Z.shape
    if N >= D and reg.G is not None:
        return theta @ reg.G
    a, b, v = G_parts(reg, D)
    return a * np.outer(theta @ v, v) - b * ((theta @ Z.T) @ Z)


class Preconditioner:
    """What preconditioner ``mode`` needs per task, computed once.

    With the rows ``X`` and N < D, from the SVD of X, with the same cut-off on s² as
    :func:`range_basis` on K's eigenvalues.
    """

    def __init__(self, K, mode, ridge, X=None):
        self.K, self.mode, self.ridge = K, check_choice(mode, "precond", PRECONDITIONERS), ridge
        self.factor = self.gram = None
        if mode == "pinv" and X is not None and X.shape[0] < X.shape[1]:
            U, sv, Vt = np.linalg.svd(X, full_matrices=False)
            keep = sv * sv > rank_tolerance(sv[0] ** 2, (X.shape[1],))
            self.factor = Vt[keep].T
            # X = U S Vᵀ ⇒ V_rᵀθ = S_r⁻¹U_rᵀ(Xθ) exactly (U_rᵀU = [I 0]): Π θ from Z = Xθ.
            self.gram = U[:, keep] / sv[keep]
        elif mode == "pinv":
            self.factor = range_basis(K)
        elif mode == "ridge":
            self.factor = ridge_factor(K, ridge, X)

    def __call__(self, theta, G):
        return self.apply_theta_G(theta @ G)  # 2(θG) and (2θ)G are the same bits: ×2 is exact

    def direction(self, theta, reg, Z):
        """Step direction ``K⁺∇_θR = 2ΠθG`` (or the other modes), ``Z = Xθ``.

        pinv with N < D: ``2V_r(TG)``, ``T = V_rᵀθ = S_r⁻¹U_rᵀZ``, ``TG = a(Tv)vᵀ − b(TZᵀ)Z``: no
        D×D×N product.
        """
        if self.gram is None:
            return self.apply_theta_G(theta_G(theta, reg, Z))
        T = self.gram.T @ Z
        a, b, v = G_parts(reg, Z.shape[1])
        return 2.0 * self.factor @ (a * np.outer(T @ v, v) - b * ((T @ Z.T) @ Z))

    def apply_theta_G(self, M):  # given M = θG
        """The step direction from ``M = θG``.

        ``2M`` (exact), ``2ΠM`` (pinv), ``2(K + λI)⁻¹KM`` (ridge), ``2KM`` (none).
        """
        if self.mode == "exact":
            return 2.0 * M
        if self.mode == "pinv":
            return 2.0 * self.factor @ (self.factor.T @ M)
        if self.mode == "ridge":
            Q, f = self.factor
            return 2.0 * Q @ (f[:, None] * (Q.T @ M))
        return 2.0 * self.K @ M


class FactorPreconditioner:
    """Algorithm 1's preconditioned regularizer directions for a stack of runs.

    They come from the task's :class:`pycore.linalg.RowFactor` (``K = V diag(s²) Vᵀ``, ``F =
    diag(s)Vᵀθ``), as a low-rank product ``L @ R`` (:meth:`parts`): with ``FG = EF``
    (:class:`pycore._batch.GramTerm`),

    - ``"pinv"``: ``K⁺∇_θR = 2VVᵀθG = 2(V diag(1/s) E) F``;
    - ``"ridge"``: ``(K + λI)⁻¹∇_θR = 2(V diag(s/(s² + λ)) E) F`` (exactly zero on null(K));
    - ``"none"``: ``∇_θR = 2KθG = 2(V diag(s) E) F``;
    - ``"exact"``: ``K⁻¹∇_θR = 2θG = 2a(θv)vᵀ − 2b(θFᵀ)F`` (docs/theory.md §4).

    No D×D×N product and no D×D H or G: the direction costs two products with r inner columns.
    """

    def __init__(self, factor, mode: str, ridge: float = 0.0):
        self.mode = check_choice(mode, "precond", PRECONDITIONERS)
        s = factor.s
        c = {"pinv": 1.0 / s, "ridge": s / (s * s + ridge), "none": s}.get(self.mode)
        self.Vc = None if c is None else factor.V * c
        self._scaled = (None, None)  # (weight, 2·weight·Vc) of the last scalar weight

    def parts(self, theta, gram, term, weight) -> tuple[np.ndarray, np.ndarray]:
        """``(L, R)`` with ``weight ×`` the direction ``= L @ R`` for every run (B×D×k, B×k×D).

        ``weight`` a number or one per run.
        """
        if self.mode != "exact" and np.ndim(weight) == 0:  # a fixed λ: Vc scaled once
            if self._scaled[0] != weight:
                self._scaled = (weight, self.Vc * (2.0 * float(weight)))
            return self._scaled[1] @ term.E, gram.F
        w = 2.0 * np.broadcast_to(np.asarray(weight, dtype=np.float64), (len(gram),))
        if self.mode != "exact":
            return (self.Vc * w[:, None, None]) @ term.E, gram.F
        v = gram.v(term.index)
        L = np.concatenate(
            [
                (w * term.a)[:, None, None] * (theta @ v[:, :, None]),
                -(w * term.b)[:, None, None] * (theta @ gram.F.mT),
            ],
            axis=2,
        )
        return L, np.concatenate([v[:, None, :], gram.F], axis=1)
