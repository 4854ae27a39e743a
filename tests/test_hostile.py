"""Hostile inputs and faults at the library level: every bad input is a one-line error of a
stated type naming the problem, never a silent wrong result, a hang or an unbounded read.

Each case asserts the exception type and the key words of its message (and, for parameters,
the ``parameter`` attribute the command-line layer maps to a flag).  The command-line layer
(exit codes, flags, atomic outputs, signals) is tested in tests/test_hostile_cli.py.
"""
from __future__ import annotations

import gzip
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pycore import validation
from pycore.data.house_price import default_path, load_house_price
from pycore.data.mnist import MnistDigits, load_mnist_idx, split_digits
from pycore.immunize import ImmunizeConfig, immunize
from pycore.metrics import grouped_feature_rir, rir_ceiling
from pycore.optim import make_optimizer
from pycore.probe import gd_exact_line_search
from pycore.precondition import precondition, range_basis
from pycore.regularizers import evaluate, hessian_regularizer, r_ill
from pycore.spectral import (
    SpectrumError,
    condition_number,
    gram_spectrum,
    spectrum_info,
)
from pycore.tasks import LinearTask
from pycore.validation import DivergenceError, ParameterError

NAN, INF = float("nan"), float("inf")


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg.strip(), f"not a one-line message: {msg!r}"
    return msg


# ---------------------------------------------------------------------------------------------
# House Prices CSV files
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hp_lines() -> list[str]:
    return default_path().read_text().splitlines()


def _col(lines, name) -> int:
    return lines[0].split(",").index(name)


def _set_cell(lines, row, col, value) -> list[str]:
    """Copy of the CSV lines with data row ``row`` (0-based), column index ``col`` replaced.
    Kaggle's train.csv has no quoted commas, so a plain split is exact."""
    out = list(lines)
    cells = out[row + 1].split(",")
    cells[col] = value
    out[row + 1] = ",".join(cells)
    return out


def _write(tmp_path, lines, name="train.csv") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def _rows_of_split(lines, harmful: bool) -> list[int]:
    z = _col(lines, "MSZoning")
    return [i for i, line in enumerate(lines[1:]) if (line.split(",")[z] == "RL") == harmful]


def _unblock_fifo_reader(path: Path, after_s: float = 3.0) -> None:
    """If a reader is (wrongly) blocked opening the FIFO, feed it a line after ``after_s`` so the
    test fails instead of hanging; if nobody opened it (the fixed code), do nothing."""
    def feed():
        time.sleep(after_s)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader, as it should be
            return
        os.write(fd, b"a,b\n1,2\n")
        os.close(fd)
    threading.Thread(target=feed, daemon=True).start()


def test_csv_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file") as e:
        load_house_price(tmp_path / "missing.csv")
    _one_line(e)


def test_csv_directory(tmp_path):
    with pytest.raises(ValueError, match="is a directory") as e:
        load_house_price(tmp_path)
    _one_line(e)


def test_csv_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "train.csv"
    os.mkfifo(fifo)
    _unblock_fifo_reader(fifo)
    with pytest.raises(ValueError, match=r"is a FIFO \(named pipe\), expected a regular file"):
        load_house_price(fifo)


def test_csv_dev_zero_is_refused_without_reading():
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    with pytest.raises(ValueError, match="/dev/zero: is a device, expected a regular file"):
        load_house_price("/dev/zero")


