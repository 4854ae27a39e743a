"""Option sets: frozen dataclasses whose every field is checked once, when the set is built.

The linear methods' options (:mod:`pycore._immunization`) and the deep ones
(:class:`pycore.deep.DeepOptions`) share :class:`Options`: one checking loop, driven by tables of
rules keyed by the option's name, and one way to lay the options a caller gives over a preset
(:meth:`Options.build`). A command line passes what the user typed to :meth:`Options.build` and
lets the library refuse a bad value; the error's ``.parameter`` names the option, hence the flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pycore._validation import ParameterError, check_choice, check_number, describe_number


@dataclasses.dataclass(frozen=True)
class Options:
    """Base of every option set: each field is checked by the rule of its name.

    A subclass is a frozen dataclass whose fields are the options, with their defaults, and whose
    class variables hold the rules:

    * ``RULES``: name → keyword arguments of :func:`pycore._validation.check_number` (bounds,
      ``integer``, ``none_ok``);
    * ``CHOICES``: name → the values allowed;
    * ``CHECKS``: name → a function ``check(value, name)`` that raises
      :class:`~pycore.ParameterError`;
    * ``WORDS``: name → words accepted in place of a number (``"auto"``).

    A field that no table names must be ``True`` or ``False``. A subclass's own
    ``__post_init__`` calls this one first, then checks what involves several fields.

    Raises
    ------
    ParameterError
        At construction, for the first option whose value breaks its rule; ``.parameter`` is the
        option's name.

    Examples
    --------
    >>> from dataclasses import dataclass
    >>> from pycore import ParameterError
    >>> from pycore._options import Options
    >>> @dataclass(frozen=True)
    ... class Probe(Options):
    ...     RULES = {"steps": dict(low=1, high=1000, integer=True)}
    ...     CHOICES = {"solver": ("gd", "cg")}
    ...     steps: int = 10
    ...     solver: str = "gd"
    ...     verbose: bool = False
    >>> Probe.build({"steps": 50, "tolerance": 1e-6}, solver="cg")  # the preset's own keys only
    Probe(steps=50, solver='cg', verbose=False)
    >>> Probe(steps=0)
    Traceback (most recent call last):
    ...
    pycore.ParameterError: steps must be an integer in [1, 1000], got 0
    >>> try:
    ...     Probe.build(None, "the probe", step=3)
    ... except ParameterError as exc:
    ...     print(exc.parameter, "|", exc)
    step | the probe has no option 'step'; its options are: steps, solver, verbose
    """

    RULES: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    CHOICES: ClassVar[Mapping[str, tuple]] = {}
    CHECKS: ClassVar[Mapping[str, Callable[[Any, str], Any]]] = {}
    WORDS: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    def __post_init__(self):
        for f in dataclasses.fields(self):
            name, value = f.name, getattr(self, f.name)
            if isinstance(value, str) and value in self.WORDS.get(name, ()):
                continue
            if name in self.RULES:
                check_number(value, name, **self.RULES[name])
            elif name in self.CHOICES:
                check_choice(value, name, self.CHOICES[name])
            elif name in self.CHECKS:
                self.CHECKS[name](value, name)
            elif not isinstance(value, bool):
                raise ParameterError(name, f"{name} must be True or False, got {value!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options of this set, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def describe(cls, name: str) -> str:
        """The rule of option ``name`` in words (a command line's ``--help`` prints it)."""
        if name in cls.RULES:
            rule = cls.RULES[name]
            text = describe_number(**rule)
        elif name in cls.CHOICES:
            text = "one of " + ", ".join(map(str, cls.CHOICES[name]))
        elif name in cls.CHECKS:
            text = (cls.CHECKS[name].__doc__ or "checked").strip().splitlines()[0].rstrip(".")
        else:
            text = "True or False"
        words = cls.WORDS.get(name, ())
        return text + "".join(f" or {w!r}" for w in words)

    @classmethod
    def build(cls, preset: Mapping[str, Any] | Options | None = None, what=None, /, **given):
        """The option set of ``preset``'s values that this set has, then ``given`` on top.

        Parameters
        ----------
        preset : mapping, Options or None
            Named settings; keys this set lacks are skipped (a preset serves several sets).
        what : str, optional
            How an error names this set (default: the class name).
        **given
            Options set by the caller; each must be one of :meth:`names`.

        Returns
        -------
        Options
            An instance of ``cls``, every field checked.

        Raises
        ------
        ParameterError
            An option in ``given`` that this set lacks, or any value its rule refuses.
        """
        names = cls.names()
        for key in given:
            if key not in names:
                raise ParameterError(
                    key,
                    f"{what or cls.__name__} has no option {key!r}; its options are: "
                    f"{', '.join(names) or 'none'}",
                )
        base = preset.to_dict() if isinstance(preset, Options) else dict(preset or {})
        return cls(**{**{k: v for k, v in base.items() if k in names}, **given})

    def to_dict(self) -> dict[str, Any]:
        """``{option: value}``, for results.json."""
        return {name: getattr(self, name) for name in self.names()}
