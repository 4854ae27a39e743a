"""Attack suite (pycore.attacks, docs/theory.md §10): every attacker reaches the true optimum, the step and
rate formulas hold, the bookkeeping (ε-steps, caps, sweeps) is right, bad input fails clearly."""
import math

import numpy as np
import pytest
import scipy.linalg
import scipy.optimize

from pycore import attacks as A

SEEDS = (0, 1, 2)


def prescribed(rng, N, D, sigma):
    """N×D matrix with singular values ``sigma`` (zeros allowed → rank deficient)."""
    U, _ = np.linalg.qr(rng.standard_normal((N, D)))
    V, _ = np.linalg.qr(rng.standard_normal((D, D)))
    return (U * np.asarray(sigma, float)) @ V.T


def lsq_problem(seed, kappa=300.0, N=60, D=12, null=2):
    rng = np.random.default_rng(seed)
    s = np.sqrt(np.logspace(0, -math.log10(kappa), D))        # κ(ZᵀZ) = kappa over the range
    s = np.concatenate([s[: D - null], np.zeros(null)])
    s[D - null - 1] = math.sqrt(1 / kappa)
    Z = prescribed(rng, N, D, s)
    return A.make_problem(Z, rng.standard_normal(N))


def logistic_problem(seed, N=150, D=10, ridge_rel=1e-3, duplicate=True):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D))
    if duplicate:                        # rank deficient, like MNIST's always-zero pixels
        X[:, -1] = X[:, 0]
        X[:, -2] = 0.0
    y = (X @ rng.standard_normal(D) + 0.7 * rng.standard_normal(N) > 0).astype(float)
    return A.make_problem(X, y, "logistic", ridge_rel=ridge_rel)


# ----------------------------------------------------------------------------------------------
# reference optimum
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_lsq_reference_matches_independent_solver(seed):
    P = lsq_problem(seed)
    assert P.rank == P.dim - 2
    # independent route: QR with column pivoting (gelsy) gives some minimiser; compare L* and Zw*
    w_ref = scipy.linalg.lstsq(P.Z, P.y, lapack_driver="gelsy")[0]
    r_ref = P.Z @ w_ref - P.y
    assert abs(P.L_star - 0.5 * r_ref @ r_ref) <= 1e-12 * (0.5 * P.y @ P.y)
    np.testing.assert_allclose(P.Z @ P.w_star, P.Z @ w_ref, atol=1e-10)
    # minimum norm: w* ⟂ null(Z)
    null = np.linalg.svd(P.Z)[2][P.rank:]
    assert np.max(np.abs(null @ P.w_star)) < 1e-10
    # μ and L over the nonzero spectrum of the Hessian ZᵀZ of the halved loss
    ev = np.linalg.eigvalsh(P.Z.T @ P.Z)
    assert P.smoothness == pytest.approx(ev[-1], rel=1e-12)
    assert P.strong_convexity == pytest.approx(ev[2], rel=1e-8)
    np.testing.assert_allclose(P.hessian(P.w_star), P.Z.T @ P.Z)


