"""θ₀'s plateau of an operator, and the race of its settings to a target (docs/theory.md §12).

An operator (an attacker's procedure: a linear probe, LoRA, fine-tuning, a retrain, training
from scratch) runs at each setting of a learning-rate grid. Every operator is evaluated on the
attacker's validation split at the same steps, :func:`next_eval`: every step up to
:data:`EVAL_DENSE`, then steps :data:`EVAL_RATIO` apart. A step schedule that is geometric is
geometric in FLOPs too, for every operator (its cost is ``setup + steps·per_step``), so no kind of
operator is read at a coarser resolution of its cost than another.

* **Reaching a level.** A run reaches an accuracy level at the first evaluation at which it is at
  least that level *and* still is at the next evaluation (:meth:`Trace.first_reaching`): one lucky
  evaluation of a small split neither sets a plateau nor reaches a target, and no operator is
  charged a lag for it (a trailing mean would charge each kind the spacing of its evaluations).
  A run's level (:attr:`Trace.best`) is the highest level it held over two evaluations.
* **θ₀'s plateau** (:func:`budget`). On θ₀ the grid runs until its best setting's plateau is
  confirmed: the plateau ``p`` is the highest level any setting holds, ``B₀`` the first evaluated
  step at which that setting holds ``p −`` :data:`PLATEAU_TOLERANCE`, and the plateau is confirmed
  once the run lasts at least :data:`BUDGET_FACTOR`·B₀ steps, at least ``min_steps`` steps, and at
  least :data:`MIN_CONFIRM_EVALS` evaluations after B₀ (so a flat start does not confirm a
  plateau at chance; ``min_steps`` is what guards against a setting that starts slower than the
  best and passes it later). A setting stops early only when its own plateau is confirmed by the
  same rule and lies more than :data:`PRUNE_GAP` points below the best: a setting that is still
  rising is never pruned.
* **The race to a target** (:func:`reach`). On any model the grid runs until some setting reaches
  the target, or until ``limit`` steps (what the caller can afford: a FLOP limit divided by the
  operator's cost of a step); the steps of the setting that got there first, or None.
* **The grid is widened per model**: while the best setting (the fastest, in a race) sits at an end
  of its learning-rate list, the next rate beyond that end (the grid's own ratio) runs too, up to
  :data:`MAX_WIDEN` times per end (``edge=True`` if the best is still at an end then): a defense
  that only moves the attacker's best learning rate is not one.

Runs are supplied by a factory ``make(variant, lrs) -> runs`` (:class:`Runs`); this module only
schedules them, so it is tested with synthetic runs and serves every operator alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

EVAL_DENSE = 16  # every step is evaluated up to this one
EVAL_RATIO = 2.0**0.125  # then evaluations about 9 % apart (8 a doubling)
BUDGET_FACTOR = 2  # θ₀'s run lasts at least this many times B₀
MIN_CONFIRM_EVALS = 8  # evaluations after B₀ before a plateau is confirmed
PLATEAU_TOLERANCE = 1.0  # points: B₀ is the first step this close to the plateau
TARGET_SHARE = 0.9  # the target: chance + 0.9 (plateau − chance)
MAX_WIDEN = 3  # learning rates added beyond each end of a grid at most
PRUNE_GAP = 5.0  # points: a setting confirmed this far below the best is not run longer


def next_eval(step: int) -> int:
    """The step of the evaluation after ``step`` (module docstring), the same for every operator.

    Parameters
    ----------
    step : int
        An evaluated step (0: none yet).

    Returns
    -------
    int
        ``step + 1`` up to :data:`EVAL_DENSE`, then ``ceil(step·EVAL_RATIO)``.
    """
    if step < EVAL_DENSE:
        return step + 1
    return max(step + 1, math.ceil(step * EVAL_RATIO))


def _evals_after(step: int, count: int) -> int:
    """The step of the ``count``-th evaluation after ``step``."""
    for _ in range(count):
        step = next_eval(step)
    return step


@dataclass(frozen=True)
class Eval:
    """One evaluation of a run: the optimizer steps taken and the validation accuracy (%)."""

    step: int
    validation: float


class Runs(Protocol):
    """Settings of one operator (one variant, several learning rates), trained in lock step."""

    def advance(self, targets: list[int | None]) -> list[Eval | str | None]:
        """Train each setting with a target step to that step, then evaluate it.

        An :class:`Eval`, or a string saying why the setting diverged (it is never advanced
        again); settings whose target is None give None.
        """

    def test(self, index: int) -> float | str:
        """The test accuracy (%) of setting ``index`` as it is now (a string: not finite)."""


# make(variant, lrs) -> Runs for those learning rates of that variant
Factory = Callable[[str, tuple], Runs]


def _held(values) -> np.ndarray:
    """``min(v[i], v[i+1])``: the level each evaluation held through the next one."""
    v = np.asarray(values, dtype=float)
    return np.minimum(v[:-1], v[1:]) if len(v) > 1 else np.zeros(0)


@dataclass(frozen=True)
class Trace:
    """One setting's run: the steps it was evaluated at and its validation accuracy (%) there."""

    variant: str
    lr: float
    label: str
    steps: tuple = ()
    validation: tuple = ()
    diverged: str = ""  # why the run stopped early ("" when it did not)

    def first_reaching(self, level: float) -> int | None:
        """The first evaluated step whose accuracy is ≥ ``level`` there and at the next evaluation.

        Parameters
        ----------
        level : float
            An accuracy (%).

        Returns
        -------
        int or None
            The step, or None when the run has not held ``level`` over two evaluations.
        """
        hit = np.flatnonzero(_held(self.validation) >= level)
        return int(self.steps[hit[0]]) if hit.size else None

    @property
    def best(self) -> float:
        """The highest level held over two consecutive evaluations (−inf before two)."""
        held = _held(self.validation)
        return float(held.max()) if held.size else -math.inf

    def to_dict(self) -> dict:
        return asdict(self)


