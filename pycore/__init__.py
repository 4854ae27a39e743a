"""Model immunization from a condition-number perspective (Zheng, Bai, Bullins, Yeh; ICML 2025).

The linear core: float64 NumPy/SciPy, never imports torch (:mod:`pycore.ops` and
:mod:`pycore.deep` do). Its public names are the ones below (docs/design.md §3); the modules
whose names start with an underscore are the implementation. The other public namespaces are
:mod:`pycore.attacks` (the attackers and the worst case), :mod:`pycore.linalg` (the float64
building blocks), :mod:`pycore.report` (results as files), :mod:`pycore.data`,
:mod:`pycore.ops` and :mod:`pycore.deep`.

Tasks and immunization
    LinearTask, immunize, immunize_batch, immunize_certified, ImmunizationResult, METHODS,
    PRESETS, Method, MethodRun, method_of, register_method, unregister_method, options_of,
    resolve_options, the options classes, auto_exponent, check_method_work, MAX_EPOCHS,
    opt_kappa_objective, imma_objective, adaptive_descent, AdaptiveRun
Evaluation and metrics
    evaluate_linear, LinearEvaluation, SplitEvaluation, EvaluationReference, immunized_def31,
    chance_accuracy, near_chance, norm_ratio_curves, RIR, rir, feature_rir, grouped_feature_rir,
    Ceiling, rir_ceiling, ExponentWindow, def31_exponent_window, best_probe_loss,
    attack_evaluation, AttackEvaluation, kstep_remaining, kstep_remaining_grad, KStepRemaining
Spectra and regularizers
    condition_number, SpectrumInfo, spectrum_info, gram_spectrum, rank_tolerance, r_ill, r_well
    and their gradients and step bounds, preconditioned_grad_theta
Hardening, the frontier, the strict protocol
    HARDENINGS, harden, harden_result, haar_rotation, equalizing_rotation, hardening_rotation,
    orthogonality_defect, invariant_change, loss_floor, closed_form_frontier, FrontierPoint,
    FrontierRatios, frontier_ratios, regularizer_product, target_progress, strict_protocol,
    StrictReport
Errors, warnings and threads
    ParameterError, DivergenceError, SpectrumError, TieWarning, OutlierWarning, bounded_blas,
    task_threads, blas_threads, threads_for
"""

from pycore._adaptive import AdaptiveRun, adaptive_descent
from pycore._algorithm1 import CertifiedOptions, OursOptions
from pycore._closed_form import ClosedFormOptions, auto_exponent
from pycore._evaluate import (
    EvaluationReference,
    LinearEvaluation,
    SplitEvaluation,
    chance_accuracy,
    evaluate_linear,
    immunized_def31,
    near_chance,
    norm_ratio_curves,
)
from pycore._frontier import (
    FrontierPoint,
    FrontierRatios,
    closed_form_frontier,
    frontier_ratios,
    regularizer_product,
    target_progress,
)
from pycore._hardening import (
    HARDENINGS,
    equalizing_rotation,
    haar_rotation,
    harden,
    harden_result,
    hardening_rotation,
    invariant_change,
    loss_floor,
    orthogonality_defect,
)
from pycore._imma import IMMAOptions, imma_objective
from pycore._immunization import (
    METHODS,
    PRESETS,
    IdentityOptions,
    ImmunizationResult,
    check_method_work,
    immunize,
    immunize_batch,
    immunize_certified,
    options_of,
    resolve_options,
)
from pycore._kstep import KStepRemaining, kstep_remaining, kstep_remaining_grad
from pycore._kstep_immunizer import KStepOptions
from pycore._linear_options import MAX_EPOCHS, LinearOptions
from pycore._losses import best_probe_loss
from pycore._metrics import (
    RIR,
    Ceiling,
    ExponentWindow,
    def31_exponent_window,
    feature_rir,
    grouped_feature_rir,
    rir,
    rir_ceiling,
)
from pycore._opt_kappa import OptKappaOptions, opt_kappa_objective
from pycore._options import Options
from pycore._precondition import preconditioned_grad_theta
from pycore._protocol import StrictReport, strict_protocol
from pycore._public import publish
from pycore._r_ill_only import RIllOnlyOptions
from pycore._registry import Method, MethodRun, method_of, register_method, unregister_method
from pycore._regularizers import (
    TieWarning,
    preconditioned_r_ill_step_bound,
    preconditioned_r_well_step_bound,
    r_ill,
    r_ill_grad,
    r_ill_grad_theta,
    r_ill_step_bound,
    r_well,
    r_well_grad,
    r_well_grad_theta,
    r_well_step_bound,
)
from pycore._spectral import (
    SpectrumError,
    SpectrumInfo,
    condition_number,
    gram_spectrum,
    rank_tolerance,
    spectrum_info,
)
from pycore._tasks import LinearTask
from pycore._threads import blas_threads, bounded_blas, task_threads, threads_for
from pycore._validation import DivergenceError, OutlierWarning, ParameterError
from pycore._worst_case import AttackEvaluation, attack_evaluation

