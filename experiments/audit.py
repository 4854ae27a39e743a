#!/usr/bin/env python
"""Audit any immunized timm model against its θ₀: RIR_θ₀, (i), (ii), Definition 3.1 and what the
attackers feel (docs/deep.md "Auditing a model").

    python experiments/audit.py --model extractor_ours.safetensors --reference extractor_init.safetensors
    python experiments/audit.py --model defended.safetensors --reference theta0.safetensors \
        --backbone resnet10t --dp-root IMAGENET_SUBSET --dh-root CARS

``--model`` and ``--reference`` are checkpoints of one architecture: files written by
experiments/deepnet.py (their architecture is in the file) or plain timm state dicts with
``--backbone`` naming any timm model (and ``--img-size`` its input side). D_P / D_H are ImageFolder
roots (``train/`` and ``--val-split``) or, by default, the demo's MNIST digits (0-4 and 5-9). Writes
``--out``: results.json, table.md (every number of both and the model minus θ₀) and audit.png.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from experiments import common, deep_report
from experiments.deep_pipeline import RunConfig, audit
from pycore.deep import CheckpointError, load_model
from pycore.deep.data import DataError, image_folder, mnist_demo_tasks, model_normalization
from pycore.report import dumps_json, pm


def build_parser() -> common.Parser:
    p = common.Parser("audit.py", __doc__.split("\n\n")[0])
    p.add_argument("--model", type=common.existing("file"), required=True, help="the model to audit (a checkpoint)")
    p.add_argument("--reference", type=common.existing("file"), required=True,
                   help="θ₀, the model before immunization (same architecture)")
    p.add_argument("--backbone", help="timm model name of checkpoints without pycore metadata")
    p.add_argument("--img-size", type=common.count(8, 4096), help="input side of --backbone (default: the model's)")
    p.add_argument("--dp-root", type=common.existing("folder"), help="ImageFolder root of D_P (with --dh-root)")
    p.add_argument("--dh-root", type=common.existing("folder"), help="ImageFolder root of D_H (with --dp-root)")
    p.add_argument("--val-split", default="val", help="validation split folder name")
    p.add_argument("--per-digit", type=common.count(10, 500), default=250, help="demo digits: images per digit")
    p.add_argument("--rir-groups", type=common.count(1, 1000), default=20, help="RIR_θ₀: random groups")
    p.add_argument("--rir-group-size", type=common.count(2, 100_000), default=100, help="RIR_θ₀: samples per group")
    p.add_argument("--epochs", type=common.count(5, 200), default=20,
                   help="attacker epochs; accuracy after 1, 5 and this many")
    common.add_seeds(p, "1")
    p.add_argument("--threads", type=common.count(1, 1024), help="torch intra-op threads (recorded)")
    common.add_out(p, "results/audit")
    p.add_argument("--quiet", action="store_true")
    return p


def load_pair(args):
    """Both checkpoints, checked to be one architecture with one class count."""
    kwargs = {"img_size": args.img_size} if args.img_size else {}
    models = []
    for flag in ("--model", "--reference"):
        try:
            models.append(load_model(getattr(args, flag[2:]), args.backbone, **kwargs))
        except CheckpointError as exc:  # the flag's file cannot be used: name the flag
            raise common.UsageError(str(exc), flag) from None
    (model, meta), (ref, _) = models
    if model.net.model_args != ref.net.model_args:
        raise common.UsageError(f"--model is a {model.net.model_args} but --reference a {ref.net.model_args}; "
                                "audit a model against its own θ₀", "--reference")
    if model.classifier.out_features != ref.classifier.out_features:
        raise common.UsageError(f"--model has {model.classifier.out_features} D_P classes, --reference "
                                f"{ref.classifier.out_features}", "--reference")
    return model, ref, meta


def load_data(args, model, rng):
    """(images by split, D_P classes, D_H classes) decoded for ``model``."""
    if (args.dp_root is None) != (args.dh_root is None):
        raise common.UsageError("pass both --dp-root and --dh-root, or neither (the demo digits)",
                                "--dh-root" if args.dh_root is None else "--dp-root")
    if args.dp_root is None:
        t = mnist_demo_tasks(rng, model, per_digit=args.per_digit)
        return {"p_train": t.p_train, "p_val": t.p_val, "h_train": t.h_train, "h_test": t.h_test}, 5, 5
    sets = {k: image_folder(root, split, model) for k, root, split in (
        ("p_train", args.dp_root, "train"), ("p_val", args.dp_root, args.val_split),
        ("h_train", args.dh_root, "train"), ("h_test", args.dh_root, args.val_split))}
    for root, a, b in ((args.dp_root, "p_train", "p_val"), (args.dh_root, "h_train", "h_test")):
        if sets[a].classes != sets[b].classes:
            raise DataError(f"{root}: train/ and {args.val_split}/ hold different class folders")
    return sets, len(sets["p_train"].classes), len(sets["h_train"].classes)


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        out = common.check_out(args.out, ("results.json", "table.md", "audit.png"))
        if args.threads:
            torch.set_num_threads(args.threads)
        model, ref, meta = load_pair(args)
        data, ncp, nch = load_data(args, model, np.random.default_rng(args.seeds[0]))
        if ncp != model.classifier.out_features:
            raise common.UsageError(f"{args.dp_root or 'the demo digits (D_P = 0-4)'} has {ncp} D_P classes but "
                                    f"the models classify {model.classifier.out_features}; D_P must be the task "
                                    "they were trained on", "--dp-root" if args.dp_root else "--model")
        rc = RunConfig("audit", model.net.model_args["name"], "folders", rir_pool=500, rir_groups=args.rir_groups,
                       rir_group_size=args.rir_group_size, probe_epochs=max(60, args.epochs),
                       attack_epochs=tuple(sorted({1, 5, args.epochs})),
                       finetune_pool=min(256, len(data["h_train"])), finetune_test=min(500, len(data["h_test"])))
        result = audit(model, ref, data, rc, args.seeds, classes_h=nch, say=None if args.quiet else print)
        result["inputs"] = {"model": str(Path(args.model).resolve()), "reference": str(Path(args.reference).resolve()),
                            "model_metadata": meta, "dp_root": args.dp_root and str(args.dp_root),
                            "dh_root": args.dh_root and str(args.dh_root),
                            "normalization": {k: model_normalization(model)[k] for k in ("mean", "std")}}
        result["data"] = (f"D_P {args.dp_root} vs D_H {args.dh_root}" if args.dp_root
                          else "MNIST digits 0-4 (D_P) vs 5-9 (D_H)")
        result["model_text"] = f"{Path(args.model).name} vs θ₀ {Path(args.reference).name}"
        table = audit_markdown(result)
        common.write_outputs(out, {"table.md": table, "audit.png": lambda p: deep_report.plot_attacks(result, p),
                                   "results.json": dumps_json(result, indent=1)})
        print(table)
        print(f"wrote {out}/results.json, table.md, audit.png")
    return common.main(parser, body, argv)


def audit_markdown(result: dict) -> str:
    """One table: the reference θ₀, the model, and the model minus θ₀, every number."""
    r0, r1, epochs = result["rows"]["init"], result["rows"]["model"], result["run_config"]["attack_epochs"]
    cols = [("(i) ↑", lambda r: r["harmful_ratio"]), ("(ii) ↓", lambda r: r["pretrain_ratio"]),
            ("RIR_θ₀ ↑", lambda r: r["rir_theta0"]), ("D_P top-1 %", lambda r: r["dp_top1"])]
    for a in deep_report.ATTACKER_LABELS:
        if a in r1["attacks"]:
            cols += [(f"{deep_report.SHORT[a]} @{e} ↓", lambda r, a=a, e=e: r["attacks"][a][f"epoch{e}"])
                     for e in epochs]
    n = len(result["seeds"])
    lines = [f"# Audit of {result['inputs']['model']}", "",
             f"Against θ₀ {result['inputs']['reference']} ({result['model']}, seeds {result['seeds']}, "
             f"{result['threads']} threads); mean ± std over seeds; attacker columns: D_H test accuracy (%) after "
             "the epoch shown (↓ = harder for the attacker).", "",
             "| | Def. 3.1 | " + " | ".join(c for c, _ in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for name, r in (("reference θ₀", r0), ("model", r1)):
        lines.append(f"| {name} | {r['immunized_count']}/{n} | " + " | ".join(pm(get(r)) for _, get in cols) + " |")
    lines.append("| model − θ₀ | | " + " | ".join(f"{get(r1)['mean'] - get(r0)['mean']:+.4g}" for _, get in cols) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
