"""The command-line layer every experiment script shares (README "Errors and guarantees").

* One flag syntax: ``--seeds N|A,B,C|A-B``, comma lists for methods and other choices, and the
  hyper-parameter flags GENERATED from a configuration dataclass (:func:`add_config_flags`), so
  a field and its flag cannot drift apart; :meth:`Parser.flag_for` maps a field name back to
  the flag the user typed, which is how a library error such as
  ``DivergenceError(..., parameter="lambda_h")`` becomes ``--lambda-h: ...``.
* Every flag is checked before any compute, naming the flag; ``--out`` included
  (:class:`OutputSet`).
* Exit codes: 0 success, 1 data or runtime error, 2 usage error (a flag value that cannot
  work), 130 Ctrl-C, 143 SIGTERM.  One line on stderr, no traceback unless ``--debug``.
* Outputs of one run form one set: written into a staging folder beside ``--out`` and swapped
  in with one rename, so an interrupted or failed run leaves the previous set intact and a
  finished run leaves no file of an earlier run behind.
* Worker processes (:func:`parallel_map`) never outlive the run: SIGTERM is handled like
  Ctrl-C (the pool is terminated) and each worker asks the kernel to kill it when its parent
  dies (``PR_SET_PDEATHSIG`` on Linux), whatever killed the parent.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import fnmatch
import functools
import math
import os
import re
import shutil
import signal
import sys
import time
import traceback
import types
import typing
from pathlib import Path

from pycore.report import progress, write_json
from pycore.validation import ParameterError

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM



class UsageError(Exception):
    """A flag value that cannot work (exit 2).  ``flag`` is the flag as typed (``"--seeds"``)."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(message)
        self.flag = flag

    def __str__(self):
        msg = super().__str__()
        return f"{self.flag}: {msg}" if self.flag else msg


class RunError(Exception):
    """A run that finished but must not count as a success (exit 1), e.g. a method that failed."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what ``timeout`` and job schedulers send), handled exactly like Ctrl-C."""


# --- parser and flag types --------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """``argparse`` with one-line usage errors (raised as :class:`UsageError`, never printed
    with the usage block), no prefix abbreviations (``--seed`` must not silently mean
    ``--seeds``), a ``--debug`` flag, and the field ↔ flag map of the generated flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.config_fields: dict[str, str] = {}   # dataclass field → flag, for generated flags
        self.zero_is_none: set[str] = set()
        self.add_argument("--debug", action="store_true", help="on error, print the full traceback")

    def error(self, message):
        # "argument --seeds: ..." → "--seeds: ..."; argparse already names the flag.
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        # a library message that already starts with the flag ("--pairs '3-3': ...") names it once
        raise UsageError(re.sub(r"^(--[\w-]+): \1:? ?", r"\1: ", message))

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        self._reject_space_separated_lists(argv)
        return super().parse_args(argv, namespace)

    def _reject_space_separated_lists(self, argv):
        """``--seeds 0 1 2`` (the old syntax of one script) would parse as ``--seeds 0`` and an
        error about ``0``; say what is wrong instead.  No script takes positional arguments."""
        i = 0
        while i < len(argv):
            tok = argv[i]
            if tok == "--":
                return
            action = self._option_string_actions.get(tok)
            if action is None or action.nargs == 0 or "=" in tok:
                i += 1
                continue
            j = i + 2
            extra = []
            while j < len(argv) and (not argv[j].startswith("-") or re.fullmatch(r"-\d[\d.e+-]*", argv[j])):
                extra.append(argv[j])
                j += 1
            if extra and i + 1 < len(argv):
                raise UsageError(f"takes one value, got {' '.join([argv[i + 1], *extra])!r}; lists are "
                                 f"comma-separated: {tok} {','.join([argv[i + 1], *extra])}", tok)
            i = j

    def flag_for(self, name: str | None) -> str | None:
        """The flag that sets ``name`` (a config field or an ``args`` attribute), or None."""
        if not name:
            return None
        if name in self.config_fields:
            return self.config_fields[name]
        flag = "--" + name.replace("_", "-")
        return flag if flag in self._option_string_actions else None

    def name_flags(self, message: str) -> str:
        """Spell the snake_case names of flags in a library message as the flags (``n_train`` →
        ``--n-train``), so the user reads what to change.  Names without an underscore are left
        alone: words like ``epochs`` or ``seeds`` are also prose."""
        def sub(m):
            flag = self.flag_for(m.group(0))
            return flag if flag else m.group(0)
        return re.sub(r"(?<![\w-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w-])", sub, message)


