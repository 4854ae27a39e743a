"""Deep-net immunization of any timm classifier (docs/theory.md §8-10; paper §5.2, App. C.2-C.3).

The public API is :func:`immunize_model` and :func:`audit_model` (:mod:`pycore.deep.api`). The
modules, in the order of the flow: :mod:`~pycore.deep.models` (the immunization layer in any timm
model), :mod:`~pycore.deep.checkpoint` (read, save, load), :mod:`~pycore.deep.data` (image folders,
the MNIST demo, paired sharded batches), :mod:`~pycore.deep.objectives` (each method's loss, term
by term), :mod:`~pycore.deep.train` (the loop and its options), :mod:`~pycore.deep.features`,
:mod:`~pycore.deep.attacks` (linear probes and fine-tuning), :mod:`~pycore.deep.harden` and
:mod:`~pycore.deep.distributed` (torchrun / DDP). The library computes and returns; the
experiments (``experiments/deepnet.py``, ``experiments/audit.py``) write files.
"""
from pycore.deep.api import DeepImmunization, audit_model, immunize_model
from pycore.deep.checkpoint import (
    CheckpointError, CheckpointMismatchError, load_model, read_weights, save_model,
)
from pycore.deep.data import DataError, image_folder
from pycore.deep.harden import HARDENINGS, harden
from pycore.deep.models import ImmunizedNet, PretrainedUnavailableError, create_model
from pycore.deep.train import DEEP_METHODS, DeepOptions, NonFiniteLossError, immunize, options

__all__ = ["immunize_model", "audit_model", "DeepImmunization", "DEEP_METHODS", "DeepOptions", "options",
           "immunize", "NonFiniteLossError", "ImmunizedNet", "create_model", "PretrainedUnavailableError",
           "load_model", "save_model", "read_weights", "CheckpointError", "CheckpointMismatchError",
           "DataError", "image_folder", "HARDENINGS", "harden"]
