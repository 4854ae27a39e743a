"""Time one MNIST pair-seed (pair 0→1, seed 0, the default configuration) for each method.

Run: ``python -m pytest bench/bench_mnist.py --benchmark-only`` (single-threaded via bench/conftest.py).
The full default grid is 90 pairs × 3 seeds of every method, split over ``--jobs`` processes,
so its immunization time is about ``270 × Σ_methods(time per run) / jobs``.
"""
from __future__ import annotations

import numpy as np
import pytest

from pycore.data.mnist import digit_covariances, load_mnist_5k, pair_task, split_digits
from pycore.immunize import METHODS


@pytest.fixture(scope="module")
def setup():
    from experiments import mnist as exp

    args = exp.parse_args([])
    digits = load_mnist_5k()
    split = split_digits(digits, args.n_train, np.random.default_rng(args.split_seed), args.n_heldout)
    task = pair_task(digits, split, 0, 1, covariances=digit_covariances(digits, split))
    return task, args.immunizer


@pytest.mark.parametrize("method", METHODS)
def test_bench_mnist_pair_seed(benchmark, setup, method):
    task, cfg = setup
    res = benchmark.pedantic(lambda: cfg(task, method, np.random.default_rng(0)),
                             rounds=2, iterations=1, warmup_rounds=0)
    assert np.all(np.isfinite(res.theta))
