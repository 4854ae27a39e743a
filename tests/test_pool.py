"""The experiments' process pool (experiments/pool.py)."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from experiments import pool


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
