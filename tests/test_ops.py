"""The fused op and the immunization head (:mod:`pycore.ops`): registration, agreement with the
float64 NumPy core and the autograd reference, refusals (CondRegError naming the argument),
fallback, CUDA sources."""

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.library import opcheck

import pycore._ops as _ops
from pycore import SpectrumError, ops, r_ill, r_well
from pycore._ops import refused_argument
from pycore._regularizers import r_ill_grad, r_well_grad
from pycore.linalg import hessian_regularizer
from pycore.ops import CondRegError

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def features(N, D, *, seed=0, cond=30.0, eigs=None, dtype=F64):
    """Z = U diag(√eigs) Vᵀ: ZᵀZ has the eigenvalues ``eigs`` (default: spread so that κ(ZᵀZ) ≈
    cond)."""
    rng = np.random.default_rng(seed)
    r = min(N, D)
    eigs = (
        np.geomspace(cond, 1.0, r) * (1 + 0.05 * rng.random(r))
        if eigs is None
        else np.asarray(eigs)
    )
    U, _ = np.linalg.qr(rng.standard_normal((N, len(eigs))))
    V, _ = np.linalg.qr(rng.standard_normal((D, len(eigs))))
    return torch.tensor((U * np.sqrt(eigs)) @ V.T, dtype=dtype)


def with_spectrum(eigs, N=20):
    return features(N, len(eigs), eigs=eigs)


def value_and_grad(fn, Z, kind):
    Z = Z.detach().clone().requires_grad_(True)
    v = fn(Z, kind)
    return v.detach(), torch.autograd.grad(v, Z)[0]


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def core_value_and_grad(Z, kind):
    H = (Z.T @ Z).numpy()
    r, G = (r_ill(H), r_ill_grad(H)) if kind == "ill" else (r_well(H), r_well_grad(H))
    return r, 2.0 * Z.numpy() @ G  # dR/dZ = 2 Z ∇_H R (docs/theory.md §4)


def test_extension_is_built():
    assert _ops.extension_available(), (
        "pycore._C is not built: run `python setup.py build_ext --inplace`"
    )


@pytest.mark.parametrize(
    "N,D,dtype,kind,grad",
    [
        (12, 30, torch.float32, "ill", True),
        (40, 9, F64, "ill", True),
        (12, 30, F64, "well", False),
        (40, 9, F64, "well", False),
    ],
)
def test_opcheck_cond_reg(N, D, dtype, kind, grad):
    Z = features(N, D, dtype=dtype).requires_grad_(grad)
    opcheck(torch.ops.pycore.cond_reg.default, (Z, kind, None, None, grad))


@pytest.mark.parametrize("N,D,bias", [(6, 10, False), (15, 7, True)])
def test_opcheck_precond_linear(N, D, bias):
    X, W = (
        features(N, D, seed=3).requires_grad_(True),
        torch.randn(5, D, dtype=F64, requires_grad=True),
    )
    b = torch.randn(5, dtype=F64, requires_grad=True) if bias else None
    opcheck(torch.ops.pycore.precond_linear.default, (X, W, b, 1e-3, True))
    opcheck(
        torch.ops.pycore.precond_linear_backward.default,
        (torch.randn(N, 5, dtype=F64), X.detach(), W.detach(), 1e-3, True, True, True),
    )


@pytest.mark.parametrize("kind", _ops.KINDS)
@pytest.mark.parametrize("N,D", [(6, 10), (12, 5)])
def test_gradcheck_float64(kind, N, D):
    Z = features(N, D, seed=5).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: ops.cond_regularizer(z, kind), (Z,))
    with pytest.raises(RuntimeError):  # a second derivative would be silently zero: refused
        torch.autograd.grad(ops.cond_regularizer(Z, kind), Z, create_graph=True)


