"""The whole default House Prices job as a user runs it (6 methods × 5 seeds, evaluation, Figure 1,
outputs), a subprocess per round; per-method costs are in bench/bench_jobs.py.

    python -m pytest bench/bench_house_price.py --benchmark-only
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_default_house_price_run(benchmark, tmp_path):
    def run():
        env = {**os.environ, "PYTHONPATH": str(ROOT)}   # as pip install -e . makes `experiments` importable
        subprocess.run([sys.executable, "experiments/house_price.py", "--out", str(tmp_path)], cwd=ROOT,
                       env=env, check=True, capture_output=True, timeout=600)

    benchmark.group = "house_price: the default run (every method × 5 seeds + Figure 1)"
    benchmark.pedantic(run, rounds=2, iterations=1)
