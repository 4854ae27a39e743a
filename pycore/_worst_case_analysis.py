"""The worst case over seeds, for a table of attacked θ's (docs/findings.md §4–5).

Each attacked :class:`Variant` (a method's θ, hardened or not) is run through an attacker grid
(:func:`pycore.attacks.run_grid`) per seed and problem (:class:`VariantRun`); :func:`analyse`
gathers, per (variant, rows, task, ε), each family's best slow-down against identity beside its κ
bound and the defender's worst cases (:class:`Analysis`), :func:`best_so_far_curves` the
best-so-far curves (:class:`BestSoFar`), :func:`targets` the hardening targets of docs/findings.md
§5 (:class:`Target`). :func:`pycore.attack_evaluation` is the same judgement of one θ;
``experiments/attacks.py`` is the command that runs and prints these.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

import pycore._worst_case as W
from pycore._registry import METHOD_LABELS
from pycore._thetas import run_name
from pycore._validation import ParameterError


@dataclass(frozen=True)
class Variant:
    """An attacked θ: a ``method``'s, hardened by ``harden`` or not.

    ``name`` is its label in results.json and the θ archive (:func:`pycore._thetas.run_name`:
    ``ours+haar``).
    """

    method: str
    harden: str = "none"

    @property
    def name(self) -> str:
        """``ours``, ``ours+haar``."""
        return run_name(self.method, self.harden)

    @property
    def hardened(self) -> bool:
        return self.harden != "none"

    @property
    def label(self) -> str:
        """``Ours (Alg. 1) + haar`` (pycore.report.METHOD_LABELS)."""
        return METHOD_LABELS[self.method] + (f" + {self.harden}" if self.hardened else "")

    def unhardened(self) -> Variant:
        """The same method's θ before hardening."""
        return Variant(self.method)

    def to_dict(self) -> dict:
        return {"name": self.name, "method": self.method, "harden": self.harden}


@dataclass(frozen=True)
class VariantRun:
    """One variant of one immunization seed.

    Its θ (by digest), the numbers hardening must keep on each row set (``numbers[rows]``: RIR,
    (i), (ii), best D_P loss), and the attacker grid on each problem (``problems[rows][task]``,
    task "D_H" or "D_P").
    """

    seed: int
    variant: Variant
    theta_digest: str
    numbers: Mapping[str, Mapping[str, float]]
    immunize_seconds: float
    diagnostics: Mapping[str, float]
    problems: Mapping[str, Mapping[str, W.GridRun]]
    orthogonality_defect: float | None = None
    # hardened variants: the largest relative change of ``numbers`` against the unhardened θ
    invariance: Mapping[str, float] | None = None

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "method": self.variant.method,
            "variant": self.variant.name,
            "theta_digest": self.theta_digest,
            "numbers": self.numbers,
            "immunize_seconds": self.immunize_seconds,
            "diagnostics": self.diagnostics,
            "orthogonality_defect": self.orthogonality_defect,
            "invariance": self.invariance,
            "problems": {
                rows: {task: run.to_dict() for task, run in per.items()}
                for rows, per in self.problems.items()
            },
        }


@dataclass(frozen=True)
class FamilyCell:
    """One attacker family on one (variant, problem, ε), one entry per seed.

    Its best slow-down against identity (``slowdown``) beside its κ ``bound``, the best
    configuration on θ and on identity; for a hardened variant also against the rotated identity
    (``*_vs_rotated``).
    """

    slowdown: tuple[W.Slowdown, ...]
    bound: tuple[float, ...]
    best: tuple[W.Best, ...]
    reference_best: tuple[W.Best, ...]
    slowdown_vs_rotated: tuple[W.Slowdown, ...] | None = None
    bound_vs_rotated: tuple[float, ...] | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Cell:
    """A variant on one problem (``rows``, ``task``) at one ``eps``, per seed.

    Every family (``families``) and the defender's worst case over all families and over the
    first-order ones.
    """

    variant: Variant
    rows: str
    task: str
    eps: float
    families: Mapping[str, FamilyCell]
    worst_all: tuple[W.FamilyResult, ...]
    worst_first_order: tuple[W.FamilyResult, ...]

    def to_dict(self) -> dict:
        return {
            "variant": self.variant.name,
            "rows": self.rows,
            "task": self.task,
            "eps": self.eps,
            "families": {f: c.to_dict() for f, c in self.families.items()},
            "worst_all": [w.to_dict() for w in self.worst_all],
            "worst_first_order": [w.to_dict() for w in self.worst_first_order],
        }


@dataclass(frozen=True)
class Analysis:
    """Every :class:`Cell` by ``(variant, rows, task, eps)``; results.json keeps a list."""

    cells: Mapping[tuple[Variant, str, str, float], Cell]

    def __call__(self, variant: Variant, rows: str, task: str, eps: float) -> Cell | None:
        """The cell of ``variant`` on (``rows``, ``task``) at ``eps``; None if not analysed."""
        return self.cells.get((variant, rows, task, eps))

    @property
    def variants(self) -> list[Variant]:
        """The analysed variants, in the order of the runs.

        Identity is the reference, not one of them.
        """
        return list(dict.fromkeys(v for v, *_ in self.cells))

    def to_dict(self) -> list[dict]:
        return [c.to_dict() for c in self.cells.values()]


