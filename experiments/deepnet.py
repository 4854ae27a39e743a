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
every defense row of the headline, one seed (``--config demo-full``: three seeds, every operator
on every row, the attacker with 4× the images). θ₀ is ``--checkpoint``, ``--pretrained``, or
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

if not __package__:  # run as a file: the checkout's root first on sys.path, not experiments/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

# torch, timm and what imports them load in the functions that run the job: --help needs none
from experiments import common
from experiments.deep_catalog import CONFIGS, DEEP_METHODS, GROUPS
from pycore import near_chance

FILES = ("results.json", "table.md", "finetune.png", "operators.png", "frontier.png")


def build_parser() -> common.Parser:
    p = common.Parser(
        "deepnet.py",
        __doc__.split("\n\n")[0],
        "Without --dp-root/--dh-root: --demo (or --config demo...) runs on the bundled MNIST "
        "digits, 0-4 as D_P and 5-9 as D_H, with θ₀ trained here; the paper's configurations "
        "(--config resnet18-cars, ...) and --config folders need both roots; with none of these "
        "flags nothing runs.",
    )
    p.add_argument(
        "--config",
        choices=sorted({*CONFIGS, *GROUPS}),
        help="named configuration (folders with --dp-root); "
        + "; ".join(f"{g}: {', '.join(c)}" for g, c in GROUPS.items()),
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="CPU demo: " + ", ".join(GROUPS["demo"]) + " on the bundled MNIST digits",
    )
    p.add_argument(
        "--model", help="any timm model name (timm.list_models()); replaces the configuration's"
    )
    p.add_argument("--img-size", type=common.count(8, 4096), help="input side in pixels")
    p.add_argument(
        "--dp-root",
        type=common.existing("folder"),
        help="D_P's images: ROOT/train/<class>/<image> and ROOT/<val-split>/<class>/<image>",
    )
    p.add_argument(
        "--dh-root", type=common.existing("folder"), help="D_H's images, laid out as --dp-root"
    )
    p.add_argument(
        "--val-split", default="val", help="the second split folder of both roots (D_H: its test)"
    )
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
        "--rows",
        type=common.comma_list(),
        help="the configuration's rows to run, by name (default: all of them)",
    )
    p.add_argument(
        "--methods",
        type=common.comma_list(choices=DEEP_METHODS),
        help="with --dp-root/--dh-root: one row per method on the layer (default: ours)",
    )
    common.add_deep_options(p)
    p.add_argument(
        "--seeds",
        type=common.seeds,
        metavar="N|A,B,C|A-B",
        help="seeds (default 3 with a group of --config, else 1, --demo included)",
    )
    p.add_argument(
        "--threads",
        type=common.count(1, 1024),
        help="torch threads (recorded; a result is reproducible for a seed AND a thread count)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where torch runs: auto is CUDA when torch sees a device, else the CPU",
    )
    p.add_argument(
        "--jobs",
        type=common.count(1, common.MAX_JOBS),
        default=common.usable_cores(),
        help="worker processes over the (configuration, seed) runs and then each row's "
        "operators, capped at the usable cores (default: all of them); every number is the same "
        "for any --jobs",
    )
    common.add_out(p, "results/deepnet")
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="recompute θ₀ and its side of the judge (by default kept in OUT/.cache for reruns "
        "on the demo digits, keyed by every setting and the code's source)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines and no table on stdout (the files are written; errors and "
        "warnings still go to stderr)",
    )
    return p


def _first_image_size(root: Path) -> tuple[int, int] | None:
    """The size of D_P's first training image (by name), None when it cannot be read
    (image_folder then reports the bad file or folder)."""
    from PIL import Image  # noqa: PLC0415

    first = min((p for p in (root / "train").rglob("*") if p.is_file()), default=None)
    try:
        with Image.open(first) as img:
            return img.size
    except (OSError, TypeError, ValueError, AttributeError):
        return None


def run_configs(*args, **kwargs):
    """:func:`experiments.deep_pipeline.run_configs` (imported when the job runs)."""
    from experiments.deep_pipeline import run_configs as run

    return run(*args, **kwargs)


def _own_side(rc) -> int:
    from pycore.deep import create_model
    from pycore.deep._data import model_normalization

    kwargs = {k: v for k, v in rc.model_kwargs.items() if k != "img_size"}
    return model_normalization(create_model(rc.model, 1, seed=0, **kwargs))["input_size"][-1]


def _image_side(root: Path, rc) -> int:
    """The shorter side of D_P's first training image (by name), at most the model's own input
    side."""
    size = _first_image_size(root)
    return _own_side(rc) if size is None else max(8, min(_own_side(rc), *size))


