"""Attack suite: linear probing on fixed features ``Z = Xθ`` by the optimisers a real attacker uses.

docs/theory.md §10 ("Attack suite"). The paper's threat model (Sec. 3, Eq. (8)) is a bad actor who trains a
linear probe ``w`` on frozen features ``Z = X_H θ`` by gradient descent; its evidence is GD with
exact line search (Figure 1) and the rate ``(1 − 1/κ)^t`` of Eq. (2). Immunization acts only
through the Hessian's condition number κ, so how much it buys depends on the optimiser:
GD-type methods pay ~κ, accelerated/Krylov methods ~√κ, quasi-Newton much less and a
closed-form or Newton solve nothing. This module measures that, in float64 NumPy/SciPy.

Problems (:class:`ProbingProblem`, built by :func:`make_problem`)
-----------------------------------------------------------------
* ``loss="lsq"`` (House Prices): ``L(w) = ½‖Zw − y‖²`` — the HALVED form, so the Hessian is
  exactly ``∇²L = ZᵀZ = θᵀKθ = H(θ)`` of docs/theory.md §1 (the paper's un-halved ``‖Zw − y‖²`` has Hessian
  ``2H``; every iterate below is identical for both forms, only the printed step sizes differ by 2).
  ``Z`` may be rank deficient (real data always is): the optimum is the minimum-norm
  least-squares solution, every attacker starts at ``w₀ = 0`` so its iterates stay in
  ``range(Zᵀ)``, and μ is the smallest NONZERO eigenvalue of ``ZᵀZ`` (docs/theory.md §2).
* ``loss="logistic"`` (MNIST binary): ``L(w) = Σᵢ [log(1 + e^{zᵢ}) − yᵢ zᵢ] + (λ/2)‖w‖²``,
  ``z = Zw``, ``y ∈ {0, 1}`` (summed BCE with logits). Two digits are linearly separable, so
  without the ridge the infimum is 0 and is never attained; the documented ridge
  ``λ = ridge_rel · ‖Z‖₂²/4`` makes the problem strongly convex with a unique minimiser. Tying λ
  to ``‖Z‖₂²`` keeps the problem invariant under ``θ → cθ`` (the attacker can undo a rescaling
  by ``w → w/c``), so the defender cannot win by scaling alone; it also caps the global condition
  number at ``1 + 1/ridge_rel`` — report ``ridge_rel`` with every logistic number.
  Smoothness ``L = ‖Z‖₂²/4 + λ`` (``σ(1−σ) ≤ 1/4``); μ is the smallest eigenvalue of the
  Hessian at the optimum restricted to ``range(Zᵀ)`` (a local, oracle-tuned value: favourable to
  the attacker, i.e. the worst case for the defender).

Reference optimum ``L*``: ``numpy.linalg.lstsq`` (SVD, minimum norm) for least squares; damped
Newton with a Cholesky solve to a gradient norm at the float64 floor for logistic.

Attackers (all start at ``w₀ = 0`` unless told otherwise, all capped at ``max_steps`` iterations
and stopped once the relative suboptimality reaches ``tol``); one "step" is one iteration of
the method — see each docstring for what an iteration costs:

=================  ==========================================================================
``gd_exact``       GD with exact line search (the paper's Figure 1 prober)
``gd_constant``    GD with the constant step ``1/L`` (Eq. (2))
``heavy_ball``     Polyak momentum tuned to (L, μ)
``nesterov``       Nesterov's constant-momentum method tuned to (L, μ)
``adam``           Adam, small learning-rate sweep; per ε the best lr counts (worst case for us)
``cg``             CGLS (CG on the normal equations) / Polak–Ribière nonlinear CG (SciPy)
``lbfgs``          L-BFGS-B (SciPy), memory 10
``closed_form``    one ``lstsq`` solve (least squares only)
``newton``         damped Newton, the second-order attacker for logistic (logistic only)
=================  ==========================================================================
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.optimize
import scipy.special

from pycore.optim import damped_newton
from pycore.probe import exact_line_search_steps
from pycore.spectral import rank_tolerance
from pycore.threads import bounded_blas
from pycore.validation import ParameterError, as_float_matrix, check_number

__all__ = [
    "ProbingProblem", "AttackTrajectory", "make_problem",
    "attack_gd_exact", "attack_gd_constant", "attack_heavy_ball", "attack_nesterov",
    "attack_adam", "attack_cg", "attack_lbfgs", "attack_closed_form", "attack_newton",
    "attack_whiten", "attack_pcg_jacobi", "jacobi_scaling", "whitening_preconditioner",
    "sweep_momentum", "sweep_adaptive", "MOMENTUM_KINDS", "ADAPTIVE_KINDS",
    "ATTACKERS", "attackers_for", "run_attack_suite", "DEFAULT_EPS",
]

DEFAULT_EPS: tuple[float, ...] = (1e-2, 1e-4, 1e-6)
LOSSES = ("lsq", "logistic")
_LOSS_ALIASES = {"mse": "lsq", "bce": "logistic"}   # pycore.tasks.LinearTask's names


# ----------------------------------------------------------------------------------------------
# problem
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ProbingProblem:
    """A linear-probing problem ``min_w L(w)`` on fixed features, with its reference optimum.

    Fields: ``Z`` (N×D features), ``y`` (N targets), ``loss`` (``"lsq"``/``"logistic"``),
    ``ridge`` (absolute λ, 0 for least squares), ``w_star`` / ``L_star`` (reference optimum),
    ``smoothness`` (L, global), ``strong_convexity`` (μ over ``range(Zᵀ)``), ``rank`` (numerical
    rank of Z), ``sigma`` (singular values of Z, descending) and ``r_star = Z w* − y`` (lsq).
    Build it with :func:`make_problem`; the attackers only call the methods below.
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
    # working form (lsq with N > D): Z = QR, so ½‖Zw − y‖² = ½‖Rw − Qᵀy‖² + ½‖(I − QQᵀ)y‖².
    # Same gradient Zᵀ(Zw − y) = Rᵀ(Rw − Qᵀy), same Hessian RᵀR = ZᵀZ, same iterates; each
    # product costs D² instead of N·D and no ZᵀZ is ever formed (accuracy of the residual form).
    Zw: np.ndarray | None = field(default=None, repr=False)
    yw: np.ndarray | None = field(default=None, repr=False)
    const: float = 0.0

    @property
    def dim(self) -> int:
        return self.Z.shape[1]

    @property
    def kappa(self) -> float:
        """``L/μ``: for least squares exactly κ(ZᵀZ) over the nonzero spectrum (docs/theory.md §2)."""
        return self.smoothness / self.strong_convexity

    # value, gradient and suboptimality, for a vector w (D,) or a block of columns W (D, m) ---
    def evaluate(self, w: np.ndarray):
        """``(L(w), ∇L(w), L(w) − L*)`` from ONE product ``Zw`` (plus ``Zᵀ·`` for the gradient).

        With ``W`` of shape (D, m) the loss and gap are length-m vectors. For least squares the
        gap is computed without cancellation: with ``e = Z(w − w*) = r(w) − r*``,
        ``L(w) − L* = ½‖e‖² + eᵀr*`` exactly (the cross term is ~0 since ``r* ⊥ range(Z)``), so
        gaps far below ``L*`` are not lost in ``½‖y‖²``; its rounding error grows like
        ``eps·√κ``, not ``eps·κ`` as ``½eᵀZᵀZe`` would. For logistic the plain difference
        ``L(w) − L*`` is used (|L| = O(N), far from cancellation at the tolerances used here).
        """
        Zw, yw = self.work
        z = Zw @ w
        block = w.ndim == 2
        if self.loss == "lsq" and not block:   # one vector: dot products (the hot path of every attacker)
            r = z - yw
            e = r - self.r_star
            return 0.5 * float(r @ r) + self.const, Zw.T @ r, 0.5 * float(e @ e) + float(self.r_star @ e)
        yy = yw[:, None] if block else yw
        if self.loss == "lsq":
            r = z - yy
            rs = self.r_star[:, None] if block else self.r_star
            e = r - rs
            f = 0.5 * np.sum(r * r, axis=0) + self.const
            gap = 0.5 * np.sum(e * e, axis=0) + np.sum(rs * e, axis=0)
            return f, Zw.T @ r, gap
        f = np.sum(np.logaddexp(0.0, z) - yy * z, axis=0) + 0.5 * self.ridge * np.sum(w * w, axis=0)
        g = self.Z.T @ (scipy.special.expit(z) - yy) + self.ridge * w
        return f, g, f - self.L_star

    def value_grad(self, w: np.ndarray):
        """``(L(w), ∇L(w))``."""
        f, g, _ = self.evaluate(w)
        return f, g

    @property
    def work(self) -> tuple[np.ndarray, np.ndarray]:
        """``(Z, y)`` the attackers iterate with: ``(R, Qᵀy)`` for least squares with N > D."""
        return (self.Zw, self.yw) if self.Zw is not None else (self.Z, self.y)

    def value(self, w: np.ndarray):
        """``L(w)``."""
        Zw, yw = self.work
        z = Zw @ w
        yy = yw if w.ndim == 1 else yw[:, None]
        if self.loss == "lsq":
            r = z - yy
            return 0.5 * np.sum(r * r, axis=0) + self.const
        return np.sum(np.logaddexp(0.0, z) - yy * z, axis=0) + 0.5 * self.ridge * np.sum(w * w, axis=0)

    def suboptimality(self, w: np.ndarray):
        """``L(w) − L*`` (see :meth:`evaluate` for how it avoids cancellation)."""
        return self.evaluate(w)[2]

    def hessian(self, w: np.ndarray) -> np.ndarray:
        """``∇²L(w)``: ``ZᵀZ`` (lsq) or ``Zᵀ diag(σ(z)(1−σ(z))) Z + λI`` (logistic)."""
        if self.loss == "lsq":
            return self.Z.T @ self.Z
        s = scipy.special.expit(self.Z @ w)
        return (self.Z.T * (s * (1.0 - s))) @ self.Z + self.ridge * np.eye(self.dim)


