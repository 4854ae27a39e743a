"""Linear core: spectra, regularizer paths, metrics, immunizers, certified mode, bad input."""
from __future__ import annotations

import numpy as np
import pytest

import pycore
from pycore import precondition as P
from pycore import regularizers as R
from pycore.immunize import METHODS, ImmunizeConfig, imma_objective, immunize
from pycore.metrics import rir, rir_ceiling
from pycore.spectral import SpectrumError, gram_spectrum, spectrum_info
from pycore.tasks import LinearTask
from tests.helpers import central_diff, rel_err, with_spectrum


def small_task(seed=0, N=40, D=6, loss="mse"):
    rng = np.random.default_rng(seed)
    XP = rng.standard_normal((N, D)) * rng.uniform(0.5, 3, D)
    XH = rng.standard_normal((N, D)) @ rng.standard_normal((D, D))
    YP = rng.standard_normal((N, 1)) if loss == "mse" else (rng.random((N, 1)) < 0.5).astype(float)
    return LinearTask(XP, YP, XH, rng.standard_normal((N, 1)), loss)


# ---------------------------------------------------------------- public API and spectra

def test_public_api_names():
    for name in ("condition_number", "r_ill", "r_well", "r_ill_grad", "r_well_grad", "rir", "rir_ceiling"):
        assert callable(getattr(pycore, name))


def test_condition_number_uses_nonzero_spectrum_and_reports_rank():
    rng = np.random.default_rng(0)
    S = with_spectrum([4.0, 2.0, 0.5, 0.0, 0.0], rng)
    info = spectrum_info(S)
    assert info.rank == 3
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


def test_hessian_regularizer_matches_matrix_path():
    rng = np.random.default_rng(2)
    Z = rng.standard_normal((12, 5))
    H = Z.T @ Z
    for kind in ("ill", "well"):
        reg = R.hessian_regularizer(Z, kind)
        ev = R.evaluate(H, kind, p=5)
        assert reg.value == pytest.approx(ev.value, rel=1e-10)
        assert rel_err(reg.G, ev.grad) < 1e-9


def test_rank_deficient_features_n_less_than_d():
    rng = np.random.default_rng(3)
    Z = rng.standard_normal((3, 7))
    reg = R.hessian_regularizer(Z, "ill")
    assert reg.info.rank == 3
    H = Z.T @ Z
    assert reg.value == pytest.approx(R.r_ill(H), rel=1e-9)


@pytest.mark.parametrize("bad, msg", [
    (np.zeros((3, 3)), "zero"),
    (np.array([[1.0, np.nan], [0.0, 1.0]]), "NaN"),
    (np.ones(4), "2-D"),
    (np.array([["a", "b"], ["c", "d"]]), "numeric"),
    (np.empty((0, 3)), "empty"),
])
def test_bad_matrices_raise_one_line_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        pycore.condition_number(bad)


def test_r_ill_of_rank_one_is_flagged():
    with pytest.raises(SpectrumError, match="rank 1"):
        pycore.r_ill(np.outer([1.0, 2.0], [3.0, 1.0]))


def test_tie_is_reported_in_diagnostics():
    info = spectrum_info(np.diag([2.0, 2.0, 1.0]))
    assert info.tie_max and not info.tie_min
    reg = R.hessian_regularizer(np.diag([3.0, 1.0, 1.0]), "ill")
    assert reg.tie


# ---------------------------------------------------------------- metrics and ceiling

def test_rir_of_identity_is_one_and_api_shape():
    t = small_task()
    r = rir(np.eye(t.D), t.X_P, t.X_H)
    assert float(r) == pytest.approx(1.0) and r.harmful_ratio == pytest.approx(1.0)


def test_ceiling_is_finite_and_attained_when_null_spaces_nest():
    t = small_task(4)
    c = rir_ceiling(t.X_P, t.X_H)
    assert np.isfinite(c.exact) and c.exact == pytest.approx(c.range_restricted)
    res = immunize(t, "closed_form", rng=np.random.default_rng(0))
    assert rir(res.theta, t.X_P, t.X_H).value == pytest.approx(c.range_restricted, rel=1e-8)
    # No θ beats the ceiling: random extractors stay below it.
    rng = np.random.default_rng(5)
    for _ in range(50):
        assert rir(rng.standard_normal((t.D, t.D)), t.X_P, t.X_H).value <= c.exact * (1 + 1e-8)


def test_ceiling_is_infinite_when_dp_ignores_a_direction_dh_uses():
    t = small_task(6)
    XP = t.X_P.copy()
    XP[:, 2] = 0.0  # D_P never varies along e_3, D_H does
    c = rir_ceiling(XP, t.X_H)
    assert c.exact == np.inf and "⊄" in c.reason
    # and indeed RIR grows without bound by shrinking that direction
    vals = [rir(np.diag([1, 1, s, 1, 1, 1.0]), XP, t.X_H).value for s in (1e-1, 1e-3)]
    assert vals[1] > 10 * vals[0]


