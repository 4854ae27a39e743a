"""The fused condition-number regularizer op and the immunization head (docs/design.md §2).

Importing this module imports torch and registers ``torch.ops.pycore.*`` (the compiled extension
``pycore._C`` when built, the plain PyTorch reference otherwise).
"""

from pycore._ops import (
    KINDS,
    CondDiagnostics,
    CondRegError,
    ImmunizationHead,
    cond_regularizer,
    cond_regularizer_with_diagnostics,
    extension_available,
    precond_linear,
    reference_cond_regularizer,
)
from pycore._public import publish

__all__ = [
    "KINDS",
    "CondRegError",
    "CondDiagnostics",
    "cond_regularizer",
    "ImmunizationHead",
    "precond_linear",
    "cond_regularizer_with_diagnostics",
    "reference_cond_regularizer",
    "extension_available",
]
publish(__name__, globals(), __all__)
del publish
