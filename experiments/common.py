"""What every experiment command line shares (docs/cli.md), in plain argparse: bounded flag types,
the linear immunization options as flags (the library checks their values), :func:`pool_map`,
:func:`write_outputs` and :func:`main`."""

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
import warnings
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
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


class WorkerDiedError(RunError):
    """A worker process died (killed, out of memory, a crash in a native library) while it ran
    a task: ``.tasks`` the indices of the tasks it was running, in the order they were
    submitted."""

    def __init__(self, message: str, tasks: tuple = ()):
        super().__init__(message)
        self.tasks = tuple(tasks)


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
    """Each flag's help ends with its bound (the action's or its type's ``bound``) and default
    (the action's ``shown``, else its default)."""

    def _get_help_string(self, action):
        default = getattr(action, "shown", action.default)
        notes = [getattr(action, "bound", None) or getattr(action.type, "bound", None)]
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
        "--on-missing",
        choices=("fill", "error"),
        default="fill",
        help="an empty input cell: set it to 0 (counted in one line and in results.json) or "
        "refuse the file",
    )
    parser.add_argument(
        "--n-train", type=count(2, 1_000_000), default=200, help="training rows per split"
    )


def load_house_price_data(args):
    """The paper's House Prices tasks from ``--data``, ``--n-train``, ``--on-outlier`` and
    ``--on-missing``, with the line that counts what was changed in the data."""
    from pycore.data.house_price import load_house_price

    data = load_house_price(
        args.data, n_train=args.n_train, on_outlier=args.on_outlier, on_missing=args.on_missing
    )
    say_changes(data)
    return data


def say_changes(data) -> None:
    """Print the one line counting what a loader changed in the data (nothing when nothing was)."""
    if data.changes_line():
        print(data.changes_line(), flush=True)


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


def thread_count(asked: int, prog: str) -> int:
    """``--threads`` capped at the usable cores (more threads than cores only contend; a result is
    recorded with the count it ran with), saying so when it caps."""
    cores = usable_cores()
    if asked > cores:
        print(
            f"{prog}: warning: --threads {asked} capped at the {cores} usable core(s)",
            file=sys.stderr,
            flush=True,
        )
    return min(asked, cores)


# ---------------------------------------------------------------- library options as flags
#
# Every option flag is written out (timm's train.py style) and only converts its text to a Python
# value: the library checks each value once, when the command builds its options before any
# compute, and its refusal names the option, hence the flag (:func:`describe`). A flag is absent
# from ``args`` unless typed (``default=SUPPRESS``), so the preset or the library's default stays
# the one source of every value.


def int_or_none(text: str) -> int | None:
    """An int, or None for ``none``."""
    return None if text == "none" else int(text)


def float_or_none(text: str) -> float | None:
    """A float, or None for ``none``."""
    return None if text == "none" else float(text)


def float_or_word(text: str) -> float | str:
    """A float, or a word such as ``auto`` (the library says which words an option takes)."""
    return text if text.isalpha() else float(text)


def add_option(group, flag: str, options, *, shown=None, **kwargs) -> argparse.Action:
    """``group.add_argument(flag, **kwargs)`` for the option that ``flag`` names (``--lambda-h``
    sets ``lambda_h``) of the :class:`pycore.options.Options` class ``options``, absent unless
    typed; ``--help`` adds the library's rule and ``shown``, the default it prints."""
    dest = flag.removeprefix("--").replace("-", "_")
    action = group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, **kwargs)
    action.shown = shown
    if not isinstance(action, argparse.BooleanOptionalAction):  # --x/--no-x says it already
        action.bound = options.describe(dest)
    return action


