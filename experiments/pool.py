"""The experiments' process pool (docs/cli.md "Outputs"): :func:`pool_map` and :func:`pool_chain`
over ``concurrent.futures`` workers, one BLAS thread per task, every worker killed on any error or
signal, and a worker that dies named by the task it ran (:class:`WorkerDiedError`).

Workers are forked, or spawned for tasks that run torch (``start``: see :data:`START`). A task
gets everything it needs as its value (a job, or arguments bound with ``functools.partial``),
pickled with it; results come back as values.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext

from experiments.outputs import RunError

MAX_JOBS = 1024  # then capped at the usable cores


class WorkerDiedError(RunError):
    """A worker process died (killed, out of memory, a crash in a native library) while it ran
    a task: ``.tasks`` the indices of the tasks it was running, in the order they were
    submitted."""

    def __init__(self, message: str, tasks: tuple = ()):
        super().__init__(message)
        self.tasks = tuple(tasks)


def usable_cores() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )


# How a pool starts its workers. "fork" (the default: nothing is imported again) for tasks that
# never run torch, the linear commands'; "spawn" (a fresh interpreter) for tasks that do. torch's
# CPU kernels run on an OpenMP thread team (GNU libgomp) that does not survive a fork: a forked
# worker whose first parallel region joins the team waits for ever on threads it does not have
# (deepnet.py --jobs 2 hung so, parent and workers asleep on futexes).
START = ("fork", "spawn")


def _watch_parent(parent: int) -> None:
    # the parent died, even by SIGKILL: its workers must not outlive it
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


# The one piece of module state, and only in a worker process: (the pool's shared array of
# running tasks, this worker's slot in it), set once by the pool's initializer, so that the parent
# can name the task of a worker that died. It cannot travel with the tasks: a shared-memory array
# reaches a process only as it starts (the initializer's arguments), and a task,
# which the pool pickles by name, reaches what the initializer set only through its module.
_SLOT = None


def _worker_init(parent: int, slots) -> None:
    global _SLOT
    running, pids, taken = slots
    with taken.get_lock():
        slot, taken.value = taken.value, taken.value + 1
    pids[slot], _SLOT = os.getpid(), (running, slot)
    # Ctrl-C reaches the group: the parent stops the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (when forked)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _task(fn, item):
    from pycore._threads import task_threads

    # one BLAS thread per task, in a worker or not: results never depend on --jobs
    with task_threads():
        return fn(item)


def _tracked(fn, task: int, item):
    """:func:`_task` with ``task`` marked as running in this worker's slot while it runs."""
    if _SLOT is not None:
        _SLOT[0][_SLOT[1]] = task + 1
    try:
        return _task(fn, item)
    finally:
        if _SLOT is not None:
            _SLOT[0][_SLOT[1]] = 0


def _label(item) -> str:
    text = repr(item)
    return text if len(text) <= 100 else f"{text[:100]}…"


@contextmanager
def _workers(n: int, tasks=None, start: str = "fork"):
    """A pool of ``n`` workers started by ``start`` (:data:`START`); on any exception, Ctrl-C or
    SIGTERM in the block every worker is killed first. A task submitted through :func:`_tracked`
    with its index in ``tasks`` (the items, as submitted) is named when the worker running it dies
    (:class:`WorkerDiedError`)."""
    if start not in START:
        raise ValueError(f"start must be one of {START}, not {start!r}")
    ctx = multiprocessing.get_context(start)
    slots = (ctx.Array("q", n, lock=False), ctx.Array("q", n, lock=False), ctx.Value("i", 0))
    ex = ProcessPoolExecutor(
        n, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(), slots)
    )
    try:
        yield ex
    except BaseException as exc:
        died = _died(ex, slots, tasks) if isinstance(exc, BrokenProcessPool) else None
        ex.shutdown(wait=False, cancel_futures=True)
        for p in multiprocessing.active_children():
            p.kill()
            p.join()
        if died is not None:
            raise died from None
        raise
    ex.shutdown()