def _type(name: str, convert):
    """An argparse ``type`` whose ``ValueError`` message becomes the flag's error message."""
    def parse(text):
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = name
    return parse


def _int(text) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"must be an integer, got {text!r}") from None


def _float(text) -> float:
    try:
        x = float(str(text).strip())
    except ValueError:
        raise ValueError(f"must be a number, got {text!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"must be finite, got {text!r}")
    return x


def integer(lo: int | None = None, hi: int | None = None):
    """Flag type: an integer in ``[lo, hi]``."""
    def convert(text):
        n = _int(text)
        if lo is not None and n < lo:
            raise ValueError(f"must be ≥ {lo}, got {n}")
        if hi is not None and n > hi:
            raise ValueError(f"must be ≤ {hi}, got {n}")
        return n
    return _type("integer", convert)


def real(lo: float | None = None, *, above: bool = False, hi: float | None = None, below: bool = False):
    """Flag type: a finite float ≥ ``lo`` (> ``lo`` when ``above``), ≤ ``hi`` (< when ``below``)."""
    def convert(text):
        x = _float(text)
        if lo is not None and (x <= lo if above else x < lo):
            raise ValueError(f"must be {'>' if above else '≥'} {lo:g}, got {text}")
        if hi is not None and (x >= hi if below else x > hi):
            raise ValueError(f"must be {'<' if below else '≤'} {hi:g}, got {text}")
        return x
    return _type("real", convert)


SEEDS_SYNTAX = "a count N (seeds 0..N-1), a list A,B,C or a range A-B"
MAX_SEEDS = 100_000  # a typo such as --seeds 10000000 must fail at once, not allocate and run


def parse_seeds(text: str) -> list[int]:
    """``"5"`` → [0..4]; ``"0,3,7"`` → [0, 3, 7]; ``"2-4"`` → [2, 3, 4].  Never empty, no
    negative seed (a ``numpy`` seed is ≥ 0), no repeated seed (it would double-count a run)."""
    t = str(text).strip()
    syntax = f"give {SEEDS_SYNTAX}, got {text!r}"
    try:
        if "," in t:
            items = [s.strip() for s in t.split(",")]
            if any(not s for s in items):
                raise ValueError(f"empty item in the list; {syntax}")
            seeds = [int(s) for s in items]
        elif "-" in t[1:]:
            a, b = (int(s) for s in t.split("-", 1))
            if b < a:
                raise ValueError(f"empty range {t} (its end {b} is below its start {a}); {syntax}")
            if b - a + 1 > MAX_SEEDS:
                raise ValueError(f"{b - a + 1} seeds, more than {MAX_SEEDS}")
            seeds = list(range(a, b + 1))
        else:
            n = int(t)
            if n < 1:
                raise ValueError(f"a count must be ≥ 1, got {n}; {syntax}")
            if n > MAX_SEEDS:
                raise ValueError(f"{n} seeds, more than {MAX_SEEDS}")
            seeds = list(range(n))
    except ValueError as exc:
        if "invalid literal" in str(exc):
            raise ValueError(syntax) from None
        raise
    bad = [s for s in seeds if s < 0]
    if bad:
        raise ValueError(f"seeds must be ≥ 0, got {bad[0]}")
    dup = sorted({s for s in seeds if seeds.count(s) > 1})
    if dup:
        raise ValueError(f"seed {dup[0]} is repeated")
    return seeds


seeds = _type("seeds", parse_seeds)


def add_seeds(parser: argparse.ArgumentParser, default: str | None, what: str = "seeds", dest: str = "seeds",
              default_help: str | None = None) -> None:
    """The one ``--seeds`` flag of every script (``args.<dest>`` is the list).  ``default=None``
    leaves ``args.<dest>`` None when the flag is not given, for a default that depends on other
    flags (describe it in ``default_help``)."""
    parser.add_argument("--seeds", dest=dest, type=seeds, default=default, metavar="N|A,B,C|A-B",
                        help=f"{what}: {SEEDS_SYNTAX}; default {default_help or default}")


def _pairs(text):
    from pycore.data.mnist import parse_pairs  # noqa: PLC0415 -- NumPy only, but not needed by every script

    return parse_pairs(text)


pairs = _type("pairs", _pairs)  # MNIST ordered digit pairs: all | P-H,P-H,…


def choice_list(choices, what: str = "value"):
    """Flag type: a comma list of distinct items from ``choices`` (at least one)."""
    choices = tuple(choices)

    def convert(text):
        items = [s.strip() for s in str(text).split(",")]
        if not any(items):
            raise ValueError(f"empty list; choose from {','.join(choices)}")
        if any(not s for s in items):
            raise ValueError(f"empty item in {text!r}")
        bad = [s for s in items if s not in choices]
        if bad:
            raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; choose from {','.join(choices)}")
        dup = sorted({s for s in items if items.count(s) > 1})
        if dup:
            raise ValueError(f"{what} {dup[0]!r} is repeated")
        return items
    return _type("choice_list", convert)


def number_list(lo=None, hi=None, *, open_interval: bool = False):
    """Flag type: a comma list of distinct finite numbers in ``[lo, hi]`` (open when asked)."""
    item = real(lo, above=open_interval, hi=hi, below=open_interval)

    def convert(text):
        items = [s.strip() for s in str(text).split(",")]
        if any(not s for s in items):
            raise ValueError(f"empty item in {text!r}")
        try:
            values = [item(s) for s in items]
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        if len(set(values)) != len(values):
            raise ValueError(f"repeated value in {text!r}")
        return values
    return _type("number_list", convert)


def existing_path(kind: str = "file"):
    """Flag type: a path that exists (a ``file`` or a ``folder``), checked before any compute."""
    def convert(text):
        p = Path(text).expanduser()
        if not p.exists():
            raise ValueError(f"no such {kind}: {text}")
        if kind == "file" and not p.is_file():
            raise ValueError(f"not a file: {text}")
        if kind == "folder" and not p.is_dir():
            raise ValueError(f"not a folder: {text}")
        return p
    return _type("existing_path", convert)


# --- flags generated from a configuration dataclass -----------------------------------------

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
    ``--help``.  ``bounds`` maps a field to ``(lo, strict)``: the flag rejects smaller values
    (every float flag rejects NaN and ±inf).  ``choices`` maps a field to its allowed strings;
    a bool field gets ``--x/--no-x``; an ``int | None`` field listed in ``zero_is_none`` reads 0
    as None (``--batch-size 0`` = full batch).  Returns the field names that got a flag.
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
            lo, strict = bounds.get(f.name, (0, False))
            lo = lo + 1 if strict else lo
            if f.name in zero_is_none:
                lo = min(lo, 0)
            group.add_argument(flag, type=integer(lo), metavar="INT", **kw)
        elif typ is float:
            lo, strict = bounds.get(f.name, (None, False))
            group.add_argument(flag, type=real(lo, above=strict), metavar="X", **kw)
        else:
            group.add_argument(flag, **kw)
        parser.config_fields[f.name] = flag
        if f.name in zero_is_none and optional:
            parser.zero_is_none.add(f.name)
        made.append(f.name)
    return made


# Bounds of the linear ImmunizeConfig's numeric fields (field: (lo, strict)); the dataclass's
# own checks run on top when the configuration is built.
IMMUNIZE_BOUNDS = {"epochs": (0, False), "lr": (0.0, True), "lambda_p": (0.0, False),
                   "lambda_h": (0.0, False), "batch_size": (1, False), "ridge": (0.0, False),
                   "adam_eps": (0.0, True),
                   "lambda_kappa": (0.0, False), "imma_inner_steps": (1, False), "imma_inner_lr": (0.0, True),
                   "certified_safety": (0.0, True)}
IMMUNIZE_HELP = {
    "epochs": "immunization epochs", "lr": "learning rate η", "lambda_p": "λ_P, weight of R_well(H_P)",
    "lambda_h": "λ_H, weight of R_ill(H_H)", "batch_size": "D_P mini-batch of the loss term",
    "optimizer": "adam, or gd (Algorithm 1 as printed)", "precond": "preconditioner of the θ gradient",
    "ridge": "λ of the 'ridge' preconditioner (K+λI)⁻¹",
    "init": "θ's initialisation: identity, or nn.Linear's U(±1/√D), the paper's 'randomly initialized dummy "
            "linear layer' (App. C.2)",
    "certified": "certified-monotone mode: clip every regularizer step to the docs/theory.md §5 bounds and "
                 "count violations",
}


def add_immunize_flags(parser: Parser, shown) -> list[str]:
    """The flags of :class:`pycore.immunize.ImmunizeConfig`, generated (see :func:`add_config_flags`)."""
    import pycore.immunize as imm

    choices = {"optimizer": ("adam", "gd"), "init": ("identity", "random")}
    if hasattr(imm, "PRECONDITIONERS"):
        choices["precond"] = tuple(imm.PRECONDITIONERS)
    return add_config_flags(parser, imm.ImmunizeConfig, shown, bounds=IMMUNIZE_BOUNDS, choices=choices,
                            zero_is_none=("batch_size",), help=IMMUNIZE_HELP,
                            title="immunization (pycore.immunize.ImmunizeConfig; flags override the base "
                                  "configuration only when given)")


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
    try:
        cfg = dataclasses.replace(base, **given_config_flags(parser, args))
        if validate is not None:
            cfg = validate(cfg) or cfg
    except ParameterError as exc:
        raise UsageError(parser.name_flags(str(exc)), parser.flag_for(exc.parameter)) from exc
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


# --- error policy -----------------------------------------------------------------------------

def describe(exc: BaseException, parser: Parser | None = None) -> str:
    """One line for an exception: a flag named where the exception names a parameter."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    if parser is not None:
        msg = parser.name_flags(msg)
    parameter = getattr(exc, "parameter", None)
    if parameter:
        flag = parser.flag_for(parameter) if parser is not None else None
        if flag and not msg.startswith(flag):
            msg = f"{flag}: {msg}"
        elif not flag:
            msg = f"{msg} (setting {parameter!r})"
    if not _expected(exc):
        msg = f"{type(exc).__name__}: {msg} (rerun with --debug for the traceback)"
    return msg


def _expected(exc: BaseException) -> bool:
    """Errors a user or their data can cause; anything else is reported as an internal error."""
    if isinstance(exc, (ValueError, OSError, FloatingPointError, UsageError, RunError)):
        return True
    return type(exc).__module__.split(".")[0] == "pycore"


def run_main(parser: Parser, body, argv=None) -> int:
    """Parse ``argv`` with ``parser`` and call ``body(args)`` under the error policy of this
    module; returns the exit code (``body`` returns None or an int)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = parser.prog
    debug = "--debug" in argv
    previous = _install_sigterm()
    try:
        args = parser.parse_args(argv)
        return int(body(args) or 0)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt as exc:
        sig = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        if debug:
            traceback.print_exc()
        print(f"{prog}: interrupted ({sig}); outputs of earlier runs left as they were", file=sys.stderr)
        return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT
    except UsageError as exc:
        _report(prog, str(exc), exc, debug)
        return EXIT_USAGE
    except ParameterError as exc:
        _report(prog, describe(exc, parser), exc, debug)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 -- the policy: one line, traceback only with --debug
        _report(prog, describe(exc, parser), exc, debug)
        return EXIT_RUNTIME
    finally:
        _restore_sigterm(previous)


def _report(prog, line, exc, debug):
    if debug:
        remote = getattr(exc, "remote_traceback", None)
        if remote:
            print(remote, file=sys.stderr, end="")
        traceback.print_exception(exc)
    print(f"{prog}: error: {line}", file=sys.stderr)


def _raise_terminated(signum, frame):
    # Once: a second SIGTERM during the clean-up must not interrupt the clean-up itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def _install_sigterm():
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        return None


def _restore_sigterm(previous):
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


# --- outputs ----------------------------------------------------------------------------------

class OutputSet:
    """The files of one run, staged in a hidden folder beside ``final`` and swapped in at once.

    Created BEFORE any compute: it checks that ``final`` is a folder (or absent) whose entries
    all match ``owned`` (the names this experiment writes: an earlier run's set, never a user's
    files), and that its parent is writable, naming ``flag`` otherwise.  :meth:`commit`
    exchanges the staging folder with ``final`` in one ``renameat2(RENAME_EXCHANGE)`` (two
    renames where the kernel or filesystem lacks it) and deletes the old set; leaving the
    ``with`` block without :meth:`commit` deletes the staging folder and touches nothing else.
    """

    def __init__(self, final, owned, *, flag: str = "--out", create: bool = True):
        self.final = Path(os.path.abspath(Path(final).expanduser()))
        self.owned = tuple(owned)
        self.flag = flag
        self.path: Path | None = None
        self._check()
        if create:
            self._stage()

    def _check(self):
        f = self.final
        if f.exists() and not f.is_dir():
            raise UsageError(f"{f} exists and is not a folder", self.flag)
        if f.is_dir():
            if f.is_symlink():
                raise UsageError(f"{f} is a symbolic link; pass the folder itself", self.flag)
            foreign = self._foreign()
            if foreign:
                raise UsageError(f"{f} holds files this experiment does not write ({foreign}); "
                                 "pass a new or empty folder", self.flag)
            if not os.access(f, os.W_OK | os.X_OK):
                raise UsageError(f"{f} is not writable", self.flag)
        parent = f.parent
        ancestor = next((a for a in (parent, *parent.parents) if a.exists()), None)
        if ancestor is not None and not ancestor.is_dir():
            raise UsageError(f"{ancestor} is a file, not a folder", self.flag)
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {parent}: {exc.strerror or exc}", self.flag) from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{parent} is not writable", self.flag)

    def _foreign(self) -> str:
        """The entries of ``final`` that this experiment does not write, for a message ("" if none)."""
        foreign = sorted(e for e in os.listdir(self.final)
                         if not any(fnmatch.fnmatch(e, p) for p in self.owned))
        return ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")

    def _stage(self):
        parent, name = self.final.parent, self.final.name
        _remove_stale_staging(parent, name)
        staging = parent / f".{name}.partial-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        try:
            staging.mkdir(mode=0o777)  # the umask applies, like a folder the user made
        except OSError as exc:
            raise UsageError(f"cannot write in {parent}: {exc.strerror or exc}", self.flag) from None
        self.path = staging

    def relocate(self, obj):
        """``obj`` with every string path inside the staging folder rewritten to ``final``."""
        if isinstance(obj, dict):
            return {k: self.relocate(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.relocate(v) for v in obj]
        if isinstance(obj, str) and self.path is not None and obj.startswith(str(self.path)):
            return str(self.final) + obj[len(str(self.path)):]
        return obj

    def commit(self) -> Path:
        staging, final = self.path, self.final
        # Checked again: the folder may have changed during a long run, and the old set is deleted.
        changed = (f"{final} is no longer a folder" if final.exists() and not final.is_dir()
                   else f"{final} gained files this experiment does not write ({self._foreign()})"
                   if final.is_dir() and self._foreign() else "")
        if changed:
            self.path = None  # keep the results where they are
            raise RunError(f"{self.flag}: {changed} during the run; this run's outputs are in {staging}")
        if final.exists():
            if not _exchange(staging, final):
                old = staging.with_name(staging.name + ".old")
                os.rename(final, old)
                os.rename(staging, final)
                staging = old
            shutil.rmtree(staging, ignore_errors=True)  # now the previous set
        else:
            os.rename(staging, final)
        self.path = None
        return final

    def discard(self):
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.discard()
        return False


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _remove_stale_staging(parent: Path, name: str) -> None:
    """Delete staging folders of runs that were killed outright (SIGKILL, power loss)."""
    for d in parent.glob(f".{glob_escape(name)}.partial-*"):
        m = re.match(rf"\.{re.escape(name)}\.partial-(\d+)-", d.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_set(outs: OutputSet, result: dict, table: str, plot=None,
              plot_name: str | None = None) -> list[Path]:
    """``results.json``, ``table.md`` and the figure into the staging folder of ``outs``;
    ``result`` gets ``wall_seconds_with_plot`` (the run plus table and figure)."""
    t0 = time.perf_counter()
    names = ["results.json", "table.md"]
    if plot is not None:
        plot(result, outs.path / plot_name)
        names.append(plot_name)
    if "wall_seconds" in result:
        result["wall_seconds_with_plot"] = result["wall_seconds"] + (time.perf_counter() - t0)
    write_json(outs.path / "results.json", outs.relocate(result))
    (outs.path / "table.md").write_text(table)
    return [outs.final / n for n in names]


def experiment_main(parser: Parser, argv, run, table_markdown, plot=None, plot_name: str | None = None,
                    prepare=None) -> int:
    """The ``main()`` of the linear experiments: ``prepare(args)`` (the checks that need more than
    one flag, e.g. building the configuration) and ``--out`` checked before any compute, then
    ``run(args)``, the set ``results.json``, ``table.md`` and the figure (unless ``--no-plot``)
    swapped into ``--out`` at once, and the table on stdout."""
    def body(args):
        if prepare is not None:
            prepare(args)
        owned = ("results.json", "table.md") + ((plot_name,) if plot_name else ())
        with OutputSet(args.out, owned) as outs:
            result = run(args)
            table = table_markdown(result)
            written = write_set(outs, result, table, None if args.no_plot else plot, plot_name)
            outs.commit()
        print(table)
        print("wrote " + ", ".join(str(p) for p in written))
        return EXIT_OK
    return run_main(parser, body, argv)


# --- worker processes -------------------------------------------------------------------------

def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def effective_jobs(requested: int, n_tasks: int) -> int:
    """Never more workers than tasks or usable cores: an extra worker only costs a fork."""
    return max(1, min(requested, n_tasks, available_cores()))


def add_jobs(parser: argparse.ArgumentParser, what: str = "runs") -> None:
    parser.add_argument("--jobs", type=integer(1), default=min(2, available_cores()),
                        help=f"worker processes for the {what} (default: 2 or the core count; never more "
                             "than the tasks or the usable cores)")


class RemoteError(Exception):
    """An exception raised in a worker, carried to the parent (picklable whatever the original's
    ``__init__``): type, message, ``parameter`` and the worker's traceback text."""


def _guarded(fn, item):
    try:
        return fn(item)
    except Exception as exc:
        raise RemoteError(type(exc), str(exc), getattr(exc, "parameter", None),
                          traceback.format_exc()) from None


def _rebuild(remote: RemoteError) -> BaseException:
    cls, message, parameter, tb = remote.args
    try:
        exc = cls.__new__(cls)
        exc.args = (message,)
    except Exception:  # noqa: BLE001 -- exotic classes: keep the message at least
        exc = RuntimeError(message)
    exc.parameter = parameter
    exc.remote_traceback = tb
    return exc


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _worker_init(parent_pid: int, mask) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and stops the pool, so the
    # workers ignore it (no traceback per worker); SIGTERM kills a worker at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent_pid)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux ``prctl``), and exit
    at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def parallel_map(fn, items, jobs: int, *, desc: str, unit: str) -> list:
    """``[fn(x) for x in items]``, in order, over ``effective_jobs`` forked workers (serial for
    one).  ``fn`` must be a module-level function.  On any exception, Ctrl-C or SIGTERM the
    workers are killed before the exception propagates; a worker's exception is re-raised in
    the parent with its type, message and ``parameter``."""
    items = list(items)
    n = effective_jobs(jobs, len(items))
    if n <= 1:
        return [fn(x) for x in progress(items, desc=desc, unit=unit)]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # SIGINT/SIGTERM are held back while the workers are forked and the tasks submitted: an
    # interruption half-way through that bookkeeping could miss a worker.  The forked workers
    # inherit the blocked mask and unblock it in _worker_init, after dropping the parent's handlers.
    ex = None
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        try:
            ex = ProcessPoolExecutor(n, mp_context=mp.get_context("fork"), initializer=_worker_init,
                                     initargs=(os.getpid(), old_mask))
            results = ex.map(functools.partial(_guarded, fn), items, chunksize=1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # a pending signal is raised here
        out = list(progress(results, total=len(items), desc=desc, unit=unit))
    except BaseException as exc:
        if ex is not None:
            _kill_pool(ex)
        if isinstance(exc, RemoteError):
            raise _rebuild(exc) from None
        raise
    ex.shutdown(wait=True)
    return out


def _kill_pool(ex) -> None:
    import multiprocessing as mp

    # The executor's own list (no public API before Python 3.14), and every live child
    # multiprocessing started, in case one was forked but not yet registered.
    procs = set(getattr(ex, "_processes", {}).values()) | set(mp.active_children())
    ex.shutdown(wait=False, cancel_futures=True)
    # SIGKILL, not SIGTERM: a worker forked an instant ago may not have run _worker_init yet and
    # would still carry the parent's SIGTERM handler (a traceback per worker).  Workers hold
    # nothing that needs cleaning up: their results only ever reach the parent.
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
