"""Worst-case evaluation (:mod:`pycore.attacks`, :func:`pycore.attack_evaluation`, docs/findings.md
§4), θ archives (what they hold, their size caps, their keys) and the (i)/(ii) frontier."""

import dataclasses
import json
import math
import zipfile

import numpy as np
import pytest

import pycore._attacks as AT
import pycore._worst_case as W
from pycore import LinearTask, ParameterError, attack_evaluation, attacks as A, limits
from pycore._frontier import closed_form_frontier, regularizer_product, target_progress
from pycore._thetas import theta_key
from pycore.report import dumps_json, load_thetas, save_thetas
from tests.helpers import known_kappa, traced_peak


def test_grid_covers_every_family_as_stated():
    g = A.attacker_grid("mse")
    assert {c.family for c in g} == set(W.FAMILIES) - {"newton"} and len(g) == 65
    assert sum(c.family == "adam" for c in g) == len(W.ADAM_LR_FACTORS) * len(W.ADAM_BETAS) == 28
    assert {c.family for c in A.attacker_grid("bce")} == set(W.FAMILIES) - {"closed_form"}
    assert len({c.label for c in g}) == len(g) and len(A.attacker_grid("mse", quick=True)) == 15
    assert all(set(dict(c.params)) <= set(AT.ATTACKERS[c.attacker]) for c in g)
    with pytest.raises(ParameterError) as info:
        A.attacker_grid("hinge")
    assert info.value.parameter == "loss"


def test_run_grid_is_the_engine_and_the_worst_case_on_known_kappa():
    X, theta, y = known_kappa()
    P, Q = A.make_problem(X, y), A.make_problem(X @ theta, y)
    grid = A.attacker_grid("mse", quick=True)
    ref, run = (A.run_grid(p, grid, eps=(1e-2, 1e-4), max_steps=5000) for p in (P, Q))
    traj = AT.run_attackers(
        Q, [dict(c.params, attacker=c.attacker) for c in grid], max_steps=5000, tol=1e-4
    )
    assert run.steps == tuple((t.steps_to(1e-2), t.steps_to(1e-4)) for t in traj)
    assert (ref.kappa["kappa"], run.kappa["kappa"]) == pytest.approx((10, 1e3), rel=1e-9)
    b = W.kappa_bounds(run.kappa, ref.kappa)
    assert (b["gd"], b["cg"], b["nesterov"], b["whiten"]) == pytest.approx((100, 10, 10, 1))
    fb, fr = W.family_best(run, 1e-4), W.family_best(ref, 1e-4)
    for fam, (s, label) in fb.items():  # per family the minimum over its configurations
        own = [
            x
            for i, c in enumerate(grid)
            if c.family == fam and (x := run.steps_of(i, 1e-4)) is not None
        ]
        assert s == min(own) and label in [c.label for c in grid if c.family == fam]
    gd = W.slowdown(fb["gd"][0], fr["gd"][0], 5000)
    assert gd[1] == "=" and math.sqrt(100) < gd[0] <= 1.5 * 100  # GD pays ~κ: measured 60
    wc = A.worst_case(run, ref, 1e-4)  # whitening is affine invariant: nothing slows it
    assert (wc.family, wc.steps, wc.slowdown, wc.kind) == ("whiten", 1, 1.0, "=")
    fo = A.worst_case(run, ref, 1e-4, W.FIRST_ORDER)
    steps = [
        s for i, c in enumerate(grid) if c.family in W.FIRST_ORDER and (s := run.steps_of(i, 1e-4))
    ]
    assert fo.steps == min(steps) and 1 < fo.slowdown <= b[fo.family]  # CG: 19/7 ≤ √r


def test_slowdown_kinds_and_the_interval_helper():
    assert W.slowdown(300, 30, 1000) == (10.0, "=") and W.slowdown(None, 30, 1000) == (
        1001 / 30,
        ">=",
    )
    assert W.slowdown(30, None, 1000) == (30 / 1001, "<=") and W.slowdown(None, None, 1000) == (
        None,
        "n/a",
    )
    assert W.within([(12.0, "="), (11.0, ">=")], low=10) is True
    assert W.within([(12.0, "="), (9.0, "=")], low=10) is False
    assert W.within([(9.0, ">=")], low=10) is None  # a lower bound below 10 cannot tell
    assert W.within([(9.0, "<=")], low=10) is False and W.within([(20.0, "<=")], low=10) is None
    assert (
        W.within([(1.1, "="), (0.5, "<=")], high=1.2) is True
        and W.within([(1.3, "=")], high=1.2) is False
    )
    assert (
        W.within([(1.3, ">=")], high=1.2) is False and W.within([(None, "n/a")], high=1.2) is None
    )
    assert (
        W.within([(2.0, "=")], low=1.5, high=3) is True
        and W.within([(2.0, "=")], low=2.5) is False
    )


