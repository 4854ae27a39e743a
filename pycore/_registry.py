"""The one table of the linear immunization methods.

A method is one :class:`Method` record, declared beside its implementation (its name, its label in
the tables, its options class, its runner and its working set) and registered once
(:func:`register_method`). :func:`pycore.immunize`, :func:`pycore.options_of`, the work check
and the labels of every table read the record; nothing else names a method
(docs/extending.md §1 shows a method added in one place).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from pycore._linear_options import LinearOptions
from pycore._validation import ParameterError, check_choice


@dataclass(frozen=True, eq=False)
class MethodRun:
    """One run of a method: what its runner returns for each generator.

    Attributes
    ----------
    theta : ndarray, shape (D, D)
        The immunized feature extractor.
    omega : ndarray or None
        The D_P head the run trained with θ (None for a method that trains none).
    history, diagnostics : dict
        Per-epoch traces and the run's own measurements; ``diagnostics["kappa_end"]``, when
        present, is ``(κ(H_P(θ)), κ(H_H(θ)))`` from the run's own SVDs (not recomputed).
    reason : str
        How the run stopped, in a clause (:class:`pycore.ImmunizationResult` adds Definition 3.1).
    """

    theta: np.ndarray
    omega: np.ndarray | None
    history: dict
    diagnostics: dict
    reason: str


@dataclass(frozen=True)
class Method:
    """One linear immunization method: everything the library knows about it.

    Attributes
    ----------
    name : str
        What :func:`pycore.immunize` takes (``"imma"``).
    label : str
        Its row label in every table (``"IMMA"``; :data:`pycore.report.METHOD_LABELS`).
    options : type
        Its options, a frozen :class:`pycore.LinearOptions` subclass: the keywords
        :func:`pycore.immunize` takes for it, each checked by its rule.
    run : callable
        ``run(task, options, rngs) -> list[MethodRun]``: one run per generator of ``rngs``
        (a list of ``numpy.random.Generator``), each run's numbers independent of the others'.
    work : tuple of int
        ``(D×D arrays, N×D blocks)`` its runs hold at their peak, N the rows of both tasks: the
        budget check (:data:`pycore.limits.MAX_WORK_BYTES`) before any of them is allocated.
    in_tables : bool, default False
        Whether every command runs it by default (:data:`pycore.METHODS`; the documented
        tables' rows).
    """

    name: str
    label: str
    options: type[LinearOptions]
    run: Callable[..., list[MethodRun]]
    work: tuple[int, int]
    in_tables: bool = False


_REGISTRY: dict[str, Method] = {}
_BUILTIN: set[str] = set()


def register_method(method: Method) -> Method:
    """Make a method known to :func:`immunize`, :func:`options_of` and the tables.

    Parameters
    ----------
    method : Method
        The record; its ``name`` must be new.

    Returns
    -------
    Method
        ``method``, so that a module can declare and register it in one statement.

    Raises
    ------
    ParameterError
        Not a :class:`Method`, a name already registered, options that are not a
        :class:`LinearOptions` subclass, a runner that is not callable or a ``work`` that is not
        two counts (``.parameter`` is ``"method"``).

    Examples
    --------
    >>> import numpy as np
    >>> from dataclasses import dataclass
    >>> from pycore import LinearOptions, LinearTask, Method, MethodRun, immunize
    >>> from pycore import register_method, unregister_method
    >>> @dataclass(frozen=True)
    ... class HalfOptions(LinearOptions):
    ...     @property
    ...     def draws_random(self):
    ...         return False
    >>> def half(task, options, rngs):  # θ = I/2: every κ, hence every ratio, unchanged
    ...     return [MethodRun(np.eye(task.D) / 2, None, {}, {}, "θ = I/2") for _ in rngs]
    >>> _ = register_method(Method("half_doc", "θ = I/2", HalfOptions, half, work=(2, 1)))
    >>> rng = np.random.default_rng(0)
    >>> X = rng.standard_normal((20, 3))
    >>> task = LinearTask(X, X[:, 0], X @ rng.standard_normal((3, 3)), X[:, 1])
    >>> res = immunize(task, "half_doc", rng=rng)
    >>> res.method, round(res.rir, 12)
    ('half_doc', 1.0)
    >>> unregister_method("half_doc")
    """
    if not isinstance(method, Method):
        raise ParameterError(
            "method", f"register_method takes a pycore.Method, got {type(method).__name__}"
        )
    problem = None
    if method.name in _REGISTRY:
        problem = f"a method named {method.name!r} is already registered"
    elif not (isinstance(method.options, type) and issubclass(method.options, LinearOptions)):
        problem = f"{method.name}: options must be a pycore.LinearOptions subclass"
    elif not callable(method.run):
        problem = f"{method.name}: run must be callable"
    elif not (len(method.work) == 2 and all(isinstance(n, int) and n >= 0 for n in method.work)):
        problem = f"{method.name}: work must be two counts (D×D arrays, N×D blocks)"
    if problem:
        raise ParameterError("method", problem)
    _REGISTRY[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Forget a method :func:`register_method` made known (a toy method, once a test is done).

    Parameters
    ----------
    name : str
        The method's name.

    Returns
    -------
    None

    Raises
    ------
    ParameterError
        A name that is not registered, or a method of the library's own (``.parameter`` is
        ``"method"``).

    Examples
    --------
    >>> from pycore import Method, method_of, register_method, unregister_method
    >>> imma = method_of("imma")
    >>> _ = register_method(Method("imma_again", "IMMA again", imma.options, imma.run, imma.work))
    >>> unregister_method("imma_again")
    >>> unregister_method("imma")
    Traceback (most recent call last):
    ...
    pycore.ParameterError: 'imma' is a method of the library's own, not one to unregister
    """
    if name in _BUILTIN:
        raise ParameterError(
            "method", f"{name!r} is a method of the library's own, not one to unregister"
        )
    if name not in _REGISTRY:
        raise ParameterError("method", f"no method named {name!r} is registered")
    del _REGISTRY[name]


def register_builtin(*methods: Method) -> None:
    """Register the library's own methods, in the order of the tables' rows."""
    for method in methods:
        _BUILTIN.add(register_method(method).name)


def method_of(name: str) -> Method:
    """The record of a registered method.

    Parameters
    ----------
    name : str
        A method's name: one of :data:`pycore.METHODS`, ``"kstep"``, or one registered by
        :func:`register_method`.

    Returns
    -------
    Method
        Its record: ``label``, ``options`` (the keywords :func:`pycore.immunize` takes for it),
        ``run``, ``work``, ``in_tables``.

    Raises
    ------
    ParameterError
        An unknown name (``.parameter`` is ``"method"``).

    Examples
    --------
    >>> from pycore import method_of
    >>> m = method_of("imma")
    >>> m.label, m.options.names()[-2:], m.in_tables
    ('IMMA', ('inner_steps', 'inner_lr'), True)
    >>> method_of("kstep").in_tables
    False
    """
    return _REGISTRY[check_choice(name, "method", _REGISTRY)]


def each_run(run: MethodRun, rngs) -> list[MethodRun]:
    """``run`` once per generator, as copies: the runs of a method that draws nothing."""
    return [
        MethodRun(
            run.theta.copy(),
            None if run.omega is None else run.omega.copy(),
            {k: list(v) for k, v in run.history.items()},
            dict(run.diagnostics),
            run.reason,
        )
        for _ in rngs
    ]


class _Labels(Mapping):
    """Method name → its label, read from the records (and the deep tables' reference row)."""

    _REFERENCE = {"init": "Init. θ₀"}

    def __getitem__(self, name: str) -> str:
        if name in self._REFERENCE:
            return self._REFERENCE[name]
        return _REGISTRY[name].label

    def __iter__(self) -> Iterator[str]:
        yield from self._REFERENCE
        yield from _REGISTRY

    def __len__(self) -> int:
        return len(self._REFERENCE) + len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


# Every table's row labels: the registered methods' and the deep tables' reference row "init".
METHOD_LABELS: Mapping[str, str] = _Labels()
