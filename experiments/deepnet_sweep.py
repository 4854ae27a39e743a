"""Trade-off of deep immunization against the balance b that sets every λ (issue 12).

    python experiments/deepnet_sweep.py --config demo-vit --balances 0.25,0.5,1,2 --seeds 1 --threads 1

For each seed: θ₀ once, then each method immunized at each b (λ = b·‖∇CE‖/‖∇term‖, re-balanced
as the configuration says) and measured: RIR_θ₀, (i), (ii), D_P top-1, the paper's probe at
epoch 10. Writes ``<out>/<config>/balance_sweep.json`` and ``balance_sweep.png``. The work is
:func:`pycore.deep.evaluate.balance_sweep`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pycore.deep import DEEP_METHODS  # noqa: E402  (pycore.deep installs the torchvision shim first)
from pycore.deep.distributed import init_from_env, shutdown  # noqa: E402
from pycore.deep.evaluate import CONFIGS, RunOptions, balance_sweep  # noqa: E402
from pycore.report import parse_seeds  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--balances", default="0.25,0.5,1,2", help="comma-separated values of b")
    ap.add_argument("--methods", default="ours", help=f"comma-separated subset of {','.join(DEEP_METHODS)}")
    ap.add_argument("--seeds", default="1", help="count (3 = seeds 0,1,2), list (0,3,7) or range (2-4)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (recorded)")
    ap.add_argument("--out", default="results/deepnet")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        balances = [float(b) for b in args.balances.split(",") if b.strip()]
        seeds = parse_seeds(args.seeds)
        methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
        bad = [m for m in methods if m not in DEEP_METHODS]
        if bad or not balances or any(not b > 0 for b in balances):
            raise ValueError(f"bad --methods {bad} or --balances {args.balances!r} (positive numbers)")
    except ValueError as exc:
        ap.error(str(exc))
    ctx = init_from_env("auto")
    try:
        balance_sweep(CONFIGS[args.config], balances, seeds, RunOptions(out=Path(args.out), quiet=True), ctx,
                      methods=methods)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
