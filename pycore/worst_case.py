"""Worst-case attack evaluation of a linear immunizer (docs/findings.md §4), as fine-tuning
defenses are judged (Qi et al. 2024; TamperBench): a *family* of optimizers is swept over its
hyper-parameters, its best configuration counts, and the defense is judged by the strongest
attacker found, named. Cost = iterations to a relative suboptimality ε.  :func:`attack_evaluation`
evaluates one θ."""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from pycore import attacks as A
from pycore.probe import LOSSES
from pycore.spectral import gram_spectrum
from pycore.threads import bounded_blas
from pycore.validation import (
    ParameterError,
    as_float_matrix,
    check_choice,
    check_number,
    check_rng,
)

__all__ = [
    "AttackerConfig",
    "FAMILIES",
    "FIRST_ORDER",
    "attacker_grid",
    "GridRun",
    "run_grid",
    "family_best",
    "slowdown",
    "worst_case",
    "kappa_reference",
    "kappa_bounds",
    "best_so_far",
    "within",
    "analyse",
    "best_so_far_curves",
    "targets",
    "FamilyResult",
    "AttackEvaluation",
    "attack_evaluation",
]

# family → (what κ alone can force on it: kappa_bounds, group). Groups: "first-order" (gradients
# only:
# the paper's threat model), "adaptive" (also statistics of the attacker's own rows), "second-
# order".
FAMILIES: dict[str, tuple[str, str]] = {
    "gd": ("kappa", "first-order"),
    "heavy_ball": ("sqrt_kappa", "first-order"),
    "nesterov": ("sqrt_kappa", "first-order"),
    "adam": ("jacobi", "first-order"),
    "adagrad": ("jacobi", "first-order"),
    "cg": ("sqrt_kappa", "first-order"),
    "lbfgs": ("sqrt_kappa", "first-order"),
    "pcg_jacobi": ("sqrt_jacobi", "adaptive"),
    "whiten": ("one", "adaptive"),
    "closed_form": ("one", "second-order"),
    "newton": ("one", "second-order"),
}
FIRST_ORDER = tuple(f for f, v in FAMILIES.items() if v[1] == "first-order")
# The stated grid (docs/findings.md §4); Adam's and Adagrad's lr in units of max|w₀ − w*|.
GD_STEP_FACTORS = (0.5, 1.0, 1.5, 1.9)
MU_FACTORS = (0.01, 0.1, 1.0, 10.0, 100.0)  # μ̂/μ: 1 = tuned; others mis-tuned
ADAM_LR_FACTORS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4)
ADAM_BETAS = ((0.9, 0.999), (0.9, 0.99), (0.99, 0.999), (0.0, 0.999))
ADAGRAD_LR_FACTORS = (1.0, 0.3, 0.1, 0.03, 0.01)
LBFGS_MEMORY = (1, 3, 5, 10, 20, 50)
WHITEN_RIDGE = (1e-12, 1e-8, 1e-4)
MAX_ORDERS = 10_000  # best_so_far: orders × configurations floats are kept in memory


@dataclass(frozen=True)
class AttackerConfig:
    """A ``family`` (:data:`FAMILIES`), the ``attacker`` it runs and its ``params`` (sorted
    pairs)."""

    family: str
    attacker: str
    params: tuple = ()

    @property
    def label(self) -> str:
        inner = ", ".join(f"{k}={_short(v)}" for k, v in self.params)
        return f"{self.attacker}({inner})" if inner else self.attacker

    def to_dict(self) -> dict:
        return {
            "family": self.family,
            "attacker": self.attacker,
            "params": dict(self.params),
            "label": self.label,
        }


def _short(v):
    if isinstance(v, tuple):
        return "(" + ",".join(_short(x) for x in v) + ")"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _cfg(family, attacker, **params) -> AttackerConfig:
    return AttackerConfig(family, attacker, tuple(sorted(params.items())))


