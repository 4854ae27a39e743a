"""The (i)/(ii) frontier of linear immunization (docs/attacks.md §3).

RIR = (i)/(ii) hides the trade-off between making the harmful task worse-conditioned,
(i) = κ(H_H(θ))/κ(H_H(I)), and the pre-training task better-conditioned, (ii) =
κ(H_P(θ))/κ(H_P(I)): RIR is maximal for ANY θ that whitens D_P, even when (i) < 1
(docs/theory.md §10). This module places immunizers in the (log (i), log (ii)) plane:

* :func:`ratios` — (i), (ii), RIR of a θ on training and held-out rows;
* :func:`closed_form_frontier` — the optimal closed form over its exponent a (s² = λ_C^a):
  for a ≥ 0 its RIR is the ceiling, so it traces the best (ii) for every (i) (the frontier);
* :func:`regularizer_product` — Algorithm 1's regularizer term at its best scale. Because
  ``R_well(c²H) = c⁴R_well(H)`` and ``R_ill(c²H) = R_ill(H)/c⁴``, rescaling θ → cθ (which the D_P
  head absorbs) gives ``min_c λ_P R_well(H_P) + λ_H R_ill(H_H) = 2√(λ_P λ_H · R_well(H_P)·R_ill(H_H))``:
  the λ's set θ's scale, and the SHAPE Algorithm 1 converges to minimises the scale-free product
  ``R_well(H_P)·R_ill(H_H)`` whatever λ_P, λ_H are. Evaluated along the frontier it says which
  (i)/(ii) balance the paper's objective prefers;
* :func:`target_progress`, :func:`pareto_front` — distance to a target region and the
  non-dominated points.
"""
from __future__ import annotations

import math

import numpy as np

from pycore.metrics import rir
from pycore.regularizers import r_ill, r_well
from pycore.tasks import LinearTask
from pycore.validation import ParameterError, check_number

__all__ = ["ratios", "closed_form_frontier", "regularizer_product", "target_progress", "pareto_front"]


def ratios(theta, train: LinearTask, heldout: LinearTask | None = None) -> dict:
    """``{"train": {...}, "heldout": {...}}`` with ``harmful_ratio`` (i), ``pretrain_ratio`` (ii)
    and ``rir`` of θ against θ = I on each row set (docs/theory.md §8)."""
    out = {}
    for name, t in (("train", train), ("heldout", heldout)):
        if t is None:
            continue
        r = rir(theta, t.X_P, t.X_H)
        out[name] = {"harmful_ratio": r.harmful_ratio, "pretrain_ratio": r.pretrain_ratio, "rir": r.value}
    return out


def closed_form_frontier(train: LinearTask, heldout: LinearTask | None, exponents) -> list[dict]:
    """The closed-form immunizer (docs/theory.md §10) at each exponent a of ``exponents``: its
    ratios on both row sets and :func:`regularizer_product` on the training rows."""
    from pycore.immunize import immunize

    out = []
    for a in exponents:
        check_number(a, "exponent")
        theta = immunize(train, "closed_form", rng=np.random.default_rng(0), exponent=float(a)).theta
        out.append({"exponent": float(a), **ratios(theta, train, heldout),
                    "regularizer_product": regularizer_product(theta, train)})
    return out


def regularizer_product(theta, task: LinearTask) -> float:
    """``R_well(H_P(θ)) · R_ill(H_H(θ))``: invariant under θ → cθ, and Algorithm 1's regularizer
    term at its best scale is ``2√(λ_P λ_H × this)`` (module docstring). Lower = preferred by
    the paper's objective."""
    theta = np.asarray(theta, dtype=np.float64)
    Z_P, Z_H = task.X_P @ theta, task.X_H @ theta
    return float(r_well(Z_P.T @ Z_P) * r_ill(Z_H.T @ Z_H))


def target_progress(harmful_ratio: float, pretrain_ratio: float, target=(10.0, 0.1)) -> float:
    """``min(log (i) / log t_i, log (ii) / log t_ii)``: ≥ 1 inside the target region
    ``(i) ≥ t_i, (ii) ≤ t_ii``, the fraction of the way there (in log scale) otherwise."""
    ti, tii = (float(x) for x in target)
    if not (ti > 1 and 0 < tii < 1):
        raise ParameterError("target", f"target must be ((i) > 1, 0 < (ii) < 1), got {target}")
    if not (harmful_ratio > 0 and pretrain_ratio > 0):
        return -math.inf
    return min(math.log(harmful_ratio) / math.log(ti), math.log(pretrain_ratio) / math.log(tii))


def pareto_front(points) -> list[int]:
    """Indices of the points ``(i, ii)`` that no other point beats in both (higher (i), lower
    (ii)), sorted by (i)."""
    pts = [(float(a), float(b)) for a, b in points]
    keep = [k for k, (a, b) in enumerate(pts)
            if not any((c >= a and d <= b) and (c > a or d < b) for c, d in pts)]
    return sorted(keep, key=lambda k: pts[k][0])
