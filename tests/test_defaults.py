"""The defaults on data the project never saw: five scikit-learn data sets, raw and standardised.

Each pair splits one data set's rows into D_P and D_H by a rule of its own (a class, a sex, a
median) and takes a column or a label as each task's target.  Definition 3.1 is attainable on every
pair (the closed form's window is non-empty); with no options the closed form must meet it on all
ten and Algorithm 1 on all ten, and the adaptive Algorithm 1 must be
scale-free, blind to the order of the columns, and say why when Definition 3.1 is out of reach.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn import datasets

from pycore import LinearTask, ParameterError, def31_exponent_window, immunize, rir_ceiling
from pycore._adaptive import AdaptiveSettings, adaptive_descent

RESTARTS = 2  # the adaptive rule's restarts before it stops (docs/design.md §4)


def _z(A):
    sd = A.std(axis=0)
    return (A - A.mean(axis=0)) / np.where(sd > 0, sd, 1.0)


def _pair(X, harmful, y_p, y_h, *, drop=(), loss="mse", std=False, n_train=200):
    """D_P = rows not ``harmful``, D_H = the others; inputs: the columns not in ``drop``."""
    X = np.asarray(X, dtype=float)
    keep = [c for c in range(X.shape[1]) if c not in drop]
    XP, XH = X[~harmful][:n_train, keep], X[harmful][:n_train, keep]
    YP, YH = (
        np.asarray(y, dtype=float)[m][:n_train, None] for y, m in ((y_p, ~harmful), (y_h, harmful))
    )
    if std:
        XP, XH, YH = _z(XP), _z(XH), _z(YH)
        YP = YP if loss == "bce" else _z(YP)
    return LinearTask(XP, YP, XH, YH, loss=loss)


def _ink_labels(X, groups):
    """1 where a row's ink exceeds the median of its own digit (balanced binary targets)."""
    ink, out = X.sum(axis=1), np.zeros(len(X))
    for g in np.unique(groups):
        out[groups == g] = ink[groups == g] > np.median(ink[groups == g])
    return out


NAMES = sorted(
    f"{d} {tag}"
    for d in ("wine", "diabetes", "breast", "digits", "iris")
    for tag in ("raw", "std")
)


def new_tasks():
    w, b, g = datasets.load_wine(), datasets.load_breast_cancer(), datasets.load_digits()
    i, d = datasets.load_iris(), datasets.load_diabetes(scaled=False)
    out = {}
    for std in (False, True):
        tag = "std" if std else "raw"
        # wine: class 0 vs class 1; targets alcohol (D_P) and colour intensity (D_H)
        s = w.target < 2
        out[f"wine {tag}"] = _pair(
            w.data[s], w.target[s] == 1, w.data[s, 0], w.data[s, 9], drop=(0, 9), std=std
        )
        # diabetes: split by sex; targets BMI (D_P) and disease progression (D_H)
        out[f"diabetes {tag}"] = _pair(
            d.data, d.data[:, 1] > 1.5, d.data[:, 2], d.target, drop=(2,), std=std
        )
        # breast cancer: split at the median texture; D_P classifies the diagnosis (BCE), D_H fits
        # the area
        out[f"breast {tag}"] = _pair(
            b.data,
            b.data[:, 1] >= np.median(b.data[:, 1]),
            b.target,
            b.data[:, 3],
            drop=(3,),
            loss="bce",
            std=std,
        )
        s = np.isin(g.target, (3, 8))  # digits: 3 (D_P) vs 8 (D_H), 64 pixels, ink labels
        lab = _ink_labels(g.data[s], g.target[s])
        out[f"digits {tag}"] = _pair(g.data[s], g.target[s] == 8, lab, lab, loss="bce", std=std)
        s = i.target < 2  # iris: setosa vs versicolor; petal width of each
        out[f"iris {tag}"] = _pair(
            i.data[s], i.target[s] == 1, i.data[s, 3], i.data[s, 3], drop=(3,), std=std
        )
    return out


@pytest.fixture(scope="session")
def tasks() -> dict:
    """The ten tasks by name (:data:`NAMES`), loaded once, when a test first asks for them."""
    out = new_tasks()
    assert sorted(out) == NAMES
    return out


