"""Fast by default: the README's library snippet ("The library") with the DEFAULT BLAS threads against
the same snippet single-threaded (pycore/threads.py, docs/design.md §5).

    python -m pytest bench/bench_threads.py --benchmark-only -s     # the ratio, target ≤ 1.3
    python bench/bench_threads.py --sizes 79,256,784,1500           # 1 vs 2 threads per matrix size

Both snippet variants run as fresh subprocesses, interleaved round by round, so machine load hits
them alike; the ratio is of the medians of the in-process times (data loading, immunization,
RIR and ceiling; interpreter start and imports excluded).  "Default threads" means no
OMP/OPENBLAS/MKL variable in the environment (bench/conftest.py pins them for the other
benchmarks; they are removed here).  The ``--sizes`` mode is the measurement behind
``pycore.threads.SMALL_MATRIX_DIM``: per-call time of loops of gemm, eigh and SVD at each size.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "PYCORE_BLAS_THREADS")

SNIPPET = """
import time
import numpy as np
from pycore import rir, rir_ceiling
from pycore.data.house_price import load_house_price
from pycore.immunize import immunize
t0 = time.perf_counter()
data = load_house_price()
t = data.train
res = immunize(t, "ours", rng=np.random.default_rng(0), preset="house_price")
r = rir(res.theta, t.X_P, t.X_H)
c = rir_ceiling(t.X_P, t.X_H)
print(time.perf_counter() - t0, r.value)
"""


def _env(single: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if single:
        env["OMP_NUM_THREADS"] = "1"
    return env


def run_snippet(single: bool) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", SNIPPET], env=_env(single), cwd=ROOT, capture_output=True,
                         text=True, timeout=600, check=True)
    seconds, value = out.stdout.split()
    return float(seconds), float(value)


def test_snippet_default_threads_within_1_3x_of_single(benchmark):
    times = {"default": [], "single": []}
    values = set()

    def one_round():
        for label, single in (("default", False), ("single", True)):
            sec, val = run_snippet(single)
            times[label].append(sec)
            values.add(val)

    benchmark.group = "threads: README snippet, default threads then OMP_NUM_THREADS=1"
    benchmark.pedantic(one_round, rounds=3, iterations=1)
    d, s = statistics.median(times["default"]), statistics.median(times["single"])
    benchmark.extra_info.update({"default_s": times["default"], "single_s": times["single"], "ratio": d / s})
    print(f"\nsnippet: default threads {d:.2f} s, single thread {s:.2f} s (medians of 3), ratio {d / s:.2f}")
    assert len(values) == 1, f"the snippet's RIR depends on the thread count: {values}"
    assert d / s <= 1.3, f"default threads take {d / s:.2f}× the single-thread time"


def sizes_table(sizes, rounds: int) -> None:
    import numpy as np
    from threadpoolctl import ThreadpoolController

    ctl = ThreadpoolController()
    rng = np.random.default_rng(0)
    res: dict = {}
    for n in sizes:
        A = rng.standard_normal((n, n))
        S = A @ A.T
        X = rng.standard_normal((max(n, 200), n))
        ops = {"gemm": lambda: A @ A, "eigh": lambda: np.linalg.eigh(S),
               "svd": lambda: np.linalg.svd(X, full_matrices=False)}
        calls = max(2, int(1e8 / n ** 3))
        for name, f in ops.items():
            for _ in range(rounds):
                for th in (1, 2):
                    with ctl.limit(limits=th, user_api="blas"):
                        t = time.perf_counter()
                        for _ in range(calls):
                            f()
                        res.setdefault((n, name, th), []).append((time.perf_counter() - t) / calls)
    print("| n | op | 1 thread (ms) | 2 threads (ms) | 2 / 1 |\n|---|---|---|---|---|")
    for n in sizes:
        for name in ("gemm", "eigh", "svd"):
            t1, t2 = statistics.median(res[(n, name, 1)]), statistics.median(res[(n, name, 2)])
            print(f"| {n} | {name} | {1e3 * t1:.3f} | {1e3 * t2:.3f} | {t2 / t1:.2f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="79,256,784,1500", help="matrix sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--snippet-rounds", type=int, default=0, help="also time the snippet this many rounds")
    a = ap.parse_args()
    sizes_table([int(s) for s in a.sizes.split(",")], a.rounds)
    if a.snippet_rounds:
        t = {False: [], True: []}
        for _ in range(a.snippet_rounds):
            for single in (False, True):
                t[single].append(run_snippet(single)[0])
        d, s = statistics.median(t[False]), statistics.median(t[True])
        print(f"snippet: default {t[False]} s, single {t[True]} s; median ratio {d / s:.2f}")