def test_lsq_kappa_agrees_with_the_core_definition():
    spectral = pytest.importorskip("pycore.spectral")
    P = lsq_problem(0, kappa=1e4)
    assert P.kappa == pytest.approx(spectral.condition_number(P.Z.T @ P.Z), rel=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_logistic_reference_is_the_minimiser(seed):
    P = logistic_problem(seed)
    _, g = P.value_grad(P.w_star)
    _, g0 = P.value_grad(np.zeros(P.dim))
    assert np.linalg.norm(g) <= 1e-10 * np.linalg.norm(g0)
    # independent solver cannot do better than L*
    res = scipy.optimize.minimize(lambda w: P.value_grad(w), np.zeros(P.dim), jac=True,
                                  method="BFGS", options={"gtol": 1e-12, "maxiter": 10000})
    assert P.L_star <= res.fun + 1e-12 * abs(res.fun)
    assert res.fun - P.L_star <= 1e-9 * abs(P.L_star)
    # ridge as documented: λ = ridge_rel·‖Z‖₂²/4, and L = ‖Z‖₂²/4 + λ bounds the Hessian
    s1 = np.linalg.norm(P.Z, 2)
    assert P.ridge == pytest.approx(1e-3 * s1 ** 2 / 4)
    for w in (np.zeros(P.dim), P.w_star):
        assert np.linalg.eigvalsh(P.hessian(w))[-1] <= P.smoothness * (1 + 1e-12)


def test_logistic_gradient_matches_finite_differences():
    P = logistic_problem(3)
    w = np.random.default_rng(5).standard_normal(P.dim) * 0.3
    err = scipy.optimize.check_grad(lambda v: P.value(v), lambda v: P.value_grad(v)[1], w)
    assert err <= 1e-5 * np.linalg.norm(P.value_grad(w)[1])


# ----------------------------------------------------------------------------------------------
# every attacker reaches the true optimum on an unimmunized problem
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", A.attackers_for("lsq"))
def test_lsq_attacker_reaches_optimum(name, seed):
    P = lsq_problem(seed, kappa=200.0)
    tr = A.ATTACKERS[name](P, max_steps=50000, tol=1e-12)
    assert tr.final_rel_subopt <= 1e-12 or (name == "closed_form" and tr.final_rel_subopt <= 1e-13)
    assert tr.steps_to(1e-12) is not None and tr.steps_to(1e-12) <= tr.n_steps
    # the predictor, not just the loss, is the optimum (w itself is unique only on range(Zᵀ))
    e = P.Z @ (tr.w_final - P.w_star)
    assert np.linalg.norm(e) <= 1e-5 * np.linalg.norm(P.Z @ P.w_star)
    assert tr.losses[-1] == pytest.approx(P.L_star, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", A.attackers_for("logistic"))
def test_logistic_attacker_reaches_optimum(name, seed):
    P = logistic_problem(seed)
    tr = A.ATTACKERS[name](P, max_steps=50000, tol=1e-10)
    assert tr.final_rel_subopt <= 1e-10
    assert np.linalg.norm(tr.w_final - P.w_star) <= 1e-3 * np.linalg.norm(P.w_star)


# ----------------------------------------------------------------------------------------------
# step and rate formulas
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: lsq_problem(4, kappa=50.0), lambda: logistic_problem(4)])
def test_exact_line_search_is_the_line_minimum(make):
    P = make()
    tr = A.attack_gd_exact(P, max_steps=3, tol=0.0)
    w = np.zeros(P.dim)
    _, g = P.value_grad(w)
    grid = np.linspace(0, 4 / np.linalg.norm(P.Z, 2) ** 2 * (4 if P.loss == "logistic" else 1), 4001)
    best = min(float(P.value(w - a * g)) for a in grid)
    assert tr.losses[1] <= best + 1e-12 * abs(best)
    # and no step size does better than the exact one (checked around the grid's best)
    a_grid = grid[np.argmin([float(P.value(w - a * g)) for a in grid])]
    fine = np.linspace(a_grid - grid[1], a_grid + grid[1], 2001)
    assert tr.losses[1] <= min(float(P.value(w - a * g)) for a in fine) + 1e-12 * abs(best)


@pytest.mark.parametrize("seed", SEEDS)
def test_gd_rates_on_quadratics(seed):
    P = lsq_problem(seed, kappa=100.0)
    k = P.kappa
    # GD with 1/L: every eigencomponent contracts by (1 − λᵢ/L), so the gap by ≤ (1 − 1/κ)² a step
    tr = A.attack_gd_constant(P, max_steps=300, tol=0.0)
    t = np.arange(tr.n_steps + 1)
    assert np.all(tr.rel_subopt <= (1 - 1 / k) ** (2 * t) * (1 + 1e-9) + 1e-15)
    # exact line search (Kantorovich): gap ratio per step ≤ ((κ−1)/(κ+1))²
    tr = A.attack_gd_exact(P, max_steps=300, tol=0.0)
    ratios = tr.rel_subopt[1:] / tr.rel_subopt[:-1]
    assert np.all(ratios[tr.rel_subopt[:-1] > 1e-13] <= ((k - 1) / (k + 1)) ** 2 + 1e-9)


