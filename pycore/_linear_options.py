"""The linear methods' option sets: the rules every option is checked by, and the shared bases.

Each method's own options class (:class:`pycore.Method`'s ``options``) lives beside the method; it
derives from :class:`LinearOptions` here, or from the loop bases when it runs epochs of Adam or GD.
"""

from __future__ import annotations

from dataclasses import dataclass

from pycore._kstep import MAX_STEPS
from pycore._optim import OPTIMIZERS
from pycore._options import Options
from pycore._precondition import PRECONDITIONERS
from pycore._validation import ParameterError, check_betas

# Bounds of the counts (epochs=10**23 fails at once instead of running until killed): 100× the
# paper's largest epoch count (Table 4: 1000), ~300× IMMA's 3 unrolled steps.
MAX_EPOCHS = 100_000
MAX_INNER_STEPS = 1_000
MAX_BATCH = 10**6
MAX_KSTEP_STEPS = MAX_STEPS
# option → check_number bounds; NaN fails every bound (each is checked positively)
# the attacker's step inner_lr/L is stable below 2
OPTION_RULES = {
    "epochs": dict(low=0, high=MAX_EPOCHS, integer=True),
    "lr": dict(low=0.0, low_open=True),
    "patience": dict(low=1, high=MAX_EPOCHS, integer=True),
    "lambda_p": dict(low=0.0),
    "lambda_h": dict(low=0.0),
    "lambda_kappa": dict(low=0.0),
    "adam_eps": dict(low=0.0, low_open=True),
    "batch_size": dict(low=1, high=MAX_BATCH, integer=True, none_ok=True),
    "ridge": dict(low=0.0),
    "inner_steps": dict(low=0, high=MAX_INNER_STEPS, integer=True),
    "inner_lr": dict(low=0.0, high=2.0, high_open=True),
    "safety": dict(low=0.0, high=1.0, low_open=True, high_open=True),
    "exponent": dict(),  # any finite number
    "steps": dict(low=1, high=MAX_KSTEP_STEPS, integer=True),
}
OPTION_CHOICES = {
    "optimizer": OPTIMIZERS,
    "precond": PRECONDITIONERS,
    "init": ("identity", "random"),
}
# options that also take a word: "auto" λ's (the adaptive Algorithm 1), the "auto" exponent
OPTION_WORDS = {"lambda_p": ("auto",), "lambda_h": ("auto",), "exponent": ("auto",)}


@dataclass(frozen=True)
class LinearOptions(Options):
    """Base of the per-method options (:func:`pycore.options_of`).

    Every field is checked by the rule of its name (``OPTION_RULES``, ``OPTION_CHOICES``,
    ``OPTION_WORDS`` of :mod:`pycore._linear_options`); Adam's ``betas`` is a pair in [0, 1).
    A subclass with a field no rule names must make it ``True`` or ``False``.

    ``draws_random`` says whether a run with these options draws from its generator: a run that
    does not gives the same θ for every seed, and :func:`pycore.immunize_batch` computes it once.
    """

    RULES = OPTION_RULES
    CHOICES = OPTION_CHOICES
    CHECKS = {"betas": check_betas}
    WORDS = OPTION_WORDS

    def __post_init__(self):
        super().__post_init__()
        if getattr(self, "precond", None) == "ridge" and not self.ridge > 0:
            raise ParameterError("ridge", f"precond 'ridge' needs ridge > 0, got {self.ridge!r}")

    @property
    def draws_random(self) -> bool:
        """Whether a run with these options uses its generator (mini-batches, a random start)."""
        return True


@dataclass(frozen=True)
class LoopOptions(LinearOptions):
    """The options of a loop over epochs of D_P mini-batches from θ = I or a random θ."""

    epochs: int = 100  # paper Sec. 5.1 text (Table 4 says 1000)
    lr: float = 0.02  # paper 0.005; docs/findings.md §1
    batch_size: int | None = 64  # D_P mini-batch of the loss term (paper: 64); None = full batch
    init: str = "identity"  # or "random": nn.Linear's U(±1/√D)


@dataclass(frozen=True)
class AdamOptions(LoopOptions):
    """A loop's options when it steps by Adam (or by GD, ``optimizer="gd"``)."""

    optimizer: str = "adam"  # the paper's, for linear models; "gd" = Algorithm 1 as printed
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
