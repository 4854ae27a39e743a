"""The (i)/(ii) frontier of linear immunization (docs/findings.md §6): RIR = (i)/(ii) hides the
trade-off, it is maximal for ANY θ that whitens D_P, even with (i) < 1 (docs/theory.md §10)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from pycore._metrics import rir
from pycore._regularizers import r_ill, r_well
from pycore._tasks import LinearTask
from pycore._validation import ParameterError


@dataclass(frozen=True)
class FrontierRatios:
    """(i) ``harmful_ratio``, (ii) ``pretrain_ratio`` and ``rir`` of θ against θ = I on one set of
    rows (docs/theory.md §8)."""

    harmful_ratio: float
    pretrain_ratio: float
    rir: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FrontierPoint:
    """The closed form at one exponent: its ratios on the training rows and, when given, on the
    held-out rows, and :func:`regularizer_product` (what Algorithm 1's objective prefers)."""

    exponent: float
    train: FrontierRatios
    heldout: FrontierRatios | None
    regularizer_product: float

    def to_dict(self) -> dict:
        """``{"exponent", "train", "heldout" (only when measured), "regularizer_product"}``."""
        out = {"exponent": self.exponent, "train": self.train.to_dict()}
        if self.heldout is not None:
            out["heldout"] = self.heldout.to_dict()
        out["regularizer_product"] = self.regularizer_product
        return out


def frontier_ratios(theta, task: LinearTask) -> FrontierRatios:
    """(i), (ii) and the RIR of θ against θ = I on ``task``'s rows."""
    r = rir(theta, task.X_P, task.X_H)
    return FrontierRatios(r.harmful_ratio, r.pretrain_ratio, r.value)


def closed_form_frontier(
    train: LinearTask, heldout: LinearTask | None, exponents
) -> list[FrontierPoint]:
    """The closed form (docs/theory.md §10) at each exponent a: the best (ii) for every (i)."""
    from pycore._immunization import immunize

    out = []
    for a in exponents:
        theta = immunize(
            train, "closed_form", rng=np.random.default_rng(0), exponent=float(a)
        ).theta
        out.append(
            FrontierPoint(
                float(a),
                frontier_ratios(theta, train),
                None if heldout is None else frontier_ratios(theta, heldout),
                regularizer_product(theta, train),
            )
        )
    return out


def regularizer_product(theta, task: LinearTask) -> float:
    """``R_well(H_P(θ))·R_ill(H_H(θ))``, invariant under θ → cθ: Algorithm 1's regularizer term at
    its best scale is ``min_c λ_P R_well + λ_H R_ill = 2√(λ_Pλ_H × this)``, whatever the λ's."""
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