def test_momentum_methods_pay_sqrt_kappa():
    P = lsq_problem(7, kappa=1e4, N=80, D=30, null=3)
    gd = A.attack_gd_constant(P, max_steps=400000, tol=1e-8).steps_to(1e-8)
    for name in ("heavy_ball", "nesterov", "cg"):
        s = A.ATTACKERS[name](P, max_steps=400000, tol=1e-8).steps_to(1e-8)
        assert s is not None and s <= 4 * math.sqrt(P.kappa) * math.log(1e8), name
        assert s < gd / 10, name


@pytest.mark.parametrize("seed", (7, 8, 9))
def test_momentum_rates_match_their_tuning(seed):
    P = lsq_problem(seed, kappa=1e4, N=80, D=30, null=3)
    sk = math.sqrt(P.kappa)
    # heavy ball's optimal tuning contracts the error by q = (√κ−1)/(√κ+1) a step (the gap by
    # q²), up to the polynomial factor of its double root; measured ≤ 1.43× the pure rate
    steps = A.attack_heavy_ball(P, max_steps=5000, tol=1e-14).steps_to(1e-12)
    pure = math.log(1e12) / (-2 * math.log((sk - 1) / (sk + 1)))
    assert steps is not None and pure < steps <= 1.55 * pure
    # Nesterov with step 1/L and β = (√κ−1)/(√κ+1): error ~ (1 − 1/√κ)^t; measured ≤ 1.11×
    steps = A.attack_nesterov(P, max_steps=5000, tol=1e-14).steps_to(1e-12)
    pure = math.log(1e12) / (-2 * math.log(1 - 1 / sk))
    assert steps is not None and steps <= 1.25 * pure


def test_cg_terminates_in_number_of_distinct_eigenvalues():
    rng = np.random.default_rng(0)
    Z = prescribed(rng, 40, 15, [3.0] * 5 + [1.0] * 5 + [0.2] * 3 + [0.0] * 2)
    P = A.make_problem(Z, rng.standard_normal(40))
    tr = A.attack_cg(P, max_steps=3, tol=0.0)
    assert tr.n_steps == 3 and tr.final_rel_subopt <= 1e-12


def test_closed_form_is_one_step_whatever_kappa():
    for kappa in (1e2, 1e8):
        tr = A.attack_closed_form(lsq_problem(1, kappa=kappa))
        assert tr.n_steps == 1 and tr.steps_to(1e-6) == 1


def test_larger_kappa_slows_first_order_attackers():
    easy, hard = lsq_problem(2, kappa=1e2, D=20), lsq_problem(2, kappa=1e4, D=20)
    for name in ("gd_exact", "gd_constant", "nesterov", "heavy_ball"):
        se = A.ATTACKERS[name](easy, max_steps=200000, tol=1e-6).steps_to(1e-6)
        sh = A.ATTACKERS[name](hard, max_steps=200000, tol=1e-6).steps_to(1e-6)
        assert sh > 3 * se, name


@pytest.mark.parametrize("loss", ["lsq", "logistic"])
def test_scale_invariance(loss):
    """θ → cθ must not change any attacker's step count: the attacker undoes it by w → w/c.
    (Fails if Adam's lr, the logistic ridge or L were absolute rather than scale-aware.)"""
    P = lsq_problem(5, kappa=1e3) if loss == "lsq" else logistic_problem(5)
    Q = A.make_problem(P.Z * 37.0, P.y, loss, ridge_rel=P.info.get("ridge_rel", 1e-4))
    for name in A.attackers_for(loss):
        if name == "adam":
            kw = {"lr_factors": (1e-1, 1e-2)}
        else:
            kw = {}
        a = A.ATTACKERS[name](P, max_steps=20000, tol=1e-6, **kw)
        b = A.ATTACKERS[name](Q, max_steps=20000, tol=1e-6, **kw)
        # SciPy's L-BFGS-B and nonlinear-CG line searches start from absolute trial steps, so
        # they are not exactly invariant: only require both to get there.
        exact = name not in ("lbfgs", "cg") or (name == "cg" and loss == "lsq")
        for eps in (1e-2, 1e-4):
            sa, sb = a.steps_to(eps), b.steps_to(eps)
            assert sa is not None and sb is not None
            if exact:
                assert abs(sa - sb) <= 1, (name, eps, sa, sb)


