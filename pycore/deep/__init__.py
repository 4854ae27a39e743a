"""Deep-net immunization of any timm classifier (docs/theory.md §8-10; paper §5.2, App. C.2-C.3).

The public API is :func:`immunize_model` and :func:`audit_model` (docs/design.md §3). The library
computes and returns; the experiments (``experiments/deepnet.py``, ``audit.py``) write."""

from pycore.deep.api import (
    DeepImmunization,
    GroupedRIR,
    NearChanceWarning,
    audit_model,
    immunize_model,
)
from pycore.deep.checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load_model,
    read_weights,
    save_model,
)
from pycore.deep.data import DataError, image_folder
from pycore.deep.hardening import HARDENINGS, harden
from pycore.deep.models import ImmunizedNet, PretrainedUnavailableError, create_model
from pycore.deep.operators import OPERATORS, AuditResult
from pycore.deep.slowdown import Budget, Slowdown
from pycore.deep.train import (
    DEEP_METHODS,
    DeepOptions,
    NonFiniteLossError,
    immunize_in_place,
    options,
)

__all__ = [
    "immunize_model",
    "audit_model",
    "DeepImmunization",
    "GroupedRIR",
    "NearChanceWarning",
    "AuditResult",
    "Budget",
    "Slowdown",
    "OPERATORS",
    "DEEP_METHODS",
    "DeepOptions",
    "options",
    "immunize_in_place",
    "NonFiniteLossError",
    "ImmunizedNet",
    "create_model",
    "PretrainedUnavailableError",
    "load_model",
    "save_model",
    "read_weights",
    "CheckpointError",
    "CheckpointMismatchError",
    "DataError",
    "image_folder",
    "HARDENINGS",
    "harden",
]
