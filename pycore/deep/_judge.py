"""The attacker's cheapest path in FLOPs, and what a defense is worth (docs/theory.md §12).

Per attacker data set (and seed) there is one target for every operator and every model: ``chance +
0.9·(p − chance)``, ``p`` the best plateau on θ₀ over every operator that uses θ₀
(:func:`reference_path`). On a model, an operator's cost is its FLOPs to the target
(:class:`AttackCost`, its learning rates tuned by :func:`pycore.deep._slowdown.reach`), and the
attacker's cost is the cheapest operator's (:class:`CheapestPath`). ``scratch`` — the architecture
trained from its own initialisation on the attacker's images — is an operator on every model (an
attacker can always ignore the release) and the same run on each, so:

* the **ceiling**, what θ₀ is worth to the attacker, is scratch's cost over the cheapest cost on
  θ₀;
* a defended model's **worth** is its cheapest cost over θ₀'s (``≤ ceiling``); also without the
  linear probes (a defense that only breaks them moves the attacker to the next operator);
* its **retrain bound** is its cheapest retrain's cost (a suffix of stages re-initialised,
  scratch included) over θ₀'s cheapest: what a defense of those stages can be worth at most;
* its **share of the headroom** is ``log(worth)/log(ceiling)`` (0: no defense, 1: as costly as
  scratch, < 0: the defense helped the attacker), defined where the ceiling is measured and ≥
  :data:`MIN_CEILING`.

One FLOP cap holds for every operator on every model: :data:`CAP_FACTOR` times scratch's cost
(what scratch was given, when it did not reach the target: then the ceiling is a lower bound).
On θ₀ every operator whose plateau reaches the target is raced to it (its own cost, for the
per-operator diagnosis). On a defended model the operators race in FLOPs: each runs until it
reaches the target or until it has spent what the cheapest operator so far of its family paid
(probes against every operator, the other operators against every operator but the probes,
retrains against the retrains and scratch), so each family's cheapest cost is exact and an
operator cut off there is reported as a lower bound (``censored``), never an estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import pycore.deep._slowdown as slowdown
from pycore._validation import ParameterError
from pycore.deep._cost import Cost, check_forward_flops
from pycore.deep._data import fetch
from pycore.deep._models import as_immunized
from pycore.deep._operators import (
    LORA_RANKS,
    LR_GRIDS,
    OPERATORS,
    PROBES,
    AttackData,
    Operator,
    Schedule,
    budgets,
    family,
    operator,
    operator_names,
    retrain_depths,
    retrain_modules,
)
from pycore.deep._slowdown import Budget, Reach

CAP_FACTOR = 2.0  # the FLOP cap of every operator: this many times scratch's cost
MIN_CEILING = 5.0  # the share of the headroom is reported only above this ceiling

# the order operators race in on a model: the cheap kinds first, so the limits fall early
_ORDER = ("probe", "retrain", "deep", "scratch")


def kind(name: str) -> str:
    """``"probe"``, ``"retrain"``, ``"scratch"`` or ``"deep"`` (an operator that trains the model).

    Parameters
    ----------
    name : str
        An operator name.

    Returns
    -------
    str
        Its kind.
    """
    f = family(name)
    return "probe" if name in PROBES else f if f in ("retrain", "scratch") else "deep"


@dataclass(frozen=True)
class AttackCost:
    """One operator on one model: what it paid to reach the target (module docstring).

    ``flops_to_target`` is measured (the setup and the steps of the setting that got there first)
    or None; ``flops_limit`` is what the operator was allowed to spend, so a ``censored`` one cost
    more than that (a lower bound). ``plateau`` is the highest level its run held (on θ₀ the
    confirmed plateau of its budget), ``reason`` why it stopped: ``"reached"``, ``"limit"`` (the
    FLOPs it was allowed), ``"plateau"`` (every setting's plateau confirmed below the target: then
    ``flops_limit`` is what it spent) or ``"steps"`` (its step bound came first: what it spent).
    """

    operator: str
    kind: str
    target: float
    flops_to_target: float | None
    flops_limit: float
    steps_to_target: int | None
    plateau: float
    setting: str
    cost: Cost
    reason: str
    test: float = math.nan
    run_steps: int = 0
    reach: Reach | None = field(default=None, repr=False)

    @property
    def censored(self) -> bool:
        return self.flops_to_target is None

    @property
    def flops(self) -> float:
        """The FLOPs to the target, or the lower bound a censored operator is known to exceed."""
        return self.flops_limit if self.flops_to_target is None else self.flops_to_target

    def to_dict(self) -> dict:
        return {
            "operator": self.operator,
            "kind": self.kind,
            "target": self.target,
            "flops_to_target": self.flops_to_target,
            "flops_limit": self.flops_limit,
            "censored": self.censored,
            "steps_to_target": self.steps_to_target,
            "plateau": self.plateau,
            "setting": self.setting,
            "cost": self.cost.to_dict(),
            "reason": self.reason,
            "test": self.test,
            "run_steps": self.run_steps,
            "trace": _chosen_trace(self.reach),
        }


def _chosen_trace(r: Reach | None) -> dict | None:
    """The trace of the setting a race chose (results keep the curve a number was read from)."""
    if r is None:
        return None
    t = next((t for t in r.traces if t.label == r.setting), None)
    return None if t is None else {"steps": list(t.steps), "validation": list(t.validation)}


@dataclass(frozen=True)
class CheapestPath:
    """Every operator's :class:`AttackCost` on one model and the cheapest, overall and by kind."""

    target: float
    cap: float
    operators: tuple

    def __getitem__(self, name: str) -> AttackCost:
        for c in self.operators:
            if c.operator == name:
                return c
        raise KeyError(name)

    def names(self) -> list[str]:
        return [c.operator for c in self.operators]

    def cheapest(self, kinds=None) -> AttackCost | None:
        """The cheapest operator of ``kinds`` (default all): measured ones before lower bounds."""
        pool = [c for c in self.operators if kinds is None or c.kind in kinds]
        if not pool:
            return None
        return min(pool, key=lambda c: (c.censored, c.flops))

    @property
    def exact(self) -> bool:
        """Whether no operator cut off could have been cheaper than the cheapest measured one.

        Every censored operator's lower bound is at least the cheapest cost, or its plateau was
        confirmed below the target (θ₀'s rule for a plateau).
        """
        best = self.cheapest()
        if best is None or best.censored:
            return False
        return all(
            c.flops >= best.flops or c.reason == "plateau" for c in self.operators if c.censored
        )

    def to_dict(self) -> dict:
        best = self.cheapest()
        return {
            "target": self.target,
            "cap": self.cap,
            "cheapest_operator": best and best.operator,
            "cheapest_flops": best and best.flops,
            "cheapest_censored": best is None or best.censored,
            "exact": self.exact,
            "operators": {c.operator: c.to_dict() for c in self.operators},
        }


