"""The attackers (pycore.attacks, docs/theory.md §10): true optima, known rates, one engine, named
errors."""

import math

import numpy as np
import pytest
import scipy.linalg
import scipy.optimize

import pycore._attacks as AT
from pycore import ParameterError, attacks as A, condition_number

ADAPTIVE = {"adam": {"lr_factor": 0.1}, "adagrad": {"lr_factor": 1.0}}


def prescribed(rng, N, D, sigma):
    """N×D matrix with singular values ``sigma`` (zeros allowed: rank deficient)."""
    U, _ = np.linalg.qr(rng.standard_normal((N, D)))
    V, _ = np.linalg.qr(rng.standard_normal((D, D)))
    return (U * np.asarray(sigma, float)) @ V.T


def lsq_problem(seed, kappa=300.0, N=60, D=12, null=2):
    rng = np.random.default_rng(seed)
    s = np.sqrt(np.logspace(0, -math.log10(kappa), D - null))  # κ(ZᵀZ) = kappa on the range
    return A.make_problem(
        prescribed(rng, N, D, np.concatenate([s, np.zeros(null)])), rng.standard_normal(N)
    )


def logistic_problem(seed, N=150, D=10, ridge_rel=1e-3):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((N, D))
    X[:, -1], X[:, -2] = X[:, 0], 0.0  # rank deficient, like MNIST's never-inked pixels
    y = (X @ rng.standard_normal(D) + 0.7 * rng.standard_normal(N) > 0).astype(float)
    return A.make_problem(X, y, "bce", ridge_rel=ridge_rel)


def test_reference_optima_and_constants():
    P = lsq_problem(0)
    assert P.rank == P.dim - 2
    w_ref = scipy.linalg.lstsq(P.Z, P.y, lapack_driver="gelsy")[0]  # an independent minimiser
    r_ref = P.Z @ w_ref - P.y
    assert abs(P.L_star - 0.5 * r_ref @ r_ref) <= 1e-12 * (0.5 * P.y @ P.y)
    np.testing.assert_allclose(P.Z @ P.w_star, P.Z @ w_ref, atol=1e-10)
    assert np.max(np.abs(np.linalg.svd(P.Z)[2][P.rank :] @ P.w_star)) < 1e-10  # minimum norm
    ev = np.linalg.eigvalsh(P.Z.T @ P.Z)
    assert P.smoothness == pytest.approx(ev[-1], rel=1e-12)
    assert P.strong_convexity == pytest.approx(ev[2], rel=1e-8)  # nonzero spectrum
    assert P.kappa == pytest.approx(300.0, rel=1e-9) == condition_number(P.Z.T @ P.Z)
    P = logistic_problem(0)
    g_star, g0 = (np.linalg.norm(P.value_grad(w)[1]) for w in (P.w_star, np.zeros(P.dim)))
    assert g_star <= 1e-10 * g0
    res = scipy.optimize.minimize(
        P.value_grad,
        np.zeros(P.dim),
        jac=True,
        method="BFGS",
        options={"gtol": 1e-12, "maxiter": 10000},
    )
    assert P.L_star <= res.fun + 1e-12 * abs(res.fun) and res.fun - P.L_star <= 1e-9 * abs(
        P.L_star
    )
    assert P.ridge == pytest.approx(1e-3 * np.linalg.norm(P.Z, 2) ** 2 / 4)  # λ as documented
    assert np.linalg.eigvalsh(P.hessian(np.zeros(P.dim)))[-1] <= P.smoothness * (1 + 1e-12)
    w = np.random.default_rng(5).standard_normal(P.dim) * 0.3
    err = scipy.optimize.check_grad(P.value, lambda v: P.value_grad(v)[1], w)
    assert err <= 1e-5 * np.linalg.norm(P.value_grad(w)[1])


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_every_attacker_reaches_the_optimum(loss):
    P = lsq_problem(1, kappa=200.0) if loss == "mse" else logistic_problem(1)
    tol = 1e-12 if loss == "mse" else 1e-10
    for name in (a for a in AT.ATTACKERS if a != ("newton" if loss == "mse" else "closed_form")):
        tr = A.attack(P, name, max_steps=50000, tol=tol, **ADAPTIVE.get(name, {}))
        assert tr.final_rel_subopt <= tol and tr.steps_to(tol) == len(tr.rel_subopt) - 1, name
        # the predictor, not only the loss, is the optimum (w is unique only on range(Zᵀ))
        assert np.linalg.norm(P.Z @ (tr.w_final - P.w_star)) <= 1e-4 * np.linalg.norm(
            P.Z @ P.w_star
        ), name


