#!/usr/bin/env python
"""Deep-net immunization of any timm model (docs/findings.md §7; docs/theory.md §8-9; paper §5.2,
Table 3).

    python experiments/deepnet.py --demo                        # CPU, no download
    python experiments/deepnet.py --dp-root MY_DP --dh-root MY_DH \
        [--model resnet10t] [--img-size 64]
    python experiments/deepnet.py --config resnet18-cars \
        --dp-root IMAGENET --dh-root CARS --pretrained
    torchrun --nproc_per_node=8 experiments/deepnet.py --config vit-country211 ...

``--demo``: MNIST 0-4 (D_P) vs 5-9 (D_H) at 32 px, a ResNet18 and a small ViT trained here as θ₀,
every method, every row also hardened, 3 seeds. θ₀ is ``--checkpoint``, ``--pretrained``, or
trained on D_P here (at the images' own size unless ``--img-size``). Writes ``--out/<config>/``:
results.json, table.md,
finetune.png (Fig. 3), attacks.png, the first seed's extractor_<row>.safetensors (for audit.py)."""

from __future__ import annotations

import functools
import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

import torch

from experiments import common, deep_report
from experiments.deep_configs import CONFIGS, DEMO_CONFIGS, PAPER_TABLE3, with_model
from experiments.deep_pipeline import RunOptions, _variants, run_configs
from pycore.deep import DEEP_METHODS, DeepOptions, create_model, options, save_model
from pycore.deep.data import model_normalization
from pycore.deep.distributed import init_from_env, shutdown
from pycore.deep.train import OPTION_CHOICES, OPTION_RULES
from pycore.report import dumps_json

FILES = ("results.json", "table.md", "finetune.png", "operators.png", "tradeoff.png")


def build_parser() -> common.Parser:
    p = common.Parser("deepnet.py", __doc__.split("\n\n")[0])
    p.add_argument(
        "--config", choices=sorted(CONFIGS), help="named configuration (folders with --dp-root)"
    )
    p.add_argument("--demo", action="store_true", help="CPU demo: " + ", ".join(DEMO_CONFIGS))
    p.add_argument(
        "--model", help="any timm model name (timm.list_models()); replaces the configuration's"
    )
    p.add_argument("--img-size", type=common.count(8, 4096), help="input side in pixels")
    p.add_argument("--dp-root", type=common.existing("folder"), help="ImageFolder root of D_P")
    p.add_argument("--dh-root", type=common.existing("folder"), help="ImageFolder root of D_H")
    p.add_argument("--val-split", default="val", help="validation split folder of both roots")
    p.add_argument(
        "--checkpoint", type=common.existing("file"), help="θ₀ (safetensors or torch state_dict)"
    )
    p.add_argument(
        "--pretrained", action="store_true", help="θ₀ from timm's hub (pretrained=True)"
    )
    p.add_argument(
        "--theta0-epochs", type=common.count(0, 1000), help="train θ₀ on D_P this many epochs"
    )
    p.add_argument(
        "--methods", type=common.comma_list(choices=DEEP_METHODS), help="methods to run"
    )
    real = common.comma_list(common.real(0.0, lo_open=True), max_items=50)
    p.add_argument(
        "--balances",
        type=real,
        help="the (i)/(ii) trade-off: each method at each balance b "
        "(λ = b·‖∇CE‖/‖∇term‖), written to OUT/<config>-sweep with tradeoff.png",
    )
    p.add_argument(
        "--ill-balances", type=real, help="R_ill's balances b_ill, crossed with --balances"
    )
    common.add_options(
        p,
        [DeepOptions],
        title="immunization options (default: the configuration's)",
        rules=OPTION_RULES,
        choices=OPTION_CHOICES,
        help={
            "harden": "also measure every row hardened this way",
            "scope": "layer: the "
            "immunization layer alone; tail: also the backbone's last --stages stages",
        },
    )
    p.add_argument(
        "--seeds",
        type=common.seeds,
        metavar="N|A,B,C|A-B",
        help="seeds (default 3 with --demo, else 1)",
    )
    p.add_argument(
        "--threads",
        type=common.count(1, 1024),
        help="torch threads (recorded; a result is reproducible for a seed AND a thread count)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--jobs",
        type=common.count(1, common.MAX_JOBS),
        default=common.usable_cores(),
        help="worker processes over the (configuration, seed) runs, capped at the usable cores "
        "(default: all of them); every number is the same for any --jobs",
    )
    common.add_out(p, "results/deepnet")
    p.add_argument("--quiet", action="store_true")
    return p