def test_csv_over_the_size_cap_is_refused(tmp_path, hp_lines, monkeypatch):
    p = _write(tmp_path, hp_lines)
    monkeypatch.setattr(validation, "MAX_DATA_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"bytes, larger than the 1000 byte limit"):
        load_house_price(p)


@pytest.mark.parametrize("text,msg", [
    ("", "is empty"),
    ("\n\n", "is empty"),
    ("Id,MSZoning,LotArea,SalePrice\n", "no data rows"),
    ("Id;MSZoning;LotArea;SalePrice\n1;RL;8450;208500\n", "looks ';'-separated"),
    ("Id\tMSZoning\tLotArea\tSalePrice\n1\tRL\t8450\t208500\n", "looks '\\\\t'-separated"),
    ("Id,LotArea,SalePrice\n1,8450,208500\n", "missing column 'MSZoning'"),
])
def test_csv_small_malformed_files(tmp_path, text, msg):
    p = tmp_path / "train.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=msg) as e:
        load_house_price(p)
    _one_line(e)


def test_csv_binary_garbage(tmp_path):
    p = tmp_path / "train.csv"
    p.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="cannot be read as CSV") as e:
        load_house_price(p)
    _one_line(e)


def test_csv_duplicated_target_header_is_refused(tmp_path, hp_lines):
    """pandas would rename the second SalePrice to SalePrice.1 and make it an input feature:
    the harmful target leaking into X_H."""
    lines = [hp_lines[0] + ",SalePrice"] + [ln + "," + ln.split(",")[-1] for ln in hp_lines[1:]]
    with pytest.raises(ValueError, match=r"duplicated column name\(s\) 'SalePrice' in the header \(line 1\)"):
        load_house_price(_write(tmp_path, lines))


def test_csv_duplicated_feature_header_is_refused(tmp_path, hp_lines):
    header = hp_lines[0].split(",")
    header[header.index("Street")] = "LotShape"
    lines = [",".join(header)] + hp_lines[1:]
    with pytest.raises(ValueError, match=r"duplicated column name\(s\) 'LotShape'"):
        load_house_price(_write(tmp_path, lines))


@pytest.mark.parametrize("value", ["1e308", "-1e308", "1.7e308"])
def test_csv_huge_feature_cell_is_not_zeroed(tmp_path, hp_lines, value):
    """One 1e308 cell used to overflow the column's std to inf and zero the whole column."""
    row = _rows_of_split(hp_lines, harmful=True)[5]      # training row 5 of D_H
    lines = _set_cell(hp_lines, row, _col(hp_lines, "GrLivArea"), value)
    with pytest.warns(validation.OutlierWarning, match="'GrLivArea'"):
        d = load_house_price(_write(tmp_path, lines))
    j = d.feature_names.index("GrLivArea")
    col = np.concatenate([d.train.X_H[:, j], d.heldout.X_H[:, j]])  # the whole split is z-scored
    assert np.all(np.isfinite(col))
    assert col.mean() == pytest.approx(0.0, abs=1e-9) and col.std() == pytest.approx(1.0, rel=1e-9)
    assert np.sign(d.train.X_H[5, j]) == np.sign(float(value)) and abs(d.train.X_H[5, j]) > 30  # the outlier


def test_csv_huge_target_is_not_zeroed(tmp_path, hp_lines):
    row = _rows_of_split(hp_lines, harmful=True)[3]
    lines = _set_cell(hp_lines, row, _col(hp_lines, "SalePrice"), "-1e308")
    with pytest.warns(validation.OutlierWarning, match="'SalePrice'"):
        d = load_house_price(_write(tmp_path, lines))
    y = np.concatenate([d.train.Y_H[:, 0], d.heldout.Y_H[:, 0]])
    assert np.all(np.isfinite(y)) and y.std() == pytest.approx(1.0, rel=1e-9)
    assert d.train.Y_H[3, 0] < -30


def test_csv_valid_file_is_unchanged_by_the_stable_zscore(tmp_path, hp_lines):
    """The stable path is taken only by overflowing columns: other columns keep their bits."""
    row = _rows_of_split(hp_lines, harmful=True)[5]
    d_bad = load_house_price(_write(tmp_path, _set_cell(hp_lines, row, _col(hp_lines, "GrLivArea"), "1e308")),
                             on_outlier="ignore")
    d = load_house_price()
    j = d.feature_names.index("GrLivArea")
    keep = [k for k in range(d.train.D) if k != j]
    assert np.array_equal(d.train.X_H[:, keep], d_bad.train.X_H[:, keep])
    assert np.array_equal(d.train.X_P, d_bad.train.X_P)


