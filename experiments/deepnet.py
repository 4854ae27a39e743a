"""Deep-net immunization with timm ResNet18 / ViT (SPEC §8-9, paper §5.2, Table 3, Figure 3).

Named configurations mirror the paper's Table 4::

    python experiments/deepnet.py --config resnet18-cars --dp-root IMAGENET --dh-root CARS \
        [--checkpoint theta0.safetensors | --pretrained]
    torchrun --nproc_per_node=8 experiments/deepnet.py --config vit-country211 ...

``--demo`` runs the whole pipeline on CPU with real images and no downloads (MNIST digits
0-4 as D_P, 5-9 as D_H, 32 px RGB; ResNet18 and a small ViT trained on D_P to make θ₀, then
immunized with every method, evaluated and probed). Outputs go to
``results/deepnet/<config>/``: ``results.json`` (all numbers, seeds, versions, command line),
``table.md`` (Table 3 layout next to the paper's numbers), ``finetune.png`` (Figure 3) and
``extractor_<method>.safetensors`` (load with :func:`pycore.deep.load_immunized`).
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

try:
    from experiments import cli
except ModuleNotFoundError as exc:  # a checkout that was never installed: say how, not a traceback
    if exc.name not in ("experiments", "pycore"):
        raise
    sys.exit(f"{Path(sys.argv[0]).name}: error: cannot import {exc.name!r}; install the project "
             "(bash scripts/install.sh, or pip install --no-build-isolation --no-deps -e .) or run from "
             "the repository root with PYTHONPATH=.")
from pycore.deep import (  # noqa: E402  (pycore.deep installs the torchvision shim first)
    METHODS, ImmunizeConfig, NonFiniteLossError, build_model, cache_trunk, freeze_reference, immunize, linear_probe_curve, save_immunized,
    train_classifier,
)
from pycore.deep.data import (  # noqa: E402
    DataError, image_folder, mnist_demo_tasks, model_normalization, timm_transform,
)
from pycore.deep.distributed import barrier, broadcast_module, init_from_env, shutdown  # noqa: E402
from pycore.deep.metrics import extract_features  # noqa: E402
from pycore.metrics import grouped_feature_rir  # noqa: E402
from pycore.report import environment, fmt, pm, write_json  # noqa: E402

# Paper Table 3 (3 seeds): (i), (ii), RIR_θ₀, D_P top-1 %; θ₀ top-1 68.24 (ResNet18) / 81.78 (ViT).
PAPER_TABLE3 = {
    ("resnet18", "cars"): {"init": (1.0, 1.0, 1.0, 68.24), "r_ill_only": (1.878, 1.786, 1.057, 63.84),
                           "imma": (0.866, 0.889, 0.974, 63.57), "opt_kappa": (1.217, 0.798, 1.527, 63.65),
                           "ours": (2.386, 0.699, 3.467, 62.36)},
    ("vit", "cars"): {"init": (1.0, 1.0, 1.0, 81.78), "r_ill_only": (13.121, 4.097, 3.342, 82.21),
                      "imma": (1.422, 2.090, 0.702, 81.89), "opt_kappa": (3.598, 0.171, 26.369, 82.51),
                      "ours": (7.945, 0.323, 34.517, 82.79)},
    ("resnet18", "country211"): {"init": (1.0, 1.0, 1.0, 68.24), "r_ill_only": (20.727, 20.675, 1.038, 62.17),
                                 "imma": (0.791, 0.814, 0.972, 67.03), "opt_kappa": (1.538, 1.053, 1.472, 66.81),
                                 "ours": (3.287, 0.399, 8.714, 65.01)},
    ("vit", "country211"): {"init": (1.0, 1.0, 1.0, 81.78), "r_ill_only": (69.291, 63.519, 1.122, 80.73),
                            "imma": (6.242, 7.599, 0.845, 82.47), "opt_kappa": (4.589, 0.300, 16.498, 82.79),
                            "ours": (20.894, 0.700, 41.341, 83.17)},
}

METHOD_LABEL = {"init": "Init. θ₀", "r_ill_only": "R_ill only", "imma": "IMMA", "opt_kappa": "Opt κ",
                "ours": "Ours"}


@dataclass
class RunConfig:
    """One experiment: backbone, data and the immunization hyper-parameters."""

    name: str
    backbone: str
    data: str                                # "folders" | "mnist"
    paper_key: "tuple[str, str] | None" = None
    immunize: ImmunizeConfig = field(default_factory=ImmunizeConfig)
    methods: tuple[str, ...] = METHODS
    # θ₀ (demo: trained here on D_P)
    theta0_epochs: int = 0
    theta0_lr: float = 1e-3
    # MNIST demo data
    per_digit: "int | None" = None
    img_size: int = 32
    # evaluation
    rir_groups: int = 20
    rir_group_size: int = 100
    rir_pool: "int | None" = None            # samples per task the RIR groups are drawn from
    probe_epochs: int = 50
    eval_batch: int = 256


def _paper(method, lam_p, lam_h, epochs):
    return ImmunizeConfig(method=method, lr=1e-5, lambda_p=lam_p, lambda_h=lam_h, epochs=epochs)


# Paper-scale runs draw the 20 groups of 100 RIR samples from 2000 training images per task.
_PAPER_EVAL = {"rir_pool": 2000}


CONFIGS: dict[str, RunConfig] = {
    # Paper Table 4 (λ_P on R_well, λ_H on R_ill; epochs of the shorter D_H loader).
    "resnet18-cars": RunConfig("resnet18-cars", "resnet18", "folders", ("resnet18", "cars"),
                               _paper("ours", 5e-5, 2e6, 3), **_PAPER_EVAL),
    "resnet18-country211": RunConfig("resnet18-country211", "resnet18", "folders", ("resnet18", "country211"),
                                     _paper("ours", 1e-4, 2e6, 3), **_PAPER_EVAL),
    "vit-cars": RunConfig("vit-cars", "vit_base_clip", "folders", ("vit", "cars"),
                          _paper("ours", 3e-6, 3e8, 2), **_PAPER_EVAL),
    "vit-country211": RunConfig("vit-country211", "vit_base_clip", "folders", ("vit", "country211"),
                                _paper("ours", 1e-6, 1e8, 2), **_PAPER_EVAL),
    # CPU demo: MNIST 0-4 (D_P) vs 5-9 (D_H), 32 px. λ's are set by gradient-norm balancing at
    # step 0 (the paper's App. C.2 rule, automated), the same ratio for every method.
    "demo-resnet18": RunConfig("demo-resnet18", "resnet18_32px", "mnist", None,
                               ImmunizeConfig(lr=3e-5, balance=1.0, epochs=2, max_steps=24, batch_size=64),
                               theta0_epochs=3, theta0_lr=2e-3, per_digit=250, rir_pool=500,
                               probe_epochs=60),
    "demo-vit": RunConfig("demo-vit", "vit_tiny_32px", "mnist", None,
                          ImmunizeConfig(lr=1e-2, balance=10.0, epochs=4, max_steps=60, batch_size=64),
                          theta0_epochs=8, theta0_lr=3e-3, per_digit=250, rir_pool=500, probe_epochs=60),
    # CI size (tests): a handful of steps on a few hundred digits.
    "ci": RunConfig("ci", "resnet18_32px", "mnist", None,
                    ImmunizeConfig(lr=3e-5, balance=1.0, epochs=1, max_steps=3, batch_size=16),
                    theta0_epochs=1, theta0_lr=2e-3, per_digit=40, rir_groups=4, rir_group_size=40,
                    probe_epochs=5, eval_batch=128),
}

DEMO_CONFIGS = ("demo-resnet18", "demo-vit")


# --- pipeline ---------------------------------------------------------------------------------

def _load_data(rc: RunConfig, model, args, rng):
    """Returns (p_train, p_val, h_train, h_test, n_classes_p, n_classes_h, cacheable)."""
    if rc.data == "mnist":
        mean, std = model_normalization(model)
        t = mnist_demo_tasks(rng, img_size=rc.img_size, per_digit=rc.per_digit, mean=mean, std=std)
        return t.p_train, t.p_val, t.h_train, t.h_test, t.num_classes_p, t.num_classes_h, True
    if not args.dp_root or not args.dh_root:
        raise DataError(f"config {rc.name} needs --dp-root and --dh-root (ImageFolder roots with "
                        f"train/ and {args.val_split}/ splits)")
    tf = timm_transform(model, training=False)
    p_tr, p_va = image_folder(args.dp_root, "train", tf), image_folder(args.dp_root, args.val_split, tf)
    h_tr, h_te = image_folder(args.dh_root, "train", tf), image_folder(args.dh_root, args.val_split, tf)
    return p_tr, p_va, h_tr, h_te, len(p_tr.classes), len(h_tr.classes), args.cache_trunk


def _subset(ds, n, rng):
    if n is None or n >= len(ds):
        return ds
    from torch.utils.data import Subset, TensorDataset  # noqa: PLC0415

    idx = np.sort(rng.choice(len(ds), size=n, replace=False))
    if isinstance(ds, TensorDataset):
        return TensorDataset(*(t[torch.from_numpy(idx)] for t in ds.tensors))
    return Subset(ds, idx.tolist())


def _labels(ds) -> np.ndarray:
    from torch.utils.data import TensorDataset  # noqa: PLC0415

    if isinstance(ds, TensorDataset):
        return ds.tensors[1].numpy()
    if hasattr(ds, "targets"):                       # ImageFolder: no need to decode images
        return np.asarray(ds.targets)
    if hasattr(ds, "indices") and hasattr(ds.dataset, "targets"):
        return np.asarray(ds.dataset.targets)[np.asarray(ds.indices)]
    return np.asarray([int(ds[i][1]) for i in range(len(ds))])


def _evaluate(model, ref_feats, ev, rc: RunConfig, seed: int, from_trunk: bool) -> dict:
    """D_P top-1, RIR_θ₀ against the frozen θ₀'s features, and the probing curve."""
    f = {k: extract_features(model, ds, batch_size=rc.eval_batch, from_trunk=from_trunk)
         for k, ds in ev["sets"].items()}
    with torch.no_grad():
        dev = next(model.parameters()).device
        logits = model.classifier(torch.from_numpy(f["p_val"]).float().to(dev)).cpu()
    acc = 100.0 * float((logits.argmax(1).numpy() == ev["y"]["p_val"]).mean())
    hp = ev["h_pool_idx"]  # the D_H RIR pool is a subset of the probe's D_H training rows
    rir = grouped_feature_rir(f["p_pool"], f["h_train"][hp], ref_feats["p_pool"], ref_feats["h_train"][hp],
                              rng=np.random.default_rng([seed, 17]), groups=rc.rir_groups,
                              group_size=rc.rir_group_size)
    probe = linear_probe_curve(f["h_train"], ev["y"]["h_train"], f["h_test"], ev["y"]["h_test"],
                               epochs=rc.probe_epochs, num_classes=ev["n_classes_h"])
    return {"dp_top1": acc, "rir": rir, "probe": probe.as_dict()}, f


