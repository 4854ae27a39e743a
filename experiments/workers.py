"""Worker processes of the experiments (docs/cli.md): ``parallel_map`` and die-with-parent.

* ``--jobs`` is capped at the number of tasks and of usable cores (:func:`effective_jobs`).
* Workers never outlive the run: on any exception, Ctrl-C or SIGTERM in the parent the pool is
  killed before the exception propagates, and each worker asks the kernel to kill it when its
  parent dies (``PR_SET_PDEATHSIG`` on Linux), whatever killed the parent.
* A worker's exception reaches the parent as itself (type, message, ``.parameter``): the
  library's exceptions pickle with their attributes (:class:`pycore.validation.PicklableError`);
  concurrent.futures attaches the worker's traceback as its ``__cause__`` (shown by ``--debug``).
* Every task runs with one BLAS thread, in a worker or serially (:func:`pycore.threads.task_threads`):
  the workers already fill the cores, and a result must not depend on ``--jobs``.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import signal
import sys

from experiments.flags import integer
from pycore.report import progress
from pycore.threads import task_threads

MAX_JOBS = 4096  # far above any core count; --jobs is capped at the usable cores anyway


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def effective_jobs(requested: int, n_tasks: int) -> int:
    """Never more workers than tasks or usable cores: an extra worker only costs a fork."""
    return max(1, min(requested, n_tasks, available_cores()))


def add_jobs(parser: argparse.ArgumentParser, what: str = "runs") -> None:
    parser.add_argument("--jobs", type=integer(1, MAX_JOBS), default=min(2, available_cores()),
                        help=f"worker processes for the {what} (default: 2 or the core count; never more "
                             "than the tasks or the usable cores)")


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _worker_init(parent_pid: int, mask) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and stops the pool, so the
    # workers ignore it (no traceback per worker); SIGTERM kills a worker at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent_pid)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux ``prctl``), and exit
    at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _task(fn, item):
    with task_threads():
        return fn(item)


def parallel_map(fn, items, jobs: int, *, desc: str, unit: str) -> list:
    """``[fn(x) for x in items]``, in order, over ``effective_jobs`` forked workers (serial for
    one).  ``fn`` must be a module-level function.  On any exception, Ctrl-C or SIGTERM the
    workers are killed before the exception propagates; a worker's exception is re-raised in
    the parent as itself."""
    items = list(items)
    n = effective_jobs(jobs, len(items))
    task = functools.partial(_task, fn)
    if n <= 1:
        return [task(x) for x in progress(items, desc=desc, unit=unit)]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # SIGINT/SIGTERM are held back while the workers are forked and the tasks submitted: an
    # interruption half-way through that bookkeeping could miss a worker.  The forked workers
    # inherit the blocked mask and unblock it in _worker_init, after dropping the parent's handlers.
    ex = None
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        try:
            ex = ProcessPoolExecutor(n, mp_context=mp.get_context("fork"), initializer=_worker_init,
                                     initargs=(os.getpid(), old_mask))
            results = ex.map(task, items, chunksize=1)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # a pending signal is raised here
        out = list(progress(results, total=len(items), desc=desc, unit=unit))
    except BaseException:
        if ex is not None:
            _kill_pool(ex)
        raise
    ex.shutdown(wait=True)
    return out


def _kill_pool(ex) -> None:
    import multiprocessing as mp

    # The executor's own list (no public API before Python 3.14), and every live child
    # multiprocessing started, in case one was forked but not yet registered.
    procs = set(getattr(ex, "_processes", {}).values()) | set(mp.active_children())
    ex.shutdown(wait=False, cancel_futures=True)
    # SIGKILL, not SIGTERM: a worker forked an instant ago may not have run _worker_init yet and
    # would still carry the parent's SIGTERM handler (a traceback per worker).  Workers hold
    # nothing that needs cleaning up: their results only ever reach the parent.
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
