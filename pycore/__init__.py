"""Model immunization from a condition-number perspective (Zheng, Bai, Bullins, Yeh; ICML 2025).
The linear core is float64 ground truth and never imports torch (:mod:`pycore.ops`,
:mod:`pycore.deep` do).
"""

from pycore.evaluate import evaluate_linear
from pycore.immunization import immunize
from pycore.kstep import kstep_remaining
from pycore.metrics import rir, rir_ceiling
from pycore.precondition import preconditioned_grad_theta
from pycore.regularizers import (
    r_ill,
    r_ill_grad,
    r_ill_grad_theta,
    r_well,
    r_well_grad,
    r_well_grad_theta,
)
from pycore.spectral import SpectrumInfo, condition_number, spectrum_info
from pycore.tasks import LinearTask
from pycore.worst_case import attack_evaluation

__all__ = [
    "condition_number",
    "SpectrumInfo",
    "spectrum_info",
    "r_ill",
    "r_well",
    "r_ill_grad",
    "r_well_grad",
    "r_ill_grad_theta",
    "r_well_grad_theta",
    "preconditioned_grad_theta",
    "rir",
    "rir_ceiling",
    "LinearTask",
    "immunize",
    "evaluate_linear",
    "attack_evaluation",
    "kstep_remaining",
]
__version__ = "0.1.0"
