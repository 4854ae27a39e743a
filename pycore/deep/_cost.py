"""What an attacker's operator costs, in floating-point operations (docs/theory.md §12).

An operator's cost to a step count is ``setup + steps·per_step`` (:class:`Cost`):

* ``per_step``, the FLOPs of one of its actual training steps (forward, loss and backward through
  every layer the gradient passes, frozen ones included), counted by
  :class:`torch.utils.flop_counter.FlopCounterMode` on a real batch of the attacker's shape, once
  per model and operator; the linear probes' steps, in NumPy, are counted by the same rule (their
  two matrix products: :func:`head_step_flops`);
* ``setup``, its one-time work: the forward pass of the frozen part of the network over the
  attacker's training images (a probe's feature extraction, the frozen earlier stages of a tail's
  fine-tuning or retrain), counted the same way, and a probe's preprocessing.

FlopCounterMode counts matrix products, convolutions and attention (2 FLOPs a multiply-add), not
elementwise work (activations, normalisation, the optimizer's update): the rule is the same for
every operator, and it is the rule the ratios between operators are read by. Evaluations on the
attacker's validation and test splits are left out for every operator alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pycore._validation import ParameterError

# the largest relative excess of a defended model's forward FLOPs over θ₀'s that is accepted
FORWARD_TOLERANCE = 0.01


@dataclass(frozen=True)
class Cost:
    """An operator's FLOPs: ``setup`` once, then ``per_step`` a training step.

    Attributes
    ----------
    setup : float
        One-time FLOPs (feature extraction, frozen stages, preprocessing).
    per_step : float
        FLOPs of one training step.
    """

    setup: float
    per_step: float

    def at(self, steps: int | None) -> float | None:
        """The FLOPs of ``steps`` training steps with the setup (None for None)."""
        return None if steps is None else self.setup + steps * self.per_step

    def steps_within(self, flops: float) -> int:
        """The most steps whose cost, setup included, is at most ``flops`` (0 when none fits)."""
        if flops < self.setup or self.per_step <= 0:
            return 0
        return int((flops - self.setup) // self.per_step)

    def to_dict(self) -> dict:
        return {"setup": self.setup, "per_step": self.per_step}


def counted_flops(fn, *args) -> float:
    """The FLOPs :class:`~torch.utils.flop_counter.FlopCounterMode` counts while ``fn`` runs.

    Parameters
    ----------
    fn : callable
        Runs the work to count (a forward pass, a training step).
    *args
        Its arguments.

    Returns
    -------
    float
        Matrix products, convolutions and attention, 2 FLOPs a multiply-add.
    """
    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return float(counter.get_total_flops())


def forward_flops(module: nn.Module, x: torch.Tensor) -> float:
    """The FLOPs of ``module(x)`` without gradients, in eval mode (restored afterwards).

    Parameters
    ----------
    module : torch.nn.Module
        Any module.
    x : torch.Tensor
        A batch.

    Returns
    -------
    float
        The counted FLOPs of the batch.
    """
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            return counted_flops(module, x)
    finally:
        module.train(was)


def head_step_flops(rows: int, width: int, classes: int) -> float:
    """A linear head's training step on ``rows`` rows: its forward and its weight gradient.

    ``2·rows·width·classes`` each (the product ``AW`` and ``Aᵀ(softmax − Y)``), what
    FlopCounterMode counts for ``nn.Linear(width, classes, bias=False)`` on inputs that need no
    gradient.

    Parameters
    ----------
    rows, width, classes : int
        The batch's rows, the inputs' width (bias column included) and the classes.

    Returns
    -------
    float
        ``4·rows·width·classes``.
    """
    return 4.0 * rows * width * classes


def preprocessing_flops(kind: str, rows: int, width: int) -> float:
    """The matrix work of a probe's preprocessing of ``rows × width`` training features.

    ``"whiten"``: the covariance (``2·N·D²``), its symmetric eigendecomposition with vectors
    (``9·D³``, the usual count for the QR algorithm after tridiagonalisation) and the map
    (``2·N·D²``); ``"gd"``: the step's ``‖A‖₂``, the singular values of ``A`` (``4·m·n² −
    4·n³/3``, ``m ≥ n`` its sides); scaling and standardising are elementwise (0).

    Parameters
    ----------
    kind : str
        ``"whiten"``, ``"gd"``, ``"scale"`` or ``"standardize"``.
    rows, width : int
        The training features' shape.

    Returns
    -------
    float
        The FLOPs.
    """
    if kind == "whiten":
        return 4.0 * rows * width**2 + 9.0 * width**3
    if kind == "gd":
        m, n = max(rows, width), min(rows, width)
        return 4.0 * m * n**2 - 4.0 * n**3 / 3.0
    return 0.0


def check_forward_flops(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> float:
    """Refuse a defended model that costs more per forward pass than θ₀.

    A defense that only makes the network bigger makes every attacker pay without immunizing
    anything; the ratio of FLOPs the judge reports would then measure the network's size.

    Parameters
    ----------
    model, reference : torch.nn.Module
        The defended model and θ₀.
    x : torch.Tensor
        A batch of their inputs.

    Returns
    -------
    float
        The model's forward FLOPs over θ₀'s.

    Raises
    ------
    ParameterError
        ``"model"``: more than :data:`FORWARD_TOLERANCE` above θ₀'s.
    """
    mine, base = forward_flops(model, x), forward_flops(reference, x)
    ratio = mine / base if base > 0 else (1.0 if mine == 0 else float("inf"))
    if ratio > 1.0 + FORWARD_TOLERANCE:
        raise ParameterError(
            "model",
            f"the model's forward pass costs {mine:.4g} FLOPs against its reference's {base:.4g} "
            f"({ratio:.4g}×): a defense that only makes the network bigger is not judged",
        )
    return ratio
