"""The README check: documented tables against what their commands print, on any BLAS kernel.

A marker ``<!-- readme-check: COMMAND -->`` in README.md or docs/*.md covers the tables after it up
to the next heading or marker.  COMMAND (an ``experiments/`` script) runs with ``--out TMP
--no-plot`` appended and one BLAS thread; the k-th covered table is compared with the k-th table of
the ``table.md`` it writes, cell by cell: rows by their first cell, columns by their header.  A
documented row or column the command does not print fails.

OpenBLAS picks its kernels by CPU (``OPENBLAS_CORETYPE`` runs another CPU's), and runs that amplify
round-off print other digits on other kernels.  ``scripts/kernel_spread.py`` runs every marked
command under several kernel types and records each printed cell in :data:`SPREAD_FILE`.

**The rule.**  A documented cell agrees with a printed one when their text with every number
replaced by ``#`` is equal and, number by number, with ``[lo, hi]`` the range that number took over
the measured kernels: ``lo ≤ documented ≤ hi`` and ``|printed − documented| ≤ hi − lo``.  A number
that never moved (``lo = hi``) must therefore be printed with the documented digits; a cell with no
measurement fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPREAD_FILE = ROOT / "tests" / "data" / "kernel_spread.json"
DOCUMENTS = ("README.md", "docs/*.md")
MARKER = re.compile(r"<!--\s*readme-check:\s*(.+?)\s*-->")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|∞")


# ---------------------------------------------------------------- documents and tables


def split_row(line: str) -> list[str]:
    return [
        c.replace("**", "").replace("`", "").strip() for c in line.strip().strip("|").split("|")
    ]


def parse_tables(lines: list[str]) -> list[tuple[list[str], dict[str, list[str]]]]:
    """Every markdown table in ``lines``: (header, {row label: cells})."""
    tables, i = [], 0
    while i < len(lines):
        rule = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if lines[i].lstrip().startswith("|") and "-" in rule and set(rule) <= set("|-: "):
            header, rows, i = split_row(lines[i]), {}, i + 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                cells = split_row(lines[i])
                rows[cells[0]] = cells
                i += 1
            tables.append((header, rows))
        else:
            i += 1
    return tables


def marked_sections(root: Path = ROOT) -> list[tuple[Path, int, str, list]]:
    """(document, marker line index, command, covered tables) for every marker, in document
    order."""
    out = []
    for path in [p for pattern in DOCUMENTS for p in sorted(root.glob(pattern))]:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = MARKER.search(line)
            if m:
                end = next(
                    (
                        j
                        for j in range(i + 1, len(lines))
                        if lines[j].startswith("#") or MARKER.search(lines[j])
                    ),
                    len(lines),
                )
                out.append((path, i, m.group(1), parse_tables(lines[i + 1 : end])))
    return out


def marked_commands(root: Path = ROOT) -> list[str]:
    return list(dict.fromkeys(cmd for _, _, cmd, _ in marked_sections(root)))


# ---------------------------------------------------------------- running a marked command


def run_command(
    command: str, out: Path, kernel: str | None = None, timeout: float = 1800
) -> subprocess.CompletedProcess:
    """Run a marked command with ``--out OUT --no-plot`` appended, one BLAS thread, from the root;
    ``kernel`` sets ``OPENBLAS_CORETYPE`` (None: the inherited environment's)."""
    argv = shlex.split(command)
    if not (len(argv) >= 2 and argv[0] == "python" and argv[1].startswith("experiments/")):
        raise ValueError(f"a readme-check command runs an experiments/ script: got {command!r}")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    if kernel is not None:
        env["OPENBLAS_CORETYPE"] = kernel
    return subprocess.run(
        [sys.executable, *argv[1:], "--out", str(out), "--no-plot"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def printed_tables(out: Path) -> list:
    return parse_tables((Path(out) / "table.md").read_text(encoding="utf-8").splitlines())


# ---------------------------------------------------------------- the rule


def value(token: str) -> float:
    return math.inf if token == "∞" else float(token)


def skeleton(cell: str) -> str:
    return NUMBER.sub("#", cell)


def measured_range(cells: list[str]) -> list[tuple[float, float]] | None:
    """(lo, hi) of each number of a cell over the measured kernels; None if their text differs."""
    if len({skeleton(c) for c in cells}) != 1:
        return None
    columns = zip(*[[value(t) for t in NUMBER.findall(c)] for c in cells])
    return [(min(col), max(col)) for col in columns]


def compare_cell(doc: str, printed: str, measured: list[str]) -> str | None:
    """None if the documented cell agrees with the printed one under the rule above, else why."""
    if skeleton(doc) != skeleton(printed):
        return f"{doc!r} vs printed {printed!r}: different text"
    ranges = measured_range(measured) if measured else None
    if ranges is None or skeleton(measured[0]) != skeleton(doc):
        return (
            f"{doc!r}: measured as {' / '.join(dict.fromkeys(measured)) or 'nothing'}; "
            "run python scripts/kernel_spread.py"
        )
    problems = []
    for d, p, (lo, hi) in zip(NUMBER.findall(doc), NUMBER.findall(printed), ranges):
        if lo == hi:
            if d != p or value(d) != lo:
                problems.append(f"{p} is not {d} (the same on every measured kernel)")
        elif not lo <= value(d) <= hi:
            problems.append(f"{d} is outside the measured {lo:.6g} … {hi:.6g}")
        elif not abs(value(p) - value(d)) <= (hi - lo) * (1 + 1e-9):
            problems.append(f"{p} differs from {d} by more than the measured spread {hi - lo:.3g}")
    return f"{doc!r} vs printed {printed!r}: " + "; ".join(problems) if problems else None


def compare_tables(
    doc_table, printed_table, measured: dict[str, dict[str, list[str]]]
) -> list[str]:
    """Problems of one documented table against the printed one; ``measured[row][column]`` is that
    cell as each measured kernel printed it."""
    (dh, drows), (ph, prows) = doc_table, printed_table
    problems = [f"column {c!r} is not printed" for c in dh if c not in ph]
    problems += [f"row {r!r} is not printed" for r in drows if r not in prows]
    if problems:
        return problems
    for label, cells in drows.items():
        for column, cell in zip(dh[1:], cells[1:]):
            why = compare_cell(
                cell, prows[label][ph.index(column)], measured.get(label, {}).get(column, [])
            )
            if why:
                problems.append(f"{label} / {column}: {why}")
    return problems


# ---------------------------------------------------------------- the spread file


def load_spread(path: Path = SPREAD_FILE) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def measured_cells(spread: dict, command: str) -> list[dict[str, dict[str, list[str]]]] | None:
    """Per printed table, {row: {column: [the cell under each measured kernel]}}; None if not
    measured."""
    rec = spread.get("commands", {}).get(command)
    if rec is None:
        return None
    out: list[dict] = []
    for run in rec["runs"]:
        for k, (header, rows) in enumerate(run["tables"]):
            if k == len(out):
                out.append({})
            for label, cells in rows.items():
                for column, cell in zip(header[1:], cells[1:]):
                    out[k].setdefault(label, {}).setdefault(column, []).append(cell)
    return out
