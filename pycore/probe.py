"""Linear probing by gradient descent with exact line search (paper Fig. 1, Eq. (16); docs/theory.md §8).

The attacker fits ``w`` on frozen features ``Z`` by minimising ``L(w) = ‖Zw − Y‖²`` (un-halved,
so ``∇²L = 2ZᵀZ``).  For a quadratic the exact line-search step along ``−g`` is
``α = gᵀg / gᵀ(∇²L)g`` (docs/theory.md §5), and the error ``w_t − w*`` contracts at a rate set by
κ(ZᵀZ): the norm ratio ``‖w_t − w*‖²/‖w_0 − w*‖²`` is the paper's picture of immunization.

The loop itself is :func:`exact_line_search_steps`, shared with the attack suite
(:func:`pycore.attacks.attack_gd_exact`, which works with the halved loss).

When ``Z`` is rank-deficient the minimiser is not unique; GD never moves ``w``'s component in
null(Z), so the relevant optimum is the one closest to ``w_0``:
``w* = w_0 + Z⁺(Y − Zw_0)``.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pycore.threads import bounded_blas
from pycore.validation import as_float_matrix, as_target, check_number


# Upper bound on the steps of one probe: its trace holds 3 floats per step, and Figure 1 stores two
# traces per method in results.json (~30 MB of JSON at this bound; the figure uses 100 steps).
MAX_PROBE_STEPS = 100_000


@dataclass(frozen=True)
class ProbeTrace:
    norm_ratio: np.ndarray   # (steps+1,) ‖w_t − w*‖²/‖w_0 − w*‖²
    loss: np.ndarray         # (steps+1,) L(w_t)
    step_sizes: np.ndarray   # (steps,) exact line-search α_t
    loss_star: float


def exact_line_search_steps(Z: np.ndarray, Y: np.ndarray, w: np.ndarray, *,
                            g_floor: float = 0.0) -> Iterator[tuple[np.ndarray, np.ndarray, float]]:
    """GD with exact line search on ``½‖Zw − Y‖²`` from ``w``: the ONE implementation of the loop
    (used by :func:`gd_exact_line_search` and :func:`pycore.attacks.attack_gd_exact`).

    Yields ``(w_{t+1}, E_{t+1}, α_t)`` after every step, with ``g = Zᵀ E``, ``α = gᵀg / ‖Zg‖²``
    (the Hessian of the halved loss is ``ZᵀZ``; for the un-halved loss ``‖Zw − Y‖²`` the step is
    ``α/2`` along ``2g``: the same iterates, bit for bit, since the factors of 2 are exact) and the
    residual ``E = Zw − Y`` updated by the recurrence ``E ← E − αZg``, so a step costs one
    product with ``Z`` and one with ``Zᵀ``.  Returns (stops yielding) once ``‖g‖ ≤ g_floor`` or
    ``‖Zg‖ = 0``: the gradient is at round-off level, where ``α`` would be noise.  The caller
    decides how many steps to take.  ``Y`` and ``w`` may be vectors or ``(·, m)`` blocks.
    """
    E = Z @ w - Y
    while True:
        g = Z.T @ E
        Zg = Z @ g
        curv = float(np.sum(Zg * Zg))
        if np.linalg.norm(g) <= g_floor or curv <= 0.0:
            return
        alpha = float(np.sum(g * g)) / curv
        w = w - alpha * g
        E = E - alpha * Zg
        yield w, E, alpha


@bounded_blas
def gd_exact_line_search(Z, Y, steps: int, w0=None) -> ProbeTrace:
    """Run ``steps`` iterations of GD with exact line search on ``‖Zw − Y‖²``.

    Stops early (padding with the last value) once the gradient is at round-off level
    (``‖g‖ ≤ 1e-14·‖2ZᵀY‖``), where ``gᵀAg`` would be zero or noise.
    """
    Z = as_float_matrix(Z, "Z")
    Y = as_target(Y, Z.shape[0], "Y")
    check_number(steps, "steps", low=0, high=MAX_PROBE_STEPS, integer=True)
    w = np.zeros((Z.shape[1], Y.shape[1])) if w0 is None else as_target(w0, Z.shape[1], "w0").copy()
    w_star = w + np.linalg.lstsq(Z, Y - Z @ w, rcond=None)[0]
    E0 = Z @ w_star - Y
    loss_star = float(np.sum(E0 * E0))
    e0 = float(np.sum((w - w_star) ** 2))
    scale = e0 if e0 > 0 else 1.0
    # ‖∇L‖ ≤ 1e-14·‖∇L(0)‖ of the un-halved loss (∇L = 2ZᵀE), i.e. ‖ZᵀE‖ ≤ 1e-14·‖ZᵀY‖.
    g_floor = 0.5 * (1e-14 * max(float(np.linalg.norm(2 * Z.T @ Y)), 1e-300))
    E = Z @ w - Y
    ratios, loss_hist, alphas = [float(np.sum((w - w_star) ** 2)) / scale], [float(np.sum(E * E))], []
    for w, E, alpha in itertools.islice(exact_line_search_steps(Z, Y, w, g_floor=g_floor), steps):
        alphas.append(0.5 * alpha)   # the step along the un-halved gradient 2ZᵀE
        ratios.append(float(np.sum((w - w_star) ** 2)) / scale)
        loss_hist.append(float(np.sum(E * E)))
    # Stopped at round-off level: w no longer moves; pad to `steps` entries.
    pad = steps - len(alphas)
    alphas += [0.0] * pad
    ratios += ratios[-1:] * pad
    loss_hist += loss_hist[-1:] * pad
    return ProbeTrace(np.array(ratios), np.array(loss_hist), np.array(alphas), loss_star)
