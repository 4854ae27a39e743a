"""Per-call time of gemm, eigh and SVD with 1 and 2 BLAS threads per matrix size: the measurement
behind ``SMALL_MATRIX_DIM`` of pycore/_threads.py (up to which the library runs its BLAS
single-threaded; tests/test_threads.py checks that it does).

    python bench/bench_threads.py [--sizes 79,256,784,1500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from threadpoolctl import ThreadpoolController


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="79,256,784,1500", help="matrix sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    args = ap.parse_args(argv)
    ctl, rng, res = ThreadpoolController(), np.random.default_rng(0), {}
    print("| n | op | 1 thread (ms) | 2 threads (ms) | 2 / 1 |\n|---|---|---|---|---|")
    for n in map(int, args.sizes.split(",")):
        A = rng.standard_normal((n, n))
        S, X = A @ A.T, rng.standard_normal((max(n, 200), n))
        ops = {
            "gemm": lambda: A @ A,
            "eigh": lambda: np.linalg.eigh(S),
            "svd": lambda: np.linalg.svd(X, full_matrices=False),
        }
        calls = max(2, int(1e8 / n**3))
        for name, f in ops.items():
            for _ in range(args.rounds):
                for th in (1, 2):  # interleaved, so that load hits both alike
                    with ctl.limit(limits=th, user_api="blas"):
                        t = time.perf_counter()
                        for _ in range(calls):
                            f()
                        res.setdefault((name, th), []).append((time.perf_counter() - t) / calls)
            t1, t2 = (statistics.median(res.pop((name, th))) for th in (1, 2))
            print(
                f"| {n} | {name} | {1e3 * t1:.3f} | {1e3 * t2:.3f} | {t2 / t1:.2f} |", flush=True
            )


if __name__ == "__main__":
    main()
