"""A CSV table of the user's own as the two tasks of docs/theory.md §1.

Each split is preprocessed as docs/theory.md §9 says.

D_H = the rows whose column has a given text (``split="COLUMN=VALUE"``), D_P = the others (a row
whose split cell is empty among them, counted); or two files.  Per split: empty input cells
(empty, or one of :data:`MISSING_MARKS` such as ``NA``) → 0 on the raw scale (counted per column;
``on_missing="error"`` refuses them), text inputs label-encoded (code-point order, as
scikit-learn's LabelEncoder; named ones only, listed), then every column z-scored with the mean
and population std of ALL the split's rows, training and held-out alike (the paper's protocol,
docs/theory.md §9; a constant column → 0); training rows the first ``n_train`` of each split in
file order (the authors' code: the same rows for every seed) or drawn with ``rng``.  D_P's target
is z-scored for the squared loss and kept as its 0/1 labels for ``loss="bce"``.  A cell reading
``nan`` or ``inf`` is refused, not filled; so is a target constant on a split's training rows.
Every change to the user's data is recorded in :class:`TableData` (``missing``, ``encoded``,
``dropped``, ``blank_split``), and the split column named as an input is said (``split_input``:
it is constant on D_H, so it is 0 there after z-scoring and informs D_P's features alone; the
paper's House Prices inputs hold it).  Memory: the header's
width is capped before pandas pads every row to it; columns are read as categoricals.
"""

from __future__ import annotations

