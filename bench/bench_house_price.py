"""Speed of the main job and of the linear core (pytest-benchmark).

    python -m pytest bench/bench_house_price.py --benchmark-only

``test_default_house_price_run`` times the WHOLE default experiment (6 methods × 5 seeds,
evaluation, Figure 1, outputs) as a subprocess, exactly as a user runs it; the issue's target is
≤ 20 s on a 2-core machine.  The per-method benchmarks time one immunization (one seed).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pycore.data.house_price import load_house_price
from pycore.immunize import METHODS, immunize

ROOT = Path(__file__).resolve().parents[1]


def test_default_house_price_run(benchmark, tmp_path):
    def run():
        subprocess.run([sys.executable, str(ROOT / "experiments" / "house_price.py"), "--out", str(tmp_path)],
                       check=True, capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})  # as installed by pip install -e .

    benchmark.group = "house_price: full default run (6 methods x 5 seeds + Figure 1)"
    benchmark.pedantic(run, rounds=2, iterations=1)


@pytest.fixture(scope="module")
def train():
    return load_house_price().train


@pytest.mark.parametrize("method", METHODS)
def test_one_immunization(benchmark, train, method):
    benchmark.group = "house_price: one immunization (one seed)"
    benchmark(lambda: immunize(train, method, rng=np.random.default_rng(0), preset="house_price"))
