"""Linear core: spectra (also at the edges of float64), regularizers, metrics and the ceiling, the
arrays and parameters each refuses by name, the immunizers, certified mode, probe solvers."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
import scipy.optimize
from scipy.special import expit

import pycore
from pycore import (
    METHODS,
    EvaluationReference,
    LinearTask,
    ParameterError,
    SpectrumError,
    condition_number,
    def31_exponent_window,
    feature_rir,
    grouped_feature_rir,
    immunize,
    immunize_certified,
    r_ill,
    r_well,
    rir,
    rir_ceiling,
)
from pycore._imma import IMMAOptions, imma_objective
from pycore._losses import best_probe_loss
from pycore._precondition import precondition
from pycore._probe import exact_line_search_steps, gd_exact_line_search
from pycore._regularizers import (
    preconditioned_r_ill_step_bound,
    preconditioned_r_well_step_bound,
    r_ill_grad,
    r_ill_grad_theta,
    r_well_grad,
    r_well_grad_theta,
)
from pycore._spectral import gram_spectrum, spectrum_info
from pycore.attacks import attack, make_problem
from pycore.linalg import hessian_regularizer
from tests.helpers import central_diff, rel_err, with_spectrum


def small_task(seed=0, N=40, D=6, loss="mse"):
    rng = np.random.default_rng(seed)
    XP = rng.standard_normal((N, D)) * rng.uniform(0.5, 3, D)
    XH = rng.standard_normal((N, D)) @ rng.standard_normal((D, D))
    YP = rng.standard_normal((N, 1)) if loss == "mse" else (rng.random((N, 1)) < 0.5).astype(float)
    return LinearTask(XP, YP, XH, rng.standard_normal((N, 1)), loss)


def short(method, **kw):
    """Options of a short run of ``method`` (the closed form and θ = I have no loop)."""
    return {} if method in ("identity", "closed_form") else {"epochs": 3, "batch_size": 16, **kw}


# ---------------------------------------------------------------- spectra


def test_condition_number_uses_nonzero_spectrum_and_reports_rank():
    rng = np.random.default_rng(0)
    S = with_spectrum([4.0, 2.0, 0.5, 0.0, 0.0], rng)
    assert spectrum_info(S).rank == 3
    assert pycore.condition_number(S) == pytest.approx(8.0, rel=1e-10)
    K = S.T @ S  # symmetric PSD path (eigh)
    assert spectrum_info(K).rank == 3
    assert pycore.condition_number(K) == pytest.approx(64.0, rel=1e-9)


def test_gram_spectrum_is_accurate_where_forming_H_is_not():
    """κ(ZᵀZ) = 1e14: from the SVD of Z it is exact to ~1e-8; eigvalsh(ZᵀZ) cannot resolve it."""
    rng = np.random.default_rng(1)
    Z = with_spectrum(np.logspace(0, -7, 6), rng, (30, 6))
    assert gram_spectrum(Z).kappa == pytest.approx(1e14, rel=1e-6)
    lam = np.linalg.eigvalsh(Z.T @ Z)
    assert abs(lam[-1] / lam[0] - 1e14) > 1e-3 * 1e14 or lam[0] <= 0


def test_hessian_regularizer_matches_matrix_path_also_with_fewer_rows_than_columns():
    rng = np.random.default_rng(2)
    for N, D in ((12, 5), (3, 7)):
        Z = rng.standard_normal((N, D))
        for kind in ("ill", "well"):
            reg, H = hessian_regularizer(Z, kind), Z.T @ Z
            value, grad = (r_ill, r_ill_grad) if kind == "ill" else (r_well, r_well_grad)
            assert reg.value == pytest.approx(value(H), rel=1e-9)
            assert reg.info.rank == min(N, D) and rel_err(reg.G, grad(H)) < 1e-9


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((3, 3)),
        np.array([[1.0, np.nan], [0.0, 1.0]]),
        np.ones(4),
        np.array([["a", "b"], ["c", "d"]]),
        np.empty((0, 3)),
    ],
)
def test_bad_matrices_raise_value_errors(bad):
    with pytest.raises(ValueError):
        pycore.condition_number(bad)


def test_r_ill_of_rank_one_and_ties():
    with pytest.raises(SpectrumError):
        pycore.r_ill(np.outer([1.0, 2.0], [3.0, 1.0]))
    info = spectrum_info(np.diag([2.0, 2.0, 1.0]))
    assert info.tie_max and not info.tie_min
    assert hessian_regularizer(np.diag([3.0, 1.0, 1.0]), "ill").tie


# ---------------------------------------------------------------- metrics and ceiling


def test_ceiling_is_finite_and_attained_when_null_spaces_nest():
    t = small_task(4)
    c = rir_ceiling(t.X_P, t.X_H)
    assert rir(np.eye(t.D), t.X_P, t.X_H).value == pytest.approx(1.0)
    assert np.isfinite(c.exact) and c.exact == pytest.approx(c.range_restricted)
    for a in (0.0, 0.5, "auto"):  # every exponent a ≥ 0 attains it (docs/theory.md §10)
        res = immunize(t, "closed_form", rng=np.random.default_rng(0), exponent=a)
        assert res.rir == pytest.approx(c.range_restricted, rel=1e-8)
    rng = np.random.default_rng(5)
    for _ in range(50):  # no θ beats it
        assert rir(rng.standard_normal((t.D, t.D)), t.X_P, t.X_H).value <= c.exact * (1 + 1e-8)


def test_closed_form_exponent_trades_the_two_factors():
    t = small_task(7)
    r0, r1 = (
        immunize(t, "closed_form", rng=np.random.default_rng(0), exponent=a) for a in (0.0, 0.5)
    )
    assert r1.pretrain_ratio != pytest.approx(r0.pretrain_ratio, rel=1e-3)
    # at constant RIR
    assert r1.harmful_ratio / r0.harmful_ratio == pytest.approx(
        r1.pretrain_ratio / r0.pretrain_ratio, rel=1e-8
    )


def test_ceiling_is_infinite_when_dp_ignores_a_direction_dh_uses():
    t = small_task(6)
    XP = t.X_P.copy()
    XP[:, 2] = 0.0  # D_P never varies along e_3, D_H does
    assert rir_ceiling(XP, t.X_H).exact == np.inf
    vals = [rir(np.diag([1, 1, s, 1, 1, 1.0]), XP, t.X_H).value for s in (1e-1, 1e-3)]
    assert vals[1] > 10 * vals[0]  # RIR grows without bound by shrinking that direction


def test_range_null_split_separates_what_D_P_sees():
    """θ_range acts as θ on range(K_P) and as I on null(K_P), θ_null the other way round
    (docs/theory.md §8); the two add up to θ + I."""
    rng = np.random.default_rng(3)
    D, r = 6, 4
    X_P = rng.normal(size=(20, r)) @ rng.normal(size=(r, D))  # rank 4: null(K_P) has dim 2
    Vt = np.linalg.svd(X_P)[2]
    V_R, V_N = Vt[:r].T, Vt[r:].T
    theta = np.eye(D) + 0.3 * rng.normal(size=(D, D))
    f = EvaluationReference(LinearTask(X_P, X_P[:, :1], np.eye(D), np.ones(D))).features(theta)
    t_range, t_null = f[("range", "H")], f[("null", "H")]  # X_H = I: the parts themselves
    for V, a, b in (
        (V_R, t_range, theta),
        (V_N, t_range, np.eye(D)),
        (V_R, t_null, np.eye(D)),
        (V_N, t_null, theta),
    ):
        np.testing.assert_allclose(V.T @ a, V.T @ b, atol=1e-12)
    np.testing.assert_allclose(t_range + t_null, theta + np.eye(D), atol=1e-12)


# ---------------------------------------------------------------- immunizers


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_every_method_runs_and_is_seeded(method, loss):
    t = small_task(8, loss=loss)
    a = immunize(t, method, rng=np.random.default_rng(11), **short(method))
    b = immunize(t, method, rng=np.random.default_rng(11), **short(method))
    assert a.theta.shape == (t.D, t.D) and np.all(np.isfinite(a.theta))
    np.testing.assert_array_equal(a.theta, b.theta)


def test_imma_gradient_matches_finite_differences():
    t = small_task(9, N=25, D=4)
    rng = np.random.default_rng(0)
    theta = np.eye(4) + 0.1 * rng.standard_normal((4, 4))
    w, omega = rng.standard_normal((4, 1)), rng.standard_normal((4, 1))
    o = IMMAOptions(inner_steps=4)
    _, g = imma_objective(theta, w, omega, t, o)
    fd = central_diff(lambda th: imma_objective(th, w, omega, t, o)[0], theta, h=1e-6)
    assert rel_err(g, fd) < 1e-7
    batch = (t.X_P[[0, 3, 7, 11, 20]], t.Y_P[[0, 3, 7, 11, 20]])  # a D_P mini-batch for L_P
    _, g_b = imma_objective(theta, w, omega, t, o, batch_P=batch)
    fd_b = central_diff(
        lambda th: imma_objective(th, w, omega, t, o, batch_P=batch)[0], theta, h=1e-6
    )
    assert rel_err(g_b, fd_b) < 1e-7 and rel_err(g_b, g) > 1e-3
    # the unrolled steps matter
    _, g0 = imma_objective(theta, w, omega, t, IMMAOptions(inner_steps=0))
    assert rel_err(g0, g) > 1e-3


def test_imma_steps_on_the_dp_mini_batches():
    """batch_size=8 of 20 D_P rows: each step sees a mini-batch (a different run from the full
    batch and from batches of 10); a batch of every row is the full batch, bit for bit."""
    task = small_task(3, N=20, D=4)

    def theta(batch_size):
        kw = dict(rng=np.random.default_rng(0), epochs=2, batch_size=batch_size)
        return immunize(task, "imma", **kw).theta

    full = theta(None)
    np.testing.assert_array_equal(theta(20), full)
    assert not np.array_equal(theta(8), full) and not np.array_equal(theta(8), theta(10))


def test_ours_immunizes_a_synthetic_task():
    t = small_task(10, N=60, D=6)
    res = immunize(
        t,
        "ours",
        rng=np.random.default_rng(0),
        epochs=60,
        batch_size=None,
        lambda_p=100.0,
        lambda_h=1e4,
    )
    assert res.rir > 1.5


@pytest.mark.parametrize("seed", range(8))
def test_certified_mode_has_no_violations(seed):
    t = small_task(20 + seed, N=30, D=5)
    res = immunize_certified(
        t,
        rng=np.random.default_rng(seed),
        epochs=5,
        batch_size=None,
        lr=0.05,
        lambda_p=10,
        lambda_h=1e4,
    )
    cert = res.diagnostics["certified"]
    assert cert["checked"] == 5 and cert["violations_P"] == 0 and cert["violations_H"] == 0


def test_uncapped_regularizer_step_can_violate_monotonicity():
    """The same step without the docs/theory.md §5 cap: a large R_well step raises κ(H_P)."""
    t = small_task(30, N=30, D=5)
    theta = np.eye(t.D)
    reg = hessian_regularizer(t.X_P, "well")
    bound = preconditioned_r_well_step_bound(reg.info, D=t.D)
    step = precondition(theta, reg.G, t.K_P, "exact")
    assert any(
        gram_spectrum(t.X_P @ (theta - eta * step)).kappa > reg.info.kappa
        for eta in bound * np.array([2.0, 5.0, 20.0, 100.0])
    )


def test_degenerate_task_raises_a_spectrum_error():
    """D_H with κ = 1 (orthogonal rows): R_ill is undefined."""
    rng = np.random.default_rng(0)
    t = LinearTask(
        rng.standard_normal((20, 4)), rng.standard_normal(20), 3.0 * np.eye(4), np.ones(4)
    )
    with pytest.raises(SpectrumError):
        immunize(t, "ours", rng=np.random.default_rng(0), epochs=1, lambda_p=1.0, lambda_h=1.0)
    # the default says why instead
    assert not immunize(t, "ours", rng=np.random.default_rng(0)).immunized


def test_closed_form_with_fewer_harmful_rows_than_rank_keeps_dp_loss():
    """N_H < rank K_P: C has a null space whose eigenvectors θ must keep (injective on range(K_P)),
    or D_P's best loss would change (Definition 3.1(c))."""
    rng = np.random.default_rng(0)
    X_P, X_H = rng.standard_normal((30, 8)), rng.standard_normal((5, 8))
    task = LinearTask(X_P, rng.standard_normal(30), X_H, rng.standard_normal(5))
    res = immunize(task, "closed_form", rng=rng)
    assert np.linalg.matrix_rank(res.theta) == 8 and res.diagnostics["null_columns_zeroed"] == 0
    assert best_probe_loss("mse", X_P @ res.theta, task.Y_P) == pytest.approx(
        best_probe_loss("mse", X_P, task.Y_P), rel=1e-10
    )
    ceil = rir_ceiling(X_P, X_H)
    assert ceil.rank_C == 5 and np.all(ceil.lambda_C[5:] == 0)
    assert res.rir == pytest.approx(ceil.range_restricted, rel=1e-8)


