"""BLAS thread bound of the linear core (pycore/threads.py, docs/design.md §5)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pycore import threads
from pycore.threads import SMALL_MATRIX_DIM, threads_for
from pycore.validation import ParameterError

ROOT = Path(__file__).resolve().parents[1]
USER_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "PYCORE_BLAS_THREADS",
)


@pytest.fixture
def clean_env(monkeypatch):
    for v in USER_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


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
        with threads.blas_threads(0):
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
from pycore.threads import bounded_blas, blas_threads, SMALL_MATRIX_DIM
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


def test_library_entry_points_are_bounded(monkeypatch, clean_env):
    """Each entry point decides the thread count once for its whole call, from its largest argument
    (arrays, a task's X_P/X_H, a probing problem's Z); inside, the bounded region is active."""
    from types import SimpleNamespace

    from pycore import metrics
    from pycore.evaluate import EvaluationReference
    from pycore.hardening import hardening_rotation
    from pycore.protocol import strict_protocol
    from pycore.tasks import LinearTask

    seen = []
    for name in ("svd", "eigh", "qr"):
        f = getattr(np.linalg, name)
        monkeypatch.setattr(
            np.linalg, name, lambda *a, f=f, **k: seen.append(threads._local.active) or f(*a, **k)
        )
    X = np.random.default_rng(0).standard_normal((12, 4))
    task = LinearTask(X, X[:, :1], np.ones((41, 4)), np.ones(41))
    dims = [threads._largest_dim(v) for v in ([X], [task, 3], [SimpleNamespace(Z=X)], ["x"])]
    assert dims == [12, 41, 12, 0]
    metrics.rir(np.eye(4), X, X)
    metrics.rir_ceiling(X, X)
    metrics.feature_rir(X, X, X, X)
    strict_protocol(task)  # these two run in the main process of the experiments
    EvaluationReference(task)
    hardening_rotation("haar", 4, rng=np.random.default_rng(0))
    hardening_rotation("equalize", 4, Z=X)
    assert seen and all(seen) and not threads._local.active
