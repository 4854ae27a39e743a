"""The command-line layer every experiment script shares (docs/cli.md), in one namespace.

Each job has its own module; this one composes them into :func:`experiment_main` and
re-exports their names, so scripts write ``from experiments import cli`` and ``cli.<name>``:

* :mod:`experiments.flags` — the parser and flag types, the seeds syntax (``--seeds N|A,B,C|A-B``);
* :mod:`experiments.config_flags` — flags generated from a configuration dataclass, the
  field ↔ flag map, and the refusal of a flag no chosen method reads;
* :mod:`experiments.errors` — exit codes, one-line errors and warnings, SIGINT/SIGTERM;
* :mod:`experiments.outputs` — atomic output sets (staging, swap, in-place fallback, rescue);
* :mod:`experiments.workers` — the worker pool (``parallel_map``, die-with-parent);
* :mod:`experiments._startup` — what a script does before its first import (one-line message
  for a checkout that was never installed, Ctrl-C during the imports).
"""
from __future__ import annotations

from experiments.config_flags import (  # noqa: F401
    IMMUNIZE_HELP, Settings, _field_type, _name_config_flag, add_config_flags, add_immunize_flags,
    config_from_args, given_config_flags, settings_from_args,
)
from experiments.errors import (  # noqa: F401
    EXIT_OK, EXIT_RUNTIME, EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE, RunError, Terminated, UsageError,
    describe, run_main,
)
from experiments.flags import (  # noqa: F401
    MAX_SEEDS, SEEDS_SYNTAX, Parser, add_seeds, ascii_int, choice_list, existing_path, integer,
    number_list, pairs, parse_seeds, real, seeds,
)
from experiments.outputs import OutputSet, glob_escape, write_set  # noqa: F401
from experiments.workers import (  # noqa: F401
    add_jobs, available_cores, die_with_parent, effective_jobs, parallel_map,
)


def experiment_main(parser: Parser, argv, run, table_markdown, plot=None, plot_name: str | None = None,
                    prepare=None) -> int:
    """The ``main()`` of the linear experiments: ``prepare(args)`` (the checks that need more than
    one flag, e.g. building the configuration) and ``--out`` checked before any compute, then
    ``run(args)``, the set ``results.json``, ``table.md`` and the figure (unless ``--no-plot``)
    moved into ``--out`` at once, and the table on stdout."""
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
