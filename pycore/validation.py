"""Input checks shared by the linear core: one clear line per problem, never a deep traceback."""
from __future__ import annotations

import math
import numbers
import os
import stat

import numpy as np


def _rebuild_error(cls, args, state):
    exc = cls.__new__(cls, *args)   # BaseException.__new__: sets .args, runs no __init__
    exc.args = args
    exc.__dict__.update(state)
    return exc


class PicklableError:
    """Mixin for an exception whose ``__init__`` takes more than its message (``ParameterError(
    parameter, message)``): pickle rebuilds it from its ``args`` and attributes without calling
    ``__init__``, so it crosses a process boundary (a worker of a process pool) as itself, with
    ``.parameter`` and the rest.  The default pickling calls ``cls(*args)`` with the message alone,
    which fails for such a signature.  Put it first among the bases."""

    def __reduce__(self):
        return _rebuild_error, (type(self), self.args, dict(self.__dict__))


class ParameterError(PicklableError, ValueError):
    """A parameter value the library cannot use (non-finite, out of range, or one that makes a
    run diverge).  ``parameter`` is the name of the offending field or argument (for example
    ``"lambda_h"``), so that a command-line layer can name the flag the user typed."""

    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


class DivergenceError(PicklableError, FloatingPointError):
    """A run became non-finite (θ, a loss, or optimizer state).  ``parameter`` names the
    setting most likely responsible (for example ``"lambda_h"`` or ``"lr"``), or is None."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def as_float_matrix(A, name: str = "matrix", *, ndim: int = 2) -> np.ndarray:
    """Return ``A`` as a C-contiguous float64 array of ``ndim`` dims, or raise ``ValueError``.

    Rejects non-numeric dtypes (object, strings), the wrong number of dimensions, empty arrays
    and NaN/inf entries, naming the offending argument and, for non-finite values, the first
    offending index.
    """
    arr = np.asarray(A)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{name} contains NaN or inf (first at index {bad})")
    return arr


def as_target(Y, n_rows: int, name: str = "Y") -> np.ndarray:
    """Targets as an ``(N, m)`` float64 matrix with ``N == n_rows``."""
    arr = np.asarray(Y)
    if arr.ndim == 1:
        arr = arr[:, None]
    arr = as_float_matrix(arr, name)
    if arr.shape[0] != n_rows:
        raise ValueError(f"{name} has {arr.shape[0]} rows but the inputs have {n_rows}")
    return arr


def check_square(A: np.ndarray, name: str) -> None:
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"{name} must be square, got shape {A.shape}")


def check_theta(theta, D: int, name: str = "theta") -> np.ndarray:
    """A D×D float64 feature extractor (docs/theory.md §1)."""
    theta = as_float_matrix(theta, name)
    if theta.shape != (D, D):
        raise ValueError(f"{name} must be {D}×{D} to match the data's {D} columns, got shape {theta.shape}")
    return theta


def _interval(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '≥'} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '≤'} {high:g}"
    return ""


def check_number(value, name: str, *, low=None, high=None, low_open: bool = False,
                 high_open: bool = False, integer: bool = False, none_ok: bool = False):
    """``value`` as a finite float (or an int when ``integer``) inside the given interval.

    Raises :class:`ParameterError` naming ``name`` for a non-number, a bool, NaN/inf, a
    non-integer where an integer is needed, or a value outside ``[low, high]`` (open ends with
    ``low_open`` / ``high_open``).  ``None`` passes through when ``none_ok``.
    """
    if value is None and none_ok:
        return None
    shown = value
    kind = "an integer" if integer else "a finite number"
    want = kind + _interval(low, high, low_open, high_open) + (" or None" if none_ok else "")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ParameterError(name, f"{name} must be {want}, got {value!r}")
    if integer:
        if not isinstance(value, numbers.Integral):
            raise ParameterError(name, f"{name} must be {want}, got {value!r}")
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ParameterError(name, f"{name} must be {want}, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ParameterError(name, f"{name} must be {want}, got {shown!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ParameterError(name, f"{name} must be {want}, got {shown!r}")
    return value


def check_choice(value, name: str, choices) -> str:
    """``value`` must be one of ``choices`` (a :class:`ParameterError` naming them otherwise)."""
    if value not in tuple(choices):
        raise ParameterError(name, f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_finite_array(a: np.ndarray, name: str, *, error=None) -> None:
    """Raise (``error`` or :class:`DivergenceError`) if ``a`` holds NaN/inf, naming ``name``."""
    a = np.asarray(a)
    if not np.all(np.isfinite(a)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(a))[0])
        msg = f"{name} contains NaN or inf (first at index {bad})"
        raise (error(msg) if error is not None else DivergenceError(msg))


class OutlierWarning(UserWarning):
    """A data value many orders of magnitude beyond the rest of its column (:func:`outliers`)."""


# A cell this many times the median magnitude of its column's nonzero cells is refused or
# warned about.  On the Kaggle House Prices file the largest ratio is 31 (MiscVal; LotArea 23),
# so 1e6 leaves 4.5 orders of magnitude of margin; and one such cell among N rows has a std of
# ≥ 1e6·m/√N, so every other row's z-score differs from the next by ~√N·1e-6: the column
# becomes an indicator of that one row (a 1e308 cell makes it exactly constant).
OUTLIER_FACTOR = 1e6


def outliers(values, factor: float = OUTLIER_FACTOR) -> np.ndarray:
    """Indices of the finite entries of ``values`` (1-D) whose magnitude exceeds ``factor`` ×
    the median magnitude of the nonzero entries (a robust scale: zeros, common in count columns
    such as PoolArea, are left out, and one huge value cannot move a median).  Empty when
    fewer than two entries are nonzero."""
    a = np.abs(np.asarray(values, dtype=np.float64))
    nz = a[np.isfinite(a) & (a > 0)]
    if nz.size < 2:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.isfinite(a) & (a > factor * np.median(nz)))


# Largest dense float64 array a call of the linear core sets out to allocate (a decomposition's
# factors, a data matrix).  The work those arrays imply (an SVD is O(N·D·min(N,D))) is then
# bounded as well; a 35k × 35k U (10 GB, the full SVD of 35k held-out rows) is refused before
# LAPACK starts, where it could not even be interrupted.
MAX_DENSE_BYTES = 4 << 30   # 4 GiB


def check_dense_size(shape, what: str, *, max_bytes: int | None = None) -> None:
    """Raise ``ValueError`` naming ``what`` and its size if a float64 array of ``shape`` would
    exceed ``max_bytes`` (default :data:`MAX_DENSE_BYTES`, read at call time)."""
    limit = MAX_DENSE_BYTES if max_bytes is None else max_bytes
    nbytes = 8 * math.prod(int(n) for n in shape)
    if nbytes > limit:
        dims = " × ".join(str(int(n)) for n in shape)
        raise ValueError(f"{what}: a {dims} float64 array needs {nbytes / 2**30:.1f} GiB, more than the "
                         f"{limit / 2**30:g} GiB this library allocates at once (pycore.validation."
                         "MAX_DENSE_BYTES); use fewer rows or columns")


# Upper limit on an input file read whole into memory (a CSV table, an IDX image file).  The
# files of this project are ≤ 50 MB; the cap turns /dev/zero, a runaway log or a wrong path
# into an error instead of an unbounded read.
MAX_DATA_FILE_BYTES = 1 << 30  # 1 GiB


def check_regular_file(path, what: str, *, max_bytes: int | None = -1, error=ValueError) -> int:
    """Require ``path`` to be an existing regular file of at most ``max_bytes``; its size.

    ``max_bytes``: default (-1) :data:`MAX_DATA_FILE_BYTES`, read at call time; None = no cap.

    A FIFO, a device (``/dev/zero``), a socket or a directory is refused BEFORE anything is
    opened: reading one would block forever or never end.  A missing path raises
    :class:`FileNotFoundError`; the other problems raise ``error`` (default ``ValueError``).
    """
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: no such file ({what})") from None
    except OSError as exc:
        raise error(f"{p}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{p}: is a directory, expected a file ({what})")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise error(f"{p}: is {kind}, expected a regular file ({what})")
    if max_bytes == -1:
        max_bytes = MAX_DATA_FILE_BYTES
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{p}: is {st.st_size} bytes, larger than the {max_bytes} byte limit ({what})")
    return int(st.st_size)
