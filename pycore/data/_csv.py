"""Reading a CSV table: its header, its columns as categoricals, their numbers and texts.

What :func:`pycore.data.load_table` builds its tasks from (:mod:`pycore.data._table`): every
problem of a file is a ``ValueError`` naming the file, the column and the line. Memory: the
header's width is capped before pandas pads every row to it; columns are read as categoricals.
"""

from __future__ import annotations

import codecs
import csv
import io
import warnings
from collections import defaultdict

import numpy as np

from pycore import limits
from pycore._validation import (
    OUTLIER_FACTOR,
    OutlierWarning,
    ParameterError,
    check_regular_file,
    outliers,
)

# The cells read as empty (pandas' default missing-value marks but its spellings of NaN): the
# Kaggle file marks missing values "NA" (and "None"); a "nan" cell is a non-finite number, refused
# as "inf" is, not an empty cell set to 0.
MISSING_MARKS = (
    "",
    "#N/A",
    "#N/A N/A",
    "#NA",
    "-1.#IND",
    "-1.#QNAN",
    "1.#IND",
    "1.#QNAN",
    "<NA>",
    "N/A",
    "NA",
    "NULL",
    "None",
    "n/a",
    "null",
)


def read_header(path) -> list[str]:
    """The column names of a CSV file's first non-blank record.

    A quoted name may hold a line break, as pandas reads it. A ``ValueError`` naming the file when
    it is binary, wider than :data:`pycore.limits.MAX_COLUMNS` or repeats a name (pandas would read
    a second ``SalePrice`` as the input ``SalePrice.1``).
    """
    check_regular_file(path, "expected a CSV table")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limits.MAX_HEADER_BYTES + 1)
        # a multi-byte character cut at the end of the buffer is not an error
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(raw, final=False)
        lines = io.StringIO(text, newline="").readlines()  # split at \n, \r, \r\n only
        reader = csv.reader(lines)
        names = next((row for row in reader if row), [])  # pandas skips blank lines too
        used = "".join(lines[: reader.line_num])
        if "\x00" in used:
            raise ValueError("binary data (NUL bytes) in the header line")
    except (OSError, csv.Error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: cannot be read as CSV ({type(exc).__name__}: {exc})") from None
    if len(names) > limits.MAX_COLUMNS:
        raise ValueError(
            f"{path}: the header has more than {limits.MAX_COLUMNS} columns "
            "(pycore.limits.MAX_COLUMNS), refused before reading the rows"
        )
    if len(raw) > limits.MAX_HEADER_BYTES and reader.line_num >= len(lines):
        raise ValueError(f"{path}: the header line is longer than {limits.MAX_HEADER_BYTES} bytes")
    if not any(n.strip() for n in names):
        raise ValueError(f"{path}: is empty (no header line)")
    for sep in (";", "\t", "|") if len(names) == 1 else ():
        if sep in names[0]:
            raise ValueError(
                f"{path}: the header has a single column; the file looks {sep!r}-separated, "
                "expected a comma-separated CSV"
            )
    empty = [i for i, n in enumerate(names) if not n.strip()]
    if empty:
        raise ValueError(
            f"{path}: column {empty[0] + 1} of the header has an empty name"
            + (f" ({len(empty)} columns in all)" if len(empty) > 1 else "")
            + "; every column needs a name (a CSV written with pandas' index: index=False)"
        )
    dups = sorted({n for n in names if names.count(n) > 1}, key=names.index)
    if dups:
        raise ValueError(
            f"{path}: duplicated column name(s) {', '.join(map(repr, dups))} in the header"
        )
    return names


def read_columns(path, names, text_column=None):
    """Every column as a pandas categorical.

    ``text_column`` keeps its cells' text (``"01"`` ≠ ``"1"``).
    """
    import pandas as pd

    try:
        with warnings.catch_warnings():
            # rows longer than the header: pandas drops the extra cells with a ParserWarning
            warnings.simplefilter("error", pd.errors.ParserWarning)
            dtype = defaultdict(
                lambda: "category", {} if text_column is None else {text_column: str}
            )
            df = pd.read_csv(
                path,
                dtype=dtype,
                index_col=False,
                keep_default_na=False,
                na_values=list(MISSING_MARKS),
            )
    except Exception as exc:  # pandas raises several types for unreadable files
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{path}: cannot be read as CSV ({type(exc).__name__}: {first})"
        ) from None
    if len(df) == 0:
        raise ValueError(f"{path}: no data rows")
    if len(df.columns) != len(names):
        raise ValueError(
            f"{path}: pandas read {len(df.columns)} columns, the header line has {len(names)}"
        )
    df.columns = names
    if text_column is not None:
        df[text_column] = df[text_column].astype("category")
    return df


