"""What every experiment command line shares (docs/cli.md), and nothing more.

* Flag types that check before any compute and print their bound in ``--help``: :func:`count`,
  :func:`real`, :func:`comma_list`, :func:`seeds` (``N | A,B,C | A-B``), :func:`existing`.
* :class:`Parser`: plain argparse, one-line usage errors, no abbreviations, ``--debug``;
  :func:`add_seeds`, :func:`add_out`, :func:`add_jobs`; :func:`add_options` makes one flag per
  field of options dataclasses and :func:`method_options` gives each chosen method its typed ones.
* :func:`pool_map`: ``concurrent.futures.ProcessPoolExecutor``, one BLAS thread per task.
* :func:`check_out` / :func:`write_outputs`: every file written under a temporary name inside
  ``--out`` and ``os.replace``d into place; nothing is ever deleted.
* :func:`main`: exit 0 / 2 usage / 1 data or runtime / 130 SIGINT / 143 SIGTERM, one line on stderr
  naming the flag (a library error's ``.parameter``), the traceback only with ``--debug``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
import traceback
import types
import typing
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pycore.validation import ParameterError

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM
MAX_SEEDS = 10_000    # a typo such as --seeds 10000000 must fail at once, not run for weeks
MAX_JOBS = 1024       # then capped at the usable cores
MAX_ITEMS = 1000      # items of any comma list


class UsageError(Exception):
    """A flag value that cannot work (exit 2); ``flag`` is the flag as typed (``"--seeds"``)."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag


class RunError(Exception):
    """A run that finished but must not count as a success (exit 1), e.g. a method that failed."""


class Terminated(BaseException):
    """SIGTERM (what ``timeout`` and job schedulers send), raised in the main thread by :func:`main`."""


# --- flag types -----------------------------------------------------------------------------------

def _interval(lo, hi, lo_open=False, hi_open=False) -> str:
    if hi is None:
        return f"{'>' if lo_open else '≥'} {lo:g}"
    if lo is None:
        return f"{'<' if hi_open else '≤'} {hi:g}"
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def _flag_type(name: str, bound: str | None, convert):
    """An argparse ``type``: ``convert``'s ValueError becomes the flag's message; ``bound`` is
    printed by ``--help`` (:class:`_Help`)."""
    def parse(text):
        try:
            return convert(str(text).strip())
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__, parse.bound = name, bound
    return parse


def count(lo: int = 0, hi: int | None = None):
    """An integer in ``[lo, hi]``.  Give every count a ``hi``: ``--orders 1e9`` must fail at once."""
    bound = f"from {lo} to {hi}" if hi is not None else f"≥ {lo}"

    def convert(t):
        try:
            n = int(t)
        except ValueError:
            raise ValueError(f"expected an integer {bound}, got {t!r}") from None
        if n < lo or (hi is not None and n > hi):
            raise ValueError(f"expected an integer {bound}, got {n}")
        return n
    return _flag_type("count", bound, convert)


def real(lo: float | None = None, hi: float | None = None, *, lo_open=False, hi_open=False):
    """A finite float in the interval (open ends where asked)."""
    bound = _interval(lo, hi, lo_open, hi_open) if (lo, hi) != (None, None) else None

    def convert(t):
        x = float(t)
        if not (math.isfinite(x) and (lo is None or x > lo or (x == lo and not lo_open))
                and (hi is None or x < hi or (x == hi and not hi_open))):
            raise ValueError(f"expected a finite number{' ' + bound if bound else ''}, got {t!r}")
        return x
    return _flag_type("real", bound, convert)


def comma_list(item=str, *, choices=None, max_items: int = MAX_ITEMS):
    """A comma list of distinct items (at most ``max_items``), each parsed by ``item`` (a flag type)
    and, with ``choices``, one of them."""
    inner = getattr(item, "bound", None)
    bound = ("from " + ",".join(choices) if choices is not None
             else f"at most {max_items} items" + (f", each {inner}" if inner else ""))

    def convert(t):
        parts = [p.strip() for p in t.split(",")]
        if len(parts) > max_items:
            raise ValueError(f"{len(parts)} items, more than {max_items}")
        if not all(parts):
            raise ValueError(f"empty item in {t!r}")
        values = [item(p) for p in parts]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad:
            raise ValueError(f"unknown item {bad[0]!r}; choose from {','.join(choices)}")
        if len(set(values)) != len(values):
            raise ValueError(f"repeated item in {t!r}")
        return values
    return _flag_type("list", bound, convert)