@bounded_blas
def make_problem(Z, y, loss: str = "lsq", *, ridge_rel: float = 1e-4,
                 newton_tol: float = 1e-13, max_newton: int = 200) -> ProbingProblem:
    """Validate ``(Z, y)``, compute the reference optimum ``(w*, L*)`` and the constants ``L, μ``.

    ``loss``: ``"lsq"`` / ``"logistic"`` (``"mse"`` / ``"bce"`` accepted, as in
    :class:`pycore.tasks.LinearTask`). ``Z``: N×D features (``X @ theta``). ``y``: N targets
    (shape (N,) or (N, 1)); ``{0,1}`` labels for ``loss="logistic"``. ``ridge_rel``: logistic only,
    ``λ = ridge_rel·‖Z‖₂²/4`` (module docstring). The numerical rank uses numpy's ``matrix_rank``
    tolerance on Z (``σ₁·max(N, D)·eps``, docs/theory.md §2); computing it on Z rather than on ZᵀZ keeps
    singular values down to ``1e-16·σ₁`` distinguishable (ZᵀZ would square them into round-off).
    """
    loss = _LOSS_ALIASES.get(loss, loss)
    if loss not in LOSSES:
        raise ParameterError("loss", f"loss must be one of {LOSSES} (or 'mse'/'bce'), got {loss!r}")
    check_number(ridge_rel, "ridge_rel", low=0.0)
    check_number(newton_tol, "newton_tol", low=0.0, high=1.0, high_open=True)
    check_number(max_newton, "max_newton", low=1, integer=True)
    Z = as_float_matrix(Z, "Z")
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ParameterError("y", f"y must have shape (N,) or (N, 1) (one target), got {y.shape}")
    if y.shape[0] != Z.shape[0]:
        raise ParameterError("y", f"Z has {Z.shape[0]} rows but y has {y.shape[0]} entries")
    y = as_float_matrix(y, "y", ndim=1)
    N, D = Z.shape

    U, sigma, Vt = np.linalg.svd(Z, full_matrices=False)
    tol = rank_tolerance(sigma[0], Z.shape) if sigma.size else 0.0
    rank = int(np.sum(sigma > tol))
    if rank == 0:
        raise ParameterError("Z", "Z is (numerically) zero: there is nothing to probe")
    Q = Vt[:rank].T                                   # orthonormal basis of range(Zᵀ)

    if loss == "lsq":
        # min-norm least squares through the SVD already computed (same as lstsq, rcond=tol)
        w_star = Q @ ((U[:, :rank].T @ y) / sigma[:rank])
        Zw, yw, const = None, None, 0.0
        if N > D:
            Qz, R = np.linalg.qr(Z)
            Zw, yw = R, Qz.T @ y
            out = y - Qz @ yw
            const = 0.5 * float(out @ out)
            r_star = R @ w_star - yw
        else:
            r_star = Z @ w_star - y
        L_star = 0.5 * float(r_star @ r_star) + const
        smooth = float(sigma[0] ** 2)
        mu = float(sigma[rank - 1] ** 2)
        return ProbingProblem(Z, y, loss, 0.0, w_star, L_star, smooth, mu, rank, sigma,
                              r_star=r_star, info={"rank_tol": float(tol)}, Zw=Zw, yw=yw, const=const)

    if not np.all((y == 0.0) | (y == 1.0)):
        raise ParameterError("y", "logistic loss needs labels y in {0, 1}")
    if not ridge_rel > 0.0:
        raise ParameterError("ridge_rel", f"ridge_rel must be > 0 for the logistic loss (separable data "
                                          f"has no minimiser without it), got {ridge_rel}")
    lam = float(ridge_rel * sigma[0] ** 2 / 4.0)
    proto = ProbingProblem(Z, y, loss, lam, np.zeros(D), 0.0, 0.0, 1.0, rank, sigma)
    w_star, newton_info = _newton(proto, np.zeros(D), tol=newton_tol, max_iter=max_newton)
    H = proto.hessian(w_star)
    mu = float(np.linalg.eigvalsh(Q.T @ H @ Q)[0])
    smooth = float(sigma[0] ** 2 / 4.0 + lam)
    return ProbingProblem(Z, y, loss, lam, w_star, float(proto.value(w_star)), smooth, mu, rank,
                          sigma, info={"rank_tol": float(tol), "ridge_rel": ridge_rel,
                                       "reference_newton": newton_info})


