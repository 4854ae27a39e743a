"""Deep-net immunization of any timm classifier (docs/theory.md §8-12; paper §5.2, App. C.2-C.3).

The entry points are :func:`immunize_model` and :func:`audit_model` (docs/design.md §3); the
library computes and returns, the experiments (``experiments/deepnet.py``, ``audit.py``) write.

Immunization
    immunize_model, DeepImmunization, GroupedRIR, HeldOutProbe, NearChanceWarning, DEEP_METHODS,
    DeepOptions, options, immunize_in_place, TrainResult, NonFiniteLossError, SimulatedOptions,
    SOPHON, HARDENINGS, harden
The immunization layer as the linear problem
    adaptive_layer, closed_form_layer, kstep_layer, LayerSolution, attainability, resolution,
    kstep_loss
Models, checkpoints, data
    ImmunizedNet, create_model, PretrainedUnavailableError, UnmergedAdaptersError,
    linear_classifier, tail_modules,
    load_model, save_model, read_weights, CheckpointError, CheckpointMismatchError, DataError,
    image_folder, ImageFolder, model_normalization, mnist_digits, as_dataset, dataset_labels,
    fetch, ShardedBatches,
    extract, prelogits_dataset
Attackers (operators) and the slowdown
    audit_model, AuditResult, audit_result, OPERATORS, LORA_RANKS, LR_GRIDS, operator_names,
    AttackData,
    Schedule, attack_copy, retrain_scope, budgets, slowdowns, Budget, Slowdown, SLOWDOWN_CAP,
    linear_probe_curve, ProbeCurve, GDProbe, AdamProbe
Several processes (torchrun)
    init_from_env, DistContext, DistributedEnvError, broadcast_module, barrier, shutdown
"""

# first, before anything imports timm: torchvision importable beside a CPU-only torch
from pycore.deep import _torchvision  # noqa: F401, I001
from pycore._public import publish
from pycore.deep._api import (
    DeepImmunization,
    GroupedRIR,
    HeldOutProbe,
    NearChanceWarning,
    audit_model,
    immunize_model,
)
from pycore.deep._checkpoint import (
    CheckpointError,
    CheckpointMismatchError,
    load_model,
    read_weights,
    save_model,
)
from pycore.deep._convs import OnePositionConv2d, one_position_convs
from pycore.deep._cost import Cost
from pycore.deep._data import (
    DataError,
    ImageFolder,
    ShardedBatches,
    as_dataset,
    dataset_labels,
    fetch,
    image_folder,
    mnist_digits,
    model_normalization,
)
from pycore.deep._distributed import (
    DistContext,
    DistributedEnvError,
    barrier,
    broadcast_module,
    init_from_env,
    shutdown,
)
from pycore.deep._features import extract, prelogits_dataset
from pycore.deep._hardening import HARDENINGS, harden
from pycore.deep._judge import (
    AttackCost,
    AuditResult,
    CheapestPath,
    ReferencePath,
    Worth,
    audit,
    cheapest_path,
    reference_path,
    worth,
)
from pycore.deep._layer import (
    LayerSolution,
    adaptive_layer,
    attainability,
    closed_form_layer,
    kstep_layer,
    resolution,
)
from pycore.deep._models import (
    ImmunizedNet,
    PretrainedUnavailableError,
    UnmergedAdaptersError,
    create_model,
    linear_classifier,
    tail_modules,
)
from pycore.deep._objectives import (
    DEEP_METHODS,
    imma_harmful_loss,
    kstep_loss,
    log_kappa,
    loss_terms,
)
from pycore.deep._operators import (
    LORA_RANKS,
    LR_GRIDS,
    OPERATORS,
    AttackData,
    Operator,
    Schedule,
    architecture,
    attack_copy,
    budgets,
    lora_targets,
    operator,
    operator_names,
    retrain_scope,
)
from pycore.deep._probes import (
    AdamProbe,
    GDProbe,
    ProbeCurve,
    linear_probe_curve,
    preprocess_features,
    probe_inputs,
)
from pycore.deep._simulated import SOPHON, SimulatedOptions, suppression_loss
from pycore.deep._slowdown import Budget, Eval, Reach
from pycore.deep._tail import TailRunner, stage_names
from pycore.deep._train import (
    DeepOptions,
    NonFiniteLossError,
    TrainResult,
    balanced_lambdas,
    immunize_in_place,
    options,
)

__all__ = [
    # immunization
    "immunize_model",
    "DeepImmunization",
    "GroupedRIR",
    "HeldOutProbe",
    "NearChanceWarning",
    "DEEP_METHODS",
    "DeepOptions",
    "options",
    "immunize_in_place",
    "TrainResult",
    "NonFiniteLossError",
    "SimulatedOptions",
    "SOPHON",
    "suppression_loss",
    "HARDENINGS",
    "harden",
    # the immunization layer as the linear problem
    "adaptive_layer",
    "closed_form_layer",
    "kstep_layer",
    "LayerSolution",
    "attainability",
    "resolution",
    "kstep_loss",
    "log_kappa",
    "imma_harmful_loss",
    "loss_terms",
    "balanced_lambdas",
    # models, checkpoints, data
    "ImmunizedNet",
    "create_model",
    "PretrainedUnavailableError",
    "UnmergedAdaptersError",
    "linear_classifier",
    "tail_modules",
    "stage_names",
    "TailRunner",
    "load_model",
    "save_model",
    "read_weights",
    "CheckpointError",
    "CheckpointMismatchError",
    "DataError",
    "image_folder",
    "ImageFolder",
    "model_normalization",
    "mnist_digits",
    "as_dataset",
    "dataset_labels",
    "fetch",
    "ShardedBatches",
    "extract",
    "prelogits_dataset",
    "OnePositionConv2d",
    "one_position_convs",
    # attackers (operators) and the slowdown
    "audit_model",
    "AuditResult",
    "audit",
    "reference_path",
    "cheapest_path",
    "worth",
    "ReferencePath",
    "CheapestPath",
    "AttackCost",
    "Worth",
    "Cost",
    "architecture",
    "OPERATORS",
    "LORA_RANKS",
    "LR_GRIDS",
    "operator_names",
    "operator",
    "Operator",
    "lora_targets",
    "AttackData",
    "Schedule",
    "attack_copy",
    "retrain_scope",
    "budgets",
    "Budget",
    "Reach",
    "linear_probe_curve",
    "ProbeCurve",
    "GDProbe",
    "AdamProbe",
    "probe_inputs",
    "preprocess_features",
    "Eval",
    # several processes (torchrun)
    "init_from_env",
    "DistContext",
    "DistributedEnvError",
    "broadcast_module",
    "barrier",
    "shutdown",
]
publish(__name__, globals(), __all__)
del publish
