#!/usr/bin/env python
"""The (i)/(ii) trade-off of deep immunization over the balance b and the R_ill weight (docs/deep.md §3).

    python experiments/deepnet_sweep.py --config demo-resnet18 --balances 0.5,1,2 --ill-balances 0.5,1,2

Per seed: θ₀ once, then each method at every point (b, b_ill) (λ = b·‖∇CE‖/‖∇term‖ for every term,
b_ill instead of b for R_ill; without --ill-balances b_ill = b), measured without the fine-tuning
attacker. Writes ``--out/<config>-sweep/``: tradeoff.json, tradeoff.md, tradeoff.png.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from experiments import common, deep_report
from experiments.deep_configs import CONFIGS
from experiments.deep_pipeline import RunOptions, tradeoff_sweep
from pycore.deep import DEEP_METHODS, HARDENINGS, options
from pycore.deep.distributed import init_from_env, shutdown
from pycore.report import dumps_json


def build_parser() -> common.Parser:
    p = common.Parser("deepnet_sweep.py", __doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(k for k, c in CONFIGS.items() if c.data == "mnist"), required=True)
    p.add_argument("--balances", type=common.comma_list(common.real(0.0, lo_open=True), max_items=50),
                   default="0.25,0.5,1,2", help="balances b")
    p.add_argument("--ill-balances", type=common.comma_list(common.real(0.0, lo_open=True), max_items=50),
                   help="R_ill balances b_ill, crossed with --balances (default: b_ill = b)")
    p.add_argument("--methods", type=common.comma_list(choices=DEEP_METHODS), default="ours", help="methods")
    p.add_argument("--harden", choices=HARDENINGS, help="hardening measured beside each point (default: the config's)")
    p.add_argument("--harden-scale", type=common.real(0.0, 1.0, lo_open=True), help="label_subspace: factor on "
                   "D_H's class-mean directions (default: the config's)")
    common.add_seeds(p, "1")
    p.add_argument("--threads", type=common.count(1, 1024), help="torch intra-op threads (recorded)")
    common.add_out(p, "results/deepnet")
    return p


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        rc = CONFIGS[args.config]
        given = {k: v for k, v in (("harden", args.harden), ("harden_scale", args.harden_scale)) if v is not None}
        rc = replace(rc, methods=tuple(args.methods), options=options(rc.options, **given))
        points = [(b, bi) for b in args.balances for bi in (args.ill_balances or [None])]
        folder = common.check_out(Path(args.out) / f"{rc.name}-sweep", ("tradeoff.json", "tradeoff.md", "tradeoff.png"))
        if args.threads:
            torch.set_num_threads(args.threads)
        ctx = init_from_env("auto")
        try:
            result = tradeoff_sweep(rc, points, args.seeds, RunOptions(quiet=True), ctx)
        finally:
            shutdown()
        if ctx.is_main:
            table = deep_report.tradeoff_markdown(result)
            common.write_outputs(folder, {"tradeoff.md": table, "tradeoff.json": dumps_json(result, indent=1),
                                          "tradeoff.png": lambda p: deep_report.plot_tradeoff(result, p)})
            print(table)
            print(f"[{rc.name}] trade-off sweep in {folder}", flush=True)
    return common.main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
