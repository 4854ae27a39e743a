#!/usr/bin/env python
"""Cross-kernel spread of the documented tables: every ``readme-check`` command of README.md and
docs/*.md run under every OpenBLAS kernel set this CPU can execute (``OPENBLAS_CORETYPE``, the
kernel really used read back with threadpoolctl) and once more natively with NumPy's AVX-512 SIMD
dispatch off (``NPY_DISABLE_CPU_FEATURES``), each printed table recorded for
tests/test_readme_numbers.py.

    python scripts/kernel_spread.py                # measure; writes tests/data/kernel_spread.json
    python scripts/kernel_spread.py --spread       # markdown: every cell that moves, per run
    python scripts/kernel_spread.py --ci-kernels 2 # two kernel types other than the native one
    python scripts/kernel_spread.py --numpy-avx512 # NumPy's AVX-512 dispatch targets found here
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

# Kernel types with the /proc/cpuinfo flags their code needs, in the order .ci/run prefers them
# (SkylakeX and Haswell first: the kernels of today's AVX-512 and AVX2 CPUs).  The OpenBLAS of
# NumPy's and SciPy's wheels holds five x86-64 kernel sets; every other type name loads one of them
# (Zen: Haswell's; Prescott: Katmai's, the generic one), so these five types measure every x86-64
# kernel set; Zen is listed to record that it adds none.
KERNELS = {
    "SkylakeX": {"avx512f", "avx512dq", "avx512bw", "avx512vl"},
    "Haswell": {"avx2", "fma"},
    "Zen": {"avx2", "fma"},
    "Sandybridge": {"avx"},
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
    return [k for k, need in KERNELS.items() if not missing_flags(k)]


def missing_flags(kernel: str) -> list[str]:
    """The cpuinfo flags ``kernel`` needs that this CPU lacks (all of them off x86-64)."""
    flags = set(cpuinfo().get("flags", "").split()) if platform.machine() == "x86_64" else set()
    return sorted(KERNELS[kernel] - flags)


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


def numpy_avx512() -> list[str]:
    """NumPy's SIMD dispatch targets found on this CPU that use AVX-512 (X86_V4 and the AVX512_*
    groups): the value of ``NPY_DISABLE_CPU_FEATURES`` that runs NumPy as on a CPU without it."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [
        t for t in __cpu_dispatch__ if __cpu_features__.get(t) and ("AVX512" in t or t == "X86_V4")
    ]


def ci_kernels(n: int) -> list[str]:
    """``n`` kernel types other than the native kernels, in :data:`KERNELS`' order; what stands in
    for a preferred type this CPU cannot run, or is native here, is said on stderr."""
    native = architecture(None)
    say = []
    for k in ("SkylakeX", "Haswell"):
        if missing_flags(k):
            say.append(f"{k} cannot run on this CPU (no {', '.join(missing_flags(k))})")
        elif architecture(k) == native:
            say.append(f"{k} is this CPU's native kernel set")
    kernels = [k for k, _ in distinct_kernels(n)[1:]]
    print(
        f"kernel_spread.py: native kernels {native}; "
        + "".join(f"{s}; " for s in say)
        + f"other kernel types checked: {' '.join(kernels) or 'none'}",
        file=sys.stderr,
    )
    if len(kernels) < n:
        print(
            f"kernel_spread.py: only {len(kernels)} other kernel type(s) take effect here "
            "(an x86-64 NumPy with a DYNAMIC_ARCH OpenBLAS runs more)",
            file=sys.stderr,
        )
    return kernels


def measure(commands: list[str], runs: list[dict]) -> dict:
    """Per command, each of ``runs`` (kernel, architecture, numpy_disabled) with its tables."""
    records = {}
    for cmd in commands:
        done = []
        for run in runs:
            kernel, disabled = run["kernel"], run["numpy_disabled"]
            with tempfile.TemporaryDirectory() as tmp:
                proc = rc.run_command(
                    cmd,
                    Path(tmp),
                    None if kernel == "native" else kernel,
                    numpy_disabled=" ".join(disabled) or None,
                )
                if proc.returncode != 0:
                    sys.exit(
                        f"kernel_spread.py: {cmd!r} under {run_name(run)} failed:\n"
                        f"{proc.stderr[-2000:]}"
                    )
                done.append({**run, "tables": rc.printed_tables(Path(tmp))})
            print(f"  {cmd}  [{run_name(run)}]", flush=True)
        records[cmd] = {"runs": done}
    return records


def run_name(run: dict) -> str:
    """How a run is named: its kernels, whether native, NumPy's dispatch targets turned off."""
    return (
        run["architecture"]
        + (" (native)" if run["kernel"] == "native" else "")
        + (f", NumPy without {' '.join(run['numpy_disabled'])}" if run["numpy_disabled"] else "")
    )


def spread_markdown(spread: dict) -> str:
    """Per command, every cell that moves: one row per cell, one column per kernel."""
    out = []
    for cmd, rec in spread["commands"].items():
        kernels = [run_name(r) for r in rec["runs"]]
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
    p.add_argument(
        "--numpy-avx512",
        action="store_true",
        help="print NumPy's AVX-512 dispatch targets found here (for NPY_DISABLE_CPU_FEATURES)",
    )
    args = p.parse_args(argv)
    if args.ci_kernels is not None:
        print(" ".join(ci_kernels(args.ci_kernels)))
        return 0
    if args.numpy_avx512:
        print(" ".join(numpy_avx512()))
        return 0
    if args.spread:
        print(spread_markdown(rc.load_spread(rc.SPREAD_FILE)))
        return 0
    import numpy
    import scipy

    kernels = distinct_kernels()
    runs = [{"kernel": k, "architecture": a, "numpy_disabled": []} for k, a in kernels]
    if numpy_avx512():
        runs.append({**runs[0], "numpy_disabled": numpy_avx512()})
    commands = rc.marked_commands()
    print(f"runs: {'; '.join(map(run_name, runs))}; {len(commands)} commands", flush=True)
    data = {
        "about": "Each readme-check command's printed tables under each BLAS kernel set, and "
        "natively with NumPy's AVX-512 dispatch off (scripts/kernel_spread.py; read by "
        "tests/test_readme_numbers.py).",
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
        "kernel_types": {k: architecture(k) for k in runnable()},
        "commands": measure(commands, runs),
    }
    rc.SPREAD_FILE.write_text(
        json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"wrote {rc.SPREAD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
