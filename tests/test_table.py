"""A CSV table of one's own (pycore/data/_table.py): what a cell may hold, what is changed and
said, and every problem of a file in one error."""

from __future__ import annotations

import numpy as np
import pytest

from pycore import ParameterError
from pycore.data import load_table, read_header


def _csv(path, rows=40, *, header="a,b,c,y,g", cells=None):
    """A table with inputs a, b, c, target y and split column g (p/h alternating); ``cells``
    maps (row, column index) to the text of that cell."""
    rng = np.random.default_rng(0)
    lines = [header]
    for i in range(rows):
        row = [f"{v:.4f}" for v in rng.standard_normal(4)] + ["h" if i % 2 else "p"]
        for (r, c), text in (cells or {}).items():
            if r == i:
                row[c] = text
        lines.append(",".join(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def _load(path, **kw):
    return load_table(path, target_p="y", split="g=h", **{"n_train": 10, **kw})


@pytest.mark.parametrize("text", ["nan", "NaN", "-nan", "inf", "-Infinity"])
def test_a_non_finite_cell_is_refused_as_the_file_says(tmp_path, text):
    with pytest.raises(ValueError):
        _load(_csv(tmp_path / "t.csv", cells={(3, 0): text}))


@pytest.mark.parametrize("text", ["", "NA", "N/A", "NULL"])
def test_an_empty_or_missing_mark_cell_is_filled_with_zero_and_counted(tmp_path, text):
    data = _load(_csv(tmp_path / "t.csv", cells={(3, 0): text}))
    assert data.missing == {"a": 1} and data.changes()["missing_cells_filled_with_0"] == {"a": 1}


@pytest.mark.parametrize("header", ["a,,c,y,g", "a, ,c,y,g", "a,b,c,y,g,"])
def test_a_column_without_a_name_is_refused(tmp_path, header):
    path = _csv(tmp_path / "t.csv", header=header)
    with pytest.raises(ValueError):
        read_header(path)
    with pytest.raises(ValueError):
        _load(path)


def test_rows_with_an_empty_split_cell_are_counted_in_dp(tmp_path):
    data = _load(_csv(tmp_path / "t.csv", cells={(5, 4): "", (8, 4): ""}))
    assert (data.n_rows_P, data.n_rows_H, data.blank_split) == (21, 19, 2)  # row 5 was in D_H
    assert data.changes()["empty_split_cells_in_D_P"] == 2 and "'g'" in data.changes_line()
    assert _load(_csv(tmp_path / "u.csv")).changes()["empty_split_cells_in_D_P"] == 0


def test_every_problem_of_the_splits_and_targets_is_one_error(tmp_path):
    path = _csv(tmp_path / "t.csv", rows=30, header="a,b,c,yy,g", cells={(4, 3): ""})
    with pytest.raises(ParameterError) as e:  # both splits below n_train, and an empty target
        load_table(path, target_p="yy", split="g=h", n_train=200)
    assert e.value.parameter == "n_train" and "'yy'" in str(e.value)
    with pytest.raises(ValueError) as e:  # the target alone once n_train fits
        load_table(path, target_p="yy", split="g=h", n_train=10)
    assert not isinstance(e.value, ParameterError) and "'yy'" in str(e.value)
