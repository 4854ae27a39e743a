"""The shared command-line layer (experiments/common.py): its process pool."""

from __future__ import annotations

import os
import signal
import time

import pytest

from experiments import common


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


needs_two = pytest.mark.skipif(
    common.usable_cores() < 2, reason="a pool needs two usable cores (else tasks run in-process)"
)


@needs_two
def test_a_worker_that_dies_is_named_by_the_task_it_ran():
    with pytest.raises(common.WorkerDiedError) as e:
        common.pool_map(_dies_on_two, [0, 1, 2, 3, 4], jobs=2)
    assert e.value.tasks == (2,)


@needs_two
def test_a_follow_up_whose_worker_dies_is_named():
    with pytest.raises(common.WorkerDiedError) as e:  # item 1's follow-up is 2
        common.pool_chain(_first, _then, [0, 1, 5], jobs=2)
    assert len(e.value.tasks) == 1 and e.value.tasks[0] >= 3  # a follow-up, after the 3 firsts


@needs_two
def test_tasks_of_a_pool_that_stays_whole_return_their_values():
    assert common.pool_map(_dies_on_two, [0, 1, 3, 4], jobs=2) == [0, 1, 3, 4]
