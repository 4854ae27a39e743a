"""The size limits (:mod:`pycore.limits`; docs/cli.md, docs/design.md §5): an input past a limit,
or work whose D×D arrays would pass the budget, is refused naming the size and the limit before
the memory is asked for (tracemalloc's peak stays far below it); within the budget nothing
changes."""

from __future__ import annotations

import numpy as np
import pytest

from pycore import (
    LinearTask,
    attack_evaluation,
    condition_number,
    evaluate_linear,
    harden_result,
    immunize,
    limits,
    rir_ceiling,
)
from pycore.data import load_house_price
from pycore.data._house_price import default_path
from tests.helpers import traced_peak


def _task(D, N=6, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return LinearTask(
        rng.normal(size=(N, D)),
        rng.normal(size=N),
        rng.normal(size=(N, D)),
        rng.normal(size=N),
        **kw,
    )


def test_a_broadcast_view_over_the_cap_is_refused_before_it_is_copied(monkeypatch):
    monkeypatch.setattr(limits, "MAX_DENSE_BYTES", 1 << 20)
    view = np.broadcast_to(np.arange(1000.0), (1000, 1000))  # 8 MB if expanded
    _, peak = traced_peak(lambda: condition_number(view), match="MAX_DENSE_BYTES")
    assert peak < 1 << 20


def test_sizes_that_cannot_fit_are_refused_up_front_naming_them(monkeypatch):
    monkeypatch.setattr(limits, "MAX_DENSE_BYTES", 1 << 16)
    with pytest.raises(ValueError, match=f"{default_path()}.*1460 × 79"):
        load_house_price()
    monkeypatch.setattr(limits, "MAX_DENSE_BYTES", 1 << 20)
    X = np.random.default_rng(0).standard_normal((5000, 40))  # its U alone would be 5000 × 40
    with pytest.raises(ValueError, match="5000 × 40"):
        rir_ceiling(X, X[:100])


def test_a_wide_task_is_refused_before_its_dxd_arrays_exist():
    """A 480 KB task of 2 × 30,000 inputs: np.eye alone would take 6.7 GiB."""
    X = np.random.default_rng(0).normal(size=(2, 30_000))
    task = LinearTask(X, [1.0, 2.0], 2 * X, [1.0, 3.0])
    for method in ("ours", "identity", "closed_form", "imma"):
        err, peak = traced_peak(lambda: immunize(task, method, rng=np.random.default_rng(0)))
        assert "30000" in str(err) and peak < 8 << 20, (method, peak)


@pytest.mark.parametrize(
    "entry",
    [
        lambda t, eye: rir_ceiling(t.X_P, t.X_H),
        lambda t, eye: evaluate_linear(eye, t),
        lambda t, eye: attack_evaluation(eye, t, rng=np.random.default_rng(0)),
        lambda t, eye: immunize(t, "opt_kappa", rng=np.random.default_rng(0)),
    ],
    ids=["rir_ceiling", "evaluate_linear", "attack_evaluation", "opt_kappa"],
)
def test_every_entry_point_checks_its_work_budget(monkeypatch, entry):
    task, eye = _task(300), np.eye(300)
    monkeypatch.setattr(limits, "MAX_WORK_BYTES", 8 * 300 * 300)  # one D×D array
    err, peak = traced_peak(lambda: entry(task, eye))
    # θ's own float64 copy is the one D×D array that may exist before the check
    assert "300" in str(err) and "MAX_WORK_BYTES" in str(err) and peak < 1.5 * 8 * 300 * 300


def test_hardening_checks_its_work_budget(monkeypatch):
    task = _task(300)
    res = immunize(task, "identity", rng=np.random.default_rng(0))
    monkeypatch.setattr(limits, "MAX_WORK_BYTES", 8 * 300 * 300)
    for kind in ("haar", "equalize"):
        err, peak = traced_peak(
            lambda: harden_result(res, task, kind, rng=np.random.default_rng(0))
        )
        assert "300" in str(err) and peak < 8 * 300 * 300, kind


def test_within_the_budget_nothing_changes():
    task = _task(20, N=30)
    res = immunize(task, "closed_form", rng=np.random.default_rng(0))
    assert np.isfinite(res.rir) and res.theta.shape == (20, 20)