# ----------------------------------------------------------------------------------------------
# bookkeeping: relative suboptimality, ε-steps, caps, sweeps
# ----------------------------------------------------------------------------------------------
def test_trajectory_bookkeeping():
    P = lsq_problem(0, kappa=1e2)
    tr = A.attack_gd_exact(P, max_steps=500, tol=0.0)
    assert tr.rel_subopt[0] == 1.0 and len(tr.losses) == len(tr.rel_subopt) == 501
    gaps = (tr.losses - P.L_star) / (tr.losses[0] - P.L_star)
    big = gaps > 1e-8                        # where the plain difference is still accurate
    np.testing.assert_allclose(tr.rel_subopt[big], gaps[big], rtol=1e-6)
    for eps in (1e-1, 1e-3):
        s = tr.steps_to(eps)
        assert tr.rel_subopt[s] <= eps and np.all(tr.rel_subopt[:s] > eps)
    assert tr.wall_seconds > 0


def test_cap_is_respected_and_reported():
    P = lsq_problem(0, kappa=1e6)
    for name in ("gd_exact", "gd_constant", "heavy_ball", "nesterov", "adam", "cg", "lbfgs"):
        tr = A.ATTACKERS[name](P, max_steps=5, tol=1e-12)
        assert tr.step_cap == 5 and tr.n_steps <= 5, name
        assert tr.steps_to(1e-12) is None, name
        assert tr.summary()["steps_to"]["1e-06"] is None


def test_adam_sweep_takes_the_best_learning_rate_per_eps():
    P = lsq_problem(3, kappa=1e3)
    tr = A.attack_adam(P, max_steps=3000, tol=1e-6, lr_factors=(1.0, 1e-1, 1e-2, 1e-3))
    runs = (tr, *tr.sweep)
    assert len(runs) == 4 and sorted(r.params["lr_factor"] for r in runs) == [1e-3, 1e-2, 1e-1, 1.0]
    for eps in (1e-1, 1e-2, 1e-4, 1e-6):
        own = [r.own_steps_to(eps) for r in runs]
        reached = [s for s in own if s is not None]
        assert tr.steps_to(eps) == (min(reached) if reached else None)
    # every swept run is a genuine Adam run: its first step moves each coordinate by ≈ lr
    lr = tr.params["lr"]
    one = A.attack_adam(P, max_steps=1, tol=0.0, lr_factors=(tr.params["lr_factor"],))
    assert np.max(np.abs(one.w_final)) == pytest.approx(lr, rel=1e-6)


def test_steps_to_takes_the_minimum_over_a_sweep():
    def traj(rel, lr):
        rel = np.asarray(rel, float)
        return A.AttackTrajectory("adam", rel, rel, 10, 0.0, {"lr": lr})

    fast_then_stuck = traj([1, 1e-2, 1e-3, 1e-3, 1e-3], 1.0)
    slow_but_deep = traj([1, 0.5, 0.1, 1e-2, 1e-5], 0.1)
    slow_but_deep.sweep = (fast_then_stuck,)
    assert slow_but_deep.own_steps_to(1e-2) == 3
    assert slow_but_deep.steps_to(1e-2) == 1           # the other learning rate got there first
    assert slow_but_deep.steps_to(1e-4) == 4
    assert slow_but_deep.steps_to(1e-6) is None
    s = slow_but_deep.summary((1e-2, 1e-6))
    assert s["steps_to"] == {"0.01": 1, "1e-06": None} and s["sweep"][0]["steps_to"]["0.01"] == 1


def test_run_attack_suite_defaults_and_labels():
    res = A.run_attack_suite(lsq_problem(0), max_steps=200, tol=1e-6)
    assert tuple(res) == A.attackers_for("lsq") and "closed_form" in res
    res = A.run_attack_suite(logistic_problem(0), max_steps=200, tol=1e-6)
    assert "newton" in res and "closed_form" not in res
    for name in res:
        assert name in A.ATTACKER_LABELS


