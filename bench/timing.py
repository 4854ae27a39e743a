"""What the benchmarks share: timings of several callables taken in one run, as ratios need."""

from __future__ import annotations

import time


def interleaved_best(fns: dict, repeat: int) -> dict:
    """Best-of-``repeat`` seconds of each callable, run in rotation so that load hits all alike
    (one warm-up call each first)."""
    for f in fns.values():
        f()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best