def _newton(problem: ProbingProblem, w0: np.ndarray, *, tol: float, max_iter: int,
            callback: Callable[[np.ndarray], bool] | None = None) -> tuple[np.ndarray, dict]:
    """Damped Newton on the problem (:func:`pycore.optim.damped_newton`). The Hessian is positive
    definite because λ > 0 (logistic) — for least squares use the closed form."""
    return damped_newton(problem.value_grad, problem.value, problem.hessian, w0, tol=tol, max_iter=max_iter,
                         callback=callback)


# ----------------------------------------------------------------------------------------------
# trajectory
# ----------------------------------------------------------------------------------------------
@dataclass
class AttackTrajectory:
    """What one attacker did: ``losses[t] = L(w_t)`` and ``rel_subopt[t] = (L(w_t) − L*)/(L(w₀) − L*)``
    for ``t = 0..n_steps`` (index 0 is the start), the cap it ran under, the wall time, the
    hyper-parameters used (``params``) and bookkeeping (``info``: oracle calls, stop reason).

    ``sweep`` holds the runs of the other hyper-parameters of a swept attacker (Adam): then
    :meth:`steps_to` takes the minimum over the whole sweep — each ε may pick its own learning
    rate, which is the defender's worst case — while the arrays are those of the kept run.
    """

    attacker: str
    losses: np.ndarray
    rel_subopt: np.ndarray
    step_cap: int
    wall_seconds: float
    params: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    sweep: tuple["AttackTrajectory", ...] = ()
    w_final: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_steps(self) -> int:
        return len(self.rel_subopt) - 1

    @property
    def final_rel_subopt(self) -> float:
        return float(self.rel_subopt[-1])

    def own_steps_to(self, eps: float) -> int | None:
        """First step ``t`` with ``rel_subopt[t] ≤ eps`` in this run; None if never (capped)."""
        hit = np.flatnonzero(self.rel_subopt <= eps)
        return int(hit[0]) if hit.size else None

    def steps_to(self, eps: float) -> int | None:
        """Steps to reach relative suboptimality ``eps`` (min over the sweep); None if not reached
        within ``step_cap``."""
        found = [s for s in (t.own_steps_to(eps) for t in (self, *self.sweep)) if s is not None]
        return min(found) if found else None

    def summary(self, eps_list=DEFAULT_EPS) -> dict:
        """Digest without the per-step arrays, for a results.json written by
        :func:`pycore.report.write_json` (its strict encoder writes a non-finite value as the string
        ``"Infinity"``/``"NaN"``; this module has no encoder of its own)."""
        return {
            "attacker": self.attacker,
            "steps_to": {f"{e:g}": self.steps_to(e) for e in eps_list},
            "step_cap": self.step_cap,
            "n_steps": self.n_steps,
            "final_rel_subopt": self.final_rel_subopt,
            "wall_seconds": self.wall_seconds,
            "params": dict(self.params),
            "info": dict(self.info),
            "sweep": [{"params": dict(t.params),
                       "steps_to": {f"{e:g}": t.own_steps_to(e) for e in eps_list},
                       "final_rel_subopt": t.final_rel_subopt} for t in self.sweep],
        }


class _Recorder:
    """Accumulates ``L(w_t)`` and ``(L(w_t) − L*)/(L(w₀) − L*)``; says when ``tol`` is reached."""

    def __init__(self, f0: float, gap0: float, tol: float):
        if not gap0 > 0.0:
            raise ParameterError("w0", f"w0 is already optimal (L(w0) − L* = {gap0:.3g}); "
                             "relative suboptimality is undefined")
        self.gap0, self.tol = float(gap0), tol
        self.losses = [float(f0)]
        self.rel = [1.0]
        self.t0 = time.perf_counter()

    def push(self, f: float, gap: float) -> bool:
        self.losses.append(float(f))
        self.rel.append(float(gap) / self.gap0)
        return self.rel[-1] <= self.tol or not math.isfinite(self.rel[-1])

    @property
    def diverged(self) -> bool:
        return not math.isfinite(self.rel[-1])

    def result(self, name, cap, params, info, w) -> AttackTrajectory:
        return AttackTrajectory(name, np.asarray(self.losses), np.asarray(self.rel), cap,
                                time.perf_counter() - self.t0, params, info, w_final=np.array(w))


def _start(problem: ProbingProblem, max_steps: int, tol: float, w0):
    """Validate the run arguments; return ``(w0, L(w0), ∇L(w0), recorder)``."""
    if not isinstance(problem, ProbingProblem):
        raise TypeError(f"problem must be a ProbingProblem (see make_problem), got {type(problem).__name__}")
    if not (isinstance(max_steps, (int, np.integer)) and max_steps >= 1):
        raise ParameterError("max_steps", f"max_steps must be a positive integer, got {max_steps!r}")
    if not (tol >= 0.0 and math.isfinite(tol)):
        raise ParameterError("tol", f"tol must be a finite number >= 0, got {tol!r}")
    if w0 is None:
        w0 = np.zeros(problem.dim)
    else:
        w0 = np.array(w0, dtype=np.float64)
        if w0.shape != (problem.dim,):
            raise ParameterError("w0", f"w0 must have shape ({problem.dim},), got {w0.shape}")
        if not np.all(np.isfinite(w0)):
            raise ParameterError("w0", "w0 contains NaN or inf")
    f, g, gap = problem.evaluate(w0)
    return w0, f, g, _Recorder(f, gap, tol)


# ----------------------------------------------------------------------------------------------
# first-order attackers
# ----------------------------------------------------------------------------------------------
def _logistic_exact_step(problem: ProbingProblem, w: np.ndarray, g: np.ndarray) -> tuple[float, int]:
    """``argmin_α φ(α)``, ``φ(α) = L(w − αg)`` for the (strictly convex) ridge-logistic loss.

    Safeguarded 1-D Newton on ``φ'`` inside a sign-change bracket ``[lo, hi]`` (``φ'(0) = −‖g‖² < 0``;
    ``hi`` found by doubling from ``1/L``); every evaluation costs O(N) on the precomputed ``Zw``
    and ``Zg``. Converges to ``|φ'(α)| ≤ 1e-12·‖g‖²`` (machine-precision exact line search).
    Returns ``(α, number of φ'/φ'' evaluations)``.
    """
    z, zg, y, lam = problem.Z @ w, problem.Z @ g, problem.y, problem.ridge
    gg, wg = float(g @ g), float(w @ g)

    def d1_d2(a):
        s = scipy.special.expit(z - a * zg)
        return float(-(zg @ (s - y)) + lam * (a * gg - wg)), float((zg * zg) @ (s * (1.0 - s)) + lam * gg)

    evals, lo, hi = 0, 0.0, 1.0 / problem.smoothness
    d, dd = d1_d2(hi)
    evals += 1
    while d < 0.0:                       # φ' < 0 at hi: the minimiser lies further out
        lo, hi = hi, 2.0 * hi
        d, dd = d1_d2(hi)
        evals += 1
    a = hi
    for _ in range(100):
        if abs(d) <= 1e-12 * gg or hi - lo <= 1e-15 * hi:
            break
        if d > 0.0:
            hi = a
        else:
            lo = a
        a_new = a - d / dd
        a = a_new if lo < a_new < hi else 0.5 * (lo + hi)
        d, dd = d1_d2(a)
        evals += 1
    return a, evals


