#!/usr/bin/env python
"""Deep-net immunization of any timm model (docs/deep.md; docs/theory.md §8-9; paper §5.2, Table 3).

    python experiments/deepnet.py --demo                                  # CPU, no download
    python experiments/deepnet.py --dp-root MY_DP --dh-root MY_DH [--model resnet10t] [--img-size 64]
    python experiments/deepnet.py --config resnet18-cars --dp-root IMAGENET --dh-root CARS --pretrained
    torchrun --nproc_per_node=8 experiments/deepnet.py --config vit-country211 ...

``--demo``: MNIST digits 0-4 (D_P) and 5-9 (D_H) at 32 px, a ResNet18 and a small ViT trained here
on D_P as θ₀, every method, every row also hardened, 3 seeds. With ImageFolder roots
(``root/train/<class>/<image>`` and ``root/val/...``) any timm ``--model`` at any image size runs
with the default rule; θ₀ is ``--checkpoint``, ``--pretrained``, or trained on D_P here (then at the
images' own size unless ``--img-size`` says otherwise). Outputs in
``--out/<config>/``: results.json, table.md, finetune.png (Figure 3), attacks.png and the first
seed's extractor_<row>.safetensors (``pycore.deep.load_model``; audit them with experiments/audit.py).
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from experiments import common, deep_report
from experiments.deep_configs import CONFIGS, DEMO_CONFIGS, PAPER_KEY, PAPER_TABLE3, with_model
from experiments.deep_pipeline import RunOptions, run_config
from pycore.deep import DEEP_METHODS, HARDENINGS, DeepOptions, options, save_model
from pycore.deep.distributed import init_from_env, shutdown
from pycore.deep.train import OPTION_BOUNDS
from pycore.report import dumps_json

MAX_THREADS = 1024
FIGURES = ("finetune.png", "attacks.png")


def build_parser() -> common.Parser:
    p = common.Parser("deepnet.py", __doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), help="named configuration (default: folders when "
                   "--dp-root is given)")
    p.add_argument("--demo", action="store_true", help="CPU demo: " + ", ".join(DEMO_CONFIGS))
    p.add_argument("--model", help="any timm model name (timm.list_models()); replaces the configuration's")
    p.add_argument("--img-size", type=common.count(8, 4096), help="input side in pixels (default: the model's)")
    p.add_argument("--dp-root", type=common.existing("folder"), help="ImageFolder root of D_P (train/, --val-split)")
    p.add_argument("--dh-root", type=common.existing("folder"), help="ImageFolder root of D_H (train/, --val-split)")
    p.add_argument("--val-split", default="val", help="validation split folder name")
    p.add_argument("--checkpoint", type=common.existing("file"), help="θ₀ weights (safetensors or torch state_dict)")
    p.add_argument("--pretrained", action="store_true", help="θ₀ from timm's hub (pretrained=True)")
    p.add_argument("--theta0-epochs", type=common.count(0, 1000),
                   help="train θ₀ on D_P for this many epochs (default: the configuration's)")
    p.add_argument("--methods", type=common.comma_list(choices=DEEP_METHODS), help="methods to run")
    add_option_flags(p)
    p.add_argument("--seeds", type=common.seeds, metavar="N|A,B,C|A-B", help="seeds (default 3 with --demo, else 1)")
    p.add_argument("--threads", type=common.count(1, MAX_THREADS), help="torch intra-op threads (recorded; "
                   "results are reproducible for a seed AND a thread count)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    common.add_out(p, "results/deepnet")
    p.add_argument("--quiet", action="store_true")
    return p


def add_option_flags(p) -> None:
    """One flag per field of DeepOptions, bounded (the library checks every value again)."""
    rules = {k: {"low": lo, "high": hi} for k, (lo, hi) in OPTION_BOUNDS.items()}
    rules.update({k: {"low": 0.0, "low_open": True} for k in ("lr", "lambda_p", "lambda_h", "lambda_kappa",
                                                              "lambda_imma", "balance", "balance_ill",
                                                              "imma_inner_lr", "ridge_rel")})
    rules.update({k: {"low": 0.0, "high": 1.0, "high_open": True} for k in ("momentum", "label_smoothing",
                                                                            "weight_decay_extractor",
                                                                            "weight_decay_classifier")})
    rules["harden_scale"] = {"low": 0.0, "high": 1.0, "low_open": True}
    common.add_options(p, [DeepOptions], title="immunization options (default: the configuration's)", rules=rules,
                       choices={"scope": ("layer", "tail"), "harden": HARDENINGS},
                       help={"batch_size": "per-rank batch size", "harden": "also measure every extractor "
                             "hardened this way", "scope": "layer: the immunization layer alone; tail: also "
                             "the backbone's last --stages stages", "virtual_ranks": "emulate a W-rank DDP run in "
                             "one process (same shards, same objective)"})


def plan(args) -> list:
    """The configurations to run with the flags applied, every combination checked before compute."""
    if args.demo and args.config:
        raise common.UsageError("pass --config NAME or --demo, not both", "--demo")
    name = args.config or ("folders" if args.dp_root or args.dh_root else None)
    if not args.demo and name is None:
        raise common.UsageError("pass --demo, --config NAME, or --dp-root and --dh-root (ImageFolder roots)")
    if args.checkpoint and args.pretrained:
        raise common.UsageError("--checkpoint and --pretrained both give θ₀; pass one", "--pretrained")
    if args.model is not None:
        import timm  # noqa: PLC0415

        if not timm.is_model(args.model):
            raise common.UsageError(f"{args.model!r} is not a timm model name (timm.list_models() lists them)",
                                    "--model")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise common.UsageError("torch sees no CUDA device here; use --device cpu or auto", "--device")
    runs = []
    for key in DEMO_CONFIGS if args.demo else (name,):
        rc = with_model(CONFIGS[key], args.model, args.img_size)
        if rc.data == "folders":
            missing = [f for f, v in (("--dp-root", args.dp_root), ("--dh-root", args.dh_root)) if v is None]
            if missing:
                raise common.UsageError(f"config {key} reads ImageFolder roots: pass --dp-root and --dh-root",
                                        missing[0])
        else:
            used = [f for f, v in (("--dp-root", args.dp_root), ("--dh-root", args.dh_root),
                                   ("--checkpoint", args.checkpoint), ("--pretrained", args.pretrained)) if v]
            if used or args.val_split != "val":
                raise common.UsageError(f"{'--demo' if args.demo else key} uses the bundled MNIST digits and "
                                        "trains θ₀ on them; drop it", (used or ["--val-split"])[0])
        epochs = rc.theta0_epochs if args.theta0_epochs is None else args.theta0_epochs
        if rc.data == "folders" and args.img_size is None and not (args.checkpoint or args.pretrained):
            rc = with_model(rc, None, _image_side(args.dp_root, rc))   # θ₀ trained here: the images' own size
        if not (epochs or args.checkpoint or args.pretrained):
            raise common.UsageError(f"config {key} has no θ₀ (a random network scores chance): pass --checkpoint "
                                    "FILE, --pretrained, or --theta0-epochs N to train it on D_P", "--checkpoint")
        methods = tuple(args.methods) if args.methods else rc.methods
        runs.append(replace(rc, theta0_epochs=epochs, methods=methods,
                            options=options(rc.options, **common.given_options(args, [DeepOptions]))))
    return runs


def _image_side(root: Path, rc) -> int:
    """The shorter side of D_P's first training image, at most the model's own input side."""
    from PIL import Image  # noqa: PLC0415

    from pycore.deep import create_model  # noqa: PLC0415
    from pycore.deep.data import IMG_EXTENSIONS, model_normalization  # noqa: PLC0415

    own = model_normalization(create_model(rc.model, 1, seed=0, **rc.model_kwargs))["input_size"][-1]
    for folder, dirs, names in sorted(os.walk(root / "train")):
        dirs.sort()
        for name in sorted(n for n in names if n.lower().endswith(IMG_EXTENSIONS)):
            try:
                with Image.open(os.path.join(folder, name)) as img:
                    return max(8, min(own, *img.size))
            except OSError:
                continue
    return own


def _extractor_writer(folder: Path, first_seed: int, config: str):
    """on_extractor: the first seed's extractors and every last good model, each written whole."""
    def write(model, row, seed, status):
        if status == "immunized" and seed != first_seed:
            return None
        name = f"{'extractor' if status == 'immunized' else 'last_good'}_{row}.safetensors"
        extra = {"config": config, "row": row, "seed": seed, "status": status}
        return str(common.write_outputs(folder, {name: lambda p: save_model(model, p, extra)})[0])
    return write