def attacker_grid(loss: str = "lsq", *, quick: bool = False) -> tuple[AttackerConfig, ...]:
    """Every configuration of every family for ``loss``; ``quick``: a few per family."""
    check_choice(loss, "loss", LOSSES)
    mus = (1.0, 0.1) if quick else MU_FACTORS
    g = [_cfg("gd", "gd_exact")]
    g += [_cfg("gd", "gd_constant", step_factor=c) for c in ((1.0,) if quick else GD_STEP_FACTORS)]
    g += [] if quick else [_cfg("gd", "gd_constant", step="2/(L+mu)")]
    g += [_cfg("heavy_ball", "heavy_ball", mu_factor=f) for f in mus]
    g += [_cfg("nesterov", "nesterov", mu_factor=f) for f in mus]
    g.append(_cfg("nesterov", "nesterov_convex"))
    g += [
        _cfg("adam", "adam", lr_factor=c, betas=b)
        for b in (ADAM_BETAS[:1] if quick else ADAM_BETAS)
        for c in ((1e-1, 1e-2) if quick else ADAM_LR_FACTORS)
    ]
    g += [
        _cfg("adagrad", "adagrad", lr_factor=c) for c in ((1.0,) if quick else ADAGRAD_LR_FACTORS)
    ]
    g.append(_cfg("cg", "cg"))
    g += [_cfg("lbfgs", "lbfgs", memory=m) for m in ((10,) if quick else LBFGS_MEMORY)]
    g.append(_cfg("pcg_jacobi", "pcg_jacobi"))
    g += [
        _cfg("whiten", "whiten", rows=r, ridge_rel=d)
        for r in (("all",) if quick else A.WHITEN_ROWS)
        for d in ((1e-8,) if quick else WHITEN_RIDGE)
    ]
    g.append(_cfg("closed_form", "closed_form") if loss == "lsq" else _cfg("newton", "newton"))
    return tuple(g)


def _ekey(e: float) -> str:
    return f"{e:g}"


@dataclass
class GridRun:
    """Per configuration on one problem: ``steps`` to each of ``eps`` (None = not within the
    ``cap``), the final relative suboptimality, divergence, and :func:`kappa_reference`;
    :meth:`compact` is what results.json keeps."""

    configs: tuple[AttackerConfig, ...]
    cap: int
    kappa: dict
    wall_seconds: float
    steps: list[list]
    final_rel_subopt: list[float]
    diverged: list[bool]
    eps: list[float]

    def steps_of(self, i: int, eps: float) -> int | None:
        return self.steps[i][[_ekey(e) for e in self.eps].index(_ekey(eps))]

    def compact(self) -> dict:
        return {k: v for k, v in vars(self).items() if k not in ("configs", "cap")}

    @classmethod
    def from_compact(cls, p: dict, grid, cap: int) -> GridRun:
        return cls(tuple(grid), cap, **p)


@bounded_blas
def run_grid(
    problem: A.ProbingProblem,
    grid,
    *,
    eps=(1e-2, 1e-4),
    max_steps: int = 20000,
    rng: np.random.Generator | None = None,
    second_order_max_steps: int = 100,
) -> GridRun:
    """Every configuration of ``grid`` on ``problem`` until min(eps) or ``max_steps``."""
    grid = tuple(grid)
    if not grid:
        raise ParameterError("grid", "the attacker grid is empty")
    eps = tuple(
        sorted(
            {
                check_number(e, "eps", low=0.0, high=1.0, low_open=True, high_open=True)
                for e in eps
            },
            reverse=True,
        )
    )
    t0 = time.perf_counter()
    traj = A.run_attackers(
        problem,
        [{"attacker": c.attacker, **dict(c.params)} for c in grid],
        max_steps=max_steps,
        tol=min(eps),
        rng=rng,
        second_order_max_steps=second_order_max_steps,
    )
    return GridRun(
        grid,
        max_steps,
        kappa_reference(problem),
        time.perf_counter() - t0,
        [[t.steps_to(e) for e in eps] for t in traj],
        [t.final_rel_subopt for t in traj],
        [t.info["diverged"] or not math.isfinite(t.final_rel_subopt) for t in traj],
        list(eps),
    )


def family_best(run: GridRun, eps: float) -> dict[str, tuple[int | None, str | None]]:
    """Per family: ``(fewest steps to eps, that configuration's label)``, (None, None) if none
    did."""
    out: dict[str, tuple[int | None, str | None]] = {}
    for i, c in enumerate(run.configs):
        s = run.steps_of(i, eps)
        best = out.get(c.family, (None, None))
        out[c.family] = (
            (s, c.label) if s is not None and (best[0] is None or s < best[0]) else best
        )
    return out


def slowdown(s_theta: int | None, s_ref: int | None, cap: int) -> tuple[float | None, str]:
    """``steps(θ)/steps(reference)`` as ``(value, kind)``: ``"="`` exact, ``">="`` when θ's
    attacker hit the cap (a lower bound), ``"<="`` when the reference's did, ``"n/a"`` when both
    did."""
    if s_theta is not None and s_ref is not None:
        return s_theta / s_ref, "="
    if s_ref is not None:
        return (cap + 1) / s_ref, ">="
    if s_theta is not None:
        return s_theta / (cap + 1), "<="
    return None, "n/a"


