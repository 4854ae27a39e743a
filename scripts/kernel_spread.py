#!/usr/bin/env python
"""Cross-kernel spread of the documented tables: every ``readme-check`` command of README.md and
docs/*.md run under several OpenBLAS kernel types (``OPENBLAS_CORETYPE``, the kernel really used
read back with threadpoolctl), each printed table recorded for tests/test_readme_numbers.py.

    python scripts/kernel_spread.py                # measure; writes tests/data/kernel_spread.json
    python scripts/kernel_spread.py --spread       # markdown: every cell that moves, per kernel
    python scripts/kernel_spread.py --ci-kernels 2 # two kernel types other than the native one
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import readme_check as rc  # noqa: E402

# Kernel types with the /proc/cpuinfo flags their code needs, in the order .ci/run prefers them:
# the
# wider the vectors the faster the run (the strict House Prices job: 49 s under Haswell, 54 s
# Sandybridge, 67 s Nehalem or Prescott on one AVX-512 CPU).
KERNELS = {
    "Haswell": {"avx2", "fma"},
    "Sandybridge": {"avx"},
    "SkylakeX": {"avx512f", "avx512dq", "avx512bw", "avx512vl"},
    "Nehalem": {"sse4_2"},
    "Prescott": {"pni"},
}
PROBE = (
    "import json, numpy, scipy.linalg, threadpoolctl; print(json.dumps(sorted({i['architecture'] "
    "for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas'})))"
)


def cpuinfo() -> dict[str, str]:
    """The first processor's entries of /proc/cpuinfo (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)}


def runnable() -> list[str]:
    """Kernel types this CPU can execute (none off x86-64)."""
    flags = set(cpuinfo().get("flags", "").split())
    return (
        [k for k, need in KERNELS.items() if need <= flags]
        if platform.machine() == "x86_64"
        else []
    )


def architecture(kernel: str | None) -> str:
    """The kernels NumPy's and SciPy's OpenBLAS load under ``OPENBLAS_CORETYPE=kernel`` (None:
    native)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if kernel:
        env["OPENBLAS_CORETYPE"] = kernel
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return "+".join(json.loads(out.stdout)) or "unknown"


def distinct_kernels(limit: int | None = None) -> list[tuple[str, str]]:
    """(kernel, architecture): native first, then each runnable type that loads other kernels."""
    seen = {architecture(None): "native"}
    for k in runnable():
        if limit is not None and len(seen) > limit:
            break
        seen.setdefault(architecture(k), k)
    return [(k, a) for a, k in seen.items()]


def measure(commands: list[str], kernels: list[tuple[str, str]]) -> dict:
    records = {}
    for cmd in commands:
        runs = []
        for kernel, arch in kernels:
            with tempfile.TemporaryDirectory() as tmp:
                proc = rc.run_command(cmd, Path(tmp), None if kernel == "native" else kernel)
                if proc.returncode != 0:
                    sys.exit(
                        f"kernel_spread.py: {cmd!r} under {kernel} failed:\n{proc.stderr[-2000:]}"
                    )
                runs.append(
                    {
                        "kernel": kernel,
                        "architecture": arch,
                        "tables": rc.printed_tables(Path(tmp)),
                    }
                )
            print(f"  {cmd}  [{kernel}: {arch}]", flush=True)
        records[cmd] = {"runs": runs}
    return records


def spread_markdown(spread: dict) -> str:
    """Per command, every cell that moves: one row per cell, one column per kernel."""
    out = []
    for cmd, rec in spread["commands"].items():
        kernels = [
            r["architecture"] + (" (native)" if r["kernel"] == "native" else "")
            for r in rec["runs"]
        ]
        rows = [
            f"| {label} | {col} | " + " | ".join(cells) + " |"
            for table in rc.measured_cells(spread, cmd)
            for label, cols in table.items()
            for col, cells in cols.items()
            if len(set(cells)) > 1
        ]
        out += [f"`{cmd}`: {len(rows)} cells move", ""]
        if rows:
            out += [
                "| row | column | " + " | ".join(kernels) + " |",
                "|---|---|" + "---|" * len(kernels),
                *rows,
                "",
            ]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="kernel_spread.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--spread", action="store_true", help="print the cells that move, per kernel (markdown)"
    )
    p.add_argument(
        "--ci-kernels", type=int, metavar="N", help="print N kernel types other than the native"
    )
    args = p.parse_args(argv)
    if args.ci_kernels is not None:
        kernels = [k for k, _ in distinct_kernels(args.ci_kernels)[1:]]
        if len(kernels) < args.ci_kernels:
            print(
                f"kernel_spread.py: only {len(kernels)} other kernel type(s) take effect here "
                "(an x86-64 NumPy with a DYNAMIC_ARCH OpenBLAS runs more)",
                file=sys.stderr,
            )
        print(" ".join(kernels))
        return 0
    if args.spread:
        print(spread_markdown(rc.load_spread(rc.SPREAD_FILE)))
        return 0
    import numpy
    import scipy

    kernels = distinct_kernels()
    commands = rc.marked_commands()
    print(
        f"kernels: {', '.join(f'{k} ({a})' for k, a in kernels)}; {len(commands)} commands",
        flush=True,
    )
    data = {
        "about": "Each readme-check command's printed tables under each BLAS kernel type "
        "(scripts/kernel_spread.py; read by tests/test_readme_numbers.py).",
        "tool": "python scripts/kernel_spread.py",
        "threads": 1,
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpuinfo().get("model name", platform.machine()),
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "numpy": numpy.__version__,
            "scipy": scipy.__version__,
        },
        "commands": measure(commands, kernels),
    }
    rc.SPREAD_FILE.write_text(
        json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"wrote {rc.SPREAD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