@pytest.mark.parametrize("column,value,msg", [
    ("LotFrontage", "inf", r"column 'LotFrontage' has non-finite value inf \(line \d+\)"),
    ("SalePrice", "", r"target column 'SalePrice' is empty \(line \d+\)"),
    ("SalePrice", "inf", r"target column 'SalePrice' has non-finite value inf \(line \d+\)"),
    ("SalePrice", "-1e999", r"target column 'SalePrice' has non-finite value -inf \(line \d+\)"),
    ("SalePrice", "cheap", r"column 'SalePrice' has non-numeric value 'cheap' \(line \d+\)"),
    ("GrLivArea", "lots", r"column 'GrLivArea' is numeric but has non-numeric value 'lots'"),
])
def test_csv_bad_cells_name_column_and_line(tmp_path, hp_lines, column, value, msg):
    row = _rows_of_split(hp_lines, harmful=True)[2]
    with pytest.raises(ValueError, match=msg) as e:
        load_house_price(_write(tmp_path, _set_cell(hp_lines, row, _col(hp_lines, column), value)))
    assert f"line {row + 2}" in _one_line(e)


@pytest.mark.parametrize("n_train", [NAN, 1, 2.5, "200", -3])
def test_house_price_n_train(n_train):
    with pytest.raises(ParameterError, match="n_train must be an integer ≥ 2") as e:
        load_house_price(n_train=n_train)
    assert e.value.parameter == "n_train"


# ---------------------------------------------------------------------------------------------
# MNIST IDX folders
# ---------------------------------------------------------------------------------------------

def _idx_images(n=20) -> bytes:
    return (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (n, 28, 28)) + bytes(n * 784)


def test_idx_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "train-images-idx3-ubyte")
    _unblock_fifo_reader(tmp_path / "train-images-idx3-ubyte")
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: is a FIFO"):
        load_mnist_idx(tmp_path)


def test_idx_link_to_dev_zero_is_refused(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    os.symlink("/dev/zero", tmp_path / "train-images-idx3-ubyte")
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: is a device"):
        load_mnist_idx(tmp_path)


def test_idx_truncated_gzip(tmp_path):
    blob = gzip.compress(_idx_images())
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: cannot be read \(EOFError") as e:
        load_mnist_idx(tmp_path)
    _one_line(e)


def test_idx_gzip_bomb_is_capped(tmp_path, monkeypatch):
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_images(50)))  # 39 kB inflated
    monkeypatch.setattr(validation, "MAX_DATA_FILE_BYTES", 10_000)
    with pytest.raises(ValueError, match="holds more than the 10000 byte limit"):
        load_mnist_idx(tmp_path)


def test_idx_truncated_header(tmp_path):
    (tmp_path / "train-images-idx3-ubyte").write_bytes((2051).to_bytes(4, "big") + (5).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="truncated"):
        load_mnist_idx(tmp_path)


@pytest.fixture(scope="module")
def tiny_digits():
    rng = np.random.default_rng(0)
    return MnistDigits({d: rng.uniform(0, 1, size=(8, 784)) for d in range(10)}, "synthetic")


@pytest.mark.parametrize("kw,param", [
    (dict(n_train=NAN), "n_train"), (dict(n_train=3.0), "n_train"), (dict(n_train=8), "n_train"),
    (dict(n_train=2, n_heldout=NAN), "n_heldout"), (dict(n_train=2, n_heldout=-1), "n_heldout"),
])
def test_split_digits_parameters(tiny_digits, kw, param):
    with pytest.raises(ParameterError, match=param) as e:
        split_digits(tiny_digits, rng=np.random.default_rng(0), **kw)
    assert e.value.parameter == param


