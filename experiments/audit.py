"""Audit any immunized timm extractor against its θ₀: RIR_θ₀, (i), (ii), Definition 3.1 and what
the attackers feel (docs/deep.md "Auditing a model").

    python -m experiments.audit --model extractor_ours.safetensors --reference extractor_init.safetensors
    python -m experiments.audit --model defended.safetensors --reference theta0.safetensors \
        --backbone resnet18 --dp-root IMAGENET_SUBSET --dh-root CARS

``--model`` and ``--reference`` are checkpoints of the same architecture: extractors written by
``experiments/deepnet.py`` (``extractor_<row>.safetensors``, θ₀ is ``extractor_init``; their
architecture is read from the file) or plain timm state dicts (safetensors or weights-only torch)
with ``--backbone`` naming the architecture. D_P / D_H are ImageFolder roots (``train/`` and
``--val-split``) or, by default, the demo's MNIST digits (D_P = 0-4, D_H = 5-9, 32 px). Inputs are
normalised with the models' own mean/std (timm's data config); the D_P class count must match the
models' classifiers. Writes ``--out`` (default ``results/audit``): ``results.json``, ``table.md``
(one table, with every number of the model minus the reference's) and ``audit.png`` (the attacker
curves of both).
"""
from __future__ import annotations

if not __package__:  # run as a path: one-line errors before any other import (experiments/_startup.py)
    import _startup  # noqa: F401

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from experiments import cli
from pycore.deep.data import DataError, image_folder, mnist_demo_tasks, model_normalization, timm_transform
from pycore.deep.evaluate import RunConfig, audit
from pycore.deep.models import BACKBONES, CheckpointError, load_extractor
from pycore.report import pm, write_json

from experiments import deep_report

OUTPUTS = ("results.json", "table.md", "audit.png")


def build_parser() -> cli.Parser:
    ap = cli.Parser(prog="audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=cli.existing_path("file"), required=True,
                    help="the extractor to audit (safetensors or weights-only torch checkpoint)")
    ap.add_argument("--reference", type=cli.existing_path("file"), required=True,
                    help="θ₀, the model before immunization (same architecture)")
    ap.add_argument("--backbone", choices=sorted(BACKBONES),
                    help="architecture of checkpoints without pycore metadata")
    ap.add_argument("--dp-root", type=cli.existing_path("folder"),
                    help="ImageFolder root of D_P (with --dh-root)")
    ap.add_argument("--dh-root", type=cli.existing_path("folder"),
                    help="ImageFolder root of D_H (with --dp-root)")
    ap.add_argument("--val-split", default=None, help="validation split folder name (default val)")
    ap.add_argument("--per-digit", type=cli.integer(10, 500), default=250,
                    help="demo digits: images per digit (default 250)")
    ap.add_argument("--rir-groups", type=cli.integer(1, 1000), default=20,
                    help="RIR_θ₀: number of random groups (default 20, the paper's)")
    ap.add_argument("--rir-group-size", type=cli.integer(2, 100000), default=100,
                    help="RIR_θ₀: samples per group and task (default 100, the paper's)")
    ap.add_argument("--epochs", type=cli.integer(5, 200), default=20,
                    help="attacker epochs; accuracy reported after 1, 5 and this many (default 20)")
    cli.add_seeds(ap, "1")
    ap.add_argument("--threads", type=cli.integer(1), default=None, help="torch intra-op threads (recorded)")
    ap.add_argument("--out", type=Path, default=Path("results/audit"),
                    help="output folder, replaced as a whole (default results/audit)")
    ap.add_argument("--quiet", action="store_true")
    return ap


def load_pair(args):
    """Both checkpoints as models, checked to be the same architecture with the same normalisation."""
    model, meta = _load(args.model, args.backbone, "--model")
    ref, _ = _load(args.reference, args.backbone, "--reference")
    if model.spec != ref.spec:
        raise cli.UsageError(f"--model is a {model.spec.key} ({model.spec.timm_name}) but --reference is a "
                             f"{ref.spec.key} ({ref.spec.timm_name}); audit a model against its own θ₀",
                             "--reference")
    n_m, n_r = model.classifier.out_features, ref.classifier.out_features
    if n_m != n_r:
        raise cli.UsageError(f"--model has {n_m} D_P classes but --reference has {n_r}", "--reference")
    norm_m, norm_r = model_normalization(model), model_normalization(ref)
    if not np.allclose(np.array(norm_m), np.array(norm_r), rtol=0, atol=1e-6):
        raise cli.UsageError(f"--model normalises inputs with mean/std {norm_m}, --reference with {norm_r}",
                             "--reference")
    return model, ref, meta


def _load(path, backbone, flag):
    try:
        return load_extractor(path, backbone)
    except CheckpointError as exc:  # the flag's file cannot be used: name the flag
        raise cli.UsageError(str(exc), flag) from None