# ---------------------------------------------------------------- the probes' solvers


def test_the_logistic_probing_problem_is_solved_to_the_floor():
    """w* of the ridge-logistic problem (damped Newton) against a generic solver."""
    rng = np.random.default_rng(1)
    A = rng.standard_normal((60, 5))
    y = (rng.random(60) < 0.5).astype(float)  # not separable: a unique interior minimiser
    problem = make_problem(A, y, "bce", ridge_rel=1e-3)
    lam = 1e-3 * np.linalg.norm(A, 2) ** 2 / 4  # λ = ridge_rel·‖Z‖₂²/4

    def value(w):
        t = A @ w
        return float(np.sum(np.logaddexp(0.0, t) - y * t) + 0.5 * lam * w @ w)

    def grad(w):
        return A.T @ (expit(A @ w) - y) + lam * w

    ref = scipy.optimize.minimize(
        value, np.zeros(5), jac=grad, method="BFGS", options={"gtol": 1e-12}
    )
    assert np.linalg.norm(grad(problem.w_star)) <= 1e-10
    assert problem.L_star == pytest.approx(value(problem.w_star), rel=1e-14)
    assert problem.L_star <= ref.fun + 1e-12
    np.testing.assert_allclose(problem.w_star, ref.x, rtol=1e-6, atol=1e-8)