def given_options(args, names) -> dict:
    """``{option: value}`` of the option flags among ``names`` the user typed (``none`` too: a
    value, not a gap)."""
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def add_immunize_options(parser, preset: str | None, *, own_table: bool = False) -> None:
    """A flag per option of every linear method (``--help`` shows ``preset``'s values, and with
    ``own_table`` the values a table of one's own runs), ``--certified`` and ``--harden``."""
    from pycore.hardening import HARDENINGS
    from pycore.immunization import PRESETS, LinearOptions

    shown = (_shown_defaults(preset) if own_table else PRESETS[preset]) if preset else {}
    g = parser.add_argument_group(
        "immunization options (pycore.immunization; each one typed beats the preset)"
    )

    def option(flag, **kwargs):
        dest = flag.removeprefix("--").replace("-", "_")
        add_option(g, flag, LinearOptions, shown=shown.get(dest), **kwargs)

    option("--epochs", type=int, metavar="N", help="epochs (the adaptive Algorithm 1: steps)")
    option("--lr", type=float, metavar="X", help="learning rate of Adam or GD")
    option(
        "--batch-size",
        type=int_or_none,
        metavar="N|none",
        help="D_P mini-batch of the loss term (none: the full batch)",
    )
    option("--init", metavar="WORD", help="θ's start: identity, or random (nn.Linear's)")
    option("--optimizer", metavar="WORD", help="adam, or gd (Algorithm 1 as printed)")
    option("--adam-eps", type=float, metavar="X", help="Adam's ε")
    option(
        "--lambda-p",
        type=float_or_word,
        metavar="X|auto",
        help="λ_P, weight of R_well(H_P); auto with --lambda-h auto: the adaptive Algorithm 1",
    )
    option("--lambda-h", type=float_or_word, metavar="X|auto", help="λ_H, weight of R_ill(H_H)")
    option("--precond", metavar="WORD", help="preconditioner of the regularizer gradients")
    option("--ridge", type=float, metavar="X", help="λ of --precond ridge: (K + λI)⁻¹")
    option(
        "--patience",
        type=int,
        metavar="N",
        help="adaptive Algorithm 1: steps without progress before lr/3 (twice), then stop",
    )
    option(
        "--safety",
        type=float,
        metavar="X",
        help="R_ill only and --certified: the fraction of each step bound taken",
    )
    option("--inner-steps", type=int, metavar="N", help="IMMA: unrolled attacker steps")
    option("--inner-lr", type=float, metavar="X", help="IMMA: attacker step in units of 1/L")
    option("--lambda-kappa", type=float, metavar="X", help="Opt κ: weight of κ(H_P) − κ(H_H)")
    option("--log", action=argparse.BooleanOptionalAction, help="Opt κ: on log κ")
    option(
        "--exponent",
        type=float_or_word,
        metavar="X|auto",
        help="closed form: s² = λ_C^a; auto: the balanced exponent of the Definition 3.1 window",
    )
    parser.add_argument("--certified", action="store_true", help="ours in certified-monotone mode")
    parser.add_argument(
        "--harden",
        choices=HARDENINGS,
        default="none",
        help="θ → θQ after the method (pycore.hardening.harden_result, docs/findings.md §5)",
    )


def _shown_defaults(preset: str) -> dict:
    """``--help``'s default of each option: the preset's value, and where a table of one's own
    runs another (the library's defaults, e.g. "auto" λ's), that one too, per method."""
    from pycore.immunization import METHODS, PRESETS, resolve_options

    def text(v):
        return f"{v:g}" if isinstance(v, float) else str(v)

    own: dict = {}  # option → {method: its value with the library's defaults}
    for m in METHODS:
        defaults = resolve_options(m)  # resolved: ours' epochs None → 5000 with "auto" λ's
        for f in dataclasses.fields(defaults):
            own.setdefault(f.name, {})[m] = text(getattr(defaults, f.name))
    shown = dict(PRESETS[preset])
    for name, per_method in own.items():
        values = list(per_method.values())
        common = max(values, key=values.count)
        odd = [f"{m} {v}" for m, v in per_method.items() if v != common]
        mine = common + (f" ({', '.join(odd)})" if odd else "")
        if name not in shown:
            shown[name] = mine
        elif odd or common != text(shown[name]):
            shown[name] = (
                f"{text(shown[name])} on the paper's data (preset {preset}), {mine} on a table "
                "of one's own"
            )
    return shown