def _label(variant: str, lr: float) -> str:
    return f"{variant}@{lr:.3g}" if variant else f"lr {lr:.3g}"


class _Race:
    """Every setting of one operator, stepped in lock step; settings can be added (widening)."""

    def __init__(self, make: Factory, grid: dict, labels: Callable | None):
        self.make, self.label = make, labels or _label
        self.grid = {v: sorted(lrs) for v, lrs in grid.items()}
        self.ratio = {v: (lrs[1] / lrs[0] if len(lrs) > 1 else None) for v, lrs in grid.items()}
        self.widened = {(v, end): 0 for v in grid for end in (-1, 1)}
        self.groups: list[tuple[Runs, list[tuple[str, float]]]] = []
        self.state: dict[tuple[str, float], dict] = {}
        for v, lrs in self.grid.items():
            self.add(v, tuple(lrs))

    def add(self, variant: str, lrs: tuple) -> None:
        self.groups.append((self.make(variant, lrs), [(variant, lr) for lr in lrs]))
        for lr in lrs:
            self.state[(variant, lr)] = {"steps": [], "val": [], "why": ""}

    def step(self, key) -> int:
        s = self.state[key]["steps"]
        return s[-1] if s else 0

    def live(self, key) -> bool:
        return not self.state[key]["why"]

    def advance(self, wanted: Callable[[tuple], bool], limit: int | None = None) -> bool:
        """One evaluation more for every live setting ``wanted`` accepts (never beyond ``limit``).

        False when none moved.
        """
        moved = False
        for runs, keys in self.groups:
            targets = [
                min(next_eval(self.step(k)), limit or math.inf)
                if self.live(k) and wanted(k) and (limit is None or self.step(k) < limit)
                else None
                for k in keys
            ]
            if all(t is None for t in targets):
                continue
            asked = [None if t is None else int(t) for t in targets]
            for k, t, out in zip(keys, asked, runs.advance(asked)):
                if t is None:
                    continue
                s = self.state[k]
                if isinstance(out, Eval):
                    s["steps"].append(int(out.step))
                    s["val"].append(float(out.validation))
                    moved = True
                else:
                    s["why"] = str(out or "stopped")
        return moved

    def run_to(self, step: int, keys=None) -> None:
        """Advance the live settings (of ``keys``, default all) until each has reached ``step``."""
        while self.advance(lambda k: keys is None or k in keys, limit=step):
            pass

    def test(self, key) -> float:
        """The test accuracy of setting ``key`` as it is now (NaN when it is not finite)."""
        for runs, keys in self.groups:
            if key in keys:
                out = runs.test(keys.index(key))
                return math.nan if isinstance(out, str) else float(out)
        raise KeyError(key)

    def trace(self, key) -> Trace:
        s = self.state[key]
        return Trace(
            key[0], key[1], self.label(*key), tuple(s["steps"]), tuple(s["val"]), s["why"]
        )

    def all(self) -> list[Trace]:
        return [self.trace(k) for k in sorted(self.state)]

    def widen(self, best: Trace) -> tuple | None:
        """The setting beyond ``best``'s end of its learning-rate list, added to the race.

        None when ``best`` is inside the list, the list has one rate, or that end was widened
        :data:`MAX_WIDEN` times.
        """
        v, lrs, r = best.variant, self.grid[best.variant], self.ratio[best.variant]
        end = -1 if best.lr == lrs[0] else 1 if best.lr == lrs[-1] else 0
        if not end or r is None or self.widened[(v, end)] >= MAX_WIDEN:
            return None
        lr = _snap(lrs[0] / r if end < 0 else lrs[-1] * r, r)
        self.widened[(v, end)] += 1
        self.grid[v] = sorted([*lrs, lr])
        self.add(v, (lr,))
        return (v, lr)

    def at_edge(self, best: Trace) -> bool:
        lrs = self.grid[best.variant]
        return len(lrs) > 1 and best.lr in (lrs[0], lrs[-1])


