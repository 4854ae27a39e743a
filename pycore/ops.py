"""Fused condition-number regularizer op and immunization head (docs/design.md §2; docs/theory.md §3-4).

For a batch of features ``Z`` (N×D) and the linear-probing Hessian ``H = ZᵀZ``:

* :func:`cond_regularizer` returns ``R_ill(H)`` (``kind="ill"``, paper Eq. (12)) or
  ``R_well(H)`` (``kind="well"``, Eq. (3)) as a 0-dim tensor, differentiable w.r.t. ``Z`` with
  ``∂R/∂Z = 2 Z ∇_H R(H)`` (docs/theory.md §4).  ``R_well`` uses ``p = D``; ``R_ill`` uses ``k = rank H``.
  The gradient is closed form from one extreme eigenpair (Theorem 4.1(3), A.1(3)); no
  autograd through ``eigh``.  When ``N < D`` everything is computed in the N×N Gram space
  (``ZZᵀ`` has the nonzero eigenvalues of ``ZᵀZ``), at cost ``O(N²D + N³)``.
* :class:`ImmunizationHead` is the paper's identity-initialised "dummy layer" (Appendix C.3)
  whose weight gradient is preconditioned on the RIGHT, ``grad_W (XᵀX + λI)⁻¹`` (docs/theory.md §4;
  the authors' code multiplies on the left, which breaks Theorem 4.3).
* :func:`reference_cond_regularizer` is the plain-PyTorch definition (autograd through
  ``torch.linalg.eigvalsh`` of ``ZᵀZ``), for tests and benchmarks.

Precision policy.  The two matrix products (forming ``ZᵀZ`` or ``ZZᵀ``, and the product that
forms ``∂R/∂Z``) run in ``Z``'s dtype; the eigenvalues, the rank, the eigenvector and all
regularizer scalars run in float64; ``R`` and ``∂R/∂Z`` come back in ``Z``'s dtype.  The
rank tolerance is ``D·eps(Z.dtype)·λ_max`` (``numpy.linalg.matrix_rank``'s rule for the
D×D matrix ``H`` at the precision ``H`` was formed in).  The float32 result is therefore at
least as accurate as the float32 reference (whose eigen-solve is float32 too).  For the
paper's float64 regularizers pass ``Z.double()``: a float32 ``H`` resolves eigenvalues only
down to ``~eps32·λ_max``, so ``σ_min`` of a strongly ill-conditioned ``H`` (what ``R_ill``
produces) needs float64.  The preconditioner of :class:`ImmunizationHead` is always solved
in float64 (``λ = 1e-7`` makes ``XᵀX + λI`` far too ill-conditioned for float32).

The op is ``torch.ops.pycore.cond_reg`` from the C++ extension ``pycore._C`` (CPU; CUDA when
built with CUDA).  If the extension is missing, the same ops are defined here in PyTorch
(exact, slower) and a single :class:`RuntimeWarning` says so.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import asdict, dataclass

import torch  # must precede pycore._C: the extension links against libc10/libtorch
from torch import nn

__all__ = [
    "KINDS", "CondDiagnostics", "cond_regularizer", "cond_regularizer_with_diagnostics",
    "reference_cond_regularizer", "ImmunizationHead", "precond_linear", "extension_available",
]

KINDS = ("ill", "well")

# Layout of the op's float64 `diag` output (csrc/spectral_summary.h, enum SummaryIndex).
_DIAG_FIELDS = ("sigma_max", "sigma_min", "kappa", "rank", "eigengap", "tie", "degenerate",
                "gram_path", "eigvec_method", "value64")
_DIAG_SIZE = len(_DIAG_FIELDS)
_EIGVEC_METHODS = ("inverse_iteration", "eigh", "none")

_SCHEMAS = {
    "cond_reg": "cond_reg(Tensor Z, str kind, float? rtol=None, float? tie_rtol=None, "
                "bool with_grad=False) -> (Tensor, Tensor, Tensor)",
    "precond_linear": "precond_linear(Tensor X, Tensor W, Tensor? bias, float lambda_reg, "
                      "bool precondition) -> Tensor",
    "precond_linear_backward": "precond_linear_backward(Tensor grad_out, Tensor X, Tensor W, "
                               "float lambda_reg, bool precondition, bool need_input, "
                               "bool need_weight) -> (Tensor, Tensor)",
}


# ---------------------------------------------------------------------------------------------
# Pure-PyTorch fallback: the same ops, same semantics (full eigh for the eigenvector).
# ---------------------------------------------------------------------------------------------

def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def _check_cond_reg_inputs(Z, kind, rtol, tie_rtol):
    # Same messages as csrc/cond_reg.cpp (TORCH_CHECK raises RuntimeError).
    if kind not in KINDS:
        raise RuntimeError(f"cond_regularizer: kind must be 'ill' or 'well', got '{kind}'")
    if Z.dim() != 2:
        raise RuntimeError(f"cond_regularizer: Z must be a 2-D (N x D) feature matrix, got {Z.dim()}-D "
                           f"with shape {list(Z.shape)}")
    if Z.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(f"cond_regularizer: Z must be float32 or float64, got {Z.dtype}")
    if Z.shape[0] < 1 or Z.shape[1] < 1:
        raise RuntimeError(f"cond_regularizer: Z must be non-empty, got shape {list(Z.shape)}")
    if not Z.is_contiguous():
        raise RuntimeError("cond_regularizer: Z must be contiguous (call .contiguous())")
    for name, v in (("rtol", rtol), ("tie_rtol", tie_rtol)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise RuntimeError(f"cond_regularizer: {name} must be a finite number >= 0, got {v}")


def _spectral_summary(lam, D, kind, rtol, tie_rtol, eps, gram):
    """Python twin of ``pycore::spectral_summary`` (csrc/spectral_summary.h), same formulas."""
    n = len(lam)
    lmax = lam[-1]
    tol = rtol * lmax if lmax > 0 else 0.0
    i0 = next((i for i, x in enumerate(lam) if x > tol), n) if lmax > 0 else n
    k = n - i0
    out = dict.fromkeys(_DIAG_FIELDS, 0.0)
    out.update(gram_path=float(gram), eigvec_method=2.0, rank=float(k),
               sigma_max=max(lmax, 0.0), sigma_min=lam[i0] if k else 0.0,
               kappa=lmax / lam[i0] if k else math.nan)
    if kind == "well":
        l1 = lmax if k else 0.0
        below = lam[-2] if n >= 2 else (0.0 if D > n else -math.inf)
        gap = lmax - below if k else 0.0
        s = sum((l1 - x) * (l1 + x) for x in lam[i0:])
        out.update(value64=(s + (D - k) * l1 * l1) / (2.0 * D), eigengap=gap,
                   tie=float(gap <= tie_rtol * out["sigma_max"]))
        return out, l1, 1.0 / D, n - 1
    lk = lam[i0] if k else 0.0
    gap = lam[i0 + 1] - lk if k >= 2 else math.inf
    out.update(eigengap=gap, tie=float(k >= 2 and gap <= max(tie_rtol * lk, tol)))
    d = sum((x - lk) * (x + lk) for x in lam[i0:]) / (2.0 * k) if k else 0.0
    idx = i0 if i0 < n else n - 1
    if k < 2 or not d > 4.0 * k * eps * lmax * lmax:
        out.update(degenerate=1.0, value64=math.inf)
        return out, math.nan, math.nan, idx
    out["value64"] = 1.0 / d
    return out, lk / (d * d), 1.0 / (k * d * d), idx


def _cond_reg_torch(Z, kind, rtol=None, tie_rtol=None, with_grad=False):
    _check_cond_reg_inputs(Z, kind, rtol, tie_rtol)
    if not bool(torch.isfinite(Z).all()):
        raise RuntimeError("cond_regularizer: Z contains NaN or Inf")
    N, D = Z.shape
    eps = _eps(Z.dtype)
    rtol = D * eps if rtol is None else rtol
    tie_rtol = math.sqrt(eps) if tie_rtol is None else tie_rtol
    gram = N < D
    M = Z @ Z.T if gram else Z.T @ Z
    lam, V = torch.linalg.eigh(M.double())
    diag, c_vec, c_mat, idx = _spectral_summary(lam.tolist(), D, kind, rtol, tie_rtol, eps, gram)
    grad = Z.new_empty((0,))
    if with_grad:
        diag["eigvec_method"] = 1.0
        x = V[:, idx]
        Z64 = Z.double()
        a, b = (x, Z64.T @ x) if gram else (Z64 @ x, x)
        P = (M @ Z) if gram else (Z @ M)
        grad = (2.0 * c_vec * torch.outer(a, b) - 2.0 * c_mat * P.double()).to(Z.dtype)
    value = torch.tensor(diag["value64"], dtype=Z.dtype, device=Z.device)
    diag_t = torch.tensor([diag[f] for f in _DIAG_FIELDS], dtype=torch.float64, device=Z.device)
    return value, grad, diag_t


def _precond_linear_torch(X, W, bias, lambda_reg, precondition):
    _check_head_inputs(X, W, lambda_reg)
    return X @ W.T if bias is None else torch.addmm(bias, X, W.T)


def _precond_linear_backward_torch(grad_out, X, W, lambda_reg, precondition, need_input, need_weight):
    _check_head_inputs(X, W, lambda_reg)
    if grad_out.dtype != X.dtype or grad_out.device != X.device:
        raise RuntimeError(f"ImmunizationHead backward: grad_output is {grad_out.dtype} on {grad_out.device} "
                           f"but the input is {X.dtype} on {X.device}")
    gX = grad_out @ W if need_input else X.new_empty((0,))
    if not need_weight:
        return gX, W.new_empty((0,))
    if not precondition:
        return gX, grad_out.T @ X
    X64, G64 = X.double(), grad_out.double()
    gram = X.shape[0] < X.shape[1]
    S = X64 @ X64.T if gram else X64.T @ X64
    S.diagonal().add_(lambda_reg)
    L, info = torch.linalg.cholesky_ex(S)
    if int(info) != 0:
        raise RuntimeError(f"ImmunizationHead: {'XXᵀ' if gram else 'XᵀX'} + λI is not positive definite "
                           f"in float64 (lambda_reg={lambda_reg}); use a larger lambda_reg")
    gW = torch.cholesky_solve(G64, L).T @ X64 if gram else torch.cholesky_solve(X64.T @ G64, L).T
    return gX, gW.to(W.dtype).contiguous()


def _check_head_inputs(X, W, lambda_reg):
    if X.dim() != 2:
        raise RuntimeError(f"ImmunizationHead: input must be 2-D (N x D_in), got {X.dim()}-D with shape "
                           f"{list(X.shape)}")
    if W.dim() != 2 or X.shape[1] != W.shape[1]:
        raise RuntimeError(f"ImmunizationHead: input has {X.shape[1]} features but the weight expects "
                           f"{W.shape[-1]}")
    if X.dtype not in (torch.float32, torch.float64) or X.dtype != W.dtype:
        raise RuntimeError(f"ImmunizationHead: input dtype {X.dtype} / weight dtype {W.dtype}: both must "
                           "be float32 or float64 and equal")
    if not (math.isfinite(lambda_reg) and lambda_reg >= 0):
        raise RuntimeError(f"ImmunizationHead: lambda_reg must be a finite number >= 0, got {lambda_reg}")


_fallback_lib = None  # keeps the fallback Library (and its registrations) alive


def _define_fallback():
    global _fallback_lib
    _fallback_lib = torch.library.Library("pycore", "DEF")
    for name, schema in _SCHEMAS.items():
        _fallback_lib.define(schema)
    _fallback_lib.impl("cond_reg", _cond_reg_torch, "CompositeExplicitAutograd")
    _fallback_lib.impl("precond_linear", _precond_linear_torch, "CompositeExplicitAutograd")
    _fallback_lib.impl("precond_linear_backward", _precond_linear_backward_torch,
                       "CompositeExplicitAutograd")


def _cover_missing_cuda_kernel() -> None:
    """A CPU-only build of the extension under a CUDA torch (no toolkit at build time) has no CUDA
    kernel for ``cond_reg``: register the PyTorch implementation for CUDA tensors and say so,
    instead of failing later with a bare NotImplementedError in the middle of training."""
    global _fallback_lib
    if (torch.version.cuda is None
            or torch._C._dispatch_has_kernel_for_dispatch_key("pycore::cond_reg", "CUDA")):
        return
    _fallback_lib = torch.library.Library("pycore", "IMPL")
    _fallback_lib.impl("cond_reg", _cond_reg_torch, "CUDA")
    if torch.cuda.is_available():
        warnings.warn("pycore._C was built without its CUDA kernel (no CUDA toolkit at build time); "
                      "cond_regularizer uses the PyTorch implementation on CUDA tensors (same results, "
                      "slower). Rebuild with CUDA_HOME set, or PYCORE_FORCE_CUDA=1 to make that an error.",
                      RuntimeWarning, stacklevel=3)


def _load_extension() -> bool:
    if os.environ.get("PYCORE_DISABLE_EXTENSION", "").strip().lower() in ("1", "true", "yes"):
        reason = "PYCORE_DISABLE_EXTENSION is set"
    else:
        try:
            import pycore._C  # noqa: F401  (registers torch.ops.pycore.* from C++)
            _cover_missing_cuda_kernel()
            return True
        except ImportError as exc:
            reason = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        f"pycore._C (the fused C++ op) is not available ({reason}); pycore.ops uses its pure-PyTorch "
        "fallback (same results, slower). Build it with `python setup.py build_ext --inplace` or "
        "`python -m pip install --no-build-isolation --no-deps -e .`", RuntimeWarning, stacklevel=2)
    _define_fallback()
    return False


_HAS_EXTENSION = _load_extension()


def extension_available() -> bool:
    """True when ``torch.ops.pycore.*`` come from the compiled extension ``pycore._C``."""
    return _HAS_EXTENSION


# ---------------------------------------------------------------------------------------------
# Fake (meta) implementations and autograd.
# ---------------------------------------------------------------------------------------------

@torch.library.register_fake("pycore::cond_reg")
def _cond_reg_fake(Z, kind, rtol=None, tie_rtol=None, with_grad=False):
    torch._check(kind in KINDS, lambda: f"cond_regularizer: kind must be 'ill' or 'well', got '{kind}'")
    torch._check(Z.dim() == 2, lambda: f"cond_regularizer: Z must be a 2-D (N x D) feature matrix, "
                                       f"got {Z.dim()}-D")
    torch._check(Z.dtype in (torch.float32, torch.float64),
                 lambda: f"cond_regularizer: Z must be float32 or float64, got {Z.dtype}")
    grad = Z.new_empty(Z.shape) if with_grad else Z.new_empty((0,))
    return Z.new_empty(()), grad, Z.new_empty((_DIAG_SIZE,), dtype=torch.float64)


def _cond_reg_setup_context(ctx, inputs, output):
    _, _, _, _, with_grad = inputs
    _, grad, diag = output
    ctx.with_grad = with_grad
    ctx.mark_non_differentiable(grad, diag)
    ctx.save_for_backward(grad)


def _cond_reg_backward(ctx, grad_value, _grad_grad, _grad_diag):
    # The saved dR/dZ carries no graph: with create_graph=True the returned gradient would be a
    # constant and any second derivative silently zero.  Refuse instead.
    if torch.is_grad_enabled():
        raise RuntimeError("cond_regularizer supports first derivatives only (create_graph=True / "
                           "double backward is not implemented); use reference_cond_regularizer")
    if not ctx.with_grad:
        raise RuntimeError("pycore::cond_reg was called with with_grad=False, so dR/dZ was not "
                           "computed; call pycore.ops.cond_regularizer instead of the raw op")
    (dRdZ,) = ctx.saved_tensors
    return grad_value * dRdZ, None, None, None, None


torch.library.register_autograd("pycore::cond_reg", _cond_reg_backward,
                                setup_context=_cond_reg_setup_context)


@torch.library.register_fake("pycore::precond_linear")
def _precond_linear_fake(X, W, bias, lambda_reg, precondition):
    torch._check(X.dim() == 2, lambda: f"ImmunizationHead: input must be 2-D (N x D_in), got {X.dim()}-D")
    torch._check(W.dim() == 2 and X.shape[1] == W.shape[1],
                 lambda: f"ImmunizationHead: input has {X.shape[1]} features but the weight expects "
                         f"{W.shape[-1]}")
    torch._check(X.dtype in (torch.float32, torch.float64) and X.dtype == W.dtype,
                 lambda: f"ImmunizationHead: input dtype {X.dtype} / weight dtype {W.dtype}: both must be "
                         "float32 or float64 and equal")
    return X.new_empty((X.shape[0], W.shape[0]))


@torch.library.register_fake("pycore::precond_linear_backward")
def _precond_linear_backward_fake(grad_out, X, W, lambda_reg, precondition, need_input, need_weight):
    torch._check(grad_out.dtype == X.dtype, lambda: f"ImmunizationHead backward: grad_output is "
                                                    f"{grad_out.dtype} but the input is {X.dtype}")
    gX = X.new_empty(X.shape) if need_input else X.new_empty((0,))
    gW = W.new_empty(W.shape) if need_weight else W.new_empty((0,))
    return gX, gW


def _precond_linear_setup_context(ctx, inputs, output):
    X, W, bias, lambda_reg, precondition = inputs
    ctx.save_for_backward(X, W)
    ctx.lambda_reg, ctx.precondition, ctx.has_bias = lambda_reg, precondition, bias is not None


def _precond_linear_backward(ctx, grad_out):
    X, W = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    try:
        gX, gW = torch.ops.pycore.precond_linear_backward(
            grad_out.contiguous(), X, W, ctx.lambda_reg, ctx.precondition, need_x, need_w)
    except RuntimeError as exc:
        # A NaN/inf batch also fails the Cholesky factorisation, whose message blames rank
        # deficiency; name the real cause (checked only on failure: no sync on the happy path).
        if "not positive definite" in str(exc):
            _raise_if_non_finite(X)
        raise
    gb = grad_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (gX if need_x else None), (gW if need_w else None), gb, None, None


def _raise_if_non_finite(X):
    bad = int((~torch.isfinite(X)).sum())
    if bad:
        raise RuntimeError(f"ImmunizationHead: the input batch contains NaN or inf "
                           f"({bad} of {X.numel()} entries): "
                           "the features entering the layer are non-finite") from None


torch.library.register_autograd("pycore::precond_linear", _precond_linear_backward,
                                setup_context=_precond_linear_setup_context)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CondDiagnostics:
    """Spectrum of ``H = ZᵀZ`` at the call (eigenvalues of H, i.e. its singular values).

    ``sigma_min`` is the smallest eigenvalue above the rank tolerance and ``kappa`` the
    condition number over the nonzero spectrum (docs/theory.md §2).  ``eigengap`` is ``λ₁ − λ₂``
    (R_well) or ``λ_{k−1} − λ_k`` (R_ill); ``tie`` flags a near-tie of that extreme eigenvalue,
    ``eigengap ≤ tie_rtol·λ₁`` (R_well) or ``≤ max(tie_rtol·λ_k, rtol·λ₁)`` (R_ill: relative to
    λ_k itself, or below the rank tolerance), where R is not differentiable and the gradient
    returned is a subgradient (docs/theory.md §3).
    ``degenerate`` flags an undefined R_ill (rank ≤ 1 or a flat nonzero spectrum, κ = 1):
    the value is then ``inf`` and the gradient NaN.
    """

    kind: str
    value: float
    sigma_max: float
    sigma_min: float
    kappa: float
    rank: int
    eigengap: float
    tie: bool
    degenerate: bool
    path: str            # "gram" (N < D) or "covariance"
    eigvec_method: str   # "inverse_iteration", "eigh" or "none" (no gradient requested)

    def as_dict(self) -> dict:
        return asdict(self)


def _call(Z, kind, rtol, tie_rtol):
    if not isinstance(Z, torch.Tensor):
        raise TypeError(f"cond_regularizer: Z must be a torch.Tensor, got {type(Z).__name__}")
    # The op checks finite and ≥ 0; rtol ≥ 1 would cut λ_max itself (rank 0: R_well = 0 silently).
    if rtol is not None and not (isinstance(rtol, (int, float)) and 0 <= rtol < 1):
        raise RuntimeError(f"cond_regularizer: rtol must be a finite number in [0, 1), got {rtol!r}")
    with_grad = torch.is_grad_enabled() and Z.requires_grad
    return torch.ops.pycore.cond_reg(Z.contiguous(), kind, rtol, tie_rtol, with_grad)


def cond_regularizer(Z: torch.Tensor, kind: str, *, rtol: float | None = None,
                     tie_rtol: float | None = None) -> torch.Tensor:
    """R_ill (``kind="ill"``) or R_well (``"well"``) of ``H = ZᵀZ`` as a 0-dim tensor (docs/theory.md §3).

    Differentiable w.r.t. ``Z`` (``∂R/∂Z = 2Z∇_H R``, docs/theory.md §4).  ``rtol`` is the relative rank
    tolerance on the eigenvalues of ``H`` (default ``D·eps``), ``tie_rtol`` the relative gap
    below which the extreme eigenvalue counts as tied (default ``sqrt(eps)``).  No host sync
    on the diagnostics: use :func:`cond_regularizer_with_diagnostics` to see ties and κ.
    """
    return _call(Z, kind, rtol, tie_rtol)[0]


def cond_regularizer_with_diagnostics(Z: torch.Tensor, kind: str, *, rtol: float | None = None,
                                      tie_rtol: float | None = None, warn: bool = True):
    """``(R, CondDiagnostics)``; warns (``RuntimeWarning``) on a tie or an undefined R_ill."""
    value, _, diag = _call(Z, kind, rtol, tie_rtol)
    v = dict(zip(_DIAG_FIELDS, diag.tolist()))
    d = CondDiagnostics(
        kind=kind, value=v["value64"], sigma_max=v["sigma_max"], sigma_min=v["sigma_min"],
        kappa=v["kappa"], rank=int(v["rank"]), eigengap=v["eigengap"], tie=bool(v["tie"]),
        degenerate=bool(v["degenerate"]), path="gram" if v["gram_path"] else "covariance",
        eigvec_method=_EIGVEC_METHODS[int(v["eigvec_method"])])
    if warn and d.degenerate:
        warnings.warn(f"R_{kind} is undefined for this batch (rank {d.rank}, κ = {d.kappa:.6g}): it needs "
                      "two distinct nonzero eigenvalues of ZᵀZ; value inf, gradient NaN",
                      RuntimeWarning, stacklevel=2)
    elif warn and d.tie:
        which = "σ_min" if kind == "ill" else "σ_max"
        warnings.warn(f"R_{kind}: {which} of ZᵀZ is (nearly) repeated (gap {d.eigengap:.3e}, σ_max "
                      f"{d.sigma_max:.3e}); R is not differentiable there, the gradient is a subgradient",
                      RuntimeWarning, stacklevel=2)
    return value, d


def reference_cond_regularizer(Z: torch.Tensor, kind: str, *, rtol: float | None = None) -> torch.Tensor:
    """Plain-PyTorch R_kind(ZᵀZ): ``H = ZᵀZ``, autograd through ``torch.linalg.eigvalsh``.

    Same definitions and rank rule as :func:`cond_regularizer`; every step in ``Z``'s dtype.
    Its backward forms all D eigenvectors (and is NaN/unstable at close eigenvalues): it exists
    to check and time the fused op, not to train with.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be 'ill' or 'well', got {kind!r}")
    H = Z.T @ Z
    D = H.shape[0]
    lam = torch.linalg.eigvalsh(H)
    fro2 = (H * H).sum()
    if kind == "well":
        return 0.5 * lam[-1] ** 2 - fro2 / (2 * D)
    rtol = D * _eps(Z.dtype) if rtol is None else rtol
    k = int((lam.detach() > rtol * lam[-1].detach()).sum())
    if k < 2:
        raise ValueError(f"R_ill is undefined for rank {k} < 2")
    return 1.0 / (fro2 / (2 * k) - 0.5 * lam[D - k] ** 2)


