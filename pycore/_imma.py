"""IMMA (docs/theory.md §7): ascent on the loss an attacker reaches after a few unrolled steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import pycore._losses as losses
from pycore._linear_options import AdamOptions
from pycore._loops import (
    Inputs,
    epoch_steps,
    exact_kappas,
    gram_stacks,
    head_bias,
    init_head,
    init_theta,
    input_norm,
    log_row,
    logits,
    max_abs,
)
from pycore._optim import check_growth, check_scale, make_optimizer
from pycore._registry import Method, MethodRun


@dataclass(frozen=True)
class IMMAOptions(AdamOptions):
    """IMMA (docs/theory.md §7): ``inner_steps`` unrolled attacker steps of size ``inner_lr``/L."""

    inner_steps: int = 3
    inner_lr: float = 0.5


def imma_inner_step_size(task, w: np.ndarray, o):
    """``inner_lr / L``, L = (2/N)λ_max(K_H)‖w‖² the Lipschitz constant of θ ↦ ∇_θL_H(w, θ).

    One per run for a stack of heads w (B×D×m).
    """
    n = task.Y_H.size
    # ‖X_H‖₂ (an SVD) is a constant of the task, cached on it: once, not once per step
    L = 2.0 / n * task.norm2_X_H**2 * np.sum(w * w, axis=(-2, -1))
    if np.ndim(L) == 0:
        return o.inner_lr / float(L) if L > 0 else 0.0
    return np.where(L > 0, o.inner_lr / np.where(L > 0, L, 1.0), 0.0)


def imma_objective(theta, w, omega, task, o, bias=None, batch_P=None):
    """IMMA's upper-level objective ``F(θ) = L_H(w, θ_J) − L_P(ω, θ_J)`` and its θ-gradient.

    θ_J is θ after ``o.inner_steps`` attacker GD steps on all of D_H (docs/theory.md §7). Each
    attacker step is affine in θ and subtracts a matrix (·)wᵀ, so θ_J = θ − S wᵀ (S D×m) and the
    adjoint (reverse mode by hand) only changes the factor of wᵀ: O(J·D²·m) work, equal to the
    unrolled matrices to round-off. Every argument may carry a leading run axis (θ B×D×D, w, ω
    B×D×m, bias B×m, the batch B×b×D): F is then one value per run.

    Parameters
    ----------
    theta : ndarray, shape (D, D) or (B, D, D)
        The feature extractor(s).
    w : ndarray, shape (D, m) or (B, D, m)
        The attacker's D_H head.
    omega : ndarray, shape (D, m) or (B, D, m)
        The D_P head.
    task : LinearTask
        The task (D_H's rows and targets, K_H, the loss of D_P).
    o : IMMAOptions
        ``inner_steps`` and ``inner_lr`` (the attacker step, in units of 1/L).
    bias : ndarray, optional
        The D_P head's bias (BCE tasks).
    batch_P : pair of ndarray, optional
        ``(X, Y)``, the D_P rows of L_P (default all of D_P).

    Returns
    -------
    F : float or ndarray of shape (B,)
        The objective (one per run with a run axis).
    grad : ndarray, shape of ``theta``
        ∇_θF.
    """
    n = task.Y_H.size
    c = imma_inner_step_size(task, w, o) * 2.0 / n
    if np.ndim(c):
        c = c[:, None, None]
    b = task.X_H.T @ task.Y_H  # D×m: B = b wᵀ
    KH = task.K_H
    ww = w.mT @ w  # m×m
    tw = theta @ w  # θw (D×m)
    S = np.zeros_like(tw)  # θ_j = θ − S wᵀ
    for _ in range(o.inner_steps):
        S = S + c * (KH @ (tw - S @ ww) - b)
    # L_H at θ_J: θ_J w = θw − S wᵀw
    lh, R = losses.residual("mse", task.X_H @ (tw - S @ ww), task.Y_H)
    a = task.X_H.T @ R  # g_h = a wᵀ
    X_P, Y_P = (task.X_P, task.Y_P) if batch_P is None else batch_P
    Z_P = X_P @ (theta @ omega - S @ (w.mT @ omega))  # X_P θ_J ω
    if task.loss == "bce" and bias is not None:
        Z_P = Z_P + (bias if np.ndim(bias) <= 1 else head_bias(bias))
    lp, R = losses.residual(task.loss, Z_P, Y_P)
    p = X_P.mT @ R  # g_p = p ωᵀ
    pw = p @ (omega.mT @ w)  # adjoint of Ḡ = a wᵀ − p ωᵀ, through Ḡw
    for _ in range(o.inner_steps):
        a = a - c * (KH @ (a @ ww - pw))
    return lh - lp, a @ w.mT - p @ omega.mT


def imma(task, o, rngs) -> list[MethodRun]:
    """IMMA (docs/theory.md §7).

    Ascent on :func:`imma_objective`; heads w and ω descend their losses.  The per-epoch κ's come
    from the small-side spectra, the last from the SVDs.
    """
    D, B = task.D, len(rngs)
    theta, omega, bias, w = [], [], [], []
    for rng in rngs:  # each run's draws in the order of a run alone
        theta.append(init_theta(D, o, rng))
        om, bi = init_head(task, rng)
        omega.append(om)
        bias.append(bi)
        w.append(rng.normal(0.0, 1.0 / np.sqrt(D), size=(D, task.Y_H.shape[1])))
    theta0, omega, bias, w = (np.stack(a) for a in (theta, omega, bias, w))
    inp = Inputs.of(task)
    theta = inp.take(theta0)
    opt_t, opt_w, opt_o, opt_b = (
        make_optimizer(o.optimizer, o.lr, o.betas, o.adam_eps, param=p)
        for p in ("θ", "w", "ω", "bias")
    )
    hists = [{"epoch": [], "objective": [], "kappa_P": [], "kappa_H": []} for _ in rngs]
    n_P = inp.X_P.shape[0]
    x_norm, start = input_norm(task), max_abs(theta)
    for epoch in range(1, o.epochs + 1):
        for rows in epoch_steps(n_P, o.batch_size, rngs):
            X_b, Y_b = (inp.X_P, inp.Y_P) if rows is None else (inp.X_P[rows], inp.Y_P[rows])
            F, gF = imma_objective(theta, w, omega, inp, o, bias, batch_P=(X_b, Y_b))
            _, g_w, _ = losses.mse(inp.X_H, theta, w, inp.Y_H, grad_theta=False)
            _, R = losses.residual(task.loss, logits(inp, X_b, theta, omega, bias), Y_b)
            g_o, g_b = theta.mT @ (X_b.mT @ R), R.sum(axis=-2)
            theta = opt_t.step(theta, -gF, blame="lr")  # ascent on F
            check_scale(theta, x_norm, f"imma: epoch {epoch}", o.optimizer, o.lr, "lr")
            w = opt_w.step(w, g_w, blame="lr")
            omega = opt_o.step(omega, g_o, blame="lr")
            if task.loss == "bce":
                bias = opt_b.step(bias, g_b, blame="lr")
        if epoch < o.epochs:
            gram_P, gram_H = gram_stacks(inp, theta, "imma", epoch, epoch)
            kappas = [(float(a), float(b)) for a, b in zip(gram_P.kappa, gram_H.kappa)]
        else:
            kappas = [exact_kappas(inp, th) for th in theta]
        for b in range(B):
            log_row(hists[b], epoch, float(F[b]), *kappas[b])
    check_growth(theta, start, f"imma: after {o.epochs} epochs")
    theta = inp.put(theta0, theta)
    out = []
    for b in range(B):
        h = hists[b]
        end = {"kappa_end": (h["kappa_P"][-1], h["kappa_H"][-1])} if h["epoch"] else {}
        why = f"ran the {o.epochs} epochs asked for"
        out.append(MethodRun(theta[b], omega[b], h, end, why))
    return out


IMMA = Method("imma", "IMMA", IMMAOptions, imma, work=(13, 1), in_tables=True)
