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
    cases = [
        (lambda: A.attack_gd_exact(P, max_steps=0), "max_steps", "max_steps"),
        (lambda: A.attack_nesterov(P, w0=np.zeros(3)), "w0", "w0 must have shape"),
        (lambda: A.attack_gd_constant(P, w0=P.w_star), "w0", "already optimal"),
        (lambda: A.run_attack_suite(P, ["sgd"]), "attackers", "unknown attacker"),
        (lambda: A.attack_closed_form(logistic_problem(0)), "loss", "logistic"),
        (lambda: A.attack_gd_constant(P, step_factor=2.0), "step_factor", "step_factor"),
        (lambda: A.attack_heavy_ball(P, mu_factor=0.0), "mu_factor", "mu_factor"),
        (lambda: A.attack_adam(P, betas=(1.0, 0.9)), "betas", "betas"),
        (lambda: A.attack_adam(P, lr_factors=()), "lr_factors", "lr_factors"),
        (lambda: A.sweep_momentum(P, []), "configs", "at least one"),
        (lambda: A.sweep_momentum(P, [{"attacker": "adam"}]), "attacker", "unknown momentum"),
        (lambda: A.sweep_adaptive(P, [{"attacker": "sgd", "lr_factor": 0.1}]), "attacker",
         "unknown adaptive"),
        (lambda: A.sweep_adaptive(P, [{"attacker": "adam", "lr_factor": -1, "betas": (0.9, 0.9)}]),
         "lr_factor", "lr_factor"),
        (lambda: A.attack_whiten(P, ridge_rel=0.0), "ridge_rel", "ridge_rel"),
        (lambda: A.make_problem(P.Z, P.y, "hinge"), "loss", "loss must be"),
    ]
    from pycore.validation import ParameterError

    for call, parameter, match in cases:
        with pytest.raises(ParameterError, match=match) as info:
            call()
        assert info.value.parameter == parameter, (parameter, info.value.parameter)
    with pytest.raises(TypeError, match="ProbingProblem"):
        A.attack_lbfgs((P.Z, P.y))


def test_summary_has_no_encoder_of_its_own(tmp_path):
    """A trajectory's summary keeps non-finite numbers as floats; pycore.report's strict encoder
    writes them as the string "Infinity" (the one encoding of every results.json)."""
    from pycore.report import read_json, write_json

    assert not hasattr(A, "_jsonable")
    P = lsq_problem(0)
    tr = A.attack_gd_constant(P, max_steps=3, tol=0.0)
    tr.params["probe"] = math.inf
    s = tr.summary()
    assert s["params"]["probe"] == math.inf
    write_json(tmp_path / "r.json", s)
    assert '"Infinity"' in (tmp_path / "r.json").read_text()
    assert read_json(tmp_path / "r.json")["params"]["probe"] == math.inf


# ----------------------------------------------------------------------------------------------
# sweeps (blocks of configurations) and the adaptive attackers
# ----------------------------------------------------------------------------------------------
def test_sweeps_run_the_same_iterations_as_the_single_attackers():
    P = lsq_problem(3, kappa=1e3)
    cfgs = [{"attacker": "gd_constant", "step_factor": 1.5}, {"attacker": "heavy_ball", "mu_factor": 0.1},
            {"attacker": "nesterov", "mu_factor": 10.0}]
    refs = [A.attack_gd_constant(P, max_steps=3000, tol=1e-8, step_factor=1.5),
            A.attack_heavy_ball(P, max_steps=3000, tol=1e-8, mu_factor=0.1),
            A.attack_nesterov(P, max_steps=3000, tol=1e-8, mu_factor=10.0)]
    for got, ref in zip(A.sweep_momentum(P, cfgs, max_steps=3000, tol=1e-8), refs):
        assert got.steps_to(1e-8) == ref.steps_to(1e-8) and len(got.rel_subopt) == len(ref.rel_subopt)
        np.testing.assert_allclose(got.rel_subopt, ref.rel_subopt, rtol=1e-8, atol=1e-15)
    lrs = (1e-1, 1e-2)
    ref = A.attack_adam(P, max_steps=3000, tol=1e-6, lr_factors=lrs, betas=(0.9, 0.99))
    got = A.sweep_adaptive(P, [{"attacker": "adam", "lr_factor": c, "betas": (0.9, 0.99)} for c in lrs],
                           max_steps=3000, tol=1e-6)
    best = min(got, key=lambda t: t.own_steps_to(1e-6) or 10 ** 9)
    assert best.own_steps_to(1e-6) == ref.steps_to(1e-6)
    k = min(len(best.rel_subopt), len(ref.rel_subopt))
    np.testing.assert_allclose(best.rel_subopt[:k], ref.rel_subopt[:k], rtol=1e-8, atol=1e-15)


