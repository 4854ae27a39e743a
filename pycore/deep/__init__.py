"""Deep-net immunization with timm backbones (SPEC §8-9; paper §5.2, App. C.2-C.3).

Importing this package first makes ``import timm`` safe on CPU-only torch (see
:mod:`pycore.deep.timm_compat`). Modules: :mod:`~pycore.deep.models` (extractors, checkpoints,
export), :mod:`~pycore.deep.data` (ImageFolder roots, MNIST demo, paired sharded batches),
:mod:`~pycore.deep.train` (the immunization loop and baselines), :mod:`~pycore.deep.metrics`
(RIR_θ₀ against a frozen θ₀, D_P accuracy, linear probing curves),
:mod:`~pycore.deep.distributed` (torchrun / DDP helpers).
"""
from pycore.deep.timm_compat import ensure_torchvision_ops, import_timm

ensure_torchvision_ops()

from pycore.deep.models import (  # noqa: E402
    BACKBONES, BackboneSpec, CheckpointError, CheckpointMismatchError, ImmunizableModel,
    PretrainedUnavailableError, build_model, export_timm_model, load_immunized, save_immunized,
)
from pycore.deep.train import (  # noqa: E402
    METHODS, ImmunizeConfig, ImmunizeResult, NonFiniteLossError, cache_trunk, immunize,
    train_classifier,
)
from pycore.deep.metrics import (  # noqa: E402
    FrozenReference, freeze_reference, linear_probe_curve, rir_theta0, top1,
)

__all__ = [
    "ensure_torchvision_ops", "import_timm", "BACKBONES", "BackboneSpec", "CheckpointError",
    "CheckpointMismatchError", "ImmunizableModel", "PretrainedUnavailableError", "build_model",
    "export_timm_model", "load_immunized", "save_immunized", "METHODS", "ImmunizeConfig",
    "ImmunizeResult", "NonFiniteLossError", "cache_trunk", "immunize", "train_classifier",
    "FrozenReference", "freeze_reference", "linear_probe_curve", "rir_theta0", "top1",
]