def test_gradcheck_head():
    # Every gradient is the plain one without preconditioning; with it, those of the input and
    # bias.
    X = features(7, 5, seed=1).requires_grad_(True)
    W, b = (
        torch.randn(4, 5, dtype=F64, requires_grad=True),
        torch.randn(4, dtype=F64, requires_grad=True),
    )
    assert torch.autograd.gradcheck(
        lambda x, w, bb: _ops.precond_linear(x, w, bb, 1e-3, False), (X, W, b)
    )
    assert torch.autograd.gradcheck(
        lambda x, bb: _ops.precond_linear(x, W.detach(), bb, 1e-3, True), (X, b)
    )


@pytest.mark.parametrize("kind", _ops.KINDS)
@pytest.mark.parametrize(
    "N,D,dead",
    [(12, 30, False), (40, 9, False), (48, 160, False), (160, 64, False), (50, 12, True)],
)
def test_matches_numpy_core(kind, N, D, dead):
    Z = features(N, D, seed=N + D, cond=1e3)
    # a dead unit: rank D − 1, R_ill's σ_k interior, so its eigenvector comes from the full eigh
    if dead:
        Z[:, 4] = 0.0
    r_np, g_np = core_value_and_grad(Z, kind)
    v, d = ops.cond_regularizer_with_diagnostics(Z.requires_grad_(True), kind)
    assert (
        abs(v.item() - r_np) <= 1e-10 * abs(r_np)
        and rel(torch.autograd.grad(v, Z)[0], g_np) <= 1e-10
    )
    interior = dead and kind == "ill"
    assert (d.rank, d.eigvec_method) == (
        min(N, D) - dead,
        "eigh" if interior else "inverse_iteration",
    )


@pytest.mark.parametrize("kind", _ops.KINDS)
@pytest.mark.parametrize("N,D", [(40, 100), (200, 30)])
def test_float32_error_at_most_twice_reference(kind, N, D):
    # flash-attention's criterion: error vs a float64 truth ≤ 2x the plain float32
    # implementation's.
    Z32 = features(N, D, seed=8, cond=1e3).float()
    tv, tg = value_and_grad(ops.cond_regularizer, Z32.double(), kind)
    (ov, og), (rv, rg) = (
        value_and_grad(f, Z32, kind)
        for f in (ops.cond_regularizer, _ops.reference_cond_regularizer)
    )
    assert abs(ov.double() - tv) <= 2 * abs(rv.double() - tv) + 1e-7 * abs(tv)
    assert rel(og.double(), tg) <= 2 * rel(rg.double(), tg) + 1e-7


def test_diagnostics_and_ties():
    for kind, eigs in (("well", [5.0, 5.0, 2.0, 1.0]), ("ill", [5.0, 3.0, 1.0, 1.0])):
        Z = with_spectrum(eigs).requires_grad_(True)
        with pytest.warns(RuntimeWarning):
            v, d = ops.cond_regularizer_with_diagnostics(Z, kind)
        assert d.tie and d.eigengap < 1e-10 and d.eigvec_method == "eigh"
        assert torch.isfinite(torch.autograd.grad(v, Z)[0]).all()  # a subgradient, not NaN
        _, d2 = ops.cond_regularizer_with_diagnostics(with_spectrum([5.0, 4.0, 2.0, 1.0]), kind)
        assert not d2.tie and d2.eigvec_method == "none" and d2.eigengap > 0.9
    Z = with_spectrum([9.0, 4.0, 2.0, 0.5], N=6)
    _, d = ops.cond_regularizer_with_diagnostics(Z, "ill")
    assert (d.rank, d.path, d.tie) == (4, "covariance", False)
    assert np.allclose(
        [d.sigma_max, d.sigma_min, d.kappa, d.eigengap], [9.0, 0.5, 18.0, 1.5], rtol=1e-10
    )
    _, d = ops.cond_regularizer_with_diagnostics(Z.T, "well")  # 4×6: the same spectrum and 2 zeros
    assert d.path == "gram" and d.rank == 4 and abs(d.eigengap - 5.0) < 1e-12
    # σ = (1, 2e-9, 1e-9): the two smallest differ by 2x, no tie although the gap is ~1e-9·λ_max;
    # the op and the linear core agree.
    for eigs, tie in (([1.0, 2e-9, 1e-9], False), ([1.0, 1e-9 * (1 + 1e-12), 1e-9], True)):
        _, d = ops.cond_regularizer_with_diagnostics(with_spectrum(eigs), "ill", warn=False)
        reg = hessian_regularizer(with_spectrum(eigs).numpy(), "ill")
        assert (d.tie, d.rank) == (reg.tie, reg.info.rank) == (tie, 3)


