"""Theorem checks (docs/theory.md §5): what holds is asserted on many seeded instances, and every
stated counterexample is asserted to BE a counterexample.  Matrices are built with a prescribed
spectrum ``(U*s)@Vᵀ`` so that gaps (and hence differentiability) are under control."""

from __future__ import annotations

import numpy as np
import pytest

from pycore import SpectrumError, condition_number as _kappa, r_ill, r_well
from pycore._precondition import preconditioned_grad_theta
from pycore._regularizers import (
    TieWarning,
    preconditioned_r_ill_step_bound,
    preconditioned_r_well_step_bound,
    r_ill_grad,
    r_ill_grad_theta,
    r_ill_step_bound,
    r_well_grad,
    r_well_grad_theta,
    r_well_step_bound,
)
from pycore._spectral import spectrum_info
from tests.helpers import (
    central_diff,
    orthogonal,
    psd_with_spectrum,
    rel_err,
    separated_spectrum,
    with_spectrum,
)

SEEDS = range(40)


# ---------------------------------------------------------------- Theorem A.1 (R_well)


@pytest.mark.parametrize("seed", SEEDS)
def test_r_well_nonnegative_and_closed_form(seed):
    rng = np.random.default_rng(seed)
    m, n = rng.integers(2, 9, size=2)
    s = separated_spectrum(min(m, n), rng)
    val = r_well(with_spectrum(s, rng, (m, n)))
    assert val >= 0 and val == pytest.approx(np.sum(s[0] ** 2 - s**2) / (2 * min(m, n)), rel=1e-12)
    # zero exactly at κ = 1
    assert r_well(3.0 * orthogonal(5, rng)) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_r_well_bounds_log_kappa_corrected(seed):
    """A.1(2) as corrected: κ(S) ≤ exp(p·R_well(S)/σ_min²)."""
    rng = np.random.default_rng(seed)
    p = int(rng.integers(2, 8))
    s = separated_spectrum(p, rng, lo=rng.uniform(0.01, 1), hi=rng.uniform(1.5, 20))
    S = with_spectrum(s, rng)
    assert np.log(_kappa(S)) <= p * r_well(S) / s[-1] ** 2 + 1e-12


@pytest.mark.parametrize("seed", SEEDS)
def test_r_well_gd_step_lowers_kappa_below_corrected_bound(seed):
    """A.1(4): singular values map to (1−η+η/p)σ₁, (1+η/p)σᵢ; κ drops for 0 < η < η*."""
    rng = np.random.default_rng(seed)
    p = int(rng.integers(3, 8))
    s = separated_spectrum(p, rng)
    S = with_spectrum(s, rng)
    for eta in np.array([0.05, 0.5, 0.95]) * r_well_step_bound(S):
        S2 = S - eta * r_well_grad(S)
        expected = np.sort(np.r_[(1 - eta + eta / p) * s[0], (1 + eta / p) * s[1:]])[::-1]
        np.testing.assert_allclose(np.linalg.svd(S2, compute_uv=False), expected, rtol=1e-10)
        assert _kappa(S2) < _kappa(S)


def test_r_well_step_bound_is_sharp():
    """Just above η* the step no longer lowers κ: the bound is the true threshold."""
    S = with_spectrum([5.0, 4.0, 1.0], np.random.default_rng(3))
    assert _kappa(S - 1.05 * r_well_step_bound(S) * r_well_grad(S)) > _kappa(S)


# ---------------------------------------------------------------- Theorem 4.1 (R_ill)