def _snap(lr: float, ratio: float) -> float:
    """``lr`` to three significant digits.

    On a grid of ratio √10 (half decades: 1e-3, 3.16e-3, 0.01, ...) snapped to the half decade, so
    that products of rounded rates do not drift (3.16e-3·√10 is 0.01, not 0.00999).
    """
    if abs(ratio - math.sqrt(10.0)) < 1e-2:
        lr = 10.0 ** (round(2.0 * math.log10(lr)) / 2.0)
    return float(f"{lr:.3g}")


def _diverged(operator: str, traces: list[Trace]) -> FloatingPointError:
    return FloatingPointError(
        f"{operator}: every setting diverged "
        f"({'; '.join(f'{t.label}: {t.diverged}' for t in traces)})"
    )


def _scored(traces: list[Trace]) -> list[Trace]:
    """The settings that held a level over two evaluations (before diverging, if they did)."""
    return [t for t in traces if len(t.steps) > 1]


def _plateau(traces: list[Trace]) -> tuple[Trace, float, int]:
    """The trace of the highest held level, that level, and B₀ on it."""
    best = max(_scored(traces), key=lambda t: (t.best, -t.steps[0], -t.lr))
    return best, best.best, best.first_reaching(best.best - PLATEAU_TOLERANCE)


def _confirm_length(b0: int, min_steps: int) -> int:
    """The run's length at which a plateau first held at step ``b0`` counts as confirmed."""
    return max(BUDGET_FACTOR * b0, min_steps, _evals_after(b0, MIN_CONFIRM_EVALS))


def _own_plateau_confirmed(t: Trace, min_steps: int) -> bool:
    """Whether ``t``'s own plateau is confirmed by the rule of the best setting's."""
    b = t.first_reaching(t.best - PLATEAU_TOLERANCE)
    return b is not None and t.steps[-1] >= _confirm_length(b, min_steps)


@dataclass(frozen=True)
class Budget:
    """θ₀'s plateau of one operator (module docstring).

    The plateau (%, the highest level held) reached by ``setting``, ``budget_steps`` B₀, the run's
    length, the test accuracy of that setting at the end of the run, whether the plateau was
    confirmed within ``max_steps``, whether the best setting was still at an end of the widened
    grid, the grid as widened (every race on a model starts from it) and every setting's trace.
    """

    operator: str
    chance: float
    plateau: float
    budget_steps: int
    setting: str
    test_at_plateau: float
    run_steps: int
    plateau_reached: bool
    edge: bool
    grid: dict = field(default_factory=dict)
    traces: tuple = ()

    @property
    def learns(self) -> bool:
        """Whether θ₀'s plateau is at least twice chance (a task the operator learns)."""
        return self.plateau >= 2 * self.chance

    def to_dict(self) -> dict:
        out = asdict(self)
        out["learns"] = self.learns
        return out


