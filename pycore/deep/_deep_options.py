"""The options of deep immunization, and what :func:`pycore.deep._train.immunize_in_place` returns.

:class:`DeepOptions` is checked by the rule tables below (:class:`pycore._options.Options`);
the loop that reads it is :mod:`pycore.deep._train`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pycore._options import Options
from pycore._validation import DivergenceError, ParameterError
from pycore.deep._hardening import HARDENINGS


def _count(low: int, high: int, none_ok: bool = False) -> dict:
    return dict(low=low, high=high, integer=True, none_ok=none_ok)


# Option → pycore._validation.check_number bounds; every count is bounded so no setting runs
# unbounded.
OPTION_RULES = {
    "epochs": _count(1, 100_000),
    "adaptive_steps": _count(0, 100_000),
    "patience": _count(1, 100_000),
    "max_steps": _count(1, 10_000_000, True),
    "batch_size": _count(1, 65_536),
    "balance_every": _count(0, 10_000_000),
    "imma_inner_steps": _count(0, 1_000),
    "stages": _count(1, 1_000),
    "kstep_steps": _count(1, 10_000),
    "virtual_ranks": _count(1, 1_024),
    **{
        k: dict(
            low=0.0,
            low_open=True,
            none_ok=k in ("balance", "balance_ill", "dp_tolerance"),
        )
        for k in (
            "lr",
            "lambda_p",
            "lambda_h",
            "lambda_kappa",
            "lambda_imma",
            "balance",
            "balance_ill",
            "imma_inner_lr",
            "ridge_rel",
            "dp_tolerance",
        )
    },
    # Adam moves every entry of θ (from I, entries ≤ 1) by about lr per step: above 1 one step
    # outweighs the identity itself (the default is 0.27/√D, docs/design.md §4)
    "adaptive_lr": dict(low=0.0, high=1.0, low_open=True, none_ok=True),
    "harden_scale": dict(low=0.0, high=1.0, low_open=True),
    **{
        k: dict(low=0.0, high=1.0, high_open=True)
        for k in (
            "momentum",
            "label_smoothing",
            "weight_decay_extractor",
            "weight_decay_classifier",
        )
    },
}


OPTION_CHOICES = {
    "scope": ("layer", "tail"),
    "harden": HARDENINGS["deep"],
    "rule": ("adaptive", "sgd"),
    "optimizer": ("sgd", "adam"),
}


@dataclass(frozen=True)
class DeepOptions(Options):
    """Options of deep immunization.

    ``ours`` defaults to the adaptive rule of the linear default on the layer's frozen features
    (``rule``, ``adaptive_steps``, ``patience``, ``adaptive_lr``; docs/design.md §4).
    ``rule="sgd"`` and the baselines run the paper's loop: the layer (and with ``scope="tail"`` the
    backbone's last stages) by SGD lr 0.1, ≤ 400 steps of 64 + 64 samples, every term re-balanced
    every step; the paper's Table 4 uses fixed λ's, ``lr=1e-5``, ``scope="tail"``
    (experiments/deep_configs.py). Every option is checked by :data:`OPTION_RULES` or
    :data:`OPTION_CHOICES`, or is a bool (:class:`pycore._options.Options`).
    """

    RULES = OPTION_RULES
    CHOICES = OPTION_CHOICES

    rule: str = "adaptive"  # ours: "adaptive" (pycore._adaptive on the layer) or "sgd" (Eq. (11))
    adaptive_steps: int = 5000  # the adaptive rule's step budget (the linear default's)
    patience: int = 300  # the adaptive rule's patience (the linear default's)
    adaptive_lr: float | None = None  # None: pycore.deep._layer.relative_step_lr(D)

    epochs: int = 100  # epochs of the paired loader (the longer task sets the length)
    max_steps: int | None = 400
    batch_size: int = 64  # per rank; capped at the smaller task's size
    kstep_steps: int = 10  # kstep: the GD probe's steps k of E_k (docs/theory.md §11)
    lr: float = 0.1
    optimizer: str = "sgd"  # the loop's optimizer: SGD (momentum, Nesterov; the paper's) or Adam
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay_extractor: float = 0.0
    weight_decay_classifier: float = 2e-5
    label_smoothing: float = 0.1
    lambda_p: float = 5e-5  # R_well weight (fixed λ's: balance=None)
    lambda_h: float = 2e6  # R_ill weight
    lambda_kappa: float = 1.0  # Opt-κ weight
    lambda_imma: float = 1.0  # IMMA harmful-loss weight
    balance: float | None = 1.0  # λ := balance·‖∇CE‖/‖∇term‖ (App. C.2); None: the lambda_* above
    balance_every: int = 1  # 0: balance at step 0 only
    balance_ill: float | None = None  # balance of the R_ill term alone (the trade-off sweep)
    imma_inner_steps: int = 3
    imma_inner_lr: float = 1.0  # in units of 1/λ_max(AᵀA/N)
    ridge_rel: float = 1e-6  # preconditioner ridge relative to tr(XᵀX)/N of the first D_P batch
    scope: str = "layer"  # "layer": the layer alone; "tail": also the backbone's last stages
    stages: int = 1  # scope "tail": how many of the backbone's last stages
    virtual_ranks: int = 1
    harden: str = "none"  # pycore.deep._hardening, applied after training
    harden_scale: float = 0.01
    normalize: bool = True  # steps in unit-scale features (False: the features' own scale)
    fold_batchnorm: bool = False  # scope tail: the trained BatchNorms folded first (design §4)
    dp_tolerance: float | None = 2.0  # end on the last state within this many % of D_P's top-1

    def __post_init__(self):
        super().__post_init__()
        if self.balance_ill is not None and self.balance is None:
            raise ParameterError(
                "balance_ill", "balance_ill re-weights the balanced R_ill term: set balance"
            )
        if self.rule == "adaptive" and self.scope != "layer":
            raise ParameterError(
                "rule",
                "the adaptive rule solves the layer on frozen features (scope 'layer'); "
                "scope 'tail' trains the backbone too: pass rule='sgd'",
            )


def options(base: DeepOptions | None = None, **given) -> DeepOptions:
    """Deep immunization options: a base set with some replaced, each checked.

    Parameters
    ----------
    base : DeepOptions, optional
        The options to start from (default :class:`DeepOptions`).
    **given
        Options to replace, by name.

    Returns
    -------
    DeepOptions
        The options.

    Raises
    ------
    ParameterError
        An unknown or bad option; ``.parameter`` names it.
    """
    return DeepOptions.build(base or DeepOptions(), "deep immunization", **given)


class NonFiniteLossError(DivergenceError):
    """A non-finite loss or gradient.

    ``.parameter`` names the option to change, ``.step`` the failed step (not applied: the model
    keeps its last good step, which only experiments/ write to a file).
    """

    def __init__(self, parameter: str, message: str, step: int):
        super().__init__(parameter, message)
        self.step = step


@dataclass
class TrainResult:
    """What :func:`immunize_in_place` did.

    The λ's in force at the end (and the ridge), the per-step history.
    """

    method: str
    steps: int
    wall_seconds: float
    lambdas: dict
    history: dict = field(default_factory=dict)
    hardening: dict | None = None
    stopped: str = ""  # why training stopped before its last step ("" when it did not)
