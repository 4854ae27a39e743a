"""Deep-net immunization with timm ResNet18 / ViT (SPEC §8-9, paper §5.2, Table 3, Figure 3).

Named configurations mirror the paper's Table 4::

    python experiments/deepnet.py --config resnet18-cars --dp-root IMAGENET --dh-root CARS \
        [--checkpoint theta0.safetensors | --pretrained]
    torchrun --nproc_per_node=8 experiments/deepnet.py --config vit-country211 ...

``--demo`` runs the whole pipeline on CPU with real images and no downloads (MNIST digits
0-4 as D_P, 5-9 as D_H, 32 px RGB; ResNet18 and a small ViT trained on D_P to make θ₀, then
immunized with every method, evaluated and attacked), over ``--seeds`` (demo default 3).
Outputs go to ``results/deepnet/<config>/``: ``results.json`` (all numbers per seed and
mean ± std, seeds, threads, versions, command line), ``table.md`` (Table 3 layout next to the
paper's numbers, and the attackers), ``finetune.png`` (Figure 3, seed mean with a band),
``attacks.png`` and ``extractor_<method>.safetensors`` of the first seed (load with
:func:`pycore.deep.load_immunized`). The pipeline itself is :mod:`pycore.deep.evaluate`.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pycore.deep import (  # noqa: E402  (pycore.deep installs the torchvision shim first)
    DEEP_METHODS, CheckpointError, PretrainedUnavailableError,
)
from pycore.deep.data import DataError  # noqa: E402
from pycore.deep.distributed import init_from_env, shutdown  # noqa: E402
from pycore.deep.evaluate import CONFIGS, DEMO_CONFIGS, RunOptions, run_config  # noqa: E402
from pycore.report import parse_seeds  # noqa: E402


# --- CLI --------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), help="named configuration")
    ap.add_argument("--demo", action="store_true", help="CPU demo: " + ", ".join(DEMO_CONFIGS))
    ap.add_argument("--dp-root", help="ImageFolder root of D_P (train/ and --val-split)")
    ap.add_argument("--dh-root", help="ImageFolder root of D_H (train/ and --val-split)")
    ap.add_argument("--val-split", default="val")
    ap.add_argument("--checkpoint", help="θ₀ weights: safetensors or weights-only torch state_dict")
    ap.add_argument("--pretrained", action="store_true", help="θ₀ from timm's hub (pretrained=True)")
    ap.add_argument("--methods", help=f"comma-separated subset of {','.join(DEEP_METHODS)}")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--batch-size", type=int, help="per-rank batch size")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int, default=None, help="a single seed (same as --seeds SEED,)")
    ap.add_argument("--seeds", default=None,
                    help="count (3 = seeds 0,1,2), list (0,3,7) or range (2-4); default 3 with --demo, else 1")
    ap.add_argument("--virtual-ranks", type=int, default=1,
                    help="emulate a W-rank DDP run in one process (same shards, same objective)")
    ap.add_argument("--cache-trunk", action="store_true",
                    help="for folder data: run the frozen trunk once and keep its outputs in memory")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (recorded in results.json; results are reproducible for a "
                         "given seed AND thread count)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--out", default="results/deepnet")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.demo and not args.config:
        _parser().error("pass --config NAME or --demo")
    try:
        seeds = ([args.seed] if args.seed is not None else
                 parse_seeds(args.seeds) if args.seeds else list(range(3 if args.demo else 1)))
    except ValueError as exc:
        _parser().error(str(exc))
    opts = RunOptions(out=Path(args.out), dp_root=args.dp_root, dh_root=args.dh_root, val_split=args.val_split,
                      checkpoint=args.checkpoint, pretrained=args.pretrained, cache_trunk=args.cache_trunk,
                      virtual_ranks=args.virtual_ranks, quiet=args.quiet)
    names = DEMO_CONFIGS if args.demo else (args.config,)
    ctx = init_from_env(args.device)
    try:
        for name in names:
            rc = CONFIGS[name]
            ic = rc.immunize
            if args.batch_size:
                ic = replace(ic, batch_size=args.batch_size)
            if args.lr:
                ic = replace(ic, lr=args.lr)
            if args.max_steps is not None:
                ic = replace(ic, max_steps=args.max_steps)
            if args.epochs is not None:
                ic = replace(ic, epochs=args.epochs)
            methods = tuple(args.methods.split(",")) if args.methods else rc.methods
            bad = [m for m in methods if m not in DEEP_METHODS]
            if bad:
                raise ValueError(f"unknown method(s) {bad}; choose from {DEEP_METHODS}")
            run_config(replace(rc, immunize=ic, methods=methods), seeds, opts, ctx)
    except (DataError, CheckpointError, PretrainedUnavailableError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