@dataclasses.dataclass(frozen=True)
class Immunizer:
    """``immunize`` (``immunize_certified`` for certified "ours") with a preset and each method's
    typed options, then ``harden_result`` with the same generator."""

    preset: str | None
    given: Mapping[str, Mapping]  # method → {option: value typed on the command line}
    certified: bool = False
    harden: str = "none"

    def options(self, method: str):
        """``method``'s options as run: :func:`pycore.immunization.resolve_options`."""
        from pycore.immunization import resolve_options

        certified = self.certified and method == "ours"
        return resolve_options(
            method, self.preset, certified=certified, **self.given.get(method, {})
        )

    def __call__(self, task, method: str, rng):
        return self.batch(task, method, [rng])[0]

    def batch(self, task, method: str, rngs) -> list:
        """One result per generator, the runs stepped together (``immunize_batch``; certified
        runs one at a time), each then hardened with its own generator."""
        from pycore.hardening import harden_result
        from pycore.immunization import immunize_batch, immunize_certified

        kw = dict(preset=self.preset, **self.given.get(method, {}))
        if self.certified and method == "ours":
            results = [immunize_certified(task, rng=rng, **kw) for rng in rngs]
        else:
            results = immunize_batch(task, method, rngs=rngs, **kw)
        return [harden_result(r, task, self.harden, rng=rng) for r, rng in zip(results, rngs)]

    def draws_random(self, method: str) -> bool:
        """Whether ``method``'s runs use their generator (else every seed gives the same run)."""
        from pycore.immunization import draws_random

        return draws_random(method, self.options(method))

    def to_dict(self) -> dict:
        """For results.json: the settings and every method's options as run."""
        return {
            "preset": self.preset,
            "certified": self.certified,
            "harden": self.harden,
            "given": {m: dict(o) for m, o in self.given.items()},
            "options": {m: self.options(m).to_dict() for m in self.given},
        }


def immunize_lines(result: dict, invariants: str) -> list[str]:
    """A table's last lines: the hardening check over its runs (``invariants``: what it compared)
    and the immunization settings (``result["immunize"]``, :meth:`Immunizer.to_dict`)."""
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
    """The :class:`Immunizer` of the typed flags, every method's options built (so checked by the
    library) before any compute; a typed option that none of ``methods`` has is a
    :class:`UsageError` naming its flag."""
    from pycore.immunization import METHODS, CertifiedOptions, options_of

    if args.certified and "ours" not in methods:
        raise UsageError(
            "certified mode is a mode of ours, which is not among --methods", "--certified"
        )
    every = {*CertifiedOptions.names(), *(n for m in METHODS for n in options_of(m).names())}
    given = given_options(args, every)
    has = {
        m: (CertifiedOptions if args.certified and m == "ours" else options_of(m)).names()
        for m in methods
    }
    unused = [k for k in given if not any(k in names for names in has.values())]
    if unused:
        raise UsageError(
            f"none of the chosen methods ({','.join(methods)}) has this option",
            parser.flag_for(unused[0]),
        )
    run = Immunizer(
        preset,
        {m: {k: v for k, v in given.items() if k in names} for m, names in has.items()},
        args.certified,
        args.harden,
    )
    for m in methods:
        run.options(m)
    return run


def _watch_parent(parent: int) -> None:
    # the parent died, even by SIGKILL: its workers must not outlive it
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


# What pool_map's ``shared`` argument is in a worker: set once by the pool's initializer.
_SHARED = None
# In a worker: (the pool's shared array of running tasks, this worker's slot in it), so that the
# parent can name the task of a worker that died.
_SLOT = None


def _worker_init(parent: int, shared, slots=None) -> None:
    global _SHARED, _SLOT
    _SHARED = shared
    if slots is not None:
        running, pids, taken = slots
        with taken.get_lock():
            slot, taken.value = taken.value, taken.value + 1
        pids[slot], _SLOT = os.getpid(), (running, slot)
    # Ctrl-C reaches the group: the parent stops the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (forked)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _task(fn, with_shared, item):
    from pycore.threads import task_threads

    # one BLAS thread per task, in a worker or not: results never depend on --jobs
    with task_threads():
        return fn(_SHARED, item) if with_shared else fn(item)


