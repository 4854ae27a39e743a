"""Update rules on NumPy arrays, float64: plain GD and Adam (first order), and the damped Newton
method used wherever a smooth strictly convex problem must be solved to the float64 floor
(the logistic probes of :mod:`pycore.losses` and :mod:`pycore.attacks`)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.linalg


class GD:
    """θ ← θ − lr·g (Algorithm 1 as printed)."""

    def __init__(self, lr: float):
        self.lr = float(lr)

    def step(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x - self.lr * g


class Adam:
    """Adam (Kingma & Ba 2015) with bias correction; the paper's optimizer for linear models.

    β = (0.9, 0.999), ε = 1e-8 as in paper Appendix C.2.
    """

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.lr, self.b1, self.b2, self.eps = float(lr), float(betas[0]), float(betas[1]), float(eps)
        self.m = self.v = None
        self.t = 0

    def step(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        if self.m is None:
            self.m, self.v = np.zeros_like(g), np.zeros_like(g)
        self.t += 1
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.v = self.b2 * self.v + (1 - self.b2) * (g * g)
        mhat = self.m / (1 - self.b1**self.t)
        vhat = self.v / (1 - self.b2**self.t)
        return x - self.lr * mhat / (np.sqrt(vhat) + self.eps)


def make_optimizer(name: str, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
    if name == "adam":
        return Adam(lr, betas, eps)
    if name == "gd":
        return GD(lr)
    raise ValueError(f"optimizer must be 'adam' or 'gd', got {name!r}")


def damped_newton(value_grad: Callable, value: Callable, hessian: Callable, w0: np.ndarray, *,
                  tol: float, max_iter: int,
                  callback: Callable[[np.ndarray], bool] | None = None) -> tuple[np.ndarray, dict]:
    """Damped Newton: Armijo backtracking (c = 1e-4, halving) on the Newton direction, Cholesky solve.

    ``w`` is a vector; ``value_grad(w) -> (f, g)``, ``value(w) -> f`` and ``hessian(w) -> ∇²f``
    (positive definite: the callers add a ridge).  Stops when ``‖∇f‖ ≤ tol·max(1, ‖∇f(w₀)‖)``,
    when a step no longer decreases f (the float64 floor), after ``max_iter`` iterations, or when
    ``callback(w)`` returns True.  Returns ``(w, info)`` with the iteration count, final gradient norm and the
    stop reason.
    """
    w = w0.copy()
    f, g = value_grad(w)
    g0 = max(1.0, float(np.linalg.norm(g)))
    it, message = 0, "max_iter reached"
    while it < max_iter:
        if np.linalg.norm(g) <= tol * g0:
            message = "gradient tolerance reached"
            break
        H = hessian(w)
        d = -scipy.linalg.cho_solve(scipy.linalg.cho_factor(H, lower=True), g)
        slope = float(g @ d)
        t = 1.0
        while True:
            f_new = value(w + t * d)
            if f_new <= f + 1e-4 * t * slope or t < 1e-12:
                break
            t *= 0.5
        if not f_new < f and t < 1e-12:
            message = "no further decrease (float64 floor)"
            break
        if f_new >= f and np.linalg.norm(g) <= 1e3 * tol * g0:
            message = "no further decrease (float64 floor)"
            break
        w = w + t * d
        f, g = value_grad(w)
        it += 1
        if callback is not None and callback(w):
            message = "callback stop"
            break
    return w, {"iterations": it, "grad_norm": float(np.linalg.norm(g)), "message": message}
