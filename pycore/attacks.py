"""The attackers of a linear θ and the defender's worst case (docs/findings.md §4-5).

An attacker probes the frozen features ``Z = Xθ`` of a task with a linear head: one attacker on
a problem (:func:`attack` on a :func:`make_problem`), the grid of every attacker family
(:func:`attacker_grid`, :func:`run_grid`), the worst case over it (:func:`worst_case`) and the
analysis over seeds and attacked θ's (:func:`analyse`). :func:`pycore.attack_evaluation` runs the
grid on one θ.
"""

from pycore._attacks import AttackTrajectory, attack
from pycore._probe import ProbingProblem, make_problem
from pycore._public import publish
from pycore._worst_case import FamilyResult, GridRun, Slowdown, attacker_grid, run_grid, worst_case

__all__ = [
    "make_problem",
    "ProbingProblem",
    "attack",
    "AttackTrajectory",
    "attacker_grid",
    "run_grid",
    "GridRun",
    "worst_case",
    "FamilyResult",
    "Slowdown",
]
publish(__name__, globals(), __all__)
del publish