@dataclass(frozen=True)
class ReferencePath:
    """θ₀'s side of a judgement (:func:`reference_path`).

    The plateau on θ₀ of every operator that takes the release as it is, the target they set (and
    the operator whose plateau set it), scratch's cost to it, the FLOP cap, θ₀'s
    :class:`CheapestPath`, the operators that ran, each one's learning-rate grid as widened on θ₀
    (every model's race starts from it), and the attacker's batch size and image side.
    """

    budgets: dict
    target: float
    target_operator: str
    chance: float
    scratch: AttackCost | None
    cap: float
    path: CheapestPath
    operators: tuple
    grids: dict
    batch_size: int
    image_side: int

    @property
    def cheapest(self) -> AttackCost:
        return self.path.cheapest()

    @property
    def ceiling(self) -> float | None:
        """Scratch's cost over θ₀'s cheapest; a lower bound when scratch is censored."""
        if self.scratch is None:
            return None
        return self.scratch.flops / self.cheapest.flops

    @property
    def ceiling_censored(self) -> bool:
        return self.scratch is None or self.scratch.censored

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "target_operator": self.target_operator,
            "chance": self.chance,
            "cap": self.cap,
            "ceiling": self.ceiling,
            "ceiling_censored": self.ceiling_censored,
            "scratch": self.scratch and self.scratch.to_dict(),
            "path": self.path.to_dict(),
            "budgets": {k: b.to_dict() for k, b in self.budgets.items()},
            "grids": self.grids,
            "batch_size": self.batch_size,
            "image_side": self.image_side,
        }


