"""Immunize a linear feature extractor θ ∈ R^{D×D}.

One entry point, per-method options (scipy style), ``immunize(task, "imma", rng=rng,
preset="strict", inner_steps=5)`` (docs/design.md §3). Methods: :data:`METHODS` (docs/theory.md §6,
§7, §10) and :data:`EXTRA_METHODS` (§11), options: :func:`options_of`, settings: :data:`PRESETS`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

import pycore._kstep as kstep_core
import pycore._methods as methods
from pycore._evaluate import immunized_def31
from pycore._metrics import def31_exponent_window, rir_ceiling
from pycore._optim import OPTIMIZERS
from pycore._options import Options
from pycore._precondition import PRECONDITIONERS
from pycore._spectral import SpectrumError, gram_spectrum
from pycore._tasks import LinearTask
from pycore._threads import bounded_blas
from pycore._validation import ParameterError, check_betas, check_choice, check_rng, check_work

# Bounds of the counts (epochs=10**23 fails at once instead of running until killed): 100× the
# paper's largest epoch count (Table 4: 1000), ~300× IMMA's 3 unrolled steps.
MAX_EPOCHS = 100_000
MAX_INNER_STEPS = 1_000
MAX_BATCH = 10**6
MAX_KSTEP_STEPS = kstep_core.MAX_STEPS
# the k-step immunizer's directions: the θ-gradient, or K⁺ times it (pycore.linalg.KStepProbe)
KSTEP_PRECONDITIONERS = ("none", "pinv")
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
    """Base of the per-method options (:func:`options_of`).

    The rules of :data:`OPTION_RULES`, :data:`OPTION_CHOICES` and :data:`OPTION_WORDS`, Adam's
    ``betas`` a pair in [0, 1).
    """

    RULES = OPTION_RULES
    CHOICES = OPTION_CHOICES
    CHECKS = {"betas": check_betas}
    WORDS = OPTION_WORDS

    def __post_init__(self):
        super().__post_init__()
        if getattr(self, "precond", None) == "ridge" and not self.ridge > 0:
            raise ParameterError("ridge", f"precond 'ridge' needs ridge > 0, got {self.ridge!r}")


@dataclass(frozen=True)
class IdentityOptions(LinearOptions):
    """θ = I: no options."""


@dataclass(frozen=True)
class ClosedFormOptions(LinearOptions):
    """Exponent a of s² = λ_C^a (docs/theory.md §10).

    A number, or "auto" (:func:`auto_exponent`).
    """

    exponent: float | str = "auto"


@dataclass(frozen=True)
class _LoopOptions(LinearOptions):
    epochs: int = 100  # paper Sec. 5.1 text (Table 4 says 1000)
    lr: float = 0.02  # paper 0.005; docs/findings.md §1
    batch_size: int | None = 64  # D_P mini-batch of the loss term (paper: 64); None = full batch
    init: str = "identity"  # or "random": nn.Linear's U(±1/√D)


@dataclass(frozen=True)
class _AdamOptions(_LoopOptions):
    optimizer: str = "adam"  # the paper's, for linear models; "gd" = Algorithm 1 as printed
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8


@dataclass(frozen=True)
class OursOptions(_AdamOptions):
    """Algorithm 1 (docs/theory.md §6).

    Both λ's "auto" (default) is the adaptive rule (docs/design.md §4); numbers give the paper's
    fixed-λ loop (``PRESETS``).
    """

    lambda_p: float | str = "auto"  # λ_P, weight of R_well(H_P); the paper's: 100
    # λ_H, weight of R_ill(H_H); the paper's 1e7 leaves R_ill inert under Adam
    lambda_h: float | str = "auto"
    precond: str = "pinv"  # K⁺ (K is singular on real data, docs/theory.md §5)
    ridge: float = 0.0  # λ of precond "ridge", (K + λI)⁻¹
    patience: int = 300  # "auto": steps without progress before lr/3 (twice), then stop
    lr: float = 0.03
    epochs: int | None = None  # None: 5000 (a budget) with "auto" λ's, 100 with numbers

    def __post_init__(self):
        if self.epochs is None:
            object.__setattr__(self, "epochs", 5000 if self.lambda_p == "auto" else 100)
        super().__post_init__()
        auto = [name for name in ("lambda_p", "lambda_h") if getattr(self, name) == "auto"]
        if len(auto) == 1:
            # named: the λ that was set to a number (both default to "auto", so it is the one a
            # caller gave), not the one left at its default
            given = "lambda_h" if auto[0] == "lambda_p" else "lambda_p"
            raise ParameterError(
                given,
                f"{given} = {getattr(self, given)!r} picks the fixed-λ loop, which needs "
                f"{auto[0]} as a number too (it is 'auto', the adaptive default's setting of "
                "both λ's)",
            )
        if auto and (self.optimizer != "adam" or self.init != "identity"):
            bad = "optimizer" if self.optimizer != "adam" else "init"
            raise ParameterError(
                bad,
                f"the adaptive default (both λ's 'auto') runs Adam from θ = I; "
                f"{bad} = {getattr(self, bad)!r} needs numbers for both λ's",
            )

    @property
    def auto(self) -> bool:
        return self.lambda_p == "auto"


@dataclass(frozen=True)
class CertifiedOptions(OursOptions):
    """:func:`immunize_certified`: ``safety`` is the fraction of each §5 step bound taken."""

    safety: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        if self.auto:
            raise ParameterError(
                "lambda_p",
                "certified mode needs numbers for lambda_p and lambda_h "
                "(preset='house_price' gives the table's)",
            )
        if self.precond not in ("exact", "pinv"):
            raise ParameterError(
                "precond",
                "certified mode needs precond 'exact' or 'pinv' "
                "(the bounds of docs/theory.md §5 are for K⁻¹/K⁺)",
            )


@dataclass(frozen=True)
class RIllOnlyOptions(_LoopOptions):
    """R_ill only (docs/theory.md §7): plain GD with step min(lr·λ_H, safety·bound)."""

    lambda_h: float = 1e10
    precond: str = "pinv"
    ridge: float = 0.0
    safety: float = 0.9


@dataclass(frozen=True)
class IMMAOptions(_AdamOptions):
    """IMMA (docs/theory.md §7): the unrolled attacker's steps and their size.

    IMMA: ``inner_steps`` unrolled attacker GD steps of size ``inner_lr``/L (docs/theory.md
    §7).
    """

    inner_steps: int = 3
    inner_lr: float = 0.5


@dataclass(frozen=True)
class OptKappaOptions(_AdamOptions):
    """Opt κ (docs/theory.md §7): the weight of κ(H_P) − κ(H_H), on κ or log κ.

    Opt κ: weight ``lambda_kappa`` of κ(H_P) − κ(H_H), of log κ when ``log`` (docs/theory.md
    §7).
    """

    lambda_kappa: float = 1.0
    log: bool = False


@dataclass(frozen=True)
class KStepOptions(LinearOptions):
    """The k-step immunizer (docs/theory.md §11).

    The adaptive rule on the k-step ratios of a GD probe of ``steps`` steps (the deep demo's
    GD-probe epoch), with a bias column when ``bias``; ``lr``, ``epochs``, ``patience`` as for the
    adaptive "ours". ``precond``: the θ-gradients as they are ("none", the default: Adam scales
    each entry itself) or K⁺-preconditioned ("pinv", Algorithm 1's; docs/findings.md §2 measures
    both).
    """

    steps: int = kstep_core.DEFAULT_STEPS
    lr: float = 0.03
    epochs: int = 5000
    patience: int = 300
    bias: bool = False
    precond: str = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.precond not in KSTEP_PRECONDITIONERS:
            raise ParameterError(
                "precond",
                f"kstep's precond must be one of {KSTEP_PRECONDITIONERS}, got {self.precond!r}",
            )


_OPTIONS = {
    "identity": IdentityOptions,
    "r_ill_only": RIllOnlyOptions,
    "imma": IMMAOptions,
    "opt_kappa": OptKappaOptions,
    "opt_kappa_balanced": OptKappaOptions,
    "ours": OursOptions,
    "closed_form": ClosedFormOptions,
}
# The methods of the documented tables: every command's default list.
METHODS = tuple(_OPTIONS)
# Methods no command runs by default (their numbers are in docs/findings.md, not in the tables):
# the k-step immunizer.
EXTRA_METHODS = ("kstep",)
_OPTIONS["kstep"] = KStepOptions
ALL_METHODS = METHODS + EXTRA_METHODS

# Named settings (docs/design.md §3), each option applied to every method that has it: MNIST's λ_H
# from the paper's rule of balancing the two preconditioned gradient norms (docs/findings.md §1).
_HOUSE_PRICE = dict(
    epochs=100,
    lr=0.02,
    batch_size=64,
    init="identity",
    optimizer="adam",
    betas=(0.9, 0.999),
    adam_eps=1e-8,
    lambda_p=100.0,
    lambda_h=1e10,
    precond="pinv",
    ridge=0.0,
    safety=0.9,
    inner_steps=3,
    inner_lr=0.5,
    lambda_kappa=1.0,
    log=False,
    exponent=0.0,
)
_PAPER = {**_HOUSE_PRICE, "lr": 0.005, "lambda_h": 1e7, "precond": "ridge", "ridge": 1e-7}
_MNIST = {**_HOUSE_PRICE, "epochs": 30, "lambda_p": 1.0, "batch_size": None, "ridge": 1e-7}
PRESETS = MappingProxyType(
    {
        name: MappingProxyType(p)
        for name, p in {
            "house_price": _HOUSE_PRICE,
            "paper": _PAPER,
            "strict": {**_PAPER, "epochs": 1000, "exponent": "auto"},
            "mnist": {**_MNIST, "lr": 0.002, "lambda_h": 1e12},
            "mnist_paper": {**_MNIST, "lr": 0.001, "lambda_h": 5e7, "precond": "ridge"},
        }.items()
    }
)


# Working set per method (pycore._validation.check_work): (D×D arrays, N×D blocks per row of both
# tasks) at its peak, from tracemalloc on random tasks (D = 300-400, N = 25-600) rounded up, the
# task's K_P and K_H included; certified "ours" and the fixed-λ loop are the larger of its modes.
WORK = MappingProxyType(
    {
        "identity": (2, 1),
        "closed_form": (2, 3),
        "ours": (21, 7),
        "imma": (13, 1),
        "r_ill_only": (6, 4),
        "opt_kappa": (21, 5),
        "opt_kappa_balanced": (21, 5),
        "kstep": (18, 5),
    }
)


def options_of(method: str) -> type[LinearOptions]:
    """The options class of a linear method.

    Parameters
    ----------
    method : str
        One of :data:`ALL_METHODS`.

    Returns
    -------
    type
        The :class:`LinearOptions` subclass holding ``method``'s options (e.g.
        :class:`OursOptions` for ``"ours"``); its ``names()`` are the keywords :func:`immunize`
        takes for the method.

    Raises
    ------
    ParameterError
        An unknown method (``.parameter`` is ``"method"``).
    """
    return _OPTIONS[check_choice(method, "method", ALL_METHODS)]


def resolve_options(
    method: str, preset: str | None = None, /, *, certified: bool = False, **options
) -> LinearOptions:
    """The options a linear method runs with: a preset's values it has, then the ones given.

    The one place a preset meets the options a caller gives (:func:`immunize`,
    :func:`immunize_certified` and the command lines all come here). An option the method lacks is
    refused, naming it and the method.

    Parameters
    ----------
    method : str
        One of :data:`ALL_METHODS`.
    preset : str, optional
        A name of :data:`PRESETS`; each of its values the method has applies.
    certified : bool, default False
        The options of :func:`immunize_certified` (method ``"ours"`` only).
    **options
        Options of the method, applied over the preset.

    Returns
    -------
    LinearOptions
        An instance of ``options_of(method)`` (:class:`CertifiedOptions` when ``certified``), each
        value checked against its bounds.

    Raises
    ------
    ParameterError
        An unknown method or preset, an option the method lacks, a value out of its bounds,
        ``certified`` with a method other than ``"ours"``; ``.parameter`` names it.
    """
    if certified and method != "ours":
        raise ParameterError("certified", f"certified mode is a mode of 'ours', not of {method!r}")
    cls, what = (
        (CertifiedOptions, "ours (certified)") if certified else (options_of(method), method)
    )
    base = None if preset is None else PRESETS[check_choice(preset, "preset", tuple(PRESETS))]
    return cls.build(base, what, **options)


def draws_random(method: str, options: LinearOptions) -> bool:
    """Whether a run of a method draws from its generator.

    A run that does not gives the same θ for every seed: θ = I, the closed form, R_ill only from
    θ = I, the adaptive Algorithm 1 and the k-step immunizer (:func:`immunize_batch` computes such
    runs once).

    Parameters
    ----------
    method : str
        One of :data:`ALL_METHODS`.
    options : LinearOptions
        The method's options as run (:func:`resolve_options`).

    Returns
    -------
    bool
        True when the run uses its generator (mini-batches, a random start).
    """
    if method in ("identity", "closed_form", "kstep"):
        return False
    if method == "ours":
        return not options.auto
    if method == "r_ill_only":
        return options.init != "identity"
    return True


@dataclass(frozen=True, eq=False)
class ImmunizationResult:
    """θ_I, what happened on the way there, and Definition 3.1 on the task's rows.

    Definition 3.1 and the ratios (i), (ii) are those of docs/theory.md §8.

    Attributes
    ----------
    method : str
        One of :data:`ALL_METHODS`.
    theta : ndarray, shape (D, D)
        The immunized feature extractor; features are ``Xθ``.
    omega : ndarray or None
        The D_P head the loop trained with θ (None for the methods that train none).
    options : LinearOptions
        The method's options as run (:func:`resolve_options`).
    harmful_ratio, pretrain_ratio : float
        (i) = κ(H_H(θ))/κ(H_H(I)) and (ii) = κ(H_P(θ))/κ(H_P(I)) on the task's rows; NaN when θ
        collapsed a task's features.
    rir : float
        (i)/(ii), paper Eq. (15).
    immunized : bool
        Definition 3.1: (i) > 1 and (ii) < 1.
    reason : str
        One sentence: how the run stopped, which exponent, whether Definition 3.1 holds.
    history, diagnostics : dict
        Per-epoch traces and the run's own measurements (step bounds, clips, exponent, ...).
    wall_seconds : float
        Time the run took.
    theta_unhardened, rotation : ndarray or None
        Set by :func:`pycore.harden_result`: θ = θ_unhardened · rotation.
    """

    method: str
    theta: np.ndarray
    omega: np.ndarray | None
    options: LinearOptions
    harmful_ratio: float
    pretrain_ratio: float
    rir: float
    immunized: bool
    reason: str
    history: dict = field(default_factory=dict)
    diagnostics: dict = field(default_factory=dict)
    wall_seconds: float = 0.0
    theta_unhardened: np.ndarray | None = None
    rotation: np.ndarray | None = None


@bounded_blas
def immunize(
    task: LinearTask,
    method: str = "ours",
    *,
    rng: np.random.Generator,
    preset: str | None = None,
    **options,
) -> ImmunizationResult:
    """Immunize a linear feature extractor θ against ``task``'s harmful rows.

    Parameters
    ----------
    task : LinearTask
        The pre-training task D_P and the harmful task D_H (docs/theory.md §1).
    method : str, default "ours"
        One of :data:`ALL_METHODS`: ``"ours"`` (Algorithm 1; by default the adaptive variant of
        docs/design.md §4), ``"closed_form"`` (the optimal θ of docs/theory.md §10), the
        baselines ``"r_ill_only"``, ``"imma"``, ``"opt_kappa"``, ``"opt_kappa_balanced"``,
        ``"identity"`` (θ = I), or ``"kstep"`` (the k-step immunizer of docs/theory.md §11,
        :data:`EXTRA_METHODS`).
    rng : numpy.random.Generator
        Every random draw of the run (mini-batches, a random start); the library never seeds.
    preset : str, optional
        Named settings, :data:`PRESETS` (``"house_price"``, ``"paper"``, ``"strict"``,
        ``"mnist"``, ``"mnist_paper"``); each applies the values the method has.
    **options
        The method's options (:func:`options_of`), on top of the preset: ``epochs``, ``lr``,
        ``lambda_p``, ``lambda_h``, ``exponent``, ...

    Returns
    -------
    ImmunizationResult
        ``theta``, ``omega``, ``options`` as run, (i) ``harmful_ratio``, (ii) ``pretrain_ratio``,
        ``rir``, ``immunized`` (Definition 3.1 on the task's rows) and the ``reason`` in one
        sentence.

    Raises
    ------
    ParameterError
        An unknown method or preset, an option the method lacks or a value out of its bounds, a
        ``task`` that is not a :class:`LinearTask`, an ``rng`` that is not a Generator;
        ``.parameter`` names it. Raised before any compute.
    DivergenceError
        The run became non-finite; ``.parameter`` names the setting to lower.

    See Also
    --------
    immunize_certified : Algorithm 1 with every step within its proven bound.
    pycore.evaluate_linear : every number of a table row, held-out rows included.
    pycore.attack_evaluation : what attackers feel.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask, immunize, rir_ceiling
    >>> rng = np.random.default_rng(0)
    >>> X_P = rng.standard_normal((50, 4)) * [1.0, 0.5, 0.2, 0.1]
    >>> X_H = rng.standard_normal((40, 4)) @ rng.standard_normal((4, 4))
    >>> task = LinearTask(X_P, rng.standard_normal(50), X_H, rng.standard_normal(40))
    >>> res = immunize(task, rng=np.random.default_rng(0))
    >>> res.immunized, bool(res.harmful_ratio > 1), bool(res.pretrain_ratio < 1)
    (True, True, True)

    The closed form reaches the ceiling of RIR over linear θ:

    >>> best = immunize(task, "closed_form", rng=np.random.default_rng(0))
    >>> round(best.rir / rir_ceiling(task.X_P, task.X_H).range_restricted, 9)
    1.0

    A preset gives the documented tables' settings; keywords override it:

    >>> immunize(task, "imma", rng=rng, preset="house_price", epochs=5).options.epochs
    5
    >>> immunize(task, "imma", rng=rng, lambda_h=1.0)
    Traceback (most recent call last):
    ...
    pycore.ParameterError: imma has no option 'lambda_h'; its options are: ...
    """
    return _run(task, method, resolve_options(method, preset, **options), [rng])[0]


@bounded_blas
def immunize_batch(
    task: LinearTask,
    method: str = "ours",
    *,
    rngs,
    preset: str | None = None,
    **options,
) -> list[ImmunizationResult]:
    """:func:`immunize` once per generator of ``rngs``, the runs stepped together as one stack.

    The runs of one table (its seeds) are independent and of one size: the loops step them as a
    B×D×D stack (docs/design.md §6), and a run that draws nothing from its generator (θ = I, the
    closed form, R_ill only from θ = I, the adaptive Algorithm 1) is computed once.

    Parameters
    ----------
    task, method, preset, **options
        As for :func:`immunize`.
    rngs : iterable of numpy.random.Generator
        One generator per run (e.g. one per seed).

    Returns
    -------
    list of ImmunizationResult
        One per generator, in order: each the result :func:`immunize` gives with that generator,
        bit for bit on this machine (tests/test_batch.py); ``wall_seconds`` is the stack's time
        shared equally.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask, immunize, immunize_batch
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((40, 5))
    >>> task = LinearTask(X, X[:, 0], X @ rng.standard_normal((5, 5)), X[:, 1])
    >>> rngs = [np.random.default_rng(s) for s in (0, 1)]
    >>> runs = immunize_batch(task, "imma", rngs=rngs, epochs=3)
    >>> one = immunize(task, "imma", rng=np.random.default_rng(1), epochs=3)
    >>> bool(np.array_equal(runs[1].theta, one.theta))
    True
    """
    rngs = list(rngs)
    if not rngs:
        raise ParameterError("rngs", "rngs must hold at least one numpy.random.Generator")
    return _run(task, method, resolve_options(method, preset, **options), rngs)


@bounded_blas
def immunize_certified(
    task: LinearTask, *, rng: np.random.Generator, preset: str | None = None, **options
) -> ImmunizationResult:
    """Algorithm 1 with every regularizer step within its proven bound.

    Each regularizer step is clipped to ``safety`` × its docs/theory.md §5 bound and κ is checked
    after it. Takes the options of ``"ours"`` with numbers for both λ's (a preset such as
    ``"house_price"`` gives them), a K⁻¹ or K⁺ preconditioner, and ``safety`` in (0, 1).

    Parameters
    ----------
    task : LinearTask
        The pre-training task D_P and the harmful task D_H.
    rng : numpy.random.Generator
        Every random draw of the run.
    preset : str, optional
        Named settings, :data:`PRESETS`.
    **options
        The options of :class:`CertifiedOptions` (those of ``"ours"`` and ``safety``), over the
        preset.

    Returns
    -------
    ImmunizationResult
        As :func:`immunize` gives; ``diagnostics["certified"]`` counts the checks, clips and
        violations.

    Raises
    ------
    ParameterError
        As for :func:`immunize`, and an "auto" λ or a preconditioner without a proven bound;
        ``.parameter`` names it.
    DivergenceError
        The run became non-finite; ``.parameter`` names the setting to lower.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask, immunize_certified
    >>> rng = np.random.default_rng(0)
    >>> X_P, X_H = rng.standard_normal((30, 3)), rng.standard_normal((30, 3))
    >>> task = LinearTask(X_P, rng.standard_normal(30), X_H, rng.standard_normal(30))
    >>> res = immunize_certified(task, rng=rng, preset="house_price", epochs=3, safety=0.5)
    >>> res.options.safety, res.diagnostics["certified"]["checked"] > 0
    (0.5, True)
    """
    opts = resolve_options("ours", preset, certified=True, **options)
    return _run(task, "ours", opts, [rng])[0]


def _run(task, method, opts, rngs) -> list[ImmunizationResult]:
    if not isinstance(task, LinearTask):
        raise ParameterError(
            "task", f"task must be a pycore.LinearTask, got {type(task).__name__}"
        )
    for rng in rngs:
        check_rng(rng)
    check_method_work(task, method)
    t0 = time.perf_counter()
    if method == "closed_form":
        ceiling = rir_ceiling(task.X_P, task.X_H)
        a, why = (
            auto_exponent(task, ceiling)
            if opts.exponent == "auto"
            else (float(opts.exponent), f"exponent {float(opts.exponent):.4g} as given")
        )
        theta, diag = methods.closed_form(task, a, ceiling)
        runs = [(theta.copy(), None, {}, dict(diag)) for _ in rngs]
        whys = [why] * len(rngs)
    elif method == "identity":
        runs = [(np.eye(task.D), None, {}, {}) for _ in rngs]
        whys = ["θ = I, the reference"] * len(rngs)
    else:
        runs = methods.RUNNERS[method](task, method, opts, rngs)
        whys = [d.get("stop", f"ran the {opts.epochs} epochs asked for") for *_, d in runs]
    seconds = (time.perf_counter() - t0) / len(rngs)
    return [_result(task, method, opts, run, why, seconds) for run, why in zip(runs, whys)]


def _result(task, method, opts, run, why, seconds) -> ImmunizationResult:
    theta, omega, hist, diag = run
    try:
        hr, pr = _ratios(task, theta, diag)
        value = hr / pr
    except SpectrumError as exc:  # θ collapsed a task's features: no κ, no Definition 3.1
        hr = pr = value = float("nan")
        why += f" but the features have no condition number ({exc})"
    ok = immunized_def31(hr, pr)
    why += (
        f"; Definition 3.1 {'holds' if ok else 'does not hold'} on the given rows: "
        f"(i) = {hr:.4g}, (ii) = {pr:.4g}."
    )
    return ImmunizationResult(
        method=method,
        theta=theta,
        omega=omega,
        options=opts,
        harmful_ratio=hr,
        pretrain_ratio=pr,
        rir=value,
        immunized=ok,
        reason=why,
        history=hist,
        diagnostics=diag,
        wall_seconds=seconds,
    )


def check_method_work(task: LinearTask, method: str) -> int:
    """The float64 work a method sets out to hold on a task, checked against the budget.

    Counted from :data:`WORK` (the method's D×D arrays and N×D blocks at its peak) and checked
    before any of them is allocated (and before worker processes start).

    Parameters
    ----------
    task : LinearTask
        The task the method would run on.
    method : str
        One of :data:`ALL_METHODS`.

    Returns
    -------
    int
        The bytes of the method's working set on ``task``.

    Raises
    ------
    ParameterError
        An unknown method.
    ValueError
        The working set exceeds :data:`pycore.limits.MAX_WORK_BYTES`; the message names D, the
        bytes and the limit.
    """
    squares, blocks = WORK[check_choice(method, "method", ALL_METHODS)]
    rows = task.X_P.shape[0] + task.X_H.shape[0]
    return check_work(task.D, rows, squares, blocks, f"immunize({method!r})")


def _ratios(task, theta, diag) -> tuple[float, float]:
    """(i), (ii) of θ (docs/theory.md §8).

    κ's at θ = I cached on the task, at θ from the run's own end-of-run SVDs
    (``diag["kappa_end"]``) when it has them.
    """
    ref = task.reference_kappas
    kP, kH = diag.get("kappa_end") or tuple(
        gram_spectrum(X @ theta, vectors=False).kappa for X in (task.X_P, task.X_H)
    )
    return kH / ref[1], kP / ref[0]


def auto_exponent(task: LinearTask, ceiling=None) -> tuple[float, str]:
    """The closed form's default exponent, and why.

    The balanced exponent of the Definition 3.1 window ((i) = 1/(ii) = √ceiling) clamped into it,
    or 0 (H_P = I) when Definition 3.1 is out of reach of the closed form.

    Parameters
    ----------
    task : LinearTask
        The task the closed form immunizes.
    ceiling : Ceiling, optional
        ``rir_ceiling(task.X_P, task.X_H)`` when already computed.

    Returns
    -------
    exponent : float
        The exponent a of ``s² = λ_C^a`` (docs/theory.md §10).
    reason : str
        Why this exponent: the window it lies in, or why Definition 3.1 is not attainable.
    """
    ceiling = ceiling if ceiling is not None else rir_ceiling(task.X_P, task.X_H)
    no = "exponent 0: Definition 3.1 is not attainable by the closed form"
    if not ceiling.kappa_C > 1 + 1e-8:  # 1e-8: far above κ(C)'s round-off at 1 (~p·eps)
        return (
            0.0,
            f"{no}, κ(C) = {ceiling.kappa_C:.6g} ≈ 1 (every exponent gives the same spectra)",
        )
    w = def31_exponent_window(ceiling)
    if w.empty:
        return 0.0, (
            f"{no}, its window [{w.low:.4g}, {w.high:.4g}) is empty (range-restricted ceiling "
            f"{ceiling.range_restricted:.4g} ≤ 1)"
        )
    a = min(max(w.balanced, w.low), w.high)
    spread = float(np.max(np.abs(np.log(ceiling.lambda_C[: ceiling.rank_C]))))
    if abs(a) * spread / 2 > 300:  # s = λ_C^(a/2) beyond 1e±130: θ is no longer representable
        return 0.0, (
            f"{no} in float64, its balanced exponent {a:.4g} scales θ's columns past 1e130 "
            f"(κ(C) = {ceiling.kappa_C:.6g} is too close to 1)"
        )
    return a, (
        f"exponent {a:.4g}: the balanced exponent of the Definition 3.1 window "
        f"[{w.low:.4g}, {w.high:.4g})" + (", clamped at 0" if a != w.balanced else "")
    )
