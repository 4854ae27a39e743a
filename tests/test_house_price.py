"""House Prices data, the main experiment end to end, and the same command on a table of one's
own."""

from __future__ import annotations

import os

import numpy as np
import pytest

from experiments import house_price
from pycore import ParameterError, evaluate_linear, immunize, limits, rir, rir_ceiling
from pycore._validation import OutlierWarning
from pycore.data import load_house_price, load_table
from pycore.data._house_price import default_path
from pycore.report import pm, read_json
from tests.cli_helpers import call, one_line
from tests.helpers import fifo


@pytest.fixture(scope="module")
def data():
    return load_house_price()


def test_protocol_shapes_and_spectra(data):
    """docs/theory.md §9/§10 facts: 79 inputs, 200 rows per split, κ(K_P)=7.7e3, κ(K_H)=2.1e5,
    ranks 74."""
    t = data.train
    assert t.X_P.shape == (200, 79) and t.X_H.shape == (200, 79)
    assert (data.n_rows_P, data.n_rows_H) == (309, 1151)
    assert data.heldout.X_P.shape == (109, 79) and data.heldout.X_H.shape == (951, 79)
    c = rir_ceiling(t.X_P, t.X_H)
    assert c.kappa_K_P == pytest.approx(7.7e3, rel=0.01) and c.kappa_K_H == pytest.approx(
        2.1e5, rel=0.02
    )
    assert c.rank_K_P == 74 and c.rank_K_H == 74 and c.exact == np.inf
    assert c.range_restricted == pytest.approx(4.09e6, rel=0.01)
    for name in ("Utilities", "PoolArea", "PoolQC"):
        j = data.feature_names.index(name)
        assert np.all(t.X_P[:, j] == 0) and np.any(t.X_H[:, j] != 0)


def test_closed_form_reaches_the_ceiling_and_ours_acts_on_null_KP(data):
    """The closed form's RIR is the range-restricted ceiling; for Algorithm 1's θ most of ‖θ − I‖²
    lies in null(K_P) and θ's range part alone gives a far lower RIR (docs/theory.md §8, §10)."""
    t = data.train
    c = rir_ceiling(t.X_P, t.X_H)
    cf = immunize(t, "closed_form", rng=np.random.default_rng(0), preset="house_price")
    assert rir(cf.theta, t.X_P, t.X_H).value / c.range_restricted >= 0.99
    e = evaluate_linear(
        immunize(t, "ours", rng=np.random.default_rng(0), preset="house_price").theta,
        t,
        data.heldout,
        ceiling=c,
    )
    assert e.null_part_fraction > 0.9 and e.train.rir_range_part < 0.1 * e.train.rir


def test_bad_csv_is_refused_naming_the_column(tmp_path, data):
    import pandas as pd

    df = pd.read_csv(data.source)
    # used to become input 80 silently
    cases = {
        "nocol": (df.drop(columns=["SalePrice"]), "SalePrice"),
        "extra": (df.assign(Extra=1.0), "Extra"),
    }
    junk = df.copy()
    junk["GrLivArea"] = junk["GrLivArea"].astype(object)
    junk.loc[7, "GrLivArea"] = "n/a?"
    cases["junk"] = (junk, "GrLivArea")
    inf = df.copy()
    inf.loc[11, "LotFrontage"] = np.inf
    cases["inf"] = (inf, "LotFrontage")
    for name, (frame, column) in cases.items():
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        with pytest.raises(ValueError, match=column):
            load_house_price(tmp_path / f"{name}.csv")


