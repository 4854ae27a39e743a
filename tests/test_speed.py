"""The speed-ups of the linear core compute what the plain formulations compute (docs/performance.md).

Each faster formulation is checked against the plain one it replaced: bit for bit where it makes
the same floating-point operations (shared tridiagonal reduction, in-place Adam, cached evaluation
constants), to round-off where it reassociates products (low-rank IMMA gradient, range/null
features, κ from the R factor), with the κ = 1e14 accuracy check of docs/theory.md §2.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from pycore import losses
from pycore.evaluate import EvaluationReference, evaluate_linear
from pycore.immunize import IMMAOptions, immunize
from pycore.methods import imma_inner_step_size, imma_objective
from pycore.metrics import range_null_split, rir, rir_ceiling
from pycore.optim import Adam, all_finite
from pycore.regularizers import hessian_regularizer
from pycore.spectral import ProductGramSpectrum, SymmetricEigen, gram_spectrum
from pycore.tasks import LinearTask


def _evr(H, j=None):
    if j is None:
        return scipy.linalg.eigh(H, eigvals_only=True, driver="evr", check_finite=False)
    return scipy.linalg.eigh(H, subset_by_index=[j, j], driver="evr", check_finite=False)[1][:, 0]


def _blas_architectures() -> set:
    import threadpoolctl
    return {i.get("architecture") for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"}


# OpenBLAS's Sandybridge kernels round the tridiagonal reduction differently when an array is
# 8 but not 16 bytes aligned (measured: dsytrd of one matrix gives two different tridiagonals over
# the 8-byte offsets of its copy, one for every other kernel type).  dsyevr hands dsytrd a
# workspace at an offset of 5n doubles inside its own, which SymmetricEigen's f2py call cannot
# reproduce: under those kernels the two agree to round-off, not bit for bit.  NumPy's own arrays
# are 16-byte aligned, so the same command still prints the same digits there.
ALIGNMENT_DEPENDENT_KERNELS = "Sandybridge" in _blas_architectures()


def _assert_same_values(values, H):
    want = _evr(H)
    if not ALIGNMENT_DEPENDENT_KERNELS:
        assert np.array_equal(values, want)
    else:  # backward stable: |Δλ| ≤ c·n·eps·‖H‖
        n = H.shape[0]
        assert np.max(np.abs(values - want)) <= 8 * n * np.finfo(float).eps * np.max(np.abs(want))


def _assert_same_vector(v, H, j):
    if not ALIGNMENT_DEPENDENT_KERNELS:
        assert np.array_equal(v, _evr(H, j))
    else:  # an eigenvector of the j-th eigenvalue: unit norm and a residual at round-off
        n, eps, w = H.shape[0], np.finfo(float).eps, _evr(H)
        assert abs(np.linalg.norm(v) - 1.0) <= 8 * n * eps
        assert np.linalg.norm(H @ v - w[j] * v) <= 8 * n * eps * np.max(np.abs(w))


@pytest.mark.parametrize("seed", range(4))
def test_symmetric_eigen_is_bitwise_the_separate_evr_calls(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        n, N = int(rng.integers(2, 140)), int(rng.integers(1, 260))
        Z = rng.standard_normal((N, n)) * np.exp(rng.normal(0.0, 3.0, n))   # spread scales, rank ≤ N
        H = Z.T @ Z
        eig = SymmetricEigen(H)
        _assert_same_values(eig.values, H)
        for j in {0, n - 1, int(rng.integers(0, n))}:
            _assert_same_vector(eig.vector(j), H, j)


def test_symmetric_eigen_falls_back_where_dsyevr_rescales():
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((30, 12))
    for scale in (1e90, 1e-160):
        H = (Z.T @ Z) * scale
        eig = SymmetricEigen(H)
        assert eig._c is None   # scipy's own path
        assert np.array_equal(eig.values, _evr(H))
        assert np.array_equal(eig.vector(11), _evr(H, 11))
    one = SymmetricEigen(np.array([[3.0]]))
    assert one.values.tolist() == [3.0] and abs(one.vector(0)[0]) == 1.0


def test_hessian_regularizer_vectors_are_the_evr_vectors():
    rng = np.random.default_rng(1)
    Z = rng.standard_normal((200, 79)) @ np.diag(np.exp(rng.normal(0, 2, 79)))
    H = Z.T @ Z
    reg = hessian_regularizer(Z, "well")
    for i in (0, 1, 78):
        _assert_same_vector(reg.vector(i), H, 78 - i)


@pytest.mark.parametrize("shape", [(200, 79), (60, 79), (79, 79)])
def test_product_gram_spectrum_matches_svd_of_features(shape):
    rng = np.random.default_rng(2)
    X = rng.standard_normal(shape)
    spec = ProductGramSpectrum(X)
    for _ in range(5):
        theta = np.eye(79) + 0.3 * rng.standard_normal((79, 79))
        a, b = spec(theta), gram_spectrum(X @ theta, vectors=False)
        assert a.rank == b.rank
        np.testing.assert_allclose(a.sigma, b.sigma, rtol=1e-10, atol=1e-12 * b.sigma[0])
        assert a.kappa == pytest.approx(b.kappa, rel=1e-10)


def test_product_gram_spectrum_keeps_kappa_1e14():
    # docs/theory.md §2: κ(H) = 1e14 must come out right (eigvalsh(ZᵀZ) would lose λ_min here).
    rng = np.random.default_rng(3)
    U, _ = np.linalg.qr(rng.standard_normal((300, 40)))
    V, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    s = np.logspace(0, -7, 40)                      # κ(Z) = 1e7, κ(ZᵀZ) = 1e14
    X = (U * s) @ V.T
    W, _ = np.linalg.qr(rng.standard_normal((40, 40)))  # an orthogonal θ keeps κ
    assert ProductGramSpectrum(X)(W).kappa == pytest.approx(1e14, rel=1e-6)
    assert gram_spectrum(X @ W, vectors=False).kappa == pytest.approx(1e14, rel=1e-6)


def _tasks(rng, D=30, n=(50, 60), heldout=(40, 70), rank_P=None):
    def rows(N, r=None):
        X = rng.standard_normal((N, D))
        if r is not None:
            X[:, r:] = 0.0   # columns D_P never varies in: null(K_P) ≠ {0}
        return X
    t = LinearTask(rows(n[0], rank_P), rng.standard_normal(n[0]), rows(n[1]), rng.standard_normal(n[1]))
    h = LinearTask(rows(heldout[0]), rng.standard_normal(heldout[0]), rows(heldout[1]),
                   rng.standard_normal(heldout[1]))
    return t, h


def test_evaluation_reference_matches_metrics():
    rng = np.random.default_rng(4)
    train, held = _tasks(rng, rank_P=24)            # null(K_P) of dimension 6
    theta = np.eye(30) + 0.2 * rng.standard_normal((30, 30))
    ref = EvaluationReference(train, held)
    for rows, task in (("train", train), ("heldout", held)):
        f = ref.features(theta, rows)
        r = ref.rir(f[("theta", "P")], f[("theta", "H")], rows)
        assert r == rir(theta, task.X_P, task.X_H)   # the same arithmetic, bit for bit
        t_range, t_null = range_null_split(theta, train.X_P)
        for part, th in (("range", t_range), ("null", t_null)):
            np.testing.assert_allclose(f[(part, "P")], task.X_P @ th, atol=1e-12)
            np.testing.assert_allclose(f[(part, "H")], task.X_H @ th, atol=1e-12)
            got = ref.rir(f[(part, "P")], f[(part, "H")], rows).value
            assert got == pytest.approx(rir(th, task.X_P, task.X_H).value, rel=1e-9)
    e = evaluate_linear(theta, train, held, ceiling=rir_ceiling(train.X_P, train.X_H), reference=ref)
    assert e == evaluate_linear(theta, train, held, ceiling=rir_ceiling(train.X_P, train.X_H))
    _, t_null = range_null_split(theta, train.X_P)
    eye = np.eye(30)
    assert e["null_part_fraction"] == pytest.approx(np.sum((t_null - eye) ** 2) / np.sum((theta - eye) ** 2),
                                                    rel=1e-12)


def test_adam_in_place_is_bitwise_the_plain_update():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 40))
    opt = Adam(0.01)
    m = v = np.zeros_like(x)
    y = x.copy()
    for t in range(1, 30):
        g = rng.standard_normal((40, 40)) * 10.0 ** rng.integers(-12, 4)
        m = 0.9 * m + (1 - 0.9) * g
        v = 0.999 * v + (1 - 0.999) * (g * g)
        y = y - 0.01 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        x = opt.step(x, g)
        assert np.array_equal(x, y)


def test_all_finite():
    a = np.ones(1000)
    assert all_finite(a)
    assert all_finite(np.full(10, 1e308))            # the sum overflows, the entries are finite
    for bad in (np.inf, -np.inf, np.nan):
        b = a.copy()
        b[517] = bad
        assert not all_finite(b)


def _imma_unrolled(theta, w, omega, task, cfg, bias=None, batch_P=None):
    """The dense unrolled form: every attacker step and adjoint step as a D×D matrix."""
    n = task.Y_H.size
    c = imma_inner_step_size(task, w, cfg) * 2.0 / n
    B = (task.X_H.T @ task.Y_H) @ w.T
    th = theta
    for _ in range(cfg.inner_steps):
        th = th - c * ((task.K_H @ (th @ w)) @ w.T - B)
    lh, _, g_h = losses.mse(task.X_H, th, w, task.Y_H)
    X_P, Y_P = (task.X_P, task.Y_P) if batch_P is None else batch_P
    if task.loss == "mse":
        lp, _, g_p = losses.mse(X_P, th, omega, Y_P)
    else:
        lp, _, g_p, _ = losses.bce(X_P, th, omega, Y_P, 0.0 if bias is None else bias)
    G = g_h - g_p
    for _ in range(cfg.inner_steps):
        G = G - c * ((task.K_H @ (G @ w)) @ w.T)
    return lh - lp, G


@pytest.mark.parametrize("loss", ["mse", "bce"])
def test_imma_low_rank_objective_equals_unrolled(loss):
    rng = np.random.default_rng(6)
    D = 25
    X_P, X_H = rng.standard_normal((40, D)), rng.standard_normal((35, D))
    Y_P = (rng.random(40) > 0.5).astype(float) if loss == "bce" else rng.standard_normal(40)
    task = LinearTask(X_P, Y_P, X_H, rng.standard_normal(35), loss)
    theta = np.eye(D) + 0.1 * rng.standard_normal((D, D))
    w, omega = rng.standard_normal((D, 1)), rng.standard_normal((D, 1))
    for steps in (0, 1, 3):
        cfg = IMMAOptions(inner_steps=steps)
        F, G = imma_objective(theta, w, omega, task, cfg, bias=np.array([0.3]))
        F0, G0 = _imma_unrolled(theta, w, omega, task, cfg, bias=np.array([0.3]))
        assert F == pytest.approx(F0, rel=1e-12, abs=1e-12)
        np.testing.assert_allclose(G, G0, rtol=1e-11, atol=1e-13 * np.max(np.abs(G0)))


def test_head_losses_skip_only_the_theta_gradient():
    rng = np.random.default_rng(7)
    X, th, om = rng.standard_normal((20, 6)), rng.standard_normal((6, 6)), rng.standard_normal((6, 1))
    y = rng.standard_normal((20, 1))
    full, head = losses.mse(X, th, om, y), losses.mse(X, th, om, y, grad_theta=False)
    assert head[0] == full[0] and np.array_equal(head[1], full[1]) and head[2] is None
    yb = (rng.random((20, 1)) > 0.5).astype(float)
    full, head = losses.bce(X, th, om, yb, 0.1), losses.bce(X, th, om, yb, 0.1, grad_theta=False)
    assert head[0] == full[0] and np.array_equal(head[1], full[1]) and head[2] is None
    assert np.array_equal(head[3], full[3])


def test_imma_run_matches_unrolled_objective_to_round_off(monkeypatch):
    """A whole IMMA run with the low-rank objective stays within round-off of the dense one."""
    import pycore.methods as imm

    rng = np.random.default_rng(8)
    task, _ = _tasks(rng)
    fast = immunize(task, "imma", rng=np.random.default_rng(0), epochs=5).theta
    monkeypatch.setattr(imm, "imma_objective", _imma_unrolled)
    slow = immunize(task, "imma", rng=np.random.default_rng(0), epochs=5).theta
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12 * np.max(np.abs(slow)))
