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

import functools
import sys
import time
from dataclasses import replace
from pathlib import Path

if not __package__:  # run as a file: the checkout's root first on sys.path, not experiments/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# torch, timm and what imports them load in main's body: --help needs none
from experiments import common
from experiments.deep_catalog import DEEP_MAX_STEPS, LORA_RANKS, OPERATORS

RIR_GROUP_SIZE = 100  # the paper's


def audit_seed(*args, **kwargs):
    """:func:`experiments.deep_pipeline.audit_seed` (imported when the audit runs)."""
    from experiments.deep_pipeline import audit_seed as audit

    return audit(*args, **kwargs)


def _operator_name(name: str) -> str:
    """One operator name (operator_names' rule), or a ValueError saying why not."""
    from pycore import ParameterError  # noqa: PLC0415  (torch: only when the flag is given)
    from pycore.deep._operators import operator_names  # noqa: PLC0415

    try:
        operator_names((name,))
    except ParameterError as exc:
        raise ValueError(str(exc)) from None
    return name


def build_parser() -> common.Parser:
    p = common.Parser(
        "audit.py",
        __doc__.split("\n\n")[0],
        "Without --dp-root/--dh-root the images are the demo's: the bundled MNIST digits, 0-4 "
        "as D_P and 5-9 as D_H, at the demo's sizes (the models must then classify 5 digits).",
    )
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
        "--rir-groups", type=common.count(1, 1000), default=20, help="RIR_θ₀: random groups"
    )
    p.add_argument(
        "--rir-group-size",
        type=common.count(2, 100_000),
        help="RIR_θ₀: group size, at most the defense's rows of each task (default "
        f"{RIR_GROUP_SIZE}, or all the rows where there are fewer)",
    )
    p.add_argument(
        "--max-steps",
        type=common.count(1, 1_000_000),
        default=DEEP_MAX_STEPS,
        help="the longest a deep operator runs on θ₀ to find its plateau (optimizer steps)",
    )
    p.add_argument(
        "--operators",
        type=common.comma_list(_operator_name),
        default=list(OPERATORS),
        help="operators to attack with: " + ", ".join(OPERATORS) + " or retrain_last<k> "
        "(default: all)",
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
    p.add_argument("--quiet", action="store_true", help="no progress lines and no table on stdout")
    return p


def main(argv=None) -> int:
    def body(args):
        import torch

        from experiments import deep_report
        from experiments.deep_configs import CONFIGS
        from experiments.deep_pipeline import Row, RunOptions, load_splits, result_of
        from pycore.deep import CheckpointError, load_model
        from pycore.deep._operators import operator_names
        from pycore.report import dumps_json

        out = common.check_out(args.out, ("results.json", "table.md", "audit.png"))
        operator_names(args.operators, args.lora_ranks)  # a bad name or rank: before compute
        if (args.dp_root is None) != (args.dh_root is None):
            raise common.UsageError(
                "pass both --dp-root and --dh-root, or neither (the demo digits)",
                "--dh-root" if args.dh_root is None else "--dp-root",
            )
        common.distinct_roots(args.dp_root, args.dh_root)
        if args.img_size and not args.backbone:
            raise common.UsageError(
                "sets the input side of --backbone's plain timm checkpoints; a checkpoint "
                "written by deepnet.py carries its own",
                "--img-size",
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
        base = CONFIGS["folders" if args.dp_root else "demo-full-resnet18"]
        rc = replace(
            base,
            name="audit",
            model=arch["name"],
            model_kwargs={k: v for k, v in arch.items() if k != "name"},
            rows=(),
            rir_groups=args.rir_groups,
            rir_group_size=args.rir_group_size or RIR_GROUP_SIZE,
            operators=tuple(args.operators),
            lora_ranks=tuple(args.lora_ranks),
            schedule=replace(base.schedule, deep_max_steps=args.max_steps),
            more_data_seeds=(),
        )
        roots = (r and str(r) for r in (args.dp_root, args.dh_root))
        opts = RunOptions(*roots, args.val_split, quiet=args.quiet)
        say = (lambda *a, **k: None) if args.quiet else functools.partial(print, flush=True)
        t0 = time.perf_counter()
        per_seed = []
        for seed in args.seeds:
            splits = load_splits(rc, opts, seed)
            if splits.classes[0] != classes:  # before any compute
                raise common.UsageError(
                    f"{args.dp_root or 'the demo digits 0-4'} hold {splits.classes[0]} D_P "
                    f"classes, the models classify {classes}: D_P must be their task",
                    "--dp-root" if args.dp_root else "--model",
                )
            rows = min(len(splits.p_train), len(splits.h_train))
            if (args.rir_group_size or 0) > rows:
                raise common.UsageError(
                    f"groups of {args.rir_group_size} rows, but the defense's rows number "
                    f"{rows} (D_P {len(splits.p_train)}, D_H {len(splits.h_train)}): at most "
                    f"{rows}",
                    "--rir-group-size",
                )
            per_seed.append(audit_seed(model, ref, rc, seed, opts, say, splits))
        result = result_of(
            rc,
            opts,
            args.seeds,
            per_seed,
            t0,
            row_specs=(Row("model", "audit", label="the model"),),
        )
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
        if not args.quiet:
            print(table)
        print(f"wrote {out}/results.json, table.md, audit.png")

    return common.main(build_parser(), body, argv)


if __name__ == "__main__":
    sys.exit(main())