def run(rc: RunConfig, args, ctx, seed: int = 0, out: "Path | None" = None) -> "dict | None":
    """One configuration and seed; rank 0 writes results.json, table.md, finetune.png and the
    extractors into ``out`` (the staging folder of the run's output set)."""
    t_start = time.perf_counter()
    rng = np.random.default_rng(seed)
    say = print if ctx.is_main else (lambda *a, **k: None)
    say(f"[{rc.name}] backbone={rc.backbone} world={ctx.world} device={ctx.device}", flush=True)

    theta0 = build_model(rc.backbone, 1, seed=seed)  # only to resolve the model's normalisation
    p_tr, p_va, h_tr, h_te, ncp, nch, cacheable = _load_data(rc, theta0, args, rng)
    theta0 = build_model(rc.backbone, ncp, pretrained=args.pretrained, checkpoint=args.checkpoint,
                         seed=seed).to(ctx.device)
    if rc.theta0_epochs and args.checkpoint is None and not args.pretrained:
        t = time.perf_counter()
        if ctx.is_main:
            train_classifier(theta0, p_tr, epochs=rc.theta0_epochs, lr=rc.theta0_lr, seed=seed,
                             device=ctx.device, progress=True)
        broadcast_module(theta0)
        say(f"[{rc.name}] θ₀ trained on D_P in {time.perf_counter() - t:.1f}s", flush=True)
    theta0.eval()
    reference = freeze_reference(theta0)          # the FROZEN copy RIR_θ₀ is measured against
    theta0.set_trainable()
    from_trunk = bool(cacheable)
    if from_trunk:
        t = time.perf_counter()
        p_tr_c, h_tr_c = (cache_trunk(theta0, d, batch_size=rc.eval_batch, device=ctx.device)
                          for d in (p_tr, h_tr))
        p_va_c, h_te_c = (cache_trunk(theta0, d, batch_size=rc.eval_batch, device=ctx.device)
                          for d in (p_va, h_te))
        say(f"[{rc.name}] frozen trunk cached in {time.perf_counter() - t:.1f}s", flush=True)
    else:
        p_tr_c, h_tr_c, p_va_c, h_te_c = p_tr, h_tr, p_va, h_te

    ev_rng = np.random.default_rng([seed, 3])
    n_h_pool = len(h_tr_c) if rc.rir_pool is None else min(rc.rir_pool, len(h_tr_c))
    ev = {"sets": {"p_pool": _subset(p_tr_c, rc.rir_pool, ev_rng), "p_val": p_va_c, "h_train": h_tr_c,
                   "h_test": h_te_c},
          "h_pool_idx": np.sort(ev_rng.choice(len(h_tr_c), size=n_h_pool, replace=False)),
          "n_classes_h": nch}
    ev["y"] = {k: _labels(ev["sets"][k]) for k in ("p_val", "h_train", "h_test")}

    rows, errors, ref_feats = {}, {}, None
    if ctx.is_main:
        reference.verify()
        ref_feats = {k: extract_features(reference.model, ds, batch_size=rc.eval_batch, from_trunk=from_trunk)
                     for k, ds in ev["sets"].items()}
        ref_eval, _ = _evaluate(reference.model, ref_feats, ev, rc, seed, from_trunk)
        rows["init"] = ref_eval
        say(f"[{rc.name}] θ₀: D_P top-1 {ref_eval['dp_top1']:.2f}%", flush=True)

    for method in rc.methods:
        cfg = replace(rc.immunize, method=method, seed=seed, virtual_ranks=args.virtual_ranks,
                      checkpoint_dir=None if out is None else str(out), progress=not args.quiet)
        model = copy.deepcopy(reference.model)
        try:
            res = immunize(model, p_tr_c, h_tr_c, cfg, num_classes_h=nch, from_trunk=from_trunk,
                           device=ctx.device, rank=ctx.rank, world=ctx.world, ddp=ctx.distributed)
        except NonFiniteLossError as exc:
            say(f"[{rc.name}] {exc}", flush=True)
            errors[method] = {"message": str(exc), "step": exc.step, "checkpoint": exc.checkpoint}
            continue
        if ctx.is_main:
            row, _ = _evaluate(model, ref_feats, ev, rc, seed, from_trunk)
            row["train"] = {"steps": res.steps, "wall_seconds": res.wall_seconds, "lambdas": res.lambdas,
                            "mean_step_seconds": float(np.mean(res.history["step_seconds"])),
                            "final": {k: v[-1] for k, v in res.history.items() if v}}
            row["extractor"] = save_immunized(model, out / f"extractor_{method}.safetensors", ncp,
                                              extra={"config": rc.name, "method": method, "seed": seed})
            rows[method] = row
            r = row["rir"]
            say(f"[{rc.name}] {method:10s} RIR_θ₀ {pm(r['value'])}  (i) {fmt(r['harmful_ratio']['mean'])}"
                f"  (ii) {fmt(r['pretrain_ratio']['mean'])}  D_P top-1 {row['dp_top1']:.2f}%"
                f"  [{res.steps} steps, {res.wall_seconds:.1f}s]", flush=True)
    barrier()
    if not ctx.is_main:
        return None
    result = {
        "config": rc.name, "backbone": rc.backbone, "seed": seed, "world_size": ctx.world,
        "virtual_ranks": args.virtual_ranks, "run_config": _jsonable(asdict(rc)),
        "rows": rows, "errors": errors, "wall_seconds": time.perf_counter() - t_start,
        "environment": environment(),
        "notes": {
            "rir": "RIR_θ₀ = [κ(H̃_H(θ_I))/κ(H̃_H(θ₀))]/[κ(H̃_P(θ_I))/κ(H̃_P(θ₀))] on extracted features "
                   f"against a frozen copy of θ₀, mean ± std over {rc.rir_groups} groups of "
                   f"{rc.rir_group_size} samples (κ over the nonzero spectrum, float64)",
            "probe": "full-batch GD on softmax CE, step 1/λ_max(AᵀA/N), zero init; test accuracy per epoch",
        },
    }
    (out / "table.md").write_text(_table(rc, rows, errors, seed))  # results.json: by main(), paths relocated
    _plot(rc, rows, out / "finetune.png")
    return result


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    return o


