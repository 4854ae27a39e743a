"""The immunization layer on frozen features IS the linear problem.

docs/theory.md §10, docs/design.md §4: with the layer's inputs ``X_P``, ``X_H`` (the backbone's
pre-logits, rows = samples) and ``W = θᵀ``, the features are ``Z = Xθ`` and every quantity of the
linear core applies.

* :func:`adaptive_layer` trains θ by the linear default's adaptive rule
  (:func:`pycore._adaptive.adaptive_descent`, the same code) on the layer's features;
* :func:`kstep_layer` trains θ by the linear core's k-step immunizer (docs/theory.md §11, the
  same code) on the layer's features and the tasks' class labels;
* :func:`closed_form_layer` is the closed form at its balanced exponent (the linear core's
  ``closed_form``): the best any θ of this layer can do, with its Definition 3.1 window;
* :func:`set_layer` writes θ into an :class:`~pycore.deep.ImmunizedNet` and solves the D_P
  head exactly: the classifier becomes ``V(θᵀ)⁺``, so the D_P logits are θ₀'s (Definition
  3.1(c): every invertible θ leaves D_P's best head as good as before).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.linalg
import torch

from pycore import LinearTask, immunize
from pycore._adaptive import AdaptiveSettings, adaptive_descent
from pycore._batch import GramStack
from pycore._closed_form import auto_exponent, closed_form
from pycore._metrics import ExponentWindow, def31_exponent_window, rir_ceiling
from pycore._precondition import FactorPreconditioner
from pycore._spectral import (
    ProductGramSpectrum,
    RowFactor,
    SpectrumError,
    numerical_rank,
)
from pycore._threads import bounded_blas
from pycore._validation import ParameterError, check_choice

# The adaptive rule's Adam moves every entry of θ by about lr per step, ‖Δθ‖_F ≈ lr·D against
# ‖θ₀‖_F = ‖I‖_F = √D: a relative step of lr·√D. The linear default's lr 0.03 on House Prices
# (D = 79) is a relative step of 0.27; the layer keeps that relative step at any width.
RELATIVE_STEP = 0.03 * np.sqrt(79.0)


def relative_step_lr(D: int) -> float:
    """The adaptive rule's lr for a D×D layer: :data:`RELATIVE_STEP` / √D."""
    return float(RELATIVE_STEP / np.sqrt(D))


@dataclass(frozen=True)
class LayerSolution:
    """A θ for the layer and what is known about it on the rows it was computed from.

    (i), (ii) (exact κ's of all rows, docs/theory.md §8), the RIR ceiling, the closed form's
    Definition 3.1 window (``None`` when κ(C) = 1, or with a NaN ceiling when the features are
    float32 round-off's, :func:`attainability`), why the run ended, and where it started.
    """

    theta: np.ndarray
    harmful_ratio: float
    pretrain_ratio: float
    ceiling: float  # sup RIR over θ restricted to range(K_P) (docs/theory.md §10); NaN: unresolved
    window: ExponentWindow | None
    reason: str
    steps: int = 0
    history: dict = field(default_factory=dict)
    # where the adaptive rule started: "closed_form", "identity", or "none" (no step: refused)
    start: str = "closed_form"

    @property
    def immunized(self) -> bool:
        return bool(self.harmful_ratio > 1 > self.pretrain_ratio)


def _rows(X: np.ndarray) -> np.ndarray:
    """``X`` with the same Gram matrix and fewer rows.

    Its R factor when N > D (``XᵀX = RᵀR``, so every κ, regularizer and preconditioner of θ is
    unchanged).
    """
    X = np.asarray(X, dtype=np.float64)
    return np.linalg.qr(X, mode="r") if X.shape[0] > X.shape[1] else X