@bounded_blas
def attack_gd_exact(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6,
                    w0=None) -> AttackTrajectory:
    """GD with exact line search — the paper's prober (Figure 1; docs/theory.md §5 "exact line search").

    ``w ← w − α g`` with ``α = argmin_α L(w − α g)``. For least squares the minimiser is
    ``α = gᵀg / gᵀ(ZᵀZ)g = ‖g‖² / ‖Zg‖²`` (Hessian of the halved loss; the un-halved form gives
    ``α/2`` and the same iterates). For logistic, ``φ(α)`` is minimised to machine precision by
    :func:`_logistic_exact_step` (O(N) per evaluation). One step = one gradient (+ one ``Zg``).
    """
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    if problem.loss == "lsq":
        # The shared loop of pycore.probe (residual by recurrence; the gap is recomputed exactly).
        for w, _, _ in itertools.islice(exact_line_search_steps(*problem.work, w), max_steps):
            f, _, gap = problem.evaluate(w)
            if rec.push(f, gap):
                break
        return rec.result("gd_exact", max_steps, {"step": "exact line search"}, {}, w)
    line_evals = 0
    for _ in range(max_steps):
        if float(g @ g) == 0.0:
            break
        alpha, n = _logistic_exact_step(problem, w, g)
        line_evals += n
        w = w - alpha * g
        f, g, gap = problem.evaluate(w)
        if rec.push(f, gap):
            break
    return rec.result("gd_exact", max_steps, {"step": "exact line search"},
                      {"line_search_evals": line_evals}, w)


@bounded_blas
def attack_gd_constant(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6,
                       w0=None, step_factor: float = 1.0) -> AttackTrajectory:
    """GD with constant step ``c/L``, ``c = step_factor`` ∈ (0, 2) (Eq. (2) for c = 1:
    ``‖w_t − w*‖² ≤ (1 − 1/κ)^t ‖w₀ − w*‖²``; every c < 2 converges on a quadratic).

    ``L = ‖Z‖₂²`` (lsq) or ``‖Z‖₂²/4 + λ`` (logistic). One step = one gradient.
    """
    check_number(step_factor, "step_factor", low=0.0, high=2.0, low_open=True, high_open=True)
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    step = step_factor / problem.smoothness
    for _ in range(max_steps):
        w = w - step * g
        f, g, gap = problem.evaluate(w)
        if rec.push(f, gap):
            break
    return rec.result("gd_constant", max_steps, {"step": step, "step_factor": step_factor}, {}, w)


@bounded_blas
def attack_heavy_ball(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6,
                      w0=None, mu_factor: float = 1.0) -> AttackTrajectory:
    """Polyak's heavy ball ``w_{t+1} = w_t − α∇L(w_t) + β(w_t − w_{t−1})`` with the optimal
    quadratic tuning ``α = 4/(√L + √μ)²``, ``β = ((√κ − 1)/(√κ + 1))²`` (rate ``(√κ−1)/(√κ+1)``
    on quadratics, Polyak 1964). μ is over ``range(Zᵀ)`` (rank-deficient Z is normal); a
    MIS-tuned attacker uses ``μ̂ = mu_factor·μ`` (capped at L) in place of μ. Heavy ball
    has no global guarantee on non-quadratic losses: on logistic it is run as is, and a
    divergence is reported in ``info``. One step = one gradient.
    """
    check_number(mu_factor, "mu_factor", low=0.0, low_open=True)
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    L, mu = problem.smoothness, min(problem.strong_convexity * mu_factor, problem.smoothness)
    sq = math.sqrt(L / mu)
    alpha = 4.0 / (math.sqrt(L) + math.sqrt(mu)) ** 2
    beta = ((sq - 1.0) / (sq + 1.0)) ** 2
    w_prev = w
    for _ in range(max_steps):
        w, w_prev = w - alpha * g + beta * (w - w_prev), w
        f, g, gap = problem.evaluate(w)
        if rec.push(f, gap):
            break
    return rec.result("heavy_ball", max_steps, {"alpha": alpha, "beta": beta, "L": L, "mu": mu,
                                                "mu_factor": mu_factor},
                      {"diverged": rec.diverged}, w)


@bounded_blas
def attack_nesterov(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6,
                    w0=None, mu_factor: float = 1.0) -> AttackTrajectory:
    """Nesterov's accelerated gradient for μ-strongly convex, L-smooth functions (constant
    momentum): ``v = w_t + β(w_t − w_{t−1})``, ``w_{t+1} = v − ∇L(v)/L``,
    ``β = (√κ − 1)/(√κ + 1)``; rate ``1 − 1/√κ`` (Nesterov 2004, Thm 2.2.3); mis-tuned with
    ``μ̂ = mu_factor·μ`` (capped at L). One step = one gradient (at v; recording ``L(w_t)`` costs
    an extra evaluation that is not counted).
    """
    check_number(mu_factor, "mu_factor", low=0.0, low_open=True)
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    L, mu = problem.smoothness, min(problem.strong_convexity * mu_factor, problem.smoothness)
    sq = math.sqrt(L / mu)
    beta = (sq - 1.0) / (sq + 1.0)
    w_prev = w
    for _ in range(max_steps):
        v = w + beta * (w - w_prev)
        _, gv = problem.value_grad(v)
        w, w_prev = v - gv / L, w
        f, _, gap = problem.evaluate(w)
        if rec.push(f, gap):
            break
    return rec.result("nesterov", max_steps, {"step": 1.0 / L, "beta": beta, "L": L, "mu": mu,
                                              "mu_factor": mu_factor},
                      {"diverged": rec.diverged}, w)


ADAM_LR_FACTORS: tuple[float, ...] = (1e-1, 1e-2, 1e-3, 1e-4)


