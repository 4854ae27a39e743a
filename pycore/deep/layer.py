"""The immunization layer on frozen features IS the linear problem (docs/theory.md §10,
docs/design.md §4): with the layer's inputs ``X_P``, ``X_H`` (the backbone's pre-logits, rows =
samples) and ``W = θᵀ``, the features are ``Z = Xθ`` and every quantity of the linear core applies.

* :func:`adaptive_layer` trains θ by the linear default's adaptive rule
  (:func:`pycore.adaptive.adaptive_descent`, the same code) on the layer's features;
* :func:`kstep_layer` trains θ by the linear core's k-step immunizer (docs/theory.md §11, the
  same code) on the layer's features and the tasks' class labels;
* :func:`closed_form_layer` is the closed form at its balanced exponent (the linear core's
  ``closed_form``): the best any θ of this layer can do, with its Definition 3.1 window;
* :func:`set_layer` writes θ into an :class:`~pycore.deep.models.ImmunizedNet` and solves the D_P
  head exactly: the classifier becomes ``V(θᵀ)⁺``, so the D_P logits are θ₀'s (Definition
  3.1(c): every invertible θ leaves D_P's best head as good as before)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pycore.adaptive import adaptive_descent, kappa_log_ratios
from pycore import LinearTask, immunize
from pycore.metrics import ExponentWindow, def31_exponent_window, rir_ceiling
from pycore.precondition import Preconditioner
from pycore.regularizers import hessian_regularizer
from pycore.spectral import SpectrumError, gram_spectrum, numerical_rank
from pycore.threads import bounded_blas
from pycore.validation import ParameterError

__all__ = [
    "LayerSolution",
    "adaptive_layer",
    "kstep_layer",
    "closed_form_layer",
    "attainability",
    "resolution",
    "set_layer",
    "relative_step_lr",
]

# The adaptive rule's Adam moves every entry of θ by about lr per step, ‖Δθ‖_F ≈ lr·D against
# ‖θ₀‖_F = ‖I‖_F = √D: a relative step of lr·√D. The linear default's lr 0.03 on House Prices
# (D = 79) is a relative step of 0.27; the layer keeps that relative step at any width.
RELATIVE_STEP = 0.03 * np.sqrt(79.0)


def relative_step_lr(D: int) -> float:
    """The adaptive rule's lr for a D×D layer: :data:`RELATIVE_STEP` / √D."""
    return float(RELATIVE_STEP / np.sqrt(D))


@dataclass(frozen=True)
class LayerSolution:
    """A θ for the layer and what is known about it on the rows it was computed from: (i), (ii)
    (exact κ's of all rows, docs/theory.md §8), the RIR ceiling, the closed form's Definition 3.1
    window (``None`` when κ(C) = 1) and why the run ended."""

    theta: np.ndarray
    harmful_ratio: float
    pretrain_ratio: float
    ceiling: float  # sup RIR over θ restricted to range(K_P) (docs/theory.md §10)
    window: "ExponentWindow | None"
    reason: str
    steps: int = 0
    history: dict = field(default_factory=dict)

    @property
    def immunized(self) -> bool:
        return bool(self.harmful_ratio > 1 > self.pretrain_ratio)


def _rows(X: np.ndarray) -> np.ndarray:
    """``X`` with the same Gram matrix and fewer rows: its R factor when N > D (``XᵀX = RᵀR``, so
    every κ, regularizer and preconditioner of θ is unchanged)."""
    X = np.asarray(X, dtype=np.float64)
    return np.linalg.qr(X, mode="r") if X.shape[0] > X.shape[1] else X