def resolution(dtype, *features) -> float:
    """The σ_min/σ_max below which features stored in a float type resolve no direction.

    ``eps(dtype)·‖Z‖_F/‖Z‖₂``, the largest over the given feature matrices. Rounding each entry of
    Z to ``dtype`` is a perturbation E with ``‖E‖₂ ≤ ‖E‖_F ≤ (eps/2)‖Z‖_F``, and by Weyl's
    inequality it moves every singular value of Z by at most that: a direction whose σ lies below
    ``eps·‖Z‖_F`` may be rounding alone (the arithmetic inside the network may have lost more; this
    is the floor no computation in ``dtype`` gets under). ``‖Z‖₂²`` is the largest eigenvalue of
    the smaller Gram matrix of Z (to ~n·eps relative, far inside what a floor needs; a full SVD of
    a 500×2048 Z costs 20× more).

    Parameters
    ----------
    dtype : torch.dtype or numpy float type
        The type the features were stored in.
    *features : array_like
        Feature matrices (rows = samples).

    Returns
    -------
    float
        The floor.
    """
    eps = torch.finfo(dtype).eps if isinstance(dtype, torch.dtype) else np.finfo(dtype).eps
    ratios = []
    for Z in features:
        Z = np.asarray(Z, dtype=np.float64)
        G = Z @ Z.T if Z.shape[0] <= Z.shape[1] else Z.T @ Z
        top = scipy.linalg.eigvalsh(G, subset_by_index=[len(G) - 1, len(G) - 1])[0]
        ratios.append(np.linalg.norm(Z) / np.sqrt(top))
    return float(eps * max(ratios))


def attainability(X_P, X_H, *, precision=None) -> tuple[float, ExponentWindow | None, str]:
    """Whether Definition 3.1 is attainable by any θ of the layer, on its features.

    The range-restricted RIR ceiling of the layer's features and the closed form's Definition 3.1
    window. A task whose σ_min/σ_max lies below :func:`resolution` has a direction that is
    round-off (a LayerNorm without bias leaves every feature row summing to zero), its κ is that
    round-off's: no window is reported, the ceiling is NaN (a ratio of round-off κ's is no
    ceiling), and the sentence says why. The R factor of X has X's singular values, so the floor is
    the same on either.

    Parameters
    ----------
    X_P, X_H : array_like, shape (N_P, D) and (N_H, D)
        The layer's inputs (the backbone's pre-logits) on D_P and D_H.
    precision : torch.dtype or numpy float type, optional
        The float type the features were computed in (float32 for a float32 network); None: exact.

    Returns
    -------
    ceiling : float
        The range-restricted RIR ceiling (NaN when the features are not resolved).
    window : ExponentWindow or None
        The closed form's window (None when κ(C) ≈ 1 or the features are not resolved).
    reason : str
        One sentence: whether some θ of the layer meets Definition 3.1, or why none can be told.

    Raises
    ------
    ValueError
        Features that are not finite real matrices.
    SpectrumError
        Zero features.
    """
    c, window, why, resolved = _reach(X_P, X_H, precision)
    return (c.range_restricted if resolved else float("nan")), window, why


def _reach(X_P, X_H, precision):
    """:func:`attainability`'s answer with the whole :class:`~pycore.Ceiling`.

    Also whether the features are resolved in ``precision``.
    """
    c = rir_ceiling(X_P, X_H)
    floor = None if precision is None else resolution(precision, X_P, X_H)
    for task, kappa in (("D_P", c.kappa_K_P), ("D_H", c.kappa_K_H)):
        if floor is not None and kappa * floor * floor > 1:
            return (
                c,
                None,
                f"{task}'s features have σ_min/σ_max = {kappa**-0.5:.2g}, below what {precision} "
                f"storage resolves ({floor:.2g}): their smallest direction is round-off, so "
                "their κ's, and any Definition 3.1 window on them, say nothing about the model",
                False,
            )
    if not c.kappa_C > 1 + 1e-8:
        return c, None, "κ(C) ≈ 1: no θ of this layer changes the κ ratio", True
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
    return c, w, why, True


def _ratios(theta, X_P, X_H, ceiling) -> tuple[float, float]:
    """(i), (ii) of θ from the SVDs of the features (docs/theory.md §8).

    They are taken against the κ's of ``ceiling`` (the features' own, θ = I); θ's columns that are
    exactly zero (the closed form's past rank K_P) add only zero singular values and are left out.
    """
    live = np.flatnonzero(np.any(theta != 0, axis=0))
    kP, kH = (ProductGramSpectrum(X)(theta[:, live]).kappa for X in (X_P, X_H))
    return float(kH / ceiling.kappa_K_H), float(kP / ceiling.kappa_K_P)


