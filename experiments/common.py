"""What the experiment command lines share (docs/cli.md), in one namespace: the flag types and
option flags (:mod:`experiments.flags`), the process pool (:mod:`experiments.pool`), outputs and
the exit-code policy (:mod:`experiments.outputs`), and what the linear commands add: the House
Prices data flags' loader and :class:`Immunizer`, the methods run with a preset and the typed
options."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from experiments.flags import (
    MAX_ITEMS,
    MAX_SEEDS,
    Parser,
    add_deep_options,
    add_house_price_data,
    add_immunize_options,
    add_option,
    add_out,
    add_run_flags,
    add_seeds,
    comma_list,
    count,
    distinct_roots,
    existing,
    flag_type,
    float_or_none,
    float_or_word,
    given_options,
    int_or_none,
    real,
    seeds,
    thread_count,
)
from experiments.outputs import (
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    RunError,
    Terminated,
    UsageError,
    check_out,
    commit,
    describe,
    main,
    pyplot,
    write_outputs,
    write_run,
)
from experiments.pool import MAX_JOBS, WorkerDiedError, pool_chain, pool_map, usable_cores

__all__ = [
    # experiments.flags
    "MAX_ITEMS",
    "MAX_SEEDS",
    "Parser",
    "add_deep_options",
    "add_house_price_data",
    "add_immunize_options",
    "add_option",
    "add_out",
    "add_run_flags",
    "add_seeds",
    "comma_list",
    "count",
    "distinct_roots",
    "existing",
    "flag_type",
    "float_or_none",
    "float_or_word",
    "given_options",
    "int_or_none",
    "real",
    "seeds",
    "thread_count",
    # experiments.outputs
    "EXIT_OK",
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "RunError",
    "Terminated",
    "UsageError",
    "check_out",
    "commit",
    "describe",
    "main",
    "pyplot",
    "write_outputs",
    "write_run",
    # experiments.pool
    "MAX_JOBS",
    "WorkerDiedError",
    "pool_chain",
    "pool_map",
    "usable_cores",
    # the linear commands
    "load_house_price_data",
    "say_changes",
    "Immunizer",
    "immunize_lines",
    "immunizer",
]


def load_house_price_data(args):
    """The paper's House Prices tasks from ``--data``, ``--n-train``, ``--on-outlier`` and
    ``--on-missing``, with the line that counts what was changed in the data."""
    from pycore.data import load_house_price

    data = load_house_price(
        args.data, n_train=args.n_train, on_outlier=args.on_outlier, on_missing=args.on_missing
    )
    say_changes(data)
    return data


def say_changes(data) -> None:
    """Print the one line counting what a loader changed in the data (nothing when nothing was)."""
    if data.changes_line():
        print(data.changes_line(), flush=True)


@dataclasses.dataclass(frozen=True)
class Immunizer:
    """``immunize`` (``immunize_certified`` for certified "ours") with a preset and each method's
    typed options, then ``harden_result`` with the same generator."""

    preset: str | None
    given: Mapping[str, Mapping]  # method → {option: value typed on the command line}
    certified: bool = False
    harden: str = "none"

    def options(self, method: str):
        """``method``'s options as run: :func:`pycore._immunization.resolve_options`."""
        from pycore._immunization import resolve_options

        certified = self.certified and method == "ours"
        return resolve_options(
            method, self.preset, certified=certified, **self.given.get(method, {})
        )

    def __call__(self, task, method: str, rng):
        return self.batch(task, method, [rng])[0]

    def batch(self, task, method: str, rngs) -> list:
        """One result per generator, the runs stepped together (``immunize_batch``; certified
        runs one at a time), each then hardened with its own generator."""
        from pycore import harden_result, immunize_batch, immunize_certified

        kw = dict(preset=self.preset, **self.given.get(method, {}))
        if self.certified and method == "ours":
            results = [immunize_certified(task, rng=rng, **kw) for rng in rngs]
        else:
            results = immunize_batch(task, method, rngs=rngs, **kw)
        return [harden_result(r, task, self.harden, rng=rng) for r, rng in zip(results, rngs)]

    def draws_random(self, method: str) -> bool:
        """Whether ``method``'s runs use their generator (else every seed gives the same run)."""
        return self.options(method).draws_random

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
    from pycore import METHODS, options_of
    from pycore._algorithm1 import CertifiedOptions

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


def add_methods(parser) -> None:
    """``--methods``: a comma list of :data:`pycore.METHODS`, every one by default."""
    from pycore import METHODS

    parser.add_argument(
        "--methods",
        type=comma_list(choices=METHODS),
        default=",".join(METHODS),
        help="methods to run",
    )
