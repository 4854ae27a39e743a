"""Input checks shared by the linear core: one clear line per problem, never a deep traceback."""

from __future__ import annotations

import math
import numbers
import os
import stat

import numpy as np

from pycore import limits


def _rebuild_error(cls, args, state):
    exc = cls.__new__(cls, *args)  # BaseException.__new__: sets .args, runs no __init__
    exc.__dict__.update(state)
    return exc


class PicklableError:
    """Mixin (first base) for an exception whose ``__init__`` takes more than its message.

    It crosses a process pool as itself.
    """

    def __reduce__(self):
        return _rebuild_error, (type(self), self.args, dict(self.__dict__))


# Every exception of this package that carries ``.parameter`` takes it FIRST, then the message:
# ``ParameterError("lr", "lr must be > 0")``, ``DivergenceError("lambda_h", "θ overflowed")``,
# ``pycore.ops.CondRegError("Z", ...)``, ``pycore.deep.NonFiniteLossError("lr", ..., step)``.


class ParameterError(PicklableError, ValueError):
    """A parameter value the library cannot use.

    Parameters
    ----------
    parameter : str
        The argument or option at fault, kept as ``.parameter`` so that a command line can name
        the flag the user typed.
    message : str
        One line saying what is wrong (``str(exc)``).
    """

    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


class DivergenceError(PicklableError, FloatingPointError):
    """A run became non-finite.

    Parameters
    ----------
    parameter : str or None
        The setting most likely responsible (``.parameter``), or None when none is.
    message : str
        One line saying where and how it diverged.
    """

    def __init__(self, parameter: str | None, message: str):
        super().__init__(message)
        self.parameter = parameter


def check_dense_size(shape, what: str) -> None:
    """A ``ValueError`` naming ``what`` if a float64 ``shape`` exceeds the dense limit.

    ``ValueError`` naming ``what`` if a float64 ``shape`` exceeds
    :data:`pycore.limits.MAX_DENSE_BYTES`.
    """
    limit, nbytes = limits.MAX_DENSE_BYTES, 8 * math.prod(int(n) for n in shape)
    if nbytes > limit:
        raise ValueError(
            f"{what}: a {' × '.join(str(int(n)) for n in shape)} float64 array needs "
            f"{nbytes / 2**30:.1f} GiB, more than the {limit / 2**30:g} GiB this library "
            "allocates at once (pycore.limits.MAX_DENSE_BYTES); use fewer rows or columns"
        )


def check_work(D: int, rows: int, squares: float, row_blocks: float, what: str) -> int:
    """The bytes of the D×D and N×D float64 arrays ``what`` holds at once, checked.

    The bytes ``8·D·(squares·D + row_blocks·rows)`` of the D×D and N×D float64 arrays ``what``
    holds at once, or a ``ValueError`` naming ``what``, D and the bytes when they exceed
    :data:`pycore.limits.MAX_WORK_BYTES` (read at call time): refused before the first array is
    allocated.
    """
    D, rows = int(D), int(rows)
    nbytes = int(8 * D * (squares * D + row_blocks * rows))
    if nbytes > limits.MAX_WORK_BYTES:
        raise ValueError(
            f"{what}: a task of D = {D} input columns and {rows} rows needs about "
            f"{_size(nbytes)} of float64 work (about {squares:g} D×D arrays and {row_blocks:g} "
            f"N×D blocks at once), more than the {_size(limits.MAX_WORK_BYTES)} "
            "budget (pycore.limits.MAX_WORK_BYTES); use fewer input columns"
        )
    return nbytes


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def as_float_matrix(A, name: str = "matrix", *, ndim: int = 2) -> np.ndarray:
    """``A`` as a C-contiguous float64 array of ``ndim`` dims, checked.

    Or a ``ValueError`` naming ``name`` (size checked before copying: a broadcast view is never
    expanded first).
    """
    arr = np.asarray(A)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    check_dense_size(arr.shape, name)
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{name} contains NaN or inf (first at index {bad})")
    return arr


def as_target(Y, n_rows: int, name: str = "Y") -> np.ndarray:
    """Targets as an ``(N, m)`` float64 matrix, ``N == n_rows``."""
    arr = np.asarray(Y)
    arr = as_float_matrix(arr[:, None] if arr.ndim == 1 else arr, name)
    if arr.shape[0] != n_rows:
        raise ValueError(f"{name} has {arr.shape[0]} rows but the inputs have {n_rows}")
    return arr


def check_theta(theta, D: int, name: str = "theta") -> np.ndarray:
    """A D×D float64 feature extractor (docs/theory.md §1); another shape names ``name``."""
    theta = as_float_matrix(theta, name)
    if theta.shape != (D, D):
        raise ParameterError(
            name,
            f"{name} must be {D}×{D} to match the data's {D} columns, got shape {theta.shape}",
        )
    return theta