# ---------------------------------------------------------------------------------------------
# Arrays into the linear core
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("A,msg", [
    (np.array([[1.0, NAN], [0.0, 1.0]]), r"contains NaN or inf \(first at index \(0, 1\)\)"),
    (np.array([[1.0, 0.0], [INF, 1.0]]), r"contains NaN or inf \(first at index \(1, 0\)\)"),
    (np.ones(3), r"must be 2-D, got shape \(3,\)"),
    (np.ones((2, 2, 2)), "must be 2-D"),
    (np.zeros((0, 3)), r"is empty \(shape \(0, 3\)\)"),
    (np.array([["1", "2"], ["3", "4"]]), "must be a real numeric array, got dtype <U1"),
    (np.array([[1, None], [2, 3]], dtype=object), "must be a real numeric array, got dtype object"),
    (np.eye(2) * (1 + 1j), "must be a real numeric array, got dtype complex128"),
])
def test_bad_arrays(A, msg):
    with pytest.raises(ValueError, match=msg) as e:
        condition_number(A)
    _one_line(e)


def test_task_shape_mismatch():
    with pytest.raises(ValueError, match="X_P has 3 columns but X_H has 4"):
        LinearTask(np.ones((5, 3)), np.ones(5), np.ones((5, 4)), np.ones(5))
    with pytest.raises(ValueError, match="Y_H has 4 rows but the inputs have 5"):
        LinearTask(np.ones((5, 3)), np.ones(5), np.ones((5, 3)), np.ones(4))


# ---------------------------------------------------------------------------------------------
# Parameters: finite, in range, named
# ---------------------------------------------------------------------------------------------

_S = np.diag([3.0, 2.0, 1.0])


@pytest.mark.parametrize("call", [
    lambda r: spectrum_info(_S, rtol=r),
    lambda r: condition_number(_S, rtol=r),
    lambda r: gram_spectrum(_S, rtol=r),
    lambda r: evaluate(_S, "ill", rtol=r),
    lambda r: hessian_regularizer(_S, "well", rtol=r),
    lambda r: range_basis(_S, rtol=r),
], ids=["spectrum_info", "condition_number", "gram_spectrum", "evaluate", "hessian_regularizer",
        "range_basis"])
@pytest.mark.parametrize("rtol", [NAN, -1.0, 1.0, INF, "1e-9"])
def test_rtol_must_be_finite_in_unit_interval(call, rtol):
    """NaN counted no singular value as nonzero (rank 0, κ garbage); rtol ≥ 1 cut σ_max itself."""
    with pytest.raises(ParameterError, match=r"rtol must be a finite number in \[0, 1\)") as e:
        call(rtol)
    assert e.value.parameter == "rtol"


@pytest.mark.parametrize("field,value", [
    ("epochs", -1), ("epochs", 2.5), ("epochs", NAN),
    ("lr", 0.0), ("lr", -0.1), ("lr", INF), ("lr", NAN),
    ("lambda_p", -1.0), ("lambda_p", NAN), ("lambda_h", NAN), ("lambda_h", INF),
    ("betas", (0.9, 1.0)), ("betas", (NAN, 0.999)), ("betas", (0.9,)),
    ("adam_eps", 0.0), ("adam_eps", NAN),
    ("batch_size", 0), ("batch_size", 3.5),
    ("ridge", -1e-7), ("ridge", NAN),
    ("lambda_kappa", NAN), ("imma_inner_steps", -1), ("imma_inner_lr", 5.0), ("imma_inner_lr", NAN),
    ("closed_form_exponent", NAN), ("closed_form_exponent", INF),
    ("certified_safety", 0.0), ("certified_safety", 1.5), ("certified_safety", NAN),
    ("optimizer", "sgd"), ("precond", "inverse"), ("init", "zeros"), ("certified", "yes"),
])
def test_immunize_config_rejects_and_names_the_field(field, value):
    with pytest.raises(ParameterError, match=f"^{field} must be ") as e:
        ImmunizeConfig(**{field: value})
    assert e.value.parameter == field
    _one_line(e)