# (Z, kind, keywords, the argument named, whether the NumPy core calls R undefined too)
REFUSED = [
    (torch.zeros(6, 4, dtype=F64), "well", {}, "Z", True),
    (torch.zeros(6, 4, dtype=F64), "ill", {}, "Z", True),
    (torch.randn(1, 6, dtype=F64), "ill", {}, "Z", True),  # rank 1
    (with_spectrum([2.0, 2.0, 2.0]), "ill", {}, "Z", True),  # κ = 1
    (1e-200 * features(6, 4), "well", {}, "Z", False),  # ZᵀZ underflows to 0
    (1e160 * features(6, 4), "well", {}, "Z", False),  # overflow
    (1e-12 * features(6, 4, dtype=torch.float32), "ill", {}, "Z", False),  # R_ill > float32 max
    (torch.tensor([[1.0, float("nan")], [0.0, 1.0]], dtype=F64), "ill", {}, "Z", False),
    (torch.ones(5, dtype=F64), "well", {}, "Z", False),
    (torch.ones(3, 4).half(), "well", {}, "Z", False),
    (torch.ones(3, 4).to(torch.float8_e4m3fn), "well", {}, "Z", False),
    (features(6, 4).to_sparse(), "well", {}, "Z", False),
    (features(6, 4), "sick", {}, "kind", False),
    (features(6, 4), "ill", {"rtol": 1.0}, "rtol", False),
    (features(6, 4), "ill", {"rtol": float("nan")}, "rtol", False),
    (features(6, 4), "well", {"tie_rtol": -1.0}, "tie_rtol", False),
]


@pytest.mark.parametrize("Z,kind,kw,arg,undefined", REFUSED)
@pytest.mark.parametrize("entry", [ops.cond_regularizer, ops.cond_regularizer_with_diagnostics])
def test_refusals_are_one_line_cond_reg_errors_naming_the_argument(
    entry, Z, kind, kw, arg, undefined
):
    with pytest.raises(CondRegError) as e:
        entry(Z.requires_grad_(Z.layout == torch.strided and Z.is_floating_point()), kind, **kw)
    assert e.value.parameter == arg and "\n" not in str(e.value)
    assert pickle.loads(pickle.dumps(e.value)).parameter == arg
    if undefined:
        with pytest.raises(SpectrumError):
            core_value_and_grad(Z.detach(), kind)


def test_a_batch_too_wide_for_the_default_rank_tolerance_names_rtol():
    """1 × 10⁸ float32: D·eps = 11.9 ≥ 1 would cut λ_max itself (a batch "zero or underflowing");
    refused naming rtol, before any product (a stride-0 view: no 400 MB)."""
    Z = torch.ones(1, 1).expand(1, 10**8)
    for fn in (ops.cond_regularizer, _ops.reference_cond_regularizer):
        with pytest.raises(ops.CondRegError) as e:
            fn(Z, "well")
        assert e.value.parameter == "rtol" and "100000000" in str(e.value)
    # an explicit tolerance reads the same width (on a small batch here: D·eps < 1 is unchanged)
    assert float(ops.cond_regularizer(torch.randn(4, 8, dtype=torch.float64), "well")) > 0


