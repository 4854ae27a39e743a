"""The README check: documented tables against what their commands print, on any BLAS kernel.

A marker ``<!-- readme-check: COMMAND -->`` in README.md or docs/*.md covers the tables after it up
to the next heading or marker.  COMMAND (an ``experiments/`` script) runs with ``--out TMP
--no-plot`` appended and one BLAS thread; the k-th covered table is compared with the k-th table of
the ``table.md`` it writes, cell by cell: rows by their first cell, columns by their header.  A
documented row or column the command does not print fails.

OpenBLAS picks its kernels by CPU (``OPENBLAS_CORETYPE`` runs another CPU's), and runs that amplify
round-off print other digits on other kernels.  ``scripts/kernel_spread.py`` runs every marked
command under every kernel set this CPU can execute and records each printed cell in
:data:`SPREAD_FILE`; a number's range ``[lo, hi]`` is the range it took over those runs.

**The rule.**  A documented cell agrees with a printed one when their text with every number
replaced by ``#`` is equal and

- in a row whose label does not end in :data:`MARK`, every number never moved (``lo = hi``) and is
  printed with the documented digits;
- in a row marked :data:`MARK` (kernel-dependent: its digits are not a result), a number that never
  moved is printed with the documented digits (Definition 3.1's ``k/n`` among them), a number that
  moved is documented inside its range, and a cell's first number (the mean) that moved is checked
  by where it stands: for every other row whose first number in that column is apart from it, the
  printed pair is in the documented order.  Two
  numbers are apart when their ranges, each widened by its own spread on both sides, are disjoint
  (a stable number's range is a point): by the factor ``hi/lo`` when ``lo > 0`` (the tables'
  numbers are ratios, shares and fractions; ``[lo²/hi, hi²/lo]``), else by ``hi − lo``.

A marked row that never moved, or a moving number in an unmarked row, fails (the marks must say
what was measured); so does a cell with no measurement.
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
MARK = "†"  # a row label ending in it: the row's digits depend on the BLAS kernel
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
    command: str,
    out: Path,
    kernel: str | None = None,
    timeout: float = 1800,
    numpy_disabled: str | None = None,
) -> subprocess.CompletedProcess:
    """Run a marked command with ``--out OUT --no-plot`` appended, one BLAS thread, from the root;
    ``kernel`` sets ``OPENBLAS_CORETYPE`` and ``numpy_disabled`` ``NPY_DISABLE_CPU_FEATURES``
    (None: the inherited environment's)."""
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
    if numpy_disabled is not None:
        env["NPY_DISABLE_CPU_FEATURES"] = numpy_disabled
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


def marked(label: str) -> bool:
    """Whether a row label carries :data:`MARK` (its digits depend on the BLAS kernel)."""
    return label.rstrip().endswith(MARK)


def compare_cell(doc: str, printed: str, measured: list[str], kernel_dependent: bool = False):
    """None if the documented cell agrees with the printed one under the rule above, else why
    (the order of a kernel-dependent number is :func:`order_problems`' part)."""
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
        elif not kernel_dependent:
            problems.append(f"moves over {lo:.6g} … {hi:.6g} across kernels: mark its row {MARK}")
        elif not lo <= value(d) <= hi:
            problems.append(f"{d} is outside the measured {lo:.6g} … {hi:.6g}")
    return f"{doc!r} vs printed {printed!r}: " + "; ".join(problems) if problems else None


def _widened(measured: list[str]) -> tuple[float, float] | None:
    """The range of a cell's first number over the measured runs, widened by its spread (None: no
    number)."""
    ranges = measured_range(measured) if measured else None
    if not ranges:
        return None
    lo, hi = ranges[0]
    if lo == hi:
        return lo, hi
    return (lo * lo / hi, hi * hi / lo) if lo > 0 else (lo - (hi - lo), hi + (hi - lo))


def _number(cell: str) -> float | None:
    token = NUMBER.search(cell)
    return None if token is None else value(token.group())


def order_problems(doc_table, printed_table, measured) -> list[str]:
    """Each kernel-dependent cell whose first number is printed on the wrong side of a number apart
    from it."""
    (dh, drows), (ph, prows) = doc_table, printed_table
    problems = []
    for j, column in enumerate(dh[1:], 1):
        cells = {}  # label: (documented, printed, widened range) of the first numbers
        for label, row in drows.items():
            span = _widened(measured.get(label, {}).get(column, []))
            d, p = _number(row[j]), _number(prows[label][ph.index(column)])
            if span and d is not None and p is not None:
                cells[label] = d, p, span
        for a, (da, pa, (lo_a, hi_a)) in cells.items():
            if not (marked(a) and lo_a < hi_a):
                continue
            for b, (db, pb, (lo_b, hi_b)) in cells.items():
                apart = hi_a < lo_b or hi_b < lo_a
                if b != a and apart and (pa < pb) != (da < db):
                    problems.append(
                        f"{a} / {column}: printed {pa:g} against {b}'s {pb:g}, documented "
                        f"{da:g} {'<' if da < db else '>'} {db:g} (apart over the measured runs)"
                    )
    return problems


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
        moved = False
        for column, cell in zip(dh[1:], cells[1:]):
            m = measured.get(label, {}).get(column, [])
            moved |= len(set(m)) > 1
            why = compare_cell(cell, prows[label][ph.index(column)], m, marked(label))
            if why:
                problems.append(f"{label} / {column}: {why}")
        if marked(label) and not moved:
            problems.append(f"{label}: marked {MARK} but the same on every measured kernel")
    return problems + order_problems(doc_table, printed_table, measured)


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