import codecs
import csv
import io
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pycore import limits
from pycore._tasks import LinearTask
from pycore._validation import (
    OUTLIER_FACTOR,
    OutlierWarning,
    ParameterError,
    check_choice,
    check_dense_size,
    check_number,
    check_regular_file,
    check_rng,
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
ON_OUTLIER = ("warn", "error", "ignore")
ON_MISSING = ("fill", "error")


@dataclass(frozen=True)
class TableData:
    """The tasks of a table, its inputs in θ's order, and what was changed in the data.

    The tasks (``heldout``: None below two rows), inputs in θ's order, and what was changed in
    the user's data before use: ``filled`` empty input cells per split and ``missing`` per column
    (set to 0), ``encoded`` the text columns label-encoded, ``dropped`` the non-numeric columns
    left out of the default inputs, ``blank_split`` the rows whose split column is empty (they are
    D_P's: their cell does not read the split's value); ``binary_target_p``: D_P's target holds
    only 0 and 1; ``split_input``: the split column is one of the inputs (constant on D_H).
    """

    train: LinearTask
    heldout: LinearTask | None
    feature_names: list[str]
    source: str
    n_rows_P: int
    n_rows_H: int
    filled: dict
    missing: dict = field(default_factory=dict)
    encoded: tuple = ()
    dropped: tuple = ()
    binary_target_p: bool = False
    blank_split: int = 0
    split_column: str | None = None
    split_input: bool = False

    def changes(self) -> dict:
        """What was changed in the data before use (results.json's record)."""
        return {
            "missing_cells_filled_with_0": dict(self.missing),
            "filled_per_split": dict(self.filled),
            "label_encoded_text_columns": list(self.encoded),
            "dropped_non_numeric_columns": list(self.dropped),
            "empty_split_cells_in_D_P": self.blank_split,
            "split_column_is_an_input": self.split_input,
        }

    def changes_line(self) -> str | None:
        """One line counting the changes (None when the data was used as it is)."""
        n, items = sum(self.missing.values()), list(self.missing.items())
        parts = (
            [
                f"{n} empty input cell(s) set to 0 ("
                + ", ".join(f"{c!r}: {k}" for c, k in items[:8])
                + (f", … {len(items)} columns in all" if len(items) > 8 else "")
                + ")"
            ]
            if n
            else []
        )
        if self.blank_split:
            parts.append(
                f"{self.blank_split} row(s) with an empty {self.split_column!r} cell put in D_P"
            )
        if self.split_input:
            parts.append(
                f"the split column {self.split_column!r} is an input (constant on D_H: 0 there "
                "after z-scoring, it informs D_P's features alone)"
            )
        for cols, what in (
            (self.encoded, "text column(s) label-encoded"),
            (self.dropped, "non-numeric column(s) left out of the inputs"),
        ):
            if cols:
                shown = ", ".join(map(repr, cols[:8])) + (" …" if len(cols) > 8 else "")
                parts.append(f"{len(cols)} {what} ({shown})")
        return f"{self.source}: " + "; ".join(parts) if parts else None


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


def _read(path, names, text_column=None):
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


class _Column:
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


def _zscore(A: np.ndarray) -> np.ndarray:
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


def _check_outliers(col: _Column, v: np.ndarray, on_outlier: str) -> None:
    """Warn about (or refuse) a cell beyond OUTLIER_FACTOR × its column's median magnitude.

    Warn about (or refuse) a cell beyond OUTLIER_FACTOR × the column's median nonzero
    magnitude.
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


def load_table(
    path,
    *,
    target_p: str,
    target_h: str | None = None,
    inputs=None,
    split: str | None = None,
    harmful_path=None,
    n_train: int = 200,
    rng: np.random.Generator | None = None,
    on_outlier: str = "warn",
    on_missing: str = "fill",
    loss: str = "mse",
    name: str | None = None,
) -> TableData:
    """The module docstring's :class:`TableData`.

    ``inputs`` (θ's column order): default every all-numeric column but the targets and the split
    column (a text column only when named). ``split``'s VALUE matches a cell's text, or its number
    in an all-numeric column (``1`` finds ``1.0``).  ``loss`` is D_P's
    (:class:`~pycore.LinearTask`).  Bad arguments (a split that matches no row, a split smaller
    than ``n_train``): :class:`ParameterError`; bad files: ``ValueError`` naming file, column,
    line.  Splits below ``n_train`` and every target's first bad or empty cell are reported
    together, in one error (a ``ParameterError`` naming ``n_train`` when a split is too small).
    """
    target_h = target_p if target_h is None else target_h
    check_number(n_train, "n_train", low=2, integer=True)
    check_choice(on_outlier, "on_outlier", ON_OUTLIER)
    check_choice(on_missing, "on_missing", ON_MISSING)
    check_choice(loss, "loss", ("mse", "bce"))
    check_rng(rng, none_ok=True)
    if (split is None) == (harmful_path is None):
        raise ParameterError("split", "give exactly one of split='COLUMN=VALUE' and harmful_path")
    if split is not None and (
        not isinstance(split, str) or "=" not in split or split.startswith("=")
    ):
        raise ParameterError("split", f"split must look like COLUMN=VALUE, got {split!r}")
    split_col, split_value = split.split("=", 1) if split is not None else (None, None)
    defaulted = inputs is None
    if not defaulted:
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        bad = [c for c in inputs if c in (target_p, target_h) or inputs.count(c) > 1]
        if not inputs or bad:
            raise ParameterError(
                "inputs",
                "inputs must be distinct columns other than the targets, got "
                f"{', '.join(map(repr, bad)) or 'none'}",
            )
    files = [Path(path)] + ([] if harmful_path is None else [Path(harmful_path)])
    headers = [read_header(p) for p in files]
    named = [
        ("target_p", [target_p], 0),
        ("target_h", [target_h], -1),
        ("split", [split_col], 0),
        ("inputs", inputs or [], 0),
        ("inputs", inputs or [], -1),
    ]
    for param, cols, f in named:
        missing = [c for c in cols if c is not None and c not in headers[f]]
        if missing:
            shown = ", ".join(headers[f][:20]) + (" ..." if len(headers[f]) > 20 else "")
            raise ParameterError(
                param,
                f"{files[f]}: no column {', '.join(map(repr, missing))} ({param}); "
                f"its columns: {shown}",
            )
    frames = [_read(p, h, split_col) for p, h in zip(files, headers)]
    cache, checked = {}, set()

    def column(f, c, *, numbers=False) -> _Column:
        if (f, c) not in cache:
            cache[f, c] = _Column(frames[f], c, files[f])
        if numbers and (f, c) not in checked:  # outliers: once per column of a file
            checked.add((f, c))
            _check_outliers(cache[f, c], cache[f, c].values(), on_outlier)
        return cache[f, c]

    if defaulted:
        inputs = [
            c
            for c in headers[0]
            if c not in (target_p, target_h, split_col) and column(0, c).check_input()
        ]
        if not inputs:
            raise ParameterError(
                "inputs",
                f"{files[0]}: no numeric column besides the targets and the split "
                "column; name the inputs",
            )
    dropped = [c for c in headers[0] if c not in (target_p, target_h, split_col, *inputs)]
    blank_split = 0
    if split_col is not None:
        is_h = _split_rows(column(0, split_col), split_value)
        blank_split = int((column(0, split_col).codes < 0).sum())  # counted in D_P, and said
        parts = [("P", 0, np.flatnonzero(~is_h)), ("H", 0, np.flatnonzero(is_h))]
        where = {"P": f"{split_col} ≠ {split_value!r}", "H": f"{split_col} = {split_value!r}"}
    else:
        parts = [("P", 0, np.arange(len(frames[0]))), ("H", 1, np.arange(len(frames[1])))]
        where = {"P": f"file {files[0]}", "H": f"file {files[1]}"}
    for f, df in enumerate(frames):
        check_dense_size((len(df), len(inputs)), f"{files[f]}: the inputs of its {len(df)} rows")
    # every problem of the splits and targets in one error (a file fixed for one then failed on
    # the next): a split below n_train, and per target its first bad or empty cell
    problems = {
        f"{files[f]}: D_{s} ({where[s]}) has {rows.size} rows, fewer than the "
        f"n_train = {n_train} training rows asked for per split": "n_train"
        for s, f, rows in parts
        if rows.size < n_train
    }
    if rng is not None:
        parts = [(s, f, rows[rng.permutation(rows.size)]) for s, f, rows in parts]
    X, y, filled, missing, encoded = {}, {}, {}, {}, []
    empty = {}  # (file, target) → [(first empty line, split)]: one problem per file, in line order
    for s, f, rows in parts:
        target = target_p if s == "P" else target_h
        try:
            y[s] = column(f, target, numbers=True).values()[rows]
        except ValueError as exc:
            problems.setdefault(str(exc), None)
            continue
        if np.isnan(y[s]).any():
            empty.setdefault((f, target), []).append((rows[np.isnan(y[s])].min() + 2, s))
        elif y[s].size > 1 and np.ptp(y[s][:n_train]) == 0:  # nothing to fit or probe
            problems.setdefault(
                f"{files[f]}: target column {target!r} is constant ({y[s][0]:g}) on the "
                f"{min(n_train, y[s].size)} training rows of D_{s} ({where[s]}); a task needs a "
                "target that varies"
            )
        X[s], filled[s] = np.empty((rows.size, len(inputs))), 0
    for (f, target), at in empty.items():
        lines = ", ".join(f"line {line} (D_{s}: {where[s]})" for line, s in sorted(at))
        problems.setdefault(f"{files[f]}: target column {target!r} is empty at {lines}")
    if problems:
        message = "; ".join(problems)
        if "n_train" in problems.values():
            raise ParameterError("n_train", message)
        raise ValueError(message)
    binary = bool(np.isin(y["P"], (0.0, 1.0)).all() and np.unique(y["P"]).size == 2)
    if loss == "bce" and not binary:
        raise ParameterError(
            "loss",
            f"{files[0]}: loss 'bce' needs D_P's target {target_p!r} to hold the labels 0 and "
            f"1 only; it holds {', '.join(f'{v:g}' for v in np.unique(y['P'])[:6])}",
        )
    for j, c in enumerate(inputs):
        for f in range(len(files)):  # each column of a file is parsed once for both splits
            # a defaulted input must be numeric
            text = not column(f, c).check_input() and not defaulted
            v = None if text else column(f, c, numbers=True).values()
            if text and c not in encoded:
                encoded.append(c)
            used = np.concatenate([rows for _, g, rows in parts if g == f])
            if on_missing == "error" and (cache[f, c].codes[used] < 0).any():
                raise ValueError(
                    f"{files[f]}: input column {c!r} is empty at line "
                    f"{used[cache[f, c].codes[used] < 0].min() + 2} (on_missing='error'; "
                    "'fill' sets empty input cells to 0)"
                )
            for s, _, rows in (part for part in parts if part[1] == f):
                # an empty text cell is the text "0" (the authors' fillna(0) before encoding)
                empty = cache[f, c].codes[rows] < 0
                filled[s] += int(empty.sum())
                missing[c] = missing.get(c, 0) + int(empty.sum())
                X[s][:, j] = cache[f, c].labels(rows) if text else np.where(empty, 0.0, v[rows])
            del cache[f, c]  # one column's numbers at a time
    for s, f, rows in parts:
        # D_P's 0/1 labels stay labels for the logistic loss; every other target is z-scored
        keep = s == "P" and loss == "bce"
        X[s], y[s] = _zscore(X[s]), y[s][:, None] if keep else _zscore(y[s][:, None])
        for part, block in (("training", X[s][:n_train]), ("held-out", X[s][n_train:])):
            if block.shape[0] > 1 and not np.any(block):
                raise ValueError(
                    f"{files[f]}: every input column is constant on the {block.shape[0]} {part} "
                    f"rows of D_{s} ({where[s]}): X_{s} is zero after z-scoring, so its κ and "
                    "the RIR are undefined"
                )
    name = name or files[0].stem

    def task(rows: slice, suffix: str = "") -> LinearTask:
        return LinearTask(
            X["P"][rows], y["P"][rows], X["H"][rows], y["H"][rows], loss, name + suffix
        )

    nP, nH = len(X["P"]), len(X["H"])
    heldout = task(slice(n_train, None), "_heldout") if min(nP, nH) > n_train + 1 else None
    return TableData(
        task(slice(n_train)),
        heldout,
        list(inputs),
        ", ".join(map(str, files)),
        nP,
        nH,
        filled,
        {c: k for c, k in missing.items() if k},
        tuple(encoded),
        tuple(dropped) if defaulted else (),
        binary,
        blank_split,
        split_col,
        split_col is not None and split_col in inputs,
    )


def _split_rows(col: _Column, value: str) -> np.ndarray:
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