def test_immunize_config_ridge_preconditioner_needs_ridge():
    with pytest.raises(ParameterError, match="precond 'ridge' needs ridge > 0") as e:
        ImmunizeConfig(precond="ridge", ridge=0.0)
    assert e.value.parameter == "ridge"


@pytest.mark.parametrize("kw,param", [
    (dict(lr=NAN), "lr"), (dict(lr=0.0), "lr"), (dict(eps=NAN), "adam_eps"),
    (dict(betas=(1.5, 0.9)), "betas"),
])
def test_optimizer_parameters(kw, param):
    with pytest.raises(ParameterError, match=param) as e:
        make_optimizer("adam", **{"lr": 0.1, **kw})
    assert e.value.parameter == param


def test_metric_and_probe_parameters():
    X = np.random.default_rng(0).normal(size=(6, 3))
    with pytest.raises(ParameterError, match="null_rtol"):
        rir_ceiling(X, X, null_rtol=NAN)
    rng = np.random.default_rng(0)
    with pytest.raises(ParameterError, match="groups must be an integer ≥ 1"):
        grouped_feature_rir(X, X, X, X, rng=rng, groups=0)
    with pytest.raises(ParameterError, match="group_size must be an integer ≥ 2"):
        grouped_feature_rir(X, X, X, X, rng=rng, group_size=NAN)
    with pytest.raises(ValueError, match=r"Z_H contains NaN or inf"):
        grouped_feature_rir(X, np.full((6, 3), NAN), X, X, rng=rng)
    with pytest.raises(ParameterError, match=r"steps must be an integer in \[0, 100000\]"):
        gd_exact_line_search(X, np.ones(6), steps=2.5)
    with pytest.raises(ParameterError, match="p must be an integer ≥ 1"):
        evaluate(_S, "well", p=0)
    with pytest.raises(ParameterError, match="ridge must be a finite number > 0"):
        precondition(np.eye(3), np.eye(3), np.eye(3), "ridge", ridge=NAN)


def test_attack_parameters():
    from pycore.attacks import attack_adam, make_problem

    prob = make_problem(np.random.default_rng(0).normal(size=(8, 3)), np.arange(8.0))
    with pytest.raises(ParameterError, match="eps must be a finite number > 0"):
        attack_adam(prob, max_steps=3, eps=NAN)
    with pytest.raises(ValueError, match="lr_factors must be a non-empty list of positive numbers"):
        attack_adam(prob, max_steps=3, lr_factors=(0.1, INF))
    with pytest.raises(ValueError, match="tol must be a finite number"):
        attack_adam(prob, max_steps=3, tol=NAN)
    with pytest.raises(ParameterError, match="newton_tol"):
        make_problem(np.ones((4, 2)), np.array([0, 1, 0, 1]), "logistic", newton_tol=NAN)


# ---------------------------------------------------------------------------------------------
# Spectra at the edges
# ---------------------------------------------------------------------------------------------

def test_zero_matrix():
    with pytest.raises(SpectrumError, match="S is zero: its condition number is undefined"):
        condition_number(np.zeros((3, 3)))
    with pytest.raises(SpectrumError, match="Z is zero"):
        gram_spectrum(np.zeros((4, 3)))


def test_tied_spectrum_r_ill_undefined():
    with pytest.raises(SpectrumError,
                       match=r"R_ill is undefined: the 3 nonzero singular value\(s\) are all equal"):
        r_ill(2.0 * np.eye(3))


@pytest.mark.parametrize("S,kappa", [
    (np.diag([1e308, 1e308]), 1.0),
    (np.diag([1e308, 1e307]), 10.0),
    (np.diag([4e-300, 1e-300]), 4.0),
])
def test_condition_number_near_float_limits(S, kappa):
    """diag(1e308, 1e308) used to be reported as "S is zero" (S + Sᵀ overflowed)."""
    assert condition_number(S) == pytest.approx(kappa, rel=1e-12)


