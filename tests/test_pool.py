"""The experiments' process pool (experiments/pool.py): workers named when they die, jobs capped
at the usable cores, errors that arrive as themselves, and a killed run that leaves no worker and
no output behind."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import pool
from pycore import ParameterError
from tests.cli_helpers import one_line

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _dies_on_two(x: int) -> int:
    """A task whose worker is killed (as the out-of-memory killer would) on item 2."""
    if x == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return x


def _then(y: int) -> int:
    return _dies_on_two(y)


def _first(x: int):
    return x, [x + 1]


def _with_shared(shared, item):
    return shared["offset"] + item, os.getpid()


needs_two = pytest.mark.skipif(
    pool.usable_cores() < 2, reason="a pool needs two usable cores (else tasks run in-process)"
)


@needs_two
def test_a_worker_that_dies_is_named_by_the_task_it_ran():
    with pytest.raises(pool.WorkerDiedError) as e:
        pool.pool_map(_dies_on_two, [0, 1, 2, 3, 4], jobs=2)
    assert e.value.tasks == (2,)


@needs_two
def test_a_follow_up_whose_worker_dies_is_named():
    with pytest.raises(pool.WorkerDiedError) as e:  # item 1's follow-up is 2
        pool.pool_chain(_first, _then, [0, 1, 5], jobs=2)
    assert len(e.value.tasks) == 1 and e.value.tasks[0] >= 3  # a follow-up, after the 3 firsts


@needs_two
def test_tasks_of_a_pool_that_stays_whole_return_their_values():
    assert pool.pool_map(_dies_on_two, [0, 1, 3, 4], jobs=2) == [0, 1, 3, 4]


@pytest.mark.parametrize("jobs", [1, 2])
def test_data_bound_to_the_function_reaches_every_worker(jobs):
    out = pool.pool_map(functools.partial(_with_shared, {"offset": 10}), range(5), jobs)
    assert [v for v, _ in out] == [10, 11, 12, 13, 14]
    assert (os.getpid() in {p for _, p in out}) == (min(jobs, pool.usable_cores()) == 1)


def _pid(_):
    return os.getpid()


def _raise_in_worker(i):
    raise ParameterError("lambda_h", f"from worker {os.getpid()}")


@needs_two
def test_pool_map_caps_jobs_and_errors_arrive_as_themselves():
    pids = pool.pool_map(_pid, range(6), jobs=64)
    assert os.getpid() not in pids and len(set(pids)) <= pool.usable_cores()
    assert pool.pool_map(_pid, [0], jobs=64) == [os.getpid()]  # one task: no fork
    with pytest.raises(ParameterError) as e:
        pool.pool_map(_raise_in_worker, [0, 1], jobs=2)
    assert e.value.parameter == "lambda_h" and f"worker {os.getpid()}" not in str(e.value)


TORCH_TASK = """
import torch


def fill(n):
    torch.set_num_threads(2)
    return float(torch.ones(1 << 22).add_(n).sum())  # a parallel region of two threads
"""


@needs_two
def test_spawned_workers_of_a_parent_whose_torch_ran_threads_do_not_hang(tmp_path):
    """torch's OpenMP thread team does not survive a fork: a forked worker's first parallel region
    waited for ever on the parent's threads. Spawned, the pool ends within a timeout, with the
    values."""
    (tmp_path / "torch_task.py").write_text(TORCH_TASK)
    code = (
        "import torch\nfrom experiments import pool\nfrom torch_task import fill\n"
        "torch.set_num_threads(2)\n"
        "torch.ones(1 << 22).add_(1)  # the parent's team of two threads\n"
        "print(pool.pool_map(fill, [1, 2, 3], jobs=2, start='spawn'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[8388608.0,", "12582912.0,", "16777216.0]"]


def _children(pid: int) -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            out.append(int(d))
    return out


def _alive(pids) -> list[int]:
    return [
        p
        for p in pids
        if Path(f"/proc/{p}").exists()
        and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_run_leaves_no_worker_and_no_output(tmp_path, sig):
    p = subprocess.Popen(
        [
            sys.executable,
            "experiments/house_price.py",
            "--seeds",
            "4",
            "--jobs",
            "2",
            "--no-plot",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.time()
    while len(_children(p.pid)) < 2 and p.poll() is None and time.time() - t0 < 60:
        time.sleep(0.05)
    workers = _children(p.pid)
    assert len(workers) >= 2, p.stderr.read() if p.poll() is not None else "no workers after 60 s"
    p.send_signal(sig)
    err = p.communicate(timeout=30)[1]
    t0 = time.time()
    # SIGKILL: the workers notice their parent is gone
    while _alive(workers) and time.time() - t0 < 5:
        time.sleep(0.05)
    left = _alive(workers)
    for pid in left:  # a failing test must not leak them
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"workers outlived the run: {left}"
    if sig == signal.SIGTERM:
        assert p.returncode == 143 and one_line(err, "SIGTERM")
    assert list(tmp_path.iterdir()) == []