def _image_side(data: AttackData) -> int:
    return int(fetch(data.train, torch.arange(1))[0].shape[-1])


def _budget_cost(name: str, b: Budget, op: Operator, target: float) -> AttackCost | None:
    """θ₀'s cost of an operator whose plateau is below the target: a lower bound, never run."""
    if b.plateau >= target:
        return None
    return AttackCost(
        name,
        kind(name),
        target,
        None,
        op.cost.at(b.run_steps),
        None,
        b.plateau,
        b.setting,
        op.cost,
        "plateau",
        b.test_at_plateau,
        b.run_steps,
    )


def _race(
    op: Operator, grid: dict, target: float, flops: float, plateau=None, max_steps=None
) -> AttackCost:
    """``op`` raced to ``target`` within ``flops`` (its steps: what that buys after the setup).

    Cut off there, its cost is above ``flops`` (the next step would cost more): the lower bound.
    """
    # within the FLOPs, its own step bound (probes: 20,000 steps; a step of a probe costs so
    # little that a FLOP limit alone could be millions of them), and no further once every
    # setting has settled below the target
    within = op.cost.steps_within(flops) if math.isfinite(flops) else op.max_steps
    limit = min(within, max_steps or op.max_steps)
    r = slowdown.reach(
        op.name,
        op.make,
        grid,
        target=target,
        limit=limit,
        labels=op.labels,
        plateau_steps=op.min_steps,
    )
    if r.reached:
        reason, bound = "reached", float(flops)
    elif r.stopped == "plateau" or limit < within:
        # it stopped before the FLOPs it was allowed: its cost is above what it spent
        reason, bound = ("plateau" if r.stopped == "plateau" else "steps"), op.cost.at(r.run_steps)
    else:
        reason, bound = "limit", float(flops)
    return AttackCost(
        op.name,
        kind(op.name),
        target,
        op.cost.at(r.steps),
        float(bound),
        r.steps,
        r.best if plateau is None else plateau,
        r.setting,
        op.cost,
        reason,
        r.test,
        r.run_steps,
        r,
    )