def test_best_bce_probe_loss_matches_a_generic_solver():
    """Not separable: the scaled ridge (1e-8 on unit-RMS rows) moves the minimum by ~1e-9."""
    rng = np.random.default_rng(2)
    Z = rng.standard_normal((80, 4))
    Y = (rng.random((80, 1)) < expit(Z[:, :1] - 0.5 * Z[:, 1:2])).astype(float)
    A = np.hstack([Z, np.ones((80, 1))])

    def bce(w):
        return np.mean(np.logaddexp(0, A @ w) - Y[:, 0] * (A @ w))

    ref = scipy.optimize.minimize(bce, np.zeros(5), method="BFGS", options={"gtol": 1e-12})
    assert best_probe_loss("bce", Z, Y) == pytest.approx(bce(ref.x), rel=1e-8)
    with pytest.raises(ValueError):
        best_probe_loss("bce", Z, np.hstack([Y, Y]))


@pytest.mark.parametrize("case", ["rank_deficient", "orthogonal_stalls"])
def test_probe_equals_the_unhalved_exact_line_search(case):
    """GD with exact line search on ‖Zw − Y‖² (halved in the library: the same iterates exactly,
    factors of 2 are exact), including the padding once the gradient reaches round-off."""
    rng = np.random.default_rng(3)
    if case == "rank_deficient":
        Z = (
            rng.standard_normal((40, 6))
            @ np.diag([5, 2, 1, 0.3, 0.0, 0.0])
            @ rng.standard_normal((6, 9))
        )
    else:
        Z = np.linalg.qr(rng.standard_normal((30, 5)))[0] * 3.0
    Y = rng.standard_normal((Z.shape[0], 2))
    w = np.zeros((Z.shape[1], 2))
    w_star = np.linalg.lstsq(Z, Y, rcond=None)[0]
    g_floor = 1e-14 * max(float(np.linalg.norm(2 * Z.T @ Y)), 1e-300)
    E, ratios = Z @ w - Y, [1.0]
    for _ in range(25):
        g = 2.0 * Z.T @ E
        Zg = Z @ g
        curv = 2.0 * float(np.sum(Zg * Zg))
        if not (np.linalg.norm(g) <= g_floor or curv <= 0.0):
            alpha = float(np.sum(g * g)) / curv
            w, E = w - alpha * g, E - alpha * Zg
        ratios.append(float(np.sum((w - w_star) ** 2)) / float(np.sum(w_star**2)))
    assert np.array_equal(gd_exact_line_search(Z, Y, 25).norm_ratio, np.array(ratios))