class _Problem:
    """The layer's linear problem for :func:`pycore._adaptive.adaptive_descent`.

    Computed from the small side of every Gram matrix (docs/design.md §6): per task ``X = U diag(s)
    Vᵀ`` once (:class:`pycore.linalg.RowFactor`), ``F = diag(s)Vᵀθ`` (r×width), H's nonzero
    spectrum from the r×r ``W = FFᵀ`` (:class:`pycore.linalg.GramStack`) and the preconditioned
    directions as low-rank products (:class:`pycore._precondition.FactorPreconditioner`): no D×D H,
    G or eigendecomposition. One evaluation per θ; the margin's κ's come from W's eigenvalues
    (relative error ≤ eps·κ(H), checked: above :data:`EIG_KAPPA_LIMIT` they come from the SVD of
    ``Xθ``, as in the linear core). ``ref``: κ(H_P), κ(H_H) of the given model's features, the
    denominators of (i) and (ii). Both K's of full rank: K⁺ = K⁻¹, the exact preconditioner 2θG
    (docs/theory.md §4), no projector; else K⁺ for both.
    """

    def __init__(self, X_P, X_H, ref):
        self.width = X_P.shape[1]
        self.factors = tuple(RowFactor.of(X) for X in (X_P, X_H))
        full = all(f.rank == self.width for f in self.factors)
        self.pre = tuple(
            FactorPreconditioner(f, "exact" if full else "pinv") for f in self.factors
        )
        self.spectra = tuple(ProductGramSpectrum(X) for X in (X_P, X_H))
        self.log_ref = tuple(float(np.log(k)) for k in ref)
        self._at, self._grams = None, None

    def grams(self, theta):
        if self._at is not theta:
            self._at, self._grams = None, None
            grams = tuple(GramStack(f.features(theta)[None], self.width) for f in self.factors)
            self._at, self._grams = theta, grams
        return self._grams

    def exact(self, theta):
        """(ln(i), ln(ii)) from the SVDs of the features (docs/theory.md §2)."""
        kP, kH = (spec(theta).kappa for spec in self.spectra)
        return np.log(kH) - self.log_ref[1], np.log(kP) - self.log_ref[0]

    def log_ratios(self, theta):
        try:
            gP, gH = self.grams(theta)
        except SpectrumError:
            return self.exact(theta)
        kP, kH = float(gP.kappa[0]), float(gH.kappa[0])
        if max(kP, kH) > EIG_KAPPA_LIMIT:
            return self.exact(theta)
        return np.log(kH) - self.log_ref[1], np.log(kP) - self.log_ref[0]

    def directions(self, theta):
        out = []
        for pre, gram, kind in zip(self.pre, self.grams(theta), ("well", "ill")):
            L, R = pre.parts(theta[None], gram, gram.term(kind), 1.0)
            out.append((L @ R)[0])
        return tuple(out)


# κ(H) from eigenvalues of H resolves λ_min to ~eps·λ_max: 1e11 keeps the margin's error < 1e-4.
EIG_KAPPA_LIMIT = 1e11


# A window of ``patience`` steps whose margin min(ln(i), −ln(ii)) gains less than this a step
# counts as one without gain (a restart at lr/3, or the end): 1e-4 a step is 3 % of (i) or
# 1/(ii) over the default 300 steps; at that rate the 5000-step budget gains at most e^0.5 = 1.65×.
MIN_GAIN_RATE = 1e-4

# Where the adaptive rule starts: the closed form at its window's balanced exponent (when the
# window is open), or θ = I (θ₀'s layer).
STARTS = ("closed_form", "identity")


def _closed_form(XP, XH, ceiling) -> tuple[np.ndarray, str]:
    """The linear core's closed form on the layer's features at its default exponent.

    The default is :func:`pycore._closed_form.auto_exponent`'s, the window's balanced one.
    """
    task = LinearTask(XP, np.zeros(len(XP)), XH, np.zeros(len(XH)), name="layer features")
    a, how = auto_exponent(task, ceiling)
    return closed_form(task, a, ceiling)[0], how


def _verdict(i: float, ii: float) -> str:
    return f"Definition 3.1 {'holds' if i > 1 > ii else 'does not hold'} on these rows: " + (
        f"(i) = {i:.4g}, (ii) = {ii:.4g}"
    )