def worst_case(run: GridRun, ref: GridRun, eps: float, families=None) -> dict:
    """The defender's worst case at ``eps`` over ``families`` (default all): the fewest steps on θ
    (named), the best on the reference and their :func:`slowdown`; ties go to the earlier one."""
    fams = set(FAMILIES if families is None else families)

    def best(r):
        found = [
            (s, i)
            for i, c in enumerate(r.configs)
            if c.family in fams and (s := r.steps_of(i, eps)) is not None
        ]
        return min(found) if found else (None, None)

    (s_t, i_t), (s_r, i_r) = best(run), best(ref)
    value, kind = slowdown(s_t, s_r, run.cap)
    return {
        "steps": s_t,
        "attacker": None if i_t is None else run.configs[i_t].label,
        "family": None if i_t is None else run.configs[i_t].family,
        "reference_steps": s_r,
        "reference_attacker": None if i_r is None else ref.configs[i_r].label,
        "slowdown": value,
        "kind": kind,
    }


def _restricted_kappa(Hm: np.ndarray, basis: np.ndarray) -> float:  # κ of Hm on range(basis)
    B = basis.T @ Hm @ basis
    ev = np.linalg.eigvalsh(0.5 * (B + B.T))
    return float(ev[-1] / ev[0]) if ev[0] > 0 else math.inf


@bounded_blas
def kappa_reference(problem: A.ProbingProblem) -> dict:
    """The κ's an attacker family feels on ``range(Zᵀ)``: ``kappa`` of the Hessian (lsq: ZᵀZ;
    logistic: ``∇²L(w*)``) and ``kappa_jacobi`` of ``J^{-½}∇²L J^{-½}``, ``J = diag ∇²L``, what a
    diagonal preconditioner faces (van der Sluis 1969)."""
    if problem.loss == "lsq":
        s = A.jacobi_scaling(problem.Z)
        return {
            "kappa": float(gram_spectrum(problem.Z, vectors=False).kappa),
            "kappa_jacobi": float(gram_spectrum(problem.Z * s, vectors=False).kappa),
            "where": "Z^T Z",
        }
    Hm = problem.hessian(problem.w_star)
    basis = np.linalg.svd(problem.Z, full_matrices=False)[2][: problem.rank].T
    j = np.sqrt(np.diag(Hm))  # > 0: the ridge λ > 0 is on the diagonal
    # the scaled iterates u = J^{½}w live in J^{½}·range(Zᵀ)
    qb, _ = np.linalg.qr(basis * j[:, None])
    return {
        "kappa": _restricted_kappa(Hm, basis),
        "kappa_jacobi": _restricted_kappa(Hm / np.outer(j, j), qb),
        "where": "Hessian at w* (logistic)",
    }


def kappa_bounds(kappa_theta: dict, kappa_ref: dict) -> dict[str, float]:
    """Per family, the slow-down the κ's alone can force (docs/findings.md §4): ``r =
    κ(θ)/κ(ref)``, √r, r_J (κ_J's ratio), √r_J or 1 by :data:`FAMILIES`: ratios of worst-case
    iteration bounds."""
    r = kappa_theta["kappa"] / kappa_ref["kappa"]
    rj = kappa_theta["kappa_jacobi"] / kappa_ref["kappa_jacobi"]
    kinds = {
        "kappa": r,
        "sqrt_kappa": math.sqrt(r),
        "jacobi": rj,
        "sqrt_jacobi": math.sqrt(rj),
        "one": 1.0,
    }
    return {f: kinds[v[0]] for f, v in FAMILIES.items()}


def best_so_far(steps, *, n_orders: int = 200, rng: np.random.Generator, cap: int) -> np.ndarray:
    """The fewest steps found after trying k configurations, k = 1..n, for ``n_orders`` random
    orders (TamperBench's best-so-far curves); ``steps`` None (not within the cap) count as ``cap +
    1``."""
    check_number(n_orders, "n_orders", low=1, high=MAX_ORDERS, integer=True)
    s = np.array([cap + 1 if x is None else x for x in steps], dtype=float)
    if s.size == 0:
        raise ParameterError("steps", "no configurations to order")
    return np.array([np.minimum.accumulate(s[rng.permutation(s.size)]) for _ in range(n_orders)])


