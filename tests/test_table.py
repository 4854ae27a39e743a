"""A CSV table of one's own (:func:`pycore.data.load_table`): splits, inputs, empty cells, what
a cell may hold, what is changed and said, bad arguments and files named (every problem of a file
in one error), and bounded memory on large files."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pycore import ParameterError
from pycore._validation import OutlierWarning
from pycore.data import load_house_price, load_table
from pycore.data._csv import read_header
from pycore.data._house_price import INPUTS, default_path
from tests.helpers import added_peak_rss


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


def test_empty_target_cells_are_one_problem_per_file_with_each_splits_first_line(tmp_path):
    """Empty target cells in both splits of one file, rows drawn in a seeded order: the file is
    named once, each split's first empty line (in the file's order) follows, lowest first."""
    empty = {(i, 3): "" for i in (12, 2, 9, 5, 16)}  # D_P (even rows): lines 4, 14, 18; D_H: 7, 11
    path = _csv(tmp_path / "t.csv", rows=30, header="a,b,c,yy,g", cells=empty)
    with pytest.raises(ValueError) as e:
        load_table(path, target_p="yy", split="g=h", n_train=5, rng=np.random.default_rng(3))
    text = str(e.value)
    assert text.count(str(path)) == 1
    lines = [int(w) for w in text.replace(",", " ").replace("(", " ").split() if w.isdigit()]
    assert lines == [4, 7]


# --- a table of numeric, text and group columns --------------------------------------------------


def _table(path, header, rows):
    path.write_text(",".join(header) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """40 rows: numeric x, y (3 cells empty), a text column c, a group column g (a/b), target t."""
    rng = np.random.default_rng(0)
    rows = [
        [
            f"{rng.normal():.6f}",
            "" if i in (3, 17, 30) else f"{rng.normal():.6f}",
            "uvw"[i % 3],
            "ab"[i % 2],
            f"{rng.normal():.6f}",
        ]
        for i in range(40)
    ]
    path = _table(tmp_path_factory.mktemp("t") / "small.csv", ["x", "y", "c", "g", "t"], rows)
    return path, rows


def test_inputs_default_to_the_numeric_columns_and_text_is_label_encoded_when_named(small):
    path, rows = small
    d = load_table(path, target_p="t", split="g=b", n_train=10)
    assert d.feature_names == ["x", "y"] and (d.n_rows_P, d.n_rows_H) == (20, 20)
    assert d.filled == {"P": 1, "H": 2}  # empty y cells of rows 3, 30 (g=b: odd rows)
    x = np.array([float(r[0]) for r in rows if r[3] == "a"])
    assert np.allclose(
        np.r_[d.train.X_P[:, 0], d.heldout.X_P[:, 0]], (x - x.mean()) / x.std(), rtol=1e-12
    )
    d = load_table(path, target_p="t", split="g=b", n_train=10, inputs=["c", "x"])
    # sorted: u < v < w
    codes = np.array(["uvw".index(r[2]) for r in rows if r[3] == "a"], dtype=float)
    assert d.feature_names == ["c", "x"]
    assert np.allclose(
        np.r_[d.train.X_P[:, 0], d.heldout.X_P[:, 0]], (codes - codes.mean()) / codes.std()
    )


def test_two_files_give_the_same_tasks_as_a_split_column(small, tmp_path):
    path, rows = small
    header = ["x", "y", "c", "g", "t"]
    p = _table(tmp_path / "p.csv", header, [r for r in rows if r[3] == "a"])
    h = _table(tmp_path / "h.csv", header, [r for r in rows if r[3] == "b"])
    a = load_table(path, target_p="t", split="g=b", n_train=10, inputs=["x", "y", "c"])
    b = load_table(p, target_p="t", harmful_path=h, n_train=10, inputs=["x", "y", "c"])
    for part in ("train", "heldout"):
        for k in ("X_P", "Y_P", "X_H", "Y_H"):
            assert np.array_equal(getattr(getattr(a, part), k), getattr(getattr(b, part), k))
    assert str(p) in b.source and str(h) in b.source


def test_rng_draws_the_training_rows(small):
    path, _ = small
    kw = dict(target_p="t", split="g=b", n_train=10)
    first, a, b = (
        load_table(path, **kw, rng=s and np.random.default_rng(s)) for s in (None, 3, 3)
    )
    assert np.array_equal(a.train.X_P, b.train.X_P) and not np.array_equal(
        a.train.X_P, first.train.X_P
    )
    assert np.allclose(*(np.sort(np.r_[d.train.Y_P, d.heldout.Y_P], 0) for d in (a, first)))


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(target_p="nope", split="g=b"), "target_p"),
        (dict(target_p="t", target_h="nope", split="g=b"), "target_h"),
        (dict(target_p="t", split="g"), "split"),
        (dict(target_p="t", split="nope=1"), "split"),
        (dict(target_p="t"), "split"),
        (dict(target_p="t", split="g=b", harmful_path="x.csv"), "split"),
        (dict(target_p="t", split="g=b", inputs=["x", "t"]), "inputs"),
        (dict(target_p="t", split="g=b", inputs=["x", "x"]), "inputs"),
        (dict(target_p="t", split="g=b", inputs=["nope"]), "inputs"),
        (dict(target_p="t", split="g=b", n_train=0), "n_train"),
        (dict(target_p="t", split="g=b", rng=0), "rng"),
        (dict(target_p="t", split="g=b", on_outlier="no"), "on_outlier"),
    ],
)
def test_bad_arguments_are_named(small, kw, param):
    with pytest.raises(ParameterError) as e:
        load_table(small[0], **{"n_train": 10, **kw})
    assert e.value.parameter == param


def test_bad_data_names_file_column_and_line(tmp_path):
    rows = [[i, i * 2.5, i % 2, 1.5 * i] for i in range(12)]
    rows[3][1] = "lots"  # a corrupt numeric input column
    with pytest.raises(ValueError, match="bad.csv.*'b'.*line 5"):
        load_table(
            _table(tmp_path / "bad.csv", list("abgt"), rows), target_p="t", split="g=1", n_train=3
        )
    # every input constant on D_H's rows
    flat_h = [[7 if i % 2 else i, i % 2, i] for i in range(12)]
    with pytest.raises(ValueError, match="c.csv.*D_H"):
        load_table(
            _table(tmp_path / "c.csv", list("agt"), flat_h), target_p="t", split="g=1", n_train=3
        )


def test_absurd_cell_warns_or_refuses_naming_column_and_line(tmp_path):
    rows = [[i % 5 + 1, i % 2, i] for i in range(30)]
    rows[4][0] = "1e308"
    p = _table(tmp_path / "abs.csv", ["a", "g", "t"], rows)
    with pytest.warns(OutlierWarning, match="abs.csv.*'a'.*line 6") as rec:
        load_table(p, target_p="t", split="g=1", n_train=5)
    assert len([w for w in rec if issubclass(w.category, OutlierWarning)]) == 1
    with pytest.raises(ValueError, match="'a'.*line 6"):
        load_table(p, target_p="t", split="g=1", n_train=5, on_outlier="error")


def test_outlier_rule_and_the_real_file(tmp_path):
    """A cell counts as an outlier beyond 1e6 × the median magnitude of its column's nonzero
    cells, either sign; a column of one nonzero cell has no scale to be beyond."""
    base = [0, 0, 4.0, 4.0, 3.0, 5.0, 0.0]  # median of the nonzero cells: 4
    for column, line in (
        (base, None),
        (base + [4e6], None),  # 1e6 × the median: not above
        (base + [-4.1e6], 9),  # the 8th row, line 9 of the file
        ([0.0] * 6 + [1e300, 0.0], None),
    ):
        rows = [[v, (i * 7) % 5 + 1, i % 2, i + 1] for i, v in enumerate(column)]
        p = _table(tmp_path / "o.csv", ["a", "b", "g", "t"], rows)
        if line is None:
            load_table(p, target_p="t", split="g=1", n_train=2, on_outlier="error")
        else:
            with pytest.raises(ValueError, match=f"'a'.*line {line}"):
                load_table(p, target_p="t", split="g=1", n_train=2, on_outlier="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutlierWarning)
        load_house_price()


def test_a_tall_csv_loads_in_a_small_multiple_of_its_size(tmp_path):
    """40× the Kaggle rows (18 MB): the peak RSS the load adds stays under 6× the file (measured:
    3.6×; a loader that keeps every text cell a Python string and every numeric column float64
    before any input is chosen takes 12-13×)."""
    lines = default_path().read_text().splitlines()
    p = tmp_path / "tall.csv"
    p.write_text("\n".join([lines[0], *(lines[1:] * 40)]) + "\n")
    added, rows = added_peak_rss(
        "import pandas, numpy\nfrom pycore.data import load_table",
        "(lambda d: d.n_rows_P + d.n_rows_H)(load_table(sys.argv[1], target_p='LotArea', "
        f"target_h='SalePrice', inputs={INPUTS!r}, split='MSZoning=RL', on_outlier='ignore'))",
        str(p),
    )
    assert int(rows) == 40 * 1460 and added < 6 * p.stat().st_size


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\n\n",
        b"Id,MSZoning,LotArea,SalePrice\n",
        bytes(range(256)) * 4,
        b"Id;MSZoning;LotArea;SalePrice\n1;RL;8450;208500\n",
        b"a,b,t\n1,2,3\n4,5,6,7\n",
    ],
)
def test_a_malformed_file_is_refused_naming_the_file(tmp_path, content):
    (tmp_path / "bad.csv").write_bytes(content)
    with pytest.raises(ValueError, match="bad.csv"):
        load_table(tmp_path / "bad.csv", target_p="t", split="a=1")


def test_a_quoted_line_break_in_a_header_is_a_column_name(small, tmp_path):
    path, _ = small
    lines = path.read_text().splitlines()
    p = tmp_path / "q.csv"
    p.write_text('x,"y\nsecond line",c,g,t\n' + "\n".join(lines[1:]) + "\n")
    d = load_table(p, target_p="t", split="g=b", n_train=10)
    assert d.feature_names == ["x", "y\nsecond line"]


def test_cells_near_1e_310_are_z_scored_not_called_nan(tmp_path):
    """Their squares underflow: a std computed on them directly is 0."""
    rng = np.random.default_rng(0)
    x = [float(v) * 1e-310 for v in rng.normal(size=40)]
    p = tmp_path / "tiny.csv"
    p.write_text(
        "x,z,g,t\n"
        + "".join(
            f"{v!r},{rng.normal():.6f},{'ab'[i % 2]},{rng.normal():.6f}\n" for i, v in enumerate(x)
        )
    )
    d = load_table(p, target_p="t", split="g=b", n_train=10)
    got = np.r_[d.train.X_P[:, 0], d.heldout.X_P[:, 0]]
    a = np.array(x[::2]) * 1e300 * 1e10  # D_P: the rows with g = a
    assert np.allclose(got, (a - a.mean()) / a.std(), atol=1e-9)


@pytest.mark.parametrize("split", ["P", "H"])
def test_a_target_constant_on_a_splits_training_rows_is_refused_naming_it(tmp_path, split):
    """A constant target leaves nothing to fit or probe; one varying only in the held-out rows
    is as constant where it is trained on."""
    rows = range(1, 40, 2) if split == "H" else range(0, 40, 2)  # g = h on the odd rows
    path = _csv(tmp_path / "t.csv", cells={(r, 3): "7" for r in list(rows)[:10]})
    with pytest.raises(ValueError) as e:
        _load(path)
    assert not isinstance(e.value, ParameterError)
    assert str(path) in str(e.value) and "'y'" in str(e.value) and f"D_{split}" in str(e.value)
    _load(path, n_train=11)  # the 11th training row varies


def test_the_split_column_as_an_input_is_said(tmp_path):
    """Constant on D_H (0 after z-scoring), it informs D_P alone: said, not refused (the paper's
    House Prices inputs hold MSZoning, its split column)."""
    path = _csv(tmp_path / "t.csv", header="a,b,c,y,g")
    named = _load(path, inputs=["a", "g"])
    assert named.split_input and named.changes()["split_column_is_an_input"]
    assert "'g'" in named.changes_line()
    assert np.all(named.train.X_H[:, 1] == 0)  # constant on D_H
    for data in (_load(path), _load(path, inputs=["a", "b"])):
        assert not data.split_input and data.changes_line() is None
    assert load_house_price().split_input
