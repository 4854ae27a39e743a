"""The three linear jobs at reduced size, each as a RATIO to its arithmetic floor measured in the
same run (docs/performance.md).

    python -m pytest bench/bench_jobs.py --benchmark-only -s     # pytest-benchmark + ratio lines
    python bench/bench_jobs.py [--repeat 5]                      # the ratio table alone

A job step's floor is the bare arithmetic every step of that job must do, replayed with the same
LAPACK/BLAS calls and nothing else:

* House Prices (both protocols; D = 79 or 75, 200 rows per task): the two feature products
  ``X_Pθ``, ``X_Hθ``, the two Hessians ``ZᵀZ`` and their eigenvalues (one tridiagonal reduction
  and ``dsterf`` each) -- what any method that reads κ(H_P), κ(H_H) per step needs;
* MNIST (D = 784, 100 rows per task): the two feature products (100×784×784), the two 100×100
  Gram matrices and their ``eigh``, and one 784×100×784 product (a dense D×D update).

Per job the benchmark runs Algorithm 1 ("ours"), Opt κ, R_ill only and IMMA for a few epochs
(one seed) and reports ``time / (steps × floor step)``: a regression in the library shows as a
larger ratio on any machine, whatever its absolute speed.  Single-threaded (bench/conftest.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.linalg.lapack as lapack  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pycore.immunize import PRESETS, immunize  # noqa: E402

METHODS = ("ours", "opt_kappa", "r_ill_only", "imma")


def _house_price(protocol):
    from pycore.data.house_price import load_house_price
    from pycore.protocol import strict_protocol

    d = load_house_price()
    if protocol == "strict":
        train, _, _ = strict_protocol(d.train, d.heldout, d.feature_names)
        return train, dict(preset="strict", epochs=20)
    return d.train, dict(preset="house_price", epochs=20)


def _mnist():
    from experiments import mnist as exp
    from pycore.data.mnist import digit_covariances, load_mnist_5k, pair_task, split_digits

    args = exp.parse_args([])
    digits = load_mnist_5k()
    split = split_digits(digits, args.n_train, np.random.default_rng(args.split_seed), args.n_heldout)
    task = pair_task(digits, split, 0, 1, covariances=digit_covariances(digits, split))
    return task, dict(preset="mnist", epochs=4)


JOBS = {"house_price": lambda: _house_price("paper"), "house_price_strict": lambda: _house_price("strict"),
        "mnist": _mnist}


def floor_step(task):
    """One step of the job's bare arithmetic (see the module docstring)."""
    X_P, X_H, D = task.X_P, task.X_H, task.D
    theta = np.eye(D)
    if X_P.shape[0] >= D:           # covariance path: D×D Hessians, eigenvalues by dsytrd + dsterf
        def step():
            for X in (X_P, X_H):
                Z = X @ theta
                c, d, e, tau, _ = lapack.dsytrd(Z.T @ Z, lower=1)
                lapack.dsterf(d, e)
        return step
    V = np.linalg.svd(X_H, full_matrices=False)[2].T   # D×N, a range basis

    def step():                     # Gram path: N×N spectra, and one dense D×D update
        for X in (X_P, X_H):
            Z = X @ theta
            np.linalg.eigh(Z @ Z.T)
        V @ V.T
    return step


def steps_of(task, cfg, method):
    batch_size = PRESETS[cfg["preset"]]["batch_size"]
    n_batches = 1 if batch_size is None else -(-task.X_P.shape[0] // batch_size)
    return cfg["epochs"] * n_batches


def best_time(fn, repeat):
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(job: str, repeat: int = 3) -> dict:
    """{method: (seconds of the run, seconds of its floor, ratio)} for one reduced job."""
    task, cfg = JOBS[job]()
    step = floor_step(task)
    out = {}
    for m in METHODS:
        n = steps_of(task, cfg, m)
        run = best_time(lambda: immunize(task, m, rng=np.random.default_rng(0), **cfg), repeat)
        floor = n * best_time(lambda: [step() for _ in range(min(n, 50))], repeat) / min(n, 50)
        out[m] = (run, floor, run / floor)
    return out


@pytest.mark.parametrize("job", list(JOBS))
def test_job_floor_ratio(benchmark, job):
    task, cfg = JOBS[job]()
    benchmark.group = f"linear job at reduced size: {job}"
    step = floor_step(task)
    runs = {}

    def run_all():
        for m in METHODS:
            runs[m] = immunize(task, m, rng=np.random.default_rng(0), **cfg)

    benchmark.pedantic(run_all, rounds=3, iterations=1, warmup_rounds=1)
    n = sum(steps_of(task, cfg, m) for m in METHODS)
    floor = n * best_time(lambda: [step() for _ in range(50)], 3) / 50
    ratio = benchmark.stats.stats.min / floor
    benchmark.extra_info.update(floor_seconds=floor, ratio_to_floor=ratio)
    print(f"\n{job}: {len(METHODS)} methods × {cfg.epochs} epochs, best {benchmark.stats.stats.min:.3f} s, "
          f"floor {floor:.3f} s, ratio {ratio:.2f}")
    assert all(np.all(np.isfinite(r.theta)) for r in runs.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", default=",".join(JOBS))
    args = ap.parse_args(argv)
    print("| job | method | run (s) | floor (s) | run / floor |")
    print("|---|---|---|---|---|")
    for job in args.jobs.split(","):
        for m, (run, floor, ratio) in measure(job, args.repeat).items():
            print(f"| {job} | {m} | {run:.3f} | {floor:.3f} | {ratio:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
