"""Round-off: what the library does not amplify, and the tools that measure what varies across
BLAS kernels (docs/reproducibility.md)."""
from __future__ import annotations

import importlib.util
import json
import platform

import numpy as np
import pytest
import scipy.linalg

from pycore.precondition import Preconditioner, precondition, ridge_factor
from pycore.regularizers import hessian_regularizer
from tests import readme_check as rc
from tests.helpers import psd_with_spectrum

EPS = np.finfo(np.float64).eps


def _kernel_spread():
    spec = importlib.util.spec_from_file_location("kernel_spread", rc.ROOT / "scripts" / "kernel_spread.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rank_deficient_rows(rng, N=200, D=30, null=2):
    """Rows X (N×D) whose Gram matrix K = XᵀX has ``null`` exact-arithmetic null directions that are
    not coordinate axes (the strict protocol's X V_rV_rᵀ), and an orthonormal basis of them."""
    Q = np.linalg.qr(rng.standard_normal((D, D)))[0]
    A = rng.standard_normal((N, D - null)) * np.geomspace(30, 0.3, D - null)
    X = A @ Q[:, :D - null].T
    return X, Q[:, D - null:]


def _ridge_direction_and_null_part(precond, X, N_basis, theta):
    Z = X @ theta
    reg = hessian_regularizer(Z, "well", matrices=False)
    d = precond.direction(theta, reg, Z)
    return d, np.linalg.norm(N_basis.T @ d) / np.linalg.norm(d)


def test_ridge_step_is_zero_on_null_K_and_insensitive_to_one_ulp():
    """(K + λI)⁻¹K maps null(K) to 0.  A Cholesky solve of the formed K + λI (λ = 1e-7, the paper's)
    leaves a null(K) part of ~eps‖K‖/λ ≈ 1e-7 relative that a 1-ulp change of θ moves by as much;
    the eigen-form of ridge_factor does neither (docs/reproducibility.md)."""
    rng = np.random.default_rng(0)
    X, N_basis = _rank_deficient_rows(rng)
    K = X.T @ X
    theta = np.eye(X.shape[1]) + 0.1 * rng.standard_normal((X.shape[1],) * 2)
    theta_ulp = theta * (1 + rng.choice([-1.0, 1.0], size=theta.shape) * EPS)
    pre = Preconditioner(K, "ridge", 1e-7, X)
    d, null_part = _ridge_direction_and_null_part(pre, X, N_basis, theta)
    d2, _ = _ridge_direction_and_null_part(pre, X, N_basis, theta_ulp)
    assert null_part < 1e-13
    assert np.linalg.norm(d2 - d) / np.linalg.norm(d) < 1e-11
    # the Cholesky solve it replaces, on the same input: the null part is round-off divided by λ
    cf = scipy.linalg.cho_factor(K + 1e-7 * np.eye(K.shape[0]))
    G = hessian_regularizer(X @ theta, "well").G
    M = theta @ G
    chol = 2.0 * scipy.linalg.cho_solve(cf, K @ M)
    assert np.linalg.norm(N_basis.T @ chol) / np.linalg.norm(chol) > 1e-10
    # and it is the same operator on range(K): agreement to the solve's own accuracy there
    R = np.linalg.svd(X, full_matrices=False)[2][:-2].T
    for new in (pre.apply_theta_G(M), precondition(theta, G, K, "ridge", 1e-7)):
        assert np.linalg.norm(R.T @ (chol - new)) < 1e-8 * np.linalg.norm(chol)


def test_ridge_factor_equals_the_ridge_solve_on_full_rank_K():
    rng = np.random.default_rng(1)
    D = 12
    K = psd_with_spectrum(np.geomspace(1e3, 1e-2, D), rng)
    M = rng.standard_normal((D, D))
    for lam in (1e-7, 0.5):
        Q, f = ridge_factor(K, lam)
        assert Q.shape == (D, D)
        got = Q @ (f[:, None] * (Q.T @ M))
        want = np.linalg.solve(K + lam * np.eye(D), K @ M)
        assert np.linalg.norm(got - want) <= 1e-10 * np.linalg.norm(want)
    # through rows X with N < D: the same factor from the SVD of X
    X = rng.standard_normal((5, D))
    Qx, fx = ridge_factor(X.T @ X, 1e-3, X)
    Qk, fk = ridge_factor(X.T @ X, 1e-3)
    assert Qx.shape == Qk.shape == (D, 5)
    np.testing.assert_allclose(Qx @ (fx[:, None] * Qx.T), Qk @ (fk[:, None] * Qk.T), atol=1e-12)


# ---------------------------------------------------------------- the kernel-spread tool

def test_stable_tables_written_into_documents(tmp_path):
    ks = _kernel_spread()
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "results.md"
    doc.write_text("text\n<!-- readme-check: python experiments/x.py -->\n"
                   "| method | RIR ↑ | Def. 3.1 seeds |\n|---|---|---|\n"
                   "| **Opt κ** | 2.218 ± 1.1 | 0/5 |\n| Identity | 1 ± 0 | 0/5 |\nafter\n", encoding="utf-8")
    header = ["method", "RIR ↑", "Def. 3.1 seeds", "paper RIR"]
    runs = [{"kernel": k, "architecture": k, "header": header,
             "rows": {"Opt κ": ["Opt κ", rir, "0/5", "92.58"], "Identity": ["Identity", "1 ± 0", "0/5", "—"]}}
            for k, rir in (("A", "2.218 ± 1.1"), ("B", "16.05 ± 28"), ("C", "5.17 ± 7.0"))]
    spread = {"kernels": [], "commands": {"python experiments/x.py": {"runs": runs}}}
    assert ks.tables(spread, apply=True, root=tmp_path) == 0
    lines = doc.read_text(encoding="utf-8").splitlines()
    assert lines[4] == "| **Opt κ** | 2.218…16.05 | 0/5 |" and lines[5] == "| Identity | 1 ± 0 | 0/5 |"
    assert lines[0] == "text" and lines[-1] == "after"
    documented = rc.parse_table(lines, 2)
    for run in runs:
        assert rc.compare_tables(documented, (header, run["rows"]),
                                 rc.measured_cells(spread, "python experiments/x.py")) == []
    md = ks.spread_markdown({"kernels": [{"kernel": k, "architecture": k} for k in "ABC"], **spread})
    assert "1 of 6 cells move" in md
    assert "| Opt κ | RIR ↑ | 2.218 ± 1.1 | 16.05 ± 28 | 5.17 ± 7.0 | 2.218…16.05 |" in md


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="the OpenBLAS kernel types are x86 ones")
def test_ci_kernels_change_the_blas_kernel():
    """The kernel types .ci/run picks run other code than the native one (read back by threadpoolctl)."""
    ks = _kernel_spread()
    picked = ks.ci_kernels(2)
    if not picked:
        pytest.skip("NumPy's BLAS ignores OPENBLAS_CORETYPE here (not a DYNAMIC_ARCH OpenBLAS)")
    native = ks.architecture(ks.probe("native"))
    archs = [ks.architecture(ks.probe(k)) for k in picked]
    assert native not in archs and len(set(archs)) == len(archs)


