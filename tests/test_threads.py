"""The BLAS thread policy of the linear core (:func:`pycore._threads.bounded_blas`,
:func:`pycore._threads.task_threads`, docs/design.md §5), checked on the limits it asks
threadpoolctl for, so each test means the same on one core as on many."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import threadpoolctl

from pycore import ParameterError
from pycore._threads import blas_threads, bounded_blas, task_threads, threads_for

ROOT = Path(__file__).resolve().parents[1]
USER_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "PYCORE_BLAS_THREADS",
)
# work whose largest dimension is below this runs on one thread (docs/design.md §5)
SMALL_MATRIX_DIM = 1200


@pytest.fixture
def clean_env(monkeypatch):
    for v in USER_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


@pytest.fixture
def limits(monkeypatch):
    """The limits asked of threadpoolctl, in order; ``limits.inside`` is true while one holds."""
    asked = SimpleNamespace(calls=[], inside=False)

    @contextlib.contextmanager
    def limit(self, *, limits, user_api):
        asked.calls.append((limits, user_api))
        asked.inside = True
        try:
            yield
        finally:
            asked.inside = False

    monkeypatch.setattr(threadpoolctl.ThreadpoolController, "limit", limit)
    return asked


@pytest.mark.parametrize(
    "env,small,large",
    [
        ({}, 1, None),  # the size rule: large work keeps the default
        ({"OMP_NUM_THREADS": "2"}, None, None),
        ({"OPENBLAS_NUM_THREADS": "2"}, None, None),  # the user's count
        ({"MKL_NUM_THREADS": "2"}, None, None),
        ({"OMP_NUM_THREADS": "4", "PYCORE_BLAS_THREADS": "3"}, 3, 3),
        ({"PYCORE_BLAS_THREADS": "auto"}, 1, None),
        ({"PYCORE_BLAS_THREADS": "off"}, None, None),
        ({"PYCORE_BLAS_THREADS": "0"}, None, None),
    ],
)
def test_who_decides_the_thread_count(clean_env, env, small, large):
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert [threads_for(n) for n in (79, SMALL_MATRIX_DIM - 1, SMALL_MATRIX_DIM)] == [
        small,
        small,
        large,
    ]


def test_a_bad_thread_setting_is_refused(clean_env):
    clean_env.setenv("PYCORE_BLAS_THREADS", "many")
    with pytest.raises(ValueError, match="PYCORE_BLAS_THREADS"):
        threads_for(79)
    with pytest.raises(ParameterError) as e:
        with blas_threads(0):
            pass
    assert e.value.parameter == "n"


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="needs ≥ 2 cores for a default above one thread"
)
def test_entry_points_run_single_threaded_on_small_work_only():
    # A clean interpreter (no thread variables): the BLAS default is > 1 thread; inside a decorated
    # entry point on small arrays it is 1, on large ones unchanged, and restored afterwards.
    code = """
import numpy as np
from threadpoolctl import ThreadpoolController
from pycore._threads import bounded_blas, blas_threads
SMALL_MATRIX_DIM = 1200
raw = lambda: max(i['num_threads'] for i in ThreadpoolController().select(user_api='blas').info())
count = bounded_blas(lambda *arrays: raw())
before, small, large = raw(), count(np.ones((79, 79))), count(np.ones((SMALL_MATRIX_DIM, 2)))
with blas_threads(1):
    forced = count(np.ones((SMALL_MATRIX_DIM, 2)))
print(before, small, large, forced, raw())
"""
    env = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    before, small, large, forced, after = map(int, out.stdout.split())
    assert before > 1
    assert (small, large, forced, after) == (1, before, 1, before)


def test_library_entry_points_are_bounded(monkeypatch, clean_env, limits):
    """Each entry point decides the thread count once for its whole call, from its largest argument
    (arrays, a task's X_P/X_H, a probing problem's Z): every factorisation inside runs under the
    one limit."""
    from pycore import (
        EvaluationReference,
        LinearTask,
        feature_rir,
        rir,
        rir_ceiling,
        strict_protocol,
    )
    from pycore._hardening import hardening_rotation

    seen = []
    for name in ("svd", "eigh", "qr"):
        f = getattr(np.linalg, name)
        monkeypatch.setattr(
            np.linalg, name, lambda *a, f=f, **k: seen.append(limits.inside) or f(*a, **k)
        )
    X = np.random.default_rng(0).standard_normal((12, 4))
    task = LinearTask(X, X[:, :1], np.ones((41, 4)), np.ones(41))
    rir(np.eye(4), X, X)
    rir_ceiling(X, X)
    feature_rir(X, X, X, X)
    strict_protocol(task)  # these two run in the main process of the experiments
    EvaluationReference(task)
    hardening_rotation("haar", 4, rng=np.random.default_rng(0))
    hardening_rotation("equalize", 4, Z=X)
    assert seen and all(seen) and not limits.inside
    assert {c for c in limits.calls} == {(1, "blas")}


def test_the_largest_dimension_of_any_argument_decides(clean_env, limits):
    """Arrays, a task's X_P and X_H, a problem's Z: one array at the size limit lifts the bound."""
    entry = bounded_blas(lambda *args: None)
    small, big = np.ones((12, 4)), np.ones((SMALL_MATRIX_DIM, 4))
    for args in (
        [small],
        [SimpleNamespace(X_P=small, X_H=small), 3],
        [SimpleNamespace(Z=small)],
        ["x"],
    ):
        limits.calls.clear()
        entry(*args)
        assert limits.calls == [(1, "blas")], args
    for args in ([small, big], [SimpleNamespace(X_P=small, X_H=big)], [SimpleNamespace(Z=big)]):
        limits.calls.clear()
        entry(*args)
        assert limits.calls == [], args


def test_task_threads_is_the_policy_of_worker_tasks(clean_env, limits):
    """One BLAS thread inside a worker task whatever the matrix size, an entry point inside keeps
    that decision, the user's count wins."""
    big = np.ones((2 * SMALL_MATRIX_DIM, 2))
    entry = bounded_blas(lambda a: len(limits.calls))
    with task_threads():
        assert limits.calls == [(1, "blas")]
        assert entry(big) == 1  # the task's decision holds: no second limit inside
    assert entry(big) == 1 and entry(np.ones((3, 3))) == 2 and limits.calls[-1] == (1, "blas")
    limits.calls.clear()
    clean_env.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins: nothing limited
    with task_threads():
        assert entry(np.ones((3, 3))) == 0
    clean_env.setenv("PYCORE_BLAS_THREADS", "2")
    with task_threads():
        assert limits.calls == [(2, "blas")]