def _by_seed(runs) -> tuple[dict, list[Variant], list[int]]:
    """The runs by ``(seed, variant)``, the variants and the seeds.

    ``({(seed, variant): run}, variants, seeds)``; every seed must have identity's run, the
    reference of every slow-down.
    """
    runs = list(runs)
    if not runs:
        raise ParameterError("runs", "no runs to analyse")
    by = {(r.seed, r.variant): r for r in runs}
    seeds = list(dict.fromkeys(r.seed for r in runs))
    missing = [s for s in seeds if (s, Variant("identity")) not in by]
    if missing:
        raise ParameterError(
            "runs", f"seed {missing[0]} has no identity run, the reference of every slow-down"
        )
    return by, list(dict.fromkeys(r.variant for r in runs)), seeds


def analyse(runs, grid, eps_list, cap: int, *, rotated: Variant | None = None) -> Analysis:
    """Per variant (≠ identity), problem, ε and seed.

    Each family's best slow-down against identity (a hardened variant: also against ``rotated``,
    identity hardened alike) beside its κ bound, and the worst cases over all families and over the
    first-order ones (docs/findings.md §4).

    Parameters
    ----------
    runs : sequence of VariantRun
        Every variant of every seed, identity's included, each on the same problems.
    grid : sequence of pycore._worst_case.AttackerConfig
        The grid the runs used (:func:`pycore.attacks.attacker_grid`).
    eps_list : sequence of float
        The targets to analyse, each one of the runs' ``eps``.
    cap : int
        The runs' step cap (a capped run gives a bound, :func:`pycore._worst_case.slowdown`).
    rotated : Variant, optional
        Identity hardened as the hardened variants are: the second reference of a hardened
        variant (``slowdown_vs_rotated``), which isolates the conditioning from the loss of the
        input basis.

    Returns
    -------
    Analysis
        A :class:`Cell` per (variant, rows, task, ε).

    Raises
    ------
    ParameterError
        ``runs`` empty, or a seed without identity's run.
    """
    by, variants, seeds = _by_seed(runs)
    families = list(dict.fromkeys(c.family for c in grid))
    first = [f for f in families if f in W.FIRST_ORDER]
    problems = [
        (rows, task) for rows, per in next(iter(by.values())).problems.items() for task in per
    ]
    cells = {}
    identity = Variant("identity")
    for v in (v for v in variants if v != identity):
        for (rows, task), e in itertools.product(problems, eps_list):
            per = {f: {k.name: [] for k in dataclasses.fields(FamilyCell)} for f in families}
            worst_all, worst_first = [], []
            for s in seeds:
                run = by[(s, v)].problems[rows][task]
                ref = by[(s, identity)].problems[rows][task]
                twin = by.get((s, rotated)) if v.hardened else None  # the rotated identity
                rot = None if twin is None else twin.problems[rows][task]
                fb, fr = W.family_best(run, e), W.family_best(ref, e)
                bounds = W.kappa_bounds(run.kappa, ref.kappa)
                for f, c in per.items():
                    c["slowdown"].append(W.slowdown(fb[f].steps, fr[f].steps, cap))
                    c["bound"].append(bounds[f])
                    c["best"].append(fb[f])
                    c["reference_best"].append(fr[f])
                if rot is not None:
                    fo, bo = W.family_best(rot, e), W.kappa_bounds(run.kappa, rot.kappa)
                    for f, c in per.items():
                        c["slowdown_vs_rotated"].append(W.slowdown(fb[f].steps, fo[f].steps, cap))
                        c["bound_vs_rotated"].append(bo[f])
                worst_all.append(W.worst_case(run, ref, e, families))
                worst_first.append(W.worst_case(run, ref, e, first))
            cells[(v, rows, task, e)] = Cell(
                variant=v,
                rows=rows,
                task=task,
                eps=e,
                families={
                    f: FamilyCell(**{k: tuple(x) if x else None for k, x in c.items()})
                    for f, c in per.items()
                },
                worst_all=tuple(worst_all),
                worst_first_order=tuple(worst_first),
            )
    return Analysis(cells)


@dataclass(frozen=True)
class Curve:
    """Best-so-far on D_H of one variant on one row set, over the configurations of a pool.

    ``pool`` is "all" or "first_order": after k configurations tried in a random order, the fewest
    steps on θ over the best of the WHOLE grid on identity; median and 10/90 % quantiles over
    orders and seeds.
    """

    variant: Variant
    rows: str
    pool: str
    median: np.ndarray
    q10: np.ndarray
    q90: np.ndarray
    n_configs: int

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "variant": self.variant.name}