def test_gd_and_exact_line_search_rates_on_a_quadratic():
    P = lsq_problem(4, kappa=100.0)
    k, t = P.kappa, np.arange(301)
    gd = A.attack(P, "gd_constant", max_steps=300, tol=0.0)  # step 1/L: gap ≤ (1 − 1/κ)^{2t}
    assert np.all(gd.rel_subopt <= (1 - 1 / k) ** (2 * t) * (1 + 1e-9) + 1e-15)
    ex = A.attack(P, "gd_exact", max_steps=300, tol=0.0).rel_subopt  # Kantorovich: ((κ−1)/(κ+1))²
    ratios = ex[1:] / ex[:-1]
    assert np.all(ratios[ex[:-1] > 1e-13] <= ((k - 1) / (k + 1)) ** 2 + 1e-9)
    for P in (P, logistic_problem(4)):  # the step is the line minimum
        w1 = A.attack(P, "gd_exact", max_steps=1, tol=0.0).w_final
        g = P.value_grad(np.zeros(P.dim))[1]
        for a in np.linalg.norm(w1) / np.linalg.norm(g) * (1 + np.array([-1e-3, 1e-3])):
            assert P.value(-a * g) > P.value(w1)  # either side of α is worse


def test_momentum_methods_pay_sqrt_kappa_at_their_tuned_rates():
    P = lsq_problem(7, kappa=1e3, N=80, D=30, null=3)
    sk = math.sqrt(P.kappa)
    q = (sk - 1) / (sk + 1)
    runs = AT.run_attackers(
        P,
        [{"attacker": a} for a in ("gd_constant", "heavy_ball", "nesterov", "cg")],
        max_steps=100000,
        tol=1e-10,
    )
    gd, hb, nes, cg = (t.steps_to(1e-10) for t in runs)
    # heavy ball: error ~ q^t (the gap q^{2t}) up to its double root's factor, measured 1.40×;
    # Nesterov: error ~ (1 − 1/√κ)^t, measured 0.89×; CG: gap ≤ 4q^{2t} (Chebyshev)
    hb_pure = math.log(1e10) / (-2 * math.log(q))
    assert hb_pure < hb <= 1.55 * hb_pure
    assert nes <= 1.25 * math.log(1e10) / (-2 * math.log(1 - 1 / sk))
    assert cg <= math.log(4e10) / (-2 * math.log(q)) and max(hb, nes, cg) < gd / 10


def test_cg_terminates_in_the_number_of_distinct_eigenvalues_and_the_solve_in_one_step():
    rng = np.random.default_rng(0)
    Z = prescribed(rng, 40, 15, [3.0] * 5 + [1.0] * 5 + [0.2] * 3 + [0.0] * 2)
    tr = A.attack(A.make_problem(Z, rng.standard_normal(40)), "cg", max_steps=3, tol=0.0)
    assert len(tr.rel_subopt) == 4 and tr.final_rel_subopt <= 1e-12
    # Newton on mse: solve
    for kappa, name in ((1e2, "closed_form"), (1e8, "closed_form"), (1e8, "newton")):
        tr = A.attack(lsq_problem(1, kappa=kappa), name)
        assert tr.attacker == "closed_form" and tr.steps_to(1e-6) == 1 and tr.step_cap == 1


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_rescaling_theta_changes_no_step_count(loss):
    """θ → cθ: the attacker undoes it by w → w/c (Adam's lr, L and the logistic ridge are
    scale-aware)."""
    P = lsq_problem(5, kappa=1e3) if loss == "mse" else logistic_problem(5)
    Q = A.make_problem(P.Z * 37.0, P.y, loss, ridge_rel=P.info.get("ridge_rel", 1e-4))
    configs = [
        {"attacker": a, **ADAPTIVE.get(a, {})}
        for a in AT.ATTACKERS
        if a not in ("closed_form", "newton", "lbfgs", "cg", "pcg_jacobi")
    ]
    for a, b in zip(
        AT.run_attackers(P, configs, tol=1e-4), AT.run_attackers(Q, configs, tol=1e-4)
    ):
        assert a.steps_to(1e-4) is not None and abs(a.steps_to(1e-4) - b.steps_to(1e-4)) <= 1, (
            a.attacker
        )


