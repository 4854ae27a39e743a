"""The (i)/(ii) trade-off of deep immunization over the balance b and the R_ill weight (docs/deep.md).

    python experiments/deepnet_sweep.py --config demo-resnet18 --balances 0.5,1,2 --ill-balances 0.5,1,2

For each seed: θ₀ once, then each method immunized at every point (b, b_ill) of the grid
(λ = b·‖∇CE‖/‖∇term‖ for every term, re-balanced as the configuration says, and b_ill instead of
b for R_ill; without --ill-balances, b_ill = b) and measured: RIR_θ₀, (i), (ii), Definition 3.1,
D_P top-1, the paper's GD probe at epoch 10 and the Adam probes at epochs 1 and 5 (plain and
whitened), hardened as well when the configuration hardens (--harden none to skip). Writes
``<out>/<config>-sweep/``: ``tradeoff.json``, ``tradeoff.md`` and ``tradeoff.png`` (the frontier
log (i) vs log (ii), and D_P top-1 and the Adam probe against (i)). The work is
:func:`pycore.deep.evaluate.tradeoff_sweep`.
"""
from __future__ import annotations

if not __package__:  # run as a path: one-line errors before any other import (experiments/_startup.py)
    import _startup  # noqa: F401

import sys
from dataclasses import replace
from pathlib import Path

import torch

from experiments import cli
from pycore.deep import DEEP_METHODS  # pycore.deep installs the torchvision shim first
from pycore.deep.distributed import init_from_env, shutdown
from pycore.deep.evaluate import RunOptions, tradeoff_sweep
from pycore.deep.harden import HARDENINGS
from pycore.report import write_json

from experiments import deep_report
from experiments.deep_configs import CONFIGS

OUTPUTS = ("tradeoff.json", "tradeoff.md", "tradeoff.png")


def build_parser() -> cli.Parser:
    ap = cli.Parser(prog="deepnet_sweep.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(k for k, c in CONFIGS.items() if c.data == "mnist"),
                    required=True)
    ap.add_argument("--balances", type=cli.number_list(0.0, open_interval=True), default="0.25,0.5,1,2",
                    help="comma list of balances b > 0 (default 0.25,0.5,1,2)")
    ap.add_argument("--ill-balances", type=cli.number_list(0.0, open_interval=True), default=None,
                    help="comma list of R_ill balances b_ill > 0, crossed with --balances "
                         "(default: b_ill = b)")
    ap.add_argument("--methods", type=cli.choice_list(DEEP_METHODS, "method"), default="ours",
                    help=f"comma list from {','.join(DEEP_METHODS)} (default ours)")
    ap.add_argument("--harden", choices=HARDENINGS, default=None,
                    help="hardening measured beside each point (default: the configuration's)")
    ap.add_argument("--harden-scale", type=cli.real(0.0, above=True, hi=1.0), default=None,
                    help="label_subspace: factor on D_H's class-mean directions "
                         "(default: the configuration's)")
    cli.add_seeds(ap, "1")
    ap.add_argument("--threads", type=cli.integer(1), default=None, help="torch intra-op threads (recorded)")
    ap.add_argument("--out", type=Path, default=Path("results/deepnet"),
                    help="output folder; the sweep goes to OUT/<config>-sweep, replaced as a whole")
    return ap


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        rc = CONFIGS[args.config]
        if args.harden is not None:
            rc = replace(rc, immunize=replace(rc.immunize, harden=args.harden))
        if args.harden_scale is not None:
            rc = replace(rc, immunize=replace(rc.immunize, harden_scale=args.harden_scale))
        if rc.immunize.balance is None:
            raise cli.UsageError(f"config {rc.name} does not balance its λ's; the sweep varies the balance",
                                 "--config")
        points = ([(b, bi) for b in args.balances for bi in args.ill_balances] if args.ill_balances
                  else [(b, None) for b in args.balances])
        final = Path(args.out) / f"{rc.name}-sweep"
        cli.OutputSet(final, OUTPUTS, create=False)
        if args.threads:
            torch.set_num_threads(args.threads)
        ctx = init_from_env("auto")
        try:
            with cli.OutputSet(final, OUTPUTS, create=ctx.is_main) as outs:
                result = tradeoff_sweep(rc, points, args.seeds, RunOptions(quiet=True), ctx,
                                        methods=tuple(args.methods))
                if ctx.is_main:
                    table = deep_report.tradeoff_markdown(result)
                    (outs.path / "tradeoff.md").write_text(table)
                    deep_report.plot_tradeoff(result, outs.path / "tradeoff.png")
                    write_json(outs.path / "tradeoff.json", result)
                    print(table)
                    print(f"[{rc.name}] trade-off sweep in {outs.commit()}", flush=True)
        finally:
            shutdown()
    return cli.run_main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