def test_the_experiment_end_to_end(capsys, tmp_path):
    out = tmp_path / "hp"
    methods = ("identity", "opt_kappa", "ours", "closed_form")  # R_ill only and IMMA: 2 s more
    assert (
        house_price.main(
            [
                "--seeds",
                "2",
                "--epochs",
                "2",
                "--probe-steps",
                "5",
                "--jobs",
                "1",
                "--methods",
                ",".join(methods),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = read_json(out / "results.json")
    assert (
        list(res["methods"]) == list(methods) and res["seeds"] == [0, 1] and res["data"]["D"] == 79
    )
    for e in res["methods"].values():
        for split in ("train", "heldout"):
            for key in ("rir", "harmful_ratio", "pretrain_ratio", "rir_null_part"):
                assert len(e[split][key]["per_seed"]) == 2
                assert all(np.isfinite(e[split][key]["per_seed"]))
            assert e[split]["immunized"]["runs"] == 2
    assert res["methods"]["closed_form"]["fraction_of_ceiling"]["mean"] >= 0.99
    assert res["methods"]["ours"]["paper"]["rir"]["mean"] == 356.2
    header = next(
        line for line in (out / "table.md").read_text().splitlines() if line.startswith("| method")
    )
    assert "paper RIR" in header  # the paper's columns, on the paper's data
    assert (out / "norm_ratio.png").stat().st_size > 10_000
    assert "Ours" in capsys.readouterr().out


def test_the_run_speaks_before_loading_and_after_each_batch(capsys, tmp_path, monkeypatch):
    """A line before the data is even read, and one as each batch of runs ends (the main job ran
    silent for 20 s)."""
    from experiments import common

    seen = []  # what stdout held at each step, consumed as it goes
    load, run_batch = common.load_house_price_data, house_price.run_batch

    def spy(name, fn):
        def wrapped(*a, **k):
            seen.append((name, capsys.readouterr().out))
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(common, "load_house_price_data", spy("load", load))
    monkeypatch.setattr(house_price, "run_batch", spy("batch", run_batch))
    argv = ["--seeds", "1", "--methods", "identity,closed_form,ours", "--epochs", "2"]
    argv += ["--probe-steps", "2", "--jobs", "1", "--no-plot", "--out", str(tmp_path / "o")]
    assert house_price.main(argv) == 0
    assert [n for n, _ in seen] == ["load", "batch", "batch", "batch"]
    assert seen[0][1].strip()  # said before the data was read
    assert [len(out.splitlines()) for _, out in seen[2:]] == [1, 1]  # one line per batch ended


def test_presets_and_typed_options_reach_the_library(data, own_csv):
    """The paper's data runs the paper's presets (its tables must not move), a table of one's own
    the library defaults; typed options beat either, method by method."""
    parse = house_price.parse_args
    assert [
        parse(argv).immunizer.preset
        for argv in ([], ["--protocol", "strict"], ["--paper-hparams"])
    ] == ["house_price", "strict", "paper"]
    assert (
        parse(["--data", str(own_csv), "--target-p", "y", "--split", "group=b"]).immunizer.preset
        is None
    )
    run = parse(
        [
            "--protocol",
            "strict",
            "--methods",
            "imma,closed_form",
            "--lr",
            "0.1",
            "--exponent",
            "0.3",
        ]
    )
    assert run.immunizer.given == {"imma": {"lr": 0.1}, "closed_form": {"exponent": 0.3}}
    run = parse(["--methods", "ours", "--init", "random", "--epochs", "0", "--batch-size", "none"])
    # a value
    assert run.immunizer.given == {"ours": {"init": "random", "epochs": 0, "batch_size": None}}
    a, b, c = (
        run.immunizer(data.train, "ours", np.random.default_rng(s)).theta for s in (3, 3, 4)
    )
    assert np.array_equal(a, b) and not np.allclose(a, c)
    # nn.Linear's U(±1/√D), untouched at 0 epochs
    assert np.abs(a).max() <= 1 / np.sqrt(data.train.D)


def test_table_prints_round_off_spread_as_zero():
    assert pm({"mean": 0.02535, "std": 3.5e-18}) == "0.02535 ± 0"
    assert pm({"mean": 2261.0, "std": 720.0}) == "2261 ± 720"


def test_null_share_at_round_off_prints_as_zero():
    cell = house_price.null_share_cell
    assert [cell(3.1e-29), cell(9.469e-4), cell(float("nan"))] == ["0", "9.469e-04", "n/a"]


def test_kernel_dependent_rows_are_those_measured():
    """The † rows: the listed methods on the paper's data under the protocol's own preset, not a
    method given options of its own, not a certified run, not one's own table."""

    def result(protocol="strict", preset="strict", paper=True, certified=False, given=None):
        methods = ["identity", "imma", "opt_kappa", "ours", "closed_form"]
        return {
            "protocol": protocol,
            "data": {"paper": paper},
            "methods": dict.fromkeys(methods),
            "immunize": {"preset": preset, "certified": certified, "given": given or {}},
        }

    marked = house_price.kernel_dependent
    assert marked(result()) == {"imma", "opt_kappa", "ours"}
    assert marked(result("paper", "house_price")) == {"opt_kappa"}
    assert marked(result(given={"imma": {"lr": 0.1}, "ours": {}})) == {"opt_kappa", "ours"}
    assert marked(result(paper=False)) == marked(result(certified=True)) == set()
    assert marked(result("strict", "paper")) == set()


@pytest.fixture(scope="module")
def own_csv(tmp_path_factory):
    """A table the project never saw: 6 numeric inputs, a text column, a group column, two
    targets."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 6)) @ rng.standard_normal((6, 6))
    y, z = X @ rng.standard_normal(6), X @ rng.standard_normal(6)
    path = tmp_path_factory.mktemp("own") / "my data.csv"
    rows = [
        ",".join(f"{v:.6f}" for v in X[i]) + f",{'ab'[i % 2]},{'xyz'[i % 3]},{y[i]:.6f},{z[i]:.6f}"
        for i in range(300)
    ]
    path.write_text("\n".join(["a,b,c,d,e,f,group,note,y,z", *rows]) + "\n")
    return path


@pytest.mark.parametrize("how", ["split", "two files"])
def test_own_table_end_to_end(capsys, tmp_path, own_csv, how):
    argv = [
        "--data",
        str(own_csv),
        "--target-p",
        "y",
        "--target-h",
        "z",
        "--n-train",
        "60",
        "--seeds",
        "1",
        "--methods",
        "identity,closed_form",
        "--probe-steps",
        "3",
        "--jobs",
        "1",
        "--no-plot",
    ]
    if how == "split":
        argv += ["--split", "group=b"]
    else:
        harmful = tmp_path / "dh.csv"
        harmful.write_text(own_csv.read_text())
        argv += ["--harmful-data", str(harmful)]
    assert house_price.main([*argv, "--out", str(tmp_path / "o")]) == 0
    res = read_json(tmp_path / "o" / "results.json")
    assert res["data"]["files"][0] == str(own_csv) and not res["data"]["paper"]
    # the numeric columns; not 'note', nor 'group'
    assert res["data"]["features"] == list("abcdef")
    table = (tmp_path / "o" / "table.md").read_text()
    title, caption = table.splitlines()[0], table.splitlines()[2]
    assert own_csv.name in title and "paper" not in title  # the file, not the paper's protocol
    said = caption.replace(str(own_csv), "").replace(str(tmp_path), "")  # the paths aside
    assert "60" in said  # the training rows: the first --n-train of each split
    assert "paper" not in next(line for line in table.splitlines() if line.startswith("| method"))
    assert "paper" not in res["methods"]["closed_form"]
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--target-p", "nope", "--split", "group=b"], "--target-p"),
        (["--target-p", "y", "--split", "nogroup=b"], "--split"),
        (["--target-p", "y", "--inputs", "a,zz", "--split", "group=b"], "--inputs"),
        (["--target-p", "y"], "--target-p"),  # no split
        (["--split", "group=b"], "--split"),  # no target
        (["--target-p", "y", "--split", "group=b", "--harmful-data", "FILE"], "--harmful-data"),
    ],
)
def test_own_table_flags_are_checked_naming_the_flag(capsys, tmp_path, own_csv, argv, flag):
    argv = [str(own_csv) if a == "FILE" else a for a in argv]
    rc, err = call(
        capsys, house_price, ["--data", str(own_csv), *argv, "--out", str(tmp_path / "o")]
    )
    assert rc == 2 and one_line(err, flag) and not (tmp_path / "o").exists()


def test_an_absurd_cell_is_one_warning_line_or_refused(capsys, tmp_path, own_csv):
    lines = own_csv.read_text().splitlines()
    lines[5] = "1e308," + lines[5].split(",", 1)[1]  # column a, line 6 of the file
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    argv = [
        "--data",
        str(tmp_path / "t.csv"),
        "--target-p",
        "y",
        "--split",
        "group=b",
        "--n-train",
        "60",
        "--seeds",
        "1",
        "--methods",
        "identity",
        "--probe-steps",
        "1",
        "--jobs",
        "1",
        "--no-plot",
    ]
    rc, err = call(capsys, house_price, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 0 and one_line(err, "warning", "'a'")
    rc, err = call(
        capsys, house_price, [*argv, "--on-outlier", "error", "--out", str(tmp_path / "o2")]
    )
    assert rc == 1 and one_line(err, "'a'") and not (tmp_path / "o2").exists()


# --- the House Prices file: what the loader refuses, names or keeps ------------------------------


@pytest.fixture(scope="module")
def hp_lines() -> list[str]:
    return default_path().read_text().splitlines()


def _col(lines, name) -> int:
    return lines[0].split(",").index(name)


def _set_cell(lines, row, name, value) -> list[str]:
    """Data row ``row`` of column ``name`` set to ``value`` (Kaggle's file has no quoted
    commas)."""
    cells = lines[row + 1].split(",")
    cells[_col(lines, name)] = value
    return lines[: row + 1] + [",".join(cells)] + lines[row + 2 :]


def _write(tmp_path, lines, name="train.csv"):
    (tmp_path / name).write_text("\n".join(lines) + "\n")
    return tmp_path / name


def _harmful_rows(lines) -> list[int]:
    return [
        i for i, line in enumerate(lines[1:]) if line.split(",")[_col(lines, "MSZoning")] == "RL"
    ]


def test_a_path_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, monkeypatch, hp_lines):
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_house_price(tmp_path / "missing.csv")
    for path in (
        tmp_path,
        fifo(tmp_path / "fifo.csv"),
        *["/dev/zero"] * os.path.exists("/dev/zero"),
    ):
        with pytest.raises(ValueError, match=str(path)):
            load_house_price(path)
    monkeypatch.setattr(limits, "MAX_DATA_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match="train.csv"):
        load_house_price(_write(tmp_path, hp_lines))


def test_a_wide_header_is_refused_before_pandas_reads(tmp_path, hp_lines, monkeypatch):
    """1,000,000 extra header columns (8.3 MB): pandas pads every row to every declared column,
    so the width is capped on the header line, before pandas is called."""
    p = _write(
        tmp_path, [hp_lines[0] + "".join(f",x{i}" for i in range(1_000_000)), *hp_lines[1:]]
    )
    import pandas as pd

    monkeypatch.setattr(pd, "read_csv", lambda *a, **k: pytest.fail("pandas read a refused file"))
    for load in (
        load_house_price,
        lambda q: load_table(q, target_p="SalePrice", split="MSZoning=RL"),
    ):
        with pytest.raises(ValueError, match=f"{p}.*{limits.MAX_COLUMNS}"):
            load(p)


def test_kaggle_column_set_is_required_and_column_order_is_not(tmp_path, hp_lines):
    """An extra column is refused by name (load_table reads any table), and so is a repeated one
    (pandas would rename a second SalePrice SalePrice.1: an input). The paper's inputs are taken
    in Kaggle's order whatever the file's order."""
    for extra in ("Extra", "SalePrice", "LotShape"):
        lines = [f"{ln},{extra if i == 0 else 1}" for i, ln in enumerate(hp_lines)]
        with pytest.raises(ValueError, match=extra):
            load_house_price(_write(tmp_path, lines))
    drop = _col(hp_lines, "Alley")
    with pytest.raises(ValueError, match="Alley"):
        load_house_price(
            _write(
                tmp_path,
                [",".join(ln.split(",")[:drop] + ln.split(",")[drop + 1 :]) for ln in hp_lines],
            )
        )
    order = np.random.default_rng(0).permutation(len(hp_lines[0].split(",")))
    a = load_house_price()
    b = load_house_price(
        _write(tmp_path, [",".join(np.array(ln.split(","))[order]) for ln in hp_lines])
    )
    assert a.feature_names == b.feature_names
    for part in ("train", "heldout"):
        for k in ("X_P", "Y_P", "X_H", "Y_H"):
            assert np.array_equal(getattr(getattr(a, part), k), getattr(getattr(b, part), k))


@pytest.mark.parametrize("value", ["1e308", "-1e308"])
def test_a_huge_cell_is_not_zeroed_and_other_columns_keep_their_bits(tmp_path, hp_lines, value):
    """One 1e308 cell must not overflow its column's std to inf and zero the whole column."""
    # training row 5 of D_H
    lines = _set_cell(hp_lines, _harmful_rows(hp_lines)[5], "GrLivArea", value)
    with pytest.warns(OutlierWarning, match="GrLivArea"):
        d = load_house_price(_write(tmp_path, lines))
    j = d.feature_names.index("GrLivArea")
    col = np.concatenate([d.train.X_H[:, j], d.heldout.X_H[:, j]])  # the whole split is z-scored
    assert col.mean() == pytest.approx(0.0, abs=1e-9) and col.std() == pytest.approx(1.0, rel=1e-9)
    assert np.sign(d.train.X_H[5, j]) == np.sign(float(value)) and abs(d.train.X_H[5, j]) > 30
    ref = load_house_price()
    assert np.array_equal(np.delete(ref.train.X_H, j, 1), np.delete(d.train.X_H, j, 1))
    assert np.array_equal(ref.train.X_P, d.train.X_P)


@pytest.mark.parametrize(
    "column,value",
    [
        ("LotFrontage", "inf"),
        ("SalePrice", ""),
        ("SalePrice", "inf"),
        ("SalePrice", "-1e999"),
        ("SalePrice", "x"),
        ("GrLivArea", "lots"),
    ],
)
def test_bad_cells_name_column_and_line(tmp_path, hp_lines, column, value):
    row = _harmful_rows(hp_lines)[2]
    with pytest.raises(ValueError, match=f"{column}.*line {row + 2}"):
        load_house_price(_write(tmp_path, _set_cell(hp_lines, row, column, value)))


# --- a table of one's own through the command: what is changed is counted, flags named ----------


def _own_csv(path, n=60, seed=1, *, empty=(3, 10, 11), pid=("1.0", "2.0")):
    """x, y (cells ``empty`` blank), text c, group g, PID stored as floats, target t, 0/1 b."""
    rng = np.random.default_rng(seed)
    lines = ["x,y,c,g,PID,t,b"]
    for i in range(n):
        cells = [
            f"{rng.normal():.6f}",
            "" if i in empty else f"{rng.normal():.6f}",
            "uvw"[i % 3],
            "ab"[i % 2],
            pid[i % 2],
            f"{rng.normal():.6f}",
            str(int(rng.random() > 0.5)),
        ]
        lines.append(",".join(cells))
    path.write_text("\n".join(lines) + "\n")
    return path


def _numeric_csv(path, columns, rows, rng):
    """``columns`` normal inputs c0, c1, …, a group g (a/b alternating) and a normal target t."""
    lines = [",".join(f"c{j}" for j in range(columns)) + ",g,t"]
    for i in range(rows):
        cells = [f"{v:.5f}" for v in rng.normal(size=columns)]
        lines.append(",".join([*cells, "ab"[i % 2], f"{rng.normal():.5f}"]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_hp(capsys, argv):
    return call(capsys, house_price, [*argv, "--seeds", "1", "--no-plot", "--jobs", "1"])


def test_changes_to_ones_data_are_counted_and_recorded(capsys, tmp_path):
    csv_path, out = _own_csv(tmp_path / "own.csv"), tmp_path / "out"
    base = ["--data", str(csv_path), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    rc, err = _run_hp(capsys, [*base, "--methods", "identity", "--out", str(out)])
    assert rc == 0, err
    data = read_json(out / "results.json")["data"]
    assert data["changes"]["missing_cells_filled_with_0"] == {"y": 3}
    assert data["changes"]["dropped_non_numeric_columns"] == ["c"]  # g is the split column
    assert data["changes"]["label_encoded_text_columns"] == []
    # named, the text column is encoded and listed
    argv = [*base, "--inputs", "x,y,c", "--methods", "identity", "--out", str(out)]
    rc, err = _run_hp(capsys, argv)
    assert rc == 0 and read_json(out / "results.json")["data"]["changes"][
        "label_encoded_text_columns"
    ] == ["c"]
    # refused on demand: the file, column and line; the last run's results left as they were
    written = (out / "results.json").read_bytes()
    rc, err = _run_hp(capsys, [*base, "--on-missing", "error", "--out", str(out)])
    assert rc == 1 and "'y'" in one_line(err, str(csv_path), "line 5")
    assert (out / "results.json").read_bytes() == written


def test_the_changes_line_is_printed(capsys, tmp_path):
    csv_path = _own_csv(tmp_path / "own.csv")
    argv = ["--data", str(csv_path), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    argv += ["--methods", "identity", "--seeds", "1", "--no-plot", "--out", str(tmp_path / "o")]
    assert house_price.main(argv) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if str(csv_path) in line]
    assert any("'y'" in line and "3" in line and "'c'" in line for line in printed), printed


def test_a_small_split_names_the_flag_and_a_float_split_value_matches(capsys, tmp_path):
    csv_path, out = _own_csv(tmp_path / "own.csv"), str(tmp_path / "out")
    base = ["--data", str(csv_path), "--target-p", "t", "--methods", "identity", "--out", out]
    rc, err = _run_hp(capsys, [*base, "--split", "PID=1"])  # 30 rows per split < 200
    assert rc == 2 and one_line(err, "--n-train") and not (tmp_path / "out").exists()
    rc, err = _run_hp(capsys, [*base, "--split", "PID=1", "--n-train", "10"])
    assert rc == 0, err  # "1" finds the cells stored as "1.0"
    rows = read_json(tmp_path / "out" / "results.json")["data"]
    assert rows["rows_P"] == rows["rows_H"] == 30  # each split found its 30 rows
    rc, err = _run_hp(capsys, [*base, "--split", "PID=3", "--n-train", "10"])
    assert rc == 2 and one_line(err, "--split", "'1.0'", "'2.0'")  # the values it saw
    assert read_json(tmp_path / "out" / "results.json")["data"] == rows  # nothing rewritten


def test_a_zero_one_target_runs_bce_when_asked_and_says_which_loss_runs(capsys, tmp_path):
    csv_path, out = _own_csv(tmp_path / "own.csv"), tmp_path / "out"
    d = load_table(csv_path, target_p="b", target_h="t", split="g=b", n_train=10, loss="bce")
    assert d.train.loss == "bce" and set(np.unique(d.train.Y_P)) == {0.0, 1.0}
    assert d.binary_target_p and not np.isin(d.train.Y_H, (0.0, 1.0)).all()
    with pytest.raises(ParameterError) as e:  # a continuous target is not a label
        load_table(csv_path, target_p="t", split="g=b", n_train=10, loss="bce")
    assert e.value.parameter == "loss"
    base = ["--data", str(csv_path), "--target-p", "b", "--target-h", "t", "--split", "g=b"]
    base += ["--n-train", "10", "--methods", "identity", "--out", str(out)]
    assert house_price.main([*base, "--seeds", "1", "--no-plot"]) == 0
    said = capsys.readouterr().out
    assert "--loss" in said and read_json(out / "results.json")["data"]["loss"] == "mse"
    assert house_price.main([*base, "--seeds", "1", "--no-plot", "--loss", "bce"]) == 0
    assert read_json(out / "results.json")["data"]["loss"] == "bce"


def test_a_table_whose_methods_exceed_the_budget_is_refused_before_any_run(
    capsys, tmp_path, monkeypatch
):
    def boom(*a, **k):
        raise AssertionError("COMPUTED")

    monkeypatch.setattr(house_price, "run_batch", boom)
    monkeypatch.setattr(limits, "MAX_WORK_BYTES", 1 << 20)
    p = _numeric_csv(tmp_path / "wide.csv", 200, 40, np.random.default_rng(0))
    argv = ["--data", str(p), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    rc, err = _run_hp(capsys, [*argv, "--methods", "ours", "--out", str(tmp_path / "o")])
    assert rc == 1 and one_line(err, "200", "MAX_WORK_BYTES")
    assert not (tmp_path / "o" / "results.json").exists()


def test_one_lambda_given_names_that_lambda(capsys, tmp_path):
    csv_path = _own_csv(tmp_path / "own.csv")
    argv = ["--data", str(csv_path), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    argv += ["--methods", "ours", "--out", str(tmp_path / "o")]
    for flag, value in (("--lambda-p", "100"), ("--lambda-h", "1e7")):
        rc, err = _run_hp(capsys, [*argv, flag, value])
        assert rc == 2 and flag in one_line(err), err
        assert not (tmp_path / "o").exists()


def test_hardening_is_not_said_to_change_a_loss_that_is_round_off(capsys, tmp_path):
    """10 training rows, 12 inputs: D_P is fit exactly, its best loss ~1e-31 with θ and ~1e-30
    with θQ; the hardening check compares them as equal, not as a change of 358 %."""
    p = _numeric_csv(tmp_path / "fit.csv", 12, 60, np.random.default_rng(2))
    argv = ["--data", str(p), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    argv += ["--methods", "identity,closed_form", "--harden", "haar", "--out", str(tmp_path / "o")]
    rc, err = _run_hp(capsys, argv)
    assert rc == 0, err
    runs = [
        r
        for e in read_json(tmp_path / "o" / "results.json")["methods"].values()
        for r in e["runs"]
    ]
    assert max(r["train"]["dp_loss_after"] for r in runs) < 1e-20  # the exact fit of this case
    assert max(r["hardening"]["max_rel_diff_vs_unhardened"] for r in runs) < 1e-8