def _image_side(root: Path, rc) -> int:
    """The shorter side of D_P's first training image (by name), at most the model's own input
    side."""
    from PIL import Image  # noqa: PLC0415

    own = model_normalization(create_model(rc.model, 1, seed=0, **rc.model_kwargs))["input_size"][
        -1
    ]
    first = min((p for p in (root / "train").rglob("*") if p.is_file()), default=None)
    try:
        with Image.open(first) as img:
            return max(8, min(own, *img.size))
    except (OSError, TypeError, ValueError):
        return own  # image_folder reports the bad file or folder


def plan(args) -> list:
    """The configurations to run with the flags applied, every combination checked before
    compute."""
    name = args.config or ("folders" if args.dp_root or args.dh_root else None)
    if (args.demo and args.config) or not (args.demo or name):
        raise common.UsageError("pass --demo, --config NAME, or --dp-root and --dh-root", "--demo")
    if args.checkpoint and args.pretrained:
        raise common.UsageError(
            "--checkpoint and --pretrained both give θ₀; pass one", "--pretrained"
        )
    if args.model is not None and not __import__("timm").is_model(args.model):
        raise common.UsageError(
            f"{args.model!r} is not a timm model name (timm.list_models())", "--model"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise common.UsageError(
            "torch sees no CUDA device here; use --device cpu or auto", "--device"
        )
    if args.ill_balances and not args.balances:
        raise common.UsageError(
            "--ill-balances is crossed with --balances: pass both", "--balances"
        )
    runs = []
    for key in DEMO_CONFIGS if args.demo else (name,):
        rc = with_model(CONFIGS[key], args.model, args.img_size)
        given = [
            f
            for f, v in (
                ("--dp-root", args.dp_root),
                ("--dh-root", args.dh_root),
                ("--checkpoint", args.checkpoint),
                ("--pretrained", args.pretrained),
                ("--val-split", args.val_split != "val"),
            )
            if v
        ]
        if rc.data == "mnist" and given:
            raise common.UsageError(
                f"{key} uses the bundled MNIST digits and trains θ₀ on them", given[0]
            )
        if rc.data == "folders" and not (args.dp_root and args.dh_root):
            raise common.UsageError(
                f"{key} reads ImageFolder roots: pass --dp-root and --dh-root",
                "--dh-root" if args.dp_root else "--dp-root",
            )
        epochs = rc.theta0_epochs if args.theta0_epochs is None else args.theta0_epochs
        if not (epochs or args.checkpoint or args.pretrained):
            raise common.UsageError(
                f"{key} has no θ₀ (a random network scores chance): pass "
                "--checkpoint FILE, --pretrained, or --theta0-epochs N (training on D_P)",
                "--checkpoint",
            )
        if (
            rc.data == "folders"
            and args.img_size is None
            and not (args.checkpoint or args.pretrained)
        ):
            # θ₀ trained here: the images' size
            rc = with_model(rc, None, _image_side(args.dp_root, rc))
        rc = replace(
            rc,
            theta0_epochs=epochs,
            methods=tuple(args.methods or rc.methods),
            options=options(rc.options, **common.given_options(args, [DeepOptions])),
        )
        if args.balances:  # a sweep: the linear probes only
            sweep = tuple((b, bi) for b in args.balances for bi in (args.ill_balances or [None]))
            rc = replace(
                rc,
                name=f"{rc.name}-sweep",
                sweep=sweep,
                operators=("gd", "adam", "adam_whitened"),
            )
        runs.append(rc)
    return runs


def _staged(path: Path, token: str) -> Path:
    """The temporary name of the output ``path`` in this run (``token``): hidden, in the same
    folder, with the same suffix (matplotlib picks the format by it)."""
    return path.with_name(f".{path.stem}.{token}{path.suffix}")


def _output_names(rc) -> list[str]:
    """Every file a configuration's run can write: the tables and figures, and per row its
    extractor and (should the row fail) its last good model."""
    rows = ["init", *(row for row, _, _ in _variants(rc))]
    rows += [f"{r}+{rc.options.harden}" for r in rows] if rc.options.harden != "none" else []
    models = [
        f"{kind}_{row.replace('/', '_')}.safetensors"
        for row in rows
        for kind in ("extractor", "last_good")
    ]
    return [*FILES, *models]


def stage_extractor(folder, token, first_seed, config, model, row, seed, status):
    """on_extractor: the first seed's extractors and every last good model, each written whole
    under its temporary name (moved into place with the run's other outputs at its end); returns
    the final path."""
    if status == "immunized" and seed != first_seed:
        return None
    # a sweep row "ours@b/b_ill" names a file, not a folder
    kind = "extractor" if status == "immunized" else "last_good"
    final = Path(folder) / f"{kind}_{row.replace('/', '_')}.safetensors"
    extra = {"config": config, "row": row, "seed": seed, "status": status}
    final.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, _staged(final, token), extra)
    return str(final)


