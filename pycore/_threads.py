"""BLAS threads for the small matrices of the linear core (docs/design.md §5).

Long loops of small products (D = 79 or 784) gain little from a second BLAS thread on an idle
machine and lose up to 100× on a busy one, so :func:`bounded_blas` entry points run with ONE thread
below :data:`SMALL_MATRIX_DIM`.  First match wins: :func:`blas_threads`; ``PYCORE_BLAS_THREADS`` =
n, ``auto`` or ``off``/``0``; an explicit ``OMP_NUM_THREADS`` (or OpenBLAS/MKL/BLIS/vecLib); the
size rule.  :func:`task_threads`: one thread per task of a process pool.  Only the count changes.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager

import numpy as np

from pycore._validation import check_number

# Largest dimension run single-threaded: 2 threads / 1 thread under load (bench/bench_threads.py,
# 2 cores): eigh 114× slower at n = 79, 3.1× at 784, 11× at 1200; idle, 2 threads gain ≤ 1.4× at
# 784.
SMALL_MATRIX_DIM = 1200

ENV_VAR = "PYCORE_BLAS_THREADS"
_USER_THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)

_local = threading.local()


@functools.cache
def _ctl():  # created on first use, after NumPy/SciPy have loaded their BLAS
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def threads_for(dim: int) -> int | None:
    """The BLAS thread count for work of a given largest dimension.

    First match wins (module docstring): ``PYCORE_BLAS_THREADS`` (n, ``auto`` or ``off``/``0``), an
    explicit ``OMP_NUM_THREADS`` (or OpenBLAS/MKL/BLIS/vecLib: None), then the size rule (one
    thread below :data:`SMALL_MATRIX_DIM`).

    Parameters
    ----------
    dim : int
        The largest dimension of the work's arrays.

    Returns
    -------
    int or None
        The count; None: leave it as it is.

    Raises
    ------
    ValueError
        ``PYCORE_BLAS_THREADS`` set to anything else (the message names it).
    """
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in ("off", "none", "no", "0"):
        return None
    if setting and setting != "auto":
        if not (setting.isdigit() and int(setting) >= 1):
            raise ValueError(
                f"{ENV_VAR} must be a positive integer, 'auto' or 'off', got {setting!r}"
            )
        return int(setting)
    if not setting and any(os.environ.get(v, "").strip() for v in _USER_THREAD_VARS):
        return None
    return 1 if dim < SMALL_MATRIX_DIM else None


@contextmanager
def _scope(n: int | None):
    _local.active = True
    try:
        if n is None:
            yield
        else:
            with _ctl().limit(limits=n, user_api="blas"):
                yield
    finally:
        _local.active = False


@contextmanager
def task_threads():
    """ONE BLAS thread for the enclosed work unless the user chose otherwise.

    A context manager for a worker task of a process pool; entry points inside keep its decision,
    so a result never depends on the worker count.

    Returns
    -------
    contextmanager
        The bounded region (``with task_threads(): ...``).

    Raises
    ------
    ValueError
        ``PYCORE_BLAS_THREADS`` malformed (:func:`threads_for`).
    """
    if getattr(_local, "active", False):
        yield
        return
    with _scope(threads_for(0)):
        yield


@contextmanager
def blas_threads(n: int):
    """Run the enclosed library calls with a given number of BLAS threads, whatever their size.

    Parameters
    ----------
    n : int
        The thread count, at least 1.

    Returns
    -------
    contextmanager
        The bounded region (``with blas_threads(2): ...``).

    Raises
    ------
    ParameterError
        ``n`` not a positive integer (``.parameter`` is ``"n"``).
    RuntimeError
        Nested inside another bounded region.
    """
    n = check_number(n, "n", low=1, integer=True)
    if getattr(_local, "active", False):
        raise RuntimeError("blas_threads cannot be nested inside another bounded region")
    with _scope(n):
        yield


def _largest_dim(values) -> int:
    """Largest dimension of the arrays among ``values``, tasks' X_P, X_H and problems' Z too."""
    dim = 0
    for v in values:
        arrays = (
            (v,)
            if isinstance(v, np.ndarray)
            else [getattr(v, a, None) for a in ("X_P", "X_H", "Z")]
        )
        for a in arrays:
            if isinstance(a, np.ndarray) and a.ndim:
                dim = max(dim, max(a.shape))
    return dim


def bounded_blas(func):
    """Entry-point decorator: the BLAS thread count decided once per call.

    The count comes from :func:`threads_for` of the arguments' largest dimension (arrays, a task's
    ``X_P`` and ``X_H``, a probing problem's ``Z``); calls made inside a bounded region keep that
    region's count.

    Parameters
    ----------
    func : callable
        The entry point.

    Returns
    -------
    callable
        ``func`` wrapped (:func:`functools.wraps`).
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if getattr(_local, "active", False):
            return func(*args, **kwargs)
        with _scope(threads_for(_largest_dim(list(args) + list(kwargs.values())))):
            return func(*args, **kwargs)

    return wrapper
