"""The linear jobs at reduced size, each method's time as a RATIO to the job's arithmetic floor
measured in the same run (:func:`floor_step`): a regression shows as a larger ratio on any machine.
The methods run one seed at a time here (``immunize``); ``bench/bench_speed.py`` measures the
stacked seeds.

    python bench/bench_jobs.py [--repeat 5]                   # the ratio table
    python -m pytest bench/bench_jobs.py --benchmark-only -s  # the same, through pytest-benchmark

Ours, Opt κ, R_ill only and IMMA run a few epochs (seed 0, the job's preset), one BLAS thread.
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

from pycore import PRESETS, immunize  # noqa: E402

METHODS = ("ours", "opt_kappa", "r_ill_only", "imma")


def house_price(protocol):
    from pycore import strict_protocol
    from pycore.data import load_house_price

    d = load_house_price()
    if protocol == "strict":
        return strict_protocol(d.train, d.heldout, d.feature_names)[0], "strict", 20
    return d.train, "house_price", 20


def mnist():
    from pycore.data import pair_task, split_digits
    from pycore.data._mnist import load_mnist_5k

    digits = load_mnist_5k()
    split = split_digits(digits, 100, np.random.default_rng(0), 100)  # mnist.py's defaults
    return pair_task(digits, split, 0, 1), "mnist", 4


JOBS = {
    "house_price": lambda: house_price("paper"),
    "house_price_strict": lambda: house_price("strict"),
    "mnist": mnist,
}


def floor_step(task):
    """One step of the bare arithmetic every step of the job must do, with the same LAPACK/BLAS
    calls: the two small-side feature products ``F = Aθ`` (``A = diag(s)Vᵀ`` of X, r×D), their
    r×r Grams ``W = FFᵀ`` and the eigenvalues of each (``dsytrd`` + ``dsterf``); on MNIST (D = 784)
    also one D×r×D product, the least a D×D gradient costs."""
    theta = np.eye(task.D)
    factors = (task.factor_P, task.factor_H)
    big = task.D > 2 * max(f.rank for f in factors)
    V = task.factor_H.V

    def step():
        for f in factors:
            F = f.features(theta)
            W = F @ F.T
            _, d, e, _, _ = lapack.dsytrd(W.T, lower=1)
            lapack.dsterf(d, e)
        if big:
            V @ V.T

    return step


def steps(task, preset, epochs):
    batch = PRESETS[preset]["batch_size"]
    return epochs * (1 if batch is None else -(-task.X_P.shape[0] // batch))


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(task, preset, epochs, method):
    return immunize(task, method, rng=np.random.default_rng(0), preset=preset, epochs=epochs)


def measure(job: str, repeat: int = 3) -> dict:
    """{method: (seconds of the run, seconds of its floor, ratio)}."""
    task, preset, epochs = JOBS[job]()
    step, n = floor_step(task), steps(task, preset, epochs)
    floor = n * best(lambda: [step() for _ in range(min(n, 50))], repeat) / min(n, 50)
    seconds = {m: best(lambda: run(task, preset, epochs, m), repeat) for m in METHODS}
    return {m: (t, floor, t / floor) for m, t in seconds.items()}


@pytest.mark.parametrize("job", list(JOBS))
def test_job_floor_ratio(benchmark, job):
    task, preset, epochs = JOBS[job]()
    step, n = floor_step(task), steps(task, preset, epochs) * len(METHODS)
    benchmark.group = f"linear job at reduced size: {job}"
    thetas = benchmark.pedantic(
        lambda: [run(task, preset, epochs, m).theta for m in METHODS],
        rounds=3,
        iterations=1,
        warmup_rounds=1,
    )
    ratio = benchmark.stats.stats.min / (n * best(lambda: [step() for _ in range(50)], 3) / 50)
    benchmark.extra_info.update(ratio_to_floor=ratio)
    print(f"\n{job}: {len(METHODS)} methods × {epochs} epochs, ratio to the floor {ratio:.2f}")
    assert all(np.all(np.isfinite(t)) for t in thetas)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs (default 3)")
    ap.add_argument("--jobs", default=",".join(JOBS), help="comma list of " + ", ".join(JOBS))
    args = ap.parse_args(argv)
    print("| job | method | run (s) | floor (s) | run / floor |\n|---|---|---|---|---|")
    for job in args.jobs.split(","):
        for m, (run, floor, ratio) in measure(job, args.repeat).items():
            print(f"| {job} | {m} | {run:.3f} | {floor:.3f} | {ratio:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