def within(items, *, low: float | None = None, high: float | None = None) -> bool | None:
    """Does every seed's slow-down ``(value, kind)`` (:func:`slowdown`: a bound on the true ratio)
    lie in ``[low, high]``? True, False when one lies outside, else None (undecided)."""
    low, high = -math.inf if low is None else low, math.inf if high is None else high
    bounds = [
        (v if k in ("=", ">=") else 0.0, v if k in ("=", "<=") else math.inf) for v, k in items
    ]
    if any(hi < low or lo > high for lo, hi in bounds):
        return False
    return True if all(lo >= low and hi <= high for lo, hi in bounds) else None


# over seeds: ``runs`` are dicts with "seed", "variant" and "problems" ({"<rows>/<task>":
# GridRun.compact()})
def _index(runs):
    by = {(r["seed"], r["variant"]): r for r in runs}
    keys = list(runs[0]["problems"])
    return (
        by,
        list(dict.fromkeys(r["variant"] for r in runs)),
        list(dict.fromkeys(r["seed"] for r in runs)),
        keys,
        list(dict.fromkeys(k.split("/")[0] for k in keys)),
    )


def analyse(runs, grid, eps_list, cap: int, *, rotated: str | None = None) -> dict:
    """Per variant (≠ "identity"), problem, ε and seed: each family's best slow-down against
    identity (hardened "m+h": also against ``rotated``) beside its κ bound, and the worst cases
    over all families and over the first-order ones."""
    by, variants, seeds, keys, _ = _index(runs)
    families = list(dict.fromkeys(c.family for c in grid))
    first = [f for f in families if f in FIRST_ORDER]
    out: dict = {}
    for v, key, e in itertools.product([v for v in variants if v != "identity"], keys, eps_list):
        cell = {
            "families": {
                f: {k: [] for k in ("slowdown", "bound", "best", "reference_best")}
                for f in families
            },
            "worst_all": [],
            "worst_first_order": [],
        }
        for s in seeds:
            run, ref = (
                GridRun.from_compact(by[(s, x)]["problems"][key], grid, cap)
                for x in (v, "identity")
            )
            rot = by.get((s, rotated)) if "+" in v else None
            rot = GridRun.from_compact(rot["problems"][key], grid, cap) if rot else None
            fb, fr, bounds = (
                family_best(run, e),
                family_best(ref, e),
                kappa_bounds(run.kappa, ref.kappa),
            )
            fo, bo = (
                (family_best(rot, e), kappa_bounds(run.kappa, rot.kappa)) if rot else (None, None)
            )
            for f, c in cell["families"].items():
                c["slowdown"].append(slowdown(fb[f][0], fr[f][0], cap))
                c["bound"].append(bounds[f])
                c["best"].append([fb[f][1], fb[f][0]])
                c["reference_best"].append([fr[f][1], fr[f][0]])
                if rot is not None:
                    c.setdefault("slowdown_vs_rotated", []).append(
                        slowdown(fb[f][0], fo[f][0], cap)
                    )
                    c.setdefault("bound_vs_rotated", []).append(bo[f])
            cell["worst_all"].append(worst_case(run, ref, e, families))
            cell["worst_first_order"].append(worst_case(run, ref, e, first))
        out.setdefault(v, {}).setdefault(key, {})[_ekey(e)] = cell
    return out


def best_so_far_curves(runs, grid, eps: float, cap: int, orders: int) -> dict:
    """Best-so-far on D_H: after k configurations in a random order, the fewest steps on θ over the
    best of the WHOLE grid on identity, ``orders`` orders per seed from ``default_rng([0, seed])``;
    median and 10/90 % quantiles, for every family and for the first-order ones."""
    by, variants, seeds, _, rows_list = _index(runs)
    fo_idx = [i for i, c in enumerate(grid) if c.family in FIRST_ORDER]
    out = {"eps": eps, "orders_per_seed": orders, "curves": {}}
    for v in variants:
        for rows in rows_list:
            for pool, idx in (("all", list(range(len(grid)))), ("first_order", fo_idx)):
                ratios = []
                for s in seeds if idx else ():
                    run, ref = (
                        GridRun.from_compact(by[(s, x)]["problems"][f"{rows}/D_H"], grid, cap)
                        for x in (v, "identity")
                    )
                    rs = [x for i in idx if (x := ref.steps_of(i, eps)) is not None]
                    curves = best_so_far(
                        [run.steps_of(i, eps) for i in idx],
                        n_orders=orders,
                        rng=np.random.default_rng([0, s]),
                        cap=cap,
                    )
                    ratios.append(curves / (min(rs) if rs else cap + 1))
                if ratios:
                    R = np.concatenate(ratios)
                    out["curves"][f"{v}|{rows}|{pool}"] = {
                        "median": np.median(R, axis=0),
                        "q10": np.quantile(R, 0.1, axis=0),
                        "q90": np.quantile(R, 0.9, axis=0),
                        "n_configs": len(idx),
                    }
    return out