def precond_linear(X, W, bias=None, lambda_reg: float = 1e-7, precondition: bool = True):
    """``X Wᵀ + b`` whose weight gradient is ``(grad_outᵀX)(XᵀX + λI)⁻¹`` (docs/theory.md §4, right side)."""
    return torch.ops.pycore.precond_linear(X, W, bias, float(lambda_reg), bool(precondition))


class ImmunizationHead(nn.Module):
    """Identity-initialised D×D linear layer with a preconditioned weight gradient.

    The paper's "dummy layer" (Appendix C.3) between the backbone and the classifier: forward
    ``z = x Wᵀ (+ b)``; backward ``grad_W ← grad_W (XᵀX + λI)⁻¹`` with ``X`` the batch input,
    i.e. ``K⁻¹∇_θR`` of Algorithm 1 line 6 in ``W = θᵀ`` form (docs/theory.md §4: right-multiplied;
    the authors' code left-multiplies).  Gradients of the input and bias are the usual ones.
    The solve runs in float64 in the backward op; when ``N < D`` it uses the N×N Gram matrix
    (push-through form of Woodbury's identity), ``O(N²D + N³)``.
    """

    def __init__(self, dim: int, lambda_reg: float = 1e-7, precondition: bool = True, bias: bool = False,
                 *, device=None, dtype=None):
        super().__init__()
        if not (isinstance(dim, int) and dim >= 1):
            raise ValueError(f"ImmunizationHead: dim must be a positive int, got {dim!r}")
        if not (math.isfinite(lambda_reg) and lambda_reg >= 0):
            raise ValueError(f"ImmunizationHead: lambda_reg must be a finite number >= 0, got {lambda_reg}")
        self.dim, self.lambda_reg, self.precondition = dim, float(lambda_reg), bool(precondition)
        self.weight = nn.Parameter(torch.eye(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return precond_linear(x, self.weight, self.bias, self.lambda_reg, self.precondition)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, lambda_reg={self.lambda_reg:g}, precondition={self.precondition}, "
                f"bias={self.bias is not None}")
