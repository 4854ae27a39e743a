"""Documented tables agree with what their commands print, on every BLAS kernel (the rule:
tests/readme_check.py).  ``.ci/run`` runs this file under two other ``OPENBLAS_CORETYPE`` types
too."""

from __future__ import annotations

import json
import os

import pytest

from tests import readme_check as rc
from tests.readme_check import compare_cell, compare_tables, parse_tables

SECTIONS = rc.marked_sections()
COMMANDS = rc.marked_commands()


def test_documents_have_checked_tables():
    files = [p.relative_to(rc.ROOT).as_posix() for p, _, _, _ in SECTIONS]
    assert "README.md" in files and files.count("docs/results.md") >= 2, files
    assert all(tables for _, _, _, tables in SECTIONS), (
        "a readme-check marker with no table after it"
    )


def test_spread_file_measures_every_marked_command_on_four_kernels():
    spread = rc.load_spread()
    assert spread["tool"] == "python scripts/kernel_spread.py" and spread["threads"] == 1
    missing = [c for c in COMMANDS if c not in spread["commands"]]
    assert not missing, (
        f"not in {rc.SPREAD_FILE.name}: {missing}; run python scripts/kernel_spread.py"
    )
    for cmd, rec in spread["commands"].items():
        kinds = {r["architecture"] for r in rec["runs"]}
        assert len(kinds) >= 4 and rec["runs"][0]["kernel"] == "native", (cmd, sorted(kinds))


@pytest.mark.parametrize("command", COMMANDS)
def test_documented_tables_match_command(command, tmp_path):
    """The command's tables now, under this run's kernel, against every table a marker gives it;
    then the same comparison must refuse one documented number moved beyond the rule."""
    measured = rc.measured_cells(rc.load_spread(), command)
    assert measured is not None, f"{command!r} not measured; run python scripts/kernel_spread.py"
    proc = rc.run_command(command, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = rc.printed_tables(tmp_path)
    for doc, line, cmd, tables in SECTIONS:
        if cmd != command:
            continue
        assert len(tables) <= len(printed), (
            f"{doc.name}:{line + 1}: more tables than {command!r} prints"
        )
        for k, table in enumerate(tables):
            problems = compare_tables(table, printed[k], measured[k])
            kernel = os.environ.get("OPENBLAS_CORETYPE", "native")
            assert not problems, (
                f"{doc.name} line {line + 1}, table {k + 1} ({command}; kernel {kernel}):\n"
                + "\n".join(problems)
            )
            header, rows = table
            label, cells = next(iter(rows.items()))
            wrong = {
                **rows,
                label: [label, _beyond(cells[1], measured[k][label][header[1]]), *cells[2:]],
            }
            assert compare_tables((header, wrong), printed[k], measured[k]), (
                f"{doc.name}: {label} wrong"
            )


def _beyond(cell: str, measured: list[str]) -> str:
    """``cell`` with its first number moved past the rule: by the measured spread plus one unit."""
    lo, hi = rc.measured_range(measured)[0]
    token = rc.NUMBER.search(cell).group()
    return cell.replace(
        token, repr(rc.value(token) + (hi - lo) + 10**-6 * (1 + abs(rc.value(token)))), 1
    )


# ---------------------------------------------------------------- the rule, on known cells

STILL = ["2261 ± 720"] * 5  # never moved: every digit must match
# strict IMMA (i)
MOVING = ["1652 ± 1000", "2163 ± 1900", "2085 ± 1800", "3139 ± 3900", "1529 ± 840"]


def test_a_number_that_never_moved_must_match_to_the_last_digit():
    assert compare_cell("2261 ± 720", "2261 ± 720", STILL) is None
    for wrong in ("2262 ± 720", "2261 ± 721", "2261.0 ± 720", "2261 ± 720 (1/5)"):
        assert compare_cell("2261 ± 720", wrong, STILL) is not None, wrong
    assert compare_cell("2262 ± 720", "2262 ± 720", STILL) is not None  # not what was measured
    assert (
        compare_cell("5/5", "4/5", ["5/5"] * 4) is not None
        and compare_cell("—", "n/a", ["—"]) is not None
    )


def test_a_number_that_moves_is_accepted_within_its_measured_spread_only():
    # the mean moved over 1529 … 3139 (spread 1610), the std over 840 … 3900 (spread 3060)
    assert compare_cell("1652 ± 1000", "3139 ± 3900", MOVING) is None
    # an unmeasured kernel, 1610 off
    assert compare_cell("1652 ± 1000", "3262 ± 1000", MOVING) is None
    assert compare_cell("1652 ± 1000", "3263 ± 1000", MOVING) is not None  # 1611 off
    assert compare_cell("1652 ± 1000", "1652 ± 4061", MOVING) is not None
    # documented below all measured
    assert compare_cell("1500 ± 1000", "1652 ± 1000", MOVING) is not None
    # measured elsewhere
    assert compare_cell("1652 ± 1000", "1652 ± 1000", MOVING[1:2] * 3) is not None
    assert compare_cell("1652", "1652 ± 1000", MOVING) is not None
    assert (
        compare_cell("∞", "∞", ["∞"] * 3) is None
        and compare_cell("∞", "1e+308", ["∞"] * 3) is not None
    )


def test_tables_match_by_row_label_and_column_header():
    header = ["method", "RIR ↑", "Def. 3.1 seeds"]
    printed = (
        header,
        {"Ours": ["Ours", "2261 ± 720", "5/5"], "Identity": ["Identity", "1 ± 0", "0/5"]},
    )
    measured = {
        "Ours": {"RIR ↑": STILL, "Def. 3.1 seeds": ["5/5"]},
        "Identity": {"RIR ↑": ["1 ± 0"]},
    }
    doc = (["method", "RIR ↑"], {"Ours": ["Ours", "2261 ± 720"]})  # a subset of rows and columns
    assert compare_tables(doc, printed, measured) == []
    wrong = (["method", "RIR ↑"], {"Ours": ["Ours", "2262 ± 720"]})
    assert len(compare_tables(wrong, printed, measured)) == 1
    assert compare_tables((["method", "x"], {}), printed, measured) == [
        "column 'x' is not printed"
    ]
    unknown = (["method", "RIR ↑"], {"A": ["A", "1"]})
    assert compare_tables(unknown, printed, measured) == ["row 'A' is not printed"]
    why = compare_tables((header, {"Identity": ["Identity", "1 ± 0", "0/5"]}), printed, measured)
    assert len(why) == 1 and "kernel_spread" in why[0]  # a cell that was never measured


def test_markers_cover_the_tables_up_to_the_next_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "intro\n<!-- readme-check: python experiments/x.py --a 1 -->\n\n| method | v "
        "|\n|---|---|\n"
        "| **A** | `1` |\n\ntext\n\n| method | w |\n| --- | --- |\n| B | 2 |\n"
        "## next\n| c | d |\n|---|---|\n",
        encoding="utf-8",
    )
    (tmp_path / "docs" / "results.md").write_text(
        "<!-- readme-check: python experiments/y.py -->\n", encoding="utf-8"
    )
    sections = rc.marked_sections(tmp_path)
    assert [(p.name, i, c) for p, i, c, _ in sections] == [
        ("README.md", 1, "python experiments/x.py --a 1"),
        ("results.md", 0, "python experiments/y.py"),
    ]
    assert sections[0][3] == [
        (["method", "v"], {"A": ["A", "1"]}),
        (["method", "w"], {"B": ["B", "2"]}),
    ]
    assert sections[1][3] == [] and rc.marked_commands(tmp_path)[1] == "python experiments/y.py"
    with pytest.raises(ValueError, match="experiments/"):
        rc.run_command("python -c 'import os'", tmp_path)