def reference_path(
    reference,
    data: AttackData,
    operators=OPERATORS,
    *,
    lora_ranks=LORA_RANKS,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    scratch_max_steps: int = 600,
    race: bool = False,
    setting: tuple | None = None,
    fresh: Callable | None = None,
    progress: Callable = lambda name: None,
    model_name: str | None = None,
) -> ReferencePath:
    """θ₀'s side: the plateaus, the target, scratch, the cap and θ₀'s cheapest path.

    Parameters
    ----------
    reference : torch.nn.Module
        θ₀.
    data : AttackData
        The attacker's splits.
    operators : str or sequence of str, default OPERATORS
        Names of :data:`OPERATORS`, ``lora_r<r>`` or ``retrain_last<k>`` (``scratch`` among them:
        the ceiling).
    lora_ranks : int or sequence of int, default LORA_RANKS
        The LoRA ranks.
    seed : int, default 0
        Seeds every run.
    schedule : Schedule, default Schedule()
        The batch size and the step bounds.
    scratch_max_steps : int, default 600
        The most steps scratch trains to reach the target.
    race : bool, default False
        Race θ₀'s operators in FLOPs as on a defended model (θ₀'s cheapest path is exact, an
        operator that is not the cheapest of its family is a lower bound); by default each
        operator whose plateau reaches the target is raced to it within the cap (θ₀'s own cost
        of every operator: the per-operator diagnosis).
    setting : tuple of str, optional
        The operators whose plateaus set the target (default: every probe, LoRA and fine-tuning
        operator of ``operators``); the others are raced to it without a plateau run.
    fresh : callable, optional
        ``fresh(num_classes, seed)``: the architecture from its own initialisation
        (default: :func:`pycore.deep._operators.architecture` of ``reference``).
    progress : callable, optional
        Called with each operator's name as it starts.
    model_name : str, optional
        θ₀'s name in errors (``"reference"``).

    Returns
    -------
    ReferencePath
        θ₀'s side of every judgement on this data.

    Raises
    ------
    ParameterError
        An unknown, empty or absent selection, a ``retrain_last<k>`` beyond the model's stages,
        LoRA without peft installed, or no operator that uses θ₀ (``"operators"``); a rank that
        is not a positive integer (``"lora_ranks"``); a ``setting`` without a probe, LoRA or
        fine-tuning operator (``"setting"``).

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import AttackData, create_model, reference_path
    >>> from pycore.deep._operators import Schedule  # short step bounds, for an example
    >>> g = torch.Generator().manual_seed(0)
    >>> def split(n):  # two classes of 32-pixel images that differ in their mean
    ...     y = torch.arange(n) % 2
    ...     X = torch.randn(n, 3, 32, 32, generator=g) + y[:, None, None, None]
    ...     return torch.utils.data.TensorDataset(X, y)
    >>> data = AttackData(split(24), split(24), split(24), classes=2)  # train, val, test
    >>> theta0 = create_model("test_resnet", 2, seed=0, img_size=32)  # timm's tiny ResNet
    >>> schedule = Schedule(batch_size=8, min_steps=5, probe_max_steps=200, deep_max_steps=20)
    >>> ref = reference_path(
    ...     theta0, data, ("adam", "scratch"), schedule=schedule, scratch_max_steps=50
    ... )
    >>> ref.chance, ref.target, ref.target_operator  # chance + 0.9·(adam's plateau − chance)
    (50.0, 95.0, 'adam')
    >>> ref.path.names(), ref.cheapest.operator, ref.ceiling > 1  # scratch costs more
    (['adam', 'scratch'], 'adam', True)
    """
    names = operator_names(operators, lora_ranks, depths=retrain_depths(reference))
    if all(n == "scratch" for n in names):
        raise ParameterError("operators", "no operator uses θ₀: the target cannot be set")
    net = as_immunized(reference)
    # the target: the best plateau of the operators that take the release as it is (probes,
    # LoRA, fine-tuning); a retrain discards part of it and scratch all of it, so they are
    # raced to the target like any operator on any model, but do not set it
    setters = tuple(
        n for n in names if kind(n) in ("probe", "deep") and (setting is None or n in setting)
    )
    if not setters:
        raise ParameterError("setting", "no operator of setting takes the release as it is")
    found = budgets(
        net,
        data,
        setters,
        lora_ranks=lora_ranks,
        seed=seed,
        schedule=schedule,
        fresh=fresh,
        progress=progress,
        model_name=model_name,
    )
    top = max(found, key=lambda n: (found[n][0].plateau, -names.index(n)))
    target = slowdown.target_level(data.chance, found[top][0].plateau)
    scratch = None
    if "scratch" in names:
        progress("scratch")
        op = operator(
            net, data, "scratch", seed=seed, schedule=schedule, fresh=fresh, model_name=model_name
        )
        scratch = _race(
            op, op.grid, target, op.cost.at(scratch_max_steps), max_steps=scratch_max_steps
        )
    # twice scratch's cost; when scratch did not get there, what it spent trying (then every
    # operator is bounded by what scratch was given, and the ceiling is a lower bound)
    cap = math.inf if scratch is None else scratch.flops * (1 if scratch.censored else CAP_FACTOR)
    grids = {n: found[n][0].grid if n in found else LR_GRIDS[family(n)] for n in names}
    if scratch is not None:
        grids["scratch"] = scratch.reach.grid if scratch.reach else grids["scratch"]
    below = {n: _budget_cost(n, b, op, target) for n, (b, op) in found.items()}
    if race:
        # θ₀'s own race (module docstring): exact for its cheapest path, lower bounds elsewhere
        prelim = ReferencePath(
            {},
            target,
            top,
            data.chance,
            scratch,
            cap,
            CheapestPath(target, cap, ()),
            names,
            grids,
            0,
            0,
        )
        kw = dict(seed=seed, schedule=schedule, fresh=fresh, model_name=model_name)
        path = _race_path(net, data, names, prelim, lambda n, limit: below.get(n), progress, kw)
        costs = list(path.operators)
    else:
        costs = []
        for n in names:
            if n == "scratch":
                costs.append(scratch)
            elif n in found:
                b, op = found[n]
                c = below[n]
                costs.append(c if c is not None else _race(op, b.grid, target, cap, b.plateau))
            else:  # a retrain, or an operator that does not set the target: raced to it
                # within the cap from its own grid
                progress(n)
                op = operator(
                    net, data, n, seed=seed, schedule=schedule, fresh=fresh, model_name=model_name
                )
                costs.append(_race(op, op.grid, target, cap))
                grids[n] = costs[-1].reach.grid
    return ReferencePath(
        {n: b for n, (b, _) in found.items()},
        target,
        top,
        data.chance,
        scratch,
        cap,
        CheapestPath(target, cap, tuple(costs)),
        names,
        grids,
        min(schedule.batch_size, len(data.train)),
        _image_side(data),
    )


