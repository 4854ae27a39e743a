"""Worst-case evaluation (pycore.worst_case), θ archives (pycore.thetas), the (i)/(ii) frontier
(pycore.frontier) and the θ files of the experiment scripts: docs/attacks.md."""
import math

import numpy as np
import pytest

from pycore import attacks as A
from pycore import worst_case as W
from pycore.frontier import closed_form_frontier, pareto_front, regularizer_product, target_progress
from pycore.tasks import LinearTask
from pycore.thetas import load_thetas, save_thetas, theta_key
from pycore.validation import ParameterError


def prescribed(rng, N, D, sigma):
    U, _ = np.linalg.qr(rng.standard_normal((N, D)))
    V, _ = np.linalg.qr(rng.standard_normal((D, D)))
    return (U * np.asarray(sigma, float)) @ V.T


def small_problem(seed=0, kappa=1e3, D=10):
    rng = np.random.default_rng(seed)
    Z = prescribed(rng, 40, D, np.sqrt(np.logspace(0, -np.log10(kappa), D)))
    return A.make_problem(Z, rng.standard_normal(40))


# ----------------------------------------------------------------------------------------------
def test_grid_covers_every_family_and_is_stated():
    g = W.attacker_grid("lsq")
    fams = {c.family for c in g}
    assert fams == set(W.FAMILIES) - {"newton"}
    assert sum(c.family == "adam" for c in g) == len(W.ADAM_LR_FACTORS) * len(W.ADAM_BETAS)
    assert sum(c.family == "lbfgs" for c in g) == len(W.LBFGS_MEMORY)
    assert {c.family for c in W.attacker_grid("logistic")} == set(W.FAMILIES) - {"closed_form"}
    assert len({c.label for c in g}) == len(g)                     # every configuration is named uniquely
    assert len(W.attacker_grid("lsq", quick=True)) < len(g) / 3
    with pytest.raises(ParameterError, match="loss"):
        W.attacker_grid("hinge")


def test_run_grid_steps_are_each_configurations_own():
    P = small_problem(1)
    grid = W.attacker_grid("lsq", quick=True)
    run = W.run_grid(P, grid, eps=(1e-2, 1e-6), max_steps=3000)
    for i, c in enumerate(grid):
        if c.attacker == "gd_exact":
            ref = A.attack_gd_exact(P, max_steps=3000, tol=1e-6)
        elif c.attacker == "cg":
            ref = A.attack_cg(P, max_steps=3000, tol=1e-6)
        elif c.attacker == "closed_form":
            ref = A.attack_closed_form(P, tol=1e-6)
        else:
            continue
        assert run.steps_of(i, 1e-6) == ref.steps_to(1e-6) and run.steps_of(i, 1e-2) == ref.steps_to(1e-2)
    fb = W.family_best(run, 1e-6)
    assert fb["closed_form"] == (1, "closed_form") and fb["whiten"][0] <= 2
    # per family the minimum over its configurations
    for fam, (s, label) in fb.items():
        own = [run.steps_of(i, 1e-6) for i, c in enumerate(grid) if c.family == fam]
        own = [x for x in own if x is not None]
        assert s == (min(own) if own else None)


def test_worst_case_names_the_fastest_attacker_and_compares_with_the_reference():
    P = small_problem(2)
    grid = [c for c in W.attacker_grid("lsq", quick=True) if c.family in ("gd", "cg", "adam")]
    ref = W.run_grid(P, grid, eps=(1e-4,), max_steps=5000)
    Q = A.make_problem(P.Z @ np.diag(np.logspace(0, 1.5, P.dim)), P.y)     # a worse-conditioned θ
    run = W.run_grid(Q, grid, eps=(1e-4,), max_steps=5000)
    wc = W.worst_case(run, ref, 1e-4)
    steps = [run.steps_of(i, 1e-4) for i in range(len(grid))]
    best = min(s for s in steps if s is not None)
    assert wc["steps"] == best and wc["attacker"] == grid[steps.index(best)].label
    rsteps = [s for s in (ref.steps_of(i, 1e-4) for i in range(len(grid))) if s is not None]
    assert wc["reference_steps"] == min(rsteps) and wc["slowdown"] == pytest.approx(best / min(rsteps))
    assert W.worst_case(run, ref, 1e-4, families=["gd"])["family"] in ("gd", None)


def test_slowdown_kinds():
    assert W.slowdown(300, 30, 1000) == (10.0, "=")
    assert W.slowdown(None, 30, 1000) == (1001 / 30, ">=")
    assert W.slowdown(30, None, 1000) == (30 / 1001, "<=")
    assert W.slowdown(None, None, 1000) == (None, "n/a")


