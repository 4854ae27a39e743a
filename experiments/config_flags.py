"""Flags generated from a configuration dataclass (docs/cli.md), and the field ↔ flag map.

One flag per scalar field (``ImmunizeConfig.lambda_h`` → ``--lambda-h``), so a field and its
flag cannot drift apart; the flags override a base configuration only when given.
:meth:`Parser.flag_for <experiments.flags.Parser.flag_for>` maps a field back to the flag, which
is how a library error such as ``DivergenceError(..., parameter="lambda_h")`` becomes
``--lambda-h: ...``.  A flag that none of the chosen methods reads is refused
(:meth:`Settings.check`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import types
import typing

from experiments.errors import UsageError
from experiments.flags import Parser, integer, real
from pycore.validation import ParameterError

def _field_type(hint):
    """(scalar type, optional) of a dataclass field's resolved type hint; None if not scalar."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            return None, optional
        hint = args[0]
    return (hint if hint in (int, float, str, bool) else None), optional


def add_config_flags(parser: Parser, cls, shown: object | None = None, *, fields=None, bounds=None,
                     choices=None, zero_is_none=(), help=None, title: str | None = None) -> list[str]:
    """One flag per scalar field of the dataclass ``cls`` (``lambda_h`` → ``--lambda-h``).

    The flags default to None, "not given": :func:`config_from_args` applies only what the user
    typed on top of a base configuration, so the base (the class defaults, ``paper()``, a named
    configuration) stays the one source of defaults; ``shown`` supplies the defaults printed by
    ``--help``.  ``bounds`` maps a field to ``(lo, strict)`` or ``(lo, strict, hi)``: the flag
    rejects smaller values (and larger than ``hi``; every float flag rejects NaN and ±inf).
    ``choices`` maps a field to its allowed strings; a bool field gets ``--x/--no-x``; an
    ``int | None`` field listed in ``zero_is_none`` reads 0 as None (``--batch-size 0`` = full
    batch).  Returns the field names that got a flag.
    """
    hints = typing.get_type_hints(cls)
    bounds, choices, help = bounds or {}, choices or {}, help or {}
    group = parser.add_argument_group(title) if title else parser
    made = []
    for f in dataclasses.fields(cls):
        if fields is not None and f.name not in fields:
            continue
        typ, optional = _field_type(hints[f.name])
        if typ is None:
            continue  # tuples and the like: not a command-line setting
        flag = "--" + f.name.replace("_", "-")
        default = getattr(shown, f.name) if shown is not None else None
        text = help.get(f.name, "")
        if shown is not None:
            text = ((text + "; " if text else "")
                    + f"default {f'{default:g}' if isinstance(default, float) else default}")
            if f.name in zero_is_none:
                text += " (0 = None)" if default is not None else " (given as 0)"
        kw = dict(default=None, dest=f.name, help=text or None)
        if typ is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif f.name in choices:
            group.add_argument(flag, choices=tuple(choices[f.name]), **kw)
        elif typ is int:
            lo, strict, hi = (*bounds.get(f.name, (0, False)), None)[:3]
            lo = lo + 1 if strict else lo
            if f.name in zero_is_none:
                lo = min(lo, 0)
            group.add_argument(flag, type=integer(lo, hi), metavar="INT", **kw)
        elif typ is float:
            lo, strict, hi = (*bounds.get(f.name, (None, False)), None)[:3]
            group.add_argument(flag, type=real(lo, above=strict, hi=hi), metavar="X", **kw)
        else:
            group.add_argument(flag, **kw)
        parser.config_fields[f.name] = flag
        if f.name in zero_is_none and optional:
            parser.zero_is_none.add(f.name)
        made.append(f.name)
    return made


def _immunize_bounds() -> dict:
    """Bounds of the linear options' numeric flags (option: (lo, strict[, hi])); the options
    dataclasses' own checks run on top when the settings are built."""
    from pycore.immunize import MAX_EPOCHS, MAX_INNER_STEPS

    return {"epochs": (0, False, MAX_EPOCHS), "lr": (0.0, True), "lambda_p": (0.0, False),
            "lambda_h": (0.0, False), "batch_size": (1, False), "ridge": (0.0, False),
            "adam_eps": (0.0, True), "lambda_kappa": (0.0, False),
            "inner_steps": (1, False, MAX_INNER_STEPS), "inner_lr": (0.0, True), "safety": (0.0, True)}


