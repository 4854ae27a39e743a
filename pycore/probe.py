"""Linear probing by gradient descent with exact line search (paper Fig. 1, Eq. (16); SPEC §8).

The attacker fits ``w`` on frozen features ``Z`` by minimising ``L(w) = ‖Zw − Y‖²`` (un-halved,
so ``∇²L = 2ZᵀZ``).  For a quadratic the exact line-search step along ``−g`` is
``α = gᵀg / gᵀ(∇²L)g`` (SPEC §5), and the error ``w_t − w*`` contracts at a rate set by
κ(ZᵀZ): the norm ratio ``‖w_t − w*‖²/‖w_0 − w*‖²`` is the paper's picture of immunization.

When ``Z`` is rank-deficient the minimiser is not unique; GD never moves ``w``'s component in
null(Z), so the relevant optimum is the one closest to ``w_0``:
``w* = w_0 + Z⁺(Y − Zw_0)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycore.validation import as_float_matrix, as_target
from pycore.threads import bounded_blas


@dataclass(frozen=True)
class ProbeTrace:
    norm_ratio: np.ndarray   # (steps+1,) ‖w_t − w*‖²/‖w_0 − w*‖²
    loss: np.ndarray         # (steps+1,) L(w_t)
    step_sizes: np.ndarray   # (steps,) exact line-search α_t
    loss_star: float


@bounded_blas
def gd_exact_line_search(Z, Y, steps: int, w0=None) -> ProbeTrace:
    """Run ``steps`` iterations of GD with exact line search on ``‖Zw − Y‖²``.

    Stops early (padding with the last value) once the gradient is at round-off level
    (``‖g‖ ≤ 1e-14·‖2ZᵀY‖``), where ``gᵀAg`` would be zero or noise.
    """
    Z = as_float_matrix(Z, "Z")
    Y = as_target(Y, Z.shape[0], "Y")
    if steps < 0:
        raise ValueError(f"steps must be ≥ 0, got {steps}")
    w = np.zeros((Z.shape[1], Y.shape[1])) if w0 is None else as_target(w0, Z.shape[1], "w0").copy()
    w_star = w + np.linalg.lstsq(Z, Y - Z @ w, rcond=None)[0]
    E0 = Z @ w_star - Y
    loss_star = float(np.sum(E0 * E0))
    e0 = float(np.sum((w - w_star) ** 2))
    scale = e0 if e0 > 0 else 1.0
    g_floor = 1e-14 * max(float(np.linalg.norm(2 * Z.T @ Y)), 1e-300)
    ratios, loss_hist, alphas = [float(np.sum((w - w_star) ** 2)) / scale], [], []
    E = Z @ w - Y
    loss_hist.append(float(np.sum(E * E)))
    for _ in range(steps):
        g = 2.0 * Z.T @ E
        Zg = Z @ g
        curv = 2.0 * float(np.sum(Zg * Zg))
        if np.linalg.norm(g) <= g_floor or curv <= 0.0:
            alphas.append(0.0)
        else:
            alpha = float(np.sum(g * g)) / curv
            alphas.append(alpha)
            w = w - alpha * g
            E = E - alpha * Zg
        ratios.append(float(np.sum((w - w_star) ** 2)) / scale)
        loss_hist.append(float(np.sum(E * E)))
    return ProbeTrace(np.array(ratios), np.array(loss_hist), np.array(alphas), loss_star)