def resolution(dtype, *features) -> float:
    """The σ_min/σ_max below which features stored in ``dtype`` (a torch or NumPy float type)
    resolve no direction: ``eps(dtype)·‖Z‖_F/‖Z‖₂``, the largest over the given feature matrices.

    Rounding each entry of Z to ``dtype`` is a perturbation E with ``‖E‖₂ ≤ ‖E‖_F ≤
    (eps/2)‖Z‖_F``, and by Weyl's inequality it moves every singular value of Z by at most that:
    a direction whose σ lies below ``eps·‖Z‖_F`` may be rounding alone (the arithmetic inside the
    network may have lost more; this is the floor no computation in ``dtype`` gets under)."""
    eps = torch.finfo(dtype).eps if isinstance(dtype, torch.dtype) else np.finfo(dtype).eps
    ratios = []
    for Z in features:
        Z = np.asarray(Z, dtype=np.float64)
        ratios.append(np.linalg.norm(Z) / np.linalg.norm(Z, 2))
    return float(eps * max(ratios))


def attainability(X_P, X_H, *, precision=None) -> tuple[float, "ExponentWindow | None", str]:
    """The range-restricted RIR ceiling of the layer's features, the closed form's Definition 3.1
    window, and a sentence saying whether Definition 3.1 is attainable by any θ of the layer.

    ``precision``: the float type the features were computed in (float32 for a float32 network;
    None: exact). A task whose σ_min/σ_max lies below :func:`resolution` has a direction that is
    round-off (a LayerNorm without bias leaves every feature row summing to zero), its κ is that
    round-off's, and no window is reported (``None``, the sentence says why). The R factor of X
    has X's singular values, so the floor is the same on either."""
    c = rir_ceiling(X_P, X_H)
    floor = None if precision is None else resolution(precision, X_P, X_H)
    for task, kappa in (("D_P", c.kappa_K_P), ("D_H", c.kappa_K_H)):
        if floor is not None and kappa * floor * floor > 1:
            return (
                c.range_restricted,
                None,
                f"{task}'s features have σ_min/σ_max = {kappa**-0.5:.2g}, below what {precision} "
                f"storage resolves ({floor:.2g}): their smallest direction is round-off, so "
                "their κ's, and any Definition 3.1 window on them, say nothing about the model",
            )
    if not c.kappa_C > 1 + 1e-8:
        return c.range_restricted, None, "κ(C) ≈ 1: no θ of this layer changes the κ ratio"
    w = def31_exponent_window(c)
    if w.empty:
        why = (
            f"the closed form's Definition 3.1 window on these features is empty "
            f"([{w.low:.3g}, {w.high:.3g}), range-restricted RIR ceiling "
            f"{c.range_restricted:.4g}): no θ of this layer meets Definition 3.1 on them"
        )
    else:
        why = (
            f"the closed form's Definition 3.1 window on these features is [{w.low:.3g}, "
            f"{w.high:.3g}) (RIR ceiling {c.range_restricted:.4g}): some θ of this layer meets it"
        )
    return c.range_restricted, w, why


def _ratios(theta, X_P, X_H) -> tuple[float, float]:
    a, b = kappa_log_ratios(X_P, X_H, np.eye(X_P.shape[1]))(theta)
    return float(np.exp(a)), float(np.exp(b))


class _Problem:
    """The layer's linear problem for :func:`pycore.adaptive.adaptive_descent`, one evaluation
    per θ: the eigen-decompositions of ``H_P``, ``H_H`` that the step's directions need also give
    the margin's κ's (relative error ≤ eps·κ(H), checked: above :data:`EIG_KAPPA_LIMIT` the κ's
    come from the SVD of ``Xθ``, as in the linear core); the denominators are exact."""

    def __init__(self, X_P, X_H, precond: str):
        self.X = (X_P, X_H)
        self.pre = tuple(Preconditioner(X.T @ X, precond, 0.0, X) for X in self.X)
        self.exact = kappa_log_ratios(X_P, X_H, np.eye(X_P.shape[1]))
        self.ref = tuple(
            gram_spectrum(X, vectors=False).kappa for X in self.X
        )  # κ(H_P(I)), κ(H_H(I))
        self._at, self._regs = None, None

    def _evaluate(self, theta):
        if self._at is not theta:
            Z = tuple(X @ theta for X in self.X)
            regs = (
                hessian_regularizer(Z[0], "well", matrices=False),
                hessian_regularizer(Z[1], "ill", matrices=False),
            )
            self._at, self._regs = theta, (Z, regs)
        return self._regs

    def log_ratios(self, theta):
        try:
            _, (rP, rH) = self._evaluate(theta)
        except SpectrumError:
            return self.exact(theta)
        if max(rP.info.kappa, rH.info.kappa) > EIG_KAPPA_LIMIT:
            return self.exact(theta)
        return np.log(rH.info.kappa / self.ref[1]), np.log(rP.info.kappa / self.ref[0])

    def directions(self, theta):
        (Z_P, Z_H), (rP, rH) = self._evaluate(theta)
        return self.pre[0].direction(theta, rP, Z_P), self.pre[1].direction(theta, rH, Z_H)


