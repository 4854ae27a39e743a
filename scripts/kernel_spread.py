#!/usr/bin/env python
"""Cross-kernel spread of the documented tables: run every ``readme-check`` command under several
BLAS kernel types and record what each prints (docs/reproducibility.md).

OpenBLAS picks its compute kernels per CPU (``SkylakeX`` on AVX-512 machines, ``Haswell`` on AVX2
ones and AMD Zen, ...) and ``OPENBLAS_CORETYPE`` makes it run another CPU's kernels on this one.
The kernels round differently, and runs that amplify round-off print other digits.

    python scripts/kernel_spread.py                  # measure: every marked command × every kernel
                                                     # this CPU runs; writes tests/data/kernel_spread.json
    python scripts/kernel_spread.py --tables         # each marked table in the stable format
    python scripts/kernel_spread.py --tables --apply # ... written into README.md / docs/*.md in place
    python scripts/kernel_spread.py --spread         # markdown: every cell that moves, per kernel
    python scripts/kernel_spread.py --ci-kernels 2   # two kernel types other than the native one

The markers are read from README.md and docs/*.md (``tests/readme_check.py``); each command runs
with one BLAS thread and ``--out TMP --no-plot`` appended, exactly as ``tests/test_readme_numbers.py``
runs it.  The kernel of every run is read back with threadpoolctl, so a request the BLAS build
ignores (a library built for one CPU, a non-OpenBLAS BLAS) is recorded as what it was.  Only the
``OPENBLAS_CORETYPE`` of each run is set here; everything else (``OPENBLAS_L2_SIZE`` included) is
inherited from the environment, and the native run is the one without ``OPENBLAS_CORETYPE``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import readme_check as rc  # noqa: E402

# Kernel types to try, in order, with the CPU flags (Linux /proc/cpuinfo names) their code needs.
# AMD Zen runs the Haswell kernels; Prescott needs SSE3 ("pni"), which every x86-64 CPU since 2005
# has, and Sandybridge AVX (every x86-64 CPU since 2011/2013).
KERNELS = {
    "SkylakeX": {"avx512f", "avx512dq", "avx512bw", "avx512vl"},
    "Haswell": {"avx2", "fma"},
    "Sandybridge": {"avx"},
    "Nehalem": {"sse4_2"},
    "Prescott": {"pni"},
}
# preferred order for CI: the types every x86-64 CI runner supports first
CI_ORDER = ("Sandybridge", "Prescott", "Nehalem", "Haswell", "SkylakeX")
PROBE = ("import json, numpy, scipy.linalg, threadpoolctl; "
         "print(json.dumps([{k: i.get(k) for k in ('internal_api', 'version', 'architecture', 'filepath')} "
         "for i in threadpoolctl.threadpool_info() if i.get('user_api') == 'blas']))")


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_kernels() -> list[str]:
    """Kernel types this CPU can execute (none off x86 or without /proc/cpuinfo)."""
    if not is_x86():
        return []
    flags = cpu_flags()
    return [k for k, need in KERNELS.items() if need <= flags]


def env_for(kernel: str) -> dict[str, str | None]:
    return {"OPENBLAS_CORETYPE": None if kernel == "native" else kernel}


def probe(kernel: str) -> list[dict]:
    """What the BLAS libraries NumPy and SciPy load report under ``kernel`` (threadpoolctl)."""
    import os

    env = dict(os.environ)
    for key, val in env_for(kernel).items():
        if val is None:
            env.pop(key, None)
        else:
            env[key] = val
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    libs = json.loads(out.stdout)
    for lib in libs:
        lib["filepath"] = Path(lib["filepath"] or "").name
    return libs


def architecture(libs: list[dict]) -> str:
    """One name for the kernels a run used (``Haswell``; ``A+B`` if NumPy's and SciPy's differ)."""
    names = list(dict.fromkeys(str(lib.get("architecture") or lib.get("internal_api")) for lib in libs))
    return "+".join(names) if names else "unknown"


def kernels_to_measure(requested: list[str] | None) -> list[tuple[str, str, list[dict]]]:
    """(kernel, architecture, libs) for the native kernel and every supported type that runs
    different code (requests that come back as an architecture already listed are dropped)."""
    wanted = requested or ["native", *supported_kernels()]
    seen, out = set(), []
    for k in wanted:
        if k != "native" and k not in KERNELS:
            raise SystemExit(f"kernel_spread.py: error: unknown kernel {k!r}; choose from native, "
                             f"{', '.join(KERNELS)}")
        libs = probe(k)
        arch = architecture(libs)
        if arch in seen:
            print(f"  {k}: runs the {arch} kernels already listed; skipped", file=sys.stderr)
            continue
        seen.add(arch)
        out.append((k, arch, libs))
    return out


def ci_kernels(n: int) -> list[str]:
    """Up to ``n`` kernel types other than the native one that this CPU runs and that really change
    the kernels (checked with threadpoolctl)."""
    native = architecture(probe("native"))
    supported = set(supported_kernels())
    out, seen = [], {native}
    for k in CI_ORDER:
        if len(out) == n:
            break
        if k not in supported:
            continue
        arch = architecture(probe(k))
        if arch not in seen:
            seen.add(arch)
            out.append(k)
    return out


def versions() -> dict:
    import numpy
    import scipy

    from pycore import __version__
    return {"python": platform.python_version(), "numpy": numpy.__version__, "scipy": scipy.__version__,
            "pycore": __version__}


def git_state() -> dict:
    def git(*args):
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def measure(commands: list[str], kernels, log=print) -> dict:
    records = {}
    for cmd in commands:
        runs = []
        for kernel, arch, libs in kernels:
            with tempfile.TemporaryDirectory(prefix="kernel_spread_") as tmp:
                t0 = time.perf_counter()
                proc = rc.run_command(cmd, Path(tmp) / "out", env_for(kernel))
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    raise SystemExit(f"kernel_spread.py: {cmd!r} under {kernel} failed "
                                     f"(exit {proc.returncode}):\n{proc.stderr[-2000:]}")
                header, rows = rc.printed_table(Path(tmp) / "out")
            log(f"  {cmd}  [{kernel}: {arch}]  {wall:.1f} s")
            runs.append({"kernel": kernel, "architecture": arch, "wall_seconds": round(wall, 1),
                         "header": header, "rows": rows})
        # provenance per command: with --commands, records of other commands keep their own
        records[cmd] = {"git": git_state(), "measured": _now(), "runs": runs}
    return records


def write_spread(path: Path, commands: dict, kernels, merge: bool) -> dict:
    old = rc.load_spread(path) if merge and path.exists() else {}
    data = {
        "about": "Each readme-check command's first printed table under each BLAS kernel type "
                 "(written by scripts/kernel_spread.py; read by tests/test_readme_numbers.py).",
        "tool": "python scripts/kernel_spread.py",
        "generated": _now(),
        "git": git_state(),
        "machine": {"cpu": cpu_model(), "platform": platform.platform()},
        "versions": versions(),
        "threads": 1,
        "margin": rc.MARGIN,
        "kernels": [{"kernel": k, "OPENBLAS_CORETYPE": env_for(k)["OPENBLAS_CORETYPE"], "architecture": a,
                     "blas": libs} for k, a, libs in kernels],
        "commands": {**old.get("commands", {}), **commands},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return data


# ---------------------------------------------------------------- tables for the documents

def stable_table_lines(lines: list[str], marker_line: int, measured) -> tuple[int, int, list[str], list[str]]:
    """(first, end, new lines, warnings) of the marked table with every cell in the stable format."""
    i, j = rc.table_span(lines, marker_line + 1)
    header = [rc.strip_cell(c) for c in rc.split_row(lines[i])]
    new, warnings = [], []
    for line in lines[i + 2:j]:
        raw = rc.split_row(line)
        label = rc.strip_cell(raw[0])
        cells = [raw[0]]
        for c, cell in zip(header[1:], raw[1:]):
            doc = rc.strip_cell(cell)
            m = (measured or {}).get(label, {}).get(c)
            if not m:
                warnings.append(f"{label} / {c}: not measured; kept as is")
                cells.append(cell)
                continue
            s = rc.stable_cell(m, doc)
            cells.append(f"**{s}**" if cell.startswith("**") else s)
        new.append("| " + " | ".join(cells) + " |")
    return i, j, lines[i:i + 2] + new, warnings


def tables(spread: dict, apply: bool, root: Path = ROOT) -> int:
    status = 0
    by_doc: dict[Path, list] = {}
    for path, cmd, line in rc.marked_tables(root):
        by_doc.setdefault(path, []).append((cmd, line))
    for path, marks in by_doc.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        edits = []
        for cmd, line in marks:
            measured = rc.measured_cells(spread, cmd)
            rel = path.relative_to(root)
            if measured is None:
                print(f"{rel}:{line + 1}: {cmd!r} was not measured; run scripts/kernel_spread.py",
                      file=sys.stderr)
                status = 1
                continue
            i, j, new, warnings = stable_table_lines(lines, line, measured)
            for w in warnings:
                print(f"{rel}:{line + 1}: {w}", file=sys.stderr)
            print(f"{rel}:{line + 1}: <!-- readme-check: {cmd} -->")
            print("\n".join(new) + "\n")
            edits.append((i, j, new))
        if apply and edits:
            for i, j, new in sorted(edits, reverse=True):
                lines[i:j] = new
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            print(f"wrote {path.relative_to(root)}", file=sys.stderr)
    return status


def spread_markdown(spread: dict) -> str:
    """Every cell that moves across kernels: one row per cell, one column per kernel."""
    out = []
    kernels = [f"{k['architecture']}" + (" (native)" if k["kernel"] == "native" else "")
               for k in spread["kernels"]]
    for cmd, rec in spread["commands"].items():
        measured = rc.measured_cells(spread, cmd)
        archs = [r["architecture"] for r in rec["runs"]]
        heads = [next((k for k in kernels if k.split(" ")[0] == a), a) for a in archs]
        rows = []
        for label, cols in measured.items():
            for c, cells in cols.items():
                if len(set(cells)) > 1:
                    rows.append(f"| {label} | {c} | " + " | ".join(cells) + f" | {rc.stable_cell(cells)} |")
        out.append(f"`{cmd}`: {len(rows)} of {sum(len(v) for v in measured.values())} cells move\n")
        if rows:
            out.append("| row | column | " + " | ".join(heads) + " | stable |")
            out.append("|---|---|" + "---|" * len(heads) + "---|")
            out.extend(rows)
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kernel_spread.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", help="comma list of kernel types to measure (native, "
                   f"{', '.join(KERNELS)}); default: native and every type this CPU runs")
    p.add_argument("--commands", help="only the marked command equal to this text, else those containing "
                   "it (the others keep their recorded runs)")
    p.add_argument("--file", type=Path, default=rc.SPREAD_FILE, help="the spread file (default: %(default)s)")
    p.add_argument("--tables", action="store_true", help="print each marked table in the stable format")
    p.add_argument("--apply", action="store_true", help="with --tables: write them into the documents")
    p.add_argument("--spread", action="store_true", help="print the cells that move, per kernel (markdown)")
    p.add_argument("--ci-kernels", type=int, metavar="N",
                   help="print up to N kernel types other than the native one (for .ci/run)")
    args = p.parse_args(argv)
    if args.apply and not args.tables:
        p.error("--apply goes with --tables")
    if args.ci_kernels is not None:
        if not is_x86():
            print(f"kernel_spread.py: {platform.machine()} is not x86: no other OpenBLAS kernel types to run",
                  file=sys.stderr)
            return 0
        ks = ci_kernels(args.ci_kernels)
        if len(ks) < args.ci_kernels:
            print(f"kernel_spread.py: only {len(ks)} kernel type(s) other than the native one take effect "
                  "here (is NumPy's BLAS an OpenBLAS built with DYNAMIC_ARCH?)", file=sys.stderr)
        print(" ".join(ks))
        return 0
    if args.tables or args.spread:
        spread = rc.load_spread(args.file)
        if args.spread:
            print(spread_markdown(spread))
            return 0
        return tables(spread, args.apply)
    commands = rc.marked_commands()
    if args.commands:
        commands = [c for c in commands if c == args.commands] or [c for c in commands if args.commands in c]
    if not commands:
        p.error("no marked command to run")
    requested = args.kernels.split(",") if args.kernels else None
    if not is_x86() and requested is None:
        print(f"kernel_spread.py: {platform.machine()} is not x86: measuring the native kernel only",
              file=sys.stderr)
        requested = ["native"]
    kernels = kernels_to_measure(requested)
    print(f"kernels: {', '.join(f'{k} ({a})' for k, a, _ in kernels)}; commands: {len(commands)}")
    records = measure(commands, kernels)
    write_spread(args.file, records, kernels, merge=bool(args.commands))
    print(f"wrote {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