IMMUNIZE_HELP = {
    "epochs": "immunization epochs", "lr": "learning rate η", "lambda_p": "λ_P, weight of R_well(H_P)",
    "lambda_h": "λ_H, weight of R_ill(H_H)", "batch_size": "D_P mini-batch of the loss term",
    "optimizer": "adam, or gd (Algorithm 1 as printed)", "precond": "preconditioner of the θ gradient",
    "ridge": "λ of the 'ridge' preconditioner (K+λI)⁻¹",
    "init": "θ's initialisation: identity, or nn.Linear's U(±1/√D), the paper's 'randomly initialized dummy "
            "linear layer' (App. C.2)",
    "harden": "spectrum-preserving hardening θ → θQ after the method (pycore.harden, docs/attacks.md): none, "
              "haar (Q from the run's seed) or equalize (deterministic: equal diagonal of H_H)",
    "certified": "certified-monotone mode of ours (pycore.immunize.immunize_certified): clip every "
                 "regularizer step to the docs/theory.md §5 bounds and count violations",
    "exponent": "closed form: exponent a of s² = λ_C^a, or auto (the balanced exponent of the "
                "Definition 3.1 window)",
    "inner_steps": "IMMA: unrolled attacker steps", "inner_lr": "IMMA: attacker step × 1/L",
    "log": "Opt κ: log κ instead of κ", "safety": "fraction of the §5 step bound (r_ill_only, --certified)",
}


def _method_options(method: str, certified: bool) -> list[str]:
    imm = importlib.import_module("pycore.immunize")   # pycore.immunize is also the function

    cls = imm.CertifiedOptions if certified and method == "ours" else imm.options_of(method)
    return [f.name for f in dataclasses.fields(cls)]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The immunization flags of a linear experiment: a preset of :data:`pycore.immunize.PRESETS`,
    the options typed on top of it, certified mode of "ours" and the hardening the caller applies.
    Attribute access falls back to :meth:`as_dict` (``settings.lr``: the value every method
    that has ``lr`` uses)."""

    preset: str
    options: dict = dataclasses.field(default_factory=dict)
    certified: bool = False
    harden: str = "none"

    def __getattr__(self, name):
        if name.startswith("_") or name in ("preset", "options", "certified", "harden"):
            raise AttributeError(name)   # not a setting (copy and pickle look these up)
        flat = self.as_dict()
        if name in flat:
            return flat[name]
        raise AttributeError(name)

    def as_dict(self) -> dict:
        from pycore.immunize import PRESETS

        return {"preset": self.preset, **PRESETS[self.preset], **self.options,
                "certified": self.certified, "harden": self.harden}

    def kwargs(self, method: str) -> dict:
        """Keywords of ``immunize(task, method, rng=..., **kwargs)``: the preset and the typed
        options ``method`` has."""
        names = _method_options(method, self.certified)
        return {"preset": self.preset, **{k: v for k, v in self.options.items() if k in names}}

    def run(self, task, method: str, rng):
        """Immunize (certified for "ours" when asked), then harden with the same generator."""
        imm = importlib.import_module("pycore.immunize")
        from pycore.harden import harden_result

        run = imm.immunize_certified if self.certified and method == "ours" else imm.immunize
        kw = self.kwargs(method)
        res = run(task, rng=rng, **kw) if run is imm.immunize_certified else run(task, method, rng=rng, **kw)
        return harden_result(res, task, self.harden, rng=rng)

    def check(self, methods) -> "Settings":
        """Every typed option is one of a chosen method's, and every method's options are valid
        (:class:`ParameterError` naming the option otherwise), before any compute."""
        imm = importlib.import_module("pycore.immunize")
        from pycore.harden import HARDENINGS
        from pycore.validation import check_choice

        check_choice(self.harden, "harden", HARDENINGS)
        methods = list(methods)
        given = list(self.options) + (["certified"] if self.certified else [])
        for name in given:
            readers = [m for m in imm.METHODS
                       if name in _method_options(m, True) + ["certified"] * (m == "ours")]
            if not any(m in readers for m in methods):
                raise ParameterError(name, f"{name} is not read by the chosen method(s) "
                                           f"{', '.join(methods)}; it applies to {', '.join(readers)}")
        for m in methods:
            kw = self.kwargs(m)
            if self.certified and m == "ours":
                imm._resolve(imm.CertifiedOptions, m, kw.pop("preset"), kw)
            else:
                imm.resolve_options(m, **kw)
        return self


def add_immunize_flags(parser: Parser, preset: str) -> list[str]:
    """One flag per option of every linear method (:func:`pycore.immunize.options_of`), plus
    ``--certified`` and ``--harden``; each defaults to "not given" and ``--help`` shows ``preset``'s value."""
    import types as _types

    imm = importlib.import_module("pycore.immunize")
    from pycore.harden import HARDENINGS

    shown = _types.SimpleNamespace(**imm.PRESETS[preset])
    group = parser.add_argument_group(f"immunization (pycore.immunize options on top of the preset "
                                      f"{preset!r}; applied only when given)")
    group.config_fields = parser.config_fields
    group.zero_is_none = parser.zero_is_none
    made = []
    for cls in (*dict.fromkeys(imm.options_of(m) for m in imm.METHODS), imm.CertifiedOptions):
        names = [f.name for f in dataclasses.fields(cls) if f.name not in made and f.name != "exponent"]
        made += add_config_flags(group, cls, shown, fields=names, bounds=_immunize_bounds(),
                                 choices={"optimizer": imm.OPTIMIZERS, "init": ("identity", "random"),
                                          "precond": imm.PRECONDITIONERS},
                                 zero_is_none=("batch_size",), help=IMMUNIZE_HELP)
    real_number = real()
    group.add_argument("--exponent", type=lambda v: v if v == "auto" else real_number(v), default=None,
                       metavar="X|auto", help=f"{IMMUNIZE_HELP['exponent']}; default {shown.exponent}")
    group.add_argument("--certified", action=argparse.BooleanOptionalAction, default=None,
                       help=IMMUNIZE_HELP["certified"])
    group.add_argument("--harden", choices=HARDENINGS, default=None, help=IMMUNIZE_HELP["harden"])
    for name in ("exponent", "certified", "harden"):
        parser.config_fields[name] = "--" + name
    return made + ["exponent", "certified", "harden"]


