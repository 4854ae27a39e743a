"""Strict protocol (docs/theory.md §10), range/null decomposition (§8) and Def. 3.1 bookkeeping."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pycore.data.house_price import load_house_price
from pycore.evaluate import def31_summary, evaluate_linear, immunized_def31
from pycore.immunize import immunize
from pycore.metrics import def31_exponent_window, rir, rir_ceiling
from pycore.protocol import constant_columns, strict_protocol
from pycore.tasks import LinearTask

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "house_price.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the scripts import `experiments`


@pytest.fixture(scope="module")
def data():
    return load_house_price()


@pytest.fixture(scope="module")
def strict(data):
    return strict_protocol(data.train, data.heldout, data.feature_names)


def _synthetic(rng, n=40, D=7):
    """D_P with a zero column (2), a nonzero constant column (5) and column 6 = column 0 + column 1
    (a null direction of K_P that no column is constant along); D_H varies in all of them."""
    X_P = rng.normal(size=(n, D))
    X_P[:, 2] = 0.0
    X_P[:, 5] = 0.3
    X_P[:, 6] = X_P[:, 0] + X_P[:, 1]
    X_H = rng.normal(size=(n + 10, D))
    return LinearTask(X_P, rng.normal(size=n), X_H, rng.normal(size=n + 10), "mse", "synthetic")


def test_strict_drops_exactly_the_constant_columns_and_names_them(data, strict):
    _, _, rep = strict
    expected = [data.feature_names[j] for j in np.flatnonzero(np.ptp(data.train.X_P, axis=0) == 0)]
    assert rep.dropped_columns == expected == ["Utilities", "3SsnPorch", "PoolArea", "PoolQC"]
    assert rep.dropped_indices == [data.feature_names.index(c) for c in expected]
    assert (rep.D_input, rep.D_after_drop, rep.rank_K_P, rep.null_dim_after_drop) == (79, 75, 73, 2)
    # Dropping alone leaves a null direction of K_P that D_H varies in (docs/theory.md §10).
    assert rep.null_leak_after_drop > 1e-4 and rep.restricted

    rng = np.random.default_rng(0)
    t = _synthetic(rng)
    names = [f"c{j}" for j in range(t.D)]
    _, _, r = strict_protocol(t, None, names)
    assert r.dropped_columns == ["c2", "c5"] and r.dropped_indices == [2, 5]
    assert list(constant_columns(t.X_P)) == [2, 5]
    assert r.D_after_drop == 5 and r.rank_K_P == 4 and r.restricted


def test_strict_makes_null_KP_inside_null_KH_and_the_ceiling_finite(data, strict):
    assert rir_ceiling(data.train.X_P, data.train.X_H).exact == np.inf
    tr, ho, rep = strict
    c = rir_ceiling(tr.X_P, tr.X_H)
    assert rep.inclusion_holds and rep.null_leak <= 1e-10 and c.null_leak <= 1e-10
    assert np.isfinite(c.exact) and c.exact == c.range_restricted
    assert c.exact == pytest.approx(409.2, rel=0.01)        # docs/theory.md §10, measured
    assert ho is not None and ho.D == tr.D == 75
    # The rows of D_P's training split are kept exactly; only what lies outside range(K_P) goes.
    keep = [j for j in range(79) if j not in rep.dropped_indices]
    np.testing.assert_allclose(tr.X_P, data.train.X_P[:, keep], atol=1e-12)
    assert not np.allclose(tr.X_H, data.train.X_H[:, keep], atol=1e-6)
    # The other form of the restriction is the same problem in r coordinates: same ceiling.
    trb, hob, repb = strict_protocol(data.train, data.heldout, data.feature_names, restriction="basis")
    assert trb.D == hob.D == repb.D == 73
    cb = rir_ceiling(trb.X_P, trb.X_H)
    assert cb.rank_K_P == 73 and cb.exact == pytest.approx(c.exact, rel=1e-8)

    t = _synthetic(np.random.default_rng(1))
    assert rir_ceiling(t.X_P, t.X_H).exact == np.inf
    for restriction in ("project", "basis"):
        s_tr, _, r = strict_protocol(t, restriction=restriction)
        assert r.inclusion_holds and np.isfinite(rir_ceiling(s_tr.X_P, s_tr.X_H).exact)


def test_strict_without_dependent_columns_only_drops():
    """Full rank after dropping: nothing to restrict, the kept columns are passed through as they are."""
    rng = np.random.default_rng(6)
    X_P = rng.normal(size=(30, 5))
    X_P[:, 3] = 1.5
    t = LinearTask(X_P, rng.normal(size=30), rng.normal(size=(40, 5)), rng.normal(size=40))
    tr, ho, r = strict_protocol(t, t)
    assert r.dropped_indices == [3] and not r.restricted and r.D == 4 and r.null_dim_after_drop == 0
    np.testing.assert_array_equal(tr.X_H, t.X_H[:, [0, 1, 2, 4]])
    np.testing.assert_array_equal(ho.X_P, t.X_P[:, [0, 1, 2, 4]])


def test_strict_bad_input():
    t = _synthetic(np.random.default_rng(2))
    with pytest.raises(ValueError, match="restriction must be one of"):
        strict_protocol(t, restriction="rotate")
    with pytest.raises(ValueError, match="feature_names has 3 names but the inputs have 7 columns"):
        strict_protocol(t, None, ["a", "b", "c"])
    flat = LinearTask(np.ones((5, 3)), np.zeros(5), np.eye(3), np.zeros(3))
    with pytest.raises(ValueError, match="every input column is constant"):
        strict_protocol(flat)


def test_closed_form_reaches_the_exact_ceiling_under_strict_and_immunizes_at_the_balanced_exponent(strict):
    tr, _, _ = strict
    c = rir_ceiling(tr.X_P, tr.X_H)
    w = def31_exponent_window(c)
    assert 0 <= w.low < w.balanced < w.high and not w.empty
    for a, immunizes in ((0.0, True), (w.balanced, True), (w.high + 0.02, False)):
        th = immunize(tr, "closed_form", rng=np.random.default_rng(0), exponent=a).theta
        r = rir(th, tr.X_P, tr.X_H)
        assert r.value / c.exact >= 0.99
        assert immunized_def31(r.harmful_ratio, r.pretrain_ratio) is immunizes
    # At the balanced exponent (i) = 1/(ii) = √ceiling; just inside the upper end (ii) is still < 1.
    th = immunize(tr, "closed_form", rng=np.random.default_rng(0), exponent=w.balanced).theta
    r = rir(th, tr.X_P, tr.X_H)
    assert r.harmful_ratio == pytest.approx(1 / r.pretrain_ratio, rel=1e-6)
    assert r.harmful_ratio == pytest.approx(np.sqrt(c.exact), rel=1e-6)
    th = immunize(tr, "closed_form", rng=np.random.default_rng(0), exponent=w.high - 0.02).theta
    assert rir(th, tr.X_P, tr.X_H).pretrain_ratio < 1


def test_evaluate_linear_range_null_parts():
    """A θ that only rescales null(K_P) directions: its RIR is all null part; one acting only on
    range(K_P): all range part (docs/theory.md §8)."""
    rng = np.random.default_rng(4)
    t = _synthetic(rng)
    held = _synthetic(np.random.default_rng(5))
    c = rir_ceiling(t.X_P, t.X_H)
    _, _, Vt = np.linalg.svd(t.X_P)
    r = np.linalg.matrix_rank(t.X_P)
    V_R, V_N = Vt[:r].T, Vt[r:].T
    only_null = np.eye(t.D) + V_N @ np.diag([4.0, 0.2, 9.0])[: V_N.shape[1], : V_N.shape[1]] @ V_N.T
    e = evaluate_linear(only_null, t, held, ceiling=c)
    assert e["rir_range_part"] == pytest.approx(1.0, rel=1e-9)
    assert e["rir_null_part"] == pytest.approx(e["rir"], rel=1e-9) and e["rir"] != pytest.approx(1.0)
    assert e["heldout_rir_null_part"] == pytest.approx(e["heldout_rir"], rel=1e-9)
    assert e["heldout_rir_range_part"] == pytest.approx(1.0, rel=1e-9)
    assert e["null_part_fraction"] == pytest.approx(1.0)
    only_range = np.eye(t.D) + V_R @ np.diag(rng.uniform(-0.5, 2.0, size=r)) @ V_R.T
    e = evaluate_linear(only_range, t, held, ceiling=c)
    assert e["rir_null_part"] == pytest.approx(1.0, rel=1e-9)
    assert e["rir_range_part"] == pytest.approx(e["rir"], rel=1e-9)
    assert e["null_part_fraction"] == pytest.approx(0.0, abs=1e-20)
    assert e["immunized"] is immunized_def31(e["harmful_ratio"], e["pretrain_ratio"])
    assert np.isnan(evaluate_linear(np.eye(t.D), t, held, ceiling=c)["null_part_fraction"])


def test_def31_bookkeeping():
    assert immunized_def31(1.5, 0.5) and not immunized_def31(0.9, 0.01) and not immunized_def31(5.0, 1.0)
    assert def31_summary([True, False, True]) == {"count": 2, "runs": 3, "per_seed": [True, False, True]}


def test_strict_flag_selects_the_strict_config_unless_a_flag_overrides():
    sys.path.insert(0, str(SCRIPT.parent))
    import house_price

    from experiments.cli import Settings

    assert house_price.build_config(house_price.parse_args(["--protocol", "strict"])) == Settings("strict")
    assert house_price.build_config(house_price.parse_args([])) == Settings("house_price")
    cfg = house_price.build_config(house_price.parse_args(["--protocol", "strict", "--lr", "0.123",
                                                           "--epochs", "7"]))
    assert cfg == Settings("strict", {"lr": 0.123, "epochs": 7})
    # A flag set to the paper-protocol default still overrides the strict configuration.
    cfg = house_price.build_config(house_price.parse_args(["--protocol", "strict", "--precond", "pinv"]))
    assert cfg.precond == "pinv" != Settings("strict").precond
    assert cfg == Settings("strict", {"precond": "pinv"})


def test_strict_experiment_smoke(tmp_path):
    """A CI-sized run of ``--protocol strict``: the protocol, the new keys, the finite ceiling."""
    out = tmp_path / "strict"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--protocol", "strict", "--seeds", "2",
                           "--epochs", "3", "--out", str(out), "--probe-steps", "5", "--jobs", "1",
                           "--no-plot"],
                          capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "dropped 4 column(s)" in proc.stdout and "Utilities, 3SsnPorch, PoolArea, PoolQC" in proc.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["protocol"] == "strict" and res["config"]["epochs"] == 3
    st = res["strict_protocol"]
    assert st["dropped_columns"] == ["Utilities", "3SsnPorch", "PoolArea", "PoolQC"] and st["inclusion_holds"]
    assert res["data"]["D"] == st["D"] == 75 and res["data"]["D_input"] == 79
    assert np.isfinite(res["ceiling"]) and res["ceiling"] == pytest.approx(409.2, rel=0.01)
    w = res["closed_form_exponent_window"]
    assert res["config"]["exponent"] == pytest.approx(w["balanced"])
    for m in ("identity", "r_ill_only", "imma", "opt_kappa", "ours", "closed_form"):
        e = res["methods"][m]
        for key in ("rir", "rir_range_part", "rir_null_part", "heldout_rir", "heldout_rir_range_part",
                    "heldout_rir_null_part", "null_part_fraction"):
            assert set(e[key]) == {"mean", "std", "per_seed"} and len(e[key]["per_seed"]) == 2
        assert e["immunized"]["runs"] == 2 and e["heldout_immunized"]["runs"] == 2
    cf = res["methods"]["closed_form"]
    assert cf["fraction_of_ceiling"]["mean"] >= 0.99 and cf["immunized"]["count"] == 2
    table = (out / "table.md").read_text()
    assert "strict protocol" in table and "Def. 3.1 seeds" in table and "range part" in table
