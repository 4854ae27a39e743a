"""Deep-net immunization with timm ResNet18 / ViT (docs/deep.md; docs/theory.md §8-9; paper §5.2, Table 3).

Named configurations mirror the paper's Table 4::

    python experiments/deepnet.py --config resnet18-cars --dp-root IMAGENET --dh-root CARS \
        [--checkpoint theta0.safetensors | --pretrained]
    torchrun --nproc_per_node=8 experiments/deepnet.py --config vit-country211 ...

``--demo`` runs the whole pipeline on CPU with real images and no downloads (MNIST digits
0-4 as D_P, 5-9 as D_H, 32 px RGB; ResNet18 and a small ViT trained on D_P to make θ₀, then
immunized with every method, hardened, evaluated and attacked), over ``--seeds`` (demo
default 3). Outputs go to ``results/deepnet/<config>/``: ``results.json`` (all numbers per seed
and mean ± std, seeds, threads, per-phase seconds, versions, command line), ``table.md``
(Table 3 layout next to the paper's numbers, the attackers, every row against θ₀),
``finetune.png`` (Figure 3, seed mean with a band), ``attacks.png`` and
``extractor_<row>.safetensors`` of the first seed (load with :func:`pycore.deep.load_immunized`).
The configurations are ``experiments/deep_configs.py``, the pipeline :mod:`pycore.deep.evaluate`,
the tables and figures ``experiments/deep_report.py``.
"""
from __future__ import annotations

if not __package__:  # run as a path: one-line errors before any other import (experiments/_startup.py)
    import _startup  # noqa: F401

import sys
from dataclasses import replace
from pathlib import Path

import torch

from experiments import cli
from pycore.deep import DEEP_METHODS, DeepImmunizeConfig  # pycore.deep installs the torchvision shim first
from pycore.deep.distributed import init_from_env, shutdown
from pycore.deep.evaluate import RunOptions, run_config
from pycore.deep.harden import HARDENINGS
from pycore.deep.models import save_immunized
from pycore.report import write_json

from experiments import deep_report
from experiments.deep_configs import CONFIGS, DEMO_CONFIGS, PAPER_KEY, PAPER_TABLE3

FLAG_FIELDS = ("epochs", "max_steps", "batch_size", "lr", "harden", "harden_scale")
OUTPUTS = ("results.json", "table.md", "finetune.png", "attacks.png", "extractor_*.safetensors",
           "last_good_*.safetensors")
# Flags that only folder (ImageFolder) configurations read.
FOLDER_FLAGS = (("dp_root", "--dp-root"), ("dh_root", "--dh-root"), ("val_split", "--val-split"),
                ("cache_trunk", "--cache-trunk"))