def test_condition_number_whose_sigma_overflows():
    with pytest.raises(SpectrumError, match="largest singular value .* overflows float64"):
        condition_number(np.full((2, 2), 1e308))


def test_gram_spectrum_out_of_float_range():
    """σ(Z)² overflows: a Python OverflowError came out of the tolerance arithmetic."""
    with pytest.raises(SpectrumError, match=r"square outside float64's range.*rescale Z"):
        gram_spectrum(np.diag([1e200, 1e199]))


# ---------------------------------------------------------------------------------------------
# Optimizer divergence: stop, name the parameter
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_task():
    rng = np.random.default_rng(0)
    X_P, X_H = rng.normal(size=(30, 6)), rng.normal(size=(30, 6)) * np.array([1, 2, 3, 4, 5, 6.0])
    return LinearTask(X_P, rng.normal(size=30), X_H, rng.normal(size=30))


@pytest.mark.parametrize("method,kw,param", [
    ("ours", dict(lambda_h=1e300), "lambda_h"),
    ("ours", dict(lambda_p=1e300), "lambda_p"),
    ("ours", dict(lr=1e300), "lr"),
    ("ours", dict(lambda_h=1e300, optimizer="gd"), "lambda_h"),
    ("ours", dict(lr=1e300, optimizer="gd"), "lr"),
    ("ours", dict(lr=1e300, certified=True), "lr"),
    ("opt_kappa", dict(lambda_kappa=1e300), "lambda_kappa"),
    ("imma", dict(lr=1e300), "lr"),
])
def test_divergence_stops_and_names_the_parameter(small_task, method, kw, param):
    """λ_H = 1e300 used to overflow Adam's second moment: every step 0, θ = I, RIR 1, no error."""
    cfg = ImmunizeConfig(epochs=2, batch_size=None, **kw)
    with pytest.raises(DivergenceError, match=f"lower {param}") as e:
        immunize(small_task, method, rng=np.random.default_rng(0), config=cfg)
    assert e.value.parameter == param
    _one_line(e)


def test_r_ill_only_clips_a_huge_lambda_h_to_its_safe_step(small_task):
    """R_ill only takes min(lr·λ_H, 0.9·bound) (docs/theory.md §7): λ_H = 1e300 cannot make it
    diverge; every step is clipped and θ stays finite, with the RIR never falling."""
    res = immunize(small_task, "r_ill_only", rng=np.random.default_rng(0),
                   config=ImmunizeConfig(epochs=2, batch_size=None, lambda_h=1e300))
    assert np.all(np.isfinite(res.theta))
    assert res.diagnostics["clipped"] == res.diagnostics["steps"] > 0
    assert res.diagnostics["rir_decreases"] == 0


def test_closed_form_exponent_overflow(small_task):
    with pytest.raises(DivergenceError, match=r"closed_form: λ_C\^\(a/2\) overflows float64") as e:
        immunize(small_task, "closed_form", rng=np.random.default_rng(0),
                 config=ImmunizeConfig(closed_form_exponent=1e4))
    assert e.value.parameter == "closed_form_exponent"


def test_optimizers_refuse_a_non_finite_step():
    for name in ("adam", "gd"):
        opt = make_optimizer(name, 0.1, param="θ")
        with pytest.raises(DivergenceError, match="for θ became non-finite at step 1.*lower lambda_h") as e:
            opt.step(np.zeros(3), np.array([0.0, 1e200 if name == "adam" else INF, 0.0]),
                     blame=lambda: "lambda_h")
        assert e.value.parameter == "lambda_h"


# ---------------------------------------------------------------------------------------------
# The fused op and the immunization head
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ops():
    import pycore.deep  # noqa: F401  (torchvision shim before timm)
    from pycore import ops as _ops

    return _ops