def test_kappa_reference_diagonal_and_logistic():
    Zd = np.vstack([np.diag(np.sqrt(np.logspace(0, 4, 6))), np.zeros((4, 6))])
    # diagonal Hessian: κ_J = 1 whatever κ
    kd = W.kappa_reference(A.make_problem(Zd, np.arange(10.0)))
    assert kd["kappa"] == pytest.approx(1e4, rel=1e-8) and kd["kappa_jacobi"] == pytest.approx(
        1.0, abs=1e-8
    )
    X = np.random.default_rng(0).standard_normal((60, 5))
    L = A.make_problem(X, (X[:, 0] > 0).astype(float), "bce", ridge_rel=1e-2)
    ev, kl = np.linalg.eigvalsh(L.hessian(L.w_star)), W.kappa_reference(L)
    assert kl["kappa"] == pytest.approx(ev[-1] / ev[0], rel=1e-8) and kl["kappa_jacobi"] >= 1


def test_best_so_far_is_a_bounded_running_minimum():
    steps = [50, None, 7, 300, 12]
    curves = W.best_so_far(steps, n_orders=40, rng=np.random.default_rng(0), cap=1000)
    assert (
        curves.shape == (40, 5)
        and np.all(np.diff(curves, axis=1) <= 0)
        and np.all(curves[:, -1] == 7)
    )
    assert set(curves[:, 0]) <= {50, 1001, 7, 300, 12}
    again = W.best_so_far(steps, n_orders=40, rng=np.random.default_rng(0), cap=1000)
    np.testing.assert_array_equal(curves, again)
    for n in (0, W.MAX_ORDERS + 1, 10**9, 2.5):  # 1e9 orders: refused before any allocation
        with pytest.raises(ParameterError) as info:
            W.best_so_far(steps, n_orders=n, rng=np.random.default_rng(0), cap=1000)
        assert info.value.parameter == "n_orders"


def test_the_facade_gives_the_grids_numbers():
    X, theta, y = known_kappa(3)
    rng = np.random.default_rng(4)
    task = LinearTask(X[:20], rng.standard_normal((20, 1)), X, y[:, None])
    rows = np.arange(10, 50)
    ev = attack_evaluation(theta, task, rng=np.random.default_rng(5), rows=rows, max_steps=500)
    grid = A.attacker_grid("mse")
    run, ref = (
        A.run_grid(
            A.make_problem(X[rows] @ t, y[rows]),
            grid,
            eps=(1e-4,),
            max_steps=500,
            rng=np.random.default_rng(5),
        )
        for t in (theta, np.eye(20))
    )
    fb, fr, b = (
        W.family_best(run, 1e-4),
        W.family_best(ref, 1e-4),
        W.kappa_bounds(run.kappa, ref.kappa),
    )
    assert list(ev.families) == list(fb) and (ev.eps, ev.cap, ev.n_rows) == (1e-4, 500, 40)
    for f, r in ev.families.items():
        assert (r.family, r.steps, r.attacker, r.reference_steps, r.reference_attacker) == (
            f,
            *fb[f],
            *fr[f],
        )
        assert (r.slowdown, r.kind, r.bound) == (*W.slowdown(fb[f].steps, fr[f].steps, 500), b[f])
    wc = A.worst_case(run, ref, 1e-4)
    assert ev.worst == dataclasses.replace(wc, bound=b[wc.family])
    saved = json.loads(dumps_json(ev))  # results.json keeps every family's numbers
    assert list(saved["families"]) == list(ev.families) and saved["n_rows"] == 40
    assert saved["worst"] == {**dataclasses.asdict(ev.worst), "bound": ev.worst.bound}
    cases = [
        ({"theta": np.eye(7)}, "theta"),
        ({"theta": np.ones((20, 4))}, "theta"),  # (D, D) only, as evaluate_linear takes
        ({"rows": [0, 99]}, "rows"),
        ({"rows": []}, "rows"),
        ({"rng": None}, "rng"),
        ({"eps": 1.0}, "eps"),
    ]
    for kw, parameter in cases:
        with pytest.raises(ParameterError) as info:
            attack_evaluation(**{"theta": theta, "task": task, "rng": rng, "quick": True, **kw})
        assert info.value.parameter == parameter


