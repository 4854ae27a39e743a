"""Attackers: linear probing of frozen features ``Z = Xθ`` by a real attacker's optimisers.

The problem is a :class:`pycore.attacks.ProbingProblem`; the optimisers are those a real attacker
uses (docs/theory.md §10, docs/findings.md §4): GD pays ~κ, momentum and Krylov methods ~√κ, a
solve nothing. One engine, :func:`run_attackers`: the constant-hyper-parameter families run as
the columns of one block, the others one by one, all through one recorder of
``(L(w_t) − L*)/(L(w₀) − L*)`` from ``w₀ = 0``; :func:`attack` is a one-configuration call.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import scipy.optimize
import scipy.special

from pycore._optim import damped_newton
from pycore._probe import (
    ProbingProblem,
    exact_line_search_steps,
    jacobi_scaling,
    make_problem,
    whitening_preconditioner,
)
from pycore._threads import bounded_blas
from pycore._validation import (
    ParameterError,
    check_betas,
    check_choice,
    check_number,
)

MOMENTUM_KINDS = ("gd_constant", "heavy_ball", "nesterov", "nesterov_convex")
ADAPTIVE_KINDS = ("adam", "adagrad")
# attacker → the configuration keys it takes, with their defaults (None: none); others are refused
# by name
ATTACKERS: dict[str, dict] = {
    "gd_exact": {},
    "gd_constant": {"step_factor": 1.0, "step": None},
    "heavy_ball": {"mu_factor": 1.0},
    "nesterov": {"mu_factor": 1.0},
    "nesterov_convex": {},
    "adam": {"lr_factor": None, "betas": (0.9, 0.999)},
    "adagrad": {"lr_factor": None},
    "cg": {},
    "lbfgs": {"memory": 10},
    "pcg_jacobi": {},
    "whiten": {"rows": "all", "ridge_rel": 1e-8},
    "closed_form": {},
    "newton": {},
}
WHITEN_ROWS = ("all", "half")  # Σ̂ from all probed rows, or a random half of them
_DIVERGED = 1e12  # a run whose suboptimality grew by this factor has diverged
_GOES_ON = np.ones(1, dtype=bool)


@dataclass
class AttackTrajectory:
    """One configuration's run: ``rel_subopt[t]`` for every step t taken and what produced it."""

    attacker: str
    rel_subopt: np.ndarray
    step_cap: int
    wall_seconds: float
    params: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    w_final: np.ndarray | None = field(default=None, repr=False)

    @property
    def final_rel_subopt(self) -> float:
        return float(self.rel_subopt[-1])

    def steps_to(self, eps: float) -> int | None:
        """First step with ``rel_subopt ≤ eps``; None if not reached within the cap."""
        hit = np.flatnonzero(self.rel_subopt <= eps)
        return int(hit[0]) if hit.size else None