def test_spread_file_records_how_it_was_made():
    spread = json.loads(rc.SPREAD_FILE.read_text(encoding="utf-8"))
    assert spread["tool"] == "python scripts/kernel_spread.py" and spread["threads"] == 1
    assert {"numpy", "scipy", "python"} <= set(spread["versions"])
    native = [k for k in spread["kernels"] if k["kernel"] == "native"]
    assert len(native) == 1 and native[0]["OPENBLAS_CORETYPE"] is None
    for rec in spread["commands"].values():
        assert all(r["header"][0] == "method" and r["rows"] for r in rec["runs"])


def test_eigenvectors_are_zero_on_identically_zero_features():
    """A feature that is identically zero (an input column constant on the split, at θ = I) puts e_j
    in null(H): every eigenvector of a nonzero eigenvalue has v_j = 0 exactly.  With LAPACK's
    round-off there instead, Opt κ's gradient had entries of pure round-off (House Prices, paper
    protocol: θ[Utilities, ·] ~1e-6 with either sign) and Adam's first step moved them by ±lr,
    a difference of 2·lr between BLAS kernels (docs/reproducibility.md §3)."""
    from pycore.methods import opt_kappa_objective

    rng = np.random.default_rng(3)
    N, D, dead = 60, 12, [2, 7]
    X_P, X_H = rng.standard_normal((N, D)), rng.standard_normal((N, D)) * np.geomspace(1, 1e-3, D)
    X_P[:, [4]] = 0.0                 # dead in D_P only: the κ_P gradient's rows there are exact zeros
    X_H[:, dead] = 0.0
    reg = hessian_regularizer(X_H, "well", matrices=False)
    k = reg.info.rank
    for v in (reg.vector(0), reg.vector(k - 1), reg.vector(3)):
        assert np.all(v[dead] == 0.0) and abs(np.linalg.norm(v) - 1) < 1e-14
    # the κ gradient: entries whose exact value is 0 (rows dead in D_P, columns dead in D_H) are 0
    _, g, _ = opt_kappa_objective(np.eye(D), X_P, X_H)
    assert np.all(g[4, dead] == 0.0)
