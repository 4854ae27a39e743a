"""Strict protocol and the ceiling it makes finite (docs/theory.md §10), the range/null split
(§8)."""

from __future__ import annotations

import numpy as np
import pytest

from pycore import (
    LinearTask,
    ParameterError,
    def31_exponent_window,
    evaluate_linear,
    rir,
    rir_ceiling,
    strict_protocol,
)
from pycore._threads import blas_threads
from pycore.data import load_house_price


@pytest.fixture(autouse=True)
def one_blas_thread():
    with blas_threads(1):  # the library's own rule at these sizes (docs/design.md §5)
        yield


@pytest.fixture(scope="module")
def data():
    return load_house_price()


@pytest.fixture(scope="module")
def strict(data):
    with blas_threads(1):
        return strict_protocol(data.train, data.heldout, data.feature_names)


def _synthetic(rng, n=40, D=7):
    """D_P with a zero column (2), a nonzero constant column (5) and column 6 = column 0 + column 1
    (a null direction of K_P that no column is constant along); D_H varies in all of them."""
    X_P = rng.normal(size=(n, D))
    X_P[:, 2], X_P[:, 5] = 0.0, 0.3
    X_P[:, 6] = X_P[:, 0] + X_P[:, 1]
    return LinearTask(
        X_P, rng.normal(size=n), rng.normal(size=(n + 10, D)), rng.normal(size=n + 10)
    )


def test_strict_drops_exactly_the_constant_columns_and_names_them(data, strict):
    _, _, rep = strict
    expected = [data.feature_names[j] for j in np.flatnonzero(np.ptp(data.train.X_P, axis=0) == 0)]
    assert rep.dropped_columns == expected == ["Utilities", "3SsnPorch", "PoolArea", "PoolQC"]
    assert rep.dropped_indices == [data.feature_names.index(c) for c in expected]
    assert (rep.D_input, rep.D_after_drop, rep.rank_K_P, rep.null_dim_after_drop) == (
        79,
        75,
        73,
        2,
    )
    assert rep.null_leak_after_drop > 1e-4 and rep.restricted  # dropping alone leaves a leak
    t = _synthetic(np.random.default_rng(0))
    _, _, r = strict_protocol(t, None, [f"c{j}" for j in range(t.D)])
    assert r.dropped_columns == ["c2", "c5"] and r.dropped_indices == [2, 5]
    assert r.D_after_drop == 5 and r.rank_K_P == 4 and r.restricted


def test_strict_makes_null_KP_inside_null_KH_and_the_ceiling_finite(data, strict):
    assert rir_ceiling(data.train.X_P, data.train.X_H).exact == np.inf
    tr, ho, rep = strict
    c = rir_ceiling(tr.X_P, tr.X_H)
    assert rep.inclusion_holds and rep.null_leak <= 1e-10 and c.null_leak <= 1e-10
    assert np.isfinite(c.exact) and c.exact == c.range_restricted
    assert c.exact == pytest.approx(409.2, rel=0.01)  # docs/theory.md §10
    assert ho.D == tr.D == 75
    keep = [j for j in range(79) if j not in rep.dropped_indices]
    # D_P's rows kept exactly
    np.testing.assert_allclose(tr.X_P, data.train.X_P[:, keep], atol=1e-12)
    assert not np.allclose(tr.X_H, data.train.X_H[:, keep], atol=1e-6)
    trb, hob, repb = strict_protocol(
        data.train, data.heldout, data.feature_names, restriction="basis"
    )
    assert trb.D == hob.D == repb.D == 73
    cb = rir_ceiling(trb.X_P, trb.X_H)
    assert cb.rank_K_P == 73 and cb.exact == pytest.approx(c.exact, rel=1e-8)
    t = _synthetic(np.random.default_rng(1))
    assert rir_ceiling(t.X_P, t.X_H).exact == np.inf
    for restriction in ("project", "basis"):
        s_tr, _, r = strict_protocol(t, restriction=restriction)
        assert r.inclusion_holds and np.isfinite(rir_ceiling(s_tr.X_P, s_tr.X_H).exact)