def _tracked(fn, with_shared, task: int, item):
    """:func:`_task` with ``task`` marked as running in this worker's slot while it runs."""
    if _SLOT is not None:
        _SLOT[0][_SLOT[1]] = task + 1
    try:
        return _task(fn, with_shared, item)
    finally:
        if _SLOT is not None:
            _SLOT[0][_SLOT[1]] = 0


def _label(item) -> str:
    text = repr(item)
    return text if len(text) <= 100 else f"{text[:100]}…"


@contextmanager
def _workers(n: int, shared=None, tasks=None):
    """A fork pool of ``n`` workers; on any exception, Ctrl-C or SIGTERM in the block every worker
    is killed first. A task submitted through :func:`_tracked` with its index in ``tasks`` (the
    items, as submitted) is named when the worker running it dies (:class:`WorkerDiedError`)."""
    ctx = multiprocessing.get_context("fork")
    slots = (ctx.Array("q", n, lock=False), ctx.Array("q", n, lock=False), ctx.Value("i", 0))
    ex = ProcessPoolExecutor(
        n, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(), shared, slots)
    )
    try:
        yield ex
    except BaseException as exc:
        died = _died(ex, slots, tasks) if isinstance(exc, BrokenProcessPool) else None
        ex.shutdown(wait=False, cancel_futures=True)
        for p in multiprocessing.active_children():
            p.kill()
            p.join()
        if died is not None:
            raise died from None
        raise
    ex.shutdown()


def _ending(code: int) -> str:
    """How a process with exit code ``code`` ended, in words."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _died(ex, slots, items) -> "WorkerDiedError | None":
    """What a dead worker was running, from the slots its tasks marked: the workers that ended
    other than by the pool's own SIGTERM (the pool stops the healthy ones that way once one
    died) and the task each had marked; None when none can be told."""
    running, pids, _ = slots
    procs = list((getattr(ex, "_processes", None) or {}).values())
    for p in procs:
        p.join(timeout=5)
    codes = {p.pid: p.exitcode for p in procs if p.exitcode not in (None, -signal.SIGTERM)}
    dead = [(k, codes[pid]) for k, pid in enumerate(pids) if pid in codes and running[k] > 0]
    if not dead:
        return None
    tasks = tuple(running[k] - 1 for k, _ in dead)
    how = ", ".join(_ending(code) for _, code in dead)
    named = "; ".join(
        f"task {t + 1} ({_label(items[t])})" if items and t < len(items) else f"task {t + 1}"
        for t in tasks
    )
    return WorkerDiedError(
        f"a worker process died ({how}{'; out of memory?' * ('SIGKILL' in how)}) while it ran "
        f"{named}; the other tasks were stopped",
        tasks,
    )


def pool_map(fn, items, jobs: int, desc: str | None = None, *, shared=None) -> list:
    """``[fn(x) for x in items]`` over at most ``jobs`` forked workers (none for one task); on any
    exception, Ctrl-C or SIGTERM every worker is killed first; a worker's exception arrives as
    itself.  With ``shared``: ``[fn(shared, x) for x in items]``, ``shared`` (the data every item
    needs) handed to each worker once by the pool's initializer, not once per item."""
    from pycore.report import progress

    items = list(items)
    n = max(1, min(jobs, len(items), usable_cores()))
    if n == 1:
        return [
            _task(functools.partial(fn, shared) if shared is not None else fn, False, x)
            for x in progress(items, desc=desc)
        ]
    task = functools.partial(_tracked, fn, shared is not None)
    with _workers(n, shared, items) as ex:
        results = ex.map(task, range(len(items)), items)
        return list(progress(results, total=len(items), desc=desc))