def test_kappa_reference_and_bounds():
    P = small_problem(3, kappa=1e4)
    k = W.kappa_reference(P)
    assert k["kappa"] == pytest.approx(P.kappa, rel=1e-8)
    # a diagonal Hessian: Jacobi scaling makes it perfectly conditioned, κ alone forces nothing on Adam
    Zd = np.vstack([np.diag(np.sqrt(np.logspace(0, 4, 6))), np.zeros((4, 6))])
    kd = W.kappa_reference(A.make_problem(Zd, np.arange(10.0)))
    assert kd["kappa"] == pytest.approx(1e4, rel=1e-8) and kd["kappa_jacobi"] == pytest.approx(1.0, abs=1e-8)
    b = W.kappa_bounds({"kappa": 400.0, "kappa_jacobi": 9.0}, {"kappa": 4.0, "kappa_jacobi": 1.0})
    assert b["gd"] == 100 and b["cg"] == b["nesterov"] == b["lbfgs"] == 10
    assert b["adam"] == 9 and b["pcg_jacobi"] == 3 and b["whiten"] == b["closed_form"] == 1
    # logistic: the local Hessian at w*, ridge included
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 5))
    L = A.make_problem(X, (X[:, 0] > 0).astype(float), "logistic", ridge_rel=1e-2)
    kl = W.kappa_reference(L)
    ev = np.linalg.eigvalsh(L.hessian(L.w_star))
    assert kl["kappa"] == pytest.approx(ev[-1] / ev[0], rel=1e-8) and kl["kappa_jacobi"] >= 1


def test_best_so_far_is_a_running_minimum_over_random_orders():
    steps = [50, None, 7, 300, 12]
    curves = W.best_so_far(steps, n_orders=40, rng=np.random.default_rng(0), cap=1000)
    assert curves.shape == (40, 5)
    assert np.all(np.diff(curves, axis=1) <= 0) and np.all(curves[:, -1] == 7)
    assert set(curves[:, 0]) <= {50, 1001, 7, 300, 12}
    np.testing.assert_array_equal(curves, W.best_so_far(steps, n_orders=40, rng=np.random.default_rng(0),
                                                        cap=1000))