def _parse_seeds(t: str) -> list[int]:
    try:
        if "," in t:
            return comma_list(count(0), max_items=MAX_SEEDS)(t)
        if "-" in t[1:]:
            a, b = (count(0)(s) for s in t.split("-", 1))
            if b < a or b - a >= MAX_SEEDS:
                raise ValueError(f"range {t!r} is empty or holds more than {MAX_SEEDS} seeds")
            return list(range(a, b + 1))
        return list(range(count(1, MAX_SEEDS)(t)))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{exc} (seeds: a count N, a list A,B,C or a range A-B)") from None


seeds = _flag_type("seeds", f"at most {MAX_SEEDS} seeds ≥ 0", _parse_seeds)


def existing(kind: str = "file"):
    """A path that exists and is a ``file`` or a ``folder``."""
    def convert(t):
        p = Path(t).expanduser()
        if not (p.is_file() if kind == "file" else p.is_dir()):
            raise ValueError(f"no such {kind}: {t}" if not p.exists() else f"not a {kind}: {t}")
        return p
    return _flag_type("path", None, convert)


# --- the parser ----------------------------------------------------------------------------------

class _Help(argparse.RawDescriptionHelpFormatter):
    """Prints each flag's bound (its type's ``bound``) and default after its help."""

    def _get_help_string(self, action):
        default = getattr(action, "shown", action.default)
        notes = [getattr(action.type, "bound", None)]
        if not any(default is x for x in (None, False, argparse.SUPPRESS)):
            notes.append(f"default {default:g}" if isinstance(default, float) else f"default {default}")
        notes = "; ".join(n for n in notes if n).replace("%", "%%")
        return (action.help or "") + (f" ({notes})" if notes else "")


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (raised as :class:`UsageError`), no prefix
    abbreviations (``--seed`` is not ``--seeds``) and ``--debug``."""

    def __init__(self, prog: str, description: str | None = None):
        super().__init__(prog=prog, description=description, formatter_class=_Help, allow_abbrev=False)
        self.add_argument("--debug", action="store_true", help="on error, print the traceback")

    def error(self, message):
        raise UsageError(message.removeprefix("argument "))

    def flag_for(self, name: str | None) -> str | None:
        """The flag whose value lands in ``args.<name>``, or None."""
        for action in self._actions:
            if name and action.dest == name and action.option_strings:
                return max(action.option_strings, key=len)
        return None


def add_seeds(parser, default: str, what: str = "seeds") -> None:
    parser.add_argument("--seeds", type=seeds, default=default, metavar="N|A,B,C|A-B",
                        help=f"{what}: a count N (0..N-1), a list or a range")


def add_out(parser, default: str) -> None:
    parser.add_argument("--out", type=Path, default=Path(default),
                        help="output folder; this run's files replace those of the same name, nothing else "
                             "in it is touched")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def add_jobs(parser) -> None:
    parser.add_argument("--jobs", type=count(1, MAX_JOBS), default=min(2, usable_cores()),
                        help="worker processes (never more than the tasks or the usable cores)")


# --- flags from options dataclasses -------------------------------------------------------------------

def _converter(hint, rule):
    """(argparse type, metavar) of a dataclass field's type hint, bounded by ``rule`` (keywords of
    :func:`pycore.validation.check_number`: low, high, low_open, high_open); None if not scalar."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    optional = type(None) in args
    args = tuple(a for a in args if a is not type(None))
    lo, hi = rule.get("low"), rule.get("high")
    if args == (int,):
        base, metavar = count(0 if lo is None else lo + rule.get("low_open", 0),
                              None if hi is None else hi - rule.get("high_open", 0)), "INT"
    elif args == (float,) or set(args) == {float, str}:
        base = real(lo, hi, lo_open=rule.get("low_open", False), hi_open=rule.get("high_open", False))
        metavar = "X"
        if str in args:    # a number or a word such as "auto" (the library checks the word)
            base = _flag_type("real_or_word", base.bound, lambda t, num=base: t if t.isalpha() else num(t))
            metavar = "X|WORD"
    elif args == (str,):
        base, metavar = str, "TEXT"
    else:
        return None
    if optional:
        base = _flag_type("optional", getattr(base, "bound", None),
                          lambda t, inner=base: None if t == "none" else inner(t))
        metavar += "|none"
    return base, metavar