@bounded_blas
def adaptive_layer(
    X_P,
    X_H,
    *,
    steps: int,
    patience: int,
    lr: float | None = None,
    precision=None,
    start: str = "closed_form",
    min_rate: float | None = MIN_GAIN_RATE,
    progress: bool = False,
) -> LayerSolution:
    """θ by the adaptive rule of the linear default on the layer's inputs (docs/design.md §4).

    All rows, in float64 (:func:`pycore._adaptive.adaptive_descent`). Before any step, features
    that ``precision`` does not resolve (:func:`attainability`) are refused: θ = I with no window
    and a NaN ceiling. ``start="closed_form"`` (when the closed form's window is open) starts from
    the closed form at the window's balanced exponent, ``S`` (D×r, r = rank K_P): the rule runs on
    the closed form's features ``XS`` from θ' = I and ``θ = Sθ'`` (its D − r other columns zero, as
    the closed form's). Such a θ reads only range(K_P), so no θ of this form has a margin
    min(ln(i), −ln(ii)) above ``min(½ ln ceiling, ln κ(K_P))`` (docs/theory.md §10; (ii) ≥ 1/κ(K_P)
    for every θ), and the run ends once it is within :data:`pycore._adaptive.PROGRESS_TOL` of that
    bound: from the balanced exponent, at step 0. Otherwise (``"identity"``, or no open window) the
    rule runs from θ = I, its bound ``min(½ ln exact ceiling, ln κ(K_P))`` (the exact ceiling is
    infinite when D_H varies where D_P does not). Every step works on the small side of the Gram
    matrices. The kept θ's (i) and (ii) are exact (SVD).

    Parameters
    ----------
    X_P, X_H : array_like, shape (N_P, D) and (N_H, D)
        The layer's inputs on D_P and D_H.
    steps : int
        The most steps of the rule.
    patience : int
        As for :func:`pycore._adaptive.adaptive_descent`.
    lr : float, optional
        Adam's learning rate (default :func:`relative_step_lr` of θ's width).
    precision : torch.dtype or numpy float type, optional
        As for :func:`attainability`.
    start : {"closed_form", "identity"}, default "closed_form"
        Where the rule starts.
    min_rate : float, optional
        As for :func:`pycore._adaptive.adaptive_descent` (default :data:`MIN_GAIN_RATE`).
    progress : bool, default False
        A bar on a terminal.

    Returns
    -------
    LayerSolution
        θ (D×D), its exact (i) and (ii), the ceiling, the window, why the run ended, its steps,
        history and start.

    Raises
    ------
    ParameterError
        An unknown ``start``.
    DivergenceError
        An Adam step became non-finite.
    """
    check_choice(start, "start", STARTS)
    XP, XH = _rows(X_P), _rows(X_H)
    D = XP.shape[1]
    c, window, why, resolved = _reach(XP, XH, precision)
    if not resolved:
        return LayerSolution(
            np.eye(D), 1.0, 1.0, float("nan"), None, f"no step taken: {why}", 0, {}, "none"
        )
    log_kP = float(np.log(c.kappa_K_P))
    if start == "closed_form" and window is not None and not window.empty:
        theta, how = _closed_form(XP, XH, c)
        S = theta[:, : c.rank_K_P]
        Xs, bound = (XP @ S, XH @ S), min(0.5 * float(np.log(c.range_restricted)), log_kP)
        begin = f"from the closed form at {how}"
    else:
        S, start, Xs = None, "identity", (XP, XH)
        bound, begin = min(0.5 * float(np.log(c.exact)), log_kP), "from θ = I"
    width = Xs[0].shape[1]
    problem = _Problem(*Xs, (c.kappa_K_P, c.kappa_K_H))
    run = adaptive_descent(
        np.eye(width),
        problem.log_ratios,
        problem.directions,
        AdaptiveSettings(
            lr=relative_step_lr(width) if lr is None else lr,
            epochs=steps,
            patience=patience,
            bound=bound,
            min_rate=min_rate,
        ),
        progress=progress,
    )
    theta = run.theta if S is None else np.pad(S @ run.theta, ((0, 0), (0, D - width)))
    i, ii = _ratios(theta, XP, XH, c)
    met = i > 1 > ii
    reason = f"adaptive rule {begin}: {run.stop}; best margin at step {run.best_step}; "
    reason += _verdict(i, ii)
    if not met:
        reason += f": {why}" + (
            "; the miss is the method's" if window is not None and not window.empty else ""
        )
    elif window is None:  # met where the closed form's window says nothing
        reason += f"; but {why}"
    return LayerSolution(
        theta, i, ii, c.range_restricted, window, reason, run.steps, run.history, start
    )