def settings_from_args(parser: Parser, args, preset: str, methods, *, harden: str = "none") -> Settings:
    """:class:`Settings` from the typed immunization flags on top of ``preset``, checked against
    ``methods`` before any compute; a failure becomes a :class:`UsageError` naming the flag."""
    given = given_config_flags(parser, args)
    try:
        return Settings(preset, {k: v for k, v in given.items() if k not in ("certified", "harden")},
                        bool(given.get("certified", False)), given.get("harden", harden)).check(methods)
    except ParameterError as exc:
        raise _usage_error(parser, exc) from exc


def _usage_error(parser: Parser, exc: ParameterError) -> UsageError:
    flag, msg = parser.flag_for(exc.parameter), parser.name_flags(str(exc))
    for said in (flag, exc.parameter):   # "--x: is not read by ...", not "--x: x is not read by ..."
        if flag and said and msg.startswith(said + " "):
            msg = msg[len(said) + 1:]
    return UsageError(msg, flag)


def given_config_flags(parser: Parser, args) -> dict:
    """The generated flags the user typed, as ``{field: value}`` (0 → None where declared)."""
    out = {}
    for name in parser.config_fields:
        v = getattr(args, name, None)
        if v is not None:
            out[name] = None if (name in parser.zero_is_none and v == 0) else v
    return out


def config_from_args(parser: Parser, args, base, *, validate=None):
    """``dataclasses.replace(base, **typed flags)``; the configuration's own checks (its
    ``__post_init__`` or ``validate``) run here, before any compute, and a failure becomes a
    :class:`UsageError` naming the flag."""
    given = given_config_flags(parser, args)
    try:
        cfg = dataclasses.replace(base, **given)
        if validate is not None:
            cfg = validate(cfg) or cfg
    except ParameterError as exc:
        raise _usage_error(parser, exc) from exc
    except (ValueError, TypeError) as exc:
        raise UsageError(_name_config_flag(parser, str(exc))) from exc
    return cfg


def _name_config_flag(parser: Parser, message: str) -> str:
    """Prefix a configuration's error message with the flag of the first field it names."""
    hits = []
    for name, flag in parser.config_fields.items():
        m = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", message)
        if m:
            hits.append((m.start(), flag, name))
    if not hits:
        return message
    _, flag, _ = min(hits)
    return f"{flag}: {parser.name_flags(message)}"