def _check_roots(args) -> None:
    """The roots are two folders, each holding train/ and the --val-split folder (a root with
    training/ failed later on an AttributeError)."""
    common.distinct_roots(args.dp_root, args.dh_root)
    for flag, root in (("--dp-root", args.dp_root), ("--dh-root", args.dh_root)):
        missing = [s for s in ("train", args.val_split) if root and not (root / s).is_dir()]
        if missing:
            found = sorted(d.name + "/" for d in root.iterdir() if d.is_dir())
            raise common.UsageError(
                f"{root} has no {missing[0]}/ folder; expected {root}/train/<class>/<image> and "
                f"{root}/{args.val_split}/<class>/<image> (--val-split names the second); it "
                f"holds {', '.join(found[:10]) or 'no folder'}",
                flag,
            )


def _check_input_size(rc, args) -> None:
    """The model takes its inputs at the side it will see (convnext_atto cannot take 28 px: a raw
    RuntimeError deep in the first step), and a side far above the images' is said, with what
    one image costs."""
    import torch

    from pycore.deep import create_model
    from pycore.deep._data import model_normalization

    net = create_model(rc.model, 2, seed=0, **rc.model_kwargs).eval()
    side = model_normalization(net)["input_size"][-1]
    try:
        if side < _own_side(rc):  # below its own side a network may run out of pixels
            with torch.no_grad():
                net(torch.zeros(1, 3, side, side))
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise common.UsageError(
            f"{rc.model} cannot take {side}-px inputs ({first}): pass a larger --img-size "
            f"(its own input side is {_own_side(rc)} px)",
            "--img-size",
        ) from None
    size = _first_image_size(args.dp_root) if args.img_size and args.dp_root else None
    if size is not None and args.img_size > 4 * max(size):
        one = 3 * 4 * args.img_size**2
        # the largest batch any row's training or any operator takes
        batch = max(
            [getattr(r.options, "batch_size", 0) for r in rc.rows] + [rc.schedule.batch_size]
        )
        print(
            f"deepnet.py: warning: --img-size {args.img_size} upsamples D_P's "
            f"{size[0]}x{size[1]}-px images {args.img_size / max(size):.0f}×: each takes "
            f"{_bytes(one)} as float32, a batch of {batch} {_bytes(batch * one)}",
            file=sys.stderr,
            flush=True,
        )


def _bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it ≥ 1, to three digits."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}" if n < 1000 else f"{n:.0f} {unit}"
        n /= 1024


def _check_classifier(rc, flag: str) -> None:
    """The model has the one linear classifier the layer feeds (a DeiT distilled pair has not):
    checked on the meta device (shapes, no weights), before any compute."""
    import torch

    from pycore import ParameterError
    from pycore.deep import create_model
    from pycore.deep._models import linear_classifier

    try:
        with torch.device("meta"):
            linear_classifier(create_model(rc.model, 2, **rc.model_kwargs))
    except ParameterError as exc:
        raise common.UsageError(str(exc), flag) from None


def plan(args) -> list:
    """The configurations to run with the flags applied, every combination checked before
    compute."""
    import torch

    from experiments.deep_configs import CONFIGS, GROUPS, with_model
    from experiments.deep_pipeline import Row
    from pycore.deep import DeepOptions
    from pycore.deep._deep_options import options

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
    if args.methods and (args.demo or (args.config and args.config != "folders")):
        raise common.UsageError(
            "--methods makes the rows of --dp-root/--dh-root runs; a named configuration "
            "has its rows: choose among them with --rows",
            "--methods",
        )
    runs = []
    keys = GROUPS["demo"] if args.demo else GROUPS.get(name, (name,))
    for key in keys:
        rc = with_model(CONFIGS[key], args.model, args.img_size)
        _check_classifier(rc, "--model" if args.model else "--config")
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
        if rc.data == "folders":
            _check_roots(args)
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
        rows = rc.rows
        if args.methods:
            rows = tuple(Row(m, m, rows[0].options) for m in args.methods)
        if args.rows:
            unknown = [r for r in args.rows if r not in {x.name for x in rows}]
            if unknown:
                raise common.UsageError(
                    f"{key} has no row {unknown[0]!r}; its rows: "
                    + ", ".join(r.name for r in rows),
                    "--rows",
                )
            rows = tuple(r for r in rows if r.name in args.rows)
        given = common.given_options(args, DeepOptions.names())
        rows = tuple(
            replace(r, options=options(r.options, **given))
            if isinstance(r.options, DeepOptions)
            else r
            for r in rows
        )
        rc = replace(rc, theta0_epochs=epochs, rows=rows)
        if rc.data == "folders":
            _check_input_size(rc, args)
        runs.append(rc)
    return runs