def _changed(model, reference) -> list[str]:
    """The state entries of ``model``'s backbone that differ from ``reference``'s."""
    mine, base = model.net.state_dict(), reference.net.state_dict()
    if mine.keys() != base.keys() or any(v.shape != base[k].shape for k, v in mine.items()):
        raise ParameterError("reference", "the model and its reference differ in structure")
    return [k for k, v in mine.items() if not torch.equal(v, base[k])]


def _kept_from_reference(name: str, net, changed: list[str]) -> bool:
    """Whether a retrain re-initialises every entry the defense changed (so it runs as on θ₀)."""
    k = int(name.removeprefix("retrain_last"))
    scope = retrain_modules(net, k)
    return all(any(c.startswith(n + ".") for n in scope) for c in changed)


def _bounded(c: AttackCost, flops: float) -> AttackCost:
    """θ₀'s cost of an operator as it is on a model that runs it identically, within ``flops``."""
    from dataclasses import replace  # noqa: PLC0415

    if c.flops_to_target is not None and c.flops_to_target <= flops:
        return c
    return replace(
        c, flops_to_target=None, steps_to_target=None, flops_limit=flops, reason="limit"
    )


def cheapest_path(
    model,
    data: AttackData,
    reference: ReferencePath,
    theta0,
    *,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    features: dict | None = None,
    fresh: Callable | None = None,
    operators=None,
    progress: Callable = lambda name: None,
    model_name: str | None = None,
) -> CheapestPath:
    """Every operator raced in FLOPs on a defended model against θ₀'s target (module docstring).

    Parameters
    ----------
    model : torch.nn.Module
        The defended model; its forward pass may not cost more than θ₀'s.
    data : AttackData
        The attacker's splits (those of ``reference``).
    reference : ReferencePath
        :func:`reference_path` of θ₀ on ``data``.
    theta0 : torch.nn.Module
        θ₀ itself (a retrain that re-initialises every module the defense changed runs as on θ₀
        and is taken from ``reference``; the forward FLOPs are compared with it).
    seed : int, default 0
        Seeds every run (as for ``reference``).
    schedule : Schedule, default Schedule()
        As for ``reference``.
    features : dict, optional
        As for :func:`pycore.deep._operators.operator`.
    fresh : callable, optional
        As for :func:`reference_path`.
    operators : sequence of str, optional
        A subset of ``reference.operators`` (default all of them).
    progress : callable, optional
        Called with each operator's name as it starts.
    model_name : str, optional
        The model's name in errors (``"model"``).

    Returns
    -------
    CheapestPath
        Every operator's cost and the cheapest.

    Raises
    ------
    ParameterError
        ``"model"``: its forward pass costs more than θ₀'s; ``"reference"``: another structure.

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import AttackData, cheapest_path, create_model, reference_path
    >>> from pycore.deep._operators import Schedule  # short step bounds, for an example
    >>> g = torch.Generator().manual_seed(0)
    >>> def split(n):  # two classes of 32-pixel images that differ in their mean
    ...     y = torch.arange(n) % 2
    ...     X = torch.randn(n, 3, 32, 32, generator=g) + y[:, None, None, None]
    ...     return torch.utils.data.TensorDataset(X, y)
    >>> data = AttackData(split(24), split(24), split(24), classes=2)  # train, val, test
    >>> theta0 = create_model("test_resnet", 2, seed=0, img_size=32)  # timm's tiny ResNet
    >>> schedule = Schedule(batch_size=8, min_steps=5, probe_max_steps=200, deep_max_steps=20)
    >>> ref = reference_path(theta0, data, ("adam",), schedule=schedule)
    >>> path = cheapest_path(theta0, data, ref, theta0, schedule=schedule)  # θ₀, undefended
    >>> path.cheapest().operator, path["adam"].flops == ref.path["adam"].flops, path.exact
    ('adam', True, True)
    """
    net, base = as_immunized(model), as_immunized(theta0)
    x = fetch(data.train, torch.arange(1))[0].to(next(net.parameters()).device)
    check_forward_flops(net, base, x)
    changed = _changed(net, base)

    def reuse(n: str, limit: float) -> AttackCost | None:
        # a retrain that re-initialises every module the defense changed runs as on θ₀
        if kind(n) == "retrain" and n in reference.path.names():
            if _kept_from_reference(n, net.net, changed):
                return _bounded(reference.path[n], limit)
        return None

    names = reference.operators if operators is None else tuple(operators)
    kw = dict(seed=seed, schedule=schedule, features=features, fresh=fresh, model_name=model_name)
    return _race_path(net, data, names, reference, reuse, progress, kw)