class _Recorder:
    """The relative suboptimality of m columns each step, recorded in chunks.

    Each column is recorded until it reaches ``tol``, diverges (non-finite or ×1e12) or hits the
    cap; the chunks spare a loop over columns.
    """

    _CHUNK = 4096

    def __init__(self, m: int, gap0: float, tol: float):
        if not gap0 > 0.0:
            raise ParameterError(
                "y", f"w = 0 is already optimal (L(0) − L* = {gap0:.3g}): nothing to probe"
            )
        self.gap0, self.tol, self.t, self.m = float(gap0), tol, 0, m
        self.active, self.stop = np.arange(m), np.full(m, -1)
        self.diverged, self.w_final = np.zeros(m, dtype=bool), [None] * m
        self.chunks = [np.full((self._CHUNK, m), np.nan)]
        self.chunks[0][0] = 1.0
        self.t0 = time.perf_counter()

    def push(self, gap, W=None) -> np.ndarray:
        """Record a step of the active columns (``W``: their iterates).

        The mask of those that go on.
        """
        self.t += 1
        c, row = divmod(self.t, self._CHUNK)
        if c == len(self.chunks):
            self.chunks.append(np.full((self._CHUNK, self.m), np.nan))
        # one attacker
        if np.ndim(gap) == 0 and self.tol < (r := float(gap) / self.gap0) <= _DIVERGED:
            self.chunks[c][row, 0] = r  # (floats: the array path costs ~10 µs a step)
            return _GOES_ON
        r = np.atleast_1d(np.asarray(gap, dtype=float)) / self.gap0
        a = self.active
        self.chunks[c][row, a] = r
        keep = (r > self.tol) & (r <= _DIVERGED)  # NaN fails both: it has finished (diverged)
        if not keep.all():
            self.diverged[a[~np.isfinite(r) | (r > _DIVERGED)]] = True
            self.stop[a[~keep]] = self.t
            for k in np.flatnonzero(~keep) if W is not None else ():
                self.w_final[a[k]] = W[:, k].copy()
            self.active = a[keep]
        return keep

    def follow(self, steps, max_steps: int, w):
        """Record the iterates ``(w, L(w) − L*)`` of ``steps`` until done; the last ``w``."""
        for _, (w, gap) in zip(range(max_steps), steps):
            if not self.push(gap).any():
                break
        return w

    def result(self, names, cap, params, infos, W) -> list[AttackTrajectory]:
        """One trajectory per column.

        ``W``: the last iterate (one attacker) or the active columns.
        """
        if W.ndim == 1:
            self.w_final[0] = np.array(W)
        else:
            for k, j in enumerate(self.active):
                self.w_final[j] = W[:, k].copy()
        wall = time.perf_counter() - self.t0
        rel = np.concatenate(self.chunks)
        ends = [(s if s >= 0 else self.t) + 1 for s in self.stop]
        return [
            AttackTrajectory(
                n,
                rel[:e, j].copy(),
                cap,
                wall,
                p,
                {**i, "diverged": bool(self.diverged[j])},
                self.w_final[j],
            )
            for j, (n, p, i, e) in enumerate(zip(names, params, infos, ends))
        ]


def _start(problem: ProbingProblem, tol: float, m: int = 1):  # (w₀ = 0, ∇L(w₀), recorder)
    w0 = np.zeros(problem.dim)
    _, g, gap = problem.evaluate(w0)
    return w0, g, _Recorder(m, gap, tol)


@bounded_blas
def run_attackers(
    problem: ProbingProblem,
    configs,
    *,
    max_steps: int = 20000,
    tol: float = 1e-6,
    rng=None,
    second_order_max_steps: int = 100,
) -> list[AttackTrajectory]:
    """One :class:`AttackTrajectory` per configuration of ``configs``, in order.

    Dicts with ``attacker`` (a key of :data:`ATTACKERS`) and its keys (defaults there):
    ``step_factor`` c ∈ (0, 2) (GD step c/L) or ``step="2/(L+mu)"``; ``mu_factor`` (tuned to μ̂ =
    mu_factor·μ); ``lr_factor`` (required) and ``betas``; ``memory``; ``rows`` and ``ridge_rel``
    (whitening), all checked before any run.  ``rng`` draws each "half" whitening's rows (default
    ``default_rng(0)``).
    """
    if not isinstance(problem, ProbingProblem):
        raise TypeError(
            f"problem must be a ProbingProblem (see make_problem), got {type(problem).__name__}"
        )
    configs = [_checked(problem, c) for c in configs]
    if not configs:
        raise ParameterError("configs", "configs needs at least one attacker configuration")
    for name, v in (("max_steps", max_steps), ("second_order_max_steps", second_order_max_steps)):
        check_number(v, name, low=1, integer=True)
    check_number(tol, "tol", low=0.0)
    rng = np.random.default_rng(0) if rng is None else rng
    out: list = [None] * len(configs)
    for kinds, sweep in ((MOMENTUM_KINDS, _sweep_momentum), (ADAPTIVE_KINDS, _sweep_adaptive)):
        idx = [i for i, c in enumerate(configs) if c["attacker"] in kinds]
        if idx:
            for i, t in zip(idx, sweep(problem, [configs[i] for i in idx], max_steps, tol)):
                out[i] = t
    for i, c in enumerate(configs):
        if out[i] is None:
            cap = second_order_max_steps if c["attacker"] == "newton" else max_steps
            out[i] = _run_single(problem, c, cap, tol, rng)
    return out