def test_a_single_attacker_is_a_one_configuration_sweep():
    """The engine runs each family as one block; each column equals the attacker run on its own."""
    P = lsq_problem(3, kappa=1e3)
    configs = [
        dict(attacker="gd_constant", step_factor=1.5),
        dict(attacker="heavy_ball", mu_factor=0.1),
        dict(attacker="nesterov", mu_factor=10.0),
        dict(attacker="nesterov_convex"),
        dict(attacker="gd_constant", step="2/(L+mu)"),
        dict(attacker="adagrad", lr_factor=0.3),
        dict(attacker="adam", lr_factor=1e-2, betas=(0.9, 0.99)),
        dict(attacker="adam", lr_factor=0.1),
        dict(attacker="lbfgs", memory=3),
        dict(attacker="whiten", rows="half"),
        dict(attacker="cg"),
    ]
    block = AT.run_attackers(P, configs, max_steps=3000, tol=1e-8, rng=np.random.default_rng(1))
    eps = (1e-2, 1e-4, 1e-6, 1e-8)
    # the same iterations up to round-off, which Adam amplifies late
    for c, got in zip(configs, block):
        one = A.attack(P, max_steps=3000, tol=1e-8, rng=np.random.default_rng(1), **c)
        assert got.attacker == one.attacker == c["attacker"], c
        assert [got.steps_to(e) for e in eps] == [one.steps_to(e) for e in eps], c
        np.testing.assert_allclose(got.rel_subopt[:300], one.rel_subopt[:300], rtol=1e-8)
    hb, nes = block[1], block[2]  # every column stops on its own
    assert (
        len(hb.rel_subopt) == hb.steps_to(1e-8) + 1 < len(nes.rel_subopt) == nes.steps_to(1e-8) + 1
    )
    assert len(block[0].rel_subopt) == 3001 and not any(t.info["diverged"] for t in block)
    blown = AT.run_attackers(
        P, [{"attacker": "adam", "lr_factor": 1e8}, configs[1]], max_steps=3000, tol=1e-8
    )
    assert (
        blown[0].info["diverged"]
        and len(blown[0].rel_subopt) == 2
        and blown[1].steps_to(1e-8) is not None
    )


def test_cap_and_steps_to_bookkeeping():
    P = lsq_problem(0, kappa=1e6)
    for name in ("gd_exact", "gd_constant", "heavy_ball", "nesterov", "adam", "cg", "lbfgs"):
        tr = A.attack(P, name, max_steps=5, tol=1e-12, **ADAPTIVE.get(name, {}))
        assert tr.step_cap == 5 and len(tr.rel_subopt) <= 6 and tr.steps_to(1e-12) is None, name
    tr = A.attack(lsq_problem(0, kappa=1e2), "gd_exact", max_steps=500, tol=0.0)
    assert tr.rel_subopt[0] == 1.0 and len(tr.rel_subopt) == 501 and tr.wall_seconds > 0
    for e, s in ((e, tr.steps_to(e)) for e in (0.1, 1e-3)):
        assert tr.rel_subopt[s] <= e and np.all(tr.rel_subopt[:s] > e)


def test_whitening_is_invariant_to_any_invertible_theta_and_jacobi_pcg_to_a_diagonal_one():
    rng = np.random.default_rng(0)
    X, y = prescribed(rng, 60, 10, np.sqrt(np.logspace(0, -3, 10))), rng.standard_normal(60)
    theta = prescribed(rng, 10, 10, np.logspace(0, -2, 10))  # κ(θ) = 100
    a, b = (
        A.attack(
            A.make_problem(Z, y),
            "whiten",
            rows="half",
            ridge_rel=1e-14,
            tol=1e-10,
            rng=np.random.default_rng(3),
        )
        for Z in (X, X @ theta)
    )
    assert a.steps_to(1e-10) == b.steps_to(1e-10)
    np.testing.assert_allclose(a.rel_subopt[:8], b.rel_subopt[:8], rtol=1e-6)
    # while plain GD is slowed > 10×
    g1 = A.attack(A.make_problem(X, y), "gd_exact").steps_to(1e-6)
    g2 = A.attack(A.make_problem(X @ theta, y), "gd_exact", max_steps=10 * g1).steps_to(1e-6)
    assert g1 is not None and g2 is None
    S = np.diag(np.logspace(0, 3, 10))  # a diagonal "immunizer"
    base = A.attack(A.make_problem(X, y), "cg", tol=1e-10).steps_to(1e-10)
    scaled = A.make_problem(X @ S, y)
    assert A.attack(scaled, "cg", tol=1e-10).steps_to(1e-10) > base
    assert A.attack(scaled, "pcg_jacobi", tol=1e-10).steps_to(1e-10) <= base + 1