def test_meta_tensors_work_through_the_fake_and_diagnostics_refuse_them():
    Z = torch.empty(8, 5, dtype=F64, device="meta", requires_grad=True)
    v = ops.cond_regularizer(Z, "ill")
    (g,) = torch.autograd.grad(v, Z)
    assert (v.shape, v.device.type, g.shape, g.device.type) == ((), "meta", Z.shape, "meta")
    head = ops.ImmunizationHead(5, device="meta", dtype=F64)
    head(Z.detach()).sum().backward()
    assert head.weight.grad.shape == (5, 5) and head.weight.grad.is_meta
    with pytest.raises(CondRegError) as e:
        ops.cond_regularizer_with_diagnostics(Z, "ill")
    assert e.value.parameter == "Z"


@pytest.mark.parametrize("N,D,lam", [(10, 25, 1e-3), (40, 12, 0.0)], ids=["gram", "covariance"])
def test_head_preconditions_on_the_right(N, D, lam):
    # docs/theory.md §4: grad_W (XᵀX + λI)⁻¹, K⁻¹∇_θR of Algorithm 1 for W = θᵀ (λ = 0: exactly
    # K⁻¹)
    X = features(N, D, seed=6)
    head = ops.ImmunizationHead(D, lambda_reg=lam).double()
    assert torch.equal(head.weight.detach(), torch.eye(D, dtype=F64))
    with torch.no_grad():
        head.weight.add_(0.1 * torch.randn(D, D, dtype=F64))
    ops.cond_regularizer(head(X), "ill").backward()
    Wp = head.weight.detach().clone().requires_grad_(True)
    ops.cond_regularizer(X @ Wp.T, "ill").backward()  # the plain grad_W
    Kl = (X.T @ X + lam * torch.eye(D, dtype=F64)).numpy()
    # grad_W (K+λI)⁻¹
    assert rel(head.weight.grad, np.linalg.solve(Kl, Wp.grad.numpy().T).T) <= 1e-8
    # not the authors' side
    assert rel(head.weight.grad, np.linalg.solve(Kl, Wp.grad.numpy())) > 1e-3


def head_backward(X, **kw):
    return lambda: ops.ImmunizationHead(4, **kw).double()(X).sum().backward()


# singular XᵀX, no ridge
# not λ
HEAD_REFUSED = [  # (call, the argument named): forward and backward
    (head_backward(torch.randn(2, 3, 4, dtype=F64)), "X"),
    (head_backward(torch.randn(3, 5, dtype=F64)), "W"),
    (head_backward(torch.randn(3, 4)), "W"),  # float32 X, float64 W
    (head_backward(torch.randn(3, 4, dtype=F64).to_sparse()), "X"),
    (head_backward(torch.randn(3, 4).to(torch.float8_e4m3fn)), "X"),
    (head_backward(torch.randn(3, 4, dtype=F64), lambda_reg=-1.0), "lambda_reg"),
    (head_backward(torch.ones(10, 4, dtype=F64), lambda_reg=0.0), "lambda_reg"),
    (
        head_backward(torch.ones(8, 4, dtype=F64).index_fill(0, torch.tensor([2]), float("nan"))),
        "X",
    ),
    (lambda: ops.ImmunizationHead(0), "dim"),
    (lambda: _ops.precond_linear(torch.randn(3, 4), torch.randn(2, 4), torch.randn(3)), "bias"),
]


@pytest.mark.parametrize("call,arg", HEAD_REFUSED)
def test_head_refusals_name_the_argument(call, arg):
    with pytest.raises(CondRegError) as e:
        call()
    assert e.value.parameter == arg and "\n" not in str(e.value)