def _race_path(net, data, names, reference, reuse, progress, kw) -> CheapestPath:
    """The operators ``names`` raced in FLOPs on ``net`` (module docstring).

    Each runs to the target or to what the cheapest operator so far of its family paid, within
    the cap; ``reuse(name, limit)`` gives an operator's cost without running it (or None).
    """
    order = sorted(names, key=lambda n: _ORDER.index(kind(n)))
    scratch = reference.scratch
    start = scratch.flops if scratch is not None and not scratch.censored else reference.cap
    best = {"probe": start, "deep": start, "retrain": start}
    costs = {}
    for n in order:
        k = kind(n)
        progress(n)
        limit = reference.cap if k == "scratch" else min(reference.cap, best[k])
        c = scratch if k == "scratch" else reuse(n, limit)
        if c is None:
            op = operator(net, data, n, **kw)
            c = _race(op, reference.grids[n], reference.target, limit)
        costs[n] = c
        if not c.censored:
            for fam in {
                "probe": ("probe",),
                "deep": ("probe", "deep"),
                "retrain": ("probe", "deep", "retrain"),
                "scratch": ("probe", "deep", "retrain"),
            }[k]:
                best[fam] = min(best[fam], c.flops)
    return CheapestPath(reference.target, reference.cap, tuple(costs[n] for n in names))


@dataclass(frozen=True)
class Worth:
    """What a defense is worth to its attacker against θ₀ (module docstring).

    ``worth`` (the model's cheapest cost over θ₀'s; ``worth_censored``: a lower bound),
    ``worth_without_probes`` (the same over every operator but the probes, on both),
    ``retrain_bound`` (the model's cheapest retrain or scratch over θ₀'s cheapest), the
    ``ceiling`` (scratch over θ₀'s cheapest), ``headroom_share`` (``log worth / log ceiling``;
    None unless the ceiling is measured and ≥ :data:`MIN_CEILING`) and the cheapest operator.
    """

    worth: float
    worth_censored: bool
    worth_without_probes: float | None
    worth_without_probes_censored: bool
    retrain_bound: float | None
    retrain_bound_censored: bool
    ceiling: float | None
    ceiling_censored: bool
    headroom_share: float | None
    cheapest_operator: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _ratio(a: AttackCost | None, b: AttackCost | None) -> tuple[float | None, bool]:
    if a is None or b is None or b.censored:
        return None, True
    return a.flops / b.flops, a.censored