def test_strict_without_dependent_columns_only_drops():
    rng = np.random.default_rng(6)
    X_P = rng.normal(size=(30, 5))
    X_P[:, 3] = 1.5
    t = LinearTask(X_P, rng.normal(size=30), rng.normal(size=(40, 5)), rng.normal(size=40))
    tr, ho, r = strict_protocol(t, t)
    assert (
        r.dropped_indices == [3] and not r.restricted and r.D == 4 and r.null_dim_after_drop == 0
    )
    np.testing.assert_array_equal(tr.X_H, t.X_H[:, [0, 1, 2, 4]])
    np.testing.assert_array_equal(ho.X_P, t.X_P[:, [0, 1, 2, 4]])


def test_strict_bad_input_is_named():
    """A held-out task of another width used to end in an IndexError."""
    rng = np.random.default_rng(2)
    t = _synthetic(rng)
    wide = LinearTask(
        rng.normal(size=(9, 10)), rng.normal(size=9), rng.normal(size=(9, 10)), np.ones(9)
    )
    for kw, param in (
        (dict(restriction="rotate"), "restriction"),
        (dict(heldout=wide), "heldout"),
        (dict(feature_names=["a", "b"]), "feature_names"),
    ):
        with pytest.raises(ParameterError) as e:
            strict_protocol(t, **kw)
        assert e.value.parameter == param
    with pytest.raises(ValueError):
        strict_protocol(LinearTask(np.ones((5, 3)), np.zeros(5), np.eye(3), np.zeros(3)))


def _closed_form(c, a):
    """θ = [U_r Λ_r^{-½} Q_C diag(λ_C^{a/2}), 0], the closed form of docs/theory.md §10."""
    s = np.ones_like(c.lambda_C)
    s[: c.rank_C] = c.lambda_C[: c.rank_C] ** (a / 2)
    theta = np.zeros((c.basis.shape[0],) * 2)
    theta[:, : c.basis.shape[1]] = c.basis * s
    return theta


def test_the_ceiling_is_attained_and_the_window_is_exactly_definition_3_1(strict):
    tr, _, _ = strict
    c = rir_ceiling(tr.X_P, tr.X_H)
    w = def31_exponent_window(c)
    assert 0 <= w.low < w.balanced < w.high and not w.empty
    for a in (0.0, w.low + 0.02, w.balanced, w.high - 0.02, w.high + 0.02):
        r = rir(_closed_form(c, a), tr.X_P, tr.X_H)
        assert r.value == pytest.approx(c.exact, rel=1e-6)
        assert (r.harmful_ratio > 1 and r.pretrain_ratio < 1) is (w.low <= a < w.high)
    r = rir(_closed_form(c, w.balanced), tr.X_P, tr.X_H)  # (i) = 1/(ii) = √ceiling
    assert r.harmful_ratio == pytest.approx(1 / r.pretrain_ratio, rel=1e-6)
    assert r.harmful_ratio == pytest.approx(np.sqrt(c.exact), rel=1e-6)


def test_range_null_split_separates_what_D_P_sees():
    """θ rescaling only null(K_P) directions: all of its RIR is the null part; θ acting only on
    range(K_P): all of it is the range part (docs/theory.md §8)."""
    rng = np.random.default_rng(4)
    t = _synthetic(rng)
    _, _, Vt = np.linalg.svd(t.X_P)
    r = np.linalg.matrix_rank(t.X_P)
    V_R, V_N = Vt[:r].T, Vt[r:].T
    only_null = np.eye(t.D) + V_N @ np.diag([4.0, 0.2]) @ V_N.T
    only_range = np.eye(t.D) + V_R @ np.diag(rng.uniform(-0.5, 2.0, size=r)) @ V_R.T
    for theta, moved, still in (
        (only_null, "rir_null_part", "rir_range_part"),
        (only_range, "rir_range_part", "rir_null_part"),
    ):
        e = evaluate_linear(theta, t).train
        assert getattr(e, still) == pytest.approx(1.0, rel=1e-9) != e.rir
        assert getattr(e, moved) == pytest.approx(e.rir, rel=1e-9)
