"""θ₀'s budget and the slowdown of an attacker's operator (docs/theory.md §12, docs/design.md §3).

The scheduler alone: :func:`budget` runs θ₀'s grid of an operator until its plateau is
confirmed, :func:`attack` races a model's settings against that :class:`~pycore.deep.Budget`.
Both drive any :class:`Runs` a factory ``make(variant, lrs)`` gives (the probes, the networks of
:func:`pycore.deep.operator`, synthetic curves), so the rules are tested on curves known in
advance. Its results are :class:`pycore.deep.Budget` and :class:`pycore.deep.Slowdown`.
"""

from pycore._public import publish
from pycore.deep._slowdown import (
    BUDGET_FACTOR,
    MAX_WIDEN,
    PLATEAU_TOLERANCE,
    PRUNE_GAP,
    SMOOTHING,
    TARGET_SHARE,
    Runs,
    attack,
    budget,
    smoothed,
)

__all__ = [
    "budget",
    "attack",
    "Runs",
    "smoothed",
    "BUDGET_FACTOR",
    "PLATEAU_TOLERANCE",
    "TARGET_SHARE",
    "MAX_WIDEN",
    "SMOOTHING",
    "PRUNE_GAP",
]
publish(__name__, globals(), __all__)
del publish
