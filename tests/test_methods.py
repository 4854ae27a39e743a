"""The linear loops (:func:`pycore.immunize`): what the adaptive Algorithm 1 says of where it
ended."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn import datasets

from pycore import DivergenceError, LinearTask, immunize, rir_ceiling
from pycore._optim import THETA_GROWTH

# below this fraction of the ceiling the result advises the closed form (docs/design.md §4)
SMALL_FRACTION = 0.05


def _wine(std: bool) -> LinearTask:
    """Wine, class 0 (D_P) against class 1 (D_H), raw or z-scored columns (tests/test_defaults.py):
    raw, D_P's column scales span 3,800×."""
    w = datasets.load_wine()
    s = w.target < 2
    X, harmful = w.data[s], w.target[s] == 1
    keep = [c for c in range(X.shape[1]) if c not in (0, 9)]
    parts = [(X[~harmful][:, keep], X[~harmful][:, 0]), (X[harmful][:, keep], X[harmful][:, 9])]
    if std:
        z = lambda a: (a - a.mean(axis=0)) / a.std(axis=0)  # noqa: E731
        parts = [(z(A), z(y)) for A, y in parts]
    (XP, yP), (XH, yH) = parts
    return LinearTask(XP, yP, XH, yH)


@pytest.mark.parametrize("std", [False, True])
def test_the_adaptive_default_says_its_fraction_of_the_ceiling(std):
    task = _wine(std)
    res = immunize(task, rng=np.random.default_rng(0))
    ceiling = rir_ceiling(task.X_P, task.X_H).range_restricted
    assert res.immunized
    assert res.diagnostics["fraction_of_ceiling"] == pytest.approx(res.rir / ceiling, rel=1e-9)
    small = res.diagnostics["fraction_of_ceiling"] < SMALL_FRACTION
    assert small == (not std)  # raw columns: far below; z-scored: not
    assert res.diagnostics["advice"] == ("closed_form" if small else None)
    if small:  # what the advice points to gets the ceiling
        best = immunize(task, res.diagnostics["advice"], rng=np.random.default_rng(0))
        assert best.immunized and best.rir == pytest.approx(ceiling, rel=1e-6)


def test_algorithm_1_on_a_narrow_window_points_to_what_meets_it():
    """Ceiling 1.007 (D_H = D_P's rows plus noise 0.005): Adam ends at (i) = (ii) = 1; the advice
    is the closed form, which meets Definition 3.1 on the same task."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 6))
    X_H = X + 0.005 * rng.normal(size=X.shape)
    task = LinearTask(X, rng.normal(size=60), X_H, rng.normal(size=60))
    res = immunize(task, "ours", rng=np.random.default_rng(0))
    assert not res.immunized and res.diagnostics["advice"] == "closed_form"
    assert immunize(task, res.diagnostics["advice"], rng=np.random.default_rng(0)).immunized


@pytest.mark.parametrize("method", ["r_ill_only", "imma", "opt_kappa", "opt_kappa_balanced"])
def test_a_learning_rate_that_blows_theta_up_is_a_divergence_naming_lr(method):
    """lr = 1e30 makes θ the sum of its first steps (every κ ratio about 1e14, returned as a
    result before): refused when θ ends the run past THETA_GROWTH times its start; lr = 1e-3
    runs."""
    rng = np.random.default_rng(0)
    X_P = rng.standard_normal((50, 4)) * [1.0, 0.5, 0.2, 0.1]
    X_H = rng.standard_normal((40, 4)) @ rng.standard_normal((4, 4))
    task = LinearTask(X_P, rng.standard_normal(50), X_H, rng.standard_normal(40))
    with pytest.raises(DivergenceError) as e:
        immunize(task, method, rng=np.random.default_rng(0), lr=1e30, epochs=300)
    assert e.value.parameter == "lr"
    theta = immunize(task, method, rng=np.random.default_rng(0), lr=1e-3, epochs=300).theta
    assert np.abs(theta).max() < THETA_GROWTH