@pytest.mark.parametrize("seed", SEEDS)
def test_r_ill_two_sided_bounds(seed):
    """4.1(1) corrected: 2k/((k−1)(σ₁²−σ_k²)) ≤ R_ill ≤ 2k/(σ₁²−σ_k²)."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 8))
    s = separated_spectrum(k, rng)
    v, span = r_ill(with_spectrum(s, rng)), s[0] ** 2 - s[-1] ** 2
    assert 2 * k / ((k - 1) * span) * (1 - 1e-12) <= v <= 2 * k / span * (1 + 1e-12)


def test_r_ill_undefined_at_kappa_one_not_zero():
    rng = np.random.default_rng(1)
    # κ = 1, rank 1
    for S in (2.0 * orthogonal(4, rng), np.outer([1.0, 2.0, 3.0], [1.0, -1.0, 0.5])):
        with pytest.raises(SpectrumError):
            r_ill(S)


def test_r_ill_tends_to_zero_with_spread_not_with_kappa():
    """R_ill → 0 iff σ₁²−σ_k² → ∞: a huge κ with a small spread keeps R_ill large."""
    tiny_spread, big_spread = np.diag([1e-3, 1e-9]), np.diag([1e3, 5e2])  # κ = 1e6 and 2
    assert _kappa(tiny_spread) > _kappa(big_spread)
    assert r_ill(tiny_spread) > 1e6 > 1e-3 > r_ill(big_spread)


@pytest.mark.parametrize("seed", SEEDS)
def test_r_ill_sharpened_log_kappa_bound(seed):
    """4.1(2) as it holds: 1/log κ ≤ ((k−1)/k)·σ₁²·R_ill."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 8))
    s = separated_spectrum(k, rng, lo=rng.uniform(0.01, 1), hi=rng.uniform(1.5, 50))
    S = with_spectrum(s, rng)
    assert 1 / np.log(_kappa(S)) <= (k - 1) / k * s[0] ** 2 * r_ill(S) * (1 + 1e-12)


def test_the_papers_readings_as_upper_bounds_are_false():
    """ "R_well ≥ log κ" fails at S = 0.1·diag(2, 1), "R_ill ≥ 1/log κ" at S = 10·diag(2, 1)."""
    S = np.diag([2.0, 1.0])
    assert r_well(0.1 * S) < np.log(2) and r_ill(10 * S) < 1 / np.log(2)


@pytest.mark.parametrize("seed", SEEDS[:15])
def test_gradients_match_central_differences(seed):
    """Theorem A.1(3), Theorem 4.1(3)."""
    rng = np.random.default_rng(seed)
    m, n = rng.integers(2, 6, size=2)
    S = with_spectrum(
        separated_spectrum(min(m, n), rng, lo=0.5, hi=3.0, min_gap=0.05), rng, (m, n)
    )
    for r, grad in ((r_well, r_well_grad), (r_ill, r_ill_grad)):
        assert rel_err(grad(S), central_diff(r, S)) < 1e-7