def test_every_sweep_column_stops_on_its_own():
    P = lsq_problem(2, kappa=1e3)
    out = A.sweep_momentum(P, [{"attacker": "gd_constant", "step_factor": 1.0},
                               {"attacker": "nesterov", "mu_factor": 1.0}], max_steps=50000, tol=1e-6)
    gd, nes = out
    assert nes.steps_to(1e-6) < gd.steps_to(1e-6)          # the fast column did not stop the slow one
    assert gd.final_rel_subopt <= 1e-6 and len(gd.rel_subopt) == gd.steps_to(1e-6) + 1
    # a diverging column (Adam with a huge lr never settles; GD beyond 2/L is refused) is flagged
    conv = A.sweep_momentum(P, [{"attacker": "nesterov_convex"}], max_steps=50000, tol=1e-6)[0]
    assert conv.steps_to(1e-6) is not None and not conv.info["diverged"]


@pytest.mark.parametrize("seed", SEEDS)
def test_adaptive_attackers_reach_the_optimum(seed):
    for P in (lsq_problem(seed, kappa=300.0), logistic_problem(seed)):
        for tr in (A.attack_whiten(P, max_steps=20000, tol=1e-10),
                   A.attack_whiten(P, P.Z[: P.Z.shape[0] // 2], max_steps=20000, tol=1e-10),
                   A.attack_pcg_jacobi(P, max_steps=20000, tol=1e-10)):
            assert tr.final_rel_subopt <= 1e-10, (P.loss, tr.attacker, tr.params)


def test_whitening_is_invariant_to_any_invertible_theta():
    """Σ̂(θ) = θᵀΣ̂θ: the whitened iteration on Xθ is the one on X mapped by θ, so the steps to
    every ε are the same for any invertible θ (up to round-off in the ridge)."""
    rng = np.random.default_rng(0)
    X = prescribed(rng, 60, 10, np.sqrt(np.logspace(0, -3, 10)))
    y = rng.standard_normal(60)
    theta = prescribed(rng, 10, 10, np.logspace(0, -2, 10))       # κ(θ) = 100
    half = rng.permutation(60)[:30]
    a = A.attack_whiten(A.make_problem(X, y), X[half], ridge_rel=1e-14, tol=1e-10)
    b = A.attack_whiten(A.make_problem(X @ theta, y), (X @ theta)[half], ridge_rel=1e-14, tol=1e-10)
    assert a.steps_to(1e-10) == b.steps_to(1e-10)
    np.testing.assert_allclose(a.rel_subopt[:8], b.rel_subopt[:8], rtol=1e-6)
    # while plain GD on the same θ is slowed: the invariance is the whitening's, not the problem's
    g1 = A.attack_gd_exact(A.make_problem(X, y), tol=1e-6).steps_to(1e-6)
    g2 = A.attack_gd_exact(A.make_problem(X @ theta, y), tol=1e-6, max_steps=10 * g1).steps_to(1e-6)
    assert g1 is not None and g2 is None                 # > 10× the steps


def test_jacobi_pcg_undoes_a_diagonal_scaling_and_nothing_more():
    rng = np.random.default_rng(1)
    X = prescribed(rng, 50, 12, np.sqrt(np.logspace(0, -1, 12)))
    y = rng.standard_normal(50)
    S = np.diag(np.logspace(0, 3, 12))                            # a diagonal "immunizer"
    base = A.attack_cg(A.make_problem(X, y), tol=1e-10).steps_to(1e-10)
    scaled = A.make_problem(X @ S, y)
    assert A.attack_cg(scaled, tol=1e-10).steps_to(1e-10) > base      # CG feels the diagonal scaling
    assert A.attack_pcg_jacobi(scaled, tol=1e-10).steps_to(1e-10) <= base + 1


# ----------------------------------------------------------------------------------------------
# the experiment script, CI-sized
# ----------------------------------------------------------------------------------------------
def _experiment_module():
    from experiments import attacks

    return attacks


def test_claim_helpers():
    E = _experiment_module()
    assert E.holds([(2.0, "=")], ">1") is True and E.holds([(0.5, "=")], ">1") is False
    assert E.holds([(0.5, "<=")], ">1") is False and E.holds([(0.5, ">=")], ">1") is None
    assert E.holds([(None, "n/a")], "<=1") is None
    assert E.holds([(2.0, "="), (0.9, "=")], ">1") is False     # one seed contradicts
    assert E.at_least([(12.0, "="), (11.0, ">=")], 10) is True
    assert E.at_least([(12.0, "="), (9.0, "=")], 10) is False
    assert E.at_least([(9.0, ">=")], 10) is None                 # a lower bound below 10 cannot tell
    assert E.at_most([(1.1, "="), (0.5, "<=")], 1.2) is True and E.at_most([(1.3, "=")], 1.2) is False
    assert E.fmt_factors([(2.0, "="), (3.0, ">="), (1.0, "=")]) == "2 (1–≥3)"


def test_experiment_ci_run(tmp_path):
    E = _experiment_module()
    from pycore.report import read_json
    from pycore.thetas import load_thetas

    out = tmp_path / "o"
    rc = E.main(["--quick", "--seeds", "1", "--methods", "closed_form,ours", "--max-steps", "400",
                 "--epochs", "2", "--jobs", "1", "--orders", "5", "--out", str(out)])
    assert rc == 0
    for name in E.OUTPUTS:
        assert (out / name).stat().st_size > 0
    saved = read_json(out / "results.json")
    assert saved["step_cap"] == 400 and saved["methods"] == ["identity", "closed_form", "ours"]
    assert set(saved["variants"]) == {"identity", "identity+haar", "closed_form", "closed_form+haar",
                                      "ours", "ours+haar"}
    # every attacked θ is in the archive, bit for bit, with the inputs it acts on
    arrays, meta = load_thetas(out / "thetas.npz")
    assert meta["harden"] == "haar" and "data/train/X_H" in arrays
    for r in saved["runs"]:
        theta = arrays[f"{r['variant']}/seed{r['seed']}"]
        assert E._digest(theta) == r["theta_digest"]
        if "+" in r["variant"]:
            Q = arrays[f"{r['variant']}/seed{r['seed']}/Q"]
            plain = arrays[f"{r['variant'].split('+')[0]}/seed{r['seed']}"]
            np.testing.assert_array_equal(plain @ Q, theta)
            assert max(r["invariance"].values()) <= 1e-10
    # the analysis agrees with the raw steps it was computed from
    grid = saved["grid"]
    by = {(r["seed"], r["variant"]): r for r in saved["runs"]}
    e_idx = saved["eps"].index(1e-4)
    cell = saved["analysis"]["closed_form+haar"]["train/D_H"]["0.0001"]
    for fam in ("adam", "cg", "closed_form"):
        idx = [i for i, c in enumerate(grid) if c["family"] == fam]

        def best(v):
            s = [by[(0, v)]["problems"]["train/D_H"]["steps"][i][e_idx] for i in idx]
            s = [x for x in s if x is not None]
            return min(s) if s else None
        from pycore.worst_case import slowdown
        assert tuple(cell["families"][fam]["slowdown"][0]) == pytest.approx(
            slowdown(best("closed_form+haar"), best("identity"), 400))
    assert cell["families"]["closed_form"]["slowdown"][0] == [1.0, "="]     # one solve, whatever θ
    assert cell["worst_all"][0]["steps"] == 1
    table = (out / "table.md").read_text()
    assert "Worst case, train rows" in table and "Hardening targets" in table and "rotated identity" in table
    assert saved["wall_seconds"] > 0 and saved["versions"]["pycore"] and saved["command"]
