"""The README check's rules: marked tables, cells, numbers, and the cross-kernel spread.

A table in ``README.md`` or ``docs/*.md`` preceded by ``<!-- readme-check: COMMAND -->`` is
checked against what COMMAND prints (the first table of the ``table.md`` it writes).  The same
command, seeds and thread count give other digits on other BLAS kernels (OpenBLAS picks its kernels
per CPU; ``OPENBLAS_CORETYPE`` forces another CPU's), because some runs amplify round-off
(docs/reproducibility.md).  ``scripts/kernel_spread.py`` runs every marked command under several
kernel types and records each printed table in :data:`SPREAD_FILE`; the rules below compare a
documented cell with a printed one in the light of that measured spread.

Per number of a cell (``mean ± std`` has two, ``0/5`` two, ``0.710 → 0.715`` two), with ``unit``
the value of the last printed digit (``2261`` → 1, ``0.0223`` → 1e-4, ``4.091e+06`` → 1e3):

* **What a documented number claims.**  A number ``r`` claims the interval ``r ± ½unit(r)``; a
  range ``a…b`` claims ``[a − ½unit(a), b + ½unit(b)]``.
* **Rule A, the document states only what is stable.**  The claim must contain every value the
  command printed under every measured kernel.  A number that moves across kernels is therefore
  printed with the precision it holds (``1.30`` for 1.301 … 1.302) or as a range
  (``292.7…299.1``); a number that never moves keeps every digit (``4.091e+06``) or fewer
  (``0.025`` for ``0.02535``).
* **Rule B, this run agrees.**  The number printed now (with its own ``± ½unit``) must overlap the
  claim widened on each side by ``MARGIN`` times the measured spread ``max − min`` over kernels.
  Kernels never measured (other CPUs, other BLAS builds) may land a bit outside the measured range
  of a number that moves; a number that never moved has no margin, so every kernel must print the
  documented digits.

A documented cell may print the mean only where the command prints ``mean ± std``; text cells
(``—``, ``n/a``) must be equal.
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
MARKER = re.compile(r"<!--\s*readme-check:\s*(.+?)\s*-->")
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|∞"
NUMBER = re.compile(_NUM)
# a documented range: two numbers joined by an ellipsis, ``292.7…299.1`` (a hyphen would read as a
# minus sign, and ``a – b ± c`` as a difference)
RANGE = "…"
TOKEN = re.compile(rf"(?P<lo>{_NUM})(?:\s*{RANGE}\s*(?P<hi>{_NUM}))?")
ALIASES = {"(Algorithm 1)": "(Alg. 1)"}
# Rule B's margin, in units of the measured cross-kernel spread of the number (each side).  Five
# kernels are a small sample: for a spread that behaves like independent draws, a sixth lands
# outside the range of five with probability 1/3, but more than one range-width outside it only
# in the far tail (under 0.1% for normal draws).
MARGIN = 1.0
# documents scanned for markers, relative to the repository root
DOCUMENTS = ("README.md", "docs/*.md")


# ---------------------------------------------------------------- documents and tables

def documents(root: Path = ROOT) -> list[Path]:
    files = []
    for pattern in DOCUMENTS:
        files.extend(sorted(root.glob(pattern)))
    return files


def strip_cell(cell: str) -> str:
    cell = cell.replace("**", "").replace("`", "").strip()
    for a, b in ALIASES.items():
        cell = cell.replace(a, b)
    return cell


def split_row(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_span(lines: list[str], start: int = 0) -> tuple[int, int]:
    """Line indices [first, end) of the first markdown table at or after ``lines[start]``."""
    i = start
    while i < len(lines) and not lines[i].lstrip().startswith("|"):
        i += 1
    if i + 1 >= len(lines):
        raise ValueError(f"no markdown table after line {start + 1}")
    j = i + 2
    while j < len(lines) and lines[j].lstrip().startswith("|"):
        j += 1
    return i, j


def parse_table(lines: list[str], start: int = 0) -> tuple[list[str], dict[str, list[str]]]:
    """The first markdown table at or after ``lines[start]``: (header, {row label: cells})."""
    i, j = table_span(lines, start)
    header = [strip_cell(c) for c in split_row(lines[i])]
    rows = {}
    for line in lines[i + 2:j]:
        cells = [strip_cell(c) for c in split_row(line)]
        rows[cells[0]] = cells
    return header, rows


def checks_in_text(text: str) -> list[tuple[str, int]]:
    """(command, line index) of every marker in a document."""
    lines = text.splitlines()
    return [(m.group(1), i) for i, line in enumerate(lines) for m in [MARKER.search(line)] if m]


def marked_tables(root: Path = ROOT) -> list[tuple[Path, str, int]]:
    """(document, command, marker line index) for every marker in README.md and docs/*.md."""
    return [(path, cmd, line) for path in documents(root)
            for cmd, line in checks_in_text(path.read_text(encoding="utf-8"))]


def marked_commands(root: Path = ROOT) -> list[str]:
    """The distinct marked commands, in document order."""
    return list(dict.fromkeys(cmd for _, cmd, _ in marked_tables(root)))


# ---------------------------------------------------------------- running a marked command

def check_argv(command: str) -> list[str]:
    argv = shlex.split(command)
    if not (len(argv) >= 2 and argv[0] == "python" and argv[1].startswith("experiments/")):
        raise ValueError(f"a readme-check command runs an experiments/ script: got {command!r}")
    return argv


def run_command(command: str, out: Path, env_changes: dict[str, str | None] | None = None,
                timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run a marked command with ``--out OUT --no-plot`` appended, one BLAS thread, from the root.

    ``env_changes`` sets (str) or removes (None) environment variables for this run only; the
    BLAS kernel choice (``OPENBLAS_CORETYPE``, ``OPENBLAS_L2_SIZE``) is otherwise inherited.
    """
    argv = check_argv(command)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}  # the scripts import `experiments` (installed by pip install -e .)
    for key, val in (env_changes or {}).items():
        if val is None:
            env.pop(key, None)
        else:
            env[key] = val
    return subprocess.run([sys.executable, *argv[1:], "--out", str(out), "--no-plot"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def printed_table(out: Path) -> tuple[list[str], dict[str, list[str]]]:
    return parse_table((out / "table.md").read_text(encoding="utf-8").splitlines())


# ---------------------------------------------------------------- numbers

def unit(token: str) -> float:
    """Value of one unit in the last printed digit of a number token (``720`` → 1)."""
    if token == "∞":
        return 0.0
    mant, _, exp = token.lower().partition("e")
    e = int(exp) if exp else 0
    return 10.0 ** (e - (len(mant.split(".")[1]) if "." in mant else 0))


def value(token: str) -> float:
    return math.inf if token == "∞" else float(token)


def numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell)


def skeleton(cell: str) -> str:
    """The cell with every number (or documented range) replaced by ``#``: its text structure."""
    return TOKEN.sub("#", cell)


def claims(cell: str) -> list[tuple[float, float]]:
    """The interval each number (or range) of a documented cell claims (see the module doc)."""
    out = []
    for m in TOKEN.finditer(cell):
        lo, hi = m.group("lo"), m.group("hi") or m.group("lo")
        out.append((value(lo) - 0.5 * unit(lo), value(hi) + 0.5 * unit(hi)))
    return out


def _slack(*xs: float) -> float:
    finite = [abs(x) for x in xs if math.isfinite(x)]
    return 1e-12 * max(finite, default=0.0)


def covers(claim: tuple[float, float], lo: float, hi: float) -> bool:
    a, b = claim
    if a == b == lo == hi:  # ∞ claims ∞
        return True
    s = _slack(a, b, lo, hi)
    return a - s <= lo and hi <= b + s


def within(claim: tuple[float, float], token: str, margin: float) -> bool:
    """Rule B for one printed number ``token``: its rounding interval ``p ± ½unit(p)`` overlaps the
    claim widened by ``margin`` on each side (intervals that only touch do not overlap: a count
    ``4`` is not ``5``, nor is ``2261`` ``2262``)."""
    p = value(token)
    a, b = claim
    if p == a == b:
        return True
    w = margin + 0.5 * unit(token)
    tiny = 1e-9 * unit(token) + _slack(a, b, p)
    return a - w + tiny < p < b + w - tiny


# ---------------------------------------------------------------- the rules

def spread_of(cells: list[str]) -> list[tuple[float, float]] | None:
    """(min, max) over kernels of each number of one printed cell (its value under each kernel);
    None when the cells differ in text or count of numbers (then nothing is comparable)."""
    if len({skeleton(c) for c in cells}) != 1:
        return None
    cols = list(zip(*[[value(t) for t in numbers(c)] for c in cells]))
    return [(min(c), max(c)) for c in cols]


def compare_cell(doc: str, printed: str, measured: list[str] | None = None,
                 margin: float = MARGIN) -> str | None:
    """None if the documented cell agrees with the printed one, else the reason.

    ``measured``: the same cell as printed under each measured kernel (``None``: no measurement,
    the printed cell alone is the spread, i.e. the number must agree to the printed digits).
    """
    if doc == printed:
        measured_same = measured is None or len(set(measured)) <= 1
        if measured_same:
            return None
    cells = measured if measured else [printed]
    spread = spread_of(cells)
    if spread is None:
        return f"{doc!r}: the kernels print different text ({' / '.join(dict.fromkeys(cells))})"
    sk_doc, sk_pr = skeleton(doc), skeleton(printed)
    pnums = numbers(printed)
    if sk_doc != sk_pr:
        if sk_doc == "#" and sk_pr.startswith("# ±"):   # the document prints the mean only
            pnums, spread = pnums[:1], spread[:1]
        elif not NUMBER.search(doc) or not pnums:
            return f"{doc!r} vs {printed!r}"
        else:
            return f"{doc!r} vs {printed!r}: different numbers or text"
    if skeleton(cells[0]) != sk_pr:
        return (f"{printed!r} is not the cell that was measured ({cells[0]!r}): "
                "re-run scripts/kernel_spread.py")
    problems = []
    for claim, token, (lo, hi) in zip(claims(doc), pnums, spread):
        if not covers(claim, lo, hi):
            lo_s, hi_s = _fmt(lo), _fmt(hi)
            problems.append(f"{_claim_text(claim)} does not hold across kernels (measured {lo_s} … {hi_s}; "
                            "print it with the precision it holds or as a range)")
        elif not within(claim, token, margin * (hi - lo)):
            problems.append(f"{token} is outside {_claim_text(claim)} (measured {_fmt(lo)} … {_fmt(hi)}, "
                            f"margin {margin:g}×spread)")
    return None if not problems else f"{doc!r} vs {printed!r}: " + "; ".join(problems)


def _fmt(x: float) -> str:
    return "∞" if math.isinf(x) else f"{x:.6g}"


def _claim_text(claim: tuple[float, float]) -> str:
    return f"[{_fmt(claim[0])}, {_fmt(claim[1])}]"


def compare_tables(doc_table, printed_table, measured: dict[str, dict[str, list[str]]] | None = None,
                   margin: float = MARGIN) -> list[str]:
    """Problems of a documented table against the printed one.

    ``measured[row][column]``: that cell as printed under each measured kernel (see
    :func:`measured_cells`); a documented cell with no measurement fails.  ``measured=None``
    compares to the printed digits (no spread known).
    """
    (rh, rrows), (ph, prows) = doc_table, printed_table
    problems = [f"column {c!r} is not printed by the command" for c in rh if c not in ph]
    if problems:
        return problems
    col = {c: ph.index(c) for c in rh}
    for label, cells in rrows.items():
        if label not in prows:
            problems.append(f"row {label!r} is not printed by the command (rows: {sorted(prows)})")
            continue
        for c, cell in zip(rh[1:], cells[1:]):
            m = None
            if measured is not None:
                m = measured.get(label, {}).get(c)
                if not m:
                    problems.append(f"{label} / {c}: no cross-kernel measurement in {SPREAD_FILE.name}; "
                                    "re-run scripts/kernel_spread.py")
                    continue
            why = compare_cell(cell, prows[label][col[c]], m, margin)
            if why:
                problems.append(f"{label} / {c}: {why}")
    return problems


# ---------------------------------------------------------------- the spread file

def load_spread(path: Path = SPREAD_FILE) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def measured_cells(spread: dict, command: str) -> dict[str, dict[str, list[str]]] | None:
    """{row: {column: [cell under each measured kernel]}} for ``command``; None if not measured."""
    rec = spread.get("commands", {}).get(command)
    if rec is None:
        return None
    out: dict[str, dict[str, list[str]]] = {}
    for run in rec["runs"]:
        header, rows = run["header"], run["rows"]
        for label, cells in rows.items():
            for c, cell in zip(header[1:], cells[1:]):
                out.setdefault(label, {}).setdefault(c, []).append(cell)
    return out


# ---------------------------------------------------------------- stable formatting

def _sig_token(x: float, digits: int, like: str) -> str:
    """``x`` rounded to ``digits`` significant digits, printed so that :func:`unit` reads that precision
    back (e-notation where fixed notation would end in zeros before the point)."""
    if x == 0:
        return "0"
    e = math.floor(math.log10(abs(x)))
    if "e" in like.lower() or digits <= e:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{max(digits - 1 - e, 0)}f}"


def _sig_digits(token: str) -> int:
    mant = token.lower().partition("e")[0].lstrip("+-").replace(".", "").lstrip("0")
    return max(len(mant), 1)


def stable_token(tokens: list[str], min_digits: int = 2) -> str:
    """The most precise single number whose claim holds every value in ``tokens`` (Rule A), with
    at least ``min_digits`` significant digits; otherwise the range ``min…max``."""
    vals = [value(t) for t in tokens]
    lo, hi = min(vals), max(vals)
    if lo == hi:
        return tokens[0]
    t_lo, t_hi = tokens[vals.index(lo)], tokens[vals.index(hi)]
    if math.isfinite(lo) and math.isfinite(hi) and lo * hi > 0:
        most = max(_sig_digits(t) for t in tokens)
        for digits in range(most, min_digits - 1, -1):
            for x in (0.5 * (lo + hi), lo, hi):
                tok = _sig_token(x, digits, tokens[0])
                if "e" in tok and "e" not in tokens[0].lower():
                    continue  # 2.9e+02 for 288.1…294.1 says less than the range
                if covers(claims(tok)[0], lo, hi):
                    return tok
    if math.isfinite(lo) and math.isfinite(hi):
        # both ends at the finest precision printed (the command's %g drops trailing zeros:
        # 0.2 is 0.2000 next to 0.2079)
        most = max(_sig_digits(t) for t in tokens)
        ends = [_sig_token(x, most, t) for x, t in ((lo, t_lo), (hi, t_hi))]
        if all(value(e) == value(t) and ("e" in e) == ("e" in t.lower()) for e, t in zip(ends, (t_lo, t_hi))):
            t_lo, t_hi = ends
    return f"{t_lo}{RANGE}{t_hi}"


def stable_cell(measured: list[str], doc: str | None = None, min_digits: int = 2) -> str:
    """A cell that passes Rule A for every measured kernel.

    Numbers that never move are kept as printed; the others are rounded to the precision they
    hold or become a range (:func:`stable_token`).  A ``mean ± std`` cell whose mean becomes a range
    is printed as that range alone (the per-kernel std is in docs/reproducibility.md), as is any
    cell the document prints as a mean only (``doc``).
    """
    if len(set(measured)) == 1:
        cell = measured[0]
        if doc is not None and skeleton(doc) == "#" and skeleton(cell).startswith("# ±"):
            return numbers(cell)[0]
        return cell
    if spread_of(measured) is None:
        raise ValueError(f"kernels print different text: {measured}")
    cols = list(zip(*[numbers(c) for c in measured]))
    new = [stable_token(list(c), min_digits) for c in cols]
    mean_only = skeleton(measured[0]).startswith("# ±") and (
        RANGE in new[0] or (doc is not None and skeleton(doc) == "#"))
    if mean_only:
        return new[0]
    it = iter(new)
    return TOKEN.sub(lambda m: next(it), measured[0])
