"""The attackers of a linear θ and the defender's worst case (docs/findings.md §4-5).

An attacker probes the frozen features ``Z = Xθ`` of a task with a linear head: the attacker
engine (:func:`run_attackers`, :func:`attack` on a :func:`make_problem`), the grid of every
attacker family (:func:`attacker_grid`, :func:`run_grid`), the worst case over it
(:func:`worst_case`, :func:`slowdown`) and the analysis over seeds and attacked θ's
(:func:`analyse`, :func:`best_so_far_curves`, :func:`targets`). :func:`pycore.attack_evaluation`
runs the grid on one θ.
"""

from pycore._attacks import (
    ATTACKERS,
    AttackTrajectory,
    attack,
    jacobi_scaling,
    run_attackers,
    whitening_preconditioner,
)
from pycore._probe import (
    MAX_PROBE_STEPS,
    ProbeTrace,
    ProbingProblem,
    exact_line_search_steps,
    gd_exact_line_search,
    make_problem,
)
from pycore._public import publish
from pycore._worst_case import (
    ADAM_BETAS,
    ADAM_LR_FACTORS,
    FAMILIES,
    FIRST_ORDER,
    MAX_ORDERS,
    AttackerConfig,
    Best,
    FamilyResult,
    GridRun,
    Slowdown,
    attacker_grid,
    best_so_far,
    family_best,
    kappa_bounds,
    kappa_reference,
    run_grid,
    slowdown,
    within,
    worst_case,
)
from pycore._worst_case_analysis import (
    Analysis,
    BestSoFar,
    Cell,
    Curve,
    FamilyCell,
    Target,
    Variant,
    VariantRun,
    analyse,
    best_so_far_curves,
    targets,
)

__all__ = [
    # the attacker engine
    "ATTACKERS",
    "AttackTrajectory",
    "ProbingProblem",
    "ProbeTrace",
    "make_problem",
    "run_attackers",
    "attack",
    "jacobi_scaling",
    "whitening_preconditioner",
    "exact_line_search_steps",
    "gd_exact_line_search",
    "MAX_PROBE_STEPS",
    # the grid and the worst case
    "FAMILIES",
    "FIRST_ORDER",
    "MAX_ORDERS",
    "ADAM_BETAS",
    "ADAM_LR_FACTORS",
    "AttackerConfig",
    "attacker_grid",
    "GridRun",
    "run_grid",
    "Best",
    "family_best",
    "Slowdown",
    "slowdown",
    "FamilyResult",
    "worst_case",
    "kappa_reference",
    "kappa_bounds",
    "best_so_far",
    "within",
    # the analysis over seeds and attacked θ's
    "Variant",
    "VariantRun",
    "FamilyCell",
    "Cell",
    "Analysis",
    "analyse",
    "Curve",
    "BestSoFar",
    "best_so_far_curves",
    "Target",
    "targets",
]
publish(__name__, globals(), __all__)
del publish