def attack(
    problem: ProbingProblem,
    attacker: str,
    *,
    max_steps: int = 20000,
    tol: float = 1e-6,
    rng=None,
    **params,
) -> AttackTrajectory:
    """One attacker configuration on a probing problem.

    Parameters
    ----------
    problem : ProbingProblem
        From :func:`make_problem`.
    attacker : str
        One of the attacker engine's names (``"gd_constant"``, ``"gd_exact"``, ``"cg"``,
        ``"adam"``, ``"whiten"``, ...; :func:`attacker_grid` lists every configuration).
    max_steps : int, default 20000
        The step cap.
    tol : float, default 1e-6
        The relative suboptimality at which the run stops.
    rng : numpy.random.Generator, optional
        For the stochastic attackers.
    **params
        The attacker's own settings (``lr_factor``, ``step_factor``, ...).

    Returns
    -------
    AttackTrajectory
        ``rel_subopt`` per step; ``steps_to(eps)`` is the first step at or below ``eps``.

    Raises
    ------
    ParameterError
        An unknown attacker or setting, or one out of its bounds; ``.parameter`` names it.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore.attacks import attack, make_problem
    >>> rng = np.random.default_rng(0)
    >>> Z = rng.standard_normal((40, 4)) * [1.0, 2.0, 4.0, 8.0]
    >>> problem = make_problem(Z, Z @ np.ones(4))
    >>> gd = attack(problem, "gd_constant", max_steps=2000, tol=1e-8)
    >>> cg = attack(problem, "cg", max_steps=2000, tol=1e-8)
    >>> gd.steps_to(1e-6), cg.steps_to(1e-6)  # GD pays κ, CG at most the dimension
    (438, 4)
    """
    return run_attackers(
        problem, [dict(params, attacker=attacker)], max_steps=max_steps, tol=tol, rng=rng
    )[0]


_RANGES = {
    "step_factor": {"low": 0.0, "high": 2.0, "low_open": True, "high_open": True},
    "mu_factor": {"low": 0.0, "low_open": True},
    "lr_factor": {"low": 0.0, "low_open": True},
    "ridge_rel": {"low": 0.0, "low_open": True},
    "memory": {"low": 1, "integer": True},
}


def _checked(problem: ProbingProblem, c) -> dict:
    """Configuration ``c`` with its defaults, every key and value checked."""
    name = c.get("attacker") if isinstance(c, dict) else None
    if name not in ATTACKERS:
        raise ParameterError(
            "attacker", f"unknown attacker {name!r}; choose from {tuple(ATTACKERS)}"
        )
    extra = sorted(set(c) - {"attacker", *ATTACKERS[name]})
    if extra:
        raise ParameterError(extra[0], f"{name} takes {list(ATTACKERS[name])}, not {extra[0]!r}")
    if name == "closed_form" and problem.loss != "mse":
        raise ParameterError(
            "attacker", "closed_form is the least-squares attacker; use newton for logistic"
        )
    c = {**{k: v for k, v in ATTACKERS[name].items() if v is not None}, **c}
    for key in set(c) & set(_RANGES) | ({"lr_factor"} if name in ADAPTIVE_KINDS else set()):
        check_number(c.get(key), key, **_RANGES[key])
    for key, choices in (("step", ("2/(L+mu)",)), ("rows", WHITEN_ROWS)):
        if key in c:
            check_choice(c[key], key, choices)
    if "betas" in c:
        c["betas"] = check_betas(c["betas"])
    return c