def _chance_warning(result: dict) -> None:
    classes, acc = result["per_seed"][0]["classes"][0], result["rows"]["init"]["dp_top1"]["mean"]
    if acc < 1.5 * 100.0 / classes:
        print(f"deepnet.py: warning: θ₀ scores {acc:.1f}% on D_P's validation split, chance is {100 / classes:.1f}% "
              f"({classes} classes): train it longer (--theta0-epochs), or pass --checkpoint or --pretrained",
              file=sys.stderr, flush=True)


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        runs = plan(args)
        seeds = args.seeds if args.seeds is not None else list(range(3 if args.demo else 1))
        for rc in runs:
            common.check_out(Path(args.out) / rc.name, ("results.json", "table.md", *FIGURES))
        if args.threads:
            torch.set_num_threads(args.threads)
        ctx = init_from_env(args.device)
        failed = []
        try:
            for rc in runs:
                folder = Path(args.out) / rc.name
                opts = RunOptions(args.dp_root and str(args.dp_root), args.dh_root and str(args.dh_root),
                                  args.val_split, args.checkpoint and str(args.checkpoint), args.pretrained,
                                  args.quiet)
                hook = _extractor_writer(folder, seeds[0], rc.name) if ctx.is_main else None
                result = run_config(rc, seeds, opts, ctx, on_extractor=hook)
                if not ctx.is_main:
                    continue
                paper = PAPER_TABLE3.get(PAPER_KEY.get(rc.name))
                table = deep_report.table_markdown(result, paper)
                common.write_outputs(folder, {"table.md": table,
                                              "finetune.png": lambda p: deep_report.plot_probing(result, p),
                                              "attacks.png": lambda p: deep_report.plot_attacks(result, p),
                                              "results.json": dumps_json(result, indent=1)})
                if not args.quiet:
                    print(table)
                print(f"[{rc.name}] outputs in {folder} ({result['wall_seconds']:.1f}s)", flush=True)
                _chance_warning(result)
                failed += [f"{rc.name} {s} {m}: {e['message']}" for s, errs in result["errors"].items()
                           for m, e in errs.items()]
        finally:
            shutdown()
        if failed:
            raise common.RunError(f"{len(failed)} method run(s) failed (recorded in results.json): " + "; ".join(failed))
    return common.main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
