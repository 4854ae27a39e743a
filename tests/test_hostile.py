"""Hostile inputs to the core checks and the data files: refused by an error naming the argument
(``.parameter``) or the file (and column and line), before long compute, or the right answer."""

from __future__ import annotations

import gzip
import os
import pickle
import threading
import time
import tracemalloc
import zipfile

import numpy as np
import pytest

from pycore import (
    DivergenceError,
    OutlierWarning,
    ParameterError,
    SpectrumError,
    blas_threads,
    condition_number,
    feature_rir,
    gram_spectrum,
    grouped_feature_rir,
    limits,
    preconditioned_r_ill_step_bound,
    preconditioned_r_well_step_bound,
    r_ill,
    r_ill_grad,
    r_ill_grad_theta,
    r_well,
    r_well_grad,
    r_well_grad_theta,
    rir,
    rir_ceiling,
    spectrum_info,
)
from pycore.data import (
    MnistDigits,
    default_path,
    load_house_price,
    load_mnist_idx,
    load_table,
    split_digits,
)
from pycore.linalg import hessian_regularizer
from pycore.report import load_thetas, save_thetas

NAN = float("nan")


@pytest.fixture(autouse=True)
def one_blas_thread():
    with blas_threads(1):  # the library's own rule at these sizes (docs/design.md §5)
        yield


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


def _fifo(path):
    """A FIFO that a (wrongly) blocked reader gets fed after 3 s, so the test fails instead of
    hanging."""
    os.mkfifo(path)

    def feed():
        time.sleep(3)
        try:
            # ENXIO without a reader, as it should be
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"a,b\n1,2\n")
            os.close(fd)
        except OSError:
            pass

    threading.Thread(target=feed, daemon=True).start()
    return path


def _peak_bytes(call, error=ValueError, match=None) -> int:
    """Peak traced allocation of a call that must raise ``error`` (numpy traces its buffers)."""
    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --- CSV files -----------------------------------------------------------------------------------


def test_csv_not_a_regular_file(tmp_path, monkeypatch, hp_lines):
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_house_price(tmp_path / "missing.csv")
    for path in (
        tmp_path,
        _fifo(tmp_path / "fifo.csv"),
        *["/dev/zero"] * os.path.exists("/dev/zero"),
    ):
        with pytest.raises(ValueError, match=str(path)):
            load_house_price(path)
    monkeypatch.setattr(limits, "MAX_DATA_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match="train.csv"):
        load_house_price(_write(tmp_path, hp_lines))


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
def test_csv_malformed_files_name_the_file(tmp_path, content):
    (tmp_path / "bad.csv").write_bytes(content)
    with pytest.raises(ValueError, match="bad.csv"):
        load_table(tmp_path / "bad.csv", target_p="t", split="a=1")


def test_csv_wide_header_is_refused_before_pandas_reads(tmp_path, hp_lines, monkeypatch):
    """1,000,000 extra header columns (8.3 MB) grew the old loader to 7.7 GB: pandas pads every row
    to every declared column.  The width is capped on the header line, before pandas is called."""
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
    """An extra column silently became input 80; now it is refused by name (load_table reads any
    table), and so is a repeated one (pandas renames a second SalePrice SalePrice.1: an input).
    The paper's inputs are taken in Kaggle's order whatever the file's order."""
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
def test_csv_huge_cell_is_not_zeroed_and_other_columns_keep_their_bits(tmp_path, hp_lines, value):
    """One 1e308 cell used to overflow the column's std to inf and zero the whole column."""
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
def test_csv_bad_cells_name_column_and_line(tmp_path, hp_lines, column, value):
    row = _harmful_rows(hp_lines)[2]
    with pytest.raises(ValueError, match=f"{column}.*line {row + 2}"):
        load_house_price(_write(tmp_path, _set_cell(hp_lines, row, column, value)))


# --- θ archives
# -----------------------------------------------------------------------------------


def test_theta_archive_sizes_are_capped_before_reading(tmp_path, monkeypatch):
    """A 3.9 MB .npz of 500M deflated zeros was read whole (3.97 GB); here 2 MB against a 1 MB cap,
    and a member whose .npy header declares 8 TB (numpy allocates what a header declares)."""
    save_thetas(tmp_path / "ok.npz", {"ours/seed0": np.eye(3)}, {"a": 1})
    assert np.array_equal(load_thetas(tmp_path / "ok.npz")[0]["ours/seed0"], np.eye(3))
    np.savez_compressed(tmp_path / "bomb.npz", x=np.zeros(1 << 18))
    assert (tmp_path / "bomb.npz").stat().st_size < 10_000
    monkeypatch.setattr(limits, "MAX_ARCHIVE_BYTES", 1 << 20)
    assert _peak_bytes(lambda: load_thetas(tmp_path / "bomb.npz"), match="bomb.npz") < 1 << 20
    assert load_thetas(tmp_path / "bomb.npz", max_bytes=4 << 20)[0]["x"].size == 1 << 18
    with zipfile.ZipFile(tmp_path / "lie.npz", "w") as zf, zf.open("x.npy", "w") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<f8", "fortran_order": False, "shape": (10**12,)}
        )
        fh.write(bytes(64))
    with pytest.raises(ValueError, match="lie.npz"):
        load_thetas(tmp_path / "lie.npz")
    with pytest.raises(ParameterError) as e:
        load_thetas(tmp_path / "ok.npz", max_bytes=-1)
    assert e.value.parameter == "max_bytes"