def _momentum_coefficients(problem: ProbingProblem, cfg: dict) -> tuple[float, float, bool]:
    """``(α, β, convex schedule)`` of a momentum method's update.

    ``(α, β, convex schedule)`` of ``w⁺ = w − α∇L(v) + β(w − w⁻)``, ``v = w + γ(w − w⁻)`` (γ = β
    for Nesterov): GD α = c/L (Eq. (2)) or 2/(L+μ); heavy ball Polyak's tuning, rate (√κ−1)/(√κ+1);
    Nesterov α = 1/L, rate 1 − 1/√κ (Thm 2.2.3), both to μ̂ = mu_factor·μ ≤ L; convex: β_t =
    (t−1)/(t+2).
    """
    kind, L = cfg["attacker"], problem.smoothness
    if kind == "gd_constant":
        if "step" in cfg:
            return 2.0 / (L + problem.strong_convexity), 0.0, False
        return cfg.get("step_factor", 1.0) / L, 0.0, False
    if kind == "nesterov_convex":
        return 1.0 / L, 0.0, True
    mu = min(problem.strong_convexity * cfg.get("mu_factor", 1.0), L)
    sq = math.sqrt(L / mu)
    if kind == "heavy_ball":
        return 4.0 / (math.sqrt(L) + math.sqrt(mu)) ** 2, ((sq - 1.0) / (sq + 1.0)) ** 2, False
    return 1.0 / L, (sq - 1.0) / (sq + 1.0), False


def _block_ops(problem: ProbingProblem):
    """``(grad(W), gap(W))`` on a D × m block (mse: the working form and gap of ``evaluate``)."""
    if problem.loss != "mse":
        return (lambda W: problem.evaluate(W)[1]), (lambda W: problem.evaluate(W)[2])
    Zw, yw = problem.work
    rs = problem.r_star

    def gap(W):
        e = Zw @ W - yw[:, None] - rs[:, None]
        return 0.5 * np.einsum("ij,ij->j", e, e) + rs @ e

    return (lambda W: Zw.T @ (Zw @ W - yw[:, None])), gap


def _sweep(
    problem, configs, max_steps, tol, update, n_state, params, infos
) -> list[AttackTrajectory]:
    """The configurations as the columns of one D × m block.

    ``S = update(t, active, grad, *S)`` a step, ``S[0]`` the iterates, every state from w₀ = 0; a
    column leaves once recorded as stopped.
    """
    w0, _, rec = _start(problem, tol, m=len(configs))
    S = [np.repeat(w0[:, None], len(configs), axis=1) for _ in range(n_state)]
    grad, block_gap = _block_ops(problem)
    for t in range(1, max_steps + 1):
        if rec.active.size == 0:
            break
        S = update(t, rec.active, grad, *S)
        keep = rec.push(block_gap(S[0]), S[0])
        if not keep.all():
            S = [X[:, keep] for X in S]
    return rec.result([c["attacker"] for c in configs], max_steps, params, infos, S[0])


def _sweep_momentum(problem, configs, max_steps, tol) -> list[AttackTrajectory]:
    """GD with a constant step, heavy ball, Nesterov (:data:`MOMENTUM_KINDS`) as one block."""
    alpha, beta, convex = (
        np.array(x) for x in zip(*(_momentum_coefficients(problem, c) for c in configs))
    )
    gamma = np.where(np.array([c["attacker"] == "nesterov" for c in configs]), beta, 0.0)

    def update(t, a, grad, W, Wp):
        b_t = np.where(convex[a], (t - 1.0) / (t + 2.0), beta[a])
        g_t = np.where(convex[a], b_t, gamma[a])
        D = W - Wp
        return W - alpha[a] * grad(W + g_t * D) + b_t * D, W

    params = [
        {**c, "alpha": float(a), "beta": "(t-1)/(t+2)" if v else float(b)}
        for c, a, b, v in zip(configs, alpha, beta, convex)
    ]
    return _sweep(problem, configs, max_steps, tol, update, 2, params, [{}] * len(configs))


