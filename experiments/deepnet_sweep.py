"""Trade-off of deep immunization against the balance b that sets every λ (issue 12).

    python experiments/deepnet_sweep.py --config demo-vit --balances 0.25,0.5,1,2 --seeds 1 --threads 1

For each seed: θ₀ once, then each method immunized at each b (λ = b·‖∇CE‖/‖∇term‖, re-balanced
as the configuration says) and measured: RIR_θ₀, (i), (ii), D_P top-1, the paper's probe at
epoch 10. Writes ``<out>/<config>-sweep/balance_sweep.json`` and ``balance_sweep.png``. The work is
:func:`pycore.deep.evaluate.balance_sweep`.
"""
from __future__ import annotations

if not __package__:  # run as a path: one-line errors before any other import (experiments/_startup.py)
    import _startup  # noqa: F401

import sys
from pathlib import Path

import torch

from experiments import cli
from pycore.deep import DEEP_METHODS  # pycore.deep installs the torchvision shim first
from pycore.deep.distributed import init_from_env, shutdown
from pycore.deep.evaluate import CONFIGS, RunOptions, balance_sweep

OUTPUTS = ("balance_sweep.json", "balance_sweep.png")


def build_parser() -> cli.Parser:
    ap = cli.Parser(prog="deepnet_sweep.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--balances", type=cli.number_list(0.0, open_interval=True), default="0.25,0.5,1,2",
                    help="comma list of balances b > 0 (default 0.25,0.5,1,2)")
    ap.add_argument("--methods", type=cli.choice_list(DEEP_METHODS, "method"), default="ours",
                    help=f"comma list from {','.join(DEEP_METHODS)} (default ours)")
    cli.add_seeds(ap, "1")
    ap.add_argument("--threads", type=cli.integer(1), default=None, help="torch intra-op threads (recorded)")
    ap.add_argument("--out", type=Path, default=Path("results/deepnet"),
                    help="output folder; the sweep goes to OUT/<config>-sweep, replaced as a whole")
    return ap


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        rc = CONFIGS[args.config]
        final = Path(args.out) / f"{rc.name}-sweep"
        cli.OutputSet(final, OUTPUTS, create=False)
        if args.threads:
            torch.set_num_threads(args.threads)
        ctx = init_from_env("auto")
        try:
            with cli.OutputSet(final, OUTPUTS, create=ctx.is_main) as outs:
                balance_sweep(rc, list(args.balances), args.seeds,
                              RunOptions(out=Path(args.out), out_dir=outs.path, quiet=True), ctx,
                              methods=tuple(args.methods))
                if ctx.is_main:
                    print(f"[{rc.name}] balance sweep in {outs.commit()}", flush=True)
        finally:
            shutdown()
    return cli.run_main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
