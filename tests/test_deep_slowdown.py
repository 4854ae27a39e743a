"""θ₀'s plateau and the race to a target (pycore/deep/_slowdown.py; docs/theory.md §12), on
synthetic runs: each setting's validation accuracy follows a given curve of the step, so every
number the module derives (plateau, B₀, confirmation, pruning, the steps to a target, widening,
the limit) is known in advance."""

from __future__ import annotations

import math

import pytest

from pycore.deep import _slowdown as S
from pycore.deep._slowdown import Eval

GRID = {"": (0.001, 0.01, 0.1)}
CHANCE = 20.0


class _Curves:
    """:class:`pycore.deep._slowdown.Runs` of the learning rates ``lrs``: a setting's validation
    accuracy at step ``s`` is ``curve(lr, s)`` (a string: it diverged there), its test accuracy
    that minus ``test_gap``. ``log`` (shared by every run of one factory) holds the last step
    each setting was trained to and how many evaluations were asked for."""

    def __init__(self, curve, lrs, test_gap, log):
        self.curve, self.lrs, self.test_gap = curve, lrs, test_gap
        self.log, self.steps = log, [0] * len(lrs)

    def advance(self, targets):
        out = []
        for g, (to, lr) in enumerate(zip(targets, self.lrs)):
            if to is None:
                out.append(None)
                continue
            assert to > self.steps[g]
            self.steps[g] = to
            self.log["steps"][lr] = to
            self.log["evals"] += 1
            v = self.curve(lr, to)
            out.append(v if isinstance(v, str) else Eval(to, v))
        return out

    def test(self, index):
        v = self.curve(self.lrs[index], self.steps[index])
        return v if isinstance(v, str) else v - self.test_gap


def _factory(curve, *, test_gap=1.0):
    log = {"steps": {}, "evals": 0}

    def make(variant, lrs):
        return _Curves(curve, lrs, test_gap, log)

    make.log = log
    return make


def _budget(curve, *, min_steps=10, max_steps=1000, operator="op", grid=GRID, **kw):
    return S.budget(
        operator,
        _factory(curve, **kw),
        grid,
        chance=CHANCE,
        min_steps=min_steps,
        max_steps=max_steps,
    )


def _reach(curve, target, limit=1000, grid=GRID):
    make = _factory(curve)
    return S.reach("op", make, grid, target=target, limit=limit), make


def _ramp(speed: dict, top: dict):
    """A rise from chance at ``speed[lr]`` points a step to ``top[lr]``."""
    return lambda lr, s: min(top[lr], CHANCE + speed[lr] * s)


def _by_decade(lr: float, values: dict):
    """``values`` keyed by the exponent of ``lr`` (−3 for 0.001): widened rates included."""
    return values[round(math.log10(lr))]


def _step_curve(delay: dict, top=80.0):
    """Chance until step ``delay[lr]``, then ``top``."""
    return lambda lr, s: top if s >= delay.get(lr, 10**9) else CHANCE


# θ₀'s curves: the middle rate is the best and the fastest
INTERIOR = _ramp({0.001: 1.0, 0.01: 6.0, 0.1: 3.0}, {0.001: 60.0, 0.01: 80.0, 0.1: 75.0})


def test_every_operator_is_evaluated_at_the_same_steps_every_step_then_geometrically():
    steps, s = [], 0
    while s < 2000:
        s = S.next_eval(s)
        steps.append(s)
    assert steps[: S.EVAL_DENSE] == list(range(1, S.EVAL_DENSE + 1))
    gaps = [b / a for a, b in zip(steps[S.EVAL_DENSE :], steps[S.EVAL_DENSE + 1 :])]
    # geometric from there: the same relative resolution of a cost setup + steps·per_step
    assert all(1.0 < g <= S.EVAL_RATIO + 1.0 / 16 for g in gaps)
    assert gaps[-1] == pytest.approx(S.EVAL_RATIO, rel=0.01)


@pytest.mark.parametrize("delay", [3, 17, 40])
def test_a_level_is_reached_where_it_is_first_held_over_two_evaluations(delay):
    """A step up at ``delay``: reached at the first evaluated step ≥ delay (no lag charged),
    confirmed by the next evaluation; one lucky evaluation is not a reach."""
    one = {"": (0.01,)}
    r, _ = _reach(_step_curve({0.01: delay}), 70.0, grid=one)
    first = next(s for s in _evals() if s >= delay)
    assert r.steps == first and r.reached
    lucky = lambda lr, s: 90.0 if s == 5 else CHANCE + s / 10  # noqa: E731
    r, _ = _reach(lucky, 70.0, limit=100, grid=one)
    assert r.steps is None and r.best < 70.0