def test_attack_gd_exact_uses_the_shared_loop_on_least_squares():
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((50, 8)) @ np.diag(np.logspace(0, -2, 8))
    P_ = make_problem(Z, rng.standard_normal(50))
    tr = attack(P_, "gd_exact", max_steps=40, tol=0.0)
    ws = [w for w, _, _ in itertools.islice(exact_line_search_steps(*P_.work, np.zeros(8)), 40)]
    assert len(ws) == 40 and np.array_equal(tr.w_final, ws[-1]) and tr.rel_subopt.size == 41


# ---------------------------------------------------------------- arrays and parameters named

NAN = float("nan")


@pytest.mark.parametrize(
    "A",
    [
        np.array([[1.0, NAN], [0.0, 1.0]]),
        np.ones(3),
        np.ones((2, 2, 2)),
        np.zeros((0, 3)),
        np.array([["1", "2"], ["3", "4"]]),
        np.eye(2) * (1 + 1j),
        np.array([[1, None], [2, 3]], dtype=object),
    ],
)
def test_bad_arrays_name_the_argument(A):
    with pytest.raises(ValueError, match="^S "):
        condition_number(A)


def test_metric_parameters_are_named():
    rng = np.random.default_rng(0)
    X, Z = rng.normal(size=(6, 3)), rng.normal(size=(20, 4))
    # rtol NaN would count no singular value as nonzero, rtol ≥ 1 would cut σ_max
    S = np.diag([3.0, 2.0, 1.0])
    for call, param in (
        (lambda: spectrum_info(S, rtol=NAN), "rtol"),
        (lambda: gram_spectrum(S, rtol=1.0), "rtol"),
        (lambda: hessian_regularizer(S, "ill", rtol=-1.0), "rtol"),
        (lambda: hessian_regularizer(S, "well", rtol="1e-9"), "rtol"),
        (lambda: rir_ceiling(X, X, null_rtol=NAN), "null_rtol"),
        (lambda: grouped_feature_rir(X, X, X, X, rng=rng, groups=0), "groups"),
        (lambda: grouped_feature_rir(X, X, X, X, rng=rng, group_size=NAN), "group_size"),
        (lambda: hessian_regularizer(X, "x"), "kind"),
        (lambda: rir(np.eye(4), Z, rng.normal(size=(20, 5))), "X_H"),
    ):
        with pytest.raises(ParameterError) as e:
            call()
        assert e.value.parameter == param
    with pytest.raises(ValueError, match="Z_H"):
        grouped_feature_rir(X, np.full((6, 3), NAN), X, X, rng=rng)


