"""Round-off the library does not amplify (docs/design.md §7): the ridge step is exactly zero on
null(K), and eigenvectors are exactly zero on identically zero features."""

from __future__ import annotations

import numpy as np
import scipy.linalg

from pycore._opt_kappa import opt_kappa_objective
from pycore._precondition import Preconditioner, ridge_factor
from pycore.linalg import hessian_regularizer
from tests.helpers import psd_with_spectrum

EPS = np.finfo(np.float64).eps


def test_ridge_step_is_zero_on_null_K_and_insensitive_to_one_ulp():
    """(K + λI)⁻¹K maps null(K) to 0.  A Cholesky solve of the formed K + λI (λ = 1e-7, the
    paper's) leaves a null(K) part of ~eps‖K‖/λ that a 1-ulp change of θ moves as much; the
    eigen-form does not."""
    rng = np.random.default_rng(0)
    N, D = 200, 30
    # null(K) = span(Q[:, 28:]), not coordinate axes
    Q = np.linalg.qr(rng.standard_normal((D, D)))[0]
    X = (rng.standard_normal((N, D - 2)) * np.geomspace(30, 0.3, D - 2)) @ Q[:, : D - 2].T
    K, null = X.T @ X, Q[:, D - 2 :]
    theta = np.eye(D) + 0.1 * rng.standard_normal((D, D))
    pre = Preconditioner(K, "ridge", 1e-7, X)
    d, d_ulp = (
        pre.direction(th, hessian_regularizer(X @ th, "well", matrices=False), X @ th)
        for th in (theta, theta * (1 + rng.choice([-1.0, 1.0], size=theta.shape) * EPS))
    )
    assert np.linalg.norm(null.T @ d) < 1e-13 * np.linalg.norm(d)
    assert np.linalg.norm(d_ulp - d) < 1e-11 * np.linalg.norm(d)
    chol = 2.0 * scipy.linalg.cho_solve(
        scipy.linalg.cho_factor(K + 1e-7 * np.eye(D)),
        K @ theta @ hessian_regularizer(X @ theta, "well").G,
    )
    assert np.linalg.norm(null.T @ chol) > 1e-10 * np.linalg.norm(chol)  # what it replaced
    R = np.linalg.svd(X, full_matrices=False)[2][:-2].T  # range(K): the same operator
    assert np.linalg.norm(R.T @ (chol - d)) < 1e-8 * np.linalg.norm(chol)


def test_ridge_factor_equals_the_ridge_solve():
    rng = np.random.default_rng(1)
    K, M = psd_with_spectrum(np.geomspace(1e3, 1e-2, 12), rng), rng.standard_normal((12, 12))
    for lam in (1e-7, 0.5):
        Q, f = ridge_factor(K, lam)
        want = np.linalg.solve(K + lam * np.eye(12), K @ M)
        assert np.linalg.norm(Q @ (f[:, None] * (Q.T @ M)) - want) <= 1e-10 * np.linalg.norm(want)
    X = rng.standard_normal((5, 12))  # N < D: the same factor from the SVD of X
    (Qx, fx), (Qk, fk) = ridge_factor(X.T @ X, 1e-3, X), ridge_factor(X.T @ X, 1e-3)
    assert Qx.shape == Qk.shape == (12, 5)
    np.testing.assert_allclose(Qx @ (fx[:, None] * Qx.T), Qk @ (fk[:, None] * Qk.T), atol=1e-12)


def test_eigenvectors_are_zero_on_identically_zero_features():
    """A zero feature puts e_j in null(H): every eigenvector of a nonzero eigenvalue has v_j = 0.
    LAPACK's ~1e-17 there once became ±lr Adam steps of kernel-dependent sign (Opt κ, House
    Prices)."""
    rng = np.random.default_rng(3)
    X_P, X_H = (
        rng.standard_normal((60, 12)),
        rng.standard_normal((60, 12)) * np.geomspace(1, 1e-3, 12),
    )
    X_P[:, 4] = 0.0
    X_H[:, [2, 7]] = 0.0
    reg = hessian_regularizer(X_H, "well", matrices=False)
    for v in (reg.vector(0), reg.vector(reg.info.rank - 1), reg.vector(3)):
        assert np.all(v[[2, 7]] == 0.0) and abs(np.linalg.norm(v) - 1) < 1e-14
    _, g, _ = opt_kappa_objective(np.eye(12), X_P, X_H)
    assert np.all(g[4, [2, 7]] == 0.0)  # rows dead in D_P, columns dead in D_H: exact zeros