def _sweep_adaptive(problem, configs, max_steps, tol, eps: float = 1e-8) -> list[AttackTrajectory]:
    """Adam and Adagrad as one block.

    Adam is bias-corrected (ε = 1e-8; β₁ = 0 is RMSprop), Adagrad is
    ``w ← w − lr·g/(√(Σg²) + ε)``. ``lr = lr_factor·max|w₀ − w*|``: Adam moves a coordinate ~lr a
    step whatever the gradient's scale, so lr is in units of the distance to w* (oracle: the
    defender's worst case; θ → cθ invariant).
    """
    ada = np.array([c["attacker"] == "adagrad" for c in configs])
    b1, b2 = (
        np.array([0.0 if k else c["betas"][i] for k, c in zip(ada, configs)]) for i in (0, 1)
    )
    scale = float(np.max(np.abs(problem.w_star)))  # w₀ = 0
    lr = (scale if scale > 0 else 1.0) * np.array([c["lr_factor"] for c in configs])

    def update(t, a, grad, W, M, Vs):
        G = grad(W)
        M = b1[a] * M + (1.0 - b1[a]) * G
        G2 = G * G
        Vs = np.where(ada[a], Vs + G2, b2[a] * Vs + (1.0 - b2[a]) * G2)
        c2 = np.where(ada[a], 1.0, 1.0 - b2[a] ** t)
        return W - (lr[a] / (1.0 - b1[a] ** t)) * M / (np.sqrt(Vs / c2) + eps), M, Vs

    params = [{**c, "lr": float(x), "eps": eps} for c, x in zip(configs, lr)]
    return _sweep(
        problem, configs, max_steps, tol, update, 3, params, [{"lr_scale": scale}] * len(configs)
    )