def budget(
    operator: str,
    make: Factory,
    grid: dict,
    *,
    chance: float,
    min_steps: int,
    max_steps: int,
    labels: Callable | None = None,
) -> Budget:
    """θ₀'s :class:`Budget` for ``operator``: its grid run until its plateau is confirmed.

    Parameters
    ----------
    operator : str
        The operator's name (for the record and errors).
    make : callable
        ``make(variant, lrs) -> Runs``.
    grid : dict
        ``{variant: learning rates}``.
    chance : float
        The accuracy (%) of always answering the most frequent class.
    min_steps : int
        The fewest steps a plateau is confirmed after.
    max_steps : int
        The most steps any setting runs.
    labels : callable, optional
        ``labels(variant, lr) -> str``.

    Returns
    -------
    Budget
        The plateau, B₀, the widened grid and every setting's trace.

    Raises
    ------
    FloatingPointError
        Every setting diverged before two evaluations.
    """
    race = _Race(make, grid, labels)
    # a level is held over two evaluations: at least two
    length, keep = min(max(min_steps, next_eval(next_eval(0))), max_steps), None
    while True:
        race.run_to(length, keep)
        traces = race.all()
        if not _scored(traces):
            if all(t.diverged for t in traces):
                raise _diverged(operator, traces)
            raise ValueError(f"{operator}: max_steps {max_steps} leaves no two evaluations")
        best, top, b0 = _plateau(traces)
        if race.at_edge(best) and race.widen(best) is not None:
            keep = None
            continue
        need = _confirm_length(b0, min_steps)
        if length >= need or length >= max_steps:
            break
        keep = {
            (t.variant, t.lr)
            for t in traces
            if not t.diverged
            and not (t.best < top - PRUNE_GAP and _own_plateau_confirmed(t, min_steps))
        }
        if not any(race.step(k) < min(need, max_steps) for k in keep):
            break  # nothing left that can run longer (the best diverged)
        length = min(max_steps, need)
    return Budget(
        operator,
        float(chance),
        float(top),
        int(b0),
        best.label,
        race.test((best.variant, best.lr)),
        int(max(race.step(k) for k in race.state)),
        bool(best.steps[-1] >= _confirm_length(b0, min_steps)),
        race.at_edge(best),
        {v: tuple(lrs) for v, lrs in race.grid.items()},
        tuple(traces),
    )


def target_level(chance: float, plateau: float) -> float:
    """The target ``chance + TARGET_SHARE·(plateau − chance)`` (``plateau`` when below chance).

    Parameters
    ----------
    chance, plateau : float
        Accuracies (%).

    Returns
    -------
    float
        The target accuracy (%).
    """
    return min(chance + TARGET_SHARE * (plateau - chance), plateau)


def _last(race: _Race, key) -> float:
    v = race.state[key]["val"]
    return v[-1] if v else -math.inf


def _fastest(traces: list[Trace], target: float) -> tuple[Trace | None, int | None]:
    """The setting that first reached ``target`` and that step; ``(None, None)`` when none did.

    Of several at the same step, the one of higher held level there, then the lower rate: a choice
    that does not depend on how far the settings ran after it.
    """
    reach = []
    for t in _scored(traces):
        s = t.first_reaching(target)
        if s is not None:
            held = float(_held(t.validation)[t.steps.index(s)])
            reach.append((s, -held, t.lr, t))
    if not reach:
        return None, None
    s, _, _, t = min(reach, key=lambda r: r[:3])
    return t, s


@dataclass(frozen=True)
class Reach:
    """One operator's race to a target on one model (module docstring).

    The steps the fastest setting needed (None: no setting held the target within ``limit``), that
    setting (the best one when none got there), the highest level any setting held, the longest
    run, the limit, whether the chosen setting was still at an end of the widened grid, its test
    accuracy at the end of its run, every setting's trace, the grid as widened, and why it
    ended (``stopped``).
    """

    operator: str
    target: float
    steps: int | None
    setting: str
    best: float
    run_steps: int
    limit: int
    edge: bool
    test: float
    traces: tuple = field(default=(), repr=False)
    grid: dict = field(default_factory=dict)
    stopped: str = "limit"  # "target", "limit" or "plateau" (every setting settled below it)

    @property
    def reached(self) -> bool:
        return self.steps is not None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reached"] = self.reached
        return out