@pytest.mark.parametrize("key", ["../../evil", "/abs", "a/../b", "a//b", "meta", "a b"])
def test_save_thetas_refuses_a_path_like_key(tmp_path, key):
    with pytest.raises(ParameterError) as e:
        save_thetas(tmp_path / "t.npz", {key: np.eye(2)})
    assert e.value.parameter == "arrays" and not (tmp_path / "t.npz").exists()


# --- MNIST IDX folders
# ----------------------------------------------------------------------------


def _idx_images(n=20) -> bytes:
    return (
        (2051).to_bytes(4, "big")
        + b"".join(d.to_bytes(4, "big") for d in (n, 28, 28))
        + bytes(n * 784)
    )


@pytest.mark.parametrize(
    "case", ["fifo", "dev_zero", "truncated_gzip", "gzip_bomb", "truncated_header"]
)
def test_idx_broken_files_name_the_file(tmp_path, monkeypatch, case):
    name = "train-images-idx3-ubyte" + (".gz" if "gzip" in case else "")
    if case == "fifo":
        _fifo(tmp_path / name)
    elif case == "dev_zero":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero")
        os.symlink("/dev/zero", tmp_path / name)
    else:
        (tmp_path / name).write_bytes(
            {
                "truncated_gzip": gzip.compress(_idx_images())[:300],
                "gzip_bomb": gzip.compress(_idx_images(50)),  # inflates to 39 kB
                "truncated_header": _idx_images()[:8],
            }[case]
        )
    monkeypatch.setattr(limits, "MAX_DATA_FILE_BYTES", 10_000)
    with pytest.raises(ValueError, match=name):
        load_mnist_idx(tmp_path)


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(n_train=NAN), "n_train"),
        (dict(n_train=8), "n_train"),
        (dict(n_train=2, n_heldout=-1), "n_heldout"),
    ],
)
def test_split_digits_parameters(kw, param):
    digits = MnistDigits(
        {d: np.random.default_rng(d).uniform(0, 1, size=(8, 784)) for d in range(10)}, "s"
    )
    with pytest.raises(ParameterError) as e:
        split_digits(digits, rng=np.random.default_rng(0), **kw)
    assert e.value.parameter == param


# --- arrays into the core
# -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "A",
    [
        np.array([[1.0, NAN], [0.0, 1.0]]),
        np.ones(3),
        np.ones((2, 2, 2)),
        np.zeros((0, 3)),
        np.array([["1", "2"], ["3", "4"]]),
        np.eye(2) * (1 + 1j),
        np.array([[1, None], [2, 3]], dtype=object),
    ],
)
def test_bad_arrays_name_the_argument(A):
    with pytest.raises(ValueError, match="^S "):
        condition_number(A)


