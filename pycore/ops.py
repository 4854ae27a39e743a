"""The fused condition-number regularizer op and the immunization head (docs/design.md §2).

Importing this module imports torch and registers ``torch.ops.pycore.*`` (the compiled extension
``pycore._C`` when built, the plain PyTorch reference otherwise).
"""

from pycore._ops import (
    CondDiagnostics,
    CondRegError,
    ImmunizationHead,
    cond_regularizer,
    cond_regularizer_with_diagnostics,
)
from pycore._public import publish

__all__ = [
    "cond_regularizer",
    "cond_regularizer_with_diagnostics",
    "CondDiagnostics",
    "CondRegError",
    "ImmunizationHead",
]
publish(__name__, globals(), __all__)
del publish
