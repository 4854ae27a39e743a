"""How fast exact Algorithm 1 could be: the calls that no layout of its step can skip, timed bare,
against the loops that make them, and the least time those calls leave the strict protocol and
MNIST commands, against the command itself, all in one run (docs/design.md §6).  One BLAS thread
for the loops; the commands run as the README runs them (two workers).

Every step of Algorithm 1 (Ours with fixed λ's) and of Opt κ must, for each run and each of the
two tasks, form the small-side features ``F = Aθ`` and their Gram ``W = FFᵀ``, reduce W to
tridiagonal form and take its eigenvalues (``dsytrd`` + ``dsterf``: κ, the rank and the ties), and
take the extreme eigenvectors that the gradient uses (``dstein`` + ``dormqr``: one per task for
Ours, two for Opt κ); Adam then needs the dense θ-gradient, one product of the joined low-rank
factors (D'×k×D, k = the loss head's columns + r_P + r_H for Ours, + 4 for Opt κ).  The floor
is those calls and nothing else, on a near-identity θ.  Each method row times the method's real
stacked loop (``immunize_batch``, the command's seeds) and its floor, and gives their ratio.  The
command rows add each floor times the command's run-steps, and IMMA's and R_ill only's loops as
they run, over the command's workers: the "bound", which leaves out starting, the evaluations and
the outputs; then the command's own wall time and its ratio to the bound: the most that a layout
of these calls could still gain on it while IMMA and R_ill only stay as they are.

    python bench/bench_bound.py [--repeat 3] [--no-commands]
    python -m pytest bench/bench_bound.py --benchmark-only -s
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
for _var in THREAD_VARS:
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.linalg.lapack as lapack  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_jobs import JOBS  # noqa: E402
from bench.timing import interleaved_best  # noqa: E402
from pycore import PRESETS, immunize_batch  # noqa: E402
from pycore._immunization import resolve_options  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Command:
    """One command of the 4× target and what its Algorithm 1 loops are."""

    argv: tuple  # after ``python``, from the repository root
    job: str  # bench_jobs' task like the command's (each of its tasks alike)
    seeds: int
    epochs: int
    loop_epochs: int  # the epochs the loops are timed over
    tasks: int  # how many such tasks the command runs
    workers: int = 2  # its default --jobs on two cores


# Ours runs with fixed λ's in both presets.  MNIST's ordered pairs are alike (100 training images
# per digit, rank 100): the four-pair command stands for the 90.
COMMANDS = (
    Command(
        argv=("experiments/house_price.py", "--protocol", "strict"),
        job="house_price_strict",
        seeds=5,
        epochs=1000,
        loop_epochs=50,
        tasks=1,
    ),
    Command(
        argv=("experiments/mnist.py", "--pairs", "0-1,3-8,7-2,1-7"),
        job="mnist",
        seeds=3,
        epochs=30,
        loop_epochs=30,
        tasks=4,
    ),
)
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
    # dsyevr's workspace per W size, as pycore/_spectral.py caches it: once, not once per step
    lworks = [int(lapack.dsyevr_lwork(f.A.shape[0], lower=1)[0]) for f in factors]
    live = np.flatnonzero(task.factor_P.live | task.factor_H.live)
    m = task.Y_P.shape[1]
    if method == "ours":
        lambda_p = resolve_options("ours", preset).lambda_p
        k = m + task.factor_H.rank + (task.factor_P.rank if lambda_p else 0)
    else:
        k = m + 4
    L, R = rng.standard_normal((live.size, k)), rng.standard_normal((k, task.D))
    n_vec = _vectors(method)

    def step():
        for f, lwork in zip(factors, lworks):
            F = f.features(theta)
            W = F @ F.T
            n = W.shape[0]
            c, d, e, tau, _ = lapack.dsytrd(W.T, lower=1, lwork=lwork - 5 * n)
            w, _ = lapack.dsterf(d, e)
            iblock, isplit = np.ones(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
            isplit[0] = n
            for j in (n - 1, 0)[:n_vec]:
                z, _ = lapack.dstein(d, e, w[j : j + 1], iblock, isplit)
                lapack.dormqr(b"L", b"N", c[1:, : n - 1], tau, z[1:, :], lwork - 2 * n)
        L @ R

    return step


def steps_per_epoch(task, preset: str) -> int:
    """Steps per epoch of the preset's D_P mini-batches (one with the full batch)."""
    batch = PRESETS[preset]["batch_size"]
    return 1 if batch is None else -(-task.X_P.shape[0] // batch)


def run_steps(task, method: str, preset: str, seeds: int, epochs: int) -> int:
    """Run-steps of ``seeds`` runs of ``method`` for ``epochs`` epochs: a method whose runs draw
    nothing (R_ill only from θ = I) is one run, as the runners compute it."""
    runs = seeds if resolve_options(method, preset).draws_random else 1
    return runs * epochs * steps_per_epoch(task, preset)


def loop_step(task, method: str, preset: str, seeds: int, epochs: int):
    """The method's stacked loop over ``seeds`` runs for ``epochs`` epochs, and its run-steps."""

    def run():
        rngs = [np.random.default_rng(s) for s in range(seeds)]
        immunize_batch(task, method, rngs=rngs, preset=preset, epochs=epochs)

    return run, run_steps(task, method, preset, seeds, epochs)


def measure(task, preset: str, seeds: int, epochs: int, repeat: int) -> dict:
    """``{method: (loop seconds per run-step, floor seconds per run-step or None)}`` in one run:
    the Algorithm 1 methods against their floors, the command's other loops as they run."""
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


def bound(command: Command, task, preset: str, rows: dict) -> tuple[float, float]:
    """Seconds, over the command's workers, of its Algorithm 1 loops at their floor and of its
    other loops as they run (``rows`` from :func:`measure` on ``task``)."""
    floors = others = 0.0
    for method, (loop, floor) in rows.items():
        n = command.tasks * run_steps(task, method, preset, command.seeds, command.epochs)
        if floor is None:
            others += n * loop
        else:
            floors += n * floor
    return floors / command.workers, others / command.workers


def run_command(command: Command) -> float:
    """Wall seconds of the command, as the README runs it (its outputs to a scratch folder)."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}  # its own threads
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, *command.argv, "--out", out],
            cwd=ROOT,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return time.perf_counter() - t0


def name(command: Command) -> str:
    return " ".join(command.argv).removeprefix("experiments/")


@pytest.mark.parametrize("command", COMMANDS, ids=name)
def test_loops_against_their_floor(benchmark, command):
    """pytest-benchmark's record of one command's method rows; every loop does its floor's work
    and more, so each ratio is above 1 (a floor that counted work the loop skips would not be)."""
    benchmark.group = f"exact Algorithm 1 against its floor: {name(command)}"
    task, preset, _ = JOBS[command.job]()
    rows = benchmark.pedantic(
        lambda: measure(task, preset, command.seeds, command.loop_epochs, 1),
        rounds=1,
        iterations=1,
        warmup_rounds=0,
    )
    ratios = {m: loop / floor for m, (loop, floor) in rows.items() if floor is not None}
    benchmark.extra_info.update(loop_over_floor=ratios)
    print(f"\n{name(command)}: loop / floor {ratios}")
    assert all(r > 1.0 for r in ratios.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs (default 3)")
    ap.add_argument(
        "--no-commands", action="store_true", help="skip timing the commands themselves"
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    print("| command | method | loop (µs/run-step) | floor (µs/run-step) | loop / floor |")
    print("|---|---|---|---|---|")
    bounds = {}
    for command in COMMANDS:
        task, preset, _ = JOBS[command.job]()
        rows = measure(task, preset, command.seeds, command.loop_epochs, args.repeat)
        for method, (loop, floor) in rows.items():
            row = f"{loop * 1e6:.0f} | " + (
                "|" if floor is None else f"{floor * 1e6:.0f} | {loop / floor:.2f}"
            )
            print(f"| {name(command)} | {method} | {row} |", flush=True)
        bounds[command] = bound(command, task, preset, rows)
    print(
        "\n| command | Algorithm 1 loops at their floor (s) | IMMA and R_ill only as they run (s) "
        "| bound (s) | the command (s) | command / bound |\n|---|---|---|---|---|---|"
    )
    for command, (floors, others) in bounds.items():
        b = floors + others
        wall = None if args.no_commands else run_command(command)
        tail = "| |" if wall is None else f"{wall:.1f} | {wall / b:.2f} |"
        print(f"| {name(command)} | {floors:.1f} | {others:.1f} | {b:.1f} | {tail}", flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