def reach(
    operator: str,
    make: Factory,
    grid: dict,
    *,
    target: float,
    limit: int,
    labels: Callable | None = None,
    plateau_steps: int | None = None,
) -> Reach:
    """Race ``operator``'s settings to ``target``, at most ``limit`` steps each, the grid widened.

    Every setting of ``grid`` runs until one holds ``target`` (:meth:`Trace.first_reaching`) or
    until ``limit``; then, while the fastest setting (the best one when none got there) sits at an
    end of its learning-rate list, the next rate beyond it runs, to the step to beat. With
    ``plateau_steps``, the race also ends once every setting's own plateau is confirmed below the
    target (θ₀'s rule, ``min_steps`` = ``plateau_steps``): an operator whose steps cost little
    would otherwise run for millions of them to a FLOP limit it can never use.

    Parameters
    ----------
    operator : str
        The operator's name.
    make : callable
        ``make(variant, lrs) -> Runs``.
    grid : dict
        ``{variant: learning rates}`` (θ₀'s widened grid, for a model).
    target : float
        The accuracy (%) to reach.
    limit : int
        The most steps any setting may take (≥ 0; 0: the operator cannot afford one step).
    labels : callable, optional
        ``labels(variant, lr) -> str``.
    plateau_steps : int, optional
        The fewest steps after which a plateau below the target ends the race (None: never).

    Returns
    -------
    Reach
        The steps to the target or None, why the race ended, and every setting's trace.

    Raises
    ------
    FloatingPointError
        Every setting diverged before two evaluations.
    """
    if limit <= 0:
        return Reach(operator, float(target), None, "", -math.inf, 0, 0, False, math.nan)
    race = _Race(make, grid, labels)
    stops = []

    def settled(pool) -> bool:
        """Every setting of ``pool`` dead or settled below the target (its plateau confirmed)."""
        if plateau_steps is None:
            return False
        ts = [race.trace(k) for k in pool]
        return all(
            t.diverged or (t.best < target and _own_plateau_confirmed(t, plateau_steps))
            for t in ts
        )

    def race_to(limit, keys=None):
        pool = sorted(race.state) if keys is None else sorted(keys)
        while _fastest([race.trace(k) for k in pool], target)[1] is None:
            if settled(pool):
                stops.append("plateau")
                return
            if not race.advance(lambda k: k in pool, limit=limit):
                # at the limit: a setting at the target there is scored once more (a level is
                # reached where it is first held; the evaluation that shows it is held is not
                # the attacker's cost)
                pending = {k for k in pool if race.live(k) and _last(race, k) >= target}
                if pending:
                    race.advance(lambda k: k in pending)
                return

    race_to(limit)
    while True:
        traces = race.all()
        best, s = _fastest(traces, target)
        if best is None:
            scored = _scored(traces)
            if not scored:
                if all(t.diverged for t in traces):
                    raise _diverged(operator, traces)
                break  # the limit came before two evaluations: nothing to widen by
            best = max(scored, key=lambda t: (t.best, -t.lr))
        key = race.widen(best) if race.at_edge(best) else None
        if key is None:
            break
        # the new rate matters only if it reaches the target sooner (or if none did)
        race_to(limit if s is None else s, keys={key})
    traces = race.all()
    chosen, s = _fastest(traces, target)
    if chosen is None and _scored(traces):
        chosen = max(_scored(traces), key=lambda t: (t.best, -t.lr))
    if chosen is None:
        return Reach(
            operator,
            float(target),
            None,
            "",
            -math.inf,
            int(max(race.step(k) for k in race.state)),
            int(limit),
            False,
            math.nan,
            tuple(traces),
            {v: tuple(lrs) for v, lrs in race.grid.items()},
            "plateau" if stops else "limit",
        )
    return Reach(
        operator,
        float(target),
        s,
        chosen.label,
        max(t.best for t in traces),
        int(max(race.step(k) for k in race.state)),
        int(limit),
        race.at_edge(chosen),
        race.test((chosen.variant, chosen.lr)),
        tuple(traces),
        {v: tuple(lrs) for v, lrs in race.grid.items()},
        "target" if s is not None else "plateau" if stops and stops[0] else "limit",
    )
