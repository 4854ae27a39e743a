"""Pre-training / probing losses of a linear model on features ``Z = Xθ`` with head ω.

Both return the loss and its gradients w.r.t. the head and θ in closed form:
``∂L/∂θ = Xᵀ R ωᵀ`` and ``∂L/∂ω = Zᵀ R = θᵀ(Xᵀ R)`` with ``R = ∂L/∂(Zω)``.

The products are associated through the head (m = its width, 1 here): ``X(θω)`` and
``θᵀ(XᵀR)`` cost O(N·D·m + D²·m), where forming ``Z = Xθ`` would cost O(N·D²) -- on MNIST
(N = 100, D = 784) that one product dominated IMMA, which calls these four times a step.
"""
from __future__ import annotations

import numpy as np
from scipy.special import expit

from pycore.optim import damped_newton


def mse(X, theta, omega, Y, *, grad_theta: bool = True):
    """L = ‖Xθω − Y‖²/(N·m) (mean squared error), its ∇_ω and ∇_θ (None unless ``grad_theta``:
    a D×D outer product that a caller updating only the head does not need)."""
    E = X @ (theta @ omega) - Y
    n = E.size
    XtR = X.T @ ((2.0 / n) * E)
    return float(np.sum(E * E) / n), theta.T @ XtR, XtR @ omega.T if grad_theta else None


def bce(X, theta, omega, Y, bias, *, grad_theta: bool = True):
    """Mean binary cross-entropy of logits ``Xθω + b`` against Y ∈ {0,1}; grads for ω, θ
    (None unless ``grad_theta``), b."""
    logits = X @ (theta @ omega) + bias
    # log(1+e^x) − y·x, written stably.
    loss = float(np.mean(np.logaddexp(0.0, logits) - Y * logits))
    R = (expit(logits) - Y) / Y.size
    XtR = X.T @ R
    return loss, theta.T @ XtR, XtR @ omega.T if grad_theta else None, R.sum(axis=0)


def task_loss(loss: str, X, theta, omega, Y, bias=None) -> float:
    if loss == "mse":
        return mse(X, theta, omega, Y)[0]
    return bce(X, theta, omega, Y, 0.0 if bias is None else bias)[0]


def best_probe_loss(loss: str, Z: np.ndarray, Y: np.ndarray) -> float:
    """min_ω L(Z, ω), the best D_P loss of a linear head on features Z (Definition 3.1(c),
    docs/theory.md §5); least squares exactly via ``lstsq``.

    BCE (one target column, head with a bias): damped Newton (:func:`pycore.optim.damped_newton`)
    on the mean BCE plus a ridge ``(1e-8/2)‖w‖²`` on the features scaled to unit RMS row norm,
    which keeps separable data well-posed and makes the value independent of Z's scale
    (Z → cZ gives the same problem); the BCE alone at that point is returned, an upper bound
    of the infimum.
    """
    if loss == "mse":
        w, *_ = np.linalg.lstsq(Z, Y, rcond=None)
        E = Z @ w - Y
        return float(np.sum(E * E) / E.size)
    return _best_logistic_loss(Z, Y)


def _best_logistic_loss(Z, Y, ridge=1e-8, tol=1e-12, max_iter=100) -> float:
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

    w, _ = damped_newton(value_grad, value, hessian, np.zeros(A.shape[1]), tol=tol, max_iter=max_iter)
    return bce_mean(w)[0]
