"""README and docs/ tables agree with what their commands print.

Every table of README.md or docs/*.md preceded by ``<!-- readme-check: COMMAND -->`` is checked: COMMAND (an
``experiments/*.py`` invocation, CI-cheap) is run with ``--out TMP --no-plot`` appended, the first
table of the ``table.md`` it writes is parsed, and every README cell is compared with the cell of
the same row (method label) and column (header) there.  A README row or column the command does
not print fails the test.

Tolerances:

* **Tight** (every deterministic method): each number must agree to the precision both sides
  print, ``|a − b| ≤ ½ unit(a) + ½ unit(b)`` where unit is the last printed digit (``2261`` → 1,
  ``0.0223`` → 1e-4, ``4.091e+06`` → 1e3).  A README cell may print fewer digits than the command
  (``0.025`` for ``0.02535``); it may not print different ones.
* **Spread** (Opt κ and its balanced variant, :data:`SPREAD_ROWS`): these runs amplify round-off
  (the step follows ∂κ/∂H, which grows with κ and turns with the extreme eigenvectors), so the
  same command on another BLAS build or thread count moves their digits (README, House Prices).
  Only ``mean ± std`` cells are compared, and the means must agree within twice the larger of the
  two printed stds (over seeds, or over pairs and seeds for MNIST); other cells of these rows are
  not compared.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The files whose tables are checked: the README and every document under docs/.
SCANNED = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*readme-check:\s*(.+?)\s*-->")
SPREAD_ROWS = {"Opt κ", "Opt κ (balanced)"}
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|∞")
ALIASES = {"(Algorithm 1)": "(Alg. 1)"}


def _strip(cell: str) -> str:
    cell = cell.replace("**", "").replace("`", "").strip()
    for a, b in ALIASES.items():
        cell = cell.replace(a, b)
    return cell


def parse_table(lines: list[str], start: int = 0) -> tuple[list[str], dict[str, list[str]]]:
    """The first markdown table at or after ``lines[start]``: (header, {row label: cells})."""
    i = start
    while i < len(lines) and not lines[i].lstrip().startswith("|"):
        i += 1
    if i + 1 >= len(lines):
        raise ValueError(f"no markdown table after line {start + 1}")
    header = [_strip(c) for c in lines[i].strip().strip("|").split("|")]
    rows = {}
    for line in lines[i + 2:]:
        if not line.lstrip().startswith("|"):
            break
        cells = [_strip(c) for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells
    return header, rows


def checks_in_readme(text: str) -> list[tuple[str, int]]:
    lines = text.splitlines()
    return [(m.group(1), i) for i, line in enumerate(lines) for m in [MARKER.search(line)] if m]


def unit(token: str) -> float:
    """Value of one unit in the last printed digit of a number token (``720`` → 1)."""
    if token == "∞":
        return 0.0
    mant, _, exp = token.lower().partition("e")
    e = int(exp) if exp else 0
    return 10.0 ** (e - (len(mant.split(".")[1]) if "." in mant else 0))


def value(token: str) -> float:
    return float("inf") if token == "∞" else float(token)


def close(a: str, b: str) -> bool:
    va, vb = value(a), value(b)
    if va == vb:
        return True
    return abs(va - vb) <= 0.5 * unit(a) + 0.5 * unit(b) + 1e-12 * max(abs(va), abs(vb))


def compare_cell(readme: str, printed: str, spread: bool) -> str | None:
    """None if the README cell agrees with the printed one, else the reason."""
    if readme == printed:
        return None
    ra, pa = NUMBER.findall(readme), NUMBER.findall(printed)
    if spread:
        if "±" not in readme or "±" not in printed:
            return None  # only mean ± std cells are compared for spread rows
        (rm, rs), (pm, ps) = ra[:2], pa[:2]
        tol = 2 * max(value(rs), value(ps)) + 0.5 * unit(rm) + 0.5 * unit(pm)
        return None if abs(value(rm) - value(pm)) <= tol else f"mean {rm} vs {pm} beyond 2·std ({tol:g})"
    if not ra or re.fullmatch(r"\d+/\d+", readme):  # text, or a count like 90/90: exact
        return f"{readme!r} vs {printed!r}"
    if len(ra) < len(pa) and "±" in printed and "±" not in readme:
        pa = pa[:1]  # README prints the mean only
    if len(ra) != len(pa):
        return f"{readme!r} vs {printed!r}: different number of values"
    bad = [f"{x} vs {y}" for x, y in zip(ra, pa) if not close(x, y)]
    return None if not bad else f"{readme!r} vs {printed!r} ({'; '.join(bad)})"


def compare_tables(readme_table, printed_table) -> list[str]:
    (rh, rrows), (ph, prows) = readme_table, printed_table
    problems = [f"column {c!r} is not printed by the command" for c in rh if c not in ph]
    if problems:
        return problems
    col = {c: ph.index(c) for c in rh}
    for label, cells in rrows.items():
        if label not in prows:
            problems.append(f"row {label!r} is not printed by the command (rows: {sorted(prows)})")
            continue
        for c, cell in zip(rh[1:], cells[1:]):
            why = compare_cell(cell, prows[label][col[c]], label in SPREAD_ROWS)
            if why:
                problems.append(f"{label} / {c}: {why}")
    return problems


# ---------------------------------------------------------------- the check itself

CHECKS = [(path, command, line) for path in SCANNED
          for command, line in checks_in_readme(path.read_text(encoding="utf-8"))]


def test_readme_has_checked_tables():
    # The README's headline table and docs/results.md's House Prices (paper protocol) and MNIST tables.
    files = [path.relative_to(ROOT).as_posix() for path, _, _ in CHECKS]
    assert len(CHECKS) >= 3, f"<!-- readme-check: ... --> markers lost: {files}"
    assert "README.md" in files and files.count("docs/results.md") >= 2, files


@pytest.mark.parametrize("path, command, line", CHECKS,
                         ids=[f"{p.relative_to(ROOT).as_posix()}: {c}" for p, c, _ in CHECKS])
def test_readme_table_matches_command(path, command, line, tmp_path):
    argv = shlex.split(command)
    assert argv[0] == "python" and argv[1].startswith("experiments/"), f"unexpected command {command!r}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}  # the scripts import `experiments` (installed by pip install -e .)
    proc = subprocess.run([sys.executable, *argv[1:], "--out", str(tmp_path), "--no-plot"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = parse_table((tmp_path / "table.md").read_text(encoding="utf-8").splitlines())
    readme = parse_table(path.read_text(encoding="utf-8").splitlines(), line + 1)
    problems = compare_tables(readme, printed)
    assert not problems, f"{path.relative_to(ROOT)} line {line + 1} ({command}):\n" + "\n".join(problems)


# ---------------------------------------------------------------- the comparison rules

def test_rules_tight_and_spread():
    assert close("0.025", "0.02535") and not close("0.026", "0.02535")
    assert close("2261", "2261") and close("4.091e6", "4.091e+06") and not close("720", "724")
    assert not close("2263", "2261") and close("2262", "2261")
    assert compare_cell("1.29e-04", "1.293e-04 ± 0", False) is None
    assert compare_cell("5.17 ± 7.0", "2.218 ± 1.1", True) is None          # within 2 std
    assert compare_cell("5.17 ± 1.0", "2.218 ± 1.1", True) is not None      # beyond 2 std
    assert compare_cell("5.17 ± 1.0", "2.218 ± 1.1", False) is not None     # tight rows: no spread
    assert compare_cell("90/90", "89/90", False) is not None
    t = (["method", "RIR ↑"], {"Ours (Alg. 1)": ["Ours (Alg. 1)", "2261 ± 720"]})
    assert compare_tables(t, t) == []
    assert compare_tables((["method", "x"], {}), t) == ["column 'x' is not printed by the command"]


def test_parse_table_after_marker():
    text = ("intro\n<!-- readme-check: python experiments/x.py --a 1 -->\n\n"
            "| method | v |\n|---|---|\n| **A** | 1 |\n\nafter")
    (cmd, line), = checks_in_readme(text)
    assert cmd == "python experiments/x.py --a 1"
    assert parse_table(text.splitlines(), line + 1) == (["method", "v"], {"A": ["A", "1"]})
