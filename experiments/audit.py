#!/usr/bin/env python
"""Audit any immunized timm model against its θ₀: RIR_θ₀, (i), (ii), Definition 3.1 and what the
attackers feel (docs/findings.md §7).

    python experiments/audit.py --model extractor_ours.safetensors \
        --reference extractor_init.safetensors
    python experiments/audit.py --model defended.safetensors --reference theta0.safetensors \
        --backbone resnet10t --dp-root IMAGENET_SUBSET --dh-root CARS

``--model``, ``--reference``: checkpoints of one architecture (deepnet.py's, or plain timm state
dicts of ``--backbone``); D_P / D_H: ImageFolder roots or the demo's digits. Writes ``--out``:
results.json,
table.md (both models, and every row minus θ₀), audit.png."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from experiments import common, deep_report
from experiments.deep_pipeline import RunConfig, RunOptions, audit, load_data
from pycore.deep import CheckpointError, load_model
from pycore.deep.operators import LORA_RANKS, OPERATORS, operator_names
from pycore.report import dumps_json


def build_parser() -> common.Parser:
    p = common.Parser("audit.py", __doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=common.existing("file"), required=True, help="the model to audit"
    )
    p.add_argument(
        "--reference",
        type=common.existing("file"),
        required=True,
        help="θ₀, the same architecture",
    )
    p.add_argument("--backbone", help="timm model name of checkpoints without pycore metadata")
    p.add_argument("--img-size", type=common.count(8, 4096), help="input side of --backbone")
    p.add_argument(
        "--dp-root",
        type=common.existing("folder"),
        help="D_P's images: ROOT/train/<class>/<image> and ROOT/<val-split>/<class>/<image>",
    )
    p.add_argument("--dh-root", type=common.existing("folder"), help="ImageFolder root of D_H")
    p.add_argument("--val-split", default="val", help="validation split folder name")
    p.add_argument(
        "--per-digit", type=common.count(10, 500), default=250, help="demo: images per digit"
    )
    p.add_argument(
        "--rir-groups", type=common.count(1, 1000), default=20, help="RIR_θ₀: random groups"
    )
    p.add_argument(
        "--rir-group-size", type=common.count(2, 100_000), default=100, help="RIR_θ₀: group size"
    )
    p.add_argument(
        "--epochs",
        type=common.count(1, 200),
        default=5,
        help="epochs of every operator (scored after 1 and N) and of the GD probe curve",
    )
    p.add_argument(
        "--operators",
        type=common.comma_list(choices=OPERATORS),
        default=list(OPERATORS),
        help="operators to attack with (pycore.deep.operators; default: all)",
    )
    p.add_argument(
        "--lora-ranks",
        type=common.comma_list(common.count(1, 100_000)),
        default=list(LORA_RANKS),
        help="ranks of the LoRA operator, one operator each",
    )
    common.add_seeds(p, "1")
    p.add_argument(
        "--threads", type=common.count(1, 1024), help="torch intra-op threads (recorded)"
    )
    common.add_out(p, "results/audit")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv=None) -> int:
    def body(args):
        out = common.check_out(args.out, ("results.json", "table.md", "audit.png"))
        operator_names(args.operators, args.lora_ranks)  # a bad name or rank: before compute
        if (args.dp_root is None) != (args.dh_root is None):
            raise common.UsageError(
                "pass both --dp-root and --dh-root, or neither (the demo digits)",
                "--dh-root" if args.dh_root is None else "--dp-root",
            )
        if args.threads:
            torch.set_num_threads(common.thread_count(args.threads, "audit.py"))
        models = []
        for flag in ("--model", "--reference"):
            try:
                models.append(
                    load_model(
                        getattr(args, flag[2:]),
                        args.backbone,
                        **({"img_size": args.img_size} if args.img_size else {}),
                    )
                )
            except CheckpointError as exc:  # the flag's file cannot be used: name the flag
                raise common.UsageError(str(exc), flag) from None
        (model, meta), (ref, _) = models
        arch, classes = model.net.model_args, model.classifier.out_features
        if (arch, classes) != (ref.net.model_args, ref.classifier.out_features):
            raise common.UsageError(
                f"--model is a {arch} with {classes} classes, --reference a "
                f"{ref.net.model_args} with {ref.classifier.out_features}: audit a model "
                "against its own θ₀",
                "--reference",
            )
        rc = RunConfig(
            "audit",
            arch["name"],
            "folders" if args.dp_root else "mnist",
            model_kwargs={k: v for k, v in arch.items() if k != "name"},
            per_digit=args.per_digit,
            rir_pool=500,
            rir_groups=args.rir_groups,
            rir_group_size=args.rir_group_size,
            probe_epochs=args.epochs,
            attack_epochs=tuple(sorted({1, args.epochs})),
            operators=tuple(args.operators),
            lora_ranks=tuple(args.lora_ranks),
        )
        roots = (r and str(r) for r in (args.dp_root, args.dh_root))
        opts = RunOptions(*roots, args.val_split, quiet=args.quiet)
        data, ncp, nch = load_data(rc, opts, np.random.default_rng(args.seeds[0]))
        if ncp != classes:
            raise common.UsageError(
                f"{args.dp_root or 'the demo digits 0-4'} hold {ncp} D_P classes, the "
                f"models classify {classes}: D_P must be their task",
                "--dp-root" if args.dp_root else "--model",
            )
        result = audit(model, ref, data, rc, args.seeds, opts, classes_h=nch)
        result["inputs"] = {
            "model": str(Path(args.model).resolve()),
            "model_metadata": meta,
            "reference": str(Path(args.reference).resolve()),
        }
        result["model_text"] = f"{Path(args.model).name} against θ₀ {Path(args.reference).name}"
        table = deep_report.table_markdown(result)
        common.write_outputs(
            out,
            {
                "table.md": table,
                "results.json": dumps_json(result, indent=1),
                "audit.png": lambda p: deep_report.plot_operators(result, p),
            },
        )
        print(table, f"wrote {out}/results.json, table.md, audit.png", sep="\n")

    return common.main(build_parser(), body, argv)


if __name__ == "__main__":
    sys.exit(main())