__all__ = [
    # tasks and immunization
    "LinearTask",
    "immunize",
    "immunize_batch",
    "immunize_certified",
    "ImmunizationResult",
    "METHODS",
    "PRESETS",
    "Method",
    "MethodRun",
    "method_of",
    "register_method",
    "unregister_method",
    "MAX_EPOCHS",
    "options_of",
    "resolve_options",
    "auto_exponent",
    "check_method_work",
    "Options",
    "LinearOptions",
    "IdentityOptions",
    "ClosedFormOptions",
    "OursOptions",
    "CertifiedOptions",
    "RIllOnlyOptions",
    "IMMAOptions",
    "OptKappaOptions",
    "KStepOptions",
    "opt_kappa_objective",
    "imma_objective",
    "adaptive_descent",
    "AdaptiveRun",
    # evaluation and metrics
    "evaluate_linear",
    "LinearEvaluation",
    "SplitEvaluation",
    "EvaluationReference",
    "immunized_def31",
    "chance_accuracy",
    "near_chance",
    "norm_ratio_curves",
    "RIR",
    "rir",
    "feature_rir",
    "grouped_feature_rir",
    "Ceiling",
    "rir_ceiling",
    "ExponentWindow",
    "def31_exponent_window",
    "best_probe_loss",
    "attack_evaluation",
    "AttackEvaluation",
    "kstep_remaining",
    "kstep_remaining_grad",
    "KStepRemaining",
    # spectra and regularizers
    "condition_number",
    "SpectrumInfo",
    "spectrum_info",
    "gram_spectrum",
    "rank_tolerance",
    "r_ill",
    "r_well",
    "r_ill_grad",
    "r_well_grad",
    "r_ill_grad_theta",
    "r_well_grad_theta",
    "r_ill_step_bound",
    "r_well_step_bound",
    "preconditioned_r_ill_step_bound",
    "preconditioned_r_well_step_bound",
    "preconditioned_grad_theta",
    # hardening, the frontier, the strict protocol
    "HARDENINGS",
    "harden",
    "harden_result",
    "haar_rotation",
    "equalizing_rotation",
    "hardening_rotation",
    "orthogonality_defect",
    "invariant_change",
    "loss_floor",
    "closed_form_frontier",
    "FrontierPoint",
    "FrontierRatios",
    "frontier_ratios",
    "regularizer_product",
    "target_progress",
    "strict_protocol",
    "StrictReport",
    # errors, warnings, threads
    "ParameterError",
    "DivergenceError",
    "SpectrumError",
    "TieWarning",
    "OutlierWarning",
    "bounded_blas",
    "task_threads",
    "blas_threads",
    "threads_for",
]
publish(__name__, globals(), __all__)
del publish
__version__ = "0.1.0"