@bounded_blas
def attack_adam(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6, w0=None,
                lr_factors=ADAM_LR_FACTORS, betas=(0.9, 0.999), eps: float = 1e-8) -> AttackTrajectory:
    """Adam (Kingma & Ba 2015; PyTorch defaults β = (0.9, 0.999), ε = 1e-8, bias-corrected),
    swept over learning rates ``lr = c · max|w₀ − w*|`` for ``c`` in ``lr_factors``.

    Adam moves each coordinate by ~lr per step whatever the gradient scale, so the grid is in
    units of the distance to the solution (oracle knowledge: a real attacker tunes lr; handing
    them the right scale is the defender's worst case, and makes the sweep invariant to a
    rescaling ``θ → cθ``). All learning rates run together as the columns of one D×m block, one
    gradient each per step; the sweep stops when the first column reaches ``tol`` (no other
    column can then beat it on any ε ≥ tol) or at the cap. The returned trajectory is the run
    that gets deepest soonest; the others are in ``sweep``, and :meth:`AttackTrajectory.steps_to`
    takes the per-ε minimum over all of them.
    """
    w0, f0, _, rec0 = _start(problem, max_steps, tol, w0)
    lr_factors = tuple(float(c) for c in lr_factors)
    if not lr_factors or not all(0 < c < np.inf for c in lr_factors):
        raise ParameterError("lr_factors",
                             f"lr_factors must be a non-empty list of positive numbers, got {lr_factors}")
    b1, b2 = (float(b) for b in betas)
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ParameterError("betas", f"betas must lie in [0, 1), got {betas}")
    check_number(eps, "eps", low=0.0, low_open=True)
    scale = float(np.max(np.abs(w0 - problem.w_star)))
    lrs = np.array(lr_factors) * (scale if scale > 0 else 1.0)
    m_cols = lrs.size
    W = np.repeat(w0[:, None], m_cols, axis=1)
    M, V = np.zeros_like(W), np.zeros_like(W)
    losses, rel = [np.full(m_cols, float(f0))], [np.ones(m_cols)]
    _, G, _ = problem.evaluate(W)
    for t in range(1, max_steps + 1):
        M = b1 * M + (1.0 - b1) * G
        V = b2 * V + (1.0 - b2) * (G * G)
        W = W - lrs * (M / (1.0 - b1 ** t)) / (np.sqrt(V / (1.0 - b2 ** t)) + eps)
        F, G, gap = problem.evaluate(W)
        losses.append(np.asarray(F, dtype=float))
        rel.append(np.asarray(gap, dtype=float) / rec0.gap0)
        if np.any(rel[-1] <= tol):
            break
    losses, rel = np.array(losses), np.array(rel)
    wall = time.perf_counter() - rec0.t0
    runs = [AttackTrajectory("adam", losses[:, j], rel[:, j], max_steps, wall,
                             {"lr": float(lrs[j]), "lr_factor": lr_factors[j], "betas": (b1, b2), "eps": eps},
                             {}, w_final=W[:, j].copy()) for j in range(m_cols)]

    def key(r):   # deepest decade reached (NaN/inf = diverged sorts last), then earliest arrival
        finite = r.rel_subopt[np.isfinite(r.rel_subopt)]
        best = float(np.min(finite)) if finite.size else math.inf
        level = math.floor(math.log10(best)) if 0 < best < math.inf else (-400 if best <= 0 else 400)
        return (level, r.own_steps_to(10.0 ** (level + 1)) or 0)

    order = sorted(range(m_cols), key=lambda j: key(runs[j]))
    kept = runs[order[0]]
    kept.sweep = tuple(runs[j] for j in order[1:])
    kept.info = {"lr_scale": scale, "lr_grid": lrs.tolist()}
    return kept


# ----------------------------------------------------------------------------------------------
# Krylov / quasi-Newton / second-order attackers
# ----------------------------------------------------------------------------------------------
@bounded_blas
def attack_cg(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6,
              w0=None) -> AttackTrajectory:
    """Conjugate gradients.

    Least squares: CGLS — CG on the normal equations ``ZᵀZ w = Zᵀy`` applied through Z and Zᵀ
    without forming ZᵀZ (Hestenes & Stiefel 1952; Björck 1996 §7.4). From ``w₀ = 0`` it converges
    to the minimum-norm solution for rank-deficient Z; its error contracts like
    ``2((√κ−1)/(√κ+1))^t`` and it terminates in at most (number of distinct nonzero eigenvalues of
    ZᵀZ) steps in exact arithmetic. One step = one product with Z and one with Zᵀ.

    Logistic: SciPy's nonlinear CG (Polak–Ribière with a Wolfe line search,
    ``scipy.optimize.minimize(method="CG")``, ``gtol = 0``); one step = one CG iteration (its
    function/gradient evaluations are in ``info``).
    """
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    if problem.loss == "logistic":
        return _scipy_attack(problem, "CG", "cg", w, rec, max_steps, {"gtol": 0.0})
    Z, yw = problem.work
    r = yw - Z @ w                              # residual of Zw ≈ y
    s = -g                                      # = Zᵀr, the steepest-descent direction
    p = s.copy()
    gamma = float(s @ s)
    message = "max_steps reached"
    for _ in range(max_steps):
        q = Z @ p
        qq = float(q @ q)
        if gamma == 0.0 or qq == 0.0:
            message = "exact solution reached (zero gradient or direction)"
            break
        a = gamma / qq
        w = w + a * p
        r = r - a * q                            # recurrence, as CGLS does; the gap is recomputed
        s = Z.T @ r
        gamma_new = float(s @ s)
        p = s + (gamma_new / gamma) * p
        gamma = gamma_new
        f, _, gap = problem.evaluate(w)          # exact bookkeeping (not counted as work)
        if rec.push(f, gap):
            message = "tol reached"
            break
    return rec.result("cg", max_steps, {"variant": "CGLS"}, {"message": message}, w)


def _scipy_attack(problem, method, name, w, rec, max_steps, options):
    calls = {"fg": 0}

    def fun(x):
        calls["fg"] += 1
        f, g = problem.value_grad(x)
        return float(f), g

    last = {"w": w}

    def callback(intermediate_result):
        last["w"] = intermediate_result.x.copy()
        _, _, gap = problem.evaluate(intermediate_result.x)
        if rec.push(intermediate_result.fun, gap):
            raise StopIteration

    res = scipy.optimize.minimize(fun, w, jac=True, method=method, callback=callback,
                                  options={"maxiter": max_steps, **options})
    return rec.result(name, max_steps, {"method": method, **options},
                      {"fun_grad_evals": calls["fg"], "message": str(res.message)}, last["w"])


@bounded_blas
def attack_lbfgs(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6,
                 w0=None, memory: int = 10) -> AttackTrajectory:
    """L-BFGS (``scipy.optimize.minimize(method="L-BFGS-B")``, no bounds, memory ``memory``),
    with SciPy's own stopping tests disabled (``ftol = gtol = 0``) so that it runs to ``tol`` or
    the cap — or until SciPy's line search fails at the float64 floor (the message is in
    ``info``). One step = one iteration (its function/gradient evaluations are in ``info``).
    """
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    return _scipy_attack(problem, "L-BFGS-B", "lbfgs", w, rec, max_steps,
                         {"maxcor": int(memory), "ftol": 0.0, "gtol": 0.0, "maxfun": 10 * max_steps + 100})


@bounded_blas
def attack_closed_form(problem: ProbingProblem, *, max_steps: int = 1, tol: float = 1e-6,
                       w0=None) -> AttackTrajectory:
    """The closed-form least-squares solve ``w = lstsq(Z, y)`` (LAPACK ``gelsd``: SVD, minimum
    norm), counted as ONE step whatever ``max_steps``. Its cost, O(N·D²), does not depend on κ —
    only its accuracy does (relative error ~κ(Z)·eps) — so immunization cannot slow it. Least
    squares only; the logistic counterpart is :func:`attack_newton`.
    """
    if isinstance(problem, ProbingProblem) and problem.loss != "lsq":
        raise ParameterError("loss", "closed_form is the least-squares attacker; "
                                     "use attack_newton for logistic")
    _, _, _, rec = _start(problem, 1, tol, w0)
    w = np.linalg.lstsq(problem.Z, problem.y, rcond=None)[0]
    f, _, gap = problem.evaluate(w)
    rec.push(f, gap)
    return rec.result("closed_form", 1, {"solver": "numpy.linalg.lstsq"}, {}, w)


@bounded_blas
def attack_newton(problem: ProbingProblem, *, max_steps: int = 100, tol: float = 1e-6,
                  w0=None) -> AttackTrajectory:
    """Damped Newton (exact Hessian ``ZᵀDZ + λI``, Cholesky solve, Armijo backtracking) — the
    second-order attacker for logistic probing (the logistic analogue of the closed-form solve;
    quadratically convergent near ``w*``, so κ barely matters). One step = one Hessian solve,
    O(N·D² + D³). For least squares, Newton from any point is the closed form (one step).
    """
    if isinstance(problem, ProbingProblem) and problem.loss == "lsq":
        return attack_closed_form(problem, tol=tol, w0=w0)
    w, f, g, rec = _start(problem, max_steps, tol, w0)

    def callback(w_new):
        _, _, gap = problem.evaluate(w_new)
        return rec.push(gap + problem.L_star, gap)

    w, info = _newton(problem, w, tol=0.0, max_iter=max_steps, callback=callback)
    return rec.result("newton", max_steps, {"solver": "damped Newton, Cholesky"}, info, w)