def test_theta_archives_round_trip_bit_exact_and_house_price_writes_every_theta(tmp_path):
    from experiments import house_price
    from pycore import rir
    from pycore.report import read_json

    arrays = {
        theta_key("ours", 3): np.random.default_rng(0).standard_normal((5, 5)),
        theta_key("ours", 3, "haar", "Q"): np.eye(5),
    }
    assert theta_key("ours", 3, "haar", "Q") == "ours+haar/seed3/Q"
    save_thetas(tmp_path / "t.npz", arrays, {"protocol": "strict", "ceiling": math.inf})
    back, meta = load_thetas(tmp_path / "t.npz")
    assert meta == {"protocol": "strict", "ceiling": float("inf")} and all(
        np.array_equal(back[k], v) and back[k].dtype == np.float64 for k, v in arrays.items()
    )
    for bad in ({"meta": np.eye(2)}, {"a": np.array(["x"])}):
        with pytest.raises(ParameterError):
            save_thetas(tmp_path / "u.npz", bad)
    out = tmp_path / "hp"
    assert (
        house_price.main(
            [
                "--seeds",
                "1",
                "--methods",
                "identity,closed_form",
                "--probe-steps",
                "2",
                "--jobs",
                "1",
                "--no-plot",
                "--harden",
                "haar",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    arrays, meta = load_thetas(out / "thetas.npz")
    for m in ("identity", "closed_form"):
        for run in read_json(out / "results.json")["methods"][m]["runs"]:
            hard, plain = arrays[f"{m}+haar/seed{run['seed']}"], arrays[f"{m}/seed{run['seed']}"]
            np.testing.assert_array_equal(plain @ arrays[f"{m}+haar/seed{run['seed']}/Q"], hard)
            assert rir(
                hard, arrays["data/train/X_P"], arrays["data/train/X_H"]
            ).value == pytest.approx(run["train"]["rir"], rel=1e-12)


def test_theta_archive_sizes_are_capped_before_reading(tmp_path, monkeypatch):
    """A small .npz may inflate to gigabytes (here 2 MB against a 1 MB cap), and a member's .npy
    header may declare 8 TB (numpy allocates what a header declares): both refused, naming the
    file, before the memory is asked for."""
    save_thetas(tmp_path / "ok.npz", {"ours/seed0": np.eye(3)}, {"a": 1})
    assert np.array_equal(load_thetas(tmp_path / "ok.npz")[0]["ours/seed0"], np.eye(3))
    np.savez_compressed(tmp_path / "bomb.npz", x=np.zeros(1 << 18))
    assert (tmp_path / "bomb.npz").stat().st_size < 10_000
    monkeypatch.setattr(limits, "MAX_ARCHIVE_BYTES", 1 << 20)
    _, peak = traced_peak(lambda: load_thetas(tmp_path / "bomb.npz"), match="bomb.npz")
    assert peak < 1 << 20
    assert load_thetas(tmp_path / "bomb.npz", max_bytes=4 << 20)[0]["x"].size == 1 << 18
    with zipfile.ZipFile(tmp_path / "lie.npz", "w") as zf, zf.open("x.npy", "w") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}
        )
        fh.write(bytes(64))
    with pytest.raises(ValueError, match="lie.npz"):
        load_thetas(tmp_path / "lie.npz")
    with pytest.raises(ParameterError) as e:
        load_thetas(tmp_path / "ok.npz", max_bytes=-1)
    assert e.value.parameter == "max_bytes"


@pytest.mark.parametrize("key", ["../../evil", "/abs", "a/../b", "a//b", "meta", "a b"])
def test_save_thetas_refuses_a_path_like_key(tmp_path, key):
    with pytest.raises(ParameterError) as e:
        save_thetas(tmp_path / "t.npz", {key: np.eye(2)})
    assert e.value.parameter == "arrays" and not (tmp_path / "t.npz").exists()


def test_attack_evaluation_probes_a_continuous_d_h_target_of_a_bce_task_with_squares():
    """LinearTask probes D_H with the squared loss: a BCE task (0/1 D_P labels) with a
    continuous D_H target attacks exactly as its squared-loss twin."""
    rng = np.random.default_rng(0)
    X_P, X_H = rng.normal(size=(40, 5)), rng.normal(size=(30, 5))
    y_P, y_H = (rng.random(40) > 0.5).astype(float), rng.normal(size=30)
    theta = np.eye(5) + 0.3 * rng.normal(size=(5, 5))
    kw = dict(quick=True, max_steps=200)
    bce = attack_evaluation(
        theta, LinearTask(X_P, y_P, X_H, y_H, loss="bce"), rng=np.random.default_rng(1), **kw
    )
    mse = attack_evaluation(
        theta, LinearTask(X_P, y_P, X_H, y_H), rng=np.random.default_rng(1), **kw
    )
    assert bce.loss == mse.loss == "mse"
    assert (bce.worst.steps, bce.worst.reference_steps) == (
        mse.worst.steps,
        mse.worst.reference_steps,
    )
    labels = LinearTask(X_P, y_P, X_H, (y_H > 0).astype(float), loss="bce")
    assert attack_evaluation(theta, labels, rng=np.random.default_rng(1), **kw).loss == "bce"


def test_regularizer_product_and_the_closed_form_frontier():
    from pycore import r_ill, r_well

    rng = np.random.default_rng(1)
    X_P, X_H = (known_kappa(s, N=n, D=8)[0] for s, n in ((1, 30), (2, 35)))
    t = LinearTask(X_P, rng.standard_normal((30, 1)), X_H, rng.standard_normal((35, 1)))
    theta = np.eye(t.D) + 0.2 * rng.standard_normal((t.D, t.D))
    p = regularizer_product(theta, t)  # scale-free, and the objective at its best scale
    assert regularizer_product(7.0 * theta, t) == pytest.approx(p, rel=1e-10)
    objective = [
        3.0 * r_well((t.X_P @ (c * theta)).T @ (t.X_P @ (c * theta)))
        + 5e4 * r_ill((t.X_H @ (c * theta)).T @ (t.X_H @ (c * theta)))
        for c in np.geomspace(0.01, 100, 2001)
    ]
    assert min(objective) == pytest.approx(2 * math.sqrt(3.0 * 5e4 * p), rel=1e-4)
    # keeps RIR, trades (i)/(ii)
    points = closed_form_frontier(t, None, [0.0, 0.2, 0.5])
    assert all(p.heldout is None and "heldout" not in p.to_dict() for p in points)
    fr = [p.train for p in points]
    assert [f.rir for f in fr] == pytest.approx([fr[0].rir] * 3, rel=1e-8)
    assert fr[0].harmful_ratio < fr[1].harmful_ratio < fr[2].harmful_ratio
    assert fr[0].pretrain_ratio < fr[1].pretrain_ratio
    assert target_progress(10.0, 0.1) == pytest.approx(1.0) == target_progress(100.0, 0.1)
    assert target_progress(100.0, 0.01) == pytest.approx(2.0) and target_progress(0.5, 0.01) < 0
    with pytest.raises(ParameterError):
        target_progress(2.0, 0.5, target=(0.5, 0.1))


def test_frontier_experiment_quick(tmp_path):
    from experiments import frontier
    from pycore.report import read_json

    out = tmp_path / "f"
    assert (
        frontier.main(
            [
                "--quick",
                "--protocols",
                "strict",
                "--optimizers",
                "adam",
                "--jobs",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = read_json(out / "results.json")
    cf = res["closed_form"]["strict"]
    assert [p["exponent"] for p in cf] == [0.0, 0.1, 0.2, 0.3, 0.5]
    assert [p["train"]["rir"] for p in cf] == pytest.approx([cf[0]["train"]["rir"]] * 5, rel=1e-8)
    p = res["selected"]["confirm"][0]["path"]
    assert frontier.path_best(res["selected"]["confirm"][0])[0] == max(
        target_progress(a, b) for a, b in zip(p["harmful_ratio"], p["pretrain_ratio"])
    )