def pool_chain(first, then, items, jobs: int) -> list:
    """Two stages in one pool: ``first(x)`` returns ``(result, follow_ups)`` and every follow-up
    ``y`` runs as ``then(y)`` as soon as its ``first`` has returned, on whichever worker is free
    (a long ``first`` no longer holds its follow-ups on one worker).  Returns ``[(result,
    [then(y) for y in follow_ups]), ...]`` in the order of ``items``; errors and interrupts as
    :func:`pool_map`."""
    items = list(items)
    n = min(jobs, usable_cores())
    if n < 2 or not items:
        out = []
        for x in items:
            result, follow = _task(first, False, x)
            out.append((result, [_task(then, False, y) for y in follow]))
        return out
    results, followed = [None] * len(items), [None] * len(items)
    tasks = list(items)  # then each follow-up, as it is submitted

    def submit(fn, x):
        tasks.append(x)
        return ex.submit(_tracked, fn, False, len(tasks) - 1, x)

    with _workers(n, tasks=tasks) as ex:
        pending = {ex.submit(_tracked, first, False, i, x): (i, None) for i, x in enumerate(items)}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i, j = pending.pop(fut)
                if j is None:
                    results[i], follow = fut.result()
                    followed[i] = [None] * len(follow)
                    for j, y in enumerate(follow):
                        pending[submit(then, y)] = (i, j)
                else:
                    followed[i][j] = fut.result()
    return list(zip(results, followed))


def check_out(out, names=()) -> Path:
    """Before any compute: ``out`` is (or can be made) a writable folder with no folder and no
    symbolic link (dangling or not) in ``names``."""
    out = Path(out).expanduser()
    # out, or where it will be made
    first = next(p for p in (out, *out.parents) if os.path.lexists(p))
    if not first.is_dir() or not os.access(first, os.W_OK | os.X_OK):
        raise UsageError(
            f"{first} is {'not a folder' if not first.is_dir() else 'not writable'}", "--out"
        )
    blocked = _blocked(out, names)
    if blocked:
        raise UsageError(blocked, "--out")
    return out


def _blocked(out: Path, names) -> str | None:
    """Why an output name cannot be replaced, or None: a folder, or a symbolic link (replacing
    it would drop the link the user made; following it would write over its target)."""
    for n in names:
        p = out / n
        if p.is_symlink():
            return f"{p} is a symbolic link (to {os.readlink(p)}), where this run writes a file"
        if p.is_dir():
            return f"{p} is a folder, where this run writes a file"
    return None


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
    reader never sees half a file, and nothing is deleted but this call's own failed temporary.
    A folder or symbolic link at any name is refused before the first file is written; an error
    names the output, never the temporary file."""
    out = Path(out)
    blocked = _blocked(out, files)
    if blocked:
        raise RunError(f"{blocked}; nothing was written")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in files.items():
        final = out / name
        tmp = final.with_name(f".{final.stem}.{os.getpid()}-{secrets.token_hex(4)}{final.suffix}")
        try:
            with open(tmp, "xb") as fh:  # exclusive: never another run's file
                if not callable(content):
                    fh.write(content.encode() if isinstance(content, str) else content)
            if callable(content):
                content(tmp)
            os.replace(tmp, final)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            _raise_for_output(exc, tmp, final)
            raise
        written.append(final)
    return written


def _raise_for_output(exc: BaseException, tmp: Path, final: Path) -> None:
    """Raise ``exc`` again naming ``final`` where it named the temporary file ``tmp`` (nothing
    when it did not: interrupts and unrelated errors go on as they are)."""
    if (
        isinstance(exc, OSError)
        and exc.filename is not None
        and os.fspath(exc.filename) == str(tmp)
    ):
        raise OSError(exc.errno, exc.strerror, str(final)) from None
    if isinstance(exc, Exception) and str(tmp) in str(exc):
        raise RunError(f"{final}: " + str(exc).replace(str(tmp), str(final))) from None


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
    as_script, argv = argv is None, sys.argv[1:] if argv is None else list(argv)
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
    if as_script and code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        _stop_past_threads(code)
    return code


def _stop_past_threads(code: int) -> None:
    """After a signal, end the process even if a thread is stuck in a system call (an image
    decoder reading from a network file): the interpreter would wait for it at exit, after
    "interrupted" was printed, until SIGKILL.  Nothing is left to clean up: outputs are written
    only at the end and their temporary files were removed as the exception passed."""
    current = threading.current_thread()
    if any(t is not current and not t.daemon and t.is_alive() for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
        os._exit(code)