# ----------------------------------------------------------------------------------------------
def test_theta_archive_round_trip_is_bit_exact(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {theta_key("ours", 3): rng.standard_normal((5, 5)),
              theta_key("ours", 3, "haar"): rng.standard_normal((5, 5)),
              theta_key("ours", 3, "haar", "Q"): np.linalg.qr(rng.standard_normal((5, 5)))[0],
              "data/train/X_P": rng.standard_normal((7, 5))}
    assert theta_key("ours", 3, "haar", "Q") == "ours+haar/seed3/Q"
    save_thetas(tmp_path / "t.npz", arrays, {"protocol": "strict", "ceiling": math.inf})
    back, meta = load_thetas(tmp_path / "t.npz")
    assert set(back) == set(arrays) and meta == {"protocol": "strict", "ceiling": float("inf")}
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == np.float64
    with pytest.raises(ParameterError, match="archive key"):
        save_thetas(tmp_path / "u.npz", {"meta": np.eye(2)})
    with pytest.raises(ParameterError, match="not numeric"):
        save_thetas(tmp_path / "u.npz", {"a": np.array(["x"])})


def test_house_price_writes_every_theta_and_it_reloads(tmp_path):
    from experiments import house_price
    from pycore.metrics import rir
    from pycore.report import read_json

    out = tmp_path / "hp"
    rc = house_price.main(["--seeds", "1", "--methods", "identity,closed_form,ours", "--epochs", "2",
                           "--probe-steps", "2", "--jobs", "1", "--no-plot", "--harden", "haar",
                           "--out", str(out)])
    assert rc == 0
    res = read_json(out / "results.json")
    arrays, meta = load_thetas(out / "thetas.npz")
    assert meta["harden"] == "haar"
    X_P, X_H = arrays["data/train/X_P"], arrays["data/train/X_H"]
    for m in ("identity", "closed_form", "ours"):
        for run in res["methods"][m]["runs"]:
            s = run["seed"]
            hard, plain = arrays[f"{m}+haar/seed{s}"], arrays[f"{m}/seed{s}"]
            np.testing.assert_array_equal(plain @ arrays[f"{m}+haar/seed{s}/Q"], hard)
            # the saved θ gives the reported numbers, and so does the unhardened one (to 1e-10)
            assert rir(hard, X_P, X_H).value == pytest.approx(run["rir"], rel=1e-12)
            assert rir(plain, X_P, X_H).value == pytest.approx(run["rir"], rel=1e-10)
            assert run["hardening"]["max_rel_diff_vs_unhardened"] <= 1e-10
    assert "Hardening `haar`" in (out / "table.md").read_text()
    # a second run into the same folder replaces the whole set (thetas.npz is a declared output)
    rc = house_price.main(["--seeds", "1", "--methods", "identity", "--jobs", "1", "--no-plot",
                           "--out", str(out)])
    data_keys = {f"data/{r}/{k}" for r in ("train", "heldout") for k in ("X_P", "Y_P", "X_H", "Y_H")}
    assert rc == 0 and set(load_thetas(out / "thetas.npz")[0]) == {"identity/seed0", *data_keys}


# ----------------------------------------------------------------------------------------------
def _task(seed=0, D=8):
    rng = np.random.default_rng(seed)
    X_P = prescribed(rng, 30, D, np.sqrt(np.logspace(0, -2, D)))
    X_H = prescribed(rng, 35, D, np.sqrt(np.logspace(0, -3, D)))
    return LinearTask(X_P, rng.standard_normal((30, 1)), X_H, rng.standard_normal((35, 1)))


def test_regularizer_product_is_scale_free_and_is_the_objective_at_its_best_scale():
    from pycore.regularizers import r_ill, r_well

    t = _task(1)
    theta = np.eye(t.D) + 0.2 * np.random.default_rng(2).standard_normal((t.D, t.D))
    p = regularizer_product(theta, t)
    assert regularizer_product(7.0 * theta, t) == pytest.approx(p, rel=1e-10)
    lp, lh = 3.0, 5e4

    def objective(c):
        Z_P, Z_H = t.X_P @ (c * theta), t.X_H @ (c * theta)
        return lp * r_well(Z_P.T @ Z_P) + lh * r_ill(Z_H.T @ Z_H)
    cs = np.geomspace(0.01, 100, 4001)
    assert min(objective(c) for c in cs) == pytest.approx(2 * math.sqrt(lp * lh * p), rel=1e-4)


def test_closed_form_frontier_keeps_the_ceiling_and_trades_i_against_ii():
    t = _task(3)
    fr = closed_form_frontier(t, None, [0.0, 0.2, 0.5])
    rirs = [p["train"]["rir"] for p in fr]
    assert rirs[1] == pytest.approx(rirs[0], rel=1e-8) and rirs[2] == pytest.approx(rirs[0], rel=1e-8)
    assert fr[0]["train"]["harmful_ratio"] < fr[1]["train"]["harmful_ratio"] < fr[2]["train"]["harmful_ratio"]
    assert fr[0]["train"]["pretrain_ratio"] < fr[1]["train"]["pretrain_ratio"]


def test_target_progress_and_pareto():
    assert target_progress(10.0, 0.1) == pytest.approx(1.0)
    assert target_progress(100.0, 0.1) == pytest.approx(1.0)
    assert target_progress(100.0, 0.01) == pytest.approx(2.0)
    assert target_progress(math.sqrt(10), 0.01) == pytest.approx(0.5)
    assert target_progress(0.5, 0.01) < 0
    with pytest.raises(ParameterError):
        target_progress(2.0, 0.5, target=(0.5, 0.1))
    pts = [(1.0, 0.5), (2.0, 0.4), (2.0, 0.6), (3.0, 1.0), (0.5, 0.1)]
    assert pareto_front(pts) == [4, 1, 3]


def test_frontier_experiment_quick(tmp_path):
    from experiments import frontier
    from pycore.report import read_json

    out = tmp_path / "f"
    assert frontier.main(["--quick", "--protocols", "strict", "--optimizers", "adam", "--jobs", "1",
                          "--out", str(out)]) == 0
    for name in frontier.OUTPUTS:
        assert (out / name).stat().st_size > 0
    res = read_json(out / "results.json")
    cf = res["closed_form"]["strict"]
    assert [p["exponent"] for p in cf] == [0.0, 0.1, 0.2, 0.3, 0.5]
    assert all(p["train"]["rir"] == pytest.approx(cf[0]["train"]["rir"], rel=1e-8) for p in cf)
    sel = res["selected"]
    assert sel["protocol"] == "strict" and len(sel["confirm"]) == 1
    table = (out / "table.md").read_text()
    assert "Target (i) ≥ 10 and (ii) ≤ 0.1 on every seed: " in table
    assert "Closest any recorded strict" in table
    # the closest path point is the maximum of target_progress over the recorded path
    best = frontier.path_best(sel["confirm"][0])
    p = sel["confirm"][0]["path"]
    assert best[0] == max(target_progress(a, b) for a, b in zip(p["harmful_ratio"], p["pretrain_ratio"]))
