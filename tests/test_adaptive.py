"""The adaptive rule's stops (:func:`pycore._adaptive.adaptive_descent`; docs/design.md §4): a
known bound on the margin ends the run once reached, a margin that gains less than a stated rate
ends it after its restarts, and a progress bar counts its steps only when asked for."""

import numpy as np
import pytest
import tqdm.auto

from pycore._adaptive import AdaptiveSettings, adaptive_descent

# docs/design.md §4: a gain of 1e-3 in the margin counts as progress; two restarts, then the end
PROGRESS_TOL, RESTARTS = 1e-3, 2


def _linear_margin(calls):
    """A rule whose margin is θ itself ((i) = e^θ, (ii) = e^−θ) and whose directions raise it:
    Adam on a constant gradient moves θ by lr a step. ``calls`` counts the direction calls (the
    steps taken)."""

    def log_ratios(theta):
        return float(theta[0]), -float(theta[0])

    def directions(theta):
        calls.append(1)
        return -np.ones(1), -np.ones(1)

    return log_ratios, directions


def test_a_known_bound_ends_the_run_once_the_margin_reaches_it():
    calls = []
    run = adaptive_descent(
        np.zeros(1),
        *_linear_margin(calls),
        AdaptiveSettings(lr=0.01, epochs=1000, patience=300, bound=0.5),
    )
    assert 0.5 - PROGRESS_TOL <= run.margin < 0.5 + 0.01
    assert run.steps == len(calls) < 60 and "bound" in run.stop
    free = adaptive_descent(
        np.zeros(1), *_linear_margin([]), AdaptiveSettings(lr=0.01, epochs=1000, patience=300)
    )
    assert free.steps == 1000 and free.margin > 5


def test_a_bound_at_or_below_zero_takes_no_step():
    calls = []
    run = adaptive_descent(
        np.zeros(1),
        *_linear_margin(calls),
        AdaptiveSettings(lr=0.01, epochs=1000, patience=300, bound=0.0),
    )
    assert run.steps == 0 and not calls and run.margin == 0.0


def test_a_margin_gaining_less_than_the_rate_ends_the_run_after_its_restarts():
    """1e-5 a step: PROGRESS_TOL (1e-3) every 100 steps, within a patience of 200, so without a
    rate the run uses its budget; at a rate of 1e-4 each 200-step window gains 2e-3 < 0.02, a
    window without gain: two restarts at lr/3, then the end."""
    kw = dict(lr=1e-5, epochs=2000, patience=200)
    free = adaptive_descent(np.zeros(1), *_linear_margin([]), AdaptiveSettings(**kw))
    assert free.steps == 2000 and free.restarts == 0
    calls = []
    slow = adaptive_descent(
        np.zeros(1), *_linear_margin(calls), AdaptiveSettings(min_rate=1e-4, **kw)
    )
    assert slow.restarts == RESTARTS and slow.steps < 1000 and "a step over" in slow.stop
    assert slow.margin > 0 and len(calls) <= slow.steps


@pytest.mark.parametrize("progress", [True, False])
def test_the_progress_bar_counts_the_steps_only_when_asked(monkeypatch, progress):
    bars = []

    class Bar:
        def __init__(self, iterable=None, **kw):
            self.total, self.n, self.closed = kw["total"], 0, False
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_postfix(self, **kw):
            pass

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    run = adaptive_descent(
        np.zeros(1),
        *_linear_margin([]),
        AdaptiveSettings(lr=0.01, epochs=40, patience=300),
        progress=progress,
    )
    if progress:
        assert [(b.total, b.n, b.closed) for b in bars] == [(40, run.steps, True)]
    else:
        assert not bars
