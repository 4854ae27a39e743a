"""First-order update rules on NumPy arrays (plain GD and Adam), float64."""
from __future__ import annotations

import numpy as np


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
