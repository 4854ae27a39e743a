"""BLAS threads for the small matrices of the linear core (docs/design.md §5).

The linear core works on matrices of a few hundred rows and columns at most (House Prices 79,
MNIST 784), in long loops of small products and eigensolves.  At those sizes a multi-threaded
BLAS gains little even on an idle machine, and loses badly on a busy one: every call waits for
all its threads to be scheduled, so one other process on the second core turns a 2-thread loop
of 79×79 calls into a crawl (the README's library snippet: 55–69 s with the default 2 threads
against 2.2–2.4 s with one, measured on the 2-core machine under load).  The entry points of
the core (``immunize``, ``rir``, ``rir_ceiling``, ``evaluate_linear``, the probes and the
attackers) are therefore wrapped with :func:`bounded_blas`: below :data:`SMALL_MATRIX_DIM` they
run with ONE BLAS thread, above it they leave the thread count alone (large products and
eigensolves do gain from threads on an idle machine).

Who decides, in order:

1. :func:`blas_threads` — a context manager the user wraps around calls to force a count
   (``with blas_threads(2): immunize(...)``); entry points inside it do not change it.
2. ``PYCORE_BLAS_THREADS`` in the environment: an integer n ≥ 1 (every entry point runs with
   n threads, whatever the size), ``auto`` (the size rule, as if unset), or ``off`` (never touch
   the thread count; ``0`` means the same).
3. An explicit thread count in the environment (``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``,
   ``MKL_NUM_THREADS``, ``BLIS_NUM_THREADS``, ``VECLIB_MAXIMUM_THREADS``) is the user's choice and
   is respected: the library then never changes the count.
4. Otherwise the size rule: one thread when the largest dimension of the arrays passed in is
   below :data:`SMALL_MATRIX_DIM`.

Work split into tasks that run side by side (the experiments' worker processes) runs inside
:func:`task_threads`: one thread per task whatever the size (rules 1–3 still apply), since the
processes already fill the cores; the scripts set no thread variable of their own.

Only the thread COUNT changes; results are bit-identical up to what the BLAS itself does with
a different count (OpenBLAS's products and LAPACK's eigensolvers can differ in the last bits
between thread counts -- the same command with the same environment gives the same digits).
"""
from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager

import numpy as np

__all__ = ["SMALL_MATRIX_DIM", "ENV_VAR", "bounded_blas", "blas_threads", "threads_for", "task_threads"]

# Largest matrix dimension still run single-threaded by default.  Measured on the 2-core machine
# shared with other jobs (``python bench/bench_threads.py --sizes 79,256,784,1200,1500``, per-call
# time of loops, 1 vs 2 threads, median of 3 interleaved rounds, load average ~10):
#   2 threads / 1 thread   n=79: gemm 0.73, eigh 114, svd 43;  n=256: gemm 6.7, eigh 2.4, svd 3.4;
#   n=784: gemm 0.92, eigh 3.1, svd 3.0;  n=1200: gemm 0.85, eigh 11, svd 18;  n=1500: 1.0/14/7.1.
# Under load a second BLAS thread costs up to 100× on the small eigensolves the core lives on;
# when the second core is idle (docs/design.md §5, and a best-of-3 run at load ~5) two threads
# gain 1.0-1.4× at n = 784 (gemm 0.66, eigh 0.72, svd 0.93) and ~1.8× on products from n ≈ 1500.
# The linear experiments also run two worker processes by default, which already fill both cores.
# So: single-threaded up to the paper's sizes (D ≤ 784, N ≤ 1151 rows), BLAS default above.
SMALL_MATRIX_DIM = 1200

ENV_VAR = "PYCORE_BLAS_THREADS"
_USER_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                     "VECLIB_MAXIMUM_THREADS")

_local = threading.local()
_controller = None


def _ctl():
    # Created on first use, after NumPy/SciPy have loaded their BLAS libraries.
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller


def threads_for(dim: int) -> int | None:
    """The BLAS thread count an entry point uses for work of largest dimension ``dim``
    (None = leave the count as it is).  See the module docstring for the order of rules."""
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in ("off", "none", "no", "0"):
        return None
    if setting and setting != "auto":
        n = int(setting) if setting.isdigit() else 0
        if n < 1:
            raise ValueError(f"{ENV_VAR} must be a positive integer, 'auto' or 'off', got {setting!r}")
        return n
    if not setting and any(os.environ.get(v, "").strip() for v in _USER_THREAD_VARS):
        return None
    return 1 if dim < SMALL_MATRIX_DIM else None


def _task_thread_count() -> int | None:
    """The count :func:`task_threads` uses: the rules 1–3 of the module docstring, then 1."""
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting and setting != "auto":
        return threads_for(0)
    if not setting and any(os.environ.get(v, "").strip() for v in _USER_THREAD_VARS):
        return None
    return 1


@contextmanager
def task_threads():
    """Run the enclosed work with ONE BLAS thread: the policy for tasks that run side by side
    (the experiments' worker processes, one task per core; docs/design.md §5).  Entry points
    inside keep this decision, whatever their size, and the same tasks run serially (one
    worker) get the same count, so a result never depends on how many workers ran it.  The
    user's choice still wins: ``PYCORE_BLAS_THREADS=n`` gives n threads, ``off`` or an explicit
    ``OMP_NUM_THREADS`` (etc.) leaves the count alone."""
    if getattr(_local, "active", False):
        yield
        return
    with _scope(_task_thread_count()):
        yield


def _largest_dim(values) -> int:
    dim = 0
    for v in values:
        if isinstance(v, np.ndarray):
            arrays = (v,)
        else:   # a LinearTask (X_P, X_H) or a ProbingProblem (Z)
            arrays = [getattr(v, a, None) for a in ("X_P", "X_H", "Z")]
        for a in arrays:
            if isinstance(a, np.ndarray) and a.ndim:
                dim = max(dim, max(a.shape))
    return dim


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
def blas_threads(n: int):
    """Run the enclosed library calls with ``n`` BLAS threads, whatever their size."""
    if int(n) < 1:
        raise ValueError(f"blas_threads needs n ≥ 1, got {n}")
    if getattr(_local, "active", False):
        raise RuntimeError("blas_threads cannot be nested inside another bounded region")
    with _scope(int(n)):
        yield


def bounded_blas(func):
    """Decorator for an entry point of the linear core: decide the BLAS thread count once, from
    the largest dimension of the arrays among its arguments (tasks and probing problems
    included), for the whole call; nested entry points keep the outer decision."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if getattr(_local, "active", False):
            return func(*args, **kwargs)
        n = threads_for(_largest_dim(list(args) + list(kwargs.values())))
        with _scope(n):
            return func(*args, **kwargs)

    return wrapper
