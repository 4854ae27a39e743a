"""Documented tables agree with what their commands print, on every BLAS kernel.

Every table in README.md or docs/*.md preceded by ``<!-- readme-check: COMMAND -->`` is checked:
COMMAND (an ``experiments/*.py`` invocation, CI-cheap) is run with ``--out TMP --no-plot`` appended
and one BLAS thread, the first table of the ``table.md`` it writes is parsed, and every documented
cell is compared with the cell of the same row (method label) and column (header) there.  A
documented row or column the command does not print fails.

The comparison allows for the spread the same command shows across BLAS kernel types, as measured
by ``python scripts/kernel_spread.py`` and recorded in ``tests/data/kernel_spread.json`` (rules in
``tests/readme_check.py``): a documented number must hold for every measured kernel (a number that
moves is printed with the precision it holds, or as a range ``a…b``), and this run's number must lie
within it, widened by one measured spread on each side.  Numbers that never move (Identity, closed
form, R_ill only, ...) are compared to their last printed digit.  The kernel is whatever
OpenBLAS picks here, or ``OPENBLAS_CORETYPE`` (``.ci/run`` runs this file under two other types).
"""
from __future__ import annotations

import json

import pytest

from tests import readme_check as rc
from tests.readme_check import (claims, compare_cell, compare_tables, covers, parse_table, skeleton,
                                stable_cell, stable_token, unit, within)

MARKED = rc.marked_tables()