def _evals():
    s = 0
    while True:
        s = S.next_eval(s)
        yield s


def test_the_plateau_is_the_highest_level_held_and_b0_the_first_step_within_a_point():
    seq = {1: 30.0, 2: 60.0, 3: 90.0, 4: 60.0, 5: 60.0, 6: 75.0, 7: 74.5}  # then 75 % for ever
    curve = {
        0.01: lambda s: seq.get(s, 75.0),
        0.001: lambda s: 65.0 if s <= 5 else 72.0,
        0.1: lambda s: 40.0,
    }
    ref = S.budget(
        "op",
        _factory(lambda lr, s: curve.get(lr, lambda s: CHANCE)(s)),
        GRID,
        chance=CHANCE,
        min_steps=5,
        max_steps=1000,
    )
    # 90 % once is not held; 75 % from step 6 on is; B₀: the first step holding ≥ 74
    assert (ref.plateau, ref.setting, ref.budget_steps) == (75.0, "lr 0.01", 6)
    assert ref.plateau_reached and ref.test_at_plateau == 74.0
    assert ref.run_steps >= max(S.BUDGET_FACTOR * 6, 5)


def test_a_flat_start_does_not_confirm_a_plateau():
    """Chance for the first 12 steps, then a rise to 80 %: a plateau at chance is never
    confirmed, whatever the factor on B₀; the budget finds the rise."""
    late = lambda lr, s: CHANCE if s <= 12 else min(80.0, CHANCE + 3 * (s - 12))  # noqa: E731
    ref = _budget(late, min_steps=40)
    assert ref.plateau == 80.0 and ref.plateau_reached
    assert ref.budget_steps >= 12 + (79.0 - CHANCE) / 3


def test_a_plateau_needs_min_confirm_evals_after_b0():
    flat = _budget(lambda lr, s: 50.0, min_steps=1)
    assert flat.budget_steps == 1
    evals_after = [s for s in _evals_upto(flat.run_steps) if s > flat.budget_steps]
    assert len(evals_after) >= S.MIN_CONFIRM_EVALS


def _evals_upto(n):
    out, s = [], 0
    while s < n:
        s = S.next_eval(s)
        out.append(s)
    return out


def test_a_rising_setting_is_never_pruned_a_settled_one_far_below_is():
    """lr 0.001 rises slowly (half a point a step up to 79); lr 0.1 settles at 30 %: the first
    runs as long as the best, the second stops once its own plateau is confirmed."""
    curve = {
        0.01: lambda s: min(80.0, CHANCE + 2 * s),
        0.001: lambda s: min(79.0, CHANCE + s / 2),
        0.1: lambda s: 30.0,
    }
    make = _factory(lambda lr, s: curve.get(lr, lambda s: CHANCE)(s))
    ref = S.budget("op", make, GRID, chance=CHANCE, min_steps=20, max_steps=1000)
    assert ref.setting == "lr 0.01" and ref.run_steps >= S.BUDGET_FACTOR * 30
    run = make.log["steps"]
    assert run[0.001] >= run[0.01] == ref.run_steps
    assert run[0.1] < ref.run_steps


def test_thetas_grid_is_widened_when_its_plateau_is_at_an_end():
    up = _factory(lambda lr, s: min(60.0 + 5 * math.log10(lr), CHANCE + 10 * s))
    ref = S.budget("op", up, GRID, chance=CHANCE, min_steps=10, max_steps=1000)
    assert ref.grid[""] == (0.001, 0.01, 0.1, 1.0, 10.0, 100.0) and ref.edge
    assert ref.setting == "lr 100" and ref.plateau == pytest.approx(70.0)


