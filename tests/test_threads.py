"""BLAS thread bound of the linear core (pycore/threads.py, docs/design.md §5)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pycore import threads
from pycore.threads import SMALL_MATRIX_DIM, threads_for

ROOT = Path(__file__).resolve().parents[1]
USER_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
             "VECLIB_MAXIMUM_THREADS", "PYCORE_BLAS_THREADS")


@pytest.fixture
def clean_env(monkeypatch):
    for v in USER_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_size_rule_without_user_settings(clean_env):
    assert threads_for(79) == 1
    assert threads_for(SMALL_MATRIX_DIM - 1) == 1
    assert threads_for(SMALL_MATRIX_DIM) is None     # large work keeps the BLAS default


@pytest.mark.parametrize("var", ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"])
def test_explicit_user_thread_count_is_respected(clean_env, var):
    clean_env.setenv(var, "2")
    assert threads_for(79) is None


def test_pycore_env_var_overrides(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "4")
    clean_env.setenv("PYCORE_BLAS_THREADS", "3")
    assert threads_for(79) == 3 and threads_for(10 ** 5) == 3
    clean_env.setenv("PYCORE_BLAS_THREADS", "auto")
    assert threads_for(79) == 1 and threads_for(10 ** 5) is None
    for off in ("off", "0"):
        clean_env.setenv("PYCORE_BLAS_THREADS", off)
        assert threads_for(79) is None
    clean_env.setenv("PYCORE_BLAS_THREADS", "many")
    with pytest.raises(ValueError, match="PYCORE_BLAS_THREADS must be a positive integer"):
        threads_for(79)


def test_largest_dim_sees_arrays_tasks_and_problems():
    from pycore.attacks import make_problem
    from pycore.tasks import LinearTask

    rng = np.random.default_rng(0)
    X = rng.standard_normal((30, 7))
    task = LinearTask(X, X[:, :1], rng.standard_normal((41, 7)), X[:5, :1].repeat(9, 0)[:41], "mse", "t")
    assert threads._largest_dim([X]) == 30
    assert threads._largest_dim([task, 3]) == 41
    assert threads._largest_dim([make_problem(X, X[:, 0])]) == 30
    assert threads._largest_dim(["x", None]) == 0


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs ≥ 2 cores for a default above one thread")
def test_entry_points_run_single_threaded_on_small_work_only():
    # A clean interpreter (no thread variables): the BLAS default is > 1 thread; inside a decorated
    # entry point on small arrays it is 1, on large ones unchanged, and restored afterwards.
    code = """
import numpy as np
from threadpoolctl import ThreadpoolController
from pycore.threads import bounded_blas, blas_threads, SMALL_MATRIX_DIM
def count():
    return max(i['num_threads'] for i in ThreadpoolController().select(user_api='blas').info())
@bounded_blas
def seen(*arrays):
    return count()
before = count()
small = seen(np.ones((79, 79)))
large = seen(np.ones((SMALL_MATRIX_DIM, 2)))
with blas_threads(1):
    forced = seen(np.ones((SMALL_MATRIX_DIM, 2)))
print(before, small, large, forced, count())
"""
    env = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, small, large, forced, after = map(int, out.stdout.split())
    assert before > 1
    assert (small, large, forced, after) == (1, before, 1, before)


def test_library_entry_points_are_bounded():
    from pycore import attacks, evaluate, immunize, metrics, probe   # immunize: the function
    from pycore.immunize import immunize_certified

    for f in (immunize, immunize_certified, metrics.rir, metrics.rir_ceiling, evaluate.evaluate_linear,
              evaluate.norm_ratio_curves, probe.gd_exact_line_search, attacks.make_problem,
              attacks.run_attackers):
        assert f.__wrapped__ is not None and f.__code__ is threads.bounded_blas(len).__code__, f.__name__