# κ(H) from eigenvalues of H resolves λ_min to ~eps·λ_max: 1e11 keeps the margin's error < 1e-4.
EIG_KAPPA_LIMIT = 1e11


@bounded_blas
def adaptive_layer(
    X_P,
    X_H,
    *,
    steps: int,
    patience: int,
    lr: "float | None" = None,
    precision=None,
):
    """θ by the adaptive rule of the linear default on the layer's inputs (all rows, float64),
    from θ = I (θ₀'s layer), at ``lr`` (default :func:`relative_step_lr`); the kept θ's (i) and
    (ii) are exact (SVD); ``precision`` as in :func:`attainability`."""
    XP, XH = _rows(X_P), _rows(X_H)
    D = XP.shape[1]
    ceiling, window, why = attainability(XP, XH, precision=precision)
    # a full-rank K: K⁺ = K⁻¹, the exact preconditioner 2θG (docs/theory.md §4), no projector
    full = all(numerical_rank(np.linalg.svd(X, compute_uv=False), X.shape) == D for X in (XP, XH))
    problem = _Problem(XP, XH, "exact" if full else "pinv")
    run = adaptive_descent(
        np.eye(D),
        problem.log_ratios,
        problem.directions,
        lr=relative_step_lr(D) if lr is None else lr,
        epochs=steps,
        patience=patience,
    )
    i, ii = _ratios(run.theta, XP, XH)
    met = i > 1 > ii
    reason = f"adaptive rule: {run.stop}; best margin at step {run.best_step}; Definition 3.1 " + (
        f"holds on these rows: (i) = {i:.4g}, (ii) = {ii:.4g}" if met else "does not hold"
    )
    if not met:
        reason += f" ((i) = {i:.4g}, (ii) = {ii:.4g}): {why}" + (
            "; the miss is the method's" if window is not None and not window.empty else ""
        )
    elif window is None:  # met, on κ's that round-off may have made
        reason += f"; but {why}"
    return LayerSolution(run.theta, i, ii, ceiling, window, reason, run.steps, run.history)


def _one_hot(y, n_rows: int, name: str, num_classes) -> np.ndarray:
    """Integer class labels ``y`` (N,) as an N×C one-hot matrix (C = ``num_classes`` or the
    largest label + 1), or a ParameterError naming ``name``."""
    y = np.asarray(y)
    if y.ndim != 1 or y.shape[0] != n_rows or y.dtype.kind not in "iu" or (y.size and y.min() < 0):
        raise ParameterError(
            name,
            f"{name} must be {n_rows} non-negative integer class labels (one per feature row), "
            f"got shape {y.shape}, dtype {y.dtype}",
        )
    C = int(y.max()) + 1 if num_classes is None else int(num_classes)
    if y.max() >= C:
        raise ParameterError(name, f"{name} has label {int(y.max())} ≥ num_classes = {C}")
    out = np.zeros((n_rows, C))
    out[np.arange(n_rows), y] = 1.0
    return out


