"""What every experiment command line shares (docs/cli.md), in plain argparse: bounded flag types,
flags from options dataclasses, :func:`pool_map`, :func:`write_outputs` and :func:`main`."""

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
MAX_SEEDS = 10_000  # a typo such as --seeds 10000000 must fail at once, not run for weeks
MAX_JOBS = 1024  # then capped at the usable cores
MAX_ITEMS = 1000  # items of a comma list


class UsageError(Exception):
    """A flag value that cannot work (exit 2); ``flag`` is the flag as typed (``"--seeds"``)."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag


class RunError(Exception):
    """A run that finished but must not count as a success (exit 1), e.g. a method that failed."""


class Terminated(BaseException):
    """SIGTERM, raised in the main thread while :func:`main` runs."""


def flag_type(name: str, bound: str | None, convert):
    """An argparse ``type`` whose ValueError message is the flag's error; ``bound`` is shown by
    ``--help``."""

    def parse(text):
        try:
            return convert(str(text).strip())
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__, parse.bound = name, bound
    return parse


def count(lo: int = 0, hi: int | None = None):
    """An integer in ``[lo, hi]``.  Give every count a ``hi``: ``--orders 1e9`` must fail at
    once."""
    bound = f"from {lo} to {hi}" if hi is not None else f"≥ {lo}"

    def convert(t):
        n = int(t) if t.lstrip("+-").isdecimal() else None
        if n is None or n < lo or (hi is not None and n > hi):
            raise ValueError(f"expected an integer {bound}, got {t!r}")
        return n

    return flag_type("count", bound, convert)


def real(lo: float | None = None, hi: float | None = None, *, lo_open=False, hi_open=False):
    """A finite float in the interval from ``lo`` to ``hi`` (open ends where asked)."""
    parts = [
        f"{'>' if lo_open else '≥'} {lo:g}" if lo is not None else "",
        f"{'<' if hi_open else '≤'} {hi:g}" if hi is not None else "",
    ]
    bound = " and ".join(p for p in parts if p) or None

    def convert(t):
        x = float(t)
        if not (
            math.isfinite(x)
            and (lo is None or x > lo or (x == lo and not lo_open))
            and (hi is None or x < hi or (x == hi and not hi_open))
        ):
            raise ValueError(f"expected a finite number{' ' + bound if bound else ''}, got {t!r}")
        return x

    return flag_type("real", bound, convert)


def comma_list(item=str, *, choices=None, max_items: int = MAX_ITEMS):
    """Distinct comma-separated items (at most ``max_items``), each parsed by ``item``, in
    ``choices``."""
    inner = getattr(item, "bound", None)
    bound = (
        "from " + ",".join(choices)
        if choices is not None
        else f"at most {max_items} items" + (f", each {inner}" if inner else "")
    )

    def convert(t):
        parts = [p.strip() for p in t.split(",")]
        if len(parts) > max_items or not all(parts):
            raise ValueError(f"expected at most {max_items} non-empty items, got {t[:80]!r}")
        values = [item(p) for p in parts]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or len(set(values)) != len(values):
            raise ValueError(
                f"unknown item {bad[0]!r}; choose from {','.join(choices)}"
                if bad
                else f"repeated item in {t!r}"
            )
        return values

    return flag_type("list", bound, convert)


def _seeds(t: str) -> list[int]:
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


seeds = flag_type("seeds", f"at most {MAX_SEEDS} seeds ≥ 0", _seeds)


def existing(kind: str = "file"):
    """A path that exists and is a ``file`` or a ``folder``."""

    def convert(t):
        p = Path(t).expanduser()
        if not (p.is_file() if kind == "file" else p.is_dir()):
            raise ValueError(f"no such {kind}: {t}" if not p.exists() else f"not a {kind}: {t}")
        return p

    return flag_type("path", None, convert)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its bound (its type's ``bound``) and default."""

    def _get_help_string(self, action):
        default = getattr(action, "shown", action.default)
        notes = [getattr(action.type, "bound", None)]
        if not any(default is x for x in (None, False, argparse.SUPPRESS)):
            notes.append(
                f"default {default:g}" if isinstance(default, float) else f"default {default}"
            )
        notes = "; ".join(n for n in notes if n).replace("%", "%%")
        return (action.help or "") + (f" ({notes})" if notes else "")


class Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (a :class:`UsageError`), no prefix abbreviations
    (``--seed`` is not ``--seeds``) and ``--debug``."""

    def __init__(self, prog: str, description: str | None = None):
        super().__init__(
            prog=prog, description=description, formatter_class=_Help, allow_abbrev=False
        )
        self.add_argument("--debug", action="store_true", help="on error, print the traceback")

    def error(self, message):
        raise UsageError(message.removeprefix("argument "))

    def flag_for(self, name: str | None) -> str | None:
        """The flag whose value lands in ``args.<name>``, or None."""
        return next(
            (
                max(a.option_strings, key=len)
                for a in self._actions
                if name and a.dest == name and a.option_strings
            ),
            None,
        )


def add_seeds(parser, default: str, what: str = "seeds") -> None:
    parser.add_argument(
        "--seeds",
        type=seeds,
        default=default,
        metavar="N|A,B,C|A-B",
        help=f"{what}: a count N (0..N-1), a list or a range",
    )


def add_out(parser, default: str) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(default),
        help="output folder (only this run's files, by name, are replaced)",
    )


def add_run_flags(parser, seeds: str, out: str, what: str = "seeds") -> None:
    """``--seeds``, ``--out`` and ``--jobs`` of the linear commands."""
    add_seeds(parser, seeds, what)
    add_out(parser, out)
    parser.add_argument(
        "--jobs",
        type=count(1, MAX_JOBS),
        default=min(2, usable_cores()),
        help="worker processes (never more than the tasks or the usable cores)",
    )


def add_house_price_data(
    parser, data_help="Kaggle House Prices train.csv (default: the packaged copy)"
):
    """``--data``, ``--on-outlier`` and ``--n-train`` of the House Prices commands."""
    parser.add_argument("--data", type=existing("file"), help=data_help)
    parser.add_argument(
        "--on-outlier",
        choices=("warn", "error"),
        default="warn",
        help="a cell > 1e6 × its column's median magnitude: warn or refuse the file",
    )
    parser.add_argument(
        "--n-train", type=count(2, 1_000_000), default=200, help="training rows per split"
    )


def pyplot():
    """matplotlib.pyplot on the Agg backend (figures go to files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def usable_cores() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )


def _converter(hint, rule: dict):
    """(type, metavar) of a field's type hint within ``rule`` (check_number's low, high, low_open,
    high_open); None for a field that is not a number or a word."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = set(typing.get_args(hint) if union else (hint,))
    lo, hi, lo_open, hi_open = (rule.get(k) for k in ("low", "high", "low_open", "high_open"))
    if args - {type(None)} == {int}:
        base = count(
            0 if lo is None else lo + bool(lo_open), None if hi is None else hi - bool(hi_open)
        )
        metavar = "N"
    elif args - {type(None)} in ({float}, {float, str}):
        base, metavar = real(lo, hi, lo_open=bool(lo_open), hi_open=bool(hi_open)), "X"
        if str in args:  # a number or a word such as "auto", which the library checks
            base = flag_type("real", base.bound, lambda t, num=base: t if t.isalpha() else num(t))
            metavar = "X|WORD"
    elif args == {str}:
        base, metavar = str, "WORD"
    else:
        return None
    if type(None) in args:
        base = flag_type(
            base.__name__,
            getattr(base, "bound", None),
            lambda t, b=base: None if t == "none" else b(t),
        )
        metavar += "|none"
    return base, metavar


def add_options(
    parser, classes, *, title: str, rules=None, choices=None, help=None, shown=None
) -> None:
    """One flag per scalar field of the dataclasses ``classes`` (``lambda_h`` → ``--lambda-h``),
    absent from ``args`` unless typed, so the library's defaults or preset stay the one source of
    values; ``rules`` (check_number's bounds), ``choices`` and ``shown`` (the default) are for
    ``--help``."""
    rules, choices, help, shown = rules or {}, choices or {}, help or {}, shown or {}
    group, done = parser.add_argument_group(title), set()
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            conv = _converter(hints[f.name], rules.get(f.name, {}))
            if f.name in done or not (hints[f.name] is bool or f.name in choices or conv):
                continue
            kw = dict(
                dest=f.name,
                default=argparse.SUPPRESS,
                help=help.get(f.name) or f"{cls.__name__}.{f.name}",
            )
            if hints[f.name] is bool:
                kw["action"] = argparse.BooleanOptionalAction
            elif f.name in choices:
                kw["choices"] = tuple(choices[f.name])
            else:
                kw["type"], kw["metavar"] = conv
            group.add_argument("--" + f.name.replace("_", "-"), **kw).shown = shown.get(f.name)
            done.add(f.name)


def given_options(args, classes) -> dict:
    """``{field: value}`` of the generated flags the user typed (``none`` too: a value, not a
    gap)."""
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def _options_class(method: str, certified: bool):
    from pycore.immunization import CertifiedOptions, options_of

    return CertifiedOptions if certified and method == "ours" else options_of(method)


def _options(cls, preset, given):
    """``cls`` from ``preset``'s values it has and the ``given`` ones (its own checks run here)."""
    from pycore.immunization import PRESETS

    names = {f.name for f in dataclasses.fields(cls)}
    return cls(
        **{**{k: v for k, v in (PRESETS[preset] if preset else {}).items() if k in names}, **given}
    )


def add_immunize_options(parser, preset: str | None) -> None:
    """A flag per option of every linear method (``--help`` shows ``preset``'s values),
    ``--certified`` and ``--harden``."""
    from pycore.harden import HARDENINGS
    from pycore.immunization import METHODS, OPTION_CHOICES, OPTION_RULES, PRESETS

    add_options(
        parser,
        dict.fromkeys(_options_class(m, True) for m in METHODS),
        title="immunization options (pycore.immunization; given ones beat the preset)",
        rules=OPTION_RULES,
        choices=OPTION_CHOICES,
        shown=PRESETS[preset] if preset else {},
    )
    parser.add_argument("--certified", action="store_true", help="ours in certified-monotone mode")
    parser.add_argument(
        "--harden",
        choices=HARDENINGS,
        default="none",
        help="θ → θQ after the method (pycore.harden.harden_result, docs/findings.md §5)",
    )


@dataclasses.dataclass(frozen=True)
class Immunizer:
    """``immunize`` (``immunize_certified`` for certified "ours") with a preset and each method's
    typed options, then ``harden_result`` with the same generator."""

    preset: str | None
    options: dict  # method → {option: value typed on the command line}
    certified: bool = False
    harden: str = "none"

    def __call__(self, task, method: str, rng):
        from pycore.harden import harden_result
        from pycore.immunization import immunize, immunize_certified

        kw = dict(preset=self.preset, **self.options.get(method, {}))
        res = (
            immunize_certified(task, rng=rng, **kw)
            if self.certified and method == "ours"
            else immunize(task, method, rng=rng, **kw)
        )
        return harden_result(res, task, self.harden, rng=rng)

    def as_dict(self) -> dict:
        """For results.json: the settings and every method's options as run."""
        run = {
            m: _options(_options_class(m, self.certified), self.preset, o)
            for m, o in self.options.items()
        }
        return {
            "preset": self.preset,
            "certified": self.certified,
            "harden": self.harden,
            "given": self.options,
            "options": {m: dataclasses.asdict(o) for m, o in run.items()},
        }


def immunize_lines(result: dict, invariants: str) -> list[str]:
    """A table's last lines: the hardening check over its runs (``invariants``: what it compared)
    and the immunization settings (``result["immunize"]``, :meth:`Immunizer.as_dict`)."""
    settings = result["immunize"]
    hard = [
        r["hardening"]["max_rel_diff_vs_unhardened"]
        for e in result["methods"].values()
        for r in e["runs"]
        if "hardening" in r
    ]
    given = {k: v for o in settings["given"].values() for k, v in o.items()}
    return (
        [
            "",
            f"Hardening `{settings['harden']}` (θ → θQ, Q orthogonal; docs/findings.md §5): every "
            "number above is that of the unhardened θ; largest relative difference over "
            "all runs of "
            f"{invariants}: {max(hard):.1e}.",
        ]
        if hard
        else []
    ) + [
        "",
        f"Immunization: preset {settings['preset'] or 'none (the library defaults)'}"
        + "".join(
            f", {k} {v:g}" if isinstance(v, float) else f", {k} {v}" for k, v in given.items()
        )
        + (", Algorithm 1 certified" if settings["certified"] else "")
        + (f", hardening {settings['harden']}" if settings["harden"] != "none" else "")
        + f". Wall time {result['wall_seconds']:.1f} s.",
    ]


def immunizer(parser, args, methods, preset: str | None) -> Immunizer:
    """The :class:`Immunizer` of the typed flags, every method's options built (so checked) before
    any compute; a typed option that none of ``methods`` has is a :class:`UsageError` naming its
    flag."""
    from pycore.immunization import METHODS

    if args.certified and "ours" not in methods:
        raise UsageError(
            "certified mode is a mode of ours, which is not among --methods", "--certified"
        )
    classes = {m: _options_class(m, args.certified) for m in methods}
    given = given_options(args, {_options_class(m, True) for m in METHODS})
    options = {
        m: {k: v for k, v in given.items() if k in {f.name for f in dataclasses.fields(c)}}
        for m, c in classes.items()
    }
    unused = [k for k in given if not any(k in o for o in options.values())]
    if unused:
        raise UsageError(
            f"none of the chosen methods ({','.join(methods)}) has this option",
            parser.flag_for(unused[0]),
        )
    for m, o in options.items():
        _options(classes[m], preset, o)
    return Immunizer(preset, options, args.certified, args.harden)


def _watch_parent(parent: int) -> None:
    # the parent died, even by SIGKILL: its workers must not outlive it
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


def _worker_init(parent: int) -> None:
    # Ctrl-C reaches the group: the parent stops the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (forked)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _task(fn, item):
    from pycore.threads import task_threads

    # one BLAS thread per task, in a worker or not: results never depend on --jobs
    with task_threads():
        return fn(item)


def pool_map(fn, items, jobs: int, desc: str | None = None) -> list:
    """``[fn(x) for x in items]`` over at most ``jobs`` forked workers (none for one task); on any
    exception, Ctrl-C or SIGTERM every worker is killed first; a worker's exception arrives as
    itself."""
    from pycore.report import progress

    items, task = list(items), functools.partial(_task, fn)
    n = max(1, min(jobs, len(items), usable_cores()))
    if n == 1:
        return [task(x) for x in progress(items, desc=desc)]
    ex = ProcessPoolExecutor(
        n,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_worker_init,
        initargs=(os.getpid(),),
    )
    try:
        out = list(progress(ex.map(task, items), total=len(items), desc=desc))
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        for p in multiprocessing.active_children():
            p.kill()
            p.join()
        raise
    ex.shutdown()
    return out


def check_out(out, names=()) -> Path:
    """Before any compute: ``out`` is (or can be made) a writable folder with no folder in
    ``names``."""
    out = Path(out).expanduser()
    # out, or where it will be made
    first = next(p for p in (out, *out.parents) if os.path.lexists(p))
    if not first.is_dir() or not os.access(first, os.W_OK | os.X_OK):
        raise UsageError(
            f"{first} is {'not a folder' if not first.is_dir() else 'not writable'}", "--out"
        )
    held = [n for n in names if (out / n).is_dir()]
    if held:
        raise UsageError(f"{out / held[0]} is a folder, where this run writes a file", "--out")
    return out


def write_run(out, table: str, result: dict, files: dict) -> None:
    """``table.md``, ``files`` (a None value: not written) and ``results.json`` (last) into ``out``
    (:func:`write_outputs`); then the table on stdout."""
    from pycore.report import dumps_json

    files = {
        "table.md": table,
        **{k: v for k, v in files.items() if v is not None},
        "results.json": dumps_json(result, indent=2) + "\n",
    }
    print(table + "\nwrote " + ", ".join(map(str, write_outputs(out, files))))


def write_outputs(out, files) -> list[Path]:
    """Write ``files`` (name → str, bytes, or a function writing the file at the path it is given)
    into ``out`` in order, each under a temporary name then ``os.replace``d over ``out/name``: a
    reader never sees half a file, and nothing is deleted but this call's own failed temporary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        final = out / name
        tmp = final.with_name(f".{final.stem}.{os.getpid()}-{secrets.token_hex(4)}{final.suffix}")
        with open(tmp, "xb") as fh:  # exclusive: never another run's file
            if not callable(content):
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


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def describe(exc: BaseException, parser: Parser) -> str:
    """One line for ``exc``, led by the flag that sets its ``.parameter`` where there is one."""
    # "No space left on device: PATH", not "[Errno 28] ..."
    if isinstance(exc, OSError) and exc.strerror:
        msg = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        msg = " ".join(str(exc).split()) or type(exc).__name__
    parameter = getattr(exc, "parameter", None)
    if parameter:
        flag = parser.flag_for(parameter)
        msg = f"{flag}: {msg}" if flag else f"{msg} (setting {parameter!r})"
    # what a user or their data can cause
    expected = (
        isinstance(exc, (ValueError, OSError, FloatingPointError, RunError))
        or type(exc).__module__.split(".")[0] == "pycore"
    )
    return (
        msg if expected else f"{type(exc).__name__}: {msg} (rerun with --debug for the traceback)"
    )


def main(parser: Parser, body, argv=None) -> int:
    """``body(parser.parse_args(argv))`` (None: 0) under the exit-code policy of docs/cli.md.
    SIGINT is never touched (an inherited SIG_IGN stays); SIGTERM raises :class:`Terminated` unless
    ignored."""
    argv = sys.argv[1:] if argv is None else list(argv)
    term = (
        signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    if term is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    show, prog = warnings.showwarning, parser.prog
    warnings.showwarning = lambda m, *a, **k: print(
        f"{prog}: warning: {' '.join(str(m).split())}", file=sys.stderr, flush=True
    )
    code, line, err = EXIT_OK, None, None
    try:
        code = int(body(parser.parse_args(argv)) or 0)
    except SystemExit as exc:  # --help
        code = exc.code if isinstance(exc.code, int) else 0
    except (KeyboardInterrupt, Terminated) as exc:
        sig = "SIGINT" if isinstance(exc, KeyboardInterrupt) else "SIGTERM"
        code, err = 128 + getattr(signal, sig), exc
        line = f"interrupted ({sig}); earlier outputs left as they were"
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
        if "--debug" in argv:
            traceback.print_exception(err)
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
    return code