def test_a_broadcast_view_over_the_cap_is_refused_before_it_is_copied(monkeypatch):
    """condition_number copied a 4.47 GiB broadcast view before any size check."""
    monkeypatch.setattr(limits, "MAX_DENSE_BYTES", 1 << 20)
    view = np.broadcast_to(np.arange(1000.0), (1000, 1000))  # 8 MB if expanded
    assert _peak_bytes(lambda: condition_number(view), match="MAX_DENSE_BYTES") < 1 << 20


def test_a_tall_task_never_forms_an_n_by_n_factor():
    """A full SVD of 30,700 held-out rows formed a 30,700² U (7 GiB) that nothing used; here 5000
    rows, whose U would be 200 MB."""
    X = np.random.default_rng(0).standard_normal((5000, 20))
    tracemalloc.start()
    c = rir_ceiling(X, X[:300])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert c.rank_K_P == 20 and peak < 50 << 20


def test_metric_parameters_are_named():
    rng = np.random.default_rng(0)
    X, Z = rng.normal(size=(6, 3)), rng.normal(size=(20, 4))
    # rtol NaN counted no singular value as nonzero, rtol ≥ 1 cut σ_max
    S = np.diag([3.0, 2.0, 1.0])
    for call, param in (
        (lambda: spectrum_info(S, rtol=NAN), "rtol"),
        (lambda: gram_spectrum(S, rtol=1.0), "rtol"),
        (lambda: hessian_regularizer(S, "ill", rtol=-1.0), "rtol"),
        (lambda: hessian_regularizer(S, "well", rtol="1e-9"), "rtol"),
        (lambda: rir_ceiling(X, X, null_rtol=NAN), "null_rtol"),
        (lambda: grouped_feature_rir(X, X, X, X, rng=rng, groups=0), "groups"),
        (lambda: grouped_feature_rir(X, X, X, X, rng=rng, group_size=NAN), "group_size"),
        (lambda: hessian_regularizer(X, "x"), "kind"),
        (lambda: rir(np.eye(4), Z, rng.normal(size=(20, 5))), "X_H"),
    ):
        with pytest.raises(ParameterError) as e:
            call()
        assert e.value.parameter == param
    with pytest.raises(ValueError, match="Z_H"):
        grouped_feature_rir(X, np.full((6, 3), NAN), X, X, rng=rng)


def test_feature_rir_refuses_mismatched_features():
    """Features of mismatched widths, or a reference of other rows, were accepted silently."""
    Z = np.random.default_rng(0).normal(size=(20, 4))
    for args, param in (
        ((Z, Z[:, :3], Z, Z[:, :3]), "Z_H"),
        ((Z, Z, Z, Z[:, :3]), "Z_H_ref"),
        ((Z, Z, Z[:10], Z), "Z_P_ref"),
        ((Z, Z, Z, Z[:10]), "Z_H_ref"),
    ):
        for f in (
            feature_rir,
            lambda *a: grouped_feature_rir(*a, rng=np.random.default_rng(), group_size=5),
        ):
            with pytest.raises(ParameterError) as e:
                f(*args)
            assert e.value.parameter == param


def test_a_matrix_that_must_be_symmetric_is_checked_with_a_round_off_tolerance():
    rng = np.random.default_rng(1)
    X, A = rng.normal(size=(30, 5)), rng.normal(size=(5, 5))
    K, theta = X.T @ X, np.eye(5) + 0.1 * rng.normal(size=(5, 5))
    for call, param in (
        (lambda M: r_well_grad_theta(theta, M), "K"),
        (lambda M: r_ill_grad_theta(theta, M), "K"),
        (preconditioned_r_ill_step_bound, "H"),
        (preconditioned_r_well_step_bound, "H"),
    ):
        for bad in (K + 1e-3 * np.abs(K).max() * (A - A.T), X.T @ X[:, :4]):
            with pytest.raises(ParameterError) as e:
                call(bad)
            assert e.value.parameter == param
        # what a product leaves (≫ eps, ≪ √eps) passes: the same result as the symmetric matrix
        assert np.allclose(call(K + 1e-12 * np.abs(K).max() * (A - A.T)), call(K), rtol=1e-8)


# --- spectra at the edges
# -------------------------------------------------------------------------


