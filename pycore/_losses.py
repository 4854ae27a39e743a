"""Losses of a linear model on features ``Z = Xθ`` with head ω, and their gradients.

The gradients are in closed form, ``∂L/∂θ = XᵀRωᵀ``, ``∂L/∂ω = θᵀ(XᵀR)``, ``R = ∂L/∂(Zω)``,
associated through the head: O(N·D·m + D²·m) instead of the O(N·D²) of forming Z (on MNIST that
product dominated IMMA).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

from pycore._optim import damped_newton


def residual(loss: str, P, Y):
    """``(L, R = ∂L/∂P)`` of predictions or logits P against targets Y.

    The mean squared error of predictions P (``"mse"``) or the mean BCE ``log(1+eᴾ) − Y·P`` of
    logits P (``"bce"``), against Y. P may be a stack (B×n×m) of runs: L is then one mean per run
    (over each run's own n×m entries).
    """
    n = P.shape[-2] * P.shape[-1]
    if loss == "mse":
        E = P - Y
        L = np.sum(E * E, axis=(-2, -1)) / n
        return (float(L) if P.ndim == 2 else L), (2.0 / n) * E
    L = np.mean(np.logaddexp(0.0, P) - Y * P, axis=(-2, -1))
    return (float(L) if P.ndim == 2 else L), (expit(P) - Y) / n


def mse(X, theta, omega, Y, *, grad_theta: bool = True):
    """L = ‖Xθω − Y‖²/(N·m), ∇_ω and ∇_θ (None unless ``grad_theta``: a D×D product)."""
    loss, R = residual("mse", X @ (theta @ omega), Y)
    XtR = X.mT @ R
    return loss, theta.mT @ XtR, XtR @ omega.mT if grad_theta else None


def bce(X, theta, omega, Y, bias, *, grad_theta: bool = True):
    """Mean BCE of logits ``Xθω + b`` against Y ∈ {0,1}; grads for ω, θ (or None), b."""
    loss, R = residual("bce", X @ (theta @ omega) + bias, Y)
    XtR = X.mT @ R
    return loss, theta.mT @ XtR, XtR @ omega.mT if grad_theta else None, R.sum(axis=-2)


def best_probe_loss(loss: str, Z: np.ndarray, Y: np.ndarray) -> float:
    """min_ω L(Z, ω), the best D_P loss of a linear head on features Z.

    Definition 3.1(c), docs/theory.md §5. Least squares by ``lstsq``; BCE (a head with a bias)
    by damped Newton on the mean BCE + ``(1e-8/2)‖w‖²`` on Z scaled to unit RMS row norm
    (separable data well-posed, Z → cZ the same problem), returning the BCE alone there, an upper
    bound of the infimum.

    Parameters
    ----------
    loss : {"mse", "bce"}
        The head's loss: the mean squared error, or the mean binary cross-entropy of logits.
    Z : ndarray, shape (N, D)
        The features.
    Y : ndarray, shape (N, m)
        The targets (0/1 labels for ``"bce"``).

    Returns
    -------
    float
        The best loss.
    """
    if loss == "mse":
        return residual("mse", Z @ best_head("mse", Z, Y)[0], Y)[0]
    return best_logistic_head(Z, Y)[2]


def best_head(loss: str, Z: np.ndarray, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The head ``(ω, bias)`` of :func:`best_probe_loss` (bias None for least squares)."""
    if loss == "mse":
        return np.linalg.lstsq(Z, Y, rcond=None)[0], None
    w, b, _ = best_logistic_head(Z, Y)
    return w[:, None], np.array([b])


def best_logistic_head(
    Z, Y, ridge=1e-8, tol=1e-12, max_iter=100
) -> tuple[np.ndarray, float, float]:
    """``(w, b, BCE)`` of the ridge-regularised logistic fit of :func:`best_probe_loss`.

    ``w`` and ``b`` are in Z's units.
    """
    n = Z.shape[0]
    Y = np.asarray(Y, dtype=np.float64)
    if Y.size != n:
        raise ValueError(f"the BCE probe takes one target column, got targets of shape {Y.shape}")
    y = Y.reshape(n)
    scale = float(np.sqrt(np.sum(Z * Z) / n))
    A = np.hstack([Z / (scale if scale > 0 else 1.0), np.ones((n, 1))])

    def bce_mean(w):
        t = A @ w
        return float(np.mean(np.logaddexp(0.0, t) - y * t)), t

    def value(w):
        return bce_mean(w)[0] + 0.5 * ridge * float(w @ w)

    def value_grad(w):
        f, t = bce_mean(w)
        return f + 0.5 * ridge * float(w @ w), A.T @ (expit(t) - y) / n + ridge * w

    def hessian(w):
        p = expit(A @ w)
        return (A * (p * (1.0 - p) / n)[:, None]).T @ A + ridge * np.eye(A.shape[1])

    w, _ = damped_newton(
        value_grad, value, hessian, np.zeros(A.shape[1]), tol=tol, max_iter=max_iter
    )
    return w[:-1] / (scale if scale > 0 else 1.0), float(w[-1]), bce_mean(w)[0]