def theta0_warning(result: dict, args) -> dict | None:
    """θ₀ near chance on D_P's validation split, on any seed (:func:`pycore.near_chance`,
    chance the majority class's share); the advice fits where θ₀ came from."""
    low = []
    for s in result["per_seed"]:
        chance = s.get("dp_chance", 100.0 / s["classes"][0])
        acc = s["theta0"]["dp_top1"]
        if near_chance(acc, chance):
            low.append({"seed": s["seed"], "dp_top1": acc, "chance": chance})
    if not low:
        return None
    if args.checkpoint:
        advice = (
            f"the --checkpoint {args.checkpoint} is not a classifier of D_P's classes: train it "
            "on them first (or give the checkpoint of one)"
        )
    elif args.pretrained:
        advice = (
            "the pretrained θ₀'s classifier is new for D_P's classes and untrained: pass "
            "--checkpoint with a model trained on D_P"
        )
    else:
        advice = "train it longer (--theta0-epochs N), or pass --checkpoint or --pretrained"
    worst = min(low, key=lambda x: x["dp_top1"] - x["chance"])
    message = (
        f"θ₀ scores {worst['dp_top1']:.1f}% on D_P's validation split (seed {worst['seed']}; "
        f"chance, its largest class, is {worst['chance']:.1f}%) on {len(low)} of "
        f"{len(result['per_seed'])} seed(s): {advice}"
    )
    return {"seeds": low, "message": message}


def _staged(path: Path, token: str) -> Path:
    """The temporary name of the output ``path`` in this run (``token``): hidden, in the same
    folder, with the same suffix (matplotlib picks the format by it)."""
    return path.with_name(f".{path.stem}.{token}{path.suffix}")


def _output_names(rc) -> list[str]:
    """Every file a configuration's run can write: the tables and figures, and per row its
    extractor and (should the row fail) its last good model."""
    rows = ["init", *(r.name for r in rc.rows)]
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
    from pycore.deep import save_model

    if status == "immunized" and seed != first_seed:
        return None
    # a row's name is a file name's part, never a folder
    kind = "extractor" if status == "immunized" else "last_good"
    final = Path(folder) / f"{kind}_{row.replace('/', '_')}.safetensors"
    extra = {"config": config, "row": row, "seed": seed, "status": status}
    final.parent.mkdir(parents=True, exist_ok=True)
    save_model(model, _staged(final, token), extra)
    return str(final)


def _write_all(staged: list, token: str) -> None:
    """Move every staged output of every configuration into place at once (:func:`common.commit`:
    all or none); any failure or interruption before that removes this run's temporaries and
    leaves every earlier output as it was."""
    common.commit([(_staged(final, token), final) for final in staged])


def main(argv=None) -> int:
    def body(args):
        import torch

        from experiments import deep_report
        from experiments.deep_configs import PAPER_TABLE3
        from experiments.deep_pipeline import RunOptions
        from pycore.deep._distributed import init_from_env, shutdown
        from pycore.report import dumps_json

        runs = plan(args)
        # --demo: one seed (the quick demo); a group of --config: three (demo-full)
        seeds = (
            args.seeds
            if args.seeds is not None
            else list(range(3 if args.config in GROUPS else 1))
        )
        for rc in runs:  # every destination checked before any compute
            common.check_out(Path(args.out) / rc.name, _output_names(rc))
        if args.threads:
            torch.set_num_threads(common.thread_count(args.threads, "deepnet.py"))
        ctx = init_from_env(args.device)
        roots = (r and str(r) for r in (args.dp_root, args.dh_root))
        # θ₀ and θ₀'s side kept for reruns on the bundled digits (a folder's images may change
        # between runs; the digits do not)
        cache = None if args.no_cache else str(Path(args.out) / ".cache")
        opts = RunOptions(
            *roots,
            args.val_split,
            args.checkpoint and str(args.checkpoint),
            args.pretrained,
            args.quiet,
            cache if all(rc.data == "mnist" for rc in runs) else None,
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
                result["theta0_near_chance"] = theta0_warning(result, args)
                models = [
                    r.get("extractor")
                    for s in result["per_seed"]
                    for r in (s["theta0"], *s["rows"].values())
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
                    deep_report.plot_frontier,
                )
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
                if result["theta0_near_chance"]:
                    print(
                        f"deepnet.py: warning: {result['theta0_near_chance']['message']}",
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