@pytest.mark.parametrize(
    "attacker, kw, parameter",
    [
        ("sgd", {}, "attacker"),
        ("cg", {"memory": 3}, "memory"),
        ("gd_constant", {"step": "1/L"}, "step"),
        ("gd_constant", {"step_factor": 2.0}, "step_factor"),
        ("heavy_ball", {"mu_factor": 0.0}, "mu_factor"),
        ("adam", {}, "lr_factor"),
        ("adagrad", {"lr_factor": math.inf}, "lr_factor"),
        ("adam", {"lr_factor": 1, "betas": (1, 0.9)}, "betas"),
        ("adam", {"lr_factor": 1, "betas": 0.9}, "betas"),
        ("lbfgs", {"memory": 0}, "memory"),
        ("whiten", {"rows": "third"}, "rows"),
        ("whiten", {"ridge_rel": 0}, "ridge_rel"),
        ("cg", {"max_steps": 0}, "max_steps"),
        ("cg", {"tol": math.nan}, "tol"),
        ("newton", {"max_steps": 5.5}, "max_steps"),
    ],
)
def test_a_bad_configuration_is_refused_by_name(attacker, kw, parameter):
    with pytest.raises(ParameterError) as info:
        A.attack(lsq_problem(0), attacker, **kw)
    assert info.value.parameter == parameter


def test_bad_problems_and_runs_are_refused_by_name():
    P = lsq_problem(0)
    # w = 0 optimal
    cases = [
        (lambda: AT.run_attackers(P, []), "configs"),
        (lambda: A.make_problem(P.Z, P.y, "hinge"), "loss"),
        (
            lambda: AT.run_attackers(P, [{"attacker": "cg"}], second_order_max_steps=0),
            "second_order_max_steps",
        ),
        (lambda: A.attack(logistic_problem(0), "closed_form"), "attacker"),
        (lambda: A.make_problem(P.Z, P.y[:-1]), "y"),
        (lambda: A.make_problem(P.Z, np.ones((60, 2))), "y"),
        (lambda: A.make_problem(P.Z, np.arange(60), "bce"), "y"),
        (lambda: A.make_problem(P.Z, P.y > 0, "bce", ridge_rel=0.0), "ridge_rel"),
        (lambda: A.make_problem(np.zeros((5, 2)), np.ones(5)), "Z"),
        (lambda: A.attack(A.make_problem(np.eye(4)[:, :2], [0, 0, 1, 1]), "cg"), "y"),
    ]
    for call, parameter in cases:
        with pytest.raises(ParameterError) as info:
            call()
        assert info.value.parameter == parameter, parameter
    with pytest.raises(ValueError):
        A.make_problem(np.full((5, 2), np.nan), np.ones(5))
    with pytest.raises(TypeError):
        A.attack((P.Z, P.y), "cg")


def test_the_experiment_end_to_end(tmp_path):
    """experiments/attacks.py, CI-sized: θ archived bit for bit, the analysis agrees with the
    raw steps."""
    from experiments import attacks as E
    from pycore._worst_case import slowdown
    from pycore.report import load_thetas, read_json

    out = tmp_path / "o"
    assert (
        E.main(
            [
                "--quick",
                "--seeds",
                "1",
                "--methods",
                "closed_form",
                "--hardened-methods",
                "closed_form",
                "--max-steps",
                "300",
                "--jobs",
                "1",
                "--orders",
                "5",
                "--no-plot",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    saved, (arrays, _) = read_json(out / "results.json"), load_thetas(out / "thetas.npz")
    assert {v["name"] for v in saved["variants"]} == {
        "identity",
        "identity+haar",
        "closed_form",
        "closed_form+haar",
    }
    for r in saved["runs"]:
        assert E.digest(arrays[f"{r['variant']}/seed{r['seed']}"]) == r["theta_digest"]
    by = {r["variant"]: r["problems"]["train"]["D_H"]["steps"] for r in saved["runs"]}
    e = saved["eps"].index(1e-4)
    [cell] = [
        c
        for c in saved["analysis"]
        if (c["variant"], c["rows"], c["task"], c["eps"])
        == ("closed_form+haar", "train", "D_H", 1e-4)
    ]
    for fam in ("adam", "cg", "closed_form"):
        idx = [i for i, c in enumerate(saved["grid"]) if c["family"] == fam]
        best = [
            min((by[v][i][e] for i in idx if by[v][i][e] is not None), default=None)
            for v in ("closed_form+haar", "identity")
        ]
        assert tuple(cell["families"][fam]["slowdown"][0]) == pytest.approx(slowdown(*best, 300))
    assert (
        cell["worst_all"][0]["steps"] == 1
        and "Worst case, train rows" in (out / "table.md").read_text()
    )