def test_every_new_task_is_attainable(tasks):
    for name, t in tasks.items():
        assert not def31_exponent_window(rir_ceiling(t.X_P, t.X_H)).empty, name


@pytest.mark.parametrize("name", NAMES)
def test_closed_form_default_meets_definition_31(tasks, name):
    t = tasks[name]
    res = immunize(t, "closed_form", rng=np.random.default_rng(0))
    w = def31_exponent_window(rir_ceiling(t.X_P, t.X_H))
    assert w.low <= res.diagnostics["exponent"] <= w.high
    assert res.immunized and res.harmful_ratio > 1 > res.pretrain_ratio


def test_algorithm1_default_meets_definition_31_on_new_tasks(tasks):
    met = {name: immunize(t, rng=np.random.default_rng(0)).immunized for name, t in tasks.items()}
    assert sum(met.values()) == len(tasks), met


def _short_run(task):
    return immunize(task, rng=np.random.default_rng(0), epochs=40).history


def test_algorithm1_default_is_scale_free_and_blind_to_column_order(tasks):
    t = tasks["wine std"]  # the R_well term outweighs R_ill 1e8-fold; scaled below, R_ill 1e8-fold
    base = _short_run(t)
    scaled = _short_run(LinearTask(10 * t.X_P, t.Y_P, 1e-3 * t.X_H, t.Y_H))
    perm = np.random.default_rng(1).permutation(t.D)
    permuted = _short_run(LinearTask(t.X_P[:, perm], t.Y_P, t.X_H[:, perm], t.Y_H))
    for other in (scaled, permuted):
        for key in ("harmful_ratio", "pretrain_ratio"):
            np.testing.assert_allclose(other[key], base[key], rtol=1e-6)


def test_unattainable_task_stops_at_once_and_says_so():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 5)) * [1, 2, 3, 4, 50]
    res = immunize(LinearTask(X, X[:, :1], X.copy(), X[:, 1:2]), rng=rng)  # D_H = D_P: ceiling 1
    assert not res.immunized and res.diagnostics["steps"] == 0
    np.testing.assert_array_equal(res.theta, np.eye(5))


@pytest.mark.parametrize(
    "options, parameter",
    [
        # the λ set to a number is named, never the one left at its default "auto"
        (dict(lambda_p="auto", lambda_h=1e7), "lambda_h"),
        (dict(lambda_p=100.0), "lambda_p"),
        (dict(optimizer="gd"), "optimizer"),
        (dict(init="random"), "init"),
        (dict(patience=0), "patience"),
    ],
)
def test_adaptive_options_are_checked(tasks, options, parameter):
    with pytest.raises(ParameterError) as e:
        immunize(tasks["iris std"], rng=np.random.default_rng(0), **options)
    assert e.value.parameter == parameter


def _band_problem(band_low, band_high):
    """A one-entry θ that Adam walks down by exactly lr a step (a constant direction), with a
    positive margin only inside ``(band_low, band_high)``: a step larger than the band jumps it."""

    def log_ratios(theta):
        t = float(theta[0, 0])
        m = min(t - band_low, band_high - t)
        return m, -m

    def directions(theta):
        return np.ones_like(theta), np.ones_like(theta)

    return log_ratios, directions


def test_a_step_too_large_for_the_margin_is_retried_at_a_third():
    # lr 1 visits -1, -2, -3, ...: never inside (-2.45, -2.2); lr 1/3 reaches -7/3
    log_ratios, directions = _band_problem(-2.45, -2.2)
    run = adaptive_descent(
        np.zeros((1, 1)), log_ratios, directions, AdaptiveSettings(lr=1.0, epochs=400, patience=20)
    )
    assert run.margin > 0
    assert run.theta[0, 0] == pytest.approx(-7 / 3, abs=1e-6)
    assert run.best_step > 4 * 20


def test_a_margin_that_no_lr_reaches_stops_after_the_restarts():
    log_ratios, directions = _band_problem(-2.45 + 1e-9, -2.45)  # an empty band
    run = adaptive_descent(
        np.zeros((1, 1)),
        log_ratios,
        directions,
        AdaptiveSettings(lr=1.0, epochs=10_000, patience=20),
    )
    assert run.margin == 0 and run.theta[0, 0] == 0
    assert run.restarts == RESTARTS
    assert run.steps < 10_000