@pytest.mark.parametrize("make,kind,kw,msg", [
    (lambda t: t.tensor([[1.0, NAN], [0.0, 1.0]], dtype=t.float64), "ill", {}, "NaN or Inf"),
    (lambda t: t.ones(5, dtype=t.float64), "well", {}, "must be a 2-D"),
    (lambda t: t.ones(2, 3, 4, dtype=t.float64), "well", {}, "must be a 2-D"),
    (lambda t: t.ones(3, 4, dtype=t.int64), "well", {}, "float32 or float64"),
    (lambda t: t.randn(4, 3, dtype=t.float64), "sick", {}, "kind must be 'ill' or 'well'"),
    (lambda t: t.randn(4, 3, dtype=t.float64), "ill", {"rtol": NAN}, "rtol must be a finite number"),
    (lambda t: t.randn(4, 3, dtype=t.float64), "ill", {"rtol": -1.0}, "rtol must be a finite number"),
    (lambda t: t.randn(4, 3, dtype=t.float64), "well", {"rtol": 1.0},
     r"rtol must be a finite number in \[0, 1\)"),
    (lambda t: t.randn(4, 3, dtype=t.float64), "well", {"tie_rtol": NAN}, "tie_rtol must be a finite number"),
])
def test_op_bad_inputs(ops, make, kind, kw, msg):
    import torch

    with pytest.raises(RuntimeError, match=msg) as e:
        ops.cond_regularizer(make(torch), kind, **kw)
    assert str(e.value).startswith("cond_regularizer:")


def test_head_names_a_non_finite_batch(ops):
    """A NaN batch used to be blamed on rank deficiency ("use a larger lambda_reg")."""
    import torch

    head = ops.ImmunizationHead(4).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    x[2, 1] = NAN
    with pytest.raises(RuntimeError,
                       match=r"ImmunizationHead: the input batch contains NaN or inf \(1 of 32"):
        head(x).sum().backward()


# ---------------------------------------------------------------------------------------------
# Checkpoints: tests/test_deepnet.py (pycore.deep.checkpoint reads every format by content)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# torchrun environment
# ---------------------------------------------------------------------------------------------

_MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}


@pytest.mark.parametrize("env,msg", [
    ({"WORLD_SIZE": "2", "RANK": "5", **_MASTER}, r"RANK=5 must be in \[0, WORLD_SIZE=2\)"),
    ({"WORLD_SIZE": "2", "RANK": "-1", **_MASTER}, r"RANK=-1 must be in \[0, WORLD_SIZE=2\)"),
    ({"WORLD_SIZE": "two", "RANK": "0", **_MASTER}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be ≥ 1"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR and MASTER_PORT are not set"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "29555"}, "MASTER_ADDR is not set"),
    ({"WORLD_SIZE": "2", **_MASTER}, "RANK is not set"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1", **_MASTER}, "LOCAL_RANK=-1 must be in"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "x", **_MASTER}, "LOCAL_RANK='x' is not an integer"),
    ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", **_MASTER},
     r"LOCAL_RANK=2 must be in \[0, LOCAL_WORLD_SIZE=2\)"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
     r"MASTER_PORT=99999 must be in \[1, 65535\]"),
])
def test_distributed_env_is_checked_before_rendezvous(monkeypatch, env, msg):
    """RANK ≥ WORLD_SIZE used to wait for the 600 s rendezvous timeout (3 s here if it regresses)."""
    import torch.distributed as dist

    import pycore.deep  # noqa: F401
    from pycore.deep import distributed

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    t0 = time.perf_counter()
    with pytest.raises(distributed.DistributedEnvError, match=msg) as e:
        distributed.init_from_env("cpu", timeout_s=3)
    assert time.perf_counter() - t0 < 2.0
    assert not dist.is_initialized()
    _one_line(e)


def test_distributed_single_process_defaults(monkeypatch):
    import pycore.deep  # noqa: F401
    from pycore.deep import distributed

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    ctx = distributed.init_from_env("cpu")
    assert (ctx.rank, ctx.world, ctx.local_rank, ctx.backend) == (0, 1, 0, None)