def build_parser() -> cli.Parser:
    ap = cli.Parser(prog="deepnet.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), help="named configuration")
    ap.add_argument("--demo", action="store_true", help="CPU demo: " + ", ".join(DEMO_CONFIGS))
    ap.add_argument("--dp-root", type=cli.existing_path("folder"),
                    help="ImageFolder root of D_P (train/ and --val-split); folder configurations only")
    ap.add_argument("--dh-root", type=cli.existing_path("folder"),
                    help="ImageFolder root of D_H (train/ and --val-split); folder configurations only")
    ap.add_argument("--val-split", default=None, help="validation split folder name (default val)")
    ap.add_argument("--checkpoint", type=cli.existing_path("file"),
                    help="θ₀ weights: safetensors or weights-only torch state_dict")
    ap.add_argument("--pretrained", action="store_true", help="θ₀ from timm's hub (pretrained=True)")
    ap.add_argument("--methods", type=cli.choice_list(DEEP_METHODS, "method"),
                    help=f"comma list from {','.join(DEEP_METHODS)}")
    cli.add_config_flags(ap, DeepImmunizeConfig, fields=FLAG_FIELDS,
                         bounds={"epochs": (1, False), "max_steps": (1, False), "batch_size": (1, False),
                                 "lr": (0.0, True), "harden_scale": (0.0, True)},
                         choices={"harden": HARDENINGS},
                         help={"batch_size": "per-rank batch size",
                               "harden": "also measure every extractor hardened this way "
                                         "(pycore.deep.harden)",
                               "harden_scale": "label_subspace: factor on D_H's class-mean directions, "
                                               "in (0, 1]"},
                         title="immunization (DeepImmunizeConfig; default: the named configuration's)")
    cli.add_seeds(ap, None, default_help="3 with --demo, else 1")
    ap.add_argument("--virtual-ranks", type=cli.integer(1), default=1,
                    help="emulate a W-rank DDP run in one process (same shards, same objective)")
    ap.add_argument("--cache-trunk", action="store_true",
                    help="for folder data: run the frozen trunk once and keep its outputs in memory")
    ap.add_argument("--threads", type=cli.integer(1), default=None,
                    help="torch intra-op threads (recorded in results.json; results are reproducible for a "
                         "given seed AND thread count)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--out", type=Path, default=Path("results/deepnet"),
                    help="output folder; each configuration's set goes to OUT/<config>, replaced as a whole")
    ap.add_argument("--quiet", action="store_true")
    return ap


def check_device(device: str) -> None:
    """``--device cuda`` on a machine where torch sees no GPU is a usage error, not a crash."""
    if device == "cuda" and not torch.cuda.is_available():
        raise cli.UsageError("torch sees no CUDA device here (CPU-only torch, or no GPU visible); "
                             "use --device cpu or auto", "--device")


def plan(args, parser: cli.Parser) -> list:
    """The configurations to run, with the flags applied, checked before any compute."""
    if args.demo and args.config:
        raise cli.UsageError("pass --config NAME or --demo, not both")
    if not args.demo and not args.config:
        raise cli.UsageError("pass --config NAME or --demo")
    if args.checkpoint is not None and args.pretrained:
        raise cli.UsageError("--checkpoint and --pretrained both give θ₀; pass one")
    check_device(args.device)
    names = DEMO_CONFIGS if args.demo else (args.config,)
    val_split = args.val_split or "val"
    runs = []
    for name in names:
        rc = CONFIGS[name]
        if rc.data == "folders":
            missing = [f for f, v in (("--dp-root", args.dp_root), ("--dh-root", args.dh_root)) if v is None]
            if missing:
                raise cli.UsageError(f"config {name} needs --dp-root and --dh-root (ImageFolder roots with "
                                     f"train/ and {val_split}/ splits)", missing[0])
        else:
            unused = [flag for dest, flag in FOLDER_FLAGS if getattr(args, dest) not in (None, False)]
            if unused:
                folders = ", ".join(sorted(k for k, c in CONFIGS.items() if c.data == "folders"))
                raise cli.UsageError(f"{'--demo' if args.demo else f'config {name}'} uses the bundled MNIST "
                                     f"digits, not ImageFolder data; drop {', '.join(unused)} (or pick a "
                                     f"folder configuration: {folders})", unused[0])
        ic = cli.config_from_args(parser, args, rc.immunize, validate=DeepImmunizeConfig.validate)
        runs.append(replace(rc, immunize=ic, methods=tuple(args.methods) if args.methods else rc.methods))
    return runs


def _extractor_writer(folder: Path, num_classes_of, first_seed: int, config: str):
    """The ``on_extractor`` hook: the first seed's extractors, and every last-good model."""
    def write(model, variant, seed, status):
        if status == "immunized" and seed != first_seed:
            return None
        name = f"extractor_{variant}" if status == "immunized" else f"last_good_{variant}"
        path = folder / f"{name}.safetensors"
        return save_immunized(model, path, num_classes_of(model),
                              extra={"config": config, "variant": variant, "seed": seed, "status": status})
    return write


def write_outputs(folder: Path, result: dict, paper: "dict | None") -> list[str]:
    """results.json, table.md and the figures of one configuration into ``folder``."""
    written = ["results.json", "table.md", "finetune.png"]
    (folder / "table.md").write_text(deep_report.table_markdown(result, paper))
    deep_report.plot_probing(result, folder / "finetune.png")
    if any(r["attacks"] for r in result["rows"].values()):
        deep_report.plot_attacks(result, folder / "attacks.png")
        written.append("attacks.png")
    return written


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        runs = plan(args, parser)
        seeds = args.seeds if args.seeds is not None else list(range(3 if args.demo else 1))
        for rc in runs:  # every output folder checked before the first run computes
            cli.OutputSet(Path(args.out) / rc.name, OUTPUTS, create=False)
        if args.threads:
            torch.set_num_threads(args.threads)
        ctx = init_from_env(args.device)
        failed = []
        try:
            for rc in runs:
                # Only rank 0 writes; every rank checked the folder before any compute.
                with cli.OutputSet(Path(args.out) / rc.name, OUTPUTS, create=ctx.is_main) as outs:
                    opts = RunOptions(dp_root=args.dp_root, dh_root=args.dh_root,
                                      val_split=args.val_split or "val", checkpoint=args.checkpoint,
                                      pretrained=args.pretrained, cache_trunk=args.cache_trunk,
                                      virtual_ranks=args.virtual_ranks, quiet=args.quiet)
                    hook = (_extractor_writer(outs.path, lambda m: m.classifier.out_features, seeds[0],
                                              rc.name) if ctx.is_main else None)
                    result = run_config(rc, seeds, opts, ctx, on_extractor=hook)
                    if ctx.is_main:
                        key = PAPER_KEY.get(rc.name)
                        paper = PAPER_TABLE3[key] if key else None
                        # the figures and table first, then results.json (with the final paths)
                        write_outputs(outs.path, result, paper)
                        write_json(outs.path / "results.json", outs.relocate(result))
                        final = outs.commit()
                        if not args.quiet:
                            print(deep_report.table_markdown(result, paper))
                        print(f"[{rc.name}] outputs in {final} ({result['wall_seconds']:.1f}s)", flush=True)
                        failed += [f"{rc.name} {s} {m}: {e['message']}"
                                   for s, errs in result["errors"].items() for m, e in errs.items()]
        finally:
            shutdown()
        if failed:
            raise cli.RunError(f"{len(failed)} method run(s) failed (recorded in results.json): "
                               + "; ".join(failed))
    return cli.run_main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
