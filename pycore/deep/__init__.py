"""Deep-net immunization of any timm classifier (docs/theory.md §8-12; paper §5.2, App. C.2-C.3).

The entry points are :func:`immunize_model` and :func:`audit_model` (docs/design.md §3); the
library computes and returns, the experiments (``experiments/deepnet.py``, ``audit.py``) write.
Its public names are the ones below (docs/api.md lists them by task); the modules whose names
start with an underscore are the implementation.

Immunization
    immunize_model, DeepImmunization, DeepOptions, SimulatedOptions, SOPHON, DEEP_METHODS,
    NearChanceWarning, NonFiniteLossError, GroupedRIR, HeldOutProbe
Models, checkpoints, data
    ImmunizedNet, create_model, load_model, save_model, image_folder, mnist_digits, DataError,
    CheckpointError, PretrainedUnavailableError
The attacker's audit and the judge
    audit_model, AuditResult, reference_path, cheapest_path, worth, ReferencePath, CheapestPath,
    AttackCost, Worth, AttackData, OPERATORS
"""

# first, before anything imports timm: torchvision importable beside a CPU-only torch
from pycore.deep import _torchvision  # noqa: F401, I001
from pycore._public import publish as _publish
from pycore.deep._api import (
    DeepImmunization,
    GroupedRIR,
    HeldOutProbe,
    NearChanceWarning,
    immunize_model,
)
from pycore.deep._audit_model import audit_model
from pycore.deep._checkpoint import CheckpointError, load_model, save_model
from pycore.deep._data import DataError, image_folder, mnist_digits
from pycore.deep._deep_options import DeepOptions, NonFiniteLossError
from pycore.deep._judge import (
    AttackCost,
    AuditResult,
    CheapestPath,
    ReferencePath,
    Worth,
    cheapest_path,
    reference_path,
    worth,
)
from pycore.deep._models import ImmunizedNet, PretrainedUnavailableError, create_model
from pycore.deep._objectives import DEEP_METHODS
from pycore.deep._operators import OPERATORS, AttackData
from pycore.deep._simulated import SOPHON, SimulatedOptions

__all__ = [
    # immunization
    "immunize_model",
    "DeepImmunization",
    "DeepOptions",
    "SimulatedOptions",
    "SOPHON",
    "DEEP_METHODS",
    "NearChanceWarning",
    "NonFiniteLossError",
    "GroupedRIR",
    "HeldOutProbe",
    # models, checkpoints, data
    "ImmunizedNet",
    "create_model",
    "load_model",
    "save_model",
    "image_folder",
    "mnist_digits",
    "DataError",
    "CheckpointError",
    "PretrainedUnavailableError",
    # the attacker's audit and the judge
    "audit_model",
    "AuditResult",
    "reference_path",
    "cheapest_path",
    "worth",
    "ReferencePath",
    "CheapestPath",
    "AttackCost",
    "Worth",
    "AttackData",
    "OPERATORS",
]
_publish(__name__, globals(), __all__)
del _publish