def add_options(parser, classes, *, title: str, rules=None, choices=None, help=None, shown=None) -> None:
    """One flag per scalar field of the dataclasses ``classes`` (``lambda_h`` → ``--lambda-h``;
    a field in several classes gets one flag).  Every flag defaults to None, "not given", so the
    library's defaults or preset stay the one source of values; ``shown`` (field → value) is
    printed as the default.  ``rules`` maps a field to its bounds (check_number's keywords) and
    ``choices`` to its allowed words, both printed by ``--help``; the library checks every value
    again when it builds the options, before any compute."""
    rules, choices, help, shown = rules or {}, choices or {}, help or {}, shown or {}
    group = parser.add_argument_group(title)
    done = set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in done or not f.init:
                continue
            kw = dict(dest=f.name, default=None, help=help.get(f.name) or f"{cls.__name__}.{f.name}")
            flag = "--" + f.name.replace("_", "-")
            if hints[f.name] is bool:
                action = group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            elif f.name in choices:
                action = group.add_argument(flag, choices=tuple(choices[f.name]), **kw)
            elif (conv := _converter(hints[f.name], rules.get(f.name, {}))) is not None:
                action = group.add_argument(flag, type=conv[0], metavar=conv[1], **kw)
            else:
                continue
            action.shown = shown.get(f.name)   # printed as the default by --help
            done.add(f.name)


def given_options(args, classes) -> dict:
    """``{field: value}`` of the generated flags the user typed."""
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def method_options(parser, args, methods, options_of) -> dict[str, dict]:
    """Per method of ``methods``, the typed flags its options class (``options_of(method)``) has.
    A typed flag that none of them has is a :class:`UsageError` naming it: a flag must change
    something."""
    classes = {m: options_of(m) for m in methods}
    given = given_options(args, set(classes.values()))
    out = {m: {k: v for k, v in given.items() if k in {f.name for f in dataclasses.fields(c)}}
           for m, c in classes.items()}
    for name in given:
        if not any(name in o for o in out.values()):
            raise UsageError(f"no chosen method ({','.join(methods)}) has this option", parser.flag_for(name))
    return out


# --- workers ----------------------------------------------------------------------------------------

def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:   # the parent died (even by SIGKILL): this worker must not outlive it
        time.sleep(0.2)
    os._exit(1)


def _worker_init(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the group: the parent stops the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # not the parent's handler (forked)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _task(fn, item):
    from pycore.threads import task_threads

    with task_threads():   # one BLAS thread per task, in a worker or serially: results never depend on --jobs
        return fn(item)


def pool_map(fn, items, jobs: int, desc: str | None = None) -> list:
    """``[fn(x) for x in items]`` in order, over at most ``jobs`` forked workers (never more than
    the items or the usable cores; serial for one).  ``fn`` must be a module-level function.  On
    any exception, Ctrl-C or SIGTERM every worker is killed before it propagates; a worker's
    exception arrives as itself (the library's keep ``.parameter`` across the pickle)."""
    from pycore.report import progress

    items = list(items)
    n = max(1, min(jobs, len(items), usable_cores()))
    task = functools.partial(_task, fn)
    if n == 1:
        return [task(x) for x in progress(items, desc=desc)]
    ex = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init,
                             initargs=(os.getpid(),))
    try:
        out = list(progress(ex.map(task, items), total=len(items), desc=desc))
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        for p in multiprocessing.active_children():   # the pool's workers: none of them may outlive the run
            p.kill()
            p.join()
        raise
    ex.shutdown()
    return out


# --- outputs ----------------------------------------------------------------------------------------

