"""Linear probing of frozen features ``Z = Xθ``.

The paper's prober and the problem every attacker solves.

:func:`gd_exact_line_search` is Figure 1 (Eq. (16); docs/theory.md §8): GD with exact line search
on ``‖Zw − Y‖²`` from w₀ = 0.  :func:`make_problem` builds the :class:`ProbingProblem` of
:mod:`pycore._attacks`: the HALVED ``½‖Zw − y‖²`` (Hessian ``ZᵀZ = H(θ)``), or the summed BCE plus
``(λ/2)‖w‖²``, ``λ = ridge_rel·‖Z‖₂²/4`` (separable digits need it; θ → cθ changes nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import scipy.special

from pycore._optim import damped_newton
from pycore._spectral import numerical_rank, rank_tolerance
from pycore._tasks import LOSSES
from pycore._threads import bounded_blas
from pycore._validation import (
    ParameterError,
    as_float_matrix,
    as_target,
    check_choice,
    check_number,
)

# Upper bound on the steps of one probe (3 floats a step in results.json; Figure 1 uses 100).
MAX_PROBE_STEPS = 100_000


@dataclass(frozen=True)
class ProbeTrace:
    """The trace of exact-line-search GD probing (:func:`gd_exact_line_search`).

    Attributes
    ----------
    norm_ratio : ndarray, shape (steps + 1,)
        ‖w_t − w*‖²/‖w_0 − w*‖², from t = 0.
    step_sizes : ndarray, shape (steps,)
        The exact line-search step α_t of each step (0 once converged).
    """

    norm_ratio: np.ndarray  # (steps+1,) ‖w_t − w*‖²/‖w_0 − w*‖²
    step_sizes: np.ndarray  # (steps,) exact line-search α_t


def exact_line_search_steps(
    Z: np.ndarray, Y: np.ndarray, w: np.ndarray, *, g_floor: float = 0.0
) -> Iterator[tuple[np.ndarray, np.ndarray, float]]:
    """GD with exact line search on ``½‖Zw − Y‖²`` from ``w``, the ONE loop.

    The loop of Figure 1 and of the ``gd_exact`` attacker: it yields ``(w_{t+1}, E_{t+1}, α_t)``,
    ``g = ZᵀE``, ``α = gᵀg/‖Zg‖²``, the residual ``E = Zw − Y`` by recurrence; stops once ``‖g‖ ≤
    g_floor`` or ``Zg = 0``.
    """
    E = Z @ w - Y
    while True:
        g = Z.T @ E
        Zg = Z @ g
        curv = float(np.sum(Zg * Zg))
        if np.linalg.norm(g) <= g_floor or curv <= 0.0:
            return
        alpha = float(np.sum(g * g)) / curv
        w = w - alpha * g
        E = E - alpha * Zg
        yield w, E, alpha


@bounded_blas
def gd_exact_line_search(Z, Y, steps: int) -> ProbeTrace:
    """``steps`` iterations from w₀ = 0, padded once ``‖∇L‖ ≤ 1e-14·‖∇L(0)‖``."""
    Z = as_float_matrix(Z, "Z")
    Y = as_target(Y, Z.shape[0], "Y")
    check_number(steps, "steps", low=0, high=MAX_PROBE_STEPS, integer=True)
    w = np.zeros((Z.shape[1], Y.shape[1]))
    w_star = np.linalg.lstsq(Z, Y, rcond=None)[0]
    e0 = float(np.sum(w_star**2))
    scale = e0 if e0 > 0 else 1.0
    g_floor = 0.5 * (1e-14 * max(float(np.linalg.norm(2 * Z.T @ Y)), 1e-300))
    ratios, alphas = [e0 / scale], []
    for w, _, alpha in itertools.islice(exact_line_search_steps(Z, Y, w, g_floor=g_floor), steps):
        alphas.append(0.5 * alpha)  # the step along the un-halved gradient 2ZᵀE
        ratios.append(float(np.sum((w - w_star) ** 2)) / scale)
    pad = steps - len(alphas)
    return ProbeTrace(np.array(ratios + ratios[-1:] * pad), np.array(alphas + [0.0] * pad))


@dataclass(frozen=True, eq=False)
class ProbingProblem:
    """``min_w L(w)`` of a linear probe and the constants that bound its attackers.

    ``w*``, ``L*``, smoothness L, ``strong_convexity`` μ on ``range(Zᵀ)``,
    ``rank``, singular values, ``r_star = Zw* − y`` (mse).
    """

    Z: np.ndarray
    y: np.ndarray
    loss: str
    ridge: float
    w_star: np.ndarray
    L_star: float
    smoothness: float
    strong_convexity: float
    rank: int
    sigma: np.ndarray
    r_star: np.ndarray | None = None
    info: dict = field(default_factory=dict)
    # mse with N > D iterates on Z = QR: ½‖Zw − y‖² = ½‖Rw − Qᵀy‖² + const, D² work a product
    Zw: np.ndarray | None = field(default=None, repr=False)
    yw: np.ndarray | None = field(default=None, repr=False)
    const: float = 0.0

    @property
    def dim(self) -> int:
        return self.Z.shape[1]

    @property
    def kappa(self) -> float:  # L/μ; least squares: κ(ZᵀZ) over the nonzero spectrum
        return self.smoothness / self.strong_convexity

    @property
    def work(self) -> tuple[np.ndarray, np.ndarray]:
        """``(Z, y)`` the attackers iterate with (``(R, Qᵀy)`` for mse with N > D)."""
        return (self.Zw, self.yw) if self.Zw is not None else (self.Z, self.y)

    def evaluate(self, w: np.ndarray):
        """``(L(w), ∇L(w), L(w) − L*)``; logistic also for a block ``w`` (D, m).

        The mse gap ``½‖e‖² + eᵀr*``, ``e = Z(w − w*)``, does not cancel against L*.
        """
        Zw, yw = self.work
        z = Zw @ w
        if self.loss == "mse":
            r = z - yw
            e = r - self.r_star
            return (
                0.5 * float(r @ r) + self.const,
                Zw.T @ r,
                0.5 * float(e @ e) + float(self.r_star @ e),
            )
        yy = yw[:, None] if w.ndim == 2 else yw
        f = np.sum(np.logaddexp(0.0, z) - yy * z, axis=0) + 0.5 * self.ridge * np.sum(
            w * w, axis=0
        )
        return f, self.Z.T @ (scipy.special.expit(z) - yy) + self.ridge * w, f - self.L_star

    def value_grad(self, w: np.ndarray):
        """``(L(w), ∇L(w))``."""
        f, g, _ = self.evaluate(w)
        return f, g

    def value(self, w: np.ndarray):
        """``L(w)``."""
        return self.evaluate(w)[0]

    def hessian(self, w: np.ndarray) -> np.ndarray:
        """``ZᵀZ`` (mse) or ``Zᵀ diag(σ(z)(1−σ(z))) Z + λI`` (logistic)."""
        if self.loss == "mse":
            return self.Z.T @ self.Z
        s = scipy.special.expit(self.Z @ w)
        return (self.Z.T * (s * (1.0 - s))) @ self.Z + self.ridge * np.eye(self.dim)


@bounded_blas
def make_problem(
    Z,
    y,
    loss: str = "mse",
    *,
    ridge_rel: float = 1e-4,
    newton_tol: float = 1e-13,
    max_newton: int = 200,
) -> ProbingProblem:
    """Validate ``(Z, y)`` and solve the probing problem an attacker faces.

    ``loss`` is :class:`pycore.LinearTask`'s: ``"mse"`` (½‖Zw − y‖²) or ``"bce"`` (the logistic
    loss plus a ridge, labels in {0, 1}). Computes ``w*`` (mse: minimum norm; bce: damped Newton),
    ``L*``, L and μ, the smallest NONZERO eigenvalue (bce: at w*, the defender's worst case; rank
    rule of docs/theory.md §2).

    Parameters
    ----------
    Z : array_like, shape (N, D)
        The features the attacker probes (``Xθ``).
    y : array_like, shape (N,) or (N, 1)
        The attacker's targets (0/1 labels for ``"bce"``).
    loss : {"mse", "bce"}, default "mse"
        The probe's loss.
    ridge_rel : float, default 1e-4
        ``"bce"``'s ridge, relative to ‖Z‖₂²/4 (separable data has no minimiser without it).
    newton_tol : float, default 1e-13
        ``"bce"``: damped Newton's tolerance on the gradient.
    max_newton : int, default 200
        ``"bce"``: the most Newton steps.

    Returns
    -------
    ProbingProblem
        ``w_star``, ``L_star``, ``smoothness``, ``strong_convexity``, ``kappa``, ``rank``.

    Raises
    ------
    ParameterError
        Shapes that do not match, a zero ``Z``, labels not in {0, 1} for ``"bce"``, an option
        out of its bounds; ``.parameter`` names it.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore.attacks import make_problem
    >>> rng = np.random.default_rng(0)
    >>> Z = rng.standard_normal((40, 4)) * [1.0, 2.0, 4.0, 8.0]
    >>> problem = make_problem(Z, Z @ np.ones(4))
    >>> problem.rank, round(problem.kappa, 3)  # κ(ZᵀZ): what GD's rate depends on
    (4, 100.257)
    """
    check_choice(loss, "loss", LOSSES)
    check_number(ridge_rel, "ridge_rel", low=0.0)
    check_number(newton_tol, "newton_tol", low=0.0, high=1.0, high_open=True)
    check_number(max_newton, "max_newton", low=1, integer=True)
    Z = as_float_matrix(Z, "Z")
    y = np.asarray(y)[:, 0] if np.ndim(y) == 2 and np.shape(y)[1] == 1 else np.asarray(y)
    if y.ndim != 1 or y.shape[0] != Z.shape[0]:
        raise ParameterError(
            "y", f"y must have shape ({Z.shape[0]},) or ({Z.shape[0]}, 1), got {y.shape}"
        )
    y = as_float_matrix(y, "y", ndim=1)
    N, D = Z.shape
    U, sigma, Vt = np.linalg.svd(Z, full_matrices=False)
    tol = rank_tolerance(sigma[0], Z.shape)
    rank = int(np.sum(sigma > tol))
    if rank == 0:
        raise ParameterError("Z", "Z is (numerically) zero: there is nothing to probe")
    Q = Vt[:rank].T  # orthonormal basis of range(Zᵀ)
    if loss == "mse":
        w_star = Q @ ((U[:, :rank].T @ y) / sigma[:rank])  # min-norm lstsq through the SVD
        Zw, yw, const = None, None, 0.0
        if N > D:
            Qz, R = np.linalg.qr(Z)
            Zw, yw = R, Qz.T @ y
            out = y - Qz @ yw
            const = 0.5 * float(out @ out)
            r_star = R @ w_star - yw
        else:
            r_star = Z @ w_star - y
        return ProbingProblem(
            Z,
            y,
            loss,
            0.0,
            w_star,
            0.5 * float(r_star @ r_star) + const,
            float(sigma[0] ** 2),
            float(sigma[rank - 1] ** 2),
            rank,
            sigma,
            r_star=r_star,
            info={"rank_tol": float(tol)},
            Zw=Zw,
            yw=yw,
            const=const,
        )
    if not np.all((y == 0.0) | (y == 1.0)):
        raise ParameterError("y", "logistic loss needs labels y in {0, 1}")
    if not ridge_rel > 0.0:
        raise ParameterError(
            "ridge_rel",
            f"ridge_rel must be > 0 for the logistic loss (separable data "
            f"has no minimiser without it), got {ridge_rel}",
        )
    lam = float(ridge_rel * sigma[0] ** 2 / 4.0)
    proto = ProbingProblem(Z, y, loss, lam, np.zeros(D), 0.0, 0.0, 1.0, rank, sigma)
    w_star, newton_info = damped_newton(
        proto.value_grad,
        proto.value,
        proto.hessian,
        np.zeros(D),
        tol=newton_tol,
        max_iter=max_newton,
    )
    mu = float(np.linalg.eigvalsh(Q.T @ proto.hessian(w_star) @ Q)[0])
    return ProbingProblem(
        Z,
        y,
        loss,
        lam,
        w_star,
        float(proto.value(w_star)),
        float(sigma[0] ** 2 / 4 + lam),
        mu,
        rank,
        sigma,
        info={"rank_tol": float(tol), "ridge_rel": ridge_rel, "reference_newton": newton_info},
    )


def jacobi_scaling(Z, *, curvature: float = 1.0, ridge: float = 0.0) -> np.ndarray:
    """The Jacobi preconditioner an attacker reads off their features.

    ``diag(c·ZᵀZ + λI)^{-½}``, 1 where zero (logistic: the Hessian at w = 0, c = ¼, plus the ridge,
    lest a never-inked pixel explode).
    """
    d = curvature * np.sum(np.asarray(Z, dtype=np.float64) ** 2, axis=0) + ridge
    out = np.ones_like(d)
    out[d > 0] = 1.0 / np.sqrt(d[d > 0])
    return out


def whitening_preconditioner(Z_est, ridge_rel: float = 1e-8) -> np.ndarray:
    """The whitening preconditioner of an attacker's own rows.

    ``(Σ̂₊ + δI)⁻¹``, ``Σ̂ = Z_estᵀZ_est/n``, ``δ = ridge_rel·λ_max(Σ̂)``; Σ̂₊ raises the
    numerically zero eigenvalues to the smallest nonzero one, lest round-off there be amplified by
    1/δ.
    """
    Z_est = as_float_matrix(Z_est, "Z_est")
    check_number(ridge_rel, "ridge_rel", low=0.0, low_open=True)
    S = Z_est.T @ Z_est / Z_est.shape[0]
    lam, U = np.linalg.eigh(0.5 * (S + S.T))
    top = max(float(lam[-1]), np.finfo(float).tiny)
    sv = np.linalg.svd(Z_est, compute_uv=False)
    rank = numerical_rank(sv, Z_est.shape)
    floor = float(lam[lam.size - rank]) if rank else top
    lam = np.where(np.arange(lam.size) < lam.size - rank, floor, lam)  # eigh sorts ascending
    return (U / (lam + ridge_rel * top)) @ U.T
