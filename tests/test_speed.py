"""The spectral speed-ups compute what the plain formulations compute: the shared tridiagonal
reduction bit for bit (same LAPACK calls), κ from the R factor to round-off, with the κ = 1e14
accuracy check of docs/theory.md §2."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import threadpoolctl

from pycore._spectral import ProductGramSpectrum, SymmetricEigen, gram_spectrum
from pycore._threads import blas_threads
from pycore.linalg import hessian_regularizer


@pytest.fixture(autouse=True)
def one_blas_thread():
    with blas_threads(1):  # the library's own rule at these sizes (docs/design.md §5)
        yield


def _evr(H, j=None):
    if j is None:
        return scipy.linalg.eigh(H, eigvals_only=True, driver="evr", check_finite=False)
    return scipy.linalg.eigh(H, subset_by_index=[j, j], driver="evr", check_finite=False)[1][:, 0]


# OpenBLAS's Sandybridge kernels round dsytrd differently on 8- but not 16-byte aligned arrays, and
# dsyevr's workspace offset (5n doubles) cannot be reproduced through f2py: there the two agree to
# round-off, not bit for bit (NumPy's arrays are 16-byte aligned: the same command, the same
# digits).
ALIGNMENT_DEPENDENT_KERNELS = any(
    i.get("architecture") == "Sandybridge" for i in threadpoolctl.threadpool_info()
)


def _assert_same_values(values, H):
    want = _evr(H)  # where not bitwise: backward stable, |Δλ| ≤ c·n·eps·‖H‖
    assert (
        np.array_equal(values, want)
        or ALIGNMENT_DEPENDENT_KERNELS
        and np.max(np.abs(values - want))
        <= 8 * H.shape[0] * np.finfo(float).eps * np.max(np.abs(want))
    )


def _assert_same_vector(v, H, j):
    tol, w = 8 * H.shape[0] * np.finfo(float).eps, _evr(H)  # where not bitwise: a unit eigenvector
    assert (
        np.array_equal(v, _evr(H, j))
        or ALIGNMENT_DEPENDENT_KERNELS
        and abs(np.linalg.norm(v) - 1) <= tol
        and np.linalg.norm(H @ v - w[j] * v) <= tol * np.max(np.abs(w))
    )


@pytest.mark.parametrize("seed", range(4))
def test_symmetric_eigen_is_bitwise_the_separate_evr_calls(seed):
    rng = np.random.default_rng(seed)
    for _ in range(25):
        n, N = int(rng.integers(2, 140)), int(rng.integers(1, 260))
        # spread scales, rank ≤ N
        Z = rng.standard_normal((N, n)) * np.exp(rng.normal(0.0, 3.0, n))
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
        assert eig._c is None  # scipy's own path
        assert np.array_equal(eig.values, _evr(H))
        assert np.array_equal(eig.vector(11), _evr(H, 11))
    one = SymmetricEigen(np.array([[3.0]]))
    assert one.values.tolist() == [3.0] and abs(one.vector(0)[0]) == 1.0


def test_hessian_regularizer_vectors_are_the_evr_vectors():
    rng = np.random.default_rng(1)
    Z = rng.standard_normal((200, 79)) @ np.diag(np.exp(rng.normal(0, 2, 79)))
    reg = hessian_regularizer(Z, "well")
    for i in (0, 1, 78):
        _assert_same_vector(reg.vector(i), Z.T @ Z, 78 - i)


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
    U, V, W = (
        np.linalg.qr(rng.standard_normal(shape))[0] for shape in ((300, 40), (40, 40), (40, 40))
    )
    X = (U * np.logspace(0, -7, 40)) @ V.T  # κ(Z) = 1e7, κ(ZᵀZ) = 1e14; orthogonal W keeps κ
    assert ProductGramSpectrum(X)(W).kappa == pytest.approx(1e14, rel=1e-6)
    assert gram_spectrum(X @ W, vectors=False).kappa == pytest.approx(1e14, rel=1e-6)