def test_closed_form_exponent_trades_factors_at_constant_rir():
    t = small_task(7)
    r0 = rir(immunize(t, "closed_form", rng=np.random.default_rng(0)).theta, t.X_P, t.X_H)
    r1 = rir(immunize(t, "closed_form", rng=np.random.default_rng(0),
                      config=ImmunizeConfig(closed_form_exponent=0.5)).theta, t.X_P, t.X_H)
    assert r1.value == pytest.approx(r0.value, rel=1e-8)
    assert r1.pretrain_ratio != pytest.approx(r0.pretrain_ratio, rel=1e-3)


# ---------------------------------------------------------------- immunizers

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_every_method_runs_and_is_seeded(method, loss):
    t = small_task(8, loss=loss)
    cfg = ImmunizeConfig(epochs=3, batch_size=16)
    a = immunize(t, method, rng=np.random.default_rng(11), config=cfg)
    b = immunize(t, method, rng=np.random.default_rng(11), config=cfg)
    assert a.theta.shape == (t.D, t.D) and np.all(np.isfinite(a.theta))
    np.testing.assert_array_equal(a.theta, b.theta)


def test_imma_gradient_matches_finite_differences():
    t = small_task(9, N=25, D=4)
    rng = np.random.default_rng(0)
    theta = np.eye(4) + 0.1 * rng.standard_normal((4, 4))
    w, omega = rng.standard_normal((4, 1)), rng.standard_normal((4, 1))
    cfg = ImmunizeConfig(imma_inner_steps=4)
    _, g = imma_objective(theta, w, omega, t, cfg)
    fd = central_diff(lambda th: imma_objective(th, w, omega, t, cfg)[0], theta, h=1e-6)
    assert rel_err(g, fd) < 1e-7
    rows = np.array([0, 3, 7, 11, 20])  # a D_P mini-batch for the upper level's L_P
    batch = (t.X_P[rows], t.Y_P[rows])
    F_b, g_b = imma_objective(theta, w, omega, t, cfg, batch_P=batch)
    fd_b = central_diff(lambda th: imma_objective(th, w, omega, t, cfg, batch_P=batch)[0], theta, h=1e-6)
    assert rel_err(g_b, fd_b) < 1e-7 and rel_err(g_b, g) > 1e-3
    # the unrolled steps matter: with 0 inner steps the gradient differs
    _, g0 = imma_objective(theta, w, omega, t, ImmunizeConfig(imma_inner_steps=0))
    assert rel_err(g0, g) > 1e-3


def test_ours_improves_rir_on_a_synthetic_task():
    t = small_task(10, N=60, D=6)
    res = immunize(t, "ours", rng=np.random.default_rng(0),
                   config=ImmunizeConfig(epochs=60, batch_size=None, lambda_h=1e4))
    assert rir(res.theta, t.X_P, t.X_H).value > 1.5


@pytest.mark.parametrize("seed", range(8))
def test_certified_mode_has_no_violations(seed):
    t = small_task(20 + seed, N=30, D=5)
    cfg = ImmunizeConfig(epochs=5, batch_size=None, certified=True, lr=0.05, lambda_p=10, lambda_h=1e4)
    res = immunize(t, "ours", rng=np.random.default_rng(seed), config=cfg)
    cert = res.diagnostics["certified"]
    assert cert["checked"] == 5 and cert["violations_P"] == 0 and cert["violations_H"] == 0


def test_uncapped_regularizer_step_can_violate_monotonicity():
    """The same step without the docs/theory.md §5 cap: a large R_well step raises κ(H_P)."""
    t = small_task(30, N=30, D=5)
    theta = np.eye(t.D)
    reg = R.hessian_regularizer(t.X_P, "well")
    bound = R.preconditioned_r_well_step_bound(reg.info, D=t.D)
    step = P.precondition(theta, reg.G, t.K_P, "exact")
    worse = [eta for eta in bound * np.array([2.0, 5.0, 20.0, 100.0])
             if gram_spectrum(t.X_P @ (theta - eta * step)).kappa > reg.info.kappa]
    assert worse, "some uncapped step must raise κ(H_P)"


# ---------------------------------------------------------------- bad input

def test_task_validation_messages():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((10, 3))
    with pytest.raises(ValueError, match="columns"):
        LinearTask(X, np.ones(10), rng.standard_normal((10, 4)), np.ones(10))
    with pytest.raises(ValueError, match="rows"):
        LinearTask(X, np.ones(9), X, np.ones(10))
    Xn = X.copy()
    Xn[2, 1] = np.inf
    with pytest.raises(ValueError, match=r"X_H contains NaN or inf \(first at index \(2, 1\)\)"):
        LinearTask(X, np.ones(10), Xn, np.ones(10))
    with pytest.raises(ValueError, match="bce"):
        LinearTask(X, np.full(10, 0.5), X, np.ones(10), loss="bce")


