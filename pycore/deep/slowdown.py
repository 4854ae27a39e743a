"""θ₀'s budget and the slowdown of an attacker's operator (docs/theory.md §12, docs/design.md §3).

The scheduler alone: :func:`budget` runs θ₀'s grid of an operator until its plateau is
confirmed, :func:`reach` races a model's settings to a target.
Both drive any :class:`Runs` a factory ``make(variant, lrs)`` gives (the probes, the networks of
:func:`pycore.deep.operator`, synthetic curves), so the rules are tested on curves known in
advance. Its results are :class:`pycore.deep.Budget` and :class:`pycore.deep.Reach`.
"""

from pycore._public import publish
from pycore.deep._slowdown import (
    BUDGET_FACTOR,
    EVAL_DENSE,
    EVAL_RATIO,
    MAX_WIDEN,
    MIN_CONFIRM_EVALS,
    PLATEAU_TOLERANCE,
    PRUNE_GAP,
    TARGET_SHARE,
    Runs,
    Trace,
    budget,
    next_eval,
    reach,
    target_level,
)

__all__ = [
    "budget",
    "reach",
    "next_eval",
    "target_level",
    "Runs",
    "Trace",
    "BUDGET_FACTOR",
    "EVAL_DENSE",
    "EVAL_RATIO",
    "MIN_CONFIRM_EVALS",
    "PLATEAU_TOLERANCE",
    "TARGET_SHARE",
    "MAX_WIDEN",
    "PRUNE_GAP",
]
publish(__name__, globals(), __all__)
del publish
