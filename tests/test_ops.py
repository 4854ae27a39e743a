"""Tests of the fused condition-number regularizer op and the immunization head (pycore.ops).

Ground truth is the float64 NumPy core (pycore.regularizers) and the plain-PyTorch reference.
Layout after pytorch/extension-cpp's test_extension.py: a ``sample_inputs`` helper, opcheck over
every sample, CUDA tests skipped without a GPU.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.library import opcheck

from pycore import ops
from pycore import regularizers as core

ROOT = Path(__file__).resolve().parents[1]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SHAPES = [(12, 30), (40, 9)]  # Gram path (N < D) and covariance path (N ≥ D)


def features(N, D, *, seed, cond=30.0, dtype=torch.float64, requires_grad=False):
    """Z = U diag(s) Vᵀ with singular values spread over [1, sqrt(cond)] (κ(ZᵀZ) = cond)."""
    rng = np.random.default_rng(seed)
    r = min(N, D)
    U, _ = np.linalg.qr(rng.standard_normal((N, r)))
    V, _ = np.linalg.qr(rng.standard_normal((D, r)))
    s = np.sqrt(np.geomspace(cond, 1.0, r)) * (1.0 + 0.05 * rng.random(r))
    Z = torch.tensor((U * s) @ V.T, dtype=dtype)
    return Z.requires_grad_(requires_grad)


def sample_inputs(device="cpu"):
    out = []
    for seed, (N, D) in enumerate(SHAPES):
        for dtype in (torch.float32, torch.float64):
            for kind in ops.KINDS:
                for rg in (False, True):
                    Z = features(N, D, seed=seed, dtype=dtype).to(device).requires_grad_(rg)
                    out.append((Z, kind, None, None, rg))
    return out


def value_and_grad(fn, Z, kind):
    Z = Z.detach().clone().requires_grad_(True)
    v = fn(Z, kind)
    (g,) = torch.autograd.grad(v, Z)
    return v.detach(), g


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ------------------------------------------------------------------------------------------
# The op contract
# ------------------------------------------------------------------------------------------

def test_extension_is_built():
    # CI builds the CPU op; a silently missing build would test only the fallback.
    assert ops.extension_available(), "pycore._C is not built: run `python setup.py build_ext --inplace`"


@pytest.mark.parametrize("args", sample_inputs(),
                         ids=lambda a: f"{tuple(a[0].shape)}-{a[0].dtype}-{a[1]}-grad{a[4]}")
def test_opcheck_cond_reg(args):
    opcheck(torch.ops.pycore.cond_reg.default, args)


@pytest.mark.parametrize("N,D,bias,pre", [(6, 10, False, True), (15, 7, True, True), (15, 7, True, False)])
def test_opcheck_precond_linear(N, D, bias, pre):
    X = features(N, D, seed=3, requires_grad=True)
    W = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True) if bias else None
    opcheck(torch.ops.pycore.precond_linear.default, (X, W, b, 1e-3, pre))
    G = torch.randn(N, 5, dtype=torch.float64)
    opcheck(torch.ops.pycore.precond_linear_backward.default,
            (G, X.detach(), W.detach(), 1e-3, pre, True, True))


@pytest.mark.parametrize("kind", ops.KINDS)
@pytest.mark.parametrize("N,D", SHAPES)
def test_gradcheck_float64(kind, N, D):
    Z = features(N, D, seed=5, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: ops.cond_regularizer(z, kind), (Z,))


def test_gradcheck_head_without_preconditioning():
    X = features(7, 5, seed=1, requires_grad=True)
    W = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, bb: ops.precond_linear(x, w, bb, 1e-3, False), (X, W, b))


# ------------------------------------------------------------------------------------------
# Agreement with the NumPy core (float64 ground truth) and with the autograd reference
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ops.KINDS)
@pytest.mark.parametrize("N,D", SHAPES + [(64, 96), (200, 48)])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_numpy_core(kind, N, D, seed):
    Z = features(N, D, seed=seed + 10, cond=1e3)
    H = (Z.T @ Z).numpy()
    r_np = core.r_ill(H) if kind == "ill" else core.r_well(H)
    G_np = core.r_ill_grad(H) if kind == "ill" else core.r_well_grad(H)
    v, g = value_and_grad(ops.cond_regularizer, Z, kind)
    assert abs(v.item() - r_np) <= 1e-10 * abs(r_np)
    assert rel(g, 2.0 * Z.numpy() @ G_np) <= 1e-10  # dR/dZ = 2 Z ∇_H R (docs/theory.md §4)


@pytest.mark.parametrize("kind", ops.KINDS)
@pytest.mark.parametrize("N,D", [(64, 512), (256, 512), (100, 768), (256, 768), (2048, 512)])
def test_matches_numpy_core_at_benchmark_shapes(kind, N, D):
    Z = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(N + D))
    H = (Z.T @ Z).numpy()
    r_np = core.r_ill(H) if kind == "ill" else core.r_well(H)
    G_np = core.r_ill_grad(H) if kind == "ill" else core.r_well_grad(H)
    v, g = value_and_grad(ops.cond_regularizer, Z, kind)
    assert abs(v.item() - r_np) <= 1e-10 * abs(r_np)
    assert rel(g, 2.0 * Z.numpy() @ G_np) <= 1e-10


@pytest.mark.parametrize("kind", ops.KINDS)
def test_rank_deficient_matches_numpy_core(kind):
    # A zero feature column (dead unit) and N ≥ D: k = D − 1, σ_k is interior -> eigh fallback path.
    Z = features(50, 12, seed=2, cond=50.0)
    Z[:, 4] = 0.0
    H = (Z.T @ Z).numpy()
    v, d = ops.cond_regularizer_with_diagnostics(Z, kind)
    assert d.rank == 11
    _, g = value_and_grad(ops.cond_regularizer, Z, kind)
    r_np = core.r_ill(H) if kind == "ill" else core.r_well(H)
    G_np = core.r_ill_grad(H) if kind == "ill" else core.r_well_grad(H)
    assert abs(v.item() - r_np) <= 1e-10 * abs(r_np)
    assert rel(g, 2.0 * Z.numpy() @ G_np) <= 1e-10


@pytest.mark.parametrize("kind", ops.KINDS)
@pytest.mark.parametrize("N,D", SHAPES)
def test_matches_autograd_reference(kind, N, D):
    Z = features(N, D, seed=7)
    v, g = value_and_grad(ops.cond_regularizer, Z, kind)
    vr, gr = value_and_grad(ops.reference_cond_regularizer, Z, kind)
    assert abs(v.item() - vr.item()) <= 1e-11 * abs(vr.item())
    assert rel(g, gr) <= 1e-9


@pytest.mark.skipif(not ops.extension_available(), reason="the fallback always uses eigh")
@pytest.mark.parametrize("kind", ops.KINDS)
def test_inverse_iteration_matches_full_eigh(kind):
    # The default eigenvector comes from shifted inverse iteration; a huge tie_rtol flags a tie
    # and forces the full-eigh path: both must give the same gradient.
    Z = features(30, 70, seed=4, cond=1e4, requires_grad=True)
    fast, d_fast = ops.cond_regularizer_with_diagnostics(Z, kind)
    slow, d_slow = ops.cond_regularizer_with_diagnostics(Z, kind, tie_rtol=10.0, warn=False)
    assert (d_fast.eigvec_method, d_slow.eigvec_method) == ("inverse_iteration", "eigh")
    (g_fast,) = torch.autograd.grad(fast, Z)
    (g_slow,) = torch.autograd.grad(slow, Z)
    assert rel(g_fast, g_slow) <= 1e-12


@pytest.mark.parametrize("kind", ops.KINDS)
@pytest.mark.parametrize("N,D", [(64, 160), (300, 40)])
def test_float32_error_at_most_twice_reference(kind, N, D):
    # flash-attention's criterion: error vs a float64 truth ≤ 2x the plain float32 implementation's.
    Z64 = features(N, D, seed=8, cond=1e3)
    Z32 = Z64.float()
    truth_v, truth_g = value_and_grad(ops.cond_regularizer, Z32.double(), kind)
    for fn in (ops.cond_regularizer, ops.reference_cond_regularizer):
        v, g = value_and_grad(fn, Z32, kind)
        err = (abs(v.double().item() - truth_v.item()) / abs(truth_v.item()), rel(g.double(), truth_g))
        if fn is ops.cond_regularizer:
            ours = err
        else:
            theirs = err
    assert ours[0] <= 2.0 * theirs[0] + 1e-7 and ours[1] <= 2.0 * theirs[1] + 1e-7, (ours, theirs)


# ------------------------------------------------------------------------------------------
# Ties, degenerate inputs, bad inputs
# ------------------------------------------------------------------------------------------

def _with_spectrum(eigs_h, N=20, seed=0):
    rng = np.random.default_rng(seed)
    D = len(eigs_h)
    U, _ = np.linalg.qr(rng.standard_normal((N, D)))
    V, _ = np.linalg.qr(rng.standard_normal((D, D)))
    return torch.tensor((U * np.sqrt(eigs_h)) @ V.T)


@pytest.mark.parametrize("kind,eigs", [("well", [5.0, 5.0, 2.0, 1.0]), ("ill", [5.0, 3.0, 1.0, 1.0])])
def test_tie_is_flagged_and_warned(kind, eigs):
    Z = _with_spectrum(eigs).requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="repeated"):
        v, d = ops.cond_regularizer_with_diagnostics(Z, kind)
    assert d.tie and d.eigengap < 1e-10 and d.eigvec_method == "eigh"
    (g,) = torch.autograd.grad(v, Z)
    assert torch.isfinite(g).all()  # a subgradient, not NaN (unlike autograd through eigh)
    # no tie one step away
    _, d2 = ops.cond_regularizer_with_diagnostics(_with_spectrum([5.0, 4.0, 2.0, 1.0]), kind)
    assert not d2.tie and d2.eigvec_method == "none" and d2.eigengap > 0.9


@pytest.mark.parametrize("Z", [_with_spectrum([2.0, 2.0, 2.0]), torch.randn(1, 6, dtype=torch.float64)],
                         ids=["kappa1", "rank1"])
def test_r_ill_degenerate_is_flagged(Z):
    with pytest.warns(RuntimeWarning, match="undefined"):
        v, d = ops.cond_regularizer_with_diagnostics(Z.requires_grad_(True), "ill")
    assert d.degenerate and v.item() == float("inf")
    with pytest.raises(core.SpectrumError):
        core.r_ill((Z.T @ Z).detach().numpy())  # the NumPy core agrees that R_ill is undefined


def test_diagnostics_values():
    Z = _with_spectrum([9.0, 4.0, 2.0, 0.5], N=6)
    _, d = ops.cond_regularizer_with_diagnostics(Z, "ill")
    assert d.rank == 4 and d.path == "covariance"
    assert abs(d.sigma_max - 9.0) < 1e-12 and abs(d.sigma_min - 0.5) < 1e-12 and abs(d.kappa - 18.0) < 1e-10
    assert abs(d.eigengap - 1.5) < 1e-12 and not d.tie and not d.degenerate
    # 4×6: Gram path, same H spectrum + 2 zeros
    _, d = ops.cond_regularizer_with_diagnostics(Z.T.contiguous(), "well")
    assert d.path == "gram" and d.rank == 4 and abs(d.eigengap - 5.0) < 1e-12


@pytest.mark.parametrize("Z,kind,msg", [
    (torch.randn(5, dtype=torch.float64), "ill", "2-D"),
    (torch.randn(3, 4).to(torch.float16), "ill", "float32 or float64"),
    (torch.zeros(0, 4, dtype=torch.float64), "well", "non-empty"),
    (torch.tensor([[1.0, float("nan")], [0.0, 1.0]], dtype=torch.float64), "ill", "NaN or Inf"),
    (torch.randn(4, 3, dtype=torch.float64), "sick", "kind must be 'ill' or 'well'"),
])
def test_bad_inputs_raise_the_ops_message(Z, kind, msg):
    with pytest.raises(RuntimeError, match=msg):
        ops.cond_regularizer(Z, kind)


def test_raw_op_rejects_non_contiguous():
    Z = torch.randn(6, 4, dtype=torch.float64).T
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.pycore.cond_reg(Z, "well")
    ops.cond_regularizer(Z, "well")  # the Python wrapper makes it contiguous


def test_raw_op_without_grad_refuses_backward():
    Z = features(8, 5, seed=0, requires_grad=True)
    v, _, _ = torch.ops.pycore.cond_reg(Z, "well", None, None, False)
    with pytest.raises(RuntimeError, match="with_grad=False"):
        v.backward()


def test_double_backward_raises_instead_of_returning_zeros():
    Z = features(10, 6, seed=1, requires_grad=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(ops.cond_regularizer(Z, "well"), Z, create_graph=True)


# ------------------------------------------------------------------------------------------
# Immunization head (Appendix C.3 dummy layer; docs/theory.md §4 right-side preconditioning)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N,D", [(10, 25), (40, 12)], ids=["woodbury_gram", "covariance"])
def test_head_preconditions_on_the_right(N, D):
    lam = 1e-3
    X = features(N, D, seed=6)
    head = ops.ImmunizationHead(D, lambda_reg=lam).double()
    assert torch.equal(head.weight.detach(), torch.eye(D, dtype=torch.float64))
    with torch.no_grad():
        head.weight.add_(0.1 * torch.randn(D, D, dtype=torch.float64))
    ops.cond_regularizer(head(X), "ill").backward()
    Wp = head.weight.detach().clone().requires_grad_(True)
    ops.cond_regularizer(X @ Wp.T, "ill").backward()  # unpreconditioned grad_W
    Kl = (X.T @ X + lam * torch.eye(D, dtype=torch.float64)).numpy()
    right = np.linalg.solve(Kl, Wp.grad.numpy().T).T  # grad_W (K+λI)⁻¹
    left = np.linalg.solve(Kl, Wp.grad.numpy())       # (K+λI)⁻¹ grad_W: the authors' orientation
    assert rel(head.weight.grad, right) <= 1e-8
    assert rel(head.weight.grad, left) > 1e-3


def test_head_matches_spec_preconditioned_theta_gradient():
    # docs/theory.md §4: with K invertible and λ = 0, K⁻¹∇_θR(H(θ)) = 2θG; in W = θᵀ form, grad_W = 2Gθᵀ.
    N, D = 60, 8
    X = features(N, D, seed=9)
    gen = torch.Generator().manual_seed(0)
    theta = torch.eye(D, dtype=torch.float64) + 0.2 * torch.randn(D, D, dtype=torch.float64, generator=gen)
    head = ops.ImmunizationHead(D, lambda_reg=0.0).double()
    with torch.no_grad():
        head.weight.copy_(theta.T)
    ops.cond_regularizer(head(X), "well").backward()
    G = core.hessian_regularizer((X @ theta).numpy(), "well").G
    assert rel(head.weight.grad, 2.0 * G @ theta.numpy().T) <= 1e-9


def test_head_bias_input_grad_and_errors():
    X = features(9, 4, seed=2, requires_grad=True)
    head = ops.ImmunizationHead(4, bias=True).double()
    out = head(X)
    out.pow(2).sum().backward()
    assert torch.allclose(head.bias.grad, 2 * out.detach().sum(0))
    assert torch.allclose(X.grad, 2 * out.detach() @ head.weight.detach())
    with pytest.raises(RuntimeError, match="features but the weight expects"):
        head(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="2-D"):
        head(torch.randn(2, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="lambda_reg"):
        ops.ImmunizationHead(4, lambda_reg=-1.0)
    Xd = X.detach()
    msg = "grad_output is (Float|torch.float32) on cpu but the input is (Double|torch.float64)"
    with pytest.raises(RuntimeError, match=msg):
        torch.ops.pycore.precond_linear_backward(torch.ones(9, 4), Xd, head.weight.detach(), 1e-7,
                                                 True, True, True)


def test_r_ill_tie_is_relative_to_sigma_min_in_op_and_core():
    """λ = (1, 2e-9, 1e-9): the two smallest differ by a factor 2, not a tie, although their gap
    is ~1e-9·λ_max; (1, 1e-9 + 1e-20, 1e-9) is one.  Op and NumPy core agree."""
    for eigs, tie in (([1.0, 2e-9, 1e-9], False), ([1.0, 1e-9 * (1 + 1e-12), 1e-9], True)):
        Z = _with_spectrum(eigs)
        _, d = ops.cond_regularizer_with_diagnostics(Z, "ill", warn=False)
        assert d.tie == tie and d.rank == 3
        reg = core.hessian_regularizer(Z.numpy(), "ill")
        assert reg.tie == tie and reg.info.rank == 3


def test_head_singular_without_ridge_raises():
    X = torch.zeros(10, 3, dtype=torch.float64)
    X[:, 0] = 1.0
    head = ops.ImmunizationHead(3, lambda_reg=0.0).double()
    with pytest.raises(RuntimeError, match="not positive definite"):
        head(X).sum().backward()


# ------------------------------------------------------------------------------------------
# torch.compile, fallback, build checks, CUDA
# ------------------------------------------------------------------------------------------

def test_torch_compile_fullgraph():
    head = ops.ImmunizationHead(16, lambda_reg=1e-3).double()

    def loss(x):
        z = head(x)
        return ops.cond_regularizer(z, "well") + 1e-3 * ops.cond_regularizer(z, "ill")

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    x = features(8, 16, seed=1)
    eager = loss(x)
    eager.backward()
    g_eager = head.weight.grad.clone()
    head.weight.grad = None
    out = compiled(x)
    out.backward()
    assert torch.allclose(out, eager, rtol=1e-12) and torch.allclose(head.weight.grad, g_eager, rtol=1e-10)


def test_fallback_without_extension_warns_once_and_agrees():
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import pycore.ops as ops\n"
        "    import pycore.ops\n"
        "print(sum('fallback' in str(x.message) for x in w), ops.extension_available())\n"
        "Z = torch.linspace(-1, 2, 60, dtype=torch.float64).reshape(6, 10).sin().requires_grad_(True)\n"
        "for kind in ('ill', 'well'):\n"
        "    v = ops.cond_regularizer(Z, kind); (g,) = torch.autograd.grad(v, Z)\n"
        "    print(repr(v.item()), repr(g.abs().sum().item()))\n"
    )
    env = dict(os.environ, PYCORE_DISABLE_EXTENSION="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         check=True)
    lines = out.stdout.split("\n")
    assert lines[0] == "1 False", out.stdout + out.stderr
    Z = torch.linspace(-1, 2, 60, dtype=torch.float64).reshape(6, 10).sin()
    for line, kind in zip(lines[1:3], ("ill", "well")):
        v, g = value_and_grad(ops.cond_regularizer, Z, kind)
        fv, fg = map(float, line.split())
        assert abs(fv - v.item()) <= 1e-12 * abs(v.item()) and abs(fg - g.abs().sum().item()) <= 1e-10 * fg


def _nvcc():
    return shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not _nvcc(), reason="nvcc not installed")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    # docs/design.md §5: the .cu is torch-free, so it compile-checks on a machine without a GPU.
    cmd = [_nvcc(), "-c", "-O3", "-std=c++17", "-Werror", "all-warnings",
           "-gencode", "arch=compute_80,code=sm_80",
           str(ROOT / "csrc/cuda/cond_reg_kernels.cu"), "-o", str(tmp_path / "k.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(not (shutil.which("g++") and os.path.exists("/usr/local/cuda/include/cuda_runtime.h")),
                    reason="needs g++ and the CUDA toolkit headers")
def test_cuda_registration_type_checks(tmp_path):
    # cond_reg_cuda.cpp (ATen + c10/cuda) is only built by a CUDA torch; type-check it against this
    # torch's headers.  CPU wheels lack one generated header, stubbed here.
    import sysconfig
    from torch.utils.cpp_extension import include_paths
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = ["g++", "-std=c++20", "-fsyntax-only", "-DWITH_CUDA", "-I/usr/local/cuda/include", f"-I{tmp_path}",
           f"-I{sysconfig.get_paths()['include']}", *[f"-I{p}" for p in include_paths()],
           str(ROOT / "csrc/cuda/cond_reg_cuda.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


@CUDA
def test_cuda_matches_cpu():
    for Z, kind, _, _, rg in sample_inputs():
        v, g, d = torch.ops.pycore.cond_reg(Z.detach(), kind, None, None, True)
        vc, gc, dc = torch.ops.pycore.cond_reg(Z.detach().cuda(), kind, None, None, True)
        tol = 1e-4 if Z.dtype == torch.float32 else 1e-10
        assert abs(vc.item() - v.item()) <= tol * abs(v.item())
        assert rel(gc.cpu(), g) <= tol
        assert torch.equal(dc.cpu()[3], d[3])  # rank


@CUDA
@pytest.mark.parametrize("args", sample_inputs("cuda") if torch.cuda.is_available() else [])
def test_opcheck_cond_reg_cuda(args):
    opcheck(torch.ops.pycore.cond_reg.default, args)


def test_cpu_only_build_under_a_cuda_torch_covers_cuda_tensors():
    """An extension built without CUDA (no toolkit) under a CUDA torch has no CUDA kernel for
    cond_reg; pycore.ops registers its PyTorch implementation there instead of leaving a bare
    NotImplementedError for training to hit.  Simulated here by claiming a CUDA torch."""
    code = ("import torch\ntorch.version.cuda = '12.4'\nfrom pycore import ops\n"
            "print(ops.extension_available(), "
            "torch._C._dispatch_has_kernel_for_dispatch_key('pycore::cond_reg', 'CUDA'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    if out.stdout.split()[0] == "True":  # only meaningful with the compiled extension
        assert out.stdout.split() == ["True", "True"]