@dataclass(frozen=True)
class BestSoFar:
    """Every :class:`Curve` at ``eps``, ``orders_per_seed`` random orders per seed."""

    eps: float
    orders_per_seed: int
    curves: tuple[Curve, ...]

    def curve(self, variant: Variant, rows: str, pool: str) -> Curve | None:
        """The curve of ``variant`` on ``rows`` over ``pool``; None if there is none."""
        return next(
            (c for c in self.curves if (c.variant, c.rows, c.pool) == (variant, rows, pool)), None
        )

    def to_dict(self) -> dict:
        return {
            "eps": self.eps,
            "orders_per_seed": self.orders_per_seed,
            "curves": [c.to_dict() for c in self.curves],
        }


def best_so_far_curves(runs, grid, eps: float, cap: int, orders: int) -> BestSoFar:
    """The best-so-far curves on D_H of every variant and row set.

    TamperBench's: how fast an attacker who tries configurations in a random order finds the worst
    case.

    Parameters
    ----------
    runs, grid, cap
        As :func:`analyse`.
    eps : float
        The target, one of the runs' ``eps``.
    orders : int
        Random orders per seed, each from ``default_rng([0, seed])``
        (:func:`pycore._worst_case.best_so_far`), so a seed's curves do not depend on the others.

    Returns
    -------
    BestSoFar
        A :class:`Curve` per (variant, rows, pool), identity's included.

    Raises
    ------
    ParameterError
        As :func:`analyse`; ``orders`` outside [1, :data:`pycore._worst_case.MAX_ORDERS`].
    """
    by, variants, seeds = _by_seed(runs)
    first = [i for i, c in enumerate(grid) if c.family in W.FIRST_ORDER]
    curves = []
    identity = Variant("identity")
    for v in variants:
        for rows in next(iter(by.values())).problems:
            for pool, idx in (("all", list(range(len(grid)))), ("first_order", first)):
                ratios = []
                for s in seeds if idx else ():
                    run = by[(s, v)].problems[rows]["D_H"]
                    ref = by[(s, identity)].problems[rows]["D_H"]
                    rs = [x for i in idx if (x := ref.steps_of(i, eps)) is not None]
                    tried = W.best_so_far(
                        [run.steps_of(i, eps) for i in idx],
                        n_orders=orders,
                        rng=np.random.default_rng([0, s]),
                        cap=cap,
                    )
                    ratios.append(tried / (min(rs) if rs else cap + 1))
                if ratios:
                    R = np.concatenate(ratios)
                    curves.append(
                        Curve(
                            variant=v,
                            rows=rows,
                            pool=pool,
                            median=np.median(R, axis=0),
                            q10=np.quantile(R, 0.1, axis=0),
                            q90=np.quantile(R, 0.9, axis=0),
                            n_configs=len(idx),
                        )
                    )
    return BestSoFar(eps, orders, tuple(curves))


# The hardening targets of docs/findings.md §5, training rows, ε = 1e-4: the best Adam slowed
# ≥ 10× on D_H on every seed, ≤ 1.2× on D_P, the invariants kept to 1e-10 relative.
TARGET_EPS, TARGET_SLOWDOWN, TARGET_DP, TARGET_RTOL = 1e-4, 10.0, 1.2, 1e-10


@dataclass(frozen=True)
class Target:
    """A hardened variant against the targets.

    Adam's per-seed slow-downs on D_H and D_P, the largest change of an invariant, and whether each
    target is met (None: undecided, a cap).
    """

    variant: Variant
    adam_dh: tuple[W.Slowdown, ...]
    adam_dp: tuple[W.Slowdown, ...]
    invariance: float
    dh_ok: bool | None
    dp_ok: bool | None
    inv_ok: bool

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "variant": self.variant.name}


def targets(runs, analysis: Analysis) -> list[Target]:
    """The hardening targets of docs/findings.md §5.

    On the training rows, ε = :data:`TARGET_EPS`, for each hardened variant but identity's that was
    attacked by Adam.

    Parameters
    ----------
    runs : sequence of VariantRun
        The runs ``analysis`` was made from (their ``invariance``).
    analysis : Analysis
        :func:`analyse` of ``runs`` at ε = :data:`TARGET_EPS` among others.

    Returns
    -------
    list of Target
        One per such variant, in the analysis' order.
    """
    out = []
    for v in (v for v in analysis.variants if v.hardened and v.method != "identity"):
        dh = analysis(v, "train", "D_H", TARGET_EPS)
        dp = analysis(v, "train", "D_P", TARGET_EPS)
        if dh is None or dp is None or "adam" not in dh.families:
            continue
        inv = max(max(r.invariance.values()) for r in runs if r.variant == v)
        out.append(
            Target(
                variant=v,
                adam_dh=dh.families["adam"].slowdown,
                adam_dp=dp.families["adam"].slowdown,
                invariance=inv,
                dh_ok=W.within(dh.families["adam"].slowdown, low=TARGET_SLOWDOWN),
                dp_ok=W.within(dp.families["adam"].slowdown, high=TARGET_DP),
                inv_ok=inv <= TARGET_RTOL,
            )
        )
    return out