def test_feature_rir_refuses_mismatched_features():
    """Features of mismatched widths, or a reference of other rows, are refused naming them."""
    Z = np.random.default_rng(0).normal(size=(20, 4))
    for args, param in (
        ((Z, Z[:, :3], Z, Z[:, :3]), "Z_H"),
        ((Z, Z, Z, Z[:, :3]), "Z_H_ref"),
        ((Z, Z, Z[:10], Z), "Z_P_ref"),
        ((Z, Z, Z, Z[:10]), "Z_H_ref"),
    ):
        for f in (
            feature_rir,
            lambda *a: grouped_feature_rir(*a, rng=np.random.default_rng(), group_size=5),
        ):
            with pytest.raises(ParameterError) as e:
                f(*args)
            assert e.value.parameter == param


def test_a_matrix_that_must_be_symmetric_is_checked_with_a_round_off_tolerance():
    rng = np.random.default_rng(1)
    X, A = rng.normal(size=(30, 5)), rng.normal(size=(5, 5))
    K, theta = X.T @ X, np.eye(5) + 0.1 * rng.normal(size=(5, 5))
    for call, param in (
        (lambda M: r_well_grad_theta(theta, M), "K"),
        (lambda M: r_ill_grad_theta(theta, M), "K"),
        (preconditioned_r_ill_step_bound, "H"),
        (preconditioned_r_well_step_bound, "H"),
    ):
        for bad in (K + 1e-3 * np.abs(K).max() * (A - A.T), X.T @ X[:, :4]):
            with pytest.raises(ParameterError) as e:
                call(bad)
            assert e.value.parameter == param
        # what a product leaves (≫ eps, ≪ √eps) passes: the same result as the symmetric matrix
        assert np.allclose(call(K + 1e-12 * np.abs(K).max() * (A - A.T)), call(K), rtol=1e-8)