def test_gd_exact_matches_the_lead_probe():
    """Same prober, two implementations: pycore.probe (un-halved loss) and attacks (halved)."""
    probe = pytest.importorskip("pycore.probe")
    P = lsq_problem(6, kappa=1e3, null=0)
    tr = A.attack_gd_exact(P, max_steps=50, tol=0.0)
    ref = probe.gd_exact_line_search(P.Z, P.y, 50)
    np.testing.assert_allclose(tr.losses, 0.5 * np.asarray(ref.loss).ravel(), rtol=1e-9)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("Z, y, loss, match", [
    (np.ones(5), np.ones(5), "lsq", "2-D"),
    (np.ones((5, 2)), np.ones(4), "lsq", "rows"),
    (np.ones((5, 2)), np.ones((5, 2)), "lsq", "one target"),
    (np.full((5, 2), np.nan), np.ones(5), "lsq", "NaN"),
    (np.ones((5, 2)), np.array([0, 1, 2, 0, 1.0]), "logistic", "labels"),
    (np.ones((5, 2)), np.ones(5), "hinge", "loss must be"),
    (np.zeros((5, 2)), np.ones(5), "lsq", "zero"),
])
def test_bad_problem_input(Z, y, loss, match):
    with pytest.raises(ValueError, match=match):
        A.make_problem(Z, y, loss)


def test_bad_run_input():
    P = lsq_problem(0)
    with pytest.raises(ValueError, match="max_steps"):
        A.attack_gd_exact(P, max_steps=0)
    with pytest.raises(ValueError, match="w0 must have shape"):
        A.attack_nesterov(P, w0=np.zeros(3))
    with pytest.raises(ValueError, match="already optimal"):
        A.attack_gd_constant(P, w0=P.w_star)
    with pytest.raises(ValueError, match="unknown attacker"):
        A.run_attack_suite(P, ["sgd"])
    with pytest.raises(ValueError, match="logistic"):
        A.attack_closed_form(logistic_problem(0))
    with pytest.raises(TypeError, match="ProbingProblem"):
        A.attack_lbfgs((P.Z, P.y))


# ----------------------------------------------------------------------------------------------
# the experiment script, CI-sized
# ----------------------------------------------------------------------------------------------
def _experiment_module():
    from experiments import attacks

    return attacks


def test_slowdown_factor_and_bounds():
    E = _experiment_module()
    assert E.slowdown(300, 30, 1000) == (10.0, "=")
    assert E.slowdown(None, 30, 1000) == (1001 / 30, ">=")      # θ_I capped: lower bound
    assert E.slowdown(30, None, 1000) == (30 / 1001, "<=")      # identity capped: upper bound
    assert E.slowdown(None, None, 1000) == (None, "n/a")
    assert E.holds([(2.0, "=")], ">1") is True and E.holds([(0.5, "=")], ">1") is False
    assert E.holds([(0.5, "<=")], ">1") is False and E.holds([(0.5, ">=")], ">1") is None
    assert E.holds([(None, "n/a")], "<=1") is None
    assert E.holds([(2.0, "="), (0.9, "=")], ">1") is False     # one seed contradicts


def test_experiment_ci_run(tmp_path):
    pytest.importorskip("pycore.immunize")
    E = _experiment_module()
    from pycore.report import read_json

    rc = E.main(["--methods", "ours", "--attackers", "gd_exact,cg,closed_form",
                 "--max-steps", "300", "--epochs", "2", "--out", str(tmp_path)])
    assert rc == 0
    for name in ("results.json", "table.md", "curves.png"):
        assert (tmp_path / name).stat().st_size > 0
    saved = read_json(tmp_path / "results.json")
    assert saved["step_cap"] == 300 and saved["methods"] == ["identity", "ours"]
    runs = {r["method"]: r for r in saved["runs"]}
    for key in ("train/D_H", "train/D_P", "heldout/D_H", "heldout/D_P"):
        for a in ("gd_exact", "cg", "closed_form"):
            sm = runs["ours"]["attacks"][key]["attackers"][a]["steps_to"]["0.01"]
            si = runs["identity"]["attacks"][key]["attackers"][a]["steps_to"]["0.01"]
            v, kind = saved["slowdown"]["ours"][key][a]["0.01"][0]
            assert (v, kind) == pytest.approx(E.slowdown(sm, si, 300)) or (v is None and kind == "n/a")
        # the closed form is one step whatever θ: never slowed
        assert saved["slowdown"]["ours"][key]["closed_form"]["1e-06"][0] == [1.0, "="]
    table = (tmp_path / "table.md").read_text()
    assert "Figure 1 claim" in table and "ours" in table
    assert saved["wall_seconds"] > 0 and saved["versions"]["pycore"] and saved["command"]