TARGET_EPS, TARGET_SLOWDOWN, TARGET_DP, TARGET_RTOL = 1e-4, 10.0, 1.2, 1e-10


def targets(res: dict) -> list[dict]:
    """The hardening targets of docs/findings.md §5 per hardened variant, training rows, ε = 1e-4:
    the best Adam slowed ≥ 10× on D_H on every seed, ≤ 1.2× on D_P, invariants kept to 1e-10."""
    out, ek = [], _ekey(TARGET_EPS)
    for v in (v for v in res["variants"] if "+" in v and not v.startswith("identity+")):
        an = res["analysis"][v]
        if ek not in an["train/D_H"] or "adam" not in an["train/D_H"][ek]["families"]:
            continue
        dh = an["train/D_H"][ek]["families"]["adam"]["slowdown"]
        dp = an["train/D_P"][ek]["families"]["adam"]["slowdown"]
        inv = max(max(r["invariance"].values()) for r in res["runs"] if r["variant"] == v)
        out.append(
            {
                "variant": v,
                "adam_dh": dh,
                "adam_dp": dp,
                "invariance": inv,
                "dh_ok": within(dh, low=TARGET_SLOWDOWN),
                "dp_ok": within(dp, high=TARGET_DP),
                "inv_ok": inv <= TARGET_RTOL,
            }
        )
    return out


@dataclass(frozen=True)
class FamilyResult:
    """A family's best configuration on θ and on θ = I (steps to ε; None = not within the cap), the
    :func:`slowdown` θ/I with its ``kind``, and the :func:`kappa_bounds` ``bound``."""

    family: str | None
    attacker: str | None
    steps: int | None
    reference_attacker: str | None
    reference_steps: int | None
    slowdown: float | None
    kind: str
    bound: float | None


@dataclass(frozen=True)
class AttackEvaluation:
    """Per family (``families``) and the worst case (``worst``: the fastest of any family on θ
    vs on I)."""

    eps: float
    cap: int
    n_rows: int
    families: dict = field(hash=False)
    worst: FamilyResult


@bounded_blas
def attack_evaluation(
    theta,
    task,
    *,
    rng: np.random.Generator,
    rows=None,
    eps: float = 1e-4,
    quick: bool = False,
    max_steps: int = 20000,
    ridge_rel: float = 1e-4,
):
    """Every family of :func:`attacker_grid` probing D_H of ``task`` through θ and through θ = I to
    relative suboptimality ``eps`` (least squares for "mse", ridge-logistic for "bce").  ``rows``:
    the rows of D_H the attacker holds (default all); ``rng`` draws each "half" whitening's rows,
    the
    same for θ and I; ``quick``: the small grid."""
    check_rng(rng)
    theta = as_float_matrix(theta, "theta")
    X, Y = task.X_H, task.Y_H
    if theta.shape[0] != X.shape[1]:
        raise ParameterError(
            "theta", f"theta must have {X.shape[1]} rows (the inputs), got {theta.shape}"
        )
    try:
        idx = np.arange(X.shape[0])[slice(None) if rows is None else rows]
    except (IndexError, TypeError, ValueError) as exc:
        raise ParameterError(
            "rows", f"rows must index the {X.shape[0]} rows of D_H: {exc}"
        ) from None
    if idx.ndim != 1 or idx.size == 0:
        raise ParameterError("rows", "rows must select at least one row of D_H")
    X, Y = X[idx], Y[idx]
    eps = check_number(eps, "eps", low=0.0, high=1.0, low_open=True, high_open=True)
    grid = attacker_grid("lsq" if task.loss == "mse" else "logistic", quick=quick)
    pairs = ((theta, rng), (np.eye(X.shape[1]), copy.deepcopy(rng)))
    run, ref = (
        run_grid(
            A.make_problem(X @ t, Y, task.loss, ridge_rel=ridge_rel),
            grid,
            eps=(eps,),
            max_steps=max_steps,
            rng=g,
        )
        for t, g in pairs
    )
    bounds = kappa_bounds(run.kappa, ref.kappa)

    def best(fams, family=None):  # worst_case over the given families, as a FamilyResult
        w = worst_case(run, ref, eps, fams)
        return FamilyResult(
            **{**w, "family": family or w["family"]}, bound=bounds.get(family or w["family"])
        )

    families = {f: best([f], f) for f in dict.fromkeys(c.family for c in grid)}
    return AttackEvaluation(eps, max_steps, X.shape[0], families, best(None))