def test_zero_and_tied_spectra():
    X = np.eye(3)
    for call in (
        lambda: condition_number(np.zeros((3, 3))),
        lambda: gram_spectrum(np.zeros((4, 3))),
        lambda: r_ill(2.0 * np.eye(3)),
        lambda: gram_spectrum(np.diag([1e200, 1e199])),
        lambda: condition_number(np.full((2, 2), 1e308)),
        lambda: rir(0 * np.eye(3), X, X),
    ):
        with pytest.raises(SpectrumError):
            call()
    assert spectrum_info(np.diag([1e308, 1.0])).rank == 1  # 1 is below σ_max·2·eps


@pytest.mark.parametrize(
    "S,kappa",
    [
        (np.diag([1e308, 1e308]), 1.0),
        (np.diag([1e308, 1e307]), 10.0),
        (np.diag([4e-300, 1e-300]), 4.0),
    ],
)
def test_condition_number_near_float_limits(S, kappa):
    """diag(1e308, 1e308) was "S is zero": S + Sᵀ overflowed."""
    assert condition_number(S) == pytest.approx(kappa, rel=1e-12)


@pytest.mark.parametrize("c", [1e80, 1e-80, 1e140, 1e-140])
def test_regularizers_scale_exactly_where_representable(c):
    """R_well(cS) = c²R_well(S), R_ill(cS) = R_ill(S)/c², ∇R_well(cS) = c∇R_well(S), ∇R_ill(cS) =
    ∇R_ill(S)/c³, computed on S/max|S| near the float64 limits (∇R_ill(diag(3e-140, 1e-140)) was
    ±inf)."""
    S = np.diag([3.0, 2.0, 1.0])
    assert r_well(c * S) == pytest.approx(c * c * r_well(S), rel=1e-12)
    assert r_ill(c * S) == pytest.approx(r_ill(S) / c**2, rel=1e-12)
    assert np.allclose(r_well_grad(c * S), c * r_well_grad(S), rtol=1e-12, atol=0)
    if 1e-100 < c < 1e100:
        assert np.allclose(r_ill_grad(c * S), r_ill_grad(S) / c**3, rtol=1e-12, atol=0)
    elif c > 1:  # |∇R_ill| ~ c⁻³ underflows: 0 is the float answer
        assert np.all(np.abs(r_ill_grad(c * S)) < 1e-300)
    else:  # ... or overflows: an error, never ±inf
        with pytest.raises(SpectrumError):
            r_ill_grad(c * S)


@pytest.mark.parametrize(
    "S,f",
    [
        (np.diag([1e200, 3e199]), r_well),
        (np.diag([1e308, 1.0]), r_well),
        (np.diag([3e-160, 1e-160]), r_ill),
        (np.diag([1e-170, 1e-171]), r_ill),
    ],
)
def test_regularizers_outside_float64_are_errors_not_nan_or_inf(S, f):
    """R_well(diag(1e200, 3e199)) ~ 1e400 came out NaN, R_ill(diag(3e-160, 1e-160)) ~ 5e319 inf."""
    with pytest.raises(SpectrumError):
        f(S)


def _deep_error():
    from pycore.deep import NonFiniteLossError

    return NonFiniteLossError("lr", "loss is NaN", 7)


def _op_error():
    from pycore.ops import CondRegError

    return CondRegError("Z", "Z is sparse")


@pytest.mark.parametrize(
    "make",
    [
        lambda: ParameterError("lambda_h", "too large"),
        lambda: DivergenceError("lr", "θ is NaN"),
        lambda: SpectrumError("X_P is zero"),
        _deep_error,
        _op_error,
    ],
    ids=[
        "ParameterError",
        "DivergenceError",
        "SpectrumError",
        "NonFiniteLossError",
        "CondRegError",
    ],
)
def test_exceptions_cross_process_boundaries_as_themselves(make):
    """Every error that carries ``.parameter`` takes it first and keeps it through a pickle."""
    exc = make()
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and back.args == exc.args and back.__dict__ == exc.__dict__
    if hasattr(exc, "parameter"):
        assert back.parameter == exc.parameter != str(exc)
