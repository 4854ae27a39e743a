"""How fast exact Algorithm 1 could be: the calls that no layout of its step can skip, timed bare,
against the loop that makes them, and the least time those calls give the strict protocol and
full MNIST commands (docs/design.md §6).  One BLAS thread.

Every step of Algorithm 1 (Ours with fixed λ's) and of Opt κ must, for each run and each of the
two tasks, form the small-side features ``F = Aθ`` and their Gram ``W = FFᵀ``, reduce W to
tridiagonal form and take its eigenvalues (``dsytrd`` + ``dsterf``: κ, the rank and the ties), and
take the extreme eigenvectors that the gradient uses (``dstein`` + ``dormqr``: one per task for
Ours, two for Opt κ); Adam then needs the dense θ-gradient, one product of the joined low-rank
factors (D'×k×D, k = the loss head's columns + r_P + r_H for Ours, + 4 for Opt κ).  The floor
below is those calls and nothing else, on a near-identity θ.  Each row times the method's real
stacked loop (``immunize_batch``, the command's seeds) and its floor in one run, and gives their
ratio; the command rows multiply each floor by the command's run-steps and divide by its workers.

    python bench/bench_bound.py [--repeat 3]
    python -m pytest bench/bench_bound.py --benchmark-only -s
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

from bench.bench_jobs import JOBS  # noqa: E402
from bench.timing import interleaved_best  # noqa: E402
from pycore.immunization import PRESETS, immunize_batch  # noqa: E402

# The two commands the 4× target names: (job, seeds, epochs, the epochs the loop is timed over,
# how many tasks like the job's the command holds, its workers).  Ours runs with fixed λ's in
# both presets; IMMA, R_ill only, the evaluations and the start are left out, so the bound is low.
COMMANDS = {
    "house_price.py --protocol strict": ("house_price_strict", 5, 1000, 50, 1, 2),
    "mnist.py (90 pairs)": ("mnist", 3, 30, 30, 90, 2),
}
METHODS = ("ours", "opt_kappa", "opt_kappa_balanced")
OTHERS = ("imma", "r_ill_only")  # the command's other loops, timed as they run


def _vectors(method: str) -> int:
    """Extreme eigenvectors per task and step: Ours' R_well takes W_P's largest and R_ill W_H's
    smallest; Opt κ both of each."""
    return 1 if method == "ours" else 2


def floor_step(task, method: str, preset: str):
    """One run-step of the calls :mod:`bench_bound` names, as a callable (θ near I)."""
    rng = np.random.default_rng(0)
    theta = np.eye(task.D) + 1e-3 * rng.standard_normal((task.D, task.D))
    factors = (task.factor_P, task.factor_H)
    live = np.flatnonzero(task.factor_P.live | task.factor_H.live)
    m = task.Y_P.shape[1]
    if method == "ours":
        k = m + task.factor_H.rank + (task.factor_P.rank if PRESETS[preset]["lambda_p"] else 0)
    else:
        k = m + 4
    L, R = rng.standard_normal((live.size, k)), rng.standard_normal((k, task.D))
    n_vec = _vectors(method)

    def step():
        for f in factors:
            F = f.features(theta)
            W = F @ F.T
            n = W.shape[0]
            lwork = int(lapack.dsyevr_lwork(n, lower=1)[0])  # dsyevr's, as pycore.spectral
            c, d, e, tau, _ = lapack.dsytrd(W.T, lower=1, lwork=lwork - 5 * n)
            w, _ = lapack.dsterf(d, e)
            iblock, isplit = np.ones(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
            isplit[0] = n
            for j in (n - 1, 0)[:n_vec]:
                z, _ = lapack.dstein(d, e, w[j : j + 1], iblock, isplit)
                lapack.dormqr(b"L", b"N", c[1:, : n - 1], tau, z[1:, :], lwork - 2 * n)
        L @ R

    return step


def loop_step(task, method: str, preset: str, seeds: int, epochs: int):
    """The method's stacked loop over ``seeds`` runs for ``epochs`` epochs, and its run-steps
    (R_ill only from θ = I draws nothing: its seeds are one run, as the runners compute it)."""
    batch = PRESETS[preset]["batch_size"]
    per_epoch = 1 if batch is None else -(-task.X_P.shape[0] // batch)
    runs = 1 if method == "r_ill_only" else seeds

    def run():
        rngs = [np.random.default_rng(s) for s in range(runs)]
        immunize_batch(task, method, rngs=rngs, preset=preset, epochs=epochs)

    return run, runs * epochs * per_epoch


def measure(job: str, seeds: int, epochs: int, repeat: int) -> dict:
    """``{method: (loop seconds per run-step, floor seconds per run-step or None)}`` in one run:
    the Algorithm 1 methods against their floors, the command's other loops as they run."""
    task, preset, _ = JOBS[job]()
    out = {}
    for method in METHODS + OTHERS:
        run, n = loop_step(task, method, preset, seeds, epochs)
        fns = {"loop": run}
        if method in METHODS:
            step = floor_step(task, method, preset)
            fns["floor"] = lambda step=step: [step() for _ in range(20)]
        t = interleaved_best(fns, repeat)
        out[method] = (t["loop"] / n, t["floor"] / 20 if "floor" in t else None)
    return out


@pytest.mark.parametrize("command", list(COMMANDS))
def test_loops_against_their_floor(benchmark, command):
    """pytest-benchmark's record of one command's rows; every loop does its floor's work and
    more, so each ratio is above 1 (a floor that counted work the loop skips would not be)."""
    job, seeds, _, loop_epochs, _, _ = COMMANDS[command]
    benchmark.group = f"exact Algorithm 1 against its floor: {command}"
    rows = benchmark.pedantic(
        lambda: measure(job, seeds, loop_epochs, 1), rounds=1, iterations=1, warmup_rounds=0
    )
    ratios = {m: loop / floor for m, (loop, floor) in rows.items() if floor is not None}
    benchmark.extra_info.update(loop_over_floor=ratios)
    print(f"\n{command}: loop / floor {ratios}")
    assert all(r > 1.0 for r in ratios.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs (default 3)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print("| command | method | loop (µs/run-step) | floor (µs/run-step) | loop / floor |")
    print("|---|---|---|---|---|")
    bounds = {}
    for command, (job, seeds, epochs, loop_epochs, tasks, workers) in COMMANDS.items():
        task, preset, _ = JOBS[job]()
        batch = PRESETS[preset]["batch_size"]
        per_epoch = 1 if batch is None else -(-task.X_P.shape[0] // batch)
        floor_cpu = rest_cpu = 0.0
        for method, (loop, floor) in measure(job, seeds, loop_epochs, args.repeat).items():
            runs = 1 if method == "r_ill_only" else seeds
            run_steps = tasks * runs * epochs * per_epoch
            if floor is None:
                print(f"| {command} | {method} | {loop * 1e6:.0f} | | |", flush=True)
                rest_cpu += run_steps * loop
                continue
            row = f"{loop * 1e6:.0f} | {floor * 1e6:.0f} | {loop / floor:.2f}"
            print(f"| {command} | {method} | {row} |", flush=True)
            floor_cpu += run_steps * floor
        bounds[command] = (floor_cpu / workers, rest_cpu / workers)
    print(
        "\n| command | its Algorithm 1 loops at their floor (s) | + IMMA and R_ill only as they "
        "run (s) | sum (s) |"
    )
    print("|---|---|---|---|")
    for command, (floor, rest) in bounds.items():
        print(f"| {command} | {floor:.1f} | {rest:.1f} | {floor + rest:.1f} |")
    print(f"\n(on 2 workers; {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
