"""A table of the user's own (pycore.data.load_table): splits, inputs, empty cells, absurd
cells, bad arguments named, and bounded memory on large files."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from pycore import OutlierWarning, ParameterError, limits, rir_ceiling
from pycore.data import INPUTS, default_path, load_house_price, load_table
from tests.helpers import added_peak_rss


def _csv(path, header, rows):
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
    return _csv(tmp_path_factory.mktemp("t") / "small.csv", ["x", "y", "c", "g", "t"], rows), rows


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
    p = _csv(tmp_path / "p.csv", header, [r for r in rows if r[3] == "a"])
    h = _csv(tmp_path / "h.csv", header, [r for r in rows if r[3] == "b"])
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
            _csv(tmp_path / "bad.csv", list("abgt"), rows), target_p="t", split="g=1", n_train=3
        )
    # every input constant on D_H's rows
    flat_h = [[7 if i % 2 else i, i % 2, i] for i in range(12)]
    with pytest.raises(ValueError, match="c.csv.*D_H"):
        load_table(
            _csv(tmp_path / "c.csv", list("agt"), flat_h), target_p="t", split="g=1", n_train=3
        )


def test_absurd_cell_warns_or_refuses_naming_column_and_line(tmp_path):
    rows = [[i % 5 + 1, i % 2, i] for i in range(30)]
    rows[4][0] = "1e308"
    p = _csv(tmp_path / "abs.csv", ["a", "g", "t"], rows)
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
        p = _csv(tmp_path / "o.csv", ["a", "b", "g", "t"], rows)
        if line is None:
            load_table(p, target_p="t", split="g=1", n_train=2, on_outlier="error")
        else:
            with pytest.raises(ValueError, match=f"'a'.*line {line}"):
                load_table(p, target_p="t", split="g=1", n_train=2, on_outlier="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutlierWarning)
        load_house_price()


def test_sizes_that_cannot_fit_are_refused_up_front_naming_them(monkeypatch):
    monkeypatch.setattr(limits, "MAX_DENSE_BYTES", 1 << 16)
    with pytest.raises(ValueError, match=f"{default_path()}.*1460 × 79"):
        load_house_price()
    monkeypatch.setattr(limits, "MAX_DENSE_BYTES", 1 << 20)
    X = np.random.default_rng(0).standard_normal((5000, 40))  # its U alone would be 5000 × 40
    with pytest.raises(ValueError, match="5000 × 40"):
        rir_ceiling(X, X[:100])


def test_a_tall_csv_loads_in_a_small_multiple_of_its_size(tmp_path):
    """A 200 MB Kaggle-shaped CSV took 2.5 GB (12× the file; 3.7 GB through house_price.py): every
    text cell a Python string, every numeric column float64 before any input was chosen.  Here 40×
    the Kaggle rows (18 MB); the peak RSS the load adds must stay under 6× the file (measured:
    3.6×, the old loader 13×)."""
    lines = default_path().read_text().splitlines()
    p = tmp_path / "tall.csv"
    p.write_text("\n".join([lines[0], *(lines[1:] * 40)]) + "\n")
    added, rows = added_peak_rss(
        "import pandas, numpy\nfrom pycore.data.table import load_table",
        "(lambda d: d.n_rows_P + d.n_rows_H)(load_table(sys.argv[1], target_p='LotArea', "
        f"target_h='SalePrice', inputs={INPUTS!r}, split='MSZoning=RL', on_outlier='ignore'))",
        str(p),
    )
    assert int(rows) == 40 * 1460 and added < 6 * p.stat().st_size
