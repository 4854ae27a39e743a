"""Where the CPU time of the linear jobs goes, phase by phase (docs/performance.md).

    python bench/profile_jobs.py house_price [--protocol strict] [--seeds 5]
    python bench/profile_jobs.py mnist [--pairs 0-1,7-2] [--seeds 1]

Runs the stages of ``experiments/house_price.py`` / ``experiments/mnist.py`` in ONE process,
in order, and prints the CPU seconds (``time.process_time``, so the figures hold on a shared
machine where wall time does not) of each: interpreter start and imports, data, the RIR
ceiling, immunization per method, evaluation, Figure 1's probing curves, the figure.  The
experiment scripts run the (method, seed) or pair work on ``--jobs`` worker processes; the
sum of the per-method and evaluation rows is that parallel part, the rest is serial.  For MNIST
the per-run figures of the sample are also scaled to the 90 × 3 grid.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: profile another tree

import numpy as np  # noqa: E402

from pycore.immunize import METHODS, immunize  # noqa: E402
from pycore.metrics import rir_ceiling  # noqa: E402

T_IMPORT = time.process_time()   # interpreter start + numpy/scipy/pycore


def _clock():
    t = [time.process_time()]

    def lap():
        now = time.process_time()
        dt, t[0] = now - t[0], now
        return dt
    return lap


def house_price(args):
    from pycore.data.house_price import load_house_price
    from pycore.evaluate import evaluate_linear, norm_ratio_curves
    from pycore.protocol import strict_protocol
    try:
        from pycore.evaluate import EvaluationReference
    except ImportError:   # an older tree: every evaluation builds its own constants
        EvaluationReference = None
    lap = _clock()
    rows = [("interpreter start + imports", T_IMPORT)]
    d = load_house_price()
    train, held, preset = d.train, d.heldout, "house_price"
    if args.protocol == "strict":
        train, held, _ = strict_protocol(train, held, d.feature_names)
        preset = "strict"
    rows.append(("data (CSV, encoding, protocol)", lap()))
    ceiling = rir_ceiling(train.X_P, train.X_H)
    ref = EvaluationReference(train, held) if EvaluationReference else None
    rows.append(("RIR ceiling + evaluation constants", lap()))
    ev, thetas = 0.0, {}
    for m in METHODS:
        for s in range(args.seeds):
            res = immunize(train, m, rng=np.random.default_rng(s), preset=preset)
            rows_m = lap()
            if ref is not None:
                evaluate_linear(res.theta, train, held, ceiling=ceiling, reference=ref)
            else:
                evaluate_linear(res.theta, train, held, ceiling=ceiling)
            ev += lap()
            thetas.setdefault(m, res.theta)
            rows.append((f"immunize {m}", rows_m))
    rows.append(("evaluation (all runs)", ev))
    curves = {m: {k: v.tolist() for k, v in norm_ratio_curves(th, train, 100).items()}
              for m, th in thetas.items()}
    rows.append(("Figure 1 probing curves", lap()))
    from experiments.house_price import plot_norm_ratio
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_norm_ratio({"norm_ratio_curves": {"curves": curves, "seed": 0}, "protocol": args.protocol,
                     "data": {"paper": True, "files": [], "D": train.D}}, out / "norm_ratio.png")
    rows.append(("figure (matplotlib import + plot + PNG)", lap()))
    return rows


def mnist(args):
    from experiments import mnist as exp
    from pycore.data.mnist import digit_covariances, load_mnist, split_digits
    lap = _clock()
    rows = [("interpreter start + imports", T_IMPORT)]
    a = exp.parse_args([])
    digits = load_mnist(None)
    split = split_digits(digits, a.n_train, np.random.default_rng(a.split_seed), a.n_heldout)
    K = digit_covariances(digits, split)
    rows.append(("data (CSV, split, covariances)", lap()))
    pairs = [tuple(int(x) for x in p.split("-")) for p in args.pairs.split(",")]
    exp._STATE.update(digits=digits, split=split, K=K, immunize=a.immunizer, methods=[], seeds=[0],
                      save=False)
    for pr in pairs:
        exp._one_pair(pr)
    per_pair = lap() / len(pairs)
    rows.append(("per pair: tasks, ceiling, evaluation constants", per_pair))
    runs = len(pairs) * args.seeds
    spent = {"immunize": 0.0}
    real = a.immunizer

    def timed(*a, **k):   # the immunization time inside _one_pair; the rest of it is evaluation
        t0 = time.process_time()
        try:
            return real(*a, **k)
        finally:
            spent["immunize"] += time.process_time() - t0
    exp._STATE["immunize"] = timed
    try:
        for m in METHODS:
            exp._STATE.update(methods=[m], seeds=list(range(args.seeds)))
            spent["immunize"] = 0.0
            lap()
            for pr in pairs:
                exp._one_pair(pr)
            total = lap()
            rows.append((f"per run: immunize {m}", spent["immunize"] / runs))
            evaluate = total - spent["immunize"] - per_pair * len(pairs)
            rows.append((f"per run: evaluate {m}", evaluate / runs))
    finally:
        exp._STATE["immunize"] = real
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", choices=("house_price", "mnist"))
    ap.add_argument("--protocol", choices=("paper", "strict"), default="paper")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--pairs", default="0-1,7-2")
    ap.add_argument("--out", default="/tmp/pycore_profile")
    args = ap.parse_args(argv)
    if args.seeds is None:
        args.seeds = 5 if args.job == "house_price" else 1
    rows = house_price(args) if args.job == "house_price" else mnist(args)
    merged: dict[str, float] = {}
    for k, v in rows:
        merged[k] = merged.get(k, 0.0) + v
    print("| phase | CPU s |")
    print("|---|---|")
    for k, v in merged.items():
        print(f"| {k} | {v:.3f} |")
    if args.job == "house_price":
        print(f"| total | {sum(merged.values()):.3f} |")
    else:
        per_run = sum(v for k, v in merged.items() if k.startswith("per run"))
        grid = 90 * (per_pair := merged["per pair: tasks, ceiling, evaluation constants"]) \
            + 270 * per_run
        print(f"| grid estimate (90 pairs × 3 seeds, serial) | {grid:.0f} |")
        del per_pair
    return 0


if __name__ == "__main__":
    sys.exit(main())
