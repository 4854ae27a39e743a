"""Worst-case attack evaluation of a linear immunizer (docs/attacks.md §1).

The convention of fine-tuning-defense evaluations (Qi et al. 2024, "On evaluating the durability
of safeguards for open-weight LLMs"; the TamperBench harness): an attacker is a *family* of
optimizers swept over its hyper-parameters; for each family the best configuration counts, and
the defense is judged by the strongest attacker found, named with its configuration, never by a
single default attacker. Here an attacker probes the frozen features ``Z = Xθ`` with a linear
head (:mod:`pycore.attacks`), and its cost is the number of iterations to a relative
suboptimality ε.

* :func:`attacker_grid` — the stated grid: every family with its hyper-parameters.
* :func:`run_grid` — every configuration of the grid on one :class:`~pycore.attacks.ProbingProblem`
  (the columns of a family run together as one block); per configuration the steps to each ε.
* :func:`family_best`, :func:`worst_case` — per family the best configuration, and the
  defender's worst case: the attacker that needs the fewest steps on θ, compared with the best
  attacker on the reference θ (identity).
* :func:`kappa_bounds` — beside each family, the slow-down the condition number alone can
  force on it (docs/attacks.md §1 derives each): GD-type ~ the κ ratio, accelerated / Krylov
  ~ its square root, diagonal-preconditioned (Adam, Adagrad) ~ the ratio of the Jacobi-scaled
  κ_J, Jacobi-PCG ~ its square root, whitening, Newton and the closed form 1.
* :func:`best_so_far` — the best attacker found against the number of configurations tried, in
  random orders (TamperBench's best-so-far curves).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from pycore import attacks as A
from pycore.spectral import gram_spectrum
from pycore.threads import bounded_blas
from pycore.validation import ParameterError, check_number

__all__ = ["AttackerConfig", "FAMILIES", "FIRST_ORDER", "attacker_grid", "GridRun", "run_grid",
           "family_best", "slowdown", "worst_case", "kappa_reference", "kappa_bounds", "best_so_far"]

# family → (label, bound kind, group). Groups: "first-order" (gradients only: the paper's threat
# model), "adaptive" (also uses statistics of the attacker's own features: it knows the defense
# acts on the feature basis/conditioning), "second-order" (a solve).
FAMILIES: dict[str, tuple[str, str, str]] = {
    "gd": ("GD (exact line search; steps c/L, 2/(L+μ))", "kappa", "first-order"),
    "heavy_ball": ("heavy ball (tuned / mis-tuned μ)", "sqrt_kappa", "first-order"),
    "nesterov": ("Nesterov (tuned / mis-tuned μ; convex schedule)", "sqrt_kappa", "first-order"),
    "adam": ("Adam (lr × β grid; β₁ = 0: RMSprop)", "jacobi", "first-order"),
    "adagrad": ("Adagrad (lr grid)", "jacobi", "first-order"),
    "cg": ("conjugate gradient", "sqrt_kappa", "first-order"),
    "lbfgs": ("L-BFGS (memory grid)", "sqrt_kappa", "first-order"),
    "pcg_jacobi": ("Jacobi-preconditioned CG", "sqrt_jacobi", "adaptive"),
    "whiten": ("whitening (Σ̂ of own rows) + GD", "one", "adaptive"),
    "closed_form": ("closed-form solve (lstsq)", "one", "second-order"),
    "newton": ("Newton (2nd order)", "one", "second-order"),
}
FIRST_ORDER = tuple(f for f, v in FAMILIES.items() if v[2] == "first-order")


@dataclass(frozen=True)
class AttackerConfig:
    """One attacker configuration: its ``family`` (a key of :data:`FAMILIES`), the attacker it
    runs (``attacker``) and the hyper-parameters (``params``, sorted key/value pairs)."""

    family: str
    attacker: str
    params: tuple = ()

    @property
    def label(self) -> str:
        if not self.params:
            return self.attacker
        inner = ", ".join(f"{k}={_short(v)}" for k, v in self.params)
        return f"{self.attacker}({inner})"

    def as_dict(self) -> dict:
        return {"family": self.family, "attacker": self.attacker, "params": dict(self.params),
                "label": self.label}


def _short(v):
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple):
        return "(" + ",".join(_short(x) for x in v) + ")"
    return str(v)


def _cfg(family, attacker, **params) -> AttackerConfig:
    return AttackerConfig(family, attacker, tuple(sorted(params.items())))


# The stated grid (docs/attacks.md §1). Adam's lr is in units of max|w₀ − w*| (pycore.attacks).
GD_STEP_FACTORS = (0.5, 1.0, 1.5, 1.9)
MU_FACTORS = (0.01, 0.1, 1.0, 10.0, 100.0)      # μ̂/μ: 1 = tuned; others mis-tuned
ADAM_LR_FACTORS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4)
ADAM_BETAS = ((0.9, 0.999), (0.9, 0.99), (0.99, 0.999), (0.0, 0.999))
ADAGRAD_LR_FACTORS = (1.0, 0.3, 0.1, 0.03, 0.01)
LBFGS_MEMORY = (1, 3, 5, 10, 20, 50)
WHITEN_RIDGE = (1e-12, 1e-8, 1e-4)
WHITEN_ROWS = ("all", "half")                  # Σ̂ from all probed rows, or a random half of them


def attacker_grid(loss: str = "lsq", *, quick: bool = False) -> tuple[AttackerConfig, ...]:
    """Every configuration of every family for ``loss`` (``"lsq"``: closed form; ``"logistic"``:
    Newton). ``quick``: a small grid for smoke tests (a few configurations per family)."""
    if loss not in A.LOSSES:
        raise ParameterError("loss", f"loss must be one of {A.LOSSES}, got {loss!r}")
    steps = (1.0,) if quick else GD_STEP_FACTORS
    mus = (1.0, 0.1) if quick else MU_FACTORS
    lrs = (1e-1, 1e-2) if quick else ADAM_LR_FACTORS
    betas = ADAM_BETAS[:1] if quick else ADAM_BETAS
    g = [_cfg("gd", "gd_exact")]
    g += [_cfg("gd", "gd_constant", step_factor=c) for c in steps]
    if not quick:
        g.append(_cfg("gd", "gd_constant", step="2/(L+mu)"))
    g += [_cfg("heavy_ball", "heavy_ball", mu_factor=f) for f in mus]
    g += [_cfg("nesterov", "nesterov", mu_factor=f) for f in mus]
    g.append(_cfg("nesterov", "nesterov_convex"))
    g += [_cfg("adam", "adam", lr_factor=c, betas=b) for b in betas for c in lrs]
    g += [_cfg("adagrad", "adagrad", lr_factor=c) for c in ((1.0,) if quick else ADAGRAD_LR_FACTORS)]
    g.append(_cfg("cg", "cg"))
    g += [_cfg("lbfgs", "lbfgs", memory=m) for m in ((10,) if quick else LBFGS_MEMORY)]
    g.append(_cfg("pcg_jacobi", "pcg_jacobi"))
    g += [_cfg("whiten", "whiten", rows=r, ridge_rel=d)
          for r in (("all",) if quick else WHITEN_ROWS) for d in ((1e-8,) if quick else WHITEN_RIDGE)]
    g.append(_cfg("closed_form", "closed_form") if loss == "lsq" else _cfg("newton", "newton"))
    return tuple(g)


@dataclass
class GridRun:
    """Per configuration of a grid on one problem: steps to each ε (``None`` = not within the
    cap), the final relative suboptimality, whether it diverged; plus the problem's κ references
    (:func:`kappa_reference`) and the wall time. ``curves`` holds the per-step curves of the
    configurations named in ``keep_curves`` (for figures)."""

    configs: tuple[AttackerConfig, ...]
    eps: tuple[float, ...]
    cap: int
    steps: list[dict]
    final_rel: list[float]
    diverged: list[bool]
    kappa: dict
    wall_seconds: float
    curves: dict = field(default_factory=dict)

    def steps_of(self, i: int, eps: float) -> int | None:
        return self.steps[i][_ekey(eps)]

    def as_dict(self) -> dict:
        return {"eps": list(self.eps), "cap": self.cap, "kappa": self.kappa,
                "wall_seconds": self.wall_seconds,
                "configs": [{**c.as_dict(), "steps_to": s, "final_rel_subopt": f, "diverged": d}
                            for c, s, f, d in zip(self.configs, self.steps, self.final_rel, self.diverged)]}


def _ekey(e: float) -> str:
    return f"{e:g}"


def _whiten_rows(Z: np.ndarray, which: str, rng: np.random.Generator) -> np.ndarray:
    if which == "all":
        return Z
    if which == "half":
        n = Z.shape[0]
        return Z[np.sort(rng.permutation(n)[: max(1, n // 2)])]
    raise ParameterError("rows", f"whitening rows must be one of {WHITEN_ROWS}, got {which!r}")


@bounded_blas
def run_grid(problem: A.ProbingProblem, grid, *, eps=(1e-2, 1e-4), max_steps: int = 20000,
             rng: np.random.Generator | None = None, second_order_max_steps: int = 100,
             keep_curves=()) -> GridRun:
    """Run every configuration of ``grid`` on ``problem`` until min(eps) or ``max_steps``.

    The GD-with-constant-step, heavy-ball and Nesterov configurations run as one block
    (:func:`pycore.attacks.sweep_momentum`), Adam and Adagrad as another
    (:func:`pycore.attacks.sweep_adaptive`); every column runs to the tolerance or the cap on its
    own, so each configuration's steps are its own. ``rng`` draws the random half of the rows a
    "half" whitening attacker estimates Σ̂ on (default: ``default_rng(0)``).
    """
    grid = tuple(grid)
    if not grid:
        raise ParameterError("grid", "the attacker grid is empty")
    eps = tuple(sorted({float(check_number(e, "eps", low=0.0, high=1.0, low_open=True, high_open=True))
                        for e in eps}, reverse=True))
    check_number(max_steps, "max_steps", low=1, integer=True)
    rng = np.random.default_rng(0) if rng is None else rng
    tol = min(eps)
    t0 = time.perf_counter()
    traj: dict[int, A.AttackTrajectory] = {}
    mom = [i for i, c in enumerate(grid) if c.attacker in A.MOMENTUM_KINDS]
    ada = [i for i, c in enumerate(grid) if c.attacker in A.ADAPTIVE_KINDS]
    if mom:
        out = A.sweep_momentum(problem, [{"attacker": grid[i].attacker, **dict(grid[i].params)} for i in mom],
                               max_steps=max_steps, tol=tol)
        traj.update(zip(mom, out))
    if ada:
        out = A.sweep_adaptive(problem, [{"attacker": grid[i].attacker, **dict(grid[i].params)} for i in ada],
                               max_steps=max_steps, tol=tol)
        traj.update(zip(ada, out))
    for i, c in enumerate(grid):
        if i in traj:
            continue
        p = dict(c.params)
        if c.attacker == "gd_exact":
            traj[i] = A.attack_gd_exact(problem, max_steps=max_steps, tol=tol)
        elif c.attacker == "cg":
            traj[i] = A.attack_cg(problem, max_steps=max_steps, tol=tol)
        elif c.attacker == "lbfgs":
            traj[i] = A.attack_lbfgs(problem, max_steps=max_steps, tol=tol, memory=int(p["memory"]))
        elif c.attacker == "pcg_jacobi":
            traj[i] = A.attack_pcg_jacobi(problem, max_steps=max_steps, tol=tol)
        elif c.attacker == "whiten":
            Z_est = _whiten_rows(problem.Z, p["rows"], rng)
            traj[i] = A.attack_whiten(problem, Z_est, ridge_rel=float(p["ridge_rel"]), max_steps=max_steps,
                                      tol=tol, estimated_on=f"{p['rows']} of the probed rows")
        elif c.attacker == "closed_form":
            traj[i] = A.attack_closed_form(problem, tol=tol)
        elif c.attacker == "newton":
            traj[i] = A.attack_newton(problem, max_steps=second_order_max_steps, tol=tol)
        else:
            raise ParameterError("grid", f"unknown attacker {c.attacker!r} in the grid")
    steps, final, div, curves = [], [], [], {}
    keep = set(keep_curves)
    for i, c in enumerate(grid):
        t = traj[i]
        steps.append({_ekey(e): t.own_steps_to(e) for e in eps})
        final.append(float(t.final_rel_subopt))
        div.append(bool(t.info.get("diverged", False)) or not math.isfinite(t.final_rel_subopt))
        if c.label in keep:
            curves[c.label] = t.rel_subopt
    return GridRun(grid, eps, max_steps, steps, final, div, kappa_reference(problem),
                   time.perf_counter() - t0, curves)


def family_best(run: GridRun, eps: float) -> dict[str, tuple[int | None, str | None]]:
    """Per family present in the run: ``(fewest steps to eps, the configuration's label)``;
    ``(None, None)`` when no configuration of the family reached eps within the cap."""
    out: dict[str, tuple[int | None, str | None]] = {}
    for i, c in enumerate(run.configs):
        s = run.steps_of(i, eps)
        best = out.get(c.family, (None, None))
        if s is not None and (best[0] is None or s < best[0]):
            best = (s, c.label)
        out[c.family] = best
    return out


def slowdown(s_theta: int | None, s_ref: int | None, cap: int) -> tuple[float | None, str]:
    """``steps(θ)/steps(reference)`` as ``(value, kind)``: kind ``"="`` exact, ``">="`` when θ's
    attacker hit the cap (a lower bound), ``"<="`` when the reference's did (an upper bound),
    ``"n/a"`` when both did."""
    if s_theta is not None and s_ref is not None:
        return s_theta / s_ref, "="
    if s_theta is None and s_ref is not None:
        return (cap + 1) / s_ref, ">="
    if s_theta is not None and s_ref is None:
        return s_theta / (cap + 1), "<="
    return None, "n/a"


def worst_case(run: GridRun, ref: GridRun, eps: float, families=None) -> dict:
    """The defender's worst case at ``eps`` over ``families`` (default: every family):
    the configuration with the fewest steps on θ (named, with its steps), the best configuration
    on the reference, and the ratio of the two (:func:`slowdown`). Ties go to the earlier
    configuration of the grid."""
    fams = set(FAMILIES if families is None else families)

    def best(r):
        pick = (None, None)
        for i, c in enumerate(r.configs):
            s = r.steps_of(i, eps)
            if c.family in fams and s is not None and (pick[0] is None or s < pick[0]):
                pick = (s, c)
        return pick

    s_t, c_t = best(run)
    s_r, c_r = best(ref)
    value, kind = slowdown(s_t, s_r, run.cap)
    return {"steps": s_t, "attacker": None if c_t is None else c_t.label,
            "family": None if c_t is None else c_t.family,
            "reference_steps": s_r, "reference_attacker": None if c_r is None else c_r.label,
            "slowdown": value, "kind": kind}


def _restricted_kappa(Hm: np.ndarray, basis: np.ndarray) -> float:
    """κ of ``basisᵀ Hm basis`` (``basis`` orthonormal), over its spectrum (positive definite)."""
    ev = np.linalg.eigvalsh(0.5 * (basis.T @ Hm @ basis + (basis.T @ Hm @ basis).T))
    return float(ev[-1] / ev[0]) if ev[0] > 0 else math.inf


@bounded_blas
def kappa_reference(problem: A.ProbingProblem) -> dict:
    """The condition numbers an attacker family feels on ``problem``, over the subspace its
    iterates live in (``range(Zᵀ)``, docs/theory.md §2):

    * ``kappa`` — κ of the Hessian (least squares: κ(ZᵀZ) from the SVD of Z; logistic: of
      ``∇²L(w*) = ZᵀD*Z + λI``, the local value at the optimum);
    * ``kappa_jacobi`` — κ_J, the same after the Jacobi scaling ``J^{-½}·J^{-½}``,
      ``J = diag(∇²L)``: what a diagonal preconditioner (Adam, Adagrad, Jacobi-PCG) faces. By
      van der Sluis (1969), ``κ_J ≤ d·min_{S diagonal} κ(S∇²LS)`` (d = non-zeros per row ≤ D):
      no diagonal scaling does better than κ_J/d. A diagonal Hessian has κ_J = 1 whatever κ; an
      equal diagonal has κ_J = κ.
    """
    if problem.loss == "lsq":
        s = A.jacobi_scaling(problem.Z)
        return {"kappa": float(gram_spectrum(problem.Z, vectors=False).kappa),
                "kappa_jacobi": float(gram_spectrum(problem.Z * s, vectors=False).kappa),
                "where": "Z^T Z"}
    Hm = problem.hessian(problem.w_star)
    basis = np.linalg.svd(problem.Z, full_matrices=False)[2][: problem.rank].T
    j = np.sqrt(np.diag(Hm))            # > 0: the ridge λ > 0 is on the diagonal
    scaled = Hm / np.outer(j, j)
    # the Jacobi-scaled iterates u = J^{½}w live in J^{½}·range(Zᵀ)
    qb, _ = np.linalg.qr(basis * j[:, None])
    return {"kappa": _restricted_kappa(Hm, basis), "kappa_jacobi": _restricted_kappa(scaled, qb),
            "where": "Hessian at w* (logistic)"}


def kappa_bounds(kappa_theta: dict, kappa_ref: dict) -> dict[str, float]:
    """Per family, the slow-down that the condition numbers alone can force (docs/attacks.md §1):
    ``r = κ(θ)/κ(ref)`` for GD; ``√r`` for heavy ball, Nesterov, CG and L-BFGS; ``r_J``, the ratio
    of the Jacobi-scaled κ_J, for Adam and Adagrad; ``√r_J`` for Jacobi-PCG; 1 for whitening,
    the closed form and Newton. These are ratios of worst-case iteration bounds, not
    predictions of a particular instance: a measured slow-down can exceed them when the
    reference run beats its own worst case."""
    r = kappa_theta["kappa"] / kappa_ref["kappa"]
    rj = kappa_theta["kappa_jacobi"] / kappa_ref["kappa_jacobi"]
    kinds = {"kappa": r, "sqrt_kappa": math.sqrt(r), "jacobi": rj, "sqrt_jacobi": math.sqrt(rj), "one": 1.0}
    return {f: kinds[v[1]] for f, v in FAMILIES.items()}


def best_so_far(steps, *, n_orders: int = 200, rng: np.random.Generator, cap: int) -> np.ndarray:
    """The best (fewest) steps found after trying k configurations, k = 1..n, for ``n_orders``
    random orders of the configurations (rows). ``steps``: per configuration, its steps on the
    problem (None = not within the cap, counted as ``cap + 1``)."""
    check_number(n_orders, "n_orders", low=1, integer=True)
    s = np.array([cap + 1 if x is None else x for x in steps], dtype=float)
    if s.size == 0:
        raise ParameterError("steps", "no configurations to order")
    out = np.empty((n_orders, s.size))
    for k in range(n_orders):
        out[k] = np.minimum.accumulate(s[rng.permutation(s.size)])
    return out
