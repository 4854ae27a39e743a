"""θ₀'s budget and the slowdown an attacker feels (pycore/deep/_slowdown.py; docs/design.md §3),
on synthetic runs: each setting's validation accuracy follows a given curve of the step, so every
number the module derives (plateau, B₀, target, s₀, slowdown, censoring, widening, deficit) is
known in advance."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pycore.deep import SLOWDOWN_CAP, Eval, slowdown as S

GRID = {"": (0.001, 0.01, 0.1)}
CHANCE = 20.0


class _Curves:
    """:class:`pycore.deep.slowdown.Runs` of the learning rates ``lrs``: a setting's validation
    accuracy at step ``s`` is ``curve(lr, s)`` (a string: it diverged there), its test accuracy
    that minus ``test_gap``. ``log`` (shared by every run of one factory) holds the last step
    each setting was advanced to, ``evals`` how many evaluations were asked for."""

    def __init__(self, curve, lrs, eval_every, test_gap, log):
        self.curve, self.lrs, self.eval_every, self.test_gap = curve, lrs, eval_every, test_gap
        self.log, self.steps = log, [0] * len(lrs)

    def advance(self, active, test):
        out = []
        for g, (on, lr) in enumerate(zip(active, self.lrs)):
            if not on:
                out.append(None)
                continue
            self.steps[g] += self.eval_every
            step = self.steps[g]
            self.log["steps"][lr] = step
            self.log["evals"] += 1
            v = self.curve(lr, step)
            out.append(
                v if isinstance(v, str) else Eval(step, v, v - self.test_gap if test else math.nan)
            )
        return out


def _factory(curve, *, eval_every=1, test_gap=1.0):
    log = {"steps": {}, "evals": 0}

    def make(variant, lrs):
        return _Curves(curve, lrs, eval_every, test_gap, log)

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


def _ramp(speed: dict, top: dict):
    """A rise from chance at ``speed[lr]`` points a step to ``top[lr]``."""
    return lambda lr, s: min(top[lr], CHANCE + speed[lr] * s)


def _by_decade(lr: float, values: dict):
    """``values`` keyed by the exponent of ``lr`` (−3 for 0.001): widened rates included."""
    return values[round(math.log10(lr))]


# θ₀'s curves: the middle rate is the best and the fastest
INTERIOR = _ramp({0.001: 1.0, 0.01: 6.0, 0.1: 3.0}, {0.001: 60.0, 0.01: 80.0, 0.1: 75.0})


def _fast_rate_plateaus_lower(lr, s):
    """lr 0.1 reaches 85 % first, lr 0.01 goes on to 90 % (its own plateau, B₀'s)."""
    if lr >= 0.1:
        return min(85.0, CHANCE + 20 * s)
    if lr >= 0.01:
        return min(82.0, CHANCE + 11 * s) if s <= 6 else min(90.0, 82 + (s - 6) / 2)
    return min(60.0, CHANCE + s)


def _faster_beyond_the_grid(lr, s):
    """The plateau's rate (0.01) is inside the grid; higher rates reach the target sooner, up to
    rates the plateau alone would never have tried."""
    return min(90.0 if lr == 0.01 else 86.0, CHANCE + 2 * math.sqrt(lr / 0.01) * s)


@pytest.mark.parametrize(
    "curve,min_steps",
    [
        (INTERIOR, 10),
        (_fast_rate_plateaus_lower, 10),
        (_faster_beyond_the_grid, 100),
    ],
)
def test_theta0_against_itself_has_slowdown_one_and_no_deficit(curve, min_steps):
    """Whichever setting reaches the target first (θ₀'s plateau's, another, or a rate beyond
    the grid the plateau was found on), θ₀ raced against its own budget is slowed by exactly 1
    and loses nothing at B₀."""
    ref = _budget(curve, min_steps=min_steps)
    got = S.attack("op", _factory(curve), ref)
    assert (got.slowdown, got.censored, got.deficit) == (1.0, False, 0.0)
    assert got.steps_to_target == ref.reference_steps and got.budget is ref
    assert got.test_at_budget == ref.test_at_budget and not math.isnan(ref.test_at_budget)


def _step_curve(delay: dict, top=80.0):
    """Chance until step ``delay[lr]``, then ``top``: the trailing mean over SMOOTHING evaluations
    reaches the target (chance + 0.9 (top − chance)) SMOOTHING − 1 evaluations later."""
    return lambda lr, s: top if s >= delay[lr] else CHANCE


@pytest.mark.parametrize("k", [0.5, 2.0, 3.5])
def test_a_model_that_reaches_the_target_k_times_later_is_slowed_k_times(k):
    lag = S.SMOOTHING - 1
    theta0 = {0.001: 28, 0.01: 8, 0.1: 18}  # 0.01 first: s₀ = 8 + lag = 10
    ref = _budget(_step_curve(theta0), eval_every=1)
    assert ref.reference_steps == theta0[0.01] + lag and ref.setting == "lr 0.01"
    model = {lr: int(k * (d + lag)) - lag for lr, d in theta0.items()}
    got = S.attack("op", _factory(_step_curve(model)), ref)
    assert got.slowdown == pytest.approx(k, rel=1e-12) and not got.censored
    assert got.steps_to_target == model[0.01] + lag


def test_evaluations_every_few_steps_scale_every_step_count():
    lag = S.SMOOTHING - 1
    ref = _budget(_step_curve({0.001: 140, 0.01: 40, 0.1: 90}), eval_every=5, min_steps=50)
    assert ref.reference_steps == 40 + 5 * lag and ref.budget_steps == 40 + 5 * lag
    got = S.attack(
        "op", _factory(_step_curve({0.001: 500, 0.01: 100, 0.1: 300}), eval_every=5), ref
    )
    assert got.slowdown == pytest.approx((100 + 5 * lag) / (40 + 5 * lag))


def test_a_model_that_never_reaches_the_target_is_censored_at_the_cap():
    """No setting gets there: the slowdown is stored as the cap, flagged censored, with no step
    count; every setting was raced to exactly SLOWDOWN_CAP·s₀ steps and not one further."""
    ref = _budget(INTERIOR)
    s0 = ref.reference_steps
    flat = _factory(lambda lr, s: {0.001: 25.0, 0.01: 40.0, 0.1: 30.0}[lr])  # best inside
    got = S.attack("op", flat, ref)
    assert (got.slowdown, got.censored, got.steps_to_target) == (SLOWDOWN_CAP, True, None)
    cap = math.ceil(SLOWDOWN_CAP * s0)
    assert cap > ref.budget_steps and flat.log["steps"] == {lr: cap for lr in GRID[""]}
    assert flat.log["evals"] == 3 * cap  # one evaluation a step, three settings, no more


@pytest.mark.parametrize("extra,censored", [(-1, False), (0, True)])
def test_a_slowdown_of_the_cap_itself_is_censored(extra, censored):
    lag = S.SMOOTHING - 1
    ref = _budget(_step_curve({0.001: 28, 0.01: 8, 0.1: 18}))
    s0 = ref.reference_steps
    reach = int(SLOWDOWN_CAP * s0) + extra
    got = S.attack("op", _factory(_step_curve({0.001: 999, 0.01: reach - lag, 0.1: 999})), ref)
    assert got.censored is censored
    assert got.slowdown == (SLOWDOWN_CAP if censored else reach / s0)


def test_the_grid_is_widened_while_the_best_rate_is_at_an_end_and_at_most_max_widen_times():
    """A model on which every higher rate is faster: the grid grows beyond its top MAX_WIDEN
    times and the best rate is still at the end (``edge``); one on which only the first rate
    beyond the top is better grows once, and that rate inside the grid wins."""
    ref = _budget(INTERIOR)
    faster = _factory(lambda lr, s: min(80.0, CHANCE + 2 * lr**0.25 * s))
    got = S.attack("op", faster, ref)
    beyond = [float(f"{0.1 * 10**k:.3g}") for k in range(1, S.MAX_WIDEN + 1)]
    assert sorted(faster.log["steps"]) == [*GRID[""], *beyond]
    assert got.edge and got.setting == f"lr {beyond[-1]:.3g}"

    peak = {-3: 1.0, -2: 2.0, -1: 3.0, 0: 6.0, 1: 0.5}
    once = _factory(lambda lr, s: min(80.0, CHANCE + _by_decade(lr, peak) * s))
    got = S.attack("op", once, ref)
    assert sorted(once.log["steps"]) == [*GRID[""], 1.0, 10.0]
    assert not got.edge and got.setting == "lr 1"


def test_theta0s_grid_is_widened_when_its_plateau_is_at_an_end():
    up = _factory(lambda lr, s: min(60.0 + 5 * math.log10(lr), CHANCE + 10 * s))
    ref = S.budget("op", up, GRID, chance=CHANCE, min_steps=10, max_steps=1000)
    assert ref.grid[""] == (0.001, 0.01, 0.1, 1.0, 10.0, 100.0) and ref.edge
    assert ref.setting == "lr 100" and ref.plateau == pytest.approx(70.0)


def _dies(at: int, good: float):
    return lambda lr, s: good if s < at else "non-finite loss"


def test_a_setting_that_diverged_is_never_the_best():
    """lr 0.1 shows 95 % before its loss becomes non-finite: θ₀'s plateau, B₀ and s₀ are those
    of the settings that ran on; on a model, a rate that reaches the target and then diverges
    on its way to B₀ gives way to the next."""
    good = _ramp({0.001: 1.0, 0.01: 6.0, 0.1: 6.0}, {0.001: 60.0, 0.01: 80.0, 0.1: 80.0})
    theta0 = lambda lr, s: _dies(3, 95.0)(lr, s) if lr == 0.1 else good(lr, s)  # noqa: E731
    ref = _budget(theta0)
    assert ref.plateau == 80.0 and ref.setting == "lr 0.01" and ref.grid == GRID
    assert [t.diverged for t in ref.traces if t.lr == 0.1] == ["non-finite loss"]
    clean = _budget(lambda lr, s: good(lr, s) if lr < 0.1 else min(60.0, CHANCE + s))
    assert (ref.reference_steps, ref.budget_steps) == (clean.reference_steps, clean.budget_steps)
    # the model: lr 0.1 gets to 80 % at once and dies two evaluations later
    late = {0.001: ref.reference_steps + 14, 0.01: ref.reference_steps + 4}
    model = lambda lr, s: (  # noqa: E731
        _dies(S.SMOOTHING + 2, 80.0)(lr, s) if lr == 0.1 else 80.0 if s >= late[lr] else CHANCE
    )
    got = S.attack("op", _factory(model), ref)
    assert got.setting == "lr 0.01" and got.steps_to_target == late[0.01] + S.SMOOTHING - 1
    assert not math.isnan(got.test_at_budget)


def test_every_setting_diverged_is_an_error_naming_the_operator():
    with pytest.raises(FloatingPointError, match="lora_r8"):
        _budget(_dies(3, 50.0), operator="lora_r8")
    ref = _budget(INTERIOR)
    with pytest.raises(FloatingPointError, match="lora_r8"):
        S.attack("lora_r8", _factory(_dies(3, 50.0)), ref)  # below the target, 74 %
    with pytest.raises(FloatingPointError, match="lora_r8"):
        S.attack("lora_r8", _factory(lambda lr, s: "diverged"), ref)


def test_the_plateau_and_b0_are_read_through_the_trailing_mean():
    """One lucky evaluation (90 %) sets neither the plateau nor B₀: the trailing mean over
    SMOOTHING evaluations does; the run lasts BUDGET_FACTOR·B₀ steps, the settings more than
    PRUNE_GAP points below the best are not run longer, and θ₀'s test accuracy is read at B₀."""
    assert S.SMOOTHING == 3  # the hand-computed means below are over 3 evaluations
    seq = [30.0, 60.0, 90.0, 60.0, 60.0, 75.0, 75.0, 75.0]  # then 75 % for ever
    means = [30.0, 45.0, 60.0, 70.0, 70.0, 65.0, 70.0, 75.0]
    np.testing.assert_allclose(S.smoothed(seq), means)
    curve = {
        0.01: lambda s: seq[min(s, len(seq)) - 1],
        0.001: lambda s: 65.0 if s <= 5 else 72.0,  # within PRUNE_GAP (5 points) of the best
        0.1: lambda s: 40.0,  # far below: pruned
    }
    make = _factory(lambda lr, s: curve[lr](s))
    ref = S.budget("op", make, GRID, chance=CHANCE, min_steps=5, max_steps=1000)
    assert (ref.plateau, ref.setting, ref.budget_steps) == (75.0, "lr 0.01", 8)
    assert ref.target == pytest.approx(CHANCE + S.TARGET_SHARE * (75.0 - CHANCE))
    assert ref.reference_steps == 4  # the mean 70 reaches the target, 69.5, at step 4
    assert ref.run_steps == S.BUDGET_FACTOR * 8 and ref.plateau_reached
    assert ref.test_at_budget == 75.0 - 1.0
    run = {t.lr: t.steps[-1] for t in ref.traces}
    assert run == {0.001: S.BUDGET_FACTOR * 8, 0.01: S.BUDGET_FACTOR * 8, 0.1: 5}
    short = S.budget(
        "op", _factory(lambda lr, s: curve[lr](s)), GRID, chance=CHANCE, min_steps=5, max_steps=20
    )
    assert short.run_steps == 20 and not short.plateau_reached


def test_the_deficit_is_theta0s_test_accuracy_at_b0_minus_the_models():
    ref = _budget(INTERIOR, test_gap=1.0)
    got = S.attack("op", _factory(INTERIOR, test_gap=8.0), ref)
    assert got.slowdown == 1.0 and got.deficit == pytest.approx(7.0)
    assert got.to_dict()["budget"]["budget_steps"] == ref.budget_steps


def test_a_plateau_below_chance_is_its_own_target():
    """An operator that does not learn (validation below the majority class's share): the
    target is the plateau, not a level above it no setting reaches."""
    ref = S.budget(
        "op", _factory(lambda lr, s: 15.0), GRID, chance=CHANCE, min_steps=5, max_steps=100
    )
    assert ref.target == ref.plateau == 15.0 and not ref.learns
    assert S.attack("op", _factory(lambda lr, s: 15.0), ref).slowdown == 1.0


def test_a_run_never_exceeds_max_steps_even_below_min_steps():
    make = _factory(INTERIOR)
    ref = S.budget("op", make, GRID, chance=CHANCE, min_steps=50, max_steps=8)
    assert ref.run_steps == 8 and max(make.log["steps"].values()) == 8
    assert not ref.plateau_reached