def _ending(code: int) -> str:
    """How a process with exit code ``code`` ended, in words."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _died(ex, slots, items) -> WorkerDiedError | None:
    """What a dead worker was running, from the slots its tasks marked: the workers that ended
    other than by the pool's own SIGTERM (the pool stops the healthy ones that way once one
    died) and the task each had marked; None when none can be told."""
    running, pids, _ = slots
    procs = list((getattr(ex, "_processes", None) or {}).values())
    for p in procs:
        p.join(timeout=5)
    codes = {p.pid: p.exitcode for p in procs if p.exitcode not in (None, -signal.SIGTERM)}
    dead = [(k, codes[pid]) for k, pid in enumerate(pids) if pid in codes and running[k] > 0]
    if not dead:
        return None
    tasks = tuple(running[k] - 1 for k, _ in dead)
    how = ", ".join(_ending(code) for _, code in dead)
    named = "; ".join(
        f"task {t + 1} ({_label(items[t])})" if items and t < len(items) else f"task {t + 1}"
        for t in tasks
    )
    return WorkerDiedError(
        f"a worker process died ({how}{'; out of memory?' * ('SIGKILL' in how)}) while it ran "
        f"{named}; the other tasks were stopped",
        tasks,
    )


def pool_map(
    fn, items, jobs: int, desc: str | None = None, done=None, start: str = "fork"
) -> list:
    """``[fn(x) for x in items]`` over at most ``jobs`` workers (none for one task); on any
    exception, Ctrl-C or SIGTERM every worker is killed first; a worker's exception arrives as
    itself.  ``fn`` is pickled with each item: data every item needs is bound to it
    (``functools.partial(fn, data)``) and travels with each task.  Progress: ``done(k, item)``
    as the k-th result arrives, in order (else a bar named ``desc`` on a terminal).  ``start``:
    how the workers start (:data:`START`; ``"spawn"`` for tasks that run torch)."""
    from pycore._report import progress

    items = list(items)
    n = max(1, min(jobs, len(items), usable_cores()))
    with _workers(n, items, start) if n > 1 else nullcontext() as ex:
        results = (
            ex.map(functools.partial(_tracked, fn), range(len(items)), items)
            if n > 1
            else (_task(fn, x) for x in items)
        )
        if done is None:
            return list(progress(results, total=len(items), desc=desc))
        out = []
        for k, r in enumerate(results):
            out.append(r)
            done(k, items[k])
        return out


def pool_chain(first, then, items, jobs: int, start: str = "fork", on_done=None) -> list:
    """Two stages in one pool: ``first(x)`` returns ``(result, follow_ups)`` and every follow-up
    ``y`` runs as ``then(y)`` as soon as its ``first`` has returned, on whichever worker is free
    (a long ``first`` no longer holds its follow-ups on one worker).  Returns ``[(result,
    [then(y) for y in follow_ups]), ...]`` in the order of ``items``; errors, interrupts and
    ``start`` as :func:`pool_map`. ``on_done(stage, task)`` (``stage`` "first" or "then"), if
    given, is called in this process as each task finishes (a progress line)."""
    items = list(items)
    n = min(jobs, usable_cores())
    done_cb = on_done or (lambda stage, task: None)
    if n < 2 or not items:
        out = []
        for x in items:
            result, follow = _task(first, x)
            done_cb("first", x)
            outs = []
            for y in follow:
                outs.append(_task(then, y))
                done_cb("then", y)
            out.append((result, outs))
        return out
    results, followed = [None] * len(items), [None] * len(items)
    tasks = list(items)  # then each follow-up, as it is submitted

    def submit(fn, x):
        tasks.append(x)
        return ex.submit(_tracked, fn, len(tasks) - 1, x)

    with _workers(n, tasks, start) as ex:
        pending = {ex.submit(_tracked, first, i, x): (i, None, x) for i, x in enumerate(items)}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i, j, x = pending.pop(fut)
                if j is None:
                    results[i], follow = fut.result()
                    followed[i] = [None] * len(follow)
                    for j, y in enumerate(follow):
                        pending[submit(then, y)] = (i, j, y)
                    done_cb("first", x)
                else:
                    followed[i][j] = fut.result()
                    done_cb("then", x)
    return list(zip(results, followed))