def worth(path: CheapestPath, reference: ReferencePath) -> Worth:
    """The :class:`Worth` of a model's cheapest path against θ₀'s.

    Parameters
    ----------
    path : CheapestPath
        :func:`cheapest_path` of the defended model.
    reference : ReferencePath
        θ₀'s side.

    Returns
    -------
    Worth
        Worth, worth without the probes, retrain bound, ceiling, share of the headroom.

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import AttackData, cheapest_path, create_model, reference_path, worth
    >>> from pycore.deep._operators import Schedule  # short step bounds, for an example
    >>> g = torch.Generator().manual_seed(0)
    >>> def split(n):  # two classes of 32-pixel images that differ in their mean
    ...     y = torch.arange(n) % 2
    ...     X = torch.randn(n, 3, 32, 32, generator=g) + y[:, None, None, None]
    ...     return torch.utils.data.TensorDataset(X, y)
    >>> data = AttackData(split(24), split(24), split(24), classes=2)  # train, val, test
    >>> theta0 = create_model("test_resnet", 2, seed=0, img_size=32)  # timm's tiny ResNet
    >>> schedule = Schedule(batch_size=8, min_steps=5, probe_max_steps=200, deep_max_steps=20)
    >>> ref = reference_path(theta0, data, ("adam",), schedule=schedule)
    >>> w = worth(cheapest_path(theta0, data, ref, theta0, schedule=schedule), ref)
    >>> w.worth, w.worth_censored, w.cheapest_operator  # θ₀ against itself: worth 1
    (1.0, False, 'adam')
    """
    theta0 = reference.path
    w, w_c = _ratio(path.cheapest(), theta0.cheapest())
    deep = ("deep", "retrain", "scratch")
    wp, wp_c = _ratio(path.cheapest(deep), theta0.cheapest(deep))
    rb, rb_c = _ratio(path.cheapest(("retrain", "scratch")), theta0.cheapest())
    ceiling, ceiling_c = reference.ceiling, reference.ceiling_censored
    share = None
    if ceiling is not None and not ceiling_c and ceiling >= MIN_CEILING and w is not None:
        share = math.log(w) / math.log(ceiling)
    return Worth(w, w_c, wp, wp_c, rb, rb_c, ceiling, ceiling_c, share, path.cheapest().operator)


@dataclass(frozen=True)
class AuditResult:
    """One defended model judged against θ₀ on the attacker's data (module docstring).

    θ₀'s side (``reference``: the plateaus, the target, scratch, the cap, θ₀'s cheapest path), the
    model's cheapest path (``path``) and what the defense is worth (``worth``). Indexing by an
    operator's name gives its :class:`AttackCost` on the model.
    """

    reference: ReferencePath
    path: CheapestPath
    worth: Worth

    def __getitem__(self, name: str) -> AttackCost:
        return self.path[name]

    def slowdown(self, name: str) -> tuple[float | None, bool]:
        """An operator's cost on the model over its cost on θ₀: the diagnosis of one operator.

        Parameters
        ----------
        name : str
            An operator that ran.

        Returns
        -------
        ratio, lower_bound : float or None, bool
            None when the operator does not reach the target on θ₀; ``lower_bound`` when it was
            cut off on the model (its cost there is above its limit).
        """
        mine, base = self.path[name], self.reference.path[name]
        if base.censored:
            return None, False
        return mine.flops / base.flops, mine.censored

    def to_dict(self) -> dict:
        return {
            "reference": self.reference.to_dict(),
            "path": self.path.to_dict(),
            "worth": self.worth.to_dict(),
            "slowdowns": {
                n: dict(zip(("ratio", "lower_bound"), self.slowdown(n))) for n in self.path.names()
            },
        }


def audit(
    model,
    theta0,
    data: AttackData,
    *,
    reference: ReferencePath | None = None,
    operators=OPERATORS,
    lora_ranks=LORA_RANKS,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    scratch_max_steps: int = 600,
    fresh: Callable | None = None,
    progress: Callable = lambda name: None,
) -> AuditResult:
    """θ₀'s side (unless given), the model's cheapest path and its :class:`Worth`.

    Parameters
    ----------
    model, theta0 : torch.nn.Module
        The defended model and θ₀.
    data : AttackData
        The attacker's splits.
    reference : ReferencePath, optional
        θ₀'s side on ``data``, when already computed.
    operators, lora_ranks, seed, schedule, scratch_max_steps, fresh, progress
        As for :func:`reference_path`.

    Returns
    -------
    AuditResult
        The judgement.
    """
    if reference is None:
        reference = reference_path(
            theta0,
            data,
            operators,
            lora_ranks=lora_ranks,
            seed=seed,
            schedule=schedule,
            scratch_max_steps=scratch_max_steps,
            fresh=fresh,
            progress=progress,
            model_name="reference",
        )
    path = cheapest_path(
        model,
        data,
        reference,
        theta0,
        seed=seed,
        schedule=schedule,
        fresh=fresh,
        progress=progress,
        model_name="model",
    )
    return AuditResult(reference, path, worth(path, reference))