def test_torch_compile_fullgraph():
    head, x = ops.ImmunizationHead(16, lambda_reg=1e-3).double(), features(8, 16, seed=1)
    loss = lambda x: (
        ops.cond_regularizer(head(x), "well") + 1e-3 * ops.cond_regularizer(head(x), "ill")
    )  # noqa: E731
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    (eager := loss(x)).backward()
    g_eager, head.weight.grad = head.weight.grad.clone(), None
    (out := compiled(x)).backward()
    assert torch.allclose(out, eager, rtol=1e-12) and torch.allclose(
        head.weight.grad, g_eager, rtol=1e-10
    )
    # documented: compiled code raises CondRegError's base class, the argument in its tag
    with pytest.raises(ValueError) as e:
        compiled(torch.zeros(8, 16, dtype=F64))
    assert refused_argument(e.value)[0] == "Z"


FALLBACK = """
import json, warnings, torch
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import pycore.ops as ops, pycore.ops
    import pycore._ops as _ops
out = {"warnings": sum("pycore._C" in str(x.message) for x in w),
       "extension": _ops.extension_available()}
Z = torch.linspace(-1, 2, 60, dtype=torch.float64).reshape(6, 10).sin().requires_grad_(True)
for kind in ("ill", "well"):
    v = ops.cond_regularizer(Z, kind)
    out[kind] = [v.item(), torch.autograd.grad(v, Z)[0].tolist()]
head = ops.ImmunizationHead(10, lambda_reg=1e-3).double()
ops.cond_regularizer(head(Z.detach()), "well").backward()
out["head"] = head.weight.grad.tolist()
out["refused"] = []
refused = (torch.zeros(6, 4, dtype=torch.float64),
           torch.linalg.qr(torch.randn(6, 3, dtype=torch.float64))[0])
for Z in refused:
    try:  # ZᵀZ = 0, and ZᵀZ = I up to round-off (κ = 1)
        ops.cond_regularizer(Z, "ill")
    except ops.CondRegError as e:
        out["refused"].append(e.parameter)
print(json.dumps(out))
"""


def test_fallback_without_extension_warns_once_and_agrees():
    env = dict(os.environ, PYCORE_DISABLE_EXTENSION="1", PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", FALLBACK], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["warnings"], out["extension"], out["refused"]) == (1, False, ["Z", "Z"])
    Z = torch.linspace(-1, 2, 60, dtype=F64).reshape(6, 10).sin()
    for kind in _ops.KINDS:
        v, g = value_and_grad(ops.cond_regularizer, Z, kind)
        assert (
            abs(out[kind][0] - v.item()) <= 1e-12 * abs(v.item()) and rel(out[kind][1], g) <= 1e-9
        )
    head = ops.ImmunizationHead(10, lambda_reg=1e-3).double()
    ops.cond_regularizer(head(Z), "well").backward()
    assert rel(out["head"], head.weight.grad) <= 1e-8


NVCC = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not NVCC, reason="nvcc not installed")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    res = subprocess.run(
        [
            NVCC,
            "-c",
            "-O3",
            "-std=c++17",
            "-Werror",
            "all-warnings",
            "-arch=sm_80",
            str(ROOT / "csrc/cuda/cond_reg_kernels.cu"),
            "-o",
            str(tmp_path / "k.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N,D,dtype", [(12, 30, torch.float32), (40, 9, F64)])
@pytest.mark.parametrize("kind", _ops.KINDS)
def test_cuda_matches_cpu_and_refuses_alike(N, D, dtype, kind):
    Z = features(N, D, dtype=dtype)
    (v, g, d), (vc, gc, dc) = (
        torch.ops.pycore.cond_reg(z, kind, None, None, True) for z in (Z, Z.cuda())
    )
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert (
        abs(vc.item() - v.item()) <= tol * abs(v.item())
        and rel(gc.cpu(), g) <= tol
        and dc[3] == d[3]
    )
    opcheck(
        torch.ops.pycore.cond_reg.default, (Z.cuda().requires_grad_(True), kind, None, None, True)
    )
    for bad in (torch.zeros(6, 4, dtype=dtype), torch.full((6, 4), float("nan"), dtype=dtype)):
        with pytest.raises(CondRegError) as e:
            ops.cond_regularizer(bad.cuda(), kind)
        assert e.value.parameter == "Z"
