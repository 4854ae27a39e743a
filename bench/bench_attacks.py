"""Cost per step of each linear-probing attacker (pycore.attacks) as a ratio to GD with exact line
search, on House Prices' D_H (200×79, least squares) and a synthetic logistic problem of that
shape.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        python bench/bench_attacks.py [--steps 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pycore import (
    attacks as A,  # noqa: E402
    worst_case as W,  # noqa: E402
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from pycore.data import load_house_price

    d = load_house_price()
    problems = {"lsq (House Prices D_H, 200×79)": A.make_problem(d.train.X_H, d.train.Y_H)}
    rng = np.random.default_rng(0)
    X = rng.standard_normal((200, 79))
    y = (X @ rng.standard_normal(79) + rng.standard_normal(200) > 0).astype(float)
    problems["logistic (synthetic, 200×79)"] = A.make_problem(X, y, "bce")
    for label, prob in problems.items():
        rows, first = [], {}  # one configuration per attacker, from the quick grid
        for c in W.attacker_grid(prob.loss, quick=True):
            first.setdefault(c.attacker, dict(c.params))
        for name, params in first.items():
            best = np.inf
            for _ in range(args.repeats):
                tr = A.attack(prob, name, max_steps=args.steps, tol=0.0, **params)
                # tol = 0 may still stop at an exact optimum (CG, Newton): time per step taken
                best = min(best, tr.wall_seconds / max(len(tr.rel_subopt) - 1, 1))
            rows.append((name, best))
        ref = dict(rows)["gd_exact"]
        print(f"\n{label}: {args.steps} steps, best of {args.repeats}")
        print(f"{'attacker':14s} {'µs/step':>10s} {'× gd_exact':>11s}")
        for name, t in rows:
            print(f"{name:14s} {1e6 * t:10.1f} {t / ref:11.2f}")


if __name__ == "__main__":
    main()