# ----------------------------------------------------------------------------------------------
# adaptive attackers that know the defense: preconditioning by what they can estimate
# ----------------------------------------------------------------------------------------------
def jacobi_scaling(Z, *, curvature: float = 1.0, ridge: float = 0.0) -> np.ndarray:
    """``diag(c·ZᵀZ + λI)^{-½}`` as a vector (1 where an entry is zero): the Jacobi preconditioner
    of the probing Hessian, which an attacker reads off their own features. Least squares:
    ``c = 1, λ = 0`` (``ZᵀZ``); logistic: the Hessian at w = 0, ``c = σ'(0) = ¼`` plus the ridge λ
    (without λ a pixel that is almost never inked would get a huge scale and the ridge term
    ``λ‖w‖²`` would become ill-conditioned in the scaled variables)."""
    d = curvature * np.sum(np.asarray(Z, dtype=np.float64) ** 2, axis=0) + ridge
    out = np.ones_like(d)
    pos = d > 0
    out[pos] = 1.0 / np.sqrt(d[pos])
    return out


def _jacobi_of(problem: ProbingProblem) -> np.ndarray:
    if problem.loss == "lsq":
        return jacobi_scaling(problem.Z)
    return jacobi_scaling(problem.Z, curvature=0.25, ridge=problem.ridge)


def whitening_preconditioner(Z_est, ridge_rel: float = 1e-8) -> np.ndarray:
    """``P = (Σ̂₊ + δI)⁻¹``: ``Σ̂ = Z_estᵀZ_est/n`` is the feature covariance the attacker estimates
    on their own rows ``Z_est``, ``δ = ridge_rel·λ_max(Σ̂)``, and ``Σ̂₊`` is Σ̂ with its numerically
    zero eigenvalues (rank rule of docs/theory.md §2 on Z_est) raised to its smallest nonzero one.
    Σ̂ is singular whenever n < D or the features are rank deficient; a bare ``(Σ̂ + δI)⁻¹`` would
    then amplify round-off in the directions the rows never vary in by 1/δ (the logistic ridge
    term reads them). Formed from ``eigh`` of Σ̂: symmetric positive definite."""
    Z_est = as_float_matrix(Z_est, "Z_est")
    check_number(ridge_rel, "ridge_rel", low=0.0, low_open=True)
    S = Z_est.T @ Z_est / Z_est.shape[0]
    lam, U = np.linalg.eigh(0.5 * (S + S.T))
    top = max(float(lam[-1]), np.finfo(float).tiny)
    sv = np.linalg.svd(Z_est, compute_uv=False)
    rank = int(np.sum(sv > rank_tolerance(sv[0], Z_est.shape))) if sv[0] > 0 else 0
    zero = np.arange(lam.size) < lam.size - rank          # eigh sorts ascending: the first D − rank
    floor = float(lam[lam.size - rank]) if rank else top
    lam = np.where(zero, floor, lam)
    return (U / (lam + ridge_rel * top)) @ U.T


@bounded_blas
def attack_whiten(problem: ProbingProblem, Z_est=None, *, ridge_rel: float = 1e-8, max_steps: int = 20000,
                  tol: float = 1e-6, w0=None, estimated_on: str = "own rows") -> AttackTrajectory:
    """The whitening attacker: preconditioned GD with exact line search,
    ``w ← w − α P∇L(w)``, ``P = (Σ̂ + δI)⁻¹`` from :func:`whitening_preconditioner` on ``Z_est``
    (default: the probed rows themselves, ``problem.Z``), ``α = argmin_α L(w − αP∇L)``.

    Why it defeats conditioning: for an invertible θ the features are ``Z = Xθ`` and
    ``Σ̂(θ) = θᵀΣ̂(I)θ``, so ``P(θ)∇²L(θ) = θ⁻¹ P(I)∇²L(I) θ`` (δ → 0): the preconditioned Hessian
    is similar to the one on θ = I, whatever θ — every κ the defender changed cancels, and an
    orthogonal hardening is a special case. With ``Z_est = problem.Z`` this is Newton's method
    for least squares up to δ (one step); with fewer rows (``estimated_on`` says which) it is a
    GD whose rate depends only on how well Σ̂ estimates the probed covariance. One step = one
    gradient (+ one product with P, a D×D matrix formed once, O(n·D² + D³)).
    """
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    P = whitening_preconditioner(problem.Z if Z_est is None else Z_est, ridge_rel)
    Zw, _ = problem.work
    for _ in range(max_steps):
        d = P @ g
        gd = float(g @ d)
        if not gd > 0.0:
            break
        if problem.loss == "lsq":
            zd = Zw @ d
            alpha = gd / float(zd @ zd)
        else:
            alpha, _ = _logistic_exact_step(problem, w, d)
        w = w - alpha * d
        f, g, gap = problem.evaluate(w)
        if rec.push(f, gap):
            break
    n_est = problem.Z.shape[0] if Z_est is None else np.asarray(Z_est).shape[0]
    return rec.result("whiten", max_steps, {"ridge_rel": ridge_rel, "estimated_on": estimated_on,
                                            "n_est": int(n_est), "inner": "GD, exact line search"}, {}, w)


@bounded_blas
def attack_pcg_jacobi(problem: ProbingProblem, *, max_steps: int = 20000, tol: float = 1e-6,
                      w0=None) -> AttackTrajectory:
    """Jacobi-preconditioned conjugate gradients: CG in the variables ``u = S⁻¹w``,
    ``S = diag(∇²L)^{-½}`` (:func:`jacobi_scaling`; least squares: the features ``ZS`` have unit
    columns; logistic: the Hessian at w = 0, ridge included). Least squares: CGLS on ``(ZS, y)``
    (the same objective: ``ZSu = Zw``); logistic: SciPy's nonlinear CG on ``u ↦ L(Su)`` (the same
    function of w, ridge included).
    A diagonal preconditioner, so the axis alignment of the features is what it exploits;
    with an equal diagonal (``pycore.harden`` "equalize") S is a multiple of I and this is CG.
    """
    w, f, g, rec = _start(problem, max_steps, tol, w0)
    s = _jacobi_of(problem)
    if problem.loss == "lsq":
        # the same objective (ZS·u = Z·w) and the same minimum L*, hence the same gaps
        scaled = make_problem(problem.Z * s, problem.y, "lsq")
        inner = attack_cg(scaled, max_steps=max_steps, tol=tol, w0=w / s)
        return AttackTrajectory("pcg_jacobi", inner.losses, inner.rel_subopt, max_steps, inner.wall_seconds,
                                {"preconditioner": "Jacobi diag(ZᵀZ)^-1", "variant": "CGLS on ZS"},
                                inner.info, w_final=None if inner.w_final is None else inner.w_final * s)
    calls = {"fg": 0}

    def fun(u):
        calls["fg"] += 1
        fw, gw = problem.value_grad(s * u)
        return float(fw), s * gw

    last = {"w": w}

    def callback(intermediate_result):
        last["w"] = s * intermediate_result.x
        _, _, gap = problem.evaluate(last["w"])
        if rec.push(intermediate_result.fun, gap):
            raise StopIteration

    res = scipy.optimize.minimize(fun, w / s, jac=True, method="CG", callback=callback,
                                  options={"maxiter": max_steps, "gtol": 0.0})
    return rec.result("pcg_jacobi", max_steps, {"preconditioner": "Jacobi diag(ZᵀZ)^-1",
                                                "variant": "Polak–Ribière CG on u ↦ L(Su)"},
                      {"fun_grad_evals": calls["fg"], "message": str(res.message)}, last["w"])


