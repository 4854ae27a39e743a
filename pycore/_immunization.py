"""Immunize a linear feature extractor θ ∈ R^{D×D}.

One entry point, per-method options (scipy style), ``immunize(task, "imma", rng=rng,
preset="strict", inner_steps=5)`` (docs/design.md §3). The methods are the records of
:mod:`pycore._registry`, each declared beside its implementation; :data:`METHODS` are those of
the documented tables (docs/theory.md §6, §7, §10), ``"kstep"`` the k-step immunizer (§11).
Options: :func:`options_of`, settings: :data:`PRESETS`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from pycore._algorithm1 import OURS, CertifiedOptions
from pycore._closed_form import CLOSED_FORM
from pycore._evaluate import immunized_def31
from pycore._imma import IMMA
from pycore._kstep_immunizer import KSTEP
from pycore._linear_options import LinearOptions
from pycore._opt_kappa import OPT_KAPPA, OPT_KAPPA_BALANCED
from pycore._r_ill_only import R_ILL_ONLY
from pycore._registry import Method, MethodRun, each_run, method_of, register_builtin
from pycore._spectral import SpectrumError, gram_spectrum
from pycore._tasks import LinearTask
from pycore._threads import bounded_blas
from pycore._validation import ParameterError, check_choice, check_rng, check_work


@dataclass(frozen=True)
class IdentityOptions(LinearOptions):
    """θ = I: no options."""

    @property
    def draws_random(self) -> bool:
        return False


def _identity(task, o, rngs) -> list[MethodRun]:
    return each_run(MethodRun(np.eye(task.D), None, {}, {}, "θ = I, the reference"), rngs)


IDENTITY = Method("identity", "Identity", IdentityOptions, _identity, work=(2, 1), in_tables=True)

# The library's own methods, in the order of the tables' rows.
_BUILTIN = (IDENTITY, R_ILL_ONLY, IMMA, OPT_KAPPA, OPT_KAPPA_BALANCED, OURS, CLOSED_FORM, KSTEP)
register_builtin(*_BUILTIN)
# The methods of the documented tables: every command's default list. The others (the k-step
# immunizer) have their numbers in docs/findings.md, not in the tables.
METHODS = tuple(m.name for m in _BUILTIN if m.in_tables)

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


def options_of(method: str) -> type[LinearOptions]:
    """The options class of a linear method.

    Parameters
    ----------
    method : str
        A method's name (:func:`pycore.method_of`).

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

    Examples
    --------
    >>> from pycore import options_of
    >>> options_of("imma").names()[-2:]  # the keywords immunize(task, "imma", ...) takes
    ('inner_steps', 'inner_lr')
    >>> options_of("imma")(inner_steps=0).inner_lr  # built and checked, with the defaults
    0.5
    """
    return method_of(method).options


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
        A method's name (:func:`pycore.method_of`).
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


@dataclass(frozen=True, eq=False)
class ImmunizationResult:
    """θ_I, what happened on the way there, and Definition 3.1 on the task's rows.

    Definition 3.1 and the ratios (i), (ii) are those of docs/theory.md §8.

    Attributes
    ----------
    method : str
        The method's name.
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
        A registered method (:func:`pycore.method_of`): ``"ours"`` (Algorithm 1; by default
        the adaptive variant of docs/design.md §4), ``"closed_form"`` (the optimal θ of
        docs/theory.md §10), the baselines ``"r_ill_only"``, ``"imma"``, ``"opt_kappa"``,
        ``"opt_kappa_balanced"``, ``"identity"`` (θ = I), ``"kstep"`` (the k-step immunizer of
        docs/theory.md §11), or one added by :func:`pycore.register_method`.
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
    runs = method_of(method).run(task, opts, rngs)
    seconds = (time.perf_counter() - t0) / len(rngs)
    return [_result(task, method, opts, run, seconds) for run in runs]


def _result(task, method, opts, run: MethodRun, seconds) -> ImmunizationResult:
    why = run.reason
    try:
        hr, pr = _ratios(task, run.theta, run.diagnostics)
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
        theta=run.theta,
        omega=run.omega,
        options=opts,
        harmful_ratio=hr,
        pretrain_ratio=pr,
        rir=value,
        immunized=ok,
        reason=why,
        history=run.history,
        diagnostics=run.diagnostics,
        wall_seconds=seconds,
    )


def check_method_work(task: LinearTask, method: str) -> int:
    """The float64 work a method sets out to hold on a task, checked against the budget.

    Counted from the method's ``work`` (:class:`pycore.Method`: its D×D arrays and N×D blocks at
    its peak) and checked before any of them is allocated (and before worker processes start).

    Parameters
    ----------
    task : LinearTask
        The task the method would run on.
    method : str
        A method's name (:func:`pycore.method_of`).

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
    squares, blocks = method_of(method).work
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