def test_the_race_is_widened_while_the_fastest_rate_is_at_an_end():
    faster = _factory(lambda lr, s: min(80.0, CHANCE + 2 * lr**0.25 * s))
    got = S.reach("op", faster, GRID, target=70.0, limit=1000)
    beyond = [float(f"{0.1 * 10**k:.3g}") for k in range(1, S.MAX_WIDEN + 1)]
    assert sorted(faster.log["steps"]) == [*GRID[""], *beyond]
    assert got.edge and got.setting == f"lr {beyond[-1]:.3g}"
    peak = {-3: 1.0, -2: 2.0, -1: 3.0, 0: 6.0, 1: 0.5}
    once = _factory(lambda lr, s: min(80.0, CHANCE + _by_decade(lr, peak) * s))
    got = S.reach("op", once, GRID, target=70.0, limit=1000)
    assert sorted(once.log["steps"]) == [*GRID[""], 1.0, 10.0]
    assert not got.edge and got.setting == "lr 1"


def test_the_race_never_trains_past_its_limit_but_to_confirm_a_level_held_there():
    """No setting reaches the target: each is trained to exactly the limit. A setting at the
    target at the limit is evaluated once more, and reaches it there."""
    r, make = _reach(lambda lr, s: {0.001: 25.0, 0.01: 40.0, 0.1: 30.0}[lr], 70.0, limit=37)
    assert r.steps is None and set(make.log["steps"].values()) == {37}
    assert r.limit == 37 and r.run_steps == 37
    r, make = _reach(_step_curve({0.001: 999, 0.01: 37, 0.1: 999}), 70.0, limit=37)
    assert r.steps == 37 and make.log["steps"][0.01] == S.next_eval(37)
    r, _ = _reach(_step_curve({0.001: 999, 0.01: 38, 0.1: 999}), 70.0, limit=37)
    assert r.steps is None


def test_a_limit_of_no_step_runs_nothing():
    r, make = _reach(INTERIOR, 70.0, limit=0)
    assert r.steps is None and make.log["evals"] == 0


def test_a_setting_that_diverged_is_never_the_best_of_the_budget_after_it_died():
    def theta0(lr, s):
        if lr >= 0.1:
            return "non-finite loss" if s >= 3 else 95.0
        return min(80.0, CHANCE + 6 * s)

    ref = _budget(theta0)
    assert [t.diverged for t in ref.traces if t.lr == 0.1] == ["non-finite loss"]
    # the level it held before dying (95 % at steps 1 and 2) is a level the attacker had
    assert ref.plateau == 95.0


def test_every_setting_diverged_is_an_error_naming_the_operator():
    with pytest.raises(FloatingPointError, match="lora_r8"):
        _budget(lambda lr, s: "diverged", operator="lora_r8")
    with pytest.raises(FloatingPointError, match="lora_r8"):
        S.reach("lora_r8", _factory(lambda lr, s: "diverged"), GRID, target=50.0, limit=10)


def test_a_plateau_below_chance_is_its_own_target():
    assert S.target_level(CHANCE, 15.0) == 15.0
    assert S.target_level(CHANCE, 80.0) == pytest.approx(CHANCE + S.TARGET_SHARE * 60.0)


def test_a_run_never_exceeds_max_steps_even_below_min_steps():
    make = _factory(INTERIOR)
    ref = S.budget("op", make, GRID, chance=CHANCE, min_steps=50, max_steps=8)
    assert ref.run_steps == 8 and max(make.log["steps"].values()) == 8
    assert not ref.plateau_reached


def test_a_race_whose_settings_all_settle_below_the_target_ends_there():
    """Settings flat below the target: with ``plateau_steps`` the race ends once each one's own
    plateau is confirmed, not at a limit of a million steps; without it, at the limit."""
    flat = lambda lr, s: {0.001: 30.0, 0.01: 45.0, 0.1: 40.0}.get(lr, CHANCE)  # noqa: E731
    make = _factory(flat)
    r = S.reach("op", make, GRID, target=70.0, limit=10**6, plateau_steps=20)
    assert r.steps is None and r.stopped == "plateau" and r.run_steps < 100
    r, _ = _reach(flat, 70.0, limit=60)
    assert r.stopped == "limit" and r.run_steps == 60
    rising = lambda lr, s: min(80.0, CHANCE + s / 4)  # noqa: E731  (it gets there at step 200)
    r = S.reach("op", _factory(rising), {"": (0.01,)}, target=70.0, limit=1000, plateau_steps=20)
    assert r.stopped == "target" and r.steps == next(s for s in _evals() if s >= 200)