# ----------------------------------------------------------------------------------------------
# sweeps: many configurations of one family as the columns of one block (one product per step)
# ----------------------------------------------------------------------------------------------
MOMENTUM_KINDS = ("gd_constant", "heavy_ball", "nesterov", "nesterov_convex")
ADAPTIVE_KINDS = ("adam", "adagrad")
# a column whose suboptimality grew by this factor has diverged (stopped, reported in info)
_DIVERGED = 1e12


def _momentum_coefficients(problem: ProbingProblem, cfg: dict) -> tuple[float, float, bool]:
    """``(α, β, convex_schedule)`` of ``w_{t+1} = w_t − α∇L(v_t) + β(w_t − w_{t−1})``,
    ``v_t = w_t + γ(w_t − w_{t−1})`` (γ = β for Nesterov, 0 otherwise)."""
    kind = cfg["attacker"]
    L = problem.smoothness
    mu = min(problem.strong_convexity * float(cfg.get("mu_factor", 1.0)), L)
    if kind == "gd_constant":
        if "step" in cfg and cfg["step"] == "2/(L+mu)":
            return 2.0 / (L + problem.strong_convexity), 0.0, False
        c = check_number(cfg.get("step_factor", 1.0), "step_factor", low=0.0, high=2.0, low_open=True,
                         high_open=True)
        return c / L, 0.0, False
    sq = math.sqrt(L / mu)
    if kind == "heavy_ball":
        return 4.0 / (math.sqrt(L) + math.sqrt(mu)) ** 2, ((sq - 1.0) / (sq + 1.0)) ** 2, False
    if kind == "nesterov":
        return 1.0 / L, (sq - 1.0) / (sq + 1.0), False
    if kind == "nesterov_convex":          # β_t = (t − 1)/(t + 2): needs no μ (Nesterov 1983)
        return 1.0 / L, 0.0, True
    raise ParameterError("attacker", f"unknown momentum attacker {kind!r}; choose from {MOMENTUM_KINDS}")


class _Block:
    """Per-column bookkeeping of a sweep: the loss and relative suboptimality of every step until
    each column reaches ``tol``, diverges or hits the cap; finished columns leave the active set.
    Rows are stored in chunks (vectorised: no Python loop over columns per step)."""

    _CHUNK = 4096

    def __init__(self, m, f0, gap0, tol):
        self.m, self.gap0, self.tol = m, gap0, tol
        self.active = np.arange(m)
        self.diverged = np.zeros(m, dtype=bool)
        self.stop = np.full(m, -1)               # index of each column's last recorded step
        self.rel_chunks, self.loss_chunks = [], []
        self.t = 0
        self._new_chunk()
        self.rel_chunks[0][0] = 1.0
        self.loss_chunks[0][0] = f0

    def _new_chunk(self):
        self.rel_chunks.append(np.full((self._CHUNK, self.m), np.nan))
        self.loss_chunks.append(np.full((self._CHUNK, self.m), np.nan))

    def push(self, F, gap) -> np.ndarray:
        """Record one step of the active columns; returns the mask of those that continue."""
        self.t += 1
        c, row = divmod(self.t, self._CHUNK)
        if c == len(self.rel_chunks):
            self._new_chunk()
        r = np.asarray(gap, dtype=float) / self.gap0
        a = self.active
        self.rel_chunks[c][row, a] = r
        self.loss_chunks[c][row, a] = F
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(r) | (r > _DIVERGED)
            done = bad | (r <= self.tol)
        self.diverged[a[bad]] = True
        self.stop[a[done]] = self.t
        keep = ~done
        self.active = a[keep]
        return keep

    def column(self, j):
        """``(losses, rel)`` of column j, steps 0..its last."""
        end = self.stop[j] if self.stop[j] >= 0 else self.t
        rel = np.concatenate([ch[:, j] for ch in self.rel_chunks])[: end + 1]
        loss = np.concatenate([ch[:, j] for ch in self.loss_chunks])[: end + 1]
        return loss, rel


def _block_start(problem, configs, max_steps, tol, w0):
    if not configs:
        raise ParameterError("configs", "a sweep needs at least one configuration")
    w0, f0, _, rec = _start(problem, max_steps, tol, w0)
    return w0, f0, rec


def _block_ops(problem: ProbingProblem):
    """``(grad(W), value_gap(W))`` on a block of columns. Least squares: from the working form
    ``(R, Qᵀy)`` with the cancellation-free gap of :meth:`ProbingProblem.evaluate` (the same
    numbers, fewer temporaries); logistic: :meth:`ProbingProblem.evaluate`."""
    if problem.loss != "lsq":
        def grad(W):
            return problem.evaluate(W)[1]

        def value_gap(W):
            F, _, gap = problem.evaluate(W)
            return F, gap
        return grad, value_gap
    Zw, yw = problem.work
    rs = problem.r_star

    def grad(W):
        return Zw.T @ (Zw @ W - yw[:, None])

    def value_gap(W):
        e = Zw @ W - yw[:, None] - rs[:, None]
        gap = 0.5 * np.einsum("ij,ij->j", e, e) + rs @ e
        return gap + problem.L_star, gap
    return grad, value_gap


@bounded_blas
def sweep_momentum(problem: ProbingProblem, configs, *, max_steps: int = 20000, tol: float = 1e-6,
                   w0=None) -> list[AttackTrajectory]:
    """GD with a constant step, heavy ball and Nesterov, tuned or mis-tuned, as the columns of
    one block: the same iterations as :func:`attack_gd_constant`, :func:`attack_heavy_ball` and
    :func:`attack_nesterov` (tested), one trajectory per configuration.

    ``configs``: dicts with ``attacker`` ∈ :data:`MOMENTUM_KINDS` and ``step_factor`` (GD, step
    ``c/L``; or ``step="2/(L+mu)"``, the optimal constant step on a quadratic) or ``mu_factor``
    (heavy ball / Nesterov tuned to ``μ̂ = mu_factor·μ``; ``nesterov_convex`` uses
    ``β_t = (t−1)/(t+2)`` and needs no μ). Each column runs until it reaches ``tol``, diverges
    (suboptimality ×1e12) or hits ``max_steps``.
    """
    w0, f0, rec = _block_start(problem, configs, max_steps, tol, w0)
    coef = [_momentum_coefficients(problem, c) for c in configs]
    alpha = np.array([c[0] for c in coef])
    beta = np.array([c[1] for c in coef])
    convex = np.array([c[2] for c in coef])
    gamma = np.where(np.array([c["attacker"] == "nesterov" for c in configs]), beta, 0.0)
    m = len(configs)
    W = np.repeat(w0[:, None], m, axis=1)
    Wp = W.copy()
    blk = _Block(m, f0, rec.gap0, tol)
    grad, value_gap = _block_ops(problem)
    t0 = time.perf_counter()
    for t in range(1, max_steps + 1):
        a = blk.active
        if a.size == 0:
            break
        b_t = np.where(convex[a], (t - 1.0) / (t + 2.0), beta[a])
        g_t = np.where(convex[a], b_t, gamma[a])
        D = W - Wp
        G = grad(W + g_t * D)
        W, Wp = W - alpha[a] * G + b_t * D, W
        F, gap = value_gap(W)
        keep = blk.push(np.atleast_1d(F), np.atleast_1d(gap))
        if not keep.all():
            W, Wp = W[:, keep], Wp[:, keep]
    wall = time.perf_counter() - t0
    out = []
    for j, c in enumerate(configs):
        params = dict(c)
        params.update(alpha=float(alpha[j]), beta=float(beta[j]) if not convex[j] else "(t-1)/(t+2)")
        loss, rel = blk.column(j)
        out.append(AttackTrajectory(c["attacker"], loss, rel, max_steps, wall, params,
                                    {"diverged": bool(blk.diverged[j])}))
    return out