def test_measured_cells_per_table_row_and_column(tmp_path):
    run = lambda kernel, v: {
        "kernel": kernel,
        "architecture": kernel,  # noqa: E731
        "tables": [[["method", "v"], {"A": ["A", v]}], [["m", "w"], {"B": ["B", "0"]}]],
    }
    path = tmp_path / "s.json"
    path.write_text(
        json.dumps(
            {"commands": {"python experiments/x.py": {"runs": [run("n", "1.0"), run("H", "1.1")]}}}
        )
    )
    m = rc.measured_cells(rc.load_spread(path), "python experiments/x.py")
    assert m == [{"A": {"v": ["1.0", "1.1"]}}, {"B": {"w": ["0", "0"]}}]
    assert rc.measured_cells({"commands": {}}, "python experiments/z.py") is None
    assert parse_tables(["| a |", "| b |"]) == []  # rows without a separator are no table


def test_results_md_is_the_tables_of_the_outputs_and_check_sees_a_change(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "results_md", rc.ROOT / "scripts" / "results_md.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    (tmp_path / "docs").mkdir()
    (tmp_path / "results" / "house_price").mkdir(parents=True)
    (tmp_path / "results" / "house_price" / "table.md").write_text(
        "# Title\n\nLegend naming /a/local/path.\n\n| method | v |\n|---|---|\n| A | 1 ± 0 |\n\n"
        "Caption of the second table.\n\n| method | w |\n|---|---|\n| A | 2 |\n\nWall time 3 s.\n"
    )
    assert gen.main([], root=tmp_path) == 0
    text = (tmp_path / "docs" / "results.md").read_text()
    lines = text.splitlines()
    i = lines.index("<!-- readme-check: python experiments/house_price.py -->")
    assert lines[i + 1 : i + 9] == [
        "| method | v |",
        "|---|---|",
        "| A | 1 ± 0 |",
        "",
        "Caption of the second table.",
        "",
        "| method | w |",
        "|---|---|",
    ]
    assert "/a/local/path" not in text and "Wall time" not in text and "Title" not in text
    assert text.count("Not run yet") == len(gen.EXPERIMENTS) - 1
    assert gen.main(["--check"], root=tmp_path) == 0
    table = tmp_path / "results" / "house_price" / "table.md"
    table.rename(tmp_path / "moved.md")  # no output: the section is kept as it was
    assert (
        gen.main([], root=tmp_path) == 0 and (tmp_path / "docs" / "results.md").read_text() == text
    )
    table.write_text("| method | v |\n|--|--|\n| A | 2 ± 0 |\n")
    assert gen.main(["--check"], root=tmp_path) == 1 and "| A | 2 ± 0 |" in capsys.readouterr().err
    assert (tmp_path / "docs" / "results.md").read_text() == text  # --check writes nothing