def _run_single(problem: ProbingProblem, c: dict, max_steps: int, tol: float, rng):
    """The attackers with no block twin.

    GD with exact line search (Figure 1), CG (CGLS; logistic: SciPy's Polak–Ribière), L-BFGS
    (SciPy, its stopping tests off), Jacobi-PCG (CG in u = S⁻¹w), whitening (exact descent along
    −P∇L: affine invariant, docs/findings.md §4), the closed form (one ``lstsq``, ONE step) and
    damped Newton (logistic; for mse the closed form).
    """
    name = c["attacker"]
    if name == "pcg_jacobi" and problem.loss == "mse":  # CGLS on ZS: the same objective (ZSu = Zw)
        s = jacobi_scaling(problem.Z)
        t = _run_single(
            make_problem(problem.Z * s, problem.y), {"attacker": "cg"}, max_steps, tol, rng
        )
        t.attacker, t.w_final, t.params = name, t.w_final * s, {"variant": "CGLS on ZS"}
        return t
    if name in ("closed_form", "newton") and problem.loss == "mse":
        name, max_steps = "closed_form", 1
    w, g, rec = _start(problem, tol)
    info = {}
    if name == "lbfgs":
        opts = {
            "maxcor": int(c["memory"]),
            "ftol": 0.0,
            "gtol": 0.0,
            "maxfun": 10 * max_steps + 100,
        }
        w, info = _scipy(problem, w, rec, max_steps, "L-BFGS-B", opts)
    elif name in ("cg", "pcg_jacobi") and problem.loss == "bce":
        s = (
            jacobi_scaling(problem.Z, curvature=0.25, ridge=problem.ridge)
            if name == "pcg_jacobi"
            else 1.0
        )
        w, info = _scipy(problem, w, rec, max_steps, "CG", {"gtol": 0.0}, s)
    elif name == "newton":

        def callback(w_new):
            return not rec.push(problem.evaluate(w_new)[2]).any()

        w, info = damped_newton(
            problem.value_grad,
            problem.value,
            problem.hessian,
            w,
            tol=0.0,
            max_iter=max_steps,
            callback=callback,
        )
    elif name == "closed_form":
        w = rec.follow([_at(problem, np.linalg.lstsq(problem.Z, problem.y, rcond=None)[0])], 1, w)
    elif name == "cg":
        w = rec.follow(_cgls(problem, w, g), max_steps, w)
    elif name == "gd_exact" and problem.loss == "mse":
        steps = (_at(problem, v) for v, _, _ in exact_line_search_steps(*problem.work, w))
        w = rec.follow(steps, max_steps, w)
    else:
        P, n = None, problem.Z.shape[0]
        if name == "whiten":  # Σ̂ from the probed rows, or a random half of them (drawn from rng)
            half = (
                np.sort(rng.permutation(n)[: max(1, n // 2)])
                if c["rows"] == "half"
                else slice(None)
            )
            P = whitening_preconditioner(problem.Z[half], c["ridge_rel"])
        w = rec.follow(_exact_descent(problem, w, g, P), max_steps, w)
    params = {k: v for k, v in c.items() if k != "attacker"}
    return rec.result([name], max_steps, [params], [info], w)[0]


def _at(problem: ProbingProblem, w):
    return w, problem.evaluate(w)[2]


def _cgls(problem: ProbingProblem, w, g):
    """CGLS (Björck 1996 §7.4): CG on ``ZᵀZw = Zᵀy`` through Z and Zᵀ, residual by recurrence."""
    Z, yw = problem.work
    r, s = yw - Z @ w, -g  # residual of Zw ≈ y, and Zᵀr
    p, gamma = s.copy(), float(s @ s)
    while True:
        q = Z @ p
        qq = float(q @ q)
        if gamma == 0.0 or qq == 0.0:  # exact solution reached
            return
        a = gamma / qq
        w = w + a * p
        r = r - a * q
        s = Z.T @ r
        gamma_new = float(s @ s)
        p = s + (gamma_new / gamma) * p
        gamma = gamma_new
        yield _at(problem, w)  # exact bookkeeping (not counted as work)


def _exact_descent(problem: ProbingProblem, w, g, P):
    """``w ← w − αd``, ``d = Pg`` (P None: g), ``α = argmin_α L(w − αd)``."""
    Zw = problem.work[0]
    while True:
        d = g if P is None else P @ g
        gd = float(g @ d)
        if not gd > 0.0:
            return
        if problem.loss == "mse":
            zd = Zw @ d
            alpha = gd / float(zd @ zd)
        else:
            alpha = _logistic_exact_step(problem, w, d)
        w = w - alpha * d
        _, g, gap = problem.evaluate(w)
        yield w, gap


def _logistic_exact_step(problem: ProbingProblem, w: np.ndarray, d: np.ndarray) -> float:
    """The exact line-search step of a logistic loss, ``argmin_α L(w − αd)``.

    Safeguarded Newton on φ' in a sign-change bracket to ``|φ'| ≤ 1e-12·‖d‖²``.
    """
    z, zd, y, lam = problem.Z @ w, problem.Z @ d, problem.y, problem.ridge
    dd_, wd = float(d @ d), float(w @ d)

    def d1_d2(a):
        s = scipy.special.expit(z - a * zd)
        return float(-(zd @ (s - y)) + lam * (a * dd_ - wd)), float(
            (zd * zd) @ (s * (1.0 - s)) + lam * dd_
        )

    lo, hi = 0.0, 1.0 / problem.smoothness
    d1, d2 = d1_d2(hi)
    while d1 < 0.0:  # φ' < 0 at hi: the minimiser lies further out
        lo, hi = hi, 2.0 * hi
        d1, d2 = d1_d2(hi)
    a = hi
    for _ in range(100):
        if abs(d1) <= 1e-12 * dd_ or hi - lo <= 1e-15 * hi:
            break
        if d1 > 0.0:
            hi = a
        else:
            lo = a
        a_new = a - d1 / d2
        a = a_new if lo < a_new < hi else 0.5 * (lo + hi)
        d1, d2 = d1_d2(a)
    return a


def _scipy(
    problem: ProbingProblem, w, rec: _Recorder, max_steps: int, method: str, options: dict, s=1.0
):
    """``scipy.optimize.minimize`` on ``u ↦ L(s·u)``, recorded at every iteration.

    ``(w, info)``.
    """

    def fun(u):
        f, g = problem.value_grad(s * u)
        return float(f), s * g

    last = [w]

    def callback(intermediate_result):
        last[0] = s * intermediate_result.x
        if not rec.push(problem.evaluate(last[0])[2]).any():
            raise StopIteration

    res = scipy.optimize.minimize(
        fun,
        w / s,
        jac=True,
        method=method,
        callback=callback,
        options={"maxiter": max_steps, **options},
    )
    return last[0], {
        "method": method,
        "fun_grad_evals": int(res.nfev),
        "message": str(res.message),
    }
