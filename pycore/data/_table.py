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
paper's House Prices inputs hold it).  Reading the file: :mod:`pycore.data._csv`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from pycore._tasks import LOSSES, LinearTask
from pycore._validation import (
    ParameterError,
    check_choice,
    check_dense_size,
    check_number,
    check_rng,
)
from pycore.data._csv import (
    Column,
    check_outliers,
    read_columns,
    read_header,
    split_rows,
    zscore,
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


@dataclass(frozen=True)
class TableSpec:
    """What :func:`load_table` reads from a table, and what it does with bad cells.

    Attributes
    ----------
    target_p : str
        D_P's target column.
    target_h : str, optional
        D_H's target column (default ``target_p``).
    inputs : str or sequence of str, optional
        The input columns in θ's order; default every all-numeric column but the targets and the
        split column (a text column only when named).
    split : str, optional
        ``"COLUMN=VALUE"``: D_H is the rows whose cell reads VALUE (its text, or its number in an
        all-numeric column: ``1`` finds ``1.0``); exactly one of ``split`` and ``harmful_path``.
    harmful_path : path, optional
        A second file holding D_H (D_P is then the first file).
    n_train : int, default 200
        Training rows per split; the rest are held out.
    on_outlier : {"warn", "error", "ignore"}, default "warn"
        What a cell far beyond its column's magnitude does.
    on_missing : {"fill", "error"}, default "fill"
        Empty input cells set to 0, or refused.
    loss : {"mse", "bce"}, default "mse"
        D_P's loss (:class:`pycore.LinearTask`); ``"bce"`` keeps D_P's target as 0/1 labels.
    name : str, optional
        The tasks' name (default the file's stem).
    """

    target_p: str
    target_h: str | None = None
    inputs: object = None
    split: str | None = None
    harmful_path: object = None
    n_train: int = 200
    on_outlier: str = "warn"
    on_missing: str = "fill"
    loss: str = "mse"
    name: str | None = None

    @classmethod
    def of(cls, spec, options: dict) -> TableSpec:
        """``spec``, or one built from keyword ``options``; an unknown one is a ParameterError."""
        names = [f.name for f in fields(cls)]
        if spec is not None:
            if not isinstance(spec, TableSpec) or options:
                raise ParameterError("spec", "give a TableSpec or keyword options, not both")
            return spec
        for key in options:
            if key not in names:
                raise ParameterError(
                    key, f"load_table has no option {key!r}; its options are: {', '.join(names)}"
                )
        if "target_p" not in options:
            raise ParameterError("target_p", "load_table needs target_p, D_P's target column")
        return cls(**options)


def load_table(path, spec: TableSpec | None = None, *, rng=None, **options) -> TableData:
    """The tasks of a CSV table (the module docstring's :class:`TableData`).

    Parameters
    ----------
    path : path
        The CSV file (D_P and D_H, or D_P alone with ``harmful_path``).
    spec : TableSpec, optional
        What to read; or give its fields as keyword ``options``.
    rng : numpy.random.Generator, optional
        Draws each split's training rows; None: the first ``n_train`` in file order.
    **options
        The fields of :class:`TableSpec` (``target_p`` at least, and one of ``split`` and
        ``harmful_path``).

    Returns
    -------
    TableData
        The training and held-out tasks, the inputs in θ's order, and every change made to the
        data.

    Raises
    ------
    ParameterError
        A bad argument (a split that matches no row, a split smaller than ``n_train``, a column
        that is not in the file); ``.parameter`` names it. Splits below ``n_train`` and every
        target's first bad or empty cell are reported together, in one error.
    ValueError
        A bad file, naming the file, the column and the line.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from pycore.data import load_table
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = pathlib.Path(folder.name) / "t.csv"
    >>> rows = [f"{i},{i % 3},{i * i % 7},{'h' if i % 2 else 'p'}" for i in range(24)]
    >>> _ = path.write_text(chr(10).join(["a,b,y,g", *rows]) + chr(10))
    >>> d = load_table(path, target_p="y", split="g=h", n_train=8)
    >>> d.feature_names, d.train.X_P.shape, d.heldout.X_H.shape
    (['a', 'b'], (8, 2), (4, 2))
    >>> folder.cleanup()
    """
    spec = TableSpec.of(spec, options)
    inputs, split_col, split_value = _checked_arguments(spec, rng)
    files = [Path(path)] + ([] if spec.harmful_path is None else [Path(spec.harmful_path)])
    headers = [read_header(p) for p in files]
    _check_named_columns(files, headers, spec, split_col, inputs)
    cols = _Columns([read_columns(p, h, split_col) for p, h in zip(files, headers)], files, spec)
    defaulted = inputs is None
    if defaulted:
        inputs = _default_inputs(cols, headers[0], spec, split_col)
    targets = (spec.target_p, spec.target_h or spec.target_p)
    dropped = [c for c in headers[0] if c not in (*targets, split_col, *inputs)]
    parts, where, blank_split = _splits(cols, split_col, split_value)
    for f, df in enumerate(cols.frames):
        check_dense_size((len(df), len(inputs)), f"{files[f]}: the inputs of its {len(df)} rows")
    parts, y = _targets(cols, parts, where, spec, rng)
    binary = bool(np.isin(y["P"], (0.0, 1.0)).all() and np.unique(y["P"]).size == 2)
    if spec.loss == "bce" and not binary:
        raise ParameterError(
            "loss",
            f"{files[0]}: loss 'bce' needs D_P's target {spec.target_p!r} to hold the labels 0 "
            f"and 1 only; it holds {', '.join(f'{v:g}' for v in np.unique(y['P'])[:6])}",
        )
    X, filled, missing, encoded = _input_matrices(cols, parts, inputs, defaulted)
    _standardize(X, y, parts, where, cols)
    name, n_train = spec.name or files[0].stem, spec.n_train

    def task(rows: slice, suffix: str = "") -> LinearTask:
        return LinearTask(
            X["P"][rows], y["P"][rows], X["H"][rows], y["H"][rows], spec.loss, name + suffix
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


def _checked_arguments(spec: TableSpec, rng):
    """``(inputs or None, split column, split value)``, every argument checked first."""
    target_p = spec.target_p
    target_h = target_p if spec.target_h is None else spec.target_h
    check_number(spec.n_train, "n_train", low=2, integer=True)
    check_choice(spec.on_outlier, "on_outlier", ON_OUTLIER)
    check_choice(spec.on_missing, "on_missing", ON_MISSING)
    check_choice(spec.loss, "loss", LOSSES)
    check_rng(rng, none_ok=True)
    split = spec.split
    if (split is None) == (spec.harmful_path is None):
        raise ParameterError("split", "give exactly one of split='COLUMN=VALUE' and harmful_path")
    if split is not None and (
        not isinstance(split, str) or "=" not in split or split.startswith("=")
    ):
        raise ParameterError("split", f"split must look like COLUMN=VALUE, got {split!r}")
    split_col, split_value = split.split("=", 1) if split is not None else (None, None)
    inputs = spec.inputs
    if inputs is not None:
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        bad = [c for c in inputs if c in (target_p, target_h) or inputs.count(c) > 1]
        if not inputs or bad:
            raise ParameterError(
                "inputs",
                "inputs must be distinct columns other than the targets, got "
                f"{', '.join(map(repr, bad)) or 'none'}",
            )
    return inputs, split_col, split_value


def _check_named_columns(files, headers, spec, split_col, inputs) -> None:
    """A ParameterError naming the argument of a column its file lacks."""
    target_h = spec.target_p if spec.target_h is None else spec.target_h
    named = [
        ("target_p", [spec.target_p], 0),
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


class _Columns:
    """The files' columns, each parsed once and checked for outliers once, dropped when used."""

    def __init__(self, frames, files, spec: TableSpec):
        self.frames, self.files, self.spec = frames, files, spec
        self.cache, self.checked = {}, set()

    def get(self, f: int, c: str, *, numbers: bool = False) -> Column:
        if (f, c) not in self.cache:
            self.cache[f, c] = Column(self.frames[f], c, self.files[f])
        if numbers and (f, c) not in self.checked:  # outliers: once per column of a file
            self.checked.add((f, c))
            check_outliers(self.cache[f, c], self.cache[f, c].values(), self.spec.on_outlier)
        return self.cache[f, c]

    def drop(self, f: int, c: str) -> None:
        del self.cache[f, c]  # one column's numbers at a time


def _default_inputs(cols: _Columns, header, spec: TableSpec, split_col) -> list[str]:
    """Every all-numeric column but the targets and the split column."""
    skip = (spec.target_p, spec.target_h or spec.target_p, split_col)
    inputs = [c for c in header if c not in skip and cols.get(0, c).check_input()]
    if not inputs:
        raise ParameterError(
            "inputs",
            f"{cols.files[0]}: no numeric column besides the targets and the split "
            "column; name the inputs",
        )
    return inputs


def _splits(cols: _Columns, split_col, split_value):
    """``[(task, file, rows)]`` of D_P and D_H, how each is described, the blank split cells."""
    files = cols.files
    if split_col is None:
        parts = [
            ("P", 0, np.arange(len(cols.frames[0]))),
            ("H", 1, np.arange(len(cols.frames[1]))),
        ]
        return parts, {"P": f"file {files[0]}", "H": f"file {files[1]}"}, 0
    column = cols.get(0, split_col)
    is_h = split_rows(column, split_value)
    blank_split = int((column.codes < 0).sum())  # counted in D_P, and said
    parts = [("P", 0, np.flatnonzero(~is_h)), ("H", 0, np.flatnonzero(is_h))]
    where = {"P": f"{split_col} ≠ {split_value!r}", "H": f"{split_col} = {split_value!r}"}
    return parts, where, blank_split


def _targets(cols: _Columns, parts, where, spec: TableSpec, rng):
    """The parts in training order and each task's target, every problem of them in one error.

    A split below ``n_train``, and per target its first bad or empty cell, or a target constant
    on its training rows (a file fixed for one problem would fail on the next).
    """
    files, n_train = cols.files, spec.n_train
    problems = {
        f"{files[f]}: D_{s} ({where[s]}) has {rows.size} rows, fewer than the "
        f"n_train = {n_train} training rows asked for per split": "n_train"
        for s, f, rows in parts
        if rows.size < n_train
    }
    if rng is not None:
        parts = [(s, f, rows[rng.permutation(rows.size)]) for s, f, rows in parts]
    y = {}
    empty = {}  # (file, target) → [(first empty line, split)]: one problem per file, in line order
    for s, f, rows in parts:
        target = spec.target_p if s == "P" else (spec.target_h or spec.target_p)
        try:
            y[s] = cols.get(f, target, numbers=True).values()[rows]
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
    for (f, target), at in empty.items():
        lines = ", ".join(f"line {line} (D_{s}: {where[s]})" for line, s in sorted(at))
        problems.setdefault(f"{files[f]}: target column {target!r} is empty at {lines}")
    if problems:
        message = "; ".join(problems)
        if "n_train" in problems.values():
            raise ParameterError("n_train", message)
        raise ValueError(message)
    return parts, y


def _input_matrices(cols: _Columns, parts, inputs, defaulted):
    """Each task's raw input matrix, empty cells 0 and named text columns label-encoded.

    Returns the matrices and the counts of filled cells (per task, per column) and the encoded
    columns.
    """
    X = {s: np.empty((rows.size, len(inputs))) for s, _, rows in parts}
    filled, missing, encoded = dict.fromkeys(X, 0), {}, []
    for j, c in enumerate(inputs):
        for f in range(len(cols.files)):  # each column of a file is parsed once for both splits
            # a defaulted input must be numeric
            text = not cols.get(f, c).check_input() and not defaulted
            v = None if text else cols.get(f, c, numbers=True).values()
            if text and c not in encoded:
                encoded.append(c)
            codes = cols.cache[f, c].codes
            used = np.concatenate([rows for _, g, rows in parts if g == f])
            if cols.spec.on_missing == "error" and (codes[used] < 0).any():
                raise ValueError(
                    f"{cols.files[f]}: input column {c!r} is empty at line "
                    f"{used[codes[used] < 0].min() + 2} (on_missing='error'; "
                    "'fill' sets empty input cells to 0)"
                )
            for s, _, rows in (part for part in parts if part[1] == f):
                # an empty text cell is the text "0" (the authors' fillna(0) before encoding)
                empty = codes[rows] < 0
                filled[s] += int(empty.sum())
                missing[c] = missing.get(c, 0) + int(empty.sum())
                col = cols.cache[f, c]
                X[s][:, j] = col.labels(rows) if text else np.where(empty, 0.0, v[rows])
            cols.drop(f, c)
    return X, filled, missing, encoded


def _standardize(X, y, parts, where, cols: _Columns) -> None:
    """Every input and target z-scored per task in place (D_P's 0/1 labels kept for BCE).

    A task whose inputs are all constant on its training or held-out rows is refused: its κ and
    the RIR would be undefined.
    """
    n_train = cols.spec.n_train
    for s, f, rows in parts:
        keep = s == "P" and cols.spec.loss == "bce"
        X[s], y[s] = zscore(X[s]), y[s][:, None] if keep else zscore(y[s][:, None])
        for part, block in (("training", X[s][:n_train]), ("held-out", X[s][n_train:])):
            if block.shape[0] > 1 and not np.any(block):
                raise ValueError(
                    f"{cols.files[f]}: every input column is constant on the {block.shape[0]} "
                    f"{part} rows of D_{s} ({where[s]}): X_{s} is zero after z-scoring, so its "
                    "κ and the RIR are undefined"
                )
