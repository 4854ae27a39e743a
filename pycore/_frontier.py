"""The (i)/(ii) frontier of linear immunization (docs/findings.md §6).

RIR = (i)/(ii) hides the trade-off: it is maximal for ANY θ that whitens D_P, even with (i) < 1
(docs/theory.md §10).
"""

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
    """(i), (ii) and the RIR of θ against θ = I on one set of rows (docs/theory.md §8).

    Attributes
    ----------
    harmful_ratio : float
        (i) = κ(H_H(θ))/κ(H_H(I)).
    pretrain_ratio : float
        (ii) = κ(H_P(θ))/κ(H_P(I)).
    rir : float
        (i)/(ii).
    """

    harmful_ratio: float
    pretrain_ratio: float
    rir: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FrontierPoint:
    """The closed form at one exponent.

    Its ratios on the training rows and, when given, on the held-out rows, and
    :func:`regularizer_product` (what Algorithm 1's objective prefers).
    """

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
    """(i), (ii) and the RIR of θ against θ = I on a task's rows.

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The feature extractor.
    task : LinearTask
        The rows whose Gram matrices are compared.

    Returns
    -------
    FrontierRatios
        ``harmful_ratio``, ``pretrain_ratio`` and ``rir`` (:func:`pycore.rir`).
    """
    r = rir(theta, task.X_P, task.X_H)
    return FrontierRatios(r.harmful_ratio, r.pretrain_ratio, r.value)


def closed_form_frontier(
    train: LinearTask, heldout: LinearTask | None, exponents
) -> list[FrontierPoint]:
    """The closed form (docs/theory.md §10) at each exponent a: the best (ii) for every (i).

    Parameters
    ----------
    train : LinearTask
        The rows the closed form is computed on.
    heldout : LinearTask or None
        Rows the same θ is also measured on (None: none).
    exponents : iterable of float
        The exponents a of ``s² = λ_C^a``.

    Returns
    -------
    list of FrontierPoint
        One per exponent, in order.
    """
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
    """``R_well(H_P(θ))·R_ill(H_H(θ))``, a number invariant under θ → cθ.

    Algorithm 1's regularizer term at its best scale is
    ``min_c λ_P R_well + λ_H R_ill = 2√(λ_Pλ_H × this)``, whatever the λ's.

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The feature extractor.
    task : LinearTask
        The rows of H_P(θ) and H_H(θ).

    Returns
    -------
    float
        The product of the two regularizers.
    """
    theta = np.asarray(theta, dtype=np.float64)
    Z_P, Z_H = task.X_P @ theta, task.X_H @ theta
    return float(r_well(Z_P.T @ Z_P) * r_ill(Z_H.T @ Z_H))


def target_progress(harmful_ratio: float, pretrain_ratio: float, target=(10.0, 0.1)) -> float:
    """How far a θ is towards a target region of (i) and (ii), in log scale.

    ``min(log (i) / log t_i, log (ii) / log t_ii)``: ≥ 1 inside the target region
    ``(i) ≥ t_i, (ii) ≤ t_ii``, the fraction of the way there (in log scale) otherwise.

    Parameters
    ----------
    harmful_ratio : float
        (i).
    pretrain_ratio : float
        (ii).
    target : pair of float, default (10.0, 0.1)
        ``(t_i, t_ii)`` with t_i > 1 and 0 < t_ii < 1.

    Returns
    -------
    float
        The progress; ``-inf`` when a ratio is not positive.

    Raises
    ------
    ParameterError
        A target outside those bounds (``.parameter`` is ``"target"``).
    """
    ti, tii = (float(x) for x in target)
    if not (ti > 1 and 0 < tii < 1):
        raise ParameterError("target", f"target must be ((i) > 1, 0 < (ii) < 1), got {target}")
    if not (harmful_ratio > 0 and pretrain_ratio > 0):
        return -math.inf
    return min(math.log(harmful_ratio) / math.log(ti), math.log(pretrain_ratio) / math.log(tii))