@pytest.mark.parametrize("seed", SEEDS)
def test_r_ill_gd_step_raises_kappa(seed):
    """4.1(4): any 0 < η < k d²/(k−1) raises κ."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 8))
    S = with_spectrum(separated_spectrum(k, rng), rng)
    for frac in (0.01, 0.5, 0.99):
        assert _kappa(S - frac * r_ill_step_bound(S) * r_ill_grad(S)) > _kappa(S)


def test_r_ill_step_at_rank_drop_value_loses_rank_and_gradients_warn_at_ties():
    """The exact bad point η = k d²/(k−1): σ_k is sent to 0 (rank drop)."""
    S, k, d = np.diag([3.0, 2.0, 1.0]), 3, (9 + 4 + 1) / 6 - 0.5
    assert spectrum_info(S - (k * d**2 / (k - 1)) * r_ill_grad(S)).rank == 2
    with pytest.warns(TieWarning, match="σ_min"):
        r_ill_grad(np.diag([3.0, 1.0, 1.0]))
    with pytest.warns(TieWarning, match="σ_max"):
        r_well_grad(np.diag([3.0, 3.0, 1.0]))


# ---------------------------------------------------------------- Theorem 4.2 (through θ)


def _rank_deficient_K(rng, D, N):
    X = rng.standard_normal((N, D)) * rng.uniform(0.5, 2.0, D)
    return X.T @ X


@pytest.mark.parametrize("seed", SEEDS[:12])
@pytest.mark.parametrize("N_less_than_D", [False, True])
def test_theta_gradients_match_central_differences(seed, N_less_than_D):
    rng = np.random.default_rng(seed)
    K = _rank_deficient_K(rng, 5, 3 if N_less_than_D else 12)
    theta = np.eye(5) + 0.3 * rng.standard_normal((5, 5))
    # R_well: p = D
    for r, grad in ((r_well, r_well_grad_theta), (r_ill, r_ill_grad_theta)):
        assert (
            rel_err(grad(theta, K), central_diff(lambda t: r(t.T @ K @ t), theta, h=1e-6)) < 1e-6
        )


@pytest.mark.parametrize("seed", SEEDS[:10])
def test_exact_preconditioned_form_equals_explicit_solve(seed):
    """K⁻¹∇_θR = 2θG exactly for invertible K; the ridge form equals the explicit ridge solve."""
    rng = np.random.default_rng(seed)
    K = _rank_deficient_K(rng, 6, 20)
    theta = np.eye(6) + 0.2 * rng.standard_normal((6, 6))
    for kind, grad in (("well", r_well_grad_theta), ("ill", r_ill_grad_theta)):
        g = grad(theta, K)
        exact = preconditioned_grad_theta(theta, K, kind, mode="exact")
        assert rel_err(exact, np.linalg.solve(K, g)) < 1e-9
        ridge = preconditioned_grad_theta(theta, K, kind, mode="ridge", ridge=0.5)
        assert rel_err(ridge, np.linalg.solve(K + 0.5 * np.eye(6), g)) < 1e-10


@pytest.mark.parametrize("seed", SEEDS[:10])
def test_pinv_preconditioner_is_pseudo_inverse_and_gives_same_hessian(seed):
    rng = np.random.default_rng(seed)
    K = _rank_deficient_K(rng, 6, 4)
    theta = np.eye(6) + 0.2 * rng.standard_normal((6, 6))
    pinv = preconditioned_grad_theta(theta, K, "ill", mode="pinv")
    assert rel_err(pinv, np.linalg.pinv(K, rcond=1e-12) @ r_ill_grad_theta(theta, K)) < 1e-7
    t1, t2 = (
        theta - 1e-3 * pinv,
        theta - 1e-3 * preconditioned_grad_theta(theta, K, "ill", mode="exact"),
    )
    assert rel_err(t1.T @ K @ t1, t2.T @ K @ t2) < 1e-10


# ---------------------------------------------------------------- Theorem 4.3 (preconditioned)


def _precond_step(theta, K, kind, eta):
    return theta - eta * preconditioned_grad_theta(theta, K, kind, mode="exact")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", ["well", "ill"])
def test_preconditioned_step_monotone_under_corrected_bound(seed, kind):
    """Thm 4.3 corrected: θ − ηK⁻¹∇_θR lowers κ(θᵀKθ) for R_well (η ≤ bound) and raises it for
    R_ill (η < bound), with the bounds of docs/theory.md §5 as computed by the library."""
    rng = np.random.default_rng(seed)
    D = int(rng.integers(3, 8))
    K = psd_with_spectrum(rng.uniform(0.5, 5, D), rng)
    theta = with_spectrum(separated_spectrum(D, rng, 0.3, 2.0), rng)
    H = theta.T @ K @ theta
    if kind == "well":
        bound, fracs, moved = preconditioned_r_well_step_bound(H), (0.1, 0.5, 1.0), np.less
    else:
        bound, fracs, moved = preconditioned_r_ill_step_bound(H), (0.01, 0.5, 0.99), np.greater
    for frac in fracs:
        t2 = _precond_step(theta, K, kind, frac * bound)
        assert moved(_kappa(t2.T @ K @ t2), _kappa(H))


def test_preconditioned_r_well_printed_first_term_alone_fails():
    """Thm 4.3(1): η < 1/((1−1/D)σ₁) alone is not enough: H=diag(1,.9,.1), K=I, η=.45."""
    H, eta, D = np.diag([1.0, 0.9, 0.1]), 0.45, 3
    assert eta < 1 / ((1 - 1 / D) * 1.0)
    t2 = _precond_step(np.sqrt(H), np.eye(3), "well", eta)
    # excluded
    assert _kappa(t2.T @ t2) > _kappa(H) and eta > preconditioned_r_well_step_bound(H)


def test_preconditioned_r_ill_printed_bound_admits_a_rank_drop():
    """Thm 4.3(2): the printed bound d²/(1−2σ_min/k) admits η = k d²/(2(k−1)σ_min), where the
    smallest eigenvalue hits 0 and κ over the nonzero spectrum FALLS (H = diag(4, 3.5, 1))."""
    H, k, smin = np.diag([4.0, 3.5, 1.0]), 3, 1.0
    d = np.sum(np.diag(H) ** 2) / (2 * k) - 0.5 * smin**2
    eta = k * d**2 / (2 * (k - 1) * smin)
    assert eta < d**2 / (1 - 2 * smin / k)  # admitted by the printed bound
    info = spectrum_info((t2 := _precond_step(np.sqrt(H), np.eye(3), "ill", eta)).T @ t2)
    assert info.rank == 2 and info.kappa < _kappa(H) and eta >= preconditioned_r_ill_step_bound(H)


# ---------------------------------------------------------------- Proposition 3.2 and Sec. 3.1


def test_prop32_counterexample_the_library_gives_the_true_spectrum():
    """Proposition 3.2 is false in general (docs/theory.md §3): for K = diag(2, 1), θ = [[1, 1],
    [0, 1]] the spectrum of θᵀKθ is (4.5616, 0.4384), the proposition's formula sᵢ²·uᵢᵀKuᵢ gives
    (4.5125, 0.4875) and so UNDERestimates κ (9.256 against 10.405). Every κ the library reports
    (of H, of the features through the SVD, and the RIR built on them) is the true one."""
    from pycore import rir
    from pycore._spectral import gram_spectrum

    K, theta = np.diag([2.0, 1.0]), np.array([[1.0, 1.0], [0.0, 1.0]])
    true = (5 + np.sqrt(17.0)) / (5 - np.sqrt(17.0))  # θᵀKθ = [[2, 2], [2, 3]]: (5 ± √17)/2
    formula = 4.5125 / 0.4875
    X = np.sqrt(K)  # XᵀX = K: H(θ) = θᵀXᵀXθ
    info = spectrum_info(theta.T @ K @ theta)
    np.testing.assert_allclose(info.sigma, [4.5616, 0.4384], atol=1e-4)  # H is symmetric PSD
    for kappa in (_kappa(theta.T @ K @ theta), gram_spectrum(X @ theta).kappa):
        assert kappa == pytest.approx(true, rel=1e-12) and kappa > 1.1 * formula
    # the harmful ratio of θ against I on these rows is the true κ's ratio, not the formula's
    r = rir(theta, X, X)
    assert r.harmful_ratio == pytest.approx(true / 2.0, rel=1e-12)


@pytest.mark.parametrize("seed", SEEDS[:20])
def test_kappa_ratio_bounded_by_kappa_C_with_equality(seed):
    """Sec. 3.1 corrected: κ(H_H)/κ(H_P) ≤ κ(C), C = K_P^{-½}K_HK_P^{-½}, equality at θ =
    K_P^{-½}."""
    rng = np.random.default_rng(seed)
    D = int(rng.integers(2, 7))
    KP, KH = (psd_with_spectrum(rng.uniform(0.2, 5, D), rng) for _ in range(2))
    w, Q = np.linalg.eigh(KP)
    KP_mhalf = (Q / np.sqrt(w)) @ Q.T
    kC = _kappa(KP_mhalf @ KH @ KP_mhalf)
    for _ in range(10):
        theta = rng.standard_normal((D, D))
        assert _kappa(theta.T @ KH @ theta) / _kappa(theta.T @ KP @ theta) <= kC * (1 + 1e-8)
    assert _kappa(KP_mhalf @ KH @ KP_mhalf) / _kappa(KP_mhalf @ KP @ KP_mhalf) == pytest.approx(
        kC, rel=1e-8
    )


def test_aligned_eigenvectors_do_not_rule_out_immunization():
    """Sec. 3.1's "aligned eigenvectors ⇒ no immunization" is false: shared eigenvectors,
    opposite eigenvalue order, and θ = K_P^{-½} reaches RIR = κ(C)κ(K_P)/κ(K_H) = 9 > 1."""
    from pycore import rir

    XP, XH = np.diag(np.sqrt([1.0, 2.0, 3.0])), np.diag(np.sqrt([3.0, 2.0, 1.0]))
    assert rir(np.diag(1 / np.sqrt([1.0, 2.0, 3.0])), XP, XH).value == pytest.approx(
        9.0, rel=1e-12
    )


# ---------------------------------------------------------------- Eq. (2), line search, Def 3.1(c)


@pytest.mark.parametrize("seed", SEEDS[:20])
def test_the_gd_attacker_contracts_at_the_rate_of_eq_2(seed):
    """Eq. (2): GD with step 1/L on ½‖Zw − y‖² (pycore.attacks' ``gd_constant``) shrinks the
    suboptimality by at least (1 − 1/κ)² a step, κ = κ(ZᵀZ); with w* along the smallest
    eigenvector, by exactly that. A step of 1.9/L must still converge (any c < 2 does)."""
    from pycore.attacks import attack, make_problem

    rng = np.random.default_rng(seed)
    D = int(rng.integers(2, 8))
    sigma = separated_spectrum(D, rng, 0.3, 3.0)
    Z = with_spectrum(sigma, rng, shape=(D + 3, D))
    kappa, steps = (sigma[0] / sigma[-1]) ** 2, 25
    rate = (1 - 1 / kappa) ** (2 * np.arange(steps + 1))
    generic = make_problem(Z, rng.standard_normal(D + 3))
    tr = attack(generic, "gd_constant", step_factor=1.0, max_steps=steps, tol=0.0)
    # the relative suboptimality resolves ~1e-15 (L(w) − L* cancels): compare above 1e-10
    seen = rate > 1e-10
    assert np.all(tr.rel_subopt[: steps + 1][seen] <= rate[seen] * (1 + 1e-6))
    v_min = np.linalg.svd(Z)[2][-1]  # the smallest eigenvector of ZᵀZ
    worst = make_problem(Z, Z @ v_min)
    tr = attack(worst, "gd_constant", step_factor=1.0, max_steps=steps, tol=0.0)
    np.testing.assert_allclose(tr.rel_subopt[: steps + 1][seen], rate[seen], rtol=1e-6)
    fast = attack(generic, "gd_constant", step_factor=1.9, max_steps=2000, tol=1e-10)
    assert fast.steps_to(1e-10) is not None


def test_exact_line_search_step_minimises_along_gradient():
    from pycore._probe import gd_exact_line_search

    rng = np.random.default_rng(0)
    Z, y = rng.standard_normal((30, 6)), rng.standard_normal(30)
    tr = gd_exact_line_search(Z, y, 1)
    g = 2 * Z.T @ (-y)  # w0 = 0
    alphas = np.linspace(0.5, 1.5, 201) * tr.step_sizes[0]
    losses = [np.sum((Z @ (-a * g) - y) ** 2) for a in alphas]
    assert abs(alphas[int(np.argmin(losses))] - tr.step_sizes[0]) <= 0.01 * tr.step_sizes[0]


def test_invertible_theta_keeps_best_pretraining_loss():
    """Def 3.1(c): any invertible θ leaves min_ω L(D_P, ω, θ) unchanged; a singular θ need not."""
    from pycore._losses import best_probe_loss

    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((40, 5)), rng.standard_normal((40, 1))
    base = best_probe_loss("mse", X, y)
    for _ in range(5):
        assert best_probe_loss("mse", X @ rng.standard_normal((5, 5)), y) == pytest.approx(
            base, rel=1e-9
        )
    assert best_probe_loss("mse", X @ np.diag([1.0, 1.0, 1.0, 1.0, 0.0]), y) > base * (1 + 1e-6)


# ---------------------------------------------------------------- orientation (docs/theory.md §4)


def test_right_side_preconditioner_orientation():
    """In W = θᵀ form the preconditioned step is grad_W·K⁻¹ (right).  Left-multiplying
    (K⁻¹·grad_W) breaks Theorem 4.3's monotonicity on a share of random instances."""
    rng = np.random.default_rng(2024)
    fails = {"right": 0, "left": 0}
    for _ in range(200):
        K = psd_with_spectrum(rng.uniform(0.2, 5, 4), rng)
        theta = with_spectrum(separated_spectrum(4, rng, 0.3, 2.0), rng)
        H, W, grad_W, Kinv = (
            theta.T @ K @ theta,
            theta.T,
            r_well_grad_theta(theta, K).T,
            np.linalg.inv(K),
        )
        eta = 0.99 * preconditioned_r_well_step_bound(H)
        for W2, side in ((W - eta * grad_W @ Kinv, "right"), (W - eta * Kinv @ grad_W, "left")):
            fails[side] += not _kappa(W2 @ K @ W2.T) < _kappa(H)
    assert fails["right"] == 0 and fails["left"] >= 5