class Column:
    """One column of a file: category codes (−1 = empty), the distinct texts and their numbers."""

    def __init__(self, df, name, path):
        import pandas as pd

        cat = df[name].cat
        self.name, self.path, self.codes, self._values = name, path, cat.codes.to_numpy(), None
        self.texts = np.asarray(cat.categories, dtype=object)
        self.numbers = pd.to_numeric(self.texts, errors="coerce").astype(np.float64)
        # "nan" is a number, a non-finite one (values() refuses it as it refuses "inf")
        spelled_nan = np.array([str(t).strip().lstrip("+-").lower() == "nan" for t in self.texts])
        self.junk = np.isnan(self.numbers) & ~spelled_nan.astype(bool)
        counts = np.bincount(self.codes[self.codes >= 0], minlength=self.texts.size)
        self.numeric = not self.junk.any()
        # mostly numbers with some text: a corrupt numeric column, not a category
        self.corrupt = 0 < counts[self.junk].sum() < 0.5 * counts.sum()

    def _first(self, bad_texts) -> str:
        i = int(np.flatnonzero(bad_texts[self.codes] & (self.codes >= 0))[0])
        return f"{self.texts[self.codes[i]]!r} (line {i + 2})"

    def check_input(self) -> bool:
        """Whether the column is numeric; refuses a corrupt numeric one naming its first text."""
        if self.corrupt:
            raise ValueError(
                f"{self.path}: column {self.name!r} is numeric but has non-numeric value "
                f"{self._first(self.junk)}"
            )
        return self.numeric

    def values(self) -> np.ndarray:
        """float64 per row, NaN where empty.

        Refuses a non-numeric or non-finite cell naming its line.
        """
        if self._values is None:
            for bad, what in (
                (self.junk, "non-numeric"),
                (~np.isfinite(self.numbers), "non-finite"),
            ):
                if bad.any():
                    raise ValueError(
                        f"{self.path}: column {self.name!r} has {what} value {self._first(bad)}"
                    )
            self._values = np.append(self.numbers, np.nan)[self.codes]  # code −1 (empty) → NaN
        return self._values

    def labels(self, rows) -> np.ndarray:
        """Label codes of ``rows``.

        Ranks of their texts in code-point order (``sorted``, as scikit-learn's LabelEncoder), an
        empty cell counting as the text "0".
        """
        c = self.codes[rows].astype(np.int64) + 1  # 0 = empty
        present = np.flatnonzero(np.bincount(c, minlength=self.texts.size + 1))
        texts = ["0" if k == 0 else self.texts[k - 1] for k in present]
        rank = {t: i for i, t in enumerate(sorted(set(texts)))}
        lut = np.zeros(self.texts.size + 1)
        lut[present] = [rank[t] for t in texts]
        return lut[c]


_TINY_STD = float(np.sqrt(np.finfo(np.float64).tiny))


def zscore(A: np.ndarray) -> np.ndarray:
    """Column z-scores in place (docs/theory.md §9).

    A constant column (``ptp == 0``: a rounded mean would leave ±1 from std ~1e-17) becomes exactly
    0; columns whose sums overflow, or whose squares underflow (std below √tiny ≈ 1.5e-154: cells
    near 1e-310 gave std 0), use ``A/max|A|``.
    """
    constant = np.ptp(A, axis=0) == 0
    mean, std = np.empty(A.shape[1]), np.empty(A.shape[1])
    with np.errstate(over="ignore", invalid="ignore"):
        for a in range(0, A.shape[1], 16):  # std's temporary: 16 columns at a time, the same sums
            mean[a : a + 16], std[a : a + 16] = (
                A[:, a : a + 16].mean(axis=0),
                A[:, a : a + 16].std(axis=0),
            )
    huge = ~(np.isfinite(mean) & np.isfinite(std)) | (~constant & (std < _TINY_STD))
    if huge.any():
        As = A[:, huge] / np.max(np.abs(A[:, huge]), axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):  # a constant column is zeroed below
            A[:, huge] = (As - As.mean(axis=0)) / As.std(axis=0)
        mean[huge], std[huge] = 0.0, 1.0
    std[constant] = 1.0
    A -= mean
    A /= std
    A[:, constant] = 0.0
    return A


def check_outliers(col: Column, v: np.ndarray, on_outlier: str) -> None:
    """Warn about (or refuse) a cell beyond OUTLIER_FACTOR × its column's median magnitude.

    The median is over the column's nonzero magnitudes.
    """
    idx = outliers(v) if on_outlier != "ignore" else ()
    if len(idx) == 0:
        return
    a, i = np.abs(v), int(idx[0])
    median = float(np.median(a[np.isfinite(a) & (a > 0)]))
    msg = (
        f"{col.path}: column {col.name!r} has {v[i]} (line {i + 2}), {a[i] / median:.1e} "
        "× the median "
        f"magnitude of its nonzero cells ({median:g}; rule: > {OUTLIER_FACTOR:g}×): "
        "after z-scoring every "
        "other row of the column would be nearly constant"
        + (f"; {len(idx) - 1} more such cell(s) in the column" if len(idx) > 1 else "")
    )
    if on_outlier == "error":
        raise ValueError(msg)
    warnings.warn(msg, OutlierWarning, stacklevel=3)


def split_rows(col: Column, value: str) -> np.ndarray:
    """Rows whose cell reads ``value``.

    Its text, else (an all-numeric column) its number; a :class:`ParameterError` listing the
    column's values when none does.
    """
    hit = col.texts == value
    if not hit.any() and col.numeric:
        try:
            hit = col.numbers == float(value)
        except ValueError:
            pass
    if not hit.any():
        counts = np.bincount(col.codes[col.codes >= 0], minlength=col.texts.size)
        order = np.argsort(-counts, kind="stable")[:10]
        shown = ", ".join(f"{col.texts[i]!r} ({counts[i]} rows)" for i in order)
        raise ParameterError(
            "split",
            f"{col.path}: no row has {col.name} = {value!r}; its values: {shown}"
            + (f" and {col.texts.size - 10} more" if col.texts.size > 10 else ""),
        )
    return np.isin(col.codes, np.flatnonzero(hit))