@bounded_blas
def kstep_layer(
    X_P,
    y_P,
    X_H,
    y_H,
    *,
    steps: int = 10,
    epochs: int = 5000,
    patience: int = 300,
    lr: "float | None" = None,
    num_classes: "tuple[int | None, int | None]" = (None, None),
    precision=None,
) -> LayerSolution:
    """θ by the k-step immunizer (``immunize(task, "kstep")``, docs/theory.md §11) on the layer's
    inputs and the tasks' integer class labels (one-hot targets, the bias column of the deep
    probe), from θ = I at ``lr`` (default :func:`relative_step_lr`), at most ``epochs`` steps of
    the adaptive rule; ``steps`` is k, the GD probe's steps. ``num_classes`` gives (C_P, C_H)
    (None: the largest label + 1); ``precision`` as in :func:`attainability`.

    E_k depends on the targets, so the R factor of :func:`_rows` (which keeps only XᵀX) does not
    suffice: the immunizer works on X's thin SVD ``X = U diag(s) Vᵀ`` with the targets kept as
    ``UᵀY`` and the part of the bias column outside range(U) (:class:`pycore.kstep.KStepProbe`);
    the residual ``‖(I − UUᵀ)Y‖`` enters L(W_k) and L* alike and cancels from E_k. The returned
    (i), (ii) are the exact κ ratios of all rows; the k-step ratios are in ``reason`` and in
    ``history`` (``kstep_harmful_ratio``, ``kstep_pretrain_ratio`` per step)."""
    X_P = np.asarray(X_P, dtype=np.float64)
    X_H = np.asarray(X_H, dtype=np.float64)
    Y_P = _one_hot(y_P, X_P.shape[0], "y_P", num_classes[0])
    Y_H = _one_hot(y_H, X_H.shape[0], "y_H", num_classes[1])
    D = X_P.shape[1]
    task = LinearTask(X_P, Y_P, X_H, Y_H, name="layer features")
    res = immunize(
        task,
        "kstep",
        rng=np.random.default_rng(0),
        steps=steps,
        epochs=epochs,
        patience=patience,
        lr=relative_step_lr(D) if lr is None else lr,
        bias=True,
    )
    ceiling, window, why = attainability(_rows(X_P), _rows(X_H), precision=precision)
    return LayerSolution(
        res.theta,
        res.harmful_ratio,
        res.pretrain_ratio,
        ceiling,
        window,
        f"k-step immunizer: {res.reason} {why}",
        res.diagnostics["steps"],
        res.history,
    )


@bounded_blas
def closed_form_layer(X_P, X_H, *, precision=None) -> LayerSolution:
    """The closed form (docs/theory.md §10) on the layer's inputs at its default exponent (the
    linear core's ``closed_form``: the balanced one of the window, clamped into it);
    ``precision`` as in :func:`attainability`."""
    XP, XH = _rows(X_P), _rows(X_H)
    ceiling, window, why = attainability(XP, XH, precision=precision)
    task = LinearTask(XP, np.zeros(len(XP)), XH, np.zeros(len(XH)), name="layer features")
    res = immunize(task, "closed_form", rng=np.random.default_rng(0))
    return LayerSolution(
        res.theta, res.harmful_ratio, res.pretrain_ratio, ceiling, window, f"{res.reason} {why}"
    )


@torch.no_grad()
def set_layer(model, theta: np.ndarray) -> float:
    """Write θ into ``model``'s layer (``W = θᵀ``) and the D_P head that keeps θ₀'s logits:
    ``V ← V(θᵀ)⁺`` in float64 (a bias of the layer ``b ← θᵀb``); returns κ(θ) over its nonzero
    spectrum (how much float32 rounding of ``W`` the compensation amplifies)."""
    layer, head = model.layer, model.classifier
    T = torch.as_tensor(np.asarray(theta, dtype=np.float64), device=layer.weight.device)
    W0 = layer.weight.double()
    layer.weight.copy_((T.T @ W0).to(layer.weight.dtype))
    if getattr(layer, "bias", None) is not None:
        layer.bias.copy_((T.T @ layer.bias.double()).to(layer.bias.dtype))
    head.weight.copy_((head.weight.double() @ torch.linalg.pinv(T.T)).to(head.weight.dtype))
    s = np.linalg.svd(np.asarray(theta, dtype=np.float64), compute_uv=False)
    s = s[: numerical_rank(s, s.shape * 2)]
    return float(s[0] / s[-1])
