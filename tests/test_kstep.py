"""The k-step remaining fraction E_k of a GD probe and the k-step immunizer (docs/theory.md §11):
the closed form against GD run step by step, the adjoint gradient against central differences,
the invariances and the κ bound, the method on a task of its own, its options, the deep layer and
the torch twin."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import central_diff, orthogonal, rel_err, with_spectrum

from pycore import (
    METHODS,
    LinearTask,
    ParameterError,
    SpectrumError,
    immunize,
    immunize_batch,
    kstep_remaining,
    method_of,
    options_of,
)
from pycore._kstep import kstep_remaining_grad, probe_matrix
from pycore._losses import best_probe_loss
from pycore._regularizers import TieWarning
from pycore.deep._layer import LayerSolution, kstep_layer
from pycore.deep._objectives import kstep_loss
from pycore.linalg import KStepProbe

EPS = np.finfo(np.float64).eps


def _features(rng, N, D, rank=None):
    """N×D features of the given rank, columns of unequal scale (κ ≈ 10–1e3)."""
    rank = min(N, D) if rank is None else rank
    Z = rng.standard_normal((N, rank)) @ rng.standard_normal((rank, D))
    return Z * np.linspace(1.0, 4.0, D)


def _gd_remaining(Z, Y, k, bias):
    """E_k by running the probe: k explicit GD steps of η = 1/λ_max(AᵀA/N) from W₀ = 0 on
    L(W) = ‖AW − Y‖²/(2N), L* from ``lstsq`` (the same rank cut-off, max(N, p)·eps·σ₁)."""
    A = probe_matrix(Z, bias)
    Y = Y.reshape(len(Y), -1)
    N = A.shape[0]
    eta = 1.0 / np.linalg.eigvalsh(A.T @ A / N)[-1]

    def loss(W):
        return float(np.sum((A @ W - Y) ** 2) / (2 * N))

    W = np.zeros((A.shape[1], Y.shape[1]))
    L0 = loss(W)
    for _ in range(k):
        W = W - eta * (A.T @ (A @ W - Y)) / N
    L_star = loss(np.linalg.lstsq(A, Y, rcond=None)[0])
    return (loss(W) - L_star) / (L0 - L_star), L0 / (L0 - L_star)


# ------------------------------------------------------------------ the closed form


@pytest.mark.parametrize(
    "N, D, rank",
    [(40, 6, None), (5, 12, None), (40, 8, 3), (6, 12, 3)],
    ids=["N>D", "N<D", "rank-deficient N>D", "rank-deficient N<D"],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("C", [1, 3])
def test_closed_form_equals_gd_run_step_by_step(N, D, rank, bias, C):
    rng = np.random.default_rng(N * 100 + D + 7 * C + bias)
    Z = _features(rng, N, D, rank)
    Y = rng.standard_normal((N, C))
    for k in (1, 10, 50):
        got = kstep_remaining(Z, Y, steps=k, bias=bias)
        want, amplification = _gd_remaining(Z, Y, k, bias)
        # Each loss of the explicit run is rounded at ~eps·L(0); their difference L(W_k) − L*
        # divides that by L(0) − L*, and k steps accumulate it: k·eps·L(0)/(L(0) − L*), ×64
        # for the products inside a step (the measured differences are ≤ 6e-15, ≤ 5% of it).
        assert abs(got.remaining - want) <= 64 * k * EPS * amplification, (k, got, want)
        assert 0.0 <= got.remaining <= 1.0


def test_formula_is_the_spectral_sum():
    # Y on the singular directions with weights w: E_k = Σ w_j²(1 − r_j)^{2k} / Σ w_j²
    rng = np.random.default_rng(0)
    s = np.array([3.0, 2.0, 1.0, 0.5])
    U, V = orthogonal(20, rng)[:, :4], orthogonal(4, rng)
    w = np.array([1.0, -2.0, 0.5, 3.0])
    Z = (U * s) @ V.T
    Y = U @ w
    r = (s / s[0]) ** 2
    for k in (1, 3, 10):
        want = np.sum(w**2 * (1 - r) ** (2 * k)) / np.sum(w**2)
        assert kstep_remaining(Z, Y, steps=k).remaining == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------ the bound and invariances


def test_remaining_is_bounded_by_kappa_and_meets_the_bound_on_the_slowest_direction():
    rng = np.random.default_rng(1)
    for _ in range(50):
        N, D = rng.integers(3, 30, size=2)
        Z, Y = _features(rng, N, D), rng.standard_normal((N, int(rng.integers(1, 4))))
        for bias in (False, True):
            e = kstep_remaining(Z, Y, steps=int(rng.integers(1, 30)), bias=bias)
            assert e.remaining <= e.bound * (1 + 1e-12)
            assert e.bound == pytest.approx((1 - 1 / e.kappa) ** (2 * e.steps), rel=1e-12)
    # all of Y on the smallest nonzero singular direction: E_k is the bound itself
    s = np.array([4.0, 2.0, 1.0])
    U, V = orthogonal(12, rng)[:, :3], orthogonal(3, rng)
    e = kstep_remaining((U * s) @ V.T, U[:, 2], steps=5)
    assert e.kappa == pytest.approx(16.0) and e.remaining == pytest.approx(e.bound, rel=1e-12)


def test_a_theta_can_raise_kappa_while_the_probe_on_these_labels_finishes_at_once():
    # docs/theory.md §11: λ_max shrunk onto the label-carrying direction, the smallest shrunk more
    X, Y = np.diag([1.0, 0.5, 0.1]), np.array([0.0, 1.0, 0.0])
    theta = np.diag([0.5, 1.0, 0.01])
    before, after = (kstep_remaining(X @ t, Y, steps=10) for t in (np.eye(3), theta))
    assert after.kappa / before.kappa == pytest.approx(2500.0)
    assert before.remaining == pytest.approx(0.75**20, rel=1e-12) and after.remaining == 0.0


@pytest.mark.parametrize("bias", [False, True])
def test_remaining_ignores_the_scale_of_features_and_targets(bias):
    rng = np.random.default_rng(2)
    Z, Y = _features(rng, 30, 6), rng.standard_normal((30, 2))
    base = kstep_remaining(Z, Y, steps=10, bias=bias).remaining
    for c, d in ((1e-3, 1.0), (1e4, 1e-5), (-2.0, 7.0)):
        assert kstep_remaining(c * Z, d * Y, steps=10, bias=bias).remaining == pytest.approx(
            base, rel=1e-12
        )
    # E_k is 0-homogeneous in Z: its gradient is orthogonal to Z (Euler)
    _, g = kstep_remaining_grad(Z, Y, steps=10, bias=bias)
    assert abs(np.sum(g * Z)) <= 1e-12 * np.linalg.norm(g) * np.linalg.norm(Z)
    # and in θ: E_k(Xcθ) = E_k(Xθ)
    probe = KStepProbe(Z, Y, steps=10, bias=bias)
    theta = np.eye(6) + 0.2 * rng.standard_normal((6, 6))
    assert probe.remaining(5.0 * theta).remaining == pytest.approx(
        probe.remaining(theta).remaining, rel=1e-12
    )


# ------------------------------------------------------------------ gradients


@pytest.mark.parametrize("N, D", [(30, 5), (4, 7)], ids=["N>D", "N<D"])
@pytest.mark.parametrize("bias", [False, True])
def test_feature_gradient_matches_central_differences(N, D, bias):
    rng = np.random.default_rng(3)
    Z, Y = _features(rng, N, D), rng.standard_normal((N, 2))
    _, g = kstep_remaining_grad(Z, Y, steps=7, bias=bias)
    fd = central_diff(lambda z: kstep_remaining(z, Y, steps=7, bias=bias).remaining, Z, h=1e-5)
    assert rel_err(g, fd) < 1e-7


@pytest.mark.parametrize(
    "N, D, rank", [(40, 6, None), (5, 9, None), (40, 8, 3)], ids=["N>D", "N<D", "rank-deficient"]
)
@pytest.mark.parametrize("bias", [False, True])
def test_theta_gradient_matches_central_differences(N, D, rank, bias):
    """Through X's small side (KStepProbe), also for rank-deficient X, where every θ keeps the
    rank of Xθ (the gradient is that of E_k at fixed rank)."""
    rng = np.random.default_rng(4)
    X, Y = _features(rng, N, D, rank), rng.standard_normal((N, 2))
    probe = KStepProbe(X, Y, steps=6, bias=bias)
    theta = np.eye(D) + 0.3 * rng.standard_normal((D, D))
    fd = central_diff(
        lambda t: kstep_remaining(X @ t, Y, steps=6, bias=bias).remaining, theta, h=1e-5
    )
    assert rel_err(probe.theta_gradient(theta), fd) < 1e-7


@pytest.mark.parametrize(
    "N, D, constant_column",
    [(40, 6, False), (40, 6, True), (5, 9, False)],
    ids=["N>D", "1 in range(X)", "N<D"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_small_side_equals_the_full_probe(N, D, constant_column, bias):
    rng = np.random.default_rng(5)
    X, Y = _features(rng, N, D), rng.standard_normal((N, 3))
    if constant_column:
        X[:, 0] = 1.0
    probe = KStepProbe(X, Y, steps=10, bias=bias)
    for _ in range(3):
        theta = np.eye(D) + 0.5 * rng.standard_normal((D, D))
        assert probe.remaining(theta).remaining == pytest.approx(
            kstep_remaining(X @ theta, Y, steps=10, bias=bias).remaining, rel=1e-11
        )


def test_a_lambda_max_tie_warns():
    rng = np.random.default_rng(6)
    Z = with_spectrum([2.0, 2.0, 1.0], rng, shape=(10, 3))
    with pytest.warns(TieWarning):
        info, _ = kstep_remaining_grad(Z, rng.standard_normal(10), steps=3)
    assert info.tie_max
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kstep_remaining_grad(Z, rng.standard_normal(10), steps=3, warn_tie=False)
        assert not kstep_remaining_grad(_features(rng, 10, 3), rng.standard_normal(10))[0].tie_max


# ------------------------------------------------------------------ bad input


def test_bad_input_names_itself():
    rng = np.random.default_rng(7)
    Z = _features(rng, 10, 3)
    for kw, name in ((dict(steps=0), "steps"), (dict(steps=1.5), "steps")):
        with pytest.raises(ParameterError) as e:
            kstep_remaining(Z, np.ones(10), **kw)
        assert e.value.parameter == name
    with pytest.raises(ParameterError) as e:
        kstep_remaining(Z, np.ones(9))
    assert e.value.parameter == "Y"
    with pytest.raises(SpectrumError):  # the targets have no part the probe can learn
        U = orthogonal(10, rng)
        kstep_remaining(U[:, :3], U[:, 5])


# ------------------------------------------------------------------ the method


def _task(seed=0):
    """D_P and D_H whose label-carrying directions differ: the labels of D_H ride on its weak
    directions, those of D_P on its strong ones."""
    rng = np.random.default_rng(seed)
    D = 6
    X_P = rng.standard_normal((60, D)) * [3.0, 2.0, 1.0, 1.0, 0.5, 0.3]
    X_H = rng.standard_normal((50, D)) @ orthogonal(D, rng) * [2.0, 1.5, 1.0, 0.7, 0.5, 0.4]
    Y_P = X_P @ rng.standard_normal(D) + 0.1 * rng.standard_normal(60)
    Y_H = X_H @ rng.standard_normal(D) + 0.1 * rng.standard_normal(50)
    return LinearTask(X_P, Y_P, X_H, Y_H)


def test_kstep_is_a_method_outside_the_tables():
    assert not method_of("kstep").in_tables and "kstep" not in METHODS
    o = options_of("kstep")()
    assert (o.steps, o.bias, o.precond) == (10, False, "none")
    assert not o.draws_random


def test_kstep_raises_the_harmful_k_step_ratio_and_holds_the_pretraining_one():
    task = _task()
    res = immunize(task, "kstep", rng=np.random.default_rng(0), epochs=600)
    d = res.diagnostics
    # the reported ratios are those of the returned θ, recomputed from the features
    i_k = (
        kstep_remaining(task.X_H @ res.theta, task.Y_H).remaining
        / kstep_remaining(task.X_H, task.Y_H).remaining
    )
    ii_k = (
        kstep_remaining(task.X_P @ res.theta, task.Y_P).remaining
        / kstep_remaining(task.X_P, task.Y_P).remaining
    )
    assert d["kstep_harmful_ratio"] == pytest.approx(i_k, rel=1e-10)
    assert d["kstep_pretrain_ratio"] == pytest.approx(ii_k, rel=1e-10)
    assert i_k > 1.5 and ii_k <= 1.0
    assert "(i)_k" in res.reason and res.history["kstep_harmful_ratio"]
    # Definition 3.1(c): D_P's best loss is θ = I's, and ω is that best head
    best = best_probe_loss("mse", task.X_P, task.Y_P)
    assert best_probe_loss("mse", task.X_P @ res.theta, task.Y_P) == pytest.approx(best, rel=1e-8)
    got = float(np.mean((task.X_P @ res.theta @ res.omega - task.Y_P) ** 2))
    assert got == pytest.approx(best, rel=1e-8)
    # one run, whatever the seeds
    runs = immunize_batch(task, "kstep", rngs=[np.random.default_rng(s) for s in (0, 1)])
    np.testing.assert_array_equal(runs[0].theta, runs[1].theta)


def test_kstep_with_the_bias_column_optimises_the_biased_probe():
    task = _task(1)
    res = immunize(task, "kstep", rng=np.random.default_rng(0), epochs=300, bias=True)
    i_k = (
        kstep_remaining(task.X_H @ res.theta, task.Y_H, bias=True).remaining
        / kstep_remaining(task.X_H, task.Y_H, bias=True).remaining
    )
    assert res.diagnostics["kstep_harmful_ratio"] == pytest.approx(i_k, rel=1e-10)
    assert i_k > 1 and res.diagnostics["kstep_pretrain_ratio"] <= 1


@pytest.mark.parametrize(
    "options, parameter",
    [
        (dict(steps=0), "steps"),
        (dict(steps=2.5), "steps"),
        (dict(bias=1), "bias"),
        (dict(precond="exact"), "precond"),
        (dict(precond="nonsense"), "precond"),
        (dict(lr=0.0), "lr"),
        (dict(epochs=-1), "epochs"),
        (dict(patience=0), "patience"),
        (dict(lambda_h=1.0), "lambda_h"),
    ],
)
def test_kstep_options_name_themselves(options, parameter):
    with pytest.raises(ParameterError) as e:
        immunize(_task(), "kstep", rng=np.random.default_rng(0), **options)
    assert e.value.parameter == parameter


def test_targets_the_probe_cannot_see_name_their_task():
    rng = np.random.default_rng(8)
    U = orthogonal(12, rng)
    X_H = U[:, :3] @ rng.standard_normal((3, 4))  # rank 3; Y_H orthogonal to its range
    task = LinearTask(rng.standard_normal((20, 4)), rng.standard_normal(20), X_H, U[:, 7])
    with pytest.raises(ParameterError) as e:
        immunize(task, "kstep", rng=rng)
    assert e.value.parameter == "Y_H"


# ------------------------------------------------------------------ the deep twins


def test_kstep_layer_works_on_the_small_side_with_labels():
    rng = np.random.default_rng(9)
    D = 8
    X_P = rng.standard_normal((300, D)) * np.linspace(2.0, 0.5, D)
    X_H = rng.standard_normal((250, D)) @ orthogonal(D, rng) * np.linspace(2.0, 0.5, D)
    y_P = (X_P[:, 0] > 0).astype(int) + (X_P[:, 1] > 0)
    y_H = (X_H[:, -1] > 0).astype(int)
    sol = kstep_layer(X_P, y_P, X_H, y_H, epochs=300, patience=100)
    assert isinstance(sol, LayerSolution) and sol.theta.shape == (D, D)
    # the last k-step ratio the run kept is that of θ on all rows, one-hot targets, bias column
    onehot = lambda y: np.eye(y.max() + 1)[y]  # noqa: E731
    ratio = [
        kstep_remaining(X @ sol.theta, onehot(y), bias=True).remaining
        / kstep_remaining(X, onehot(y), bias=True).remaining
        for X, y in ((X_H, y_H), (X_P, y_P))
    ]
    assert ratio[0] > 1 and ratio[1] <= 1
    assert f"(i)_k = {ratio[0]:.4g}" in sol.reason
    with pytest.raises(ParameterError) as e:
        kstep_layer(X_P, y_P.astype(float), X_H, y_H, epochs=3, patience=3)
    assert e.value.parameter == "y_P"


@pytest.mark.parametrize(
    "N, D, rank", [(60, 8, None), (6, 12, None), (60, 8, 3)], ids=["N>D", "N<D", "rank-deficient"]
)
@pytest.mark.parametrize("bias", [True, False])
def test_torch_twin_equals_the_numpy_value_and_gradient(N, D, rank, bias):
    rng = np.random.default_rng(10)
    Z, y = _features(rng, N, D, rank), rng.integers(0, 3, N)
    Zt = torch.tensor(Z, requires_grad=True)
    E = kstep_loss(Zt, torch.as_tensor(y), steps=10, num_classes=3, bias=bias)
    E.backward()
    info, g = kstep_remaining_grad(Z, np.eye(3)[y], steps=10, bias=bias)
    assert abs(E.item() - info.remaining) <= 1e-10
    assert rel_err(Zt.grad.numpy(), g) < 1e-9