def _interval(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return (
        f" {'>' if low_open else '≥'} {low:g}"
        if low is not None
        else f" {'<' if high_open else '≤'} {high:g}"
        if high is not None
        else ""
    )


def describe_number(
    *, low=None, high=None, low_open=False, high_open=False, integer=False, none_ok=False
) -> str:
    """What :func:`check_number` accepts with these bounds, in words ("an integer in [0, 10]")."""
    return (
        ("an integer" if integer else "a finite number")
        + _interval(low, high, low_open, high_open)
        + (" or None" if none_ok else "")
    )


def check_number(
    value,
    name: str,
    *,
    low=None,
    high=None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    none_ok: bool = False,
):
    """``value`` as a finite float (an int when ``integer``) in the interval, checked.

    Otherwise a :class:`ParameterError` naming ``name``; ``None`` passes through when ``none_ok``.
    """
    if value is None and none_ok:
        return None
    want = describe_number(
        low=low,
        high=high,
        low_open=low_open,
        high_open=high_open,
        integer=integer,
        none_ok=none_ok,
    )
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, (bool, np.bool_))
        and (not integer or isinstance(value, numbers.Integral))
    )
    try:
        x = (int(value) if integer else float(value)) if ok else None
    except OverflowError:  # float(10**400)
        x = None
    if (
        x is None
        or not math.isfinite(x)
        or (low is not None and (x < low or (low_open and x == low)))
        or (high is not None and (x > high or (high_open and x == high)))
    ):
        raise ParameterError(name, f"{name} must be {want}, got {value!r}")
    return x


def check_counts(value, name: str, *, low: int = 1, high=None) -> tuple[int, ...]:
    """``value`` as a tuple of ints each in ``[low, high]``, checked.

    ``value``, one integer (any ``numbers.Integral`` but a bool: NumPy's too) or a non-empty
    list, tuple, range, set or array of them, as a tuple of ints each in ``[low, high]``;
    anything else (a float, None, a string, an empty list) is a :class:`ParameterError` naming
    ``name``.
    """
    if isinstance(value, np.ndarray):
        value = value.tolist()  # one int, or a list of them
    items = (value,) if isinstance(value, numbers.Integral) else value
    want = describe_number(low=low, high=high, integer=True)
    if isinstance(items, (range, set, frozenset)):
        items = tuple(items)
    if not isinstance(items, (list, tuple)) or not items:
        raise ParameterError(
            name, f"{name} must be {want} or a non-empty list of them, got {value!r}"
        )
    return tuple(check_number(v, name, low=low, high=high, integer=True) for v in items)


def check_choice(value, name: str, choices) -> str:
    if value not in tuple(choices):
        raise ParameterError(name, f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_betas(betas, name: str = "betas") -> tuple[float, float]:
    """Adam's ``(β₁, β₂)``, each in [0, 1)."""
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ParameterError(name, f"{name} must be a pair (β₁, β₂), got {betas!r}")
    return tuple(check_number(b, name, low=0.0, high=1.0, high_open=True) for b in betas)


def check_rng(rng, *, none_ok: bool = False):
    if not (isinstance(rng, np.random.Generator) or (none_ok and rng is None)):
        raise ParameterError(
            "rng",
            f"rng must be a numpy.random.Generator{' or None' * none_ok}, "
            f"got {type(rng).__name__}",
        )
    return rng


class OutlierWarning(UserWarning):
    """A data value many orders of magnitude beyond the rest of its column (:func:`outliers`)."""


# A cell this many times the median magnitude of its column's nonzero cells makes the column an
# indicator of its row after z-scoring; the Kaggle House Prices file's largest ratio is 31
# (MiscVal).
OUTLIER_FACTOR = 1e6


def outliers(values, factor: float = OUTLIER_FACTOR) -> np.ndarray:
    """Indices of the finite entries beyond ``factor`` × the median magnitude of the nonzero ones.

    Robust to the outlier itself; empty with < 2 nonzero entries.
    """
    a = np.abs(np.asarray(values, dtype=np.float64))
    nz = a[np.isfinite(a) & (a > 0)]
    if nz.size < 2:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.isfinite(a) & (a > factor * np.median(nz)))


def check_regular_file(path, what: str, *, max_bytes: int | None = None, error=ValueError) -> int:
    """The size of ``path``, an existing regular file of at most ``max_bytes``.

    ``max_bytes`` defaults to :data:`pycore.limits.MAX_DATA_FILE_BYTES` at call time. A FIFO or
    device is refused before it is opened (reading one could block forever). Missing:
    ``FileNotFoundError``; other problems: ``error``.
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
        kind = (
            "a FIFO (named pipe)"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "not a regular file"
        )
        raise error(f"{p}: is {kind}, expected a regular file ({what})")
    max_bytes = limits.MAX_DATA_FILE_BYTES if max_bytes is None else max_bytes
    if st.st_size > max_bytes:
        raise error(f"{p}: is {st.st_size} bytes, larger than the {max_bytes} byte limit ({what})")
    return int(st.st_size)


# torch.Generator.manual_seed takes seeds below 2**64, numpy's default_rng any non-negative one
MAX_SEED = 2**63 - 1


def check_seed(seed) -> int:
    """``seed`` as an int, or a :class:`ParameterError` naming it.

    Checked before any work: a negative seed failed in numpy's generator after the training.
    """
    if (
        isinstance(seed, bool)
        or not isinstance(seed, numbers.Integral)
        or not 0 <= seed <= MAX_SEED
    ):
        raise ParameterError("seed", f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    return int(seed)


def check_flag(value, name: str) -> bool:
    """``value`` if it is True or False, else a :class:`ParameterError` naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ParameterError(name, f"{name} must be True or False, got {value!r}")
    return bool(value)