def test_unknown_method_and_bad_config():
    t = small_task()
    with pytest.raises(ValueError, match="unknown method"):
        immunize(t, "magic", rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="precond"):
        ImmunizeConfig(precond="cholesky")
    with pytest.raises(TypeError, match="Generator"):
        immunize(t, "ours", rng=0)


def test_degenerate_task_gives_clear_error():
    """D_H with κ = 1 (orthogonal rows): R_ill is undefined, said with the epoch and step."""
    rng = np.random.default_rng(0)
    XP = rng.standard_normal((20, 4))
    XH = np.eye(4) * 3.0
    t = LinearTask(XP, rng.standard_normal(20), XH, rng.standard_normal(4))
    with pytest.raises(SpectrumError, match=r"ours: epoch 1, step 0: R_ill is undefined"):
        immunize(t, "ours", rng=np.random.default_rng(0), config=ImmunizeConfig(epochs=1))


def test_closed_form_with_fewer_harmful_rows_than_rank_keeps_dp_loss():
    """N_H < rank K_P: C = K_P^{-½}K_HK_P^{-½} has a null space, and the closed form must keep its
    eigenvectors (θ injective on range(K_P)), or D_P's best loss would change (Def. 3.1(c))."""
    from pycore.losses import best_probe_loss

    rng = np.random.default_rng(0)
    X_P, X_H = rng.standard_normal((30, 8)), rng.standard_normal((5, 8))
    task = LinearTask(X_P, rng.standard_normal(30), X_H, rng.standard_normal(5))
    res = immunize(task, "closed_form", rng=rng)
    assert np.linalg.matrix_rank(res.theta) == 8 and res.diagnostics["null_columns_zeroed"] == 0
    assert best_probe_loss("mse", X_P @ res.theta, task.Y_P) == pytest.approx(
        best_probe_loss("mse", X_P, task.Y_P), rel=1e-10)
    ceil = rir_ceiling(X_P, X_H)
    assert ceil.lambda_C.size == 8 and np.all(ceil.lambda_C[ceil.rank_C:] == 0) and ceil.rank_C == 5
    assert rir(res.theta, X_P, X_H).value == pytest.approx(ceil.range_restricted, rel=1e-8)


def test_imma_upper_level_uses_the_dp_mini_batches(monkeypatch):
    """IMMA's L_P term sees the same D_P mini-batches as Algorithm 1's loss term, not all of D_P
    at every step."""
    import pycore.immunize as imm

    seen = []
    real = imm.imma_objective

    def spy(*args, batch_P=None, **kw):
        seen.append(None if batch_P is None else batch_P[0].shape[0])
        return real(*args, batch_P=batch_P, **kw)

    monkeypatch.setattr(imm, "imma_objective", spy)
    t = small_task(3, N=20, D=4)
    immunize(t, "imma", rng=np.random.default_rng(0), config=ImmunizeConfig(epochs=2, batch_size=8))
    assert seen == [8, 8, 4, 8, 8, 4]


def test_range_null_split_separates_what_D_P_sees():
    """θ_range acts as θ on range(K_P) and as I on null(K_P); θ_null the other way round, so a θ
    that only rescales null(K_P) directions has θ_range = I and θ_null = θ (docs/theory.md §8)."""
    from pycore.metrics import range_null_split

    rng = np.random.default_rng(3)
    D, r = 6, 4
    X_P = rng.normal(size=(20, r)) @ rng.normal(size=(r, D))      # rank 4: null(K_P) has dim 2
    _, _, Vt = np.linalg.svd(X_P)
    V_R, V_N = Vt[:r].T, Vt[r:].T
    theta = np.eye(D) + 0.3 * rng.normal(size=(D, D))
    t_range, t_null = range_null_split(theta, X_P)
    # Inputs are rows (features xθ): on range(K_P) θ_range acts as θ, on null(K_P) as I.
    np.testing.assert_allclose(V_R.T @ t_range, V_R.T @ theta, atol=1e-12)
    np.testing.assert_allclose(V_N.T @ t_range, V_N.T, atol=1e-12)
    np.testing.assert_allclose(V_R.T @ t_null, V_R.T, atol=1e-12)
    np.testing.assert_allclose(V_N.T @ t_null, V_N.T @ theta, atol=1e-12)
    # The two parts add up to θ + I.
    np.testing.assert_allclose(t_range + t_null, theta + np.eye(D), atol=1e-12)
    only_null = np.eye(D) + V_N @ np.diag([5.0, 0.1]) @ V_N.T   # rescales only null(K_P) inputs
    a, b = range_null_split(only_null, X_P)
    np.testing.assert_allclose(a, np.eye(D), atol=1e-12)
    np.testing.assert_allclose(b, only_null, atol=1e-12)