def _blas() -> str:
    try:
        import threadpoolctl
        return ", ".join(f"{i.get('internal_api')} {i.get('architecture')}"
                         for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas")
    except ImportError:  # pragma: no cover - threadpoolctl ships with the project's requirements
        return "unknown"


def test_documents_have_checked_tables():
    # The README's headline table and docs/results.md's House Prices (paper protocol) and MNIST tables.
    files = [p.relative_to(rc.ROOT).as_posix() for p, _, _ in MARKED]
    assert len({c for _, c, _ in MARKED}) >= 2, f"<!-- readme-check: ... --> markers lost: {files}"
    assert "README.md" in files and files.count("docs/results.md") >= 2, files


def test_spread_file_covers_every_marked_command():
    """The spread file is re-made whenever a marked command is added or changed."""
    spread = rc.load_spread()
    missing = [c for c in rc.marked_commands() if c not in spread["commands"]]
    assert not missing, f"not in {rc.SPREAD_FILE.name}: {missing}; run python scripts/kernel_spread.py"
    for cmd, rec in spread["commands"].items():
        kinds = {r["architecture"] for r in rec["runs"]}
        assert len(kinds) >= 3, f"{cmd!r} measured under fewer than three kernel types: {sorted(kinds)}"


@pytest.mark.parametrize("doc, command, line", MARKED,
                         ids=[f"{p.name}:{i + 1}:{c}" for p, c, i in MARKED])
def test_documented_table_matches_command(doc, command, line, tmp_path):
    measured = rc.measured_cells(rc.load_spread(), command)
    assert measured is not None, \
        f"{command!r} is not in {rc.SPREAD_FILE.name}; run python scripts/kernel_spread.py"
    proc = rc.run_command(command, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = rc.printed_table(tmp_path)
    documented = parse_table(doc.read_text(encoding="utf-8").splitlines(), line + 1)
    problems = compare_tables(documented, printed, measured)
    assert not problems, (f"{doc.name} line {line + 1} ({command}; BLAS: {_blas()}):\n" + "\n".join(problems)
                          + "\n(python scripts/kernel_spread.py --tables prints the table in a format that "
                            "holds on every measured kernel)")


# ---------------------------------------------------------------- the comparison rules

def test_units_and_claims():
    assert unit("720") == 1 and unit("0.0223") == 1e-4 and unit("4.091e+06") == 1e3
    assert unit("2.0e-05") == 1e-6 and unit("∞") == 0
    assert claims("2261 ± 720") == [(2260.5, 2261.5), (719.5, 720.5)]
    assert claims("292.7…299.1") == [pytest.approx((292.65, 299.15))]
    assert claims("0.710 → 0.715") == [pytest.approx((0.7095, 0.7105)), pytest.approx((0.7145, 0.7155))]
    assert skeleton("2.2…16 ± 1.1") == skeleton("16.05 ± 28") == "# ± #"
    assert skeleton("0/5") == "#/#" and skeleton("—") == "—"


def test_rule_a_documented_number_holds_on_every_kernel():
    assert covers(claims("1.30")[0], 1.301, 1.302)
    assert not covers(claims("1.301")[0], 1.301, 1.302)      # one kernel's last digit
    assert covers(claims("292.7…299.1")[0], 292.7, 299.1)
    assert not covers(claims("292.7…298")[0], 292.7, 299.1)
    # a number that never moves: every digit, or fewer, but not other ones
    assert compare_cell("0.025", "0.02535", ["0.02535"] * 3) is None
    assert compare_cell("0.026", "0.02535", ["0.02535"] * 3) is not None
    assert compare_cell("2262", "2261", ["2261"] * 3) is not None             # another last digit
    # the README's old Opt κ cell, 2.218 ± 1.1, on kernels printing 2.218 ± 1.1 and 16.05 ± 28
    why = compare_cell("2.218 ± 1.1", "2.218 ± 1.1", ["2.218 ± 1.1", "16.05 ± 28"])
    assert why is not None and "does not hold across kernels" in why
    assert compare_cell("2.2…16 ± 1.1…28", "2.218 ± 1.1", ["2.218 ± 1.1", "16.05 ± 28"]) is None
    assert compare_cell("2.2…16", "16.05 ± 28", ["2.218 ± 1.1", "16.05 ± 28"]) is None   # mean only


def test_rule_b_printed_number_within_claim_and_margin():
    measured = ["292.7 ± 9", "299.1 ± 5.3"]                    # spread 6.4 of the mean
    doc = "292.7…299.1 ± 5.3…9"
    assert compare_cell(doc, "299.1 ± 5.3", measured) is None
    assert compare_cell(doc, "305 ± 5.3", measured) is None      # within one spread (6.4) beyond 299.1
    why = compare_cell(doc, "306.5 ± 5.3", measured)
    assert why is not None and "outside" in why
    assert within((292.65, 299.15), "305.5", 6.4) and not within((292.65, 299.15), "306.1", 6.4)
    # no measured spread: no margin (counts and deterministic rows agree exactly)
    assert compare_cell("5/5", "4/5", ["5/5"] * 4) is not None
    assert compare_cell("1 ± 0", "1 ± 0", ["1 ± 0"] * 4) is None


def test_text_and_structure():
    assert compare_cell("—", "—", ["—"]) is None
    assert compare_cell("—", "n/a", ["n/a"]) is not None
    assert compare_cell("1.293e-04", "1.293e-04 ± 0", ["1.293e-04 ± 0"]) is None   # mean only
    assert compare_cell("1 ± 0 ± 0", "1 ± 0", ["1 ± 0"]) is not None
    why = compare_cell("1", "1", ["1", "n/a"])
    assert why is not None and "different text" in why


def test_tables_need_a_measurement_for_every_cell():
    t = (["method", "RIR ↑"], {"Ours (Alg. 1)": ["Ours (Alg. 1)", "2261 ± 720"]})
    assert compare_tables(t, t) == []
    assert compare_tables(t, t, {"Ours (Alg. 1)": {"RIR ↑": ["2261 ± 720"] * 3}}) == []
    problems = compare_tables(t, t, {})
    assert len(problems) == 1 and "no cross-kernel measurement" in problems[0]
    assert compare_tables((["method", "x"], {}), t) == ["column 'x' is not printed by the command"]
    assert "row 'A'" in compare_tables((["method", "RIR ↑"], {"A": ["A", "1"]}), t)[0]


def test_stable_format_passes_rule_a():
    assert stable_token(["1.301", "1.302"]) == "1.30"
    assert stable_token(["292.7", "299.1"]) == "292.7…299.1"
    assert stable_token(["6.794e-07", "6.790e-07", "6.796e-07"]) == "6.8e-07"
    assert stable_token(["157.9", "157.8"]) == "158"
    assert stable_token(["288.1", "294.1"]) == "288.1…294.1"             # not 2.9e+02
    assert stable_token(["0", "0.001"]) == "0…0.001"
    assert stable_token(["0.2", "0.2079", "0.206"]) == "0.2000…0.2079"       # %g dropped the zeros
    cells = ["2.218 ± 1.1", "16.05 ± 28", "5.17 ± 7.0"]
    assert stable_cell(cells) == "2.218…16.05"                  # the mean moves: its range alone
    assert stable_cell(["1.302 ± 0.028", "1.301 ± 0.019"]) == "1.30 ± 0.019…0.028"
    assert stable_cell(["1 ± 0"] * 3) == "1 ± 0" and stable_cell(["1 ± 0"] * 3, doc="1") == "1"
    for cells in (["2.218 ± 1.1", "16.05 ± 28"], ["0.004349 ± 5.3e-05", "0.00445 ± 6.2e-05"],
                  ["4/5", "5/5"], ["0.710 → 0.715", "0.710 → 0.720"], ["1.302 ± 0.028", "1.301 ± 0.019"]):
        s = stable_cell(cells)
        for c in cells:
            assert compare_cell(s, c, cells) is None, (s, c)


def test_markers_and_tables_in_documents(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "intro\n<!-- readme-check: python experiments/x.py --a 1 -->\n\n"
        "| method | v |\n|---|---|\n| **A** | 1 |\n\nafter\n", encoding="utf-8")
    (tmp_path / "docs" / "results.md").write_text("<!-- readme-check: python experiments/y.py -->\n"
                                                  "| method | v |\n|---|---|\n| B | 2 |\n", encoding="utf-8")
    marked = rc.marked_tables(tmp_path)
    assert [(p.name, c, i) for p, c, i in marked] == [("README.md", "python experiments/x.py --a 1", 1),
                                                       ("results.md", "python experiments/y.py", 0)]
    lines = (tmp_path / "README.md").read_text(encoding="utf-8").splitlines()
    assert parse_table(lines, 2) == (["method", "v"], {"A": ["A", "1"]})
    with pytest.raises(ValueError, match="experiments/"):
        rc.check_argv("python -c 'import os'")


def test_measured_cells_from_spread_file(tmp_path):
    spread = {"kernels": [], "commands": {"python experiments/x.py": {"runs": [
        {"kernel": "native", "architecture": "A", "header": ["method", "v"], "rows": {"A": ["A", "1.0"]}},
        {"kernel": "Haswell", "architecture": "B", "header": ["method", "v"], "rows": {"A": ["A", "1.1"]}}]}}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(spread), encoding="utf-8")
    m = rc.measured_cells(rc.load_spread(path), "python experiments/x.py")
    assert m == {"A": {"v": ["1.0", "1.1"]}}
    assert rc.measured_cells(spread, "python experiments/z.py") is None