def _write_all(staged: list, token: str) -> None:
    """Move every staged output into place, results.json files last; any failure or interruption
    before that removes this run's temporaries and leaves every earlier output as it was."""
    staged = sorted(staged, key=lambda p: p.name == "results.json")
    for final in staged:
        os.replace(_staged(final, token), final)


def main(argv=None) -> int:
    def body(args):
        runs = plan(args)
        seeds = args.seeds if args.seeds is not None else list(range(3 if args.demo else 1))
        for rc in runs:  # every destination checked before any compute
            common.check_out(Path(args.out) / rc.name, _output_names(rc))
        if args.threads:
            torch.set_num_threads(args.threads)
        ctx = init_from_env(args.device)
        roots = (r and str(r) for r in (args.dp_root, args.dh_root))
        opts = RunOptions(
            *roots,
            args.val_split,
            args.checkpoint and str(args.checkpoint),
            args.pretrained,
            args.quiet,
        )
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        folders = {rc.name: Path(args.out) / rc.name for rc in runs}
        failed, staged = [], []
        cpu0 = sum(os.times()[:4])
        try:
            results = run_configs(
                runs,
                seeds,
                opts,
                ctx,
                on_extractor=lambda rc: functools.partial(
                    stage_extractor, str(folders[rc.name]), token, seeds[0], rc.name
                ),
                jobs=args.jobs,
            )
            for rc, result in zip(runs, results or ()):
                folder = folders[rc.name]
                result["cpu_seconds"] = sum(os.times()[:4]) - cpu0  # this process + workers
                models = [
                    r.get("extractor") for s in result["per_seed"] for r in s["rows"].values()
                ]
                models += [
                    e.get("checkpoint") for v in result["errors"].values() for e in v.values()
                ]
                # the models this run staged (a worker wrote each under its temporary name)
                staged += [Path(p) for p in models if p and _staged(Path(p), token).exists()]
                table = deep_report.table_markdown(
                    result, PAPER_TABLE3.get(tuple(rc.name.split("-", 1)))
                )
                plots = (
                    deep_report.plot_probing,
                    deep_report.plot_operators,
                    deep_report.plot_tradeoff,
                )[: 2 + bool(rc.sweep)]
                files = {
                    "table.md": table,
                    **{n: (lambda p, f=f: f(result, p)) for n, f in zip(FILES[2:], plots)},
                    "results.json": dumps_json(result, indent=1),
                }
                for name, content in files.items():
                    path = _staged(folder / name, token)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if callable(content):
                        content(path)
                    else:
                        path.write_text(content)
                    staged.append(folder / name)
                if not args.quiet:
                    print(table)
                classes, acc = (
                    result["per_seed"][0]["classes"][0],
                    result["rows"]["init"]["dp_top1"]["mean"],
                )
                if acc < 150.0 / classes:
                    print(
                        f"deepnet.py: warning: θ₀ scores {acc:.1f}% on D_P's validation "
                        f"split, chance is {100 / classes:.1f}%: train it longer "
                        "(--theta0-epochs), or pass --checkpoint or --pretrained",
                        file=sys.stderr,
                        flush=True,
                    )
                failed += [
                    f"{rc.name} {s} {m}: {e['message']}"
                    for s, errs in result["errors"].items()
                    for m, e in errs.items()
                ]
            _write_all(staged, token)
            for rc in runs:
                print(f"[{rc.name}] outputs in {folders[rc.name]}")
        finally:
            shutdown()
            for folder in folders.values():  # this run's temporaries, whatever happened
                for tmp in folder.glob(f".*.{token}.*") if folder.is_dir() else ():
                    tmp.unlink(missing_ok=True)
        if failed:
            raise common.RunError(
                f"{len(failed)} run(s) failed (in results.json): " + "; ".join(failed)
            )

    return common.main(build_parser(), body, argv)


if __name__ == "__main__":
    sys.exit(main())