def test_a_tall_task_never_forms_an_n_by_n_factor():
    """5000 held-out rows, whose full SVD's U would be 200 MB that nothing uses."""
    X = np.random.default_rng(0).standard_normal((5000, 20))
    tracemalloc.start()
    try:
        c = rir_ceiling(X, X[:300])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert c.rank_K_P == 20 and peak < 50 << 20


# ---------------------------------------------------------------- spectra at the edges of float64


def test_zero_and_tied_spectra():
    X = np.eye(3)
    for call in (
        lambda: condition_number(np.zeros((3, 3))),
        lambda: gram_spectrum(np.zeros((4, 3))),
        lambda: r_ill(2.0 * np.eye(3)),
        lambda: gram_spectrum(np.diag([1e200, 1e199])),
        lambda: condition_number(np.full((2, 2), 1e308)),
        lambda: rir(0 * np.eye(3), X, X),
    ):
        with pytest.raises(SpectrumError):
            call()
    assert spectrum_info(np.diag([1e308, 1.0])).rank == 1  # 1 is below σ_max·2·eps


@pytest.mark.parametrize(
    "S,kappa",
    [
        (np.diag([1e308, 1e308]), 1.0),
        (np.diag([1e308, 1e307]), 10.0),
        (np.diag([4e-300, 1e-300]), 4.0),
    ],
)
def test_condition_number_near_float_limits(S, kappa):
    """diag(1e308, 1e308): S + Sᵀ overflows, so symmetry is checked without forming it."""
    assert condition_number(S) == pytest.approx(kappa, rel=1e-12)


@pytest.mark.parametrize("c", [1e80, 1e-80, 1e140, 1e-140])
def test_regularizers_scale_exactly_where_representable(c):
    """R_well(cS) = c²R_well(S), R_ill(cS) = R_ill(S)/c², ∇R_well(cS) = c∇R_well(S), ∇R_ill(cS) =
    ∇R_ill(S)/c³, computed on S/max|S| near the float64 limits (never ±inf)."""
    S = np.diag([3.0, 2.0, 1.0])
    assert r_well(c * S) == pytest.approx(c * c * r_well(S), rel=1e-12)
    assert r_ill(c * S) == pytest.approx(r_ill(S) / c**2, rel=1e-12)
    assert np.allclose(r_well_grad(c * S), c * r_well_grad(S), rtol=1e-12, atol=0)
    if 1e-100 < c < 1e100:
        assert np.allclose(r_ill_grad(c * S), r_ill_grad(S) / c**3, rtol=1e-12, atol=0)
    elif c > 1:  # |∇R_ill| ~ c⁻³ underflows: 0 is the float answer
        assert np.all(np.abs(r_ill_grad(c * S)) < 1e-300)
    else:  # ... or overflows: an error, never ±inf
        with pytest.raises(SpectrumError):
            r_ill_grad(c * S)


@pytest.mark.parametrize(
    "S,f",
    [
        (np.diag([1e200, 3e199]), r_well),
        (np.diag([1e308, 1.0]), r_well),
        (np.diag([3e-160, 1e-160]), r_ill),
        (np.diag([1e-170, 1e-171]), r_ill),
    ],
)
def test_regularizers_outside_float64_are_errors_not_nan_or_inf(S, f):
    """R_well(diag(1e200, 3e199)) ~ 1e400 and R_ill(diag(3e-160, 1e-160)) ~ 5e319 do not fit."""
    with pytest.raises(SpectrumError):
        f(S)


def _near_twins(noise, seed=0):
    """D_H = D_P's rows plus ``noise``: the RIR ceiling is 1 + O(noise)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(60, 6))
    X_H = X + noise * rng.normal(size=X.shape)
    return LinearTask(X, rng.normal(size=60), X_H, rng.normal(size=60))


def test_a_window_whose_width_is_round_off_is_empty():
    """Both tasks of the same rows: κ(C) = 1 + 4e-15 is round-off, not a window
    [2.6e14, 2.6e14 + 1)."""
    same = _near_twins(0.0)
    ceiling = rir_ceiling(same.X_P, same.X_H)
    assert ceiling.kappa_C > 1 and def31_exponent_window(ceiling).empty
    narrow = _near_twins(0.005)
    assert not def31_exponent_window(rir_ceiling(narrow.X_P, narrow.X_H)).empty
