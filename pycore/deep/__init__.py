"""Deep-net immunization with timm backbones (docs/theory.md §8-10; paper §5.2, App. C.2-C.3).

Importing this package first makes ``import timm`` safe on CPU-only torch (see
:mod:`pycore.deep.timm_compat`). Modules, in the order of the flow:

* :mod:`~pycore.deep.models` -- extractors (trunk / immunized part / immunization layer),
  checkpoints, export;
* :mod:`~pycore.deep.data` -- ImageFolder roots, the MNIST demo, paired sharded batches;
* :mod:`~pycore.deep.objectives` -- each method's loss, term by term (``DEEP_METHODS``);
* :mod:`~pycore.deep.train` -- the immunization loop (``DeepImmunizeConfig`` → ``immunize`` →
  ``DeepImmunizationResult``), θ₀ training, trunk caching;
* :mod:`~pycore.deep.feature_metrics` -- RIR_θ₀ against a frozen θ₀, D_P accuracy (the deep
  twin of :mod:`pycore.metrics`);
* :mod:`~pycore.deep.attacks` -- linear probing (GD 1/L, Adam on scaled / standardised / whitened
  features) and fine-tuning attackers;
* :mod:`~pycore.deep.harden` -- hardening of the immunization layer (a feature map with the D_P
  head compensated: a rotation, or the label-subspace squash);
* :mod:`~pycore.deep.evaluate` -- the pipeline over seeds and the audit of any extractor; it
  returns results and writes no file (tables, figures and outputs are ``experiments/``'s);
* :mod:`~pycore.deep.distributed` -- torchrun / DDP helpers.

The linear side's twins are :class:`pycore.immunize.ImmunizeConfig`,
:class:`pycore.immunize.ImmunizationResult` and :data:`pycore.immunize.METHODS`.
"""
from pycore.deep.timm_compat import ensure_torchvision_ops, import_timm

ensure_torchvision_ops()

from pycore.deep.models import (  # noqa: E402
    BACKBONES, BackboneSpec, CheckpointError, CheckpointMismatchError, ImmunizableModel,
    PretrainedUnavailableError, build_model, export_timm_model, load_extractor, load_immunized,
    save_immunized,
)
from pycore.deep.objectives import DEEP_METHODS  # noqa: E402
from pycore.deep.train import (  # noqa: E402
    DeepImmunizationResult, DeepImmunizeConfig, NonFiniteLossError, cache_trunk, immunize,
    train_classifier,
)
from pycore.deep.feature_metrics import (  # noqa: E402
    FrozenReference, freeze_reference, rir_theta0, top1,
)
from pycore.deep.attacks import (  # noqa: E402
    adam_probe_curve, best_adam_probe, finetune_attack, linear_probe_curve, preprocess_features,
)
from pycore.deep.harden import HARDENINGS, harden  # noqa: E402

__all__ = [
    "ensure_torchvision_ops", "import_timm", "BACKBONES", "BackboneSpec", "CheckpointError",
    "CheckpointMismatchError", "ImmunizableModel", "PretrainedUnavailableError", "build_model",
    "export_timm_model", "load_immunized", "save_immunized", "DEEP_METHODS", "DeepImmunizeConfig",
    "DeepImmunizationResult", "NonFiniteLossError", "cache_trunk", "immunize", "train_classifier",
    "FrozenReference", "freeze_reference", "rir_theta0", "top1", "linear_probe_curve",
    "adam_probe_curve", "best_adam_probe", "finetune_attack", "preprocess_features", "HARDENINGS", "harden",
    "load_extractor",
]