@bounded_blas
def sweep_adaptive(problem: ProbingProblem, configs, *, max_steps: int = 20000, tol: float = 1e-6,
                   w0=None, eps: float = 1e-8) -> list[AttackTrajectory]:
    """Adam and Adagrad over a grid, as the columns of one block (per-coordinate step sizes: the
    diagonal-preconditioner family that axis-aligned features favour).

    ``configs``: dicts with ``attacker`` ∈ :data:`ADAPTIVE_KINDS`, ``lr_factor`` (the learning
    rate is ``lr_factor·max|w₀ − w*|``, as in :func:`attack_adam`: oracle scale, the defender's
    worst case, invariant to θ → cθ) and for Adam ``betas`` = (β₁, β₂) (bias-corrected; β₁ = 0 is
    RMSprop with bias correction). Adagrad: ``w ← w − lr·g/(√(Σg²) + ε)``. Each column runs until
    ``tol``, divergence or ``max_steps``; the same Adam iteration as :func:`attack_adam` (tested).
    """
    w0, f0, rec = _block_start(problem, configs, max_steps, tol, w0)
    check_number(eps, "eps", low=0.0, low_open=True)
    kinds = [c["attacker"] for c in configs]
    bad = [k for k in kinds if k not in ADAPTIVE_KINDS]
    if bad:
        raise ParameterError("attacker",
                             f"unknown adaptive attacker {bad[0]!r}; choose from {ADAPTIVE_KINDS}")
    scale = float(np.max(np.abs(w0 - problem.w_star)))
    scale = scale if scale > 0 else 1.0
    lr = scale * np.array([check_number(c["lr_factor"], "lr_factor", low=0.0, low_open=True)
                           for c in configs])
    ada = np.array([k == "adagrad" for k in kinds])
    b1 = np.array([0.0 if k == "adagrad" else float(c["betas"][0]) for k, c in zip(kinds, configs)])
    b2 = np.array([0.0 if k == "adagrad" else float(c["betas"][1]) for k, c in zip(kinds, configs)])
    for b in (*b1, *b2):
        check_number(b, "betas", low=0.0, high=1.0, high_open=True)
    m = len(configs)
    W = np.repeat(w0[:, None], m, axis=1)
    M, Vs = np.zeros_like(W), np.zeros_like(W)
    blk = _Block(m, f0, rec.gap0, tol)
    grad, value_gap = _block_ops(problem)
    G = grad(W)
    t0 = time.perf_counter()
    for t in range(1, max_steps + 1):
        a = blk.active
        if a.size == 0:
            break
        M = b1[a] * M + (1.0 - b1[a]) * G
        G2 = G * G
        Vs = np.where(ada[a], Vs + G2, b2[a] * Vs + (1.0 - b2[a]) * G2)
        c2 = np.where(ada[a], 1.0, 1.0 - b2[a] ** t)
        W = W - (lr[a] / (1.0 - b1[a] ** t)) * M / (np.sqrt(Vs / c2) + eps)
        F, gap = value_gap(W)
        keep = blk.push(np.atleast_1d(F), np.atleast_1d(gap))
        if not keep.all():
            W, M, Vs = W[:, keep], M[:, keep], Vs[:, keep]
        G = grad(W)
    wall = time.perf_counter() - t0
    out = []
    for j, c in enumerate(configs):
        params = dict(c)
        params.update(lr=float(lr[j]), eps=eps)
        loss, rel = blk.column(j)
        out.append(AttackTrajectory(c["attacker"], loss, rel, max_steps, wall, params,
                                    {"diverged": bool(blk.diverged[j]), "lr_scale": scale}))
    return out


ATTACKERS: dict[str, Callable[..., AttackTrajectory]] = {
    "gd_exact": attack_gd_exact,
    "gd_constant": attack_gd_constant,
    "heavy_ball": attack_heavy_ball,
    "nesterov": attack_nesterov,
    "adam": attack_adam,
    "cg": attack_cg,
    "lbfgs": attack_lbfgs,
    "closed_form": attack_closed_form,
    "newton": attack_newton,
    "whiten": attack_whiten,
    "pcg_jacobi": attack_pcg_jacobi,
}

ATTACKER_LABELS = {
    "gd_exact": "GD, exact line search (paper)",
    "gd_constant": "GD, step 1/L",
    "heavy_ball": "heavy ball (tuned L, μ)",
    "nesterov": "Nesterov (tuned L, μ)",
    "adam": "Adam (best lr of sweep)",
    "cg": "conjugate gradient",
    "lbfgs": "L-BFGS (m=10)",
    "closed_form": "closed form (lstsq)",
    "newton": "Newton (2nd order)",
    "whiten": "whitening + GD (adaptive)",
    "pcg_jacobi": "Jacobi-preconditioned CG (adaptive)",
}


def attackers_for(loss: str) -> tuple[str, ...]:
    """The attacker names that apply to ``loss`` (closed form for lsq, Newton for logistic)."""
    if loss not in LOSSES:
        raise ParameterError("loss", f"loss must be one of {LOSSES}, got {loss!r}")
    second = "closed_form" if loss == "lsq" else "newton"
    return ("gd_exact", "gd_constant", "heavy_ball", "nesterov", "adam", "cg", "lbfgs", second)


@bounded_blas
def run_attack_suite(problem: ProbingProblem, attackers=None, *, max_steps: int = 20000,
                     tol: float = 1e-6, second_order_max_steps: int = 100) -> dict[str, AttackTrajectory]:
    """Run every attacker in ``attackers`` (default :func:`attackers_for(problem.loss)`) on
    ``problem``; returns ``{name: trajectory}``. Newton gets its own (small) cap."""
    names = attackers_for(problem.loss) if attackers is None else tuple(attackers)
    unknown = [a for a in names if a not in ATTACKERS]
    if unknown:
        raise ParameterError("attackers", f"unknown attacker(s) {unknown}; choose from {sorted(ATTACKERS)}")
    out = {}
    for name in names:
        cap = second_order_max_steps if name == "newton" else max_steps
        out[name] = ATTACKERS[name](problem, max_steps=cap, tol=tol)
    return out