def _one_hot(y, n_rows: int, name: str, num_classes) -> np.ndarray:
    """Integer class labels ``y`` (N,) as an N×C one-hot matrix.

    C is ``num_classes`` or the largest label + 1; a bad label is a ParameterError naming ``name``.
    """
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
    lr: float | None = None,
    num_classes: tuple[int | None, int | None] = (None, None),
    precision=None,
) -> LayerSolution:
    """θ by the k-step immunizer on the layer's inputs and the tasks' class labels.

    The linear core's ``immunize(task, "kstep")`` (docs/theory.md §11) on one-hot targets with the
    deep probe's bias column, from θ = I, at most ``epochs`` steps of the adaptive rule. E_k
    depends on the targets, so the R factor that keeps only XᵀX does not suffice: the immunizer
    works on X's thin SVD ``X = U diag(s) Vᵀ`` with the targets kept as ``UᵀY`` and the part of the
    bias column outside range(U) (:class:`pycore.linalg.KStepProbe`); the residual
    ``‖(I − UUᵀ)Y‖`` enters L(W_k) and L* alike and cancels from E_k.

    Parameters
    ----------
    X_P, X_H : array_like, shape (N_P, D) and (N_H, D)
        The layer's inputs on D_P and D_H.
    y_P, y_H : array_like of int
        The tasks' class labels.
    steps : int, default 10
        k, the GD probe's steps.
    epochs : int, default 5000
        The most steps of the adaptive rule.
    patience : int, default 300
        As for :func:`pycore._adaptive.adaptive_descent`.
    lr : float, optional
        Adam's learning rate (default :func:`relative_step_lr`).
    num_classes : pair of int or None, default (None, None)
        (C_P, C_H); None: the largest label + 1.
    precision : torch.dtype or numpy float type, optional
        As for :func:`attainability`.

    Returns
    -------
    LayerSolution
        θ, the exact κ ratios (i), (ii) of all rows, the ceiling, the window; the k-step ratios are
        in ``reason`` and in ``history`` (``kstep_harmful_ratio``, ``kstep_pretrain_ratio`` per
        step).

    Raises
    ------
    ParameterError
        Labels that are not non-negative integers of the rows' count, or beyond ``num_classes``
        (``.parameter`` names ``y_P`` or ``y_H``); options out of bounds.
    """
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
    """The closed form (docs/theory.md §10) on the layer's inputs at its default exponent.

    The linear core's ``closed_form`` at the window's balanced exponent; on features ``precision``
    does not resolve, the closed form still, on their κ's, with a NaN ceiling and no window.

    Parameters
    ----------
    X_P, X_H : array_like, shape (N_P, D) and (N_H, D)
        The layer's inputs on D_P and D_H.
    precision : torch.dtype or numpy float type, optional
        As for :func:`attainability`.

    Returns
    -------
    LayerSolution
        θ, its exact (i) and (ii), the ceiling, the window and the verdict.

    Raises
    ------
    ValueError
        ``X_P`` or ``X_H`` not a finite real matrix.
    SpectrumError
        ``X_P`` or ``X_H`` zero.
    """
    XP, XH = _rows(X_P), _rows(X_H)
    c, window, why, resolved = _reach(XP, XH, precision)
    theta, how = _closed_form(XP, XH, c)
    i, ii = _ratios(theta, XP, XH, c)
    ceiling = c.range_restricted if resolved else float("nan")
    return LayerSolution(theta, i, ii, ceiling, window, f"{how}; {_verdict(i, ii)}. {why}")


@torch.no_grad()
def set_layer(model, theta: np.ndarray) -> float:
    """Write θ into ``model``'s layer (``W = θᵀ``) and the D_P head that keeps θ₀'s logits.

    ``V ← V(θᵀ)⁺`` in float64 (a bias of the layer ``b ← θᵀb``); returns κ(θ) over its nonzero
    spectrum (how much float32 rounding of ``W`` the compensation amplifies).
    """
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