def load_data(args, model, rng):
    """(data dict, D_P classes, D_H classes) normalised with ``model``'s own mean/std."""
    if (args.dp_root is None) != (args.dh_root is None):
        raise cli.UsageError("pass both --dp-root and --dh-root, or neither (the demo digits)",
                             "--dh-root" if args.dh_root is None else "--dp-root")
    if args.dp_root is None:
        if args.val_split is not None:
            raise cli.UsageError("the demo digits have no split folders; drop --val-split", "--val-split")
        t = mnist_demo_tasks(rng, per_digit=args.per_digit, img_size=model.spec.input_size or 32, model=model)
        return ({"p_train": t.p_train, "p_val": t.p_val, "h_train": t.h_train, "h_test": t.h_test},
                t.num_classes_p, t.num_classes_h)
    split = args.val_split or "val"
    tf = timm_transform(model, training=False)
    sets = {"p_train": image_folder(args.dp_root, "train", tf),
            "p_val": image_folder(args.dp_root, split, tf),
            "h_train": image_folder(args.dh_root, "train", tf),
            "h_test": image_folder(args.dh_root, split, tf)}
    for root, a, b in ((args.dp_root, "p_train", "p_val"), (args.dh_root, "h_train", "h_test")):
        if list(sets[a].classes) != list(sets[b].classes):
            raise DataError(f"{root}: train/ and {split}/ hold different classes "
                            f"({len(sets[a].classes)} vs {len(sets[b].classes)})")
    return sets, len(sets["p_train"].classes), len(sets["h_train"].classes)


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        cli.OutputSet(args.out, OUTPUTS, create=False)  # --out checked before any compute
        if args.threads:
            torch.set_num_threads(args.threads)
        model, ref, meta = load_pair(args)
        data, ncp, nch = load_data(args, model, np.random.default_rng(args.seeds[0]))
        if ncp != model.classifier.out_features:
            where = args.dp_root or "the demo digits (D_P = 0-4)"
            raise cli.UsageError(f"{where} has {ncp} D_P classes but the models' classifiers have "
                                 f"{model.classifier.out_features} outputs; D_P must be the task the models "
                                 "were trained on", "--dp-root" if args.dp_root else "--model")
        base = RunConfig("audit", model.spec.key, "folders" if args.dp_root else "mnist",
                         rir_pool=500, rir_groups=args.rir_groups, rir_group_size=args.rir_group_size,
                         probe_epochs=max(60, args.epochs),
                         attack_epochs=tuple(sorted({1, 5, args.epochs})))
        rc = replace(base, finetune_pool=min(256, len(data["h_train"])),
                     finetune_test=min(500, len(data["h_test"])))
        say = (lambda *a, **k: None) if args.quiet else print
        with cli.OutputSet(args.out, OUTPUTS) as outs:
            result = audit(model, ref, data, rc, args.seeds, num_classes_h=nch, say=say)
            result["inputs"] = {"model": str(Path(args.model).resolve()),
                                "reference": str(Path(args.reference).resolve()),
                                "model_metadata": meta, "dp_root": args.dp_root, "dh_root": args.dh_root,
                                "normalization": model_normalization(model)}
            table = audit_markdown(result)
            (outs.path / "table.md").write_text(table)
            deep_report.plot_attacks(result, outs.path / "audit.png")
            write_json(outs.path / "results.json", result)
            final = outs.commit()
        print(table)
        print(f"wrote {final}/results.json, table.md, audit.png")
    return cli.run_main(parser, body, argv)


def audit_markdown(result: dict) -> str:
    """One table: the reference θ₀ and the model, every number, and the model minus θ₀."""
    r0, r1 = result["rows"]["init"], result["rows"]["model"]
    epochs = result["run_config"]["attack_epochs"]
    cols = [("(i) ↑", lambda r: r["harmful_ratio"]), ("(ii) ↓", lambda r: r["pretrain_ratio"]),
            ("RIR_θ₀ ↑", lambda r: r["rir_theta0"]), ("D_P top-1 %", lambda r: r["dp_top1"]),
            ("GD probe @10 ↓", lambda r: r["probe_acc_epoch10"])]
    for a, short in (("gd", "GD"), ("adam", "Adam"), ("adam_whitened", "whitened Adam"),
                     ("finetune", "fine-tune")):
        if a in r1["attacks"]:
            cols += [(f"{short} @{e} ↓", _attack(a, e)) for e in epochs]
    n = len(result["seeds"])
    head = "| | Def. 3.1 | " + " | ".join(c for c, _ in cols) + " |"
    lines = [f"# Audit: {result['inputs']['model']}", "",
             f"Against the reference θ₀ {result['inputs']['reference']}; backbone {result['backbone']}, "
             f"seeds {result['seeds']}, {result['threads']} threads. Mean ± std over "
             "seeds; attacker columns are D_H test accuracy (%) after the epoch shown (↓ = harder for the "
             "attacker).", "", head, "|---|---|" + "---|" * len(cols)]
    for name, r in (("reference θ₀", r0), ("model", r1)):
        lines.append(f"| {name} | {r['immunized_count']}/{n} | "
                     + " | ".join(pm(get(r)) for _, get in cols) + " |")
    lines.append("| model − θ₀ | | " + " | ".join(
        f"{get(r1)['mean'] - get(r0)['mean']:+.4g}" for _, get in cols) + " |")
    return "\n".join(lines) + "\n"


def _attack(name: str, epoch: int):
    return lambda r: r["attacks"][name][f"epoch{epoch}"]


if __name__ == "__main__":
    sys.exit(main())