def check_out(out, names=()) -> Path:
    """Before any compute: ``out`` is a folder or can be made one, and none of ``names`` in it is
    held by a folder.  Raises :class:`UsageError` naming ``--out``."""
    out = Path(out).expanduser()
    if os.path.lexists(out) and not out.is_dir():
        raise UsageError(f"{out} exists and is not a folder", "--out")
    first = next(p for p in (out, *out.parents) if os.path.lexists(p))
    if not first.is_dir():
        raise UsageError(f"{first} is not a folder", "--out")
    if not os.access(first, os.W_OK | os.X_OK):
        raise UsageError(f"{first} is not writable", "--out")
    held = [n for n in names if (out / n).is_dir()]
    if held:
        raise UsageError(f"{out / held[0]} is a folder, where this run writes a file", "--out")
    return out


def write_outputs(out, files) -> list[Path]:
    """Write ``files`` (name → str, bytes, or a function that writes the file at the path it is
    given) into the folder ``out``, in order: each under a temporary name inside ``out``, then
    ``os.replace``d over ``out/name``.  A reader never sees half a file, and nothing is ever deleted:
    no file or folder of the user's or of another run, whatever its name, and no earlier output
    other than the files of the same name (the one file ever removed is this call's own temporary
    file, when writing it failed).  Returns the paths written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        final = out / name
        tmp = final.with_name(f".{final.stem}.{os.getpid()}-{secrets.token_hex(4)}{final.suffix}")
        with open(tmp, "xb") as fh:   # exclusive: never another run's file
            if isinstance(content, (str, bytes)):
                fh.write(content.encode() if isinstance(content, str) else content)
        try:
            if callable(content):
                content(tmp)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        written.append(final)
    return written


# --- main ----------------------------------------------------------------------------------------

def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a second SIGTERM ends the process at once
    raise Terminated()


def _expected(exc: BaseException) -> bool:
    """Errors a user or their data can cause; anything else is reported as an internal error."""
    return (isinstance(exc, (ValueError, OSError, FloatingPointError, RunError))
            or type(exc).__module__.split(".")[0] == "pycore")


def describe(exc: BaseException, parser: Parser) -> str:
    """One line for ``exc``: prefixed by the flag that sets its ``.parameter`` where there is one."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    parameter = getattr(exc, "parameter", None)
    if parameter:
        flag = parser.flag_for(parameter)
        msg = f"{flag}: {msg}" if flag else f"{msg} (setting {parameter!r})"
    if not _expected(exc):
        msg = f"{type(exc).__name__}: {msg} (rerun with --debug for the traceback)"
    return msg


def main(parser: Parser, body, argv=None) -> int:
    """Parse ``argv`` and return ``body(args)`` (None = 0) under the error policy of docs/cli.md.
    SIGINT is never touched (an inherited SIG_IGN, as in ``cmd &``, stays); SIGTERM raises
    :class:`Terminated` while ``body`` runs, unless it was inherited ignored."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    prog = parser.prog
    main_thread = threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if main_thread else None
    if term is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    show = warnings.showwarning
    warnings.showwarning = lambda m, *a, **k: print(f"{prog}: warning: {' '.join(str(m).split())}",
                                                    file=sys.stderr, flush=True)
    code, line, err = EXIT_OK, None, None
    try:
        code = int(body(parser.parse_args(argv)) or 0)
    except SystemExit as exc:   # --help
        code = exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt as exc:
        code, line, err = EXIT_SIGINT, "interrupted (SIGINT); earlier outputs left as they were", exc
    except Terminated as exc:
        code, line, err = EXIT_SIGTERM, "interrupted (SIGTERM); earlier outputs left as they were", exc
    except UsageError as exc:
        code, line, err = EXIT_USAGE, f"error: {' '.join(str(exc).split())}", exc
    except Exception as exc:  # noqa: BLE001 -- the policy: one line, the traceback only with --debug
        code = EXIT_USAGE if isinstance(exc, ParameterError) else EXIT_RUNTIME
        line, err = f"error: {describe(exc, parser)}", exc
    finally:
        warnings.showwarning = show
        if term is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, term)
    if line:
        if debug:
            traceback.print_exception(err)
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return code
