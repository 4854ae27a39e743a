#!/usr/bin/env python
"""Write experiments/deep_catalog.py: what the deep commands' ``--help`` prints, without torch.

    python scripts/deep_catalog.py            # after changing a configuration or a deep option
    python scripts/deep_catalog.py --check    # exit 1 if the catalog is not what it would write

``deepnet.py --help`` and ``audit.py --help`` list the configurations, the methods, the operators
and each deep option's rule, which live in modules that import torch and timm (seconds); the
catalog holds their names and rules as plain data, so that ``--help`` answers at once.
tests/test_flags.py checks that the catalog is current.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATALOG = ROOT / "experiments" / "deep_catalog.py"


def render() -> str:
    """The catalog's text, from the library and experiments/deep_configs.py."""
    sys.path.insert(0, str(ROOT))
    from experiments.deep_configs import CONFIGS, GROUPS
    from pycore.deep import DEEP_METHODS, OPERATORS, DeepOptions
    from pycore.deep._operators import LORA_RANKS, Schedule

    rules = {n: DeepOptions.describe(n) for n in DeepOptions.names()}
    lines = [
        '"""What the deep commands\' ``--help`` prints, importable without torch: written',
        "by scripts/deep_catalog.py from experiments/deep_configs.py and pycore.deep (edit",
        'those, then run it; tests/test_flags.py checks that this file is current)."""',
        "",
        f"CONFIGS = {tuple(sorted(CONFIGS))!r}",
        f"GROUPS = { ({k: tuple(v) for k, v in GROUPS.items()})!r}",
        f"DEEP_METHODS = {tuple(DEEP_METHODS)!r}",
        f"OPERATORS = {tuple(OPERATORS)!r}",
        f"LORA_RANKS = {tuple(LORA_RANKS)!r}",
        f"DEEP_MAX_STEPS = {Schedule.deep_max_steps!r}",
        "# each field of pycore.deep.DeepOptions → its rule (DeepOptions.describe)",
        "DEEP_OPTIONS = {",
        *(f"    {k!r}: {v!r}," for k, v in rules.items()),
        "}",
    ]
    # in the layout ruff gives it (the project's format check covers this file too)
    return subprocess.run(
        [sys.executable, "-m", "ruff", "format", "-", "--stdin-filename", str(CATALOG)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if it differs")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if CATALOG.read_text() != text:
            print(f"{CATALOG} is stale: run python scripts/deep_catalog.py", file=sys.stderr)
            return 1
        return 0
    CATALOG.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