def _table(rc: RunConfig, rows: dict, errors: dict, seed: int) -> str:
    gs = next((r["rir"]["group_size"] for r in rows.values()), rc.rir_group_size)  # capped by the data
    lines = [f"# Deep-net immunization: {rc.name} (backbone {rc.backbone}, seed {seed})", "",
             f"RIR_θ₀ against a frozen copy of θ₀, mean ± std over {rc.rir_groups} groups of "
             f"{gs} samples; D_P top-1 on the D_P validation split.", "",
             "| method | (i) κ ratio on D_H ↑ | (ii) κ ratio on D_P ↓ | RIR_θ₀ ↑ | D_P top-1 % | "
             "probe acc. on D_H after 10 / last epoch ↓ |" + (" paper RIR_θ₀ | paper D_P % |" if rc.paper_key else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if rc.paper_key else "")]
    paper = PAPER_TABLE3.get(rc.paper_key, {}) if rc.paper_key else {}
    for m in ("init",) + tuple(rc.methods):
        if m in errors:
            lines.append(f"| {METHOD_LABEL[m]} | failed: {errors[m]['message']} |")
            continue
        if m not in rows:
            continue
        r = rows[m]
        acc = r["probe"]["test_accuracy"]
        line = (f"| {METHOD_LABEL[m]} | {pm(r['rir']['harmful_ratio'])} | {pm(r['rir']['pretrain_ratio'])} | "
                f"{pm(r['rir']['value'])} | {r['dp_top1']:.2f} | {acc[min(10, len(acc) - 1)]:.1f} / {acc[-1]:.1f} |")
        if rc.paper_key:
            p = paper.get(m)
            line += f" {p[2]} | {p[3]} |" if p else " | |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _plot(rc: RunConfig, rows: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for m, r in rows.items():
        acc = r["probe"]["test_accuracy"]
        ax.plot(range(len(acc)), acc, label=METHOD_LABEL.get(m, m), lw=2 if m in ("ours", "init") else 1.2,
                ls="--" if m == "init" else "-")
    ax.set_xlabel("linear-probing epoch (full-batch GD, step 1/L)")
    ax.set_ylabel("D_H test accuracy (%)  ↓ better")
    ax.set_title(f"Linear probing on D_H: {rc.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- CLI --------------------------------------------------------------------------------------

# The deep ImmunizeConfig fields a flag may override on top of the named configuration.
FLAG_FIELDS = ("epochs", "max_steps", "batch_size", "lr")
OUTPUTS = ("results.json", "table.md", "finetune.png", "extractor_*.safetensors", "last_good_*.safetensors")


def build_parser() -> cli.Parser:
    ap = cli.Parser(prog="deepnet.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), help="named configuration")
    ap.add_argument("--demo", action="store_true", help="CPU demo: " + ", ".join(DEMO_CONFIGS))
    ap.add_argument("--dp-root", type=cli.existing_path("folder"), help="ImageFolder root of D_P (train/ and --val-split)")
    ap.add_argument("--dh-root", type=cli.existing_path("folder"), help="ImageFolder root of D_H (train/ and --val-split)")
    ap.add_argument("--val-split", default="val")
    ap.add_argument("--checkpoint", type=cli.existing_path("file"),
                    help="θ₀ weights: safetensors or weights-only torch state_dict")
    ap.add_argument("--pretrained", action="store_true", help="θ₀ from timm's hub (pretrained=True)")
    ap.add_argument("--methods", type=cli.choice_list(METHODS, "method"), help=f"comma list from {','.join(METHODS)}")
    cli.add_config_flags(ap, ImmunizeConfig, fields=FLAG_FIELDS,
                         bounds={"epochs": (1, False), "max_steps": (1, False), "batch_size": (1, False),
                                 "lr": (0.0, True)},
                         help={"batch_size": "per-rank batch size"},
                         title="immunization (pycore.deep ImmunizeConfig; default: the named configuration's)")
    cli.add_seeds(ap, "1")
    ap.add_argument("--virtual-ranks", type=cli.integer(1), default=1,
                    help="emulate a W-rank DDP run in one process (same shards, same objective)")
    ap.add_argument("--cache-trunk", action="store_true",
                    help="for folder data: run the frozen trunk once and keep its outputs in memory")
    ap.add_argument("--threads", type=cli.integer(1), default=None, help="torch intra-op threads")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--out", type=Path, default=Path("results/deepnet"),
                    help="output folder; each configuration's set goes to OUT/<config> (OUT/<config>-seed<S> "
                         "with several seeds), replaced as a whole")
    ap.add_argument("--quiet", action="store_true")
    return ap


def plan(args, parser: cli.Parser) -> list[tuple[RunConfig, int, Path]]:
    """(configuration, seed, output folder) of every run, checked before any compute."""
    if args.demo and args.config:
        raise cli.UsageError("pass --config NAME or --demo, not both")
    if not args.demo and not args.config:
        raise cli.UsageError("pass --config NAME or --demo")
    if args.checkpoint is not None and args.pretrained:
        raise cli.UsageError("--checkpoint and --pretrained both give θ₀; pass one")
    runs = []
    for name in DEMO_CONFIGS if args.demo else (args.config,):
        rc = CONFIGS[name]
        if rc.data == "folders":
            missing = [f for f, v in (("--dp-root", args.dp_root), ("--dh-root", args.dh_root)) if v is None]
            if missing:
                raise cli.UsageError(f"config {name} needs --dp-root and --dh-root (ImageFolder roots with "
                                     f"train/ and {args.val_split}/ splits)", missing[0])
        ic = cli.config_from_args(parser, args, rc.immunize, validate=ImmunizeConfig.validate)
        rc = replace(rc, immunize=ic, methods=tuple(args.methods) if args.methods else rc.methods)
        for seed in args.seeds:
            sub = name if len(args.seeds) == 1 else f"{name}-seed{seed}"
            runs.append((rc, seed, Path(args.out) / sub))
    return runs


def main(argv=None) -> int:
    parser = build_parser()

    def body(args):
        runs = plan(args, parser)
        for _, _, final in runs:  # every output folder checked before the first run computes
            cli.OutputSet(final, OUTPUTS, create=False)
        if args.threads:
            torch.set_num_threads(args.threads)
        ctx = init_from_env(args.device)
        failed = []
        try:
            for rc, seed, final in runs:
                # Only rank 0 writes; every rank checks the folder before any compute.
                with cli.OutputSet(final, OUTPUTS, create=ctx.is_main) as outs:
                    result = run(rc, args, ctx, seed, outs.path)
                    if ctx.is_main:
                        write_json(outs.path / "results.json", outs.relocate(result))
                        outs.commit()
                        print(f"[{rc.name}] wrote {final}/results.json, table.md, finetune.png "
                              f"({result['wall_seconds']:.1f}s)", flush=True)
                        failed += [f"{rc.name} seed {seed} {m}: {e['message']}" for m, e in result["errors"].items()]
        finally:
            shutdown()
        if failed:
            raise cli.RunError(f"{len(failed)} method run(s) failed (recorded in results.json): " + "; ".join(failed))
    return cli.run_main(parser, body, argv)


if __name__ == "__main__":
    sys.exit(main())
