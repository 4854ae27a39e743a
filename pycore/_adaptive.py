"""The adaptive rule of Algorithm 1 (docs/design.md §4).

One implementation for the linear default (:func:`pycore._methods.algorithm1_auto`) and the deep
immunization layer (:mod:`pycore.deep._layer`, whose D×D map on frozen features IS the linear
problem).

Adam from a given θ on ``(1 − w)·d_P/‖d_P‖_F + w·d_H/‖d_H‖_F``, with ``d_P = K_P⁺∇_θR_well(H_P)``
and ``d_H = K_H⁺∇_θR_ill(H_H)`` (docs/theory.md §4, §6) and ``w = σ(−γ(ln(i) + ln(ii)))``
re-measured at every step, so the run aims at ln(i) = −ln(ii) in the units of neither task. The
iterate of largest margin ``min(ln(i), −ln(ii))`` is kept; once the margin is positive,
``patience`` steps without a gain of :data:`PROGRESS_TOL` restart Adam from it at lr/3; before
that, ``4·patience`` steps with no iterate of positive margin restart it from the starting θ at
lr/3 (a step too large for the features' conditioning makes both κ's jump and the run never
recovers). :data:`RESTARTS` restarts in all, then the run stops. Two optional stops bound the
steps by what the margin can still gain: a known ``bound`` on the margin (the run ends once its
best margin is within :data:`PROGRESS_TOL` of it: no θ can gain more) and a ``min_rate`` (a
window of ``patience`` steps whose margin gain is below ``min_rate·patience`` counts as a window
without gain: restart, or stop). Who calls it decides what (i) and (ii) are measured on
(``log_ratios``): the linear core's exact κ's of all rows, or the deep layer's features.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pycore._optim import make_optimizer
from pycore._precondition import Preconditioner
from pycore._regularizers import hessian_regularizer
from pycore._report import progress as progress_bar
from pycore._spectral import ProductGramSpectrum, SpectrumError

# The rule's constants: the gain of the balance (w moves from 0.5 to 0.98 when ln(i) and −ln(ii)
# differ by 0.5), the margin gain that counts as progress, the lr divisions before stopping.
BALANCE_GAIN, PROGRESS_TOL, RESTARTS = 8.0, 1e-3, 2


@dataclass(frozen=True)
class AdaptiveRun:
    """What :func:`adaptive_descent` did.

    The kept θ, its margin ``min(ln(i), −ln(ii))`` (≤ 0: no iterate met Definition 3.1), the step
    it was found at, the steps taken, the restarts, why the run stopped, and per step (i), (ii) and
    the weight of the R_ill term.
    """

    theta: np.ndarray
    margin: float
    best_step: int
    steps: int
    restarts: int
    stop: str
    history: dict = field(default_factory=dict)


def kappa_log_ratios(X_P: np.ndarray, X_H: np.ndarray, theta_ref: np.ndarray) -> Callable:
    """The exact ``(ln(i), ln(ii))`` of a θ of a linear task, as a function.

    ``θ ↦ (ln(i), ln(ii))`` from the exact κ's of ``X_Hθ`` and ``X_Pθ`` (one QR of each X,
    :class:`pycore._spectral.ProductGramSpectrum`) against those at ``theta_ref``.
    """
    spec_P, spec_H = ProductGramSpectrum(X_P), ProductGramSpectrum(X_H)
    kP0, kH0 = spec_P(theta_ref).kappa, spec_H(theta_ref).kappa

    def log_ratios(theta):
        return np.log(spec_H(theta).kappa / kH0), np.log(spec_P(theta).kappa / kP0)

    return log_ratios


def regularizer_directions(
    X_P: np.ndarray,
    X_H: np.ndarray,
    *,
    precond: str = "pinv",
    ridge: float = 0.0,
    K_P: np.ndarray | None = None,
    K_H: np.ndarray | None = None,
) -> Callable:
    """The two preconditioned regularizer directions of a linear task, as a function.

    ``θ ↦ (K_P⁺∇_θR_well(H_P), K_H⁺∇_θR_ill(H_H))`` (docs/theory.md §4; ``precond`` as
    :class:`pycore._precondition.Preconditioner`, ``K = XᵀX`` unless given); raises
    ``SpectrumError`` where R has no value.
    """
    pre_P = Preconditioner(X_P.T @ X_P if K_P is None else K_P, precond, ridge, X_P)
    pre_H = Preconditioner(X_H.T @ X_H if K_H is None else K_H, precond, ridge, X_H)

    def directions(theta):
        Z_P, Z_H = X_P @ theta, X_H @ theta
        reg_P = hessian_regularizer(Z_P, "well", matrices=False)
        reg_H = hessian_regularizer(Z_H, "ill", matrices=False)
        return pre_P.direction(theta, reg_P, Z_P), pre_H.direction(theta, reg_H, Z_H)

    return directions


@dataclass(frozen=True)
class AdaptiveSettings:
    """How :func:`adaptive_descent` steps and when it stops.

    Attributes
    ----------
    lr : float
        Adam's first learning rate; each restart divides it by 3.
    epochs : int
        The most steps.
    patience : int
        Steps without margin gain before a restart (``4·patience`` before any positive margin).
    betas : pair of float, default (0.9, 0.999)
        Adam's moment decays.
    adam_eps : float, default 1e-8
        Adam's ε.
    bound : float, default inf
        An upper bound of the margin over every θ the run can reach (the deep layer's,
        docs/theory.md §10); the run ends, before its next step, once its best margin is within
        :data:`PROGRESS_TOL` of it (a bound ≤ 0 ends it before the first step).
    min_rate : float, optional
        The least margin gain per step that counts as progress once the margin is positive,
        measured over windows of ``patience`` steps; None: only :data:`PROGRESS_TOL` since the best
        iterate counts.
    """

    lr: float
    epochs: int
    patience: int
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    bound: float = np.inf
    min_rate: float | None = None


def _unit(a):
    n = np.linalg.norm(a)
    return a / n if n > 0 else a


def adaptive_descent(
    theta: np.ndarray,
    log_ratios: Callable,
    directions: Callable,
    settings: AdaptiveSettings,
    *,
    progress: bool = False,
) -> AdaptiveRun:
    """The adaptive rule (module docstring) from a given θ.

    At most ``epochs`` steps. A margin that stays ≤ 0 for ``4·patience`` steps restarts the run
    from ``theta`` at lr/3 (one of the :data:`RESTARTS`), or ends it when none is left; a
    ``SpectrumError`` of ``directions`` ends it at that step.

    Parameters
    ----------
    theta : ndarray
        The starting θ (any shape ``directions`` and ``log_ratios`` take).
    log_ratios : callable
        ``θ ↦ (ln(i), ln(ii))``, exact: they choose the kept iterate
        (:func:`kappa_log_ratios` for a linear task).
    directions : callable
        ``θ ↦ (d_P, d_H)``, the two preconditioned regularizer directions
        (:func:`regularizer_directions`).
    settings : AdaptiveSettings
        The learning rate, the step budget, the patience, Adam's constants and the stops.
    progress : bool, default False
        A bar on a terminal (:func:`pycore._report.progress`) over the ``epochs`` steps, its time
        left an upper bound (the run can stop early).

    Returns
    -------
    AdaptiveRun
        The kept θ (largest margin ``min(ln(i), −ln(ii))``), its margin and step, the steps taken,
        the restarts, why the run stopped, and per step (i), (ii) and the weight of the R_ill term.

    Raises
    ------
    DivergenceError
        An Adam step became non-finite (``.parameter`` is ``"lr"``).
    """
    lr, epochs, patience = settings.lr, settings.epochs, settings.patience
    bound, min_rate = settings.bound, settings.min_rate
    make = lambda lr: make_optimizer(  # noqa: E731
        "adam", lr, settings.betas, settings.adam_eps, param="θ"
    )
    opt = make(lr)
    best, best_m, best_step, since, left = theta, 0.0, 0, 0, RESTARTS
    window = None  # (step, best margin) where the current min_rate window began
    hist = {"step": [], "harmful_ratio": [], "pretrain_ratio": [], "weight_h": []}
    stop = f"used the budget of {epochs} steps"
    bar = progress_bar(total=epochs, desc="adaptive rule") if progress else None
    step = 0
    try:
        for step in range(epochs + 1):
            a, neg_b = log_ratios(theta)
            b = -neg_b
            if min(a, b) > best_m + PROGRESS_TOL:
                best, best_m, best_step, since = theta, min(a, b), step, 0
            else:
                since += 1
            if best_m >= bound - PROGRESS_TOL:
                stop = (
                    f"stopped at step {step}: the margin {best_m:.4g} is within {PROGRESS_TOL:g} "
                    f"of its bound {bound:.4g}, which no θ exceeds"
                )
                break
            slow = False
            if min_rate is not None and best_m > 0:  # windows begin at the first positive margin
                if window is None:
                    window = (step, best_m)
                elif step - window[0] >= patience:
                    slow = best_m - window[1] < min_rate * (step - window[0])
                    window = (step, best_m)
            # before any iterate of positive margin the run waits 4·patience steps
            if slow or since > (patience if best_m > 0 else 4 * patience):
                if not left:
                    stop = f"stopped at step {step}: " + (
                        f"a margin gain below {min_rate:g} a step over {patience} steps"
                        if slow
                        else f"no margin gain in {patience} steps"
                        if best_m > 0
                        else f"no θ with (i) > 1 and (ii) < 1 in {since} steps"
                    )
                    stop += f" at lr {lr:.3g}"
                    break
                left, since, theta, lr = left - 1, 0, best, lr / 3
                window = (step, best_m) if best_m > 0 else None
                opt = make(lr)
                continue
            if step == epochs:
                break
            try:
                d_P, d_H = directions(theta)
            except SpectrumError as exc:
                stop = f"stopped at step {step}: {exc}"
                break
            w = 1.0 / (1.0 + np.exp(np.clip(BALANCE_GAIN * (a - b), -50.0, 50.0)))
            for key, v in zip(hist, (step, np.exp(a), np.exp(-b), w)):
                hist[key].append(float(v))
            theta = opt.step(theta, (1 - w) * _unit(d_P) + w * _unit(d_H), blame="lr")
            if bar is not None:
                bar.set_postfix(margin=f"{best_m:.3g}", refresh=False)
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    return AdaptiveRun(best, float(best_m), best_step, step, RESTARTS - left, stop, hist)
