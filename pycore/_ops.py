"""The fused condition-number regularizer op and the immunization head.

docs/theory.md §3-4, docs/design.md §2, as pytorch/extension-cpp does it: ``torch.ops.pycore.*``
are defined, with their input checks, in C++ (csrc/; CPU kernels, CUDA when built); this module
registers the fake implementation and autograd, and turns the C++ refusals into
:class:`CondRegError` (under ``torch.compile``: its base ValueError). Without the extension (not
built, or ``PYCORE_DISABLE_EXTENSION=1``; one RuntimeWarning) the entry points run the plain
reference, :func:`reference_cond_regularizer` and a float64 solve on the weight gradient: the same
values and refusals of R, no diagnostics, no meta tensors, no ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from dataclasses import dataclass

import torch  # must precede pycore._C: the extension links against libc10/libtorch
from torch import nn
from torch.nn import functional as F

from pycore._regularizers import KINDS
from pycore._validation import PicklableError

# The op's float64 `diag` output, in the order of enum SummaryIndex (csrc/spectral_summary.h).
_DIAG_FIELDS = (
    "sigma_max",
    "sigma_min",
    "kappa",
    "rank",
    "eigengap",
    "tie",
    "degenerate",
    "gram_path",
    "eigvec_method",
    "value64",
)
_EIGVEC_METHODS = ("inverse_iteration", "eigh", "none")


class CondRegError(PicklableError, ValueError):
    """Input the op cannot handle.

    Parameters
    ----------
    parameter : str
        The argument at fault (``"Z"``, ``"kind"``, ``"rtol"``, ``"lambda_reg"``, ...), kept as
        ``.parameter`` (the same order as :class:`~pycore.ParameterError`).
    message : str
        One line saying what is wrong.
    """

    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


def _load_extension() -> bool:
    reason = "PYCORE_DISABLE_EXTENSION is set"
    if os.environ.get("PYCORE_DISABLE_EXTENSION", "").strip().lower() not in ("1", "true", "yes"):
        try:
            import pycore._C  # noqa: F401  (its TORCH_LIBRARY blocks register torch.ops.pycore.*)

            return True
        except ImportError as exc:
            reason = f"{type(exc).__name__}: {exc}"
    warnings.warn(
        f"pycore._C (the fused C++ op) is not available ({reason}); pycore.ops runs the plain "
        "PyTorch definitions (same values, slower, no diagnostics). Build it with "
        "`python setup.py build_ext --inplace`",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


_HAS_EXTENSION = _load_extension()


def extension_available() -> bool:
    """True when ``torch.ops.pycore.*`` come from the compiled extension ``pycore._C``."""
    return _HAS_EXTENSION


# The tag before the sentence of every refusal of the C++ op (PYCORE_CHECK_ARG, csrc/cond_reg.h).
ARGUMENT_TAG = re.compile(r"pycore\.argument=(\w+);")


def refused_argument(exc: BaseException) -> tuple[str, str] | None:
    """``(argument, sentence)`` of a refusal of the C++ op; None for any other error.

    The op's ValueError carries the argument at fault as a tag (``pycore.argument=Z;``) before
    the sentence; compiled code (``torch.compile``) gets that ValueError as it is.
    """
    first = (str(exc).splitlines() or [""])[0]
    tag = ARGUMENT_TAG.match(first)
    return None if tag is None else (tag.group(1), first[tag.end() :])


def _run(where: str, name: str, op, *args):
    """``op(*args)``, the C++ refusals as CondRegError.

    The C++ checks' tagged ValueError (:func:`refused_argument`) and the dispatcher's
    NotImplementedError (no kernel for this layout or device) as CondRegError; any other error
    as it is.
    """
    try:
        return op(*args)
    except ValueError as exc:
        refused = refused_argument(exc)
        if refused is None:
            raise
        raise CondRegError(refused[0], f"{where}: {refused[1]}") from None
    except NotImplementedError:
        t = args[0]
        raise CondRegError(
            name,
            f"{where}: {name} is a {t.layout} {t.dtype} tensor on {t.device}; the op takes "
            "dense float32/float64 tensors on the CPU (CUDA if built)",
        ) from None


if _HAS_EXTENSION:

    @torch.library.register_fake("pycore::cond_reg")
    def _cond_reg_fake(Z, kind, rtol=None, tie_rtol=None, with_grad=False):
        grad = Z.new_empty(Z.shape if with_grad else (0,))
        return Z.new_empty(()), grad, Z.new_empty((len(_DIAG_FIELDS),), dtype=torch.float64)

    def _cond_reg_setup(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.save_for_backward(output[1])

    def _cond_reg_backward(ctx, grad_value, _grad_grad, _grad_diag):
        # The saved dR/dZ carries no graph: a second derivative would silently be zero.
        torch._check(
            not torch.is_grad_enabled(),
            lambda: (
                "cond_regularizer has first derivatives only "
                "(no create_graph=True / double backward); use reference_cond_regularizer"
            ),
        )
        return grad_value * ctx.saved_tensors[0], None, None, None, None

    torch.library.register_autograd(
        "pycore::cond_reg", _cond_reg_backward, setup_context=_cond_reg_setup
    )

    def _precond_linear_setup(ctx, inputs, output):
        X, W, _, ctx.lambda_reg, ctx.precondition = inputs
        ctx.save_for_backward(X, W)

    def _precond_linear_backward(ctx, grad_out):
        X, W = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gX, gW = _run(
            "ImmunizationHead",
            "X",
            torch.ops.pycore.precond_linear_backward,
            grad_out,
            X,
            W,
            ctx.lambda_reg,
            ctx.precondition,
            need_x,
            need_w,
        )
        return (
            gX if need_x else None,
            gW if need_w else None,
            grad_out.sum(0) if need_b else None,
            None,
            None,
        )

    torch.library.register_autograd(
        "pycore::precond_linear", _precond_linear_backward, setup_context=_precond_linear_setup
    )


@dataclass(frozen=True)
class CondDiagnostics:
    """Spectrum of ``H = ZᵀZ`` (docs/theory.md §2-3).

    ``sigma_min`` the smallest eigenvalue above ``rtol·λ_max``; ``eigengap`` ``λ₁ − λ₂`` (R_well)
    or ``λ_{k−1} − λ_k`` (R_ill); ``tie`` a gap ≤ ``tie_rtol·λ₁`` (R_well) or ≤ ``max(tie_rtol·λ_k,
    rtol·λ₁)`` (R_ill): R is not differentiable there.
    """

    kind: str
    value: float
    sigma_max: float
    sigma_min: float
    kappa: float
    rank: int
    eigengap: float
    tie: bool
    path: str  # "gram" (N < D) or "covariance"
    eigvec_method: str  # "inverse_iteration", "eigh" or "none" (no gradient requested)


def _check_default_rtol(Z, rtol, where: str) -> None:
    """Refuse a batch so wide that the default rank tolerance cuts λ_max itself.

    The default rank tolerance ``D·eps`` cuts λ_max itself once it reaches 1 (float32 from D ≈
    8.4 million columns): every eigenvalue would count as zero and a 1 × 10⁸ batch read as "zero or
    underflowing".  Refused naming ``rtol``, the setting that makes such a batch readable.
    """
    if rtol is not None or getattr(Z, "ndim", 0) != 2 or not Z.is_floating_point():
        return
    eps = torch.finfo(Z.dtype).eps
    if Z.shape[1] * eps >= 1.0:
        raise CondRegError(
            "rtol",
            f"{where}: Z has D = {Z.shape[1]} columns, so the default rank tolerance D·eps = "
            f"{Z.shape[1] * eps:.3g} of {Z.dtype} is ≥ 1 and no eigenvalue of ZᵀZ could count "
            "as nonzero: pass an explicit rtol < 1, or float64 features",
        )


def _cond_reg(Z, kind, rtol, tie_rtol, where):
    _check_default_rtol(Z, rtol, where)
    with_grad = torch.is_grad_enabled() and getattr(Z, "requires_grad", False)
    return _run(where, "Z", torch.ops.pycore.cond_reg, Z, kind, rtol, tie_rtol, with_grad)


def cond_regularizer(
    Z: torch.Tensor, kind: str, *, rtol: float | None = None, tie_rtol: float | None = None
) -> torch.Tensor:
    """The condition-number regularizer R_ill or R_well of ``H = ZᵀZ`` (docs/theory.md §3), fused.

    ``R_well(H) = ½λ_max² − ‖H‖_F²/(2D)`` is small when H is well conditioned; ``R_ill(H) =
    1/(‖H‖_F²/(2k) − ½λ_k²)``, k = rank H, is small when H is ill conditioned. The value is
    differentiable in Z (autograd through the op's own closed-form gradient ``2Z∇_H R``); with
    the compiled extension one fused kernel works in the N×N Gram space when N < D (docs/design.md
    §2), without it the plain definition runs (:func:`reference_cond_regularizer`).

    Parameters
    ----------
    Z : torch.Tensor, shape (N, D)
        Features, float32 or float64, dense, on the CPU (CUDA when built with it).
    kind : {"ill", "well"}
        Which regularizer.
    rtol : float, optional
        Relative rank tolerance on the eigenvalues of H (default ``D·eps`` of Z's dtype).
    tie_rtol : float, optional
        Relative gap at which the extreme eigenvalue counts as tied (default ``sqrt(eps)``).

    Returns
    -------
    torch.Tensor
        A 0-dim tensor of Z's dtype; scalars are computed in float64.

    Raises
    ------
    CondRegError
        A bad ``kind`` or ``rtol``, a NaN, sparse or wrong-device Z, or a batch where R has no
        value (ZᵀZ = 0, rank ≤ 1 or κ = 1 for R_ill, overflow); ``.parameter`` names the
        argument.

    Examples
    --------
    >>> import torch
    >>> from pycore.ops import cond_regularizer
    >>> Z = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    >>> Z.requires_grad_(True)  # doctest: +ELLIPSIS
    tensor(...)
    >>> R = cond_regularizer(Z, "ill")  # H = diag(4, 1): 1/(17/4 − 1/2)
    >>> round(R.item(), 12)
    0.266666666667
    >>> R.backward()
    >>> [round(g, 6) for g in Z.grad.diagonal().tolist()]  # ∂R/∂Z = 2Z∇_H R
    [-0.568889, 0.071111]
    >>> round(cond_regularizer(Z.detach(), "well").item(), 12)  # ½·16 − 17/4
    3.75
    """
    if not _HAS_EXTENSION:
        return reference_cond_regularizer(Z, kind, rtol=rtol)
    return _cond_reg(Z, kind, rtol, tie_rtol, "cond_regularizer")[0]


def cond_regularizer_with_diagnostics(
    Z: torch.Tensor,
    kind: str,
    *,
    rtol: float | None = None,
    tie_rtol: float | None = None,
    warn: bool = True,
):
    """``R`` and what the op measured on the way: a :class:`CondDiagnostics`.

    Needs the compiled extension. A RuntimeWarning at an eigenvalue tie (``warn``), where the
    gradient is not defined.

    Parameters
    ----------
    Z : torch.Tensor, shape (N, D)
        float32 or float64 features.
    kind : {"ill", "well"}
        R_ill or R_well.
    rtol, tie_rtol : float, optional
        The rank cut-off and the tie threshold, relative to λ_max (the op's defaults: D·eps and
        √eps of Z's dtype).
    warn : bool, default True
        Warn at a tie.

    Returns
    -------
    value : torch.Tensor
        R, a scalar with ``Z``'s gradient.
    diagnostics : CondDiagnostics
        σ_max, σ_min, κ, rank, the eigengap, the tie flag and how the eigenvector was found.

    Raises
    ------
    CondRegError
        Input the op refuses; ``.parameter`` names the argument.

    Examples
    --------
    >>> import torch
    >>> from pycore.ops import cond_regularizer_with_diagnostics
    >>> Z = torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64))
    >>> value, d = cond_regularizer_with_diagnostics(Z, "well")
    >>> float(value), d.rank, round(d.kappa, 12)  # κ(ZᵀZ) = 9
    (20.0, 2, 9.0)
    """
    if not _HAS_EXTENSION:
        raise RuntimeError(
            "cond_regularizer_with_diagnostics needs the compiled extension pycore._C"
        )
    where = "cond_regularizer_with_diagnostics"
    if getattr(Z, "is_meta", False):
        raise CondRegError("Z", f"{where}: Z is a meta tensor; diagnostics need data")
    value, _, diag = _cond_reg(Z, kind, rtol, tie_rtol, where)
    v = dict(zip(_DIAG_FIELDS, diag.tolist()))
    d = CondDiagnostics(
        kind=kind,
        value=v["value64"],
        sigma_max=v["sigma_max"],
        sigma_min=v["sigma_min"],
        kappa=v["kappa"],
        rank=int(v["rank"]),
        eigengap=v["eigengap"],
        tie=bool(v["tie"]),
        path="gram" if v["gram_path"] else "covariance",
        eigvec_method=_EIGVEC_METHODS[int(v["eigvec_method"])],
    )
    if warn and d.tie:
        warnings.warn(
            f"R_{kind}: the extreme eigenvalue of ZᵀZ is (nearly) repeated (gap "
            f"{d.eigengap:.3e}): "
            "R is not differentiable, the gradient is a subgradient",
            RuntimeWarning,
            stacklevel=2,
        )
    return value, d


def reference_cond_regularizer(
    Z: torch.Tensor, kind: str, *, rtol: float | None = None
) -> torch.Tensor:
    """R_kind(ZᵀZ) by autograd through ``torch.linalg.eigvalsh`` in Z's dtype (docs/theory.md §3).

    The definition the op is tested against and the fallback without it (same rank rule and
    domain).
    """
    where = "reference_cond_regularizer"
    if kind not in KINDS:
        raise CondRegError("kind", f"{where}: kind must be 'ill' or 'well', got {kind!r}")
    if rtol is not None and not 0 <= rtol < 1:
        raise CondRegError("rtol", f"{where}: rtol must be a number in [0, 1), got {rtol!r}")
    _check_default_rtol(Z, rtol, where)
    H = Z.T @ Z
    D = H.shape[0]
    lam = torch.linalg.eigvalsh(H)
    fro2 = (H * H).sum()
    eps = torch.finfo(Z.dtype).eps
    lmax = float(lam[-1].detach())
    k = int((lam.detach() > (D * eps if rtol is None else rtol) * lmax).sum()) if lmax > 0 else 0
    if k == 0 or not math.isfinite(lmax * lmax):
        raise CondRegError(
            "Z", f"{where}: Z gives ZᵀZ = 0, NaN or eigenvalues whose squares overflow"
        )
    if kind == "well":
        value = 0.5 * lam[-1] ** 2 - fro2 / (2 * D)
    else:
        d = fro2 / (2 * k) - 0.5 * lam[-k] ** 2
        # κ = 1 up to round-off, as in the op
        if k < 2 or not float(d.detach()) > 4 * k * eps * lmax * lmax:
            kappa = lmax / float(lam[-k].detach())
            raise CondRegError(
                "Z", f"{where}: Z gives an undefined R_ill (rank {k}, κ = {kappa:.3g})"
            )
        value = 1.0 / d
    if not math.isfinite(float(value.detach())):
        raise CondRegError(
            "Z", f"{where}: R_{kind} of Z overflows {Z.dtype}: rescale the features"
        )
    return value


def _precondition_right(X: torch.Tensor, lambda_reg: float, grad_W: torch.Tensor) -> torch.Tensor:
    """The fallback's ``grad_W (XᵀX + λI)⁻¹``: a plain D×D Cholesky solve in float64."""
    X64 = X.double()
    L, info = torch.linalg.cholesky_ex(
        torch.addmm(lambda_reg * torch.eye(X.shape[1]).to(X64), X64.T, X64)
    )
    if int(info):
        raise CondRegError(
            "lambda_reg",
            f"ImmunizationHead: XᵀX + λI is not positive definite in float64 (lambda_reg="
            f"{lambda_reg}): use a larger lambda_reg",
        )
    return torch.cholesky_solve(grad_W.double().T, L).T.to(grad_W.dtype)


def precond_linear(X, W, bias=None, lambda_reg: float = 1e-7, precondition: bool = True):
    """``X Wᵀ + b`` whose weight gradient is ``(grad_outᵀX)(XᵀX + λI)⁻¹``.

    The preconditioner multiplies the weight gradient on the right (docs/theory.md §4).
    """
    if _HAS_EXTENSION:
        return _run(
            "precond_linear",
            "X",
            torch.ops.pycore.precond_linear,
            X,
            W,
            bias,
            float(lambda_reg),
            bool(precondition),
        )
    if precondition and W.requires_grad and torch.is_grad_enabled():
        W = W.view_as(W)  # the hook on this view rewrites the gradient that reaches the parameter
        W.register_hook(functools.partial(_precondition_right, X.detach(), float(lambda_reg)))
    return F.linear(X, W, bias)


class ImmunizationHead(nn.Module):
    """The paper's identity-initialised D×D dummy layer (App. C.3).

    ``z = x Wᵀ (+ b)``, ``grad_W ← grad_W (XᵀX + λI)⁻¹``, ``K⁻¹∇_θR`` of Algorithm 1 line 6 for ``W
    = θᵀ`` (docs/theory.md §4: on the right; the authors' code multiplies on the left).
    """

    def __init__(
        self,
        dim: int,
        lambda_reg: float = 1e-7,
        precondition: bool = True,
        bias: bool = False,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not (isinstance(dim, int) and dim >= 1):
            raise CondRegError("dim", f"ImmunizationHead: dim must be a positive int, got {dim!r}")
        self.dim, self.lambda_reg, self.precondition = dim, float(lambda_reg), bool(precondition)
        self.weight = nn.Parameter(torch.eye(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return precond_linear(x, self.weight, self.bias, self.lambda_reg, self.precondition)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, lambda_reg={self.lambda_reg:g}, precondition={self.precondition}"
