"""House Prices data, the main experiment end to end, and the same command on a table of one's
own."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import house_price
from pycore import evaluate_linear, immunize, rir, rir_ceiling
from pycore.data import load_house_price
from pycore.report import pm, read_json
from tests.cli_helpers import call, one_line


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
    rc, err, _ = call(
        capsys, house_price, ["--data", str(own_csv), *argv, "--out", str(tmp_path / "o")]
    )
    assert rc == 2 and one_line(err, flag)


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
    rc, err, _ = call(capsys, house_price, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 0 and one_line(err, "warning", "'a'")
    rc, err, _ = call(
        capsys, house_price, [*argv, "--on-outlier", "error", "--out", str(tmp_path / "o2")]
    )
    assert rc == 1 and one_line(err, "'a'") and not (tmp_path / "o2").exists()
