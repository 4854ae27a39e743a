"""Model immunization from a condition-number perspective (Zheng, Bai, Bullins, Yeh; ICML 2025).

The linear core: float64 NumPy/SciPy, never imports torch (:mod:`pycore.ops` and
:mod:`pycore.deep` do). Its public names are the ones below (docs/api.md lists them by task); the
modules whose names start with an underscore are the implementation. The other public namespaces
are :mod:`pycore.attacks` (the attackers and the worst case), :mod:`pycore.linalg` (the float64
building blocks), :mod:`pycore.report` (results as files), :mod:`pycore.data`,
:mod:`pycore.limits`, :mod:`pycore.ops` and :mod:`pycore.deep`.

Tasks and immunization
    LinearTask, immunize, immunize_batch, immunize_certified, ImmunizationResult, METHODS,
    PRESETS, options_of, LinearOptions
Adding a method
    Method, MethodRun, method_of, register_method, unregister_method
Evaluation
    evaluate_linear, LinearEvaluation, SplitEvaluation, EvaluationReference, attack_evaluation,
    AttackEvaluation, immunized_def31, near_chance
Metrics and regularizers
    rir, RIR, feature_rir, grouped_feature_rir, rir_ceiling, Ceiling, def31_exponent_window,
    ExponentWindow, kstep_remaining, condition_number, r_ill, r_well
Hardening and the strict protocol
    HARDENINGS, harden_result, strict_protocol
Errors
    ParameterError, DivergenceError, SpectrumError
"""

from pycore._attack_evaluation import AttackEvaluation, attack_evaluation
from pycore._evaluate import (
    EvaluationReference,
    LinearEvaluation,
    SplitEvaluation,
    evaluate_linear,
    immunized_def31,
    near_chance,
)
from pycore._hardening import HARDENINGS, harden_result
from pycore._immunization import (
    METHODS,
    PRESETS,
    ImmunizationResult,
    immunize,
    immunize_batch,
    immunize_certified,
    options_of,
)
from pycore._kstep import kstep_remaining
from pycore._linear_options import LinearOptions
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
from pycore._protocol import strict_protocol
from pycore._public import publish
from pycore._registry import Method, MethodRun, method_of, register_method, unregister_method
from pycore._regularizers import r_ill, r_well
from pycore._spectral import SpectrumError, condition_number
from pycore._tasks import LinearTask
from pycore._validation import DivergenceError, ParameterError

__all__ = [
    # tasks and immunization
    "LinearTask",
    "immunize",
    "immunize_batch",
    "immunize_certified",
    "ImmunizationResult",
    "METHODS",
    "PRESETS",
    "options_of",
    "LinearOptions",
    # adding a method
    "Method",
    "MethodRun",
    "method_of",
    "register_method",
    "unregister_method",
    # evaluation
    "evaluate_linear",
    "LinearEvaluation",
    "SplitEvaluation",
    "EvaluationReference",
    "attack_evaluation",
    "AttackEvaluation",
    "immunized_def31",
    "near_chance",
    # metrics and regularizers
    "rir",
    "RIR",
    "feature_rir",
    "grouped_feature_rir",
    "rir_ceiling",
    "Ceiling",
    "def31_exponent_window",
    "ExponentWindow",
    "kstep_remaining",
    "condition_number",
    "r_ill",
    "r_well",
    # hardening, the strict protocol
    "HARDENINGS",
    "harden_result",
    "strict_protocol",
    # errors
    "ParameterError",
    "DivergenceError",
    "SpectrumError",
]
publish(__name__, globals(), __all__)
del publish
__version__ = "0.1.0"
