"""The deep-net experiment pipeline (docs/theory.md §8-10; paper §5.2, Table 3, Figure 3).

Per seed: make θ₀ (train it on D_P for the demo, or load it), freeze a copy as the RIR_θ₀
reference, cache the frozen trunk once, immunize a deep copy of θ₀ with every method, and
measure each extractor (θ₀ included): D_P top-1, RIR_θ₀ with its factors (i) and (ii), and how
fast three attackers learn D_H from its features (:mod:`pycore.deep.attacks`). Over seeds:
mean ± std of every number (:func:`aggregate`), the Table 3 layout (:func:`table_markdown`),
seed-mean probing curves with a band (:func:`plot_probing`) and the attackers (:func:`plot_attacks`).

Reproducibility: everything random is seeded from the run's seed (data split, θ₀'s init and
its batches, the immunization batches, RIR groups, attackers), and :func:`run_config` turns
on ``torch.use_deterministic_algorithms``; the same seed and thread count give the same
digits (the thread count changes float reduction order, so it is recorded in results.json).
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from pycore.deep.attacks import best_adam_probe, finetune_attack, linear_probe_curve
from pycore.deep.data import DataError, image_folder, mnist_demo_tasks, model_normalization, timm_transform
from pycore.deep.distributed import barrier, broadcast_module
from pycore.deep.feature_metrics import extract_features, freeze_reference
from pycore.deep.models import build_model, save_immunized
from pycore.deep.objectives import DEEP_METHODS
from pycore.deep.train import DeepImmunizeConfig, NonFiniteLossError, cache_trunk, immunize, train_classifier
from pycore.metrics import grouped_feature_rir
from pycore.report import environment, fmt, pm, save_figure, summarize, write_json

__all__ = ["RunConfig", "RunOptions", "SeedRun", "CONFIGS", "DEMO_CONFIGS", "PAPER_TABLE3", "METHOD_LABEL",
           "run_config", "run_seed", "prepare_seed", "immunize_and_evaluate", "balance_sweep", "aggregate",
           "table_markdown", "plot_probing", "plot_attacks", "plot_balance_sweep"]

# Paper Table 3 (3 seeds): (i), (ii), RIR_θ₀, D_P top-1 %; θ₀ top-1 68.24 (ResNet18) / 81.78 (ViT).
PAPER_TABLE3 = {
    ("resnet18", "cars"): {"init": (1.0, 1.0, 1.0, 68.24), "r_ill_only": (1.878, 1.786, 1.057, 63.84),
                           "imma": (0.866, 0.889, 0.974, 63.57), "opt_kappa": (1.217, 0.798, 1.527, 63.65),
                           "ours": (2.386, 0.699, 3.467, 62.36)},
    ("vit", "cars"): {"init": (1.0, 1.0, 1.0, 81.78), "r_ill_only": (13.121, 4.097, 3.342, 82.21),
                      "imma": (1.422, 2.090, 0.702, 81.89), "opt_kappa": (3.598, 0.171, 26.369, 82.51),
                      "ours": (7.945, 0.323, 34.517, 82.79)},
    ("resnet18", "country211"): {"init": (1.0, 1.0, 1.0, 68.24), "r_ill_only": (20.727, 20.675, 1.038, 62.17),
                                 "imma": (0.791, 0.814, 0.972, 67.03),
                                 "opt_kappa": (1.538, 1.053, 1.472, 66.81),
                                 "ours": (3.287, 0.399, 8.714, 65.01)},
    ("vit", "country211"): {"init": (1.0, 1.0, 1.0, 81.78), "r_ill_only": (69.291, 63.519, 1.122, 80.73),
                            "imma": (6.242, 7.599, 0.845, 82.47), "opt_kappa": (4.589, 0.300, 16.498, 82.79),
                            "ours": (20.894, 0.700, 41.341, 83.17)},
}

METHOD_LABEL = {"init": "Init. θ₀", "r_ill_only": "R_ill only", "imma": "IMMA", "opt_kappa": "Opt κ",
                "ours": "Ours"}
ATTACKERS = {"gd": "linear probe, GD step 1/L (paper)", "adam": "linear probe, Adam (best lr)",
             "finetune": "fine-tune stage + new head, Adam"}


@dataclass
class RunConfig:
    """One experiment: backbone, data, immunization hyper-parameters and evaluation sizes."""

    name: str
    backbone: str
    data: str                                # "folders" | "mnist"
    paper_key: "tuple[str, str] | None" = None
    immunize: DeepImmunizeConfig = field(default_factory=DeepImmunizeConfig)
    methods: tuple[str, ...] = DEEP_METHODS
    scope: str = "tail"                      # what immunization trains: see ImmunizableModel.set_scope
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
    # attackers (beyond the paper): accuracy after these epochs
    attack_epochs: tuple[int, ...] = (1, 5, 20)
    adam_lrs: tuple[float, ...] = (1e-3, 1e-2, 1e-1)
    finetune_lr: float = 1e-4                # best of {1e-4, 3e-4, 1e-3} for the attacker on θ₀
                                             # (ResNet18, seed 0)
    finetune_pool: "int | None" = 256        # D_H training samples the fine-tuning attacker gets
    finetune_test: "int | None" = 500        # D_H test samples it is scored on


@dataclass
class RunOptions:
    """Run-time choices that are not hyper-parameters (paths, θ₀ source, distribution, output)."""

    out: Path = Path("results/deepnet")
    dp_root: "str | None" = None
    dh_root: "str | None" = None
    val_split: str = "val"
    checkpoint: "str | None" = None
    pretrained: bool = False
    cache_trunk: bool = False                # folder data: keep trunk outputs in memory
    virtual_ranks: int = 1
    quiet: bool = False
    save_extractors: bool = True             # first seed's extractors as safetensors
    out_dir: "Path | None" = None            # this configuration's folder (default: out/<config>)


def config_dir(rc: "RunConfig", opts: RunOptions) -> Path:
    """Where the outputs of ``rc`` go: ``opts.out_dir`` when the caller stages them (the CLI's
    atomic output set), else ``opts.out/<config name>``."""
    return Path(opts.out_dir) if opts.out_dir is not None else Path(opts.out) / rc.name


def _paper(method, lam_p, lam_h, epochs):
    return DeepImmunizeConfig(method=method, lr=1e-5, lambda_p=lam_p, lambda_h=lam_h, epochs=epochs)


# Paper-scale runs draw the 20 groups of 100 RIR samples from 2000 training images per task.
_PAPER_EVAL = {"rir_pool": 2000}

# One rule for every method of the CPU demo (no per-method λ): the immunization layer alone is
# trained (Algorithm 1 on the frozen backbone's features, preconditioned as in the paper's
# App. C.3), SGD Nesterov lr 0.1, 400 steps of 64 + 64 samples, and every regularizer term
# re-balanced at EVERY step to the gradient norm of the D_P loss (balance 1).
_DEMO_RULE = DeepImmunizeConfig(lr=0.1, balance=1.0, balance_every=1, epochs=100, max_steps=400,
                                batch_size=64)

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
    # CPU demo: MNIST 0-4 (D_P) vs 5-9 (D_H), 32 px.
    "demo-resnet18": RunConfig("demo-resnet18", "resnet18_32px", "mnist", None, _DEMO_RULE, scope="layer",
                               theta0_epochs=3, theta0_lr=2e-3, per_digit=250, rir_pool=500, probe_epochs=60),
    "demo-vit": RunConfig("demo-vit", "vit_tiny_32px", "mnist", None, _DEMO_RULE, scope="layer",
                          theta0_epochs=8, theta0_lr=3e-3, per_digit=250, rir_pool=500, probe_epochs=60),
    # CI size (tests): the demo's rule on a few hundred digits, a handful of steps.
    "ci": RunConfig("ci", "resnet18_32px", "mnist", None,
                    replace(_DEMO_RULE, epochs=1, max_steps=6, batch_size=16), scope="layer",
                    theta0_epochs=1, theta0_lr=2e-3, per_digit=40, rir_groups=4, rir_group_size=40,
                    probe_epochs=5, eval_batch=128, attack_epochs=(1, 2), adam_lrs=(1e-2,), finetune_pool=32),
    # The paper's layer choice (last two residual stages) at CI size: checks the tail path.
    "ci-tail": RunConfig("ci-tail", "resnet18_32px", "mnist", None,
                         DeepImmunizeConfig(lr=3e-5, balance=1.0, epochs=1, max_steps=3, batch_size=16),
                         theta0_epochs=1, theta0_lr=2e-3, per_digit=40, rir_groups=4, rir_group_size=40,
                         probe_epochs=5, eval_batch=128, attack_epochs=(1,), adam_lrs=(1e-2,),
                         finetune_pool=32),
}

DEMO_CONFIGS = ("demo-resnet18", "demo-vit")


# --- data -------------------------------------------------------------------------------------

def _load_data(rc: RunConfig, model, opts: RunOptions, rng):
    """Returns (p_train, p_val, h_train, h_test, n_classes_p, n_classes_h, cacheable)."""
    if rc.data == "mnist":
        mean, std = model_normalization(model)
        t = mnist_demo_tasks(rng, img_size=rc.img_size, per_digit=rc.per_digit, mean=mean, std=std)
        return t.p_train, t.p_val, t.h_train, t.h_test, t.num_classes_p, t.num_classes_h, True
    if not opts.dp_root or not opts.dh_root:
        raise DataError(f"config {rc.name} needs --dp-root and --dh-root (ImageFolder roots with "
                        f"train/ and {opts.val_split}/ splits)")
    tf = timm_transform(model, training=False)
    p_tr, p_va = image_folder(opts.dp_root, "train", tf), image_folder(opts.dp_root, opts.val_split, tf)
    h_tr, h_te = image_folder(opts.dh_root, "train", tf), image_folder(opts.dh_root, opts.val_split, tf)
    return p_tr, p_va, h_tr, h_te, len(p_tr.classes), len(h_tr.classes), opts.cache_trunk


def _subset(ds, n, rng):
    if n is None or n >= len(ds):
        return ds
    idx = np.sort(rng.choice(len(ds), size=n, replace=False))
    if isinstance(ds, TensorDataset):
        return TensorDataset(*(t[torch.from_numpy(idx)] for t in ds.tensors))
    return Subset(ds, idx.tolist())


def _labels(ds) -> np.ndarray:
    if isinstance(ds, TensorDataset):
        return ds.tensors[1].numpy()
    if hasattr(ds, "targets"):                       # ImageFolder: no need to decode images
        return np.asarray(ds.targets)
    if hasattr(ds, "indices") and hasattr(ds.dataset, "targets"):
        return np.asarray(ds.dataset.targets)[np.asarray(ds.indices)]
    return np.asarray([int(ds[i][1]) for i in range(len(ds))])


@torch.no_grad()
def _through_tail(model, ds: TensorDataset, batch: int) -> TensorDataset:
    """Cached stem outputs -> cached pooled features X (scope "layer"), one pass."""
    h = ds.tensors[0]
    out = [model._tail(h[s:s + batch]) for s in range(0, len(h), batch)]
    return TensorDataset(torch.cat(out), ds.tensors[1])


# --- one seed ---------------------------------------------------------------------------------

def _evaluate(model, ref_feats, ev, rc: RunConfig, seed: int, from_trunk: bool) -> tuple[dict, dict]:
    """D_P top-1, RIR_θ₀ against the frozen θ₀'s features, and the three attackers."""
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
    yt, yv, nch = ev["y"]["h_train"], ev["y"]["h_test"], ev["n_classes_h"]
    probe = linear_probe_curve(f["h_train"], yt, f["h_test"], yv,
                               epochs=max(rc.probe_epochs, *rc.attack_epochs), num_classes=nch)
    attacks = {"gd": probe.test_accuracy[:max(rc.attack_epochs) + 1]}
    if rc.adam_lrs:
        adam = best_adam_probe(f["h_train"], yt, f["h_test"], yv, epochs=max(rc.attack_epochs),
                               lrs=rc.adam_lrs, seed=seed, num_classes=nch)
        attacks["adam"] = adam["test_accuracy"]
        attacks["adam_best_lr"] = adam["best_lr"]
    if ev.get("stem") is not None:
        ft = finetune_attack(model, ev["stem"]["h_train"], ev["stem"]["h_test"], num_classes=nch,
                             epochs=max(rc.attack_epochs), lr=rc.finetune_lr, seed=seed,
                             eval_batch=rc.eval_batch, eval_epochs=rc.attack_epochs,
                             from_trunk=ev["stem"]["cached"])
        attacks["finetune"] = ft.test_accuracy
    curve = probe.test_accuracy[:rc.probe_epochs + 1]
    row = {"dp_top1": acc, "rir": rir, "probe": {"test_accuracy": curve, "step_size": probe.step_size},
           "probe_acc_epoch10": curve[min(10, len(curve) - 1)], "probe_acc_last": curve[-1],
           "attacks": attacks}
    return row, f


@dataclass
class SeedRun:
    """Everything one seed's methods share: θ₀ (frozen), cached data, evaluation sets, θ₀'s features."""

    rc: RunConfig
    seed: int
    reference: object
    data: dict
    ev: dict
    ref_feats: "dict | None"
    from_trunk: bool
    num_classes_p: int
    num_classes_h: int
    seconds: dict


def prepare_seed(rc: RunConfig, seed: int, opts: RunOptions, ctx) -> SeedRun:
    """θ₀ (trained, loaded or pretrained), its frozen copy, the cached trunk and the evaluation sets."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)  # nothing should draw from it; belt and braces for third-party code
    probe_model = build_model(rc.backbone, 1, seed=seed)  # only to resolve the model's normalisation
    p_tr, p_va, h_tr, h_te, ncp, nch, cacheable = _load_data(rc, probe_model, opts, rng)
    if rc.scope == "layer" and not cacheable:
        raise ValueError(f"config {rc.name}: scope 'layer' needs cached features (--cache-trunk)")
    theta0 = build_model(rc.backbone, ncp, pretrained=opts.pretrained, checkpoint=opts.checkpoint,
                         seed=seed).to(ctx.device)
    t = time.perf_counter()
    if rc.theta0_epochs and opts.checkpoint is None and not opts.pretrained:
        if ctx.is_main:
            train_classifier(theta0, p_tr, epochs=rc.theta0_epochs, lr=rc.theta0_lr, seed=seed,
                             device=ctx.device, progress=not opts.quiet)
        broadcast_module(theta0)
    seconds = {"theta0": time.perf_counter() - t}
    theta0.eval()
    reference = freeze_reference(theta0)          # the FROZEN copy RIR_θ₀ is measured against
    theta0.set_trainable()
    from_trunk = bool(cacheable)
    t = time.perf_counter()
    stem = None
    if from_trunk:
        stem = {k: cache_trunk(theta0, d, batch_size=rc.eval_batch, device=ctx.device)
                for k, d in (("p_train", p_tr), ("h_train", h_tr), ("p_val", p_va), ("h_test", h_te))}
        data = ({k: _through_tail(theta0, d, rc.eval_batch) for k, d in stem.items()} if rc.scope == "layer"
                else stem)
    else:
        data = {"p_train": p_tr, "h_train": h_tr, "p_val": p_va, "h_test": h_te}
    seconds["cache"] = time.perf_counter() - t
    reference.model.set_scope(rc.scope)

    ev_rng = np.random.default_rng([seed, 3])
    n_h_pool = len(data["h_train"]) if rc.rir_pool is None else min(rc.rir_pool, len(data["h_train"]))
    ev = {"sets": {"p_pool": _subset(data["p_train"], rc.rir_pool, ev_rng), "p_val": data["p_val"],
                   "h_train": data["h_train"], "h_test": data["h_test"]},
          "h_pool_idx": np.sort(ev_rng.choice(len(data["h_train"]), size=n_h_pool, replace=False)),
          "n_classes_h": nch}
    ev["y"] = {k: _labels(ev["sets"][k]) for k in ("p_val", "h_train", "h_test")}
    attack_src = stem or {"h_train": h_tr, "h_test": h_te}
    ev["stem"] = {"h_train": _subset(attack_src["h_train"], rc.finetune_pool,
                                     np.random.default_rng([seed, 5])),
                  "h_test": _subset(attack_src["h_test"], rc.finetune_test, np.random.default_rng([seed, 6])),
                  "cached": from_trunk}
    ref_feats = None
    if ctx.is_main:
        reference.verify()
        ref_feats = {k: extract_features(reference.model, ds, batch_size=rc.eval_batch, from_trunk=from_trunk)
                     for k, ds in ev["sets"].items()}
    return SeedRun(rc, seed, reference, data, ev, ref_feats, from_trunk, ncp, nch, seconds)


def immunize_and_evaluate(sr: SeedRun, cfg: DeepImmunizeConfig, opts: RunOptions, ctx, *,
                          attacks: bool = True, save_as: "Path | None" = None) -> "dict | None":
    """Immunize a deep copy of θ₀ with ``cfg`` and measure it (rank 0 returns the row).

    Raises :class:`NonFiniteLossError` when the immunization diverges."""
    rc = sr.rc if attacks else replace(sr.rc, adam_lrs=(), finetune_pool=None)
    model = copy.deepcopy(sr.reference.model)
    res = immunize(model, sr.data["p_train"], sr.data["h_train"], cfg, num_classes_h=sr.num_classes_h,
                   from_trunk=sr.from_trunk, device=ctx.device, rank=ctx.rank, world=ctx.world,
                   ddp=ctx.distributed)
    if not ctx.is_main:
        return None
    ev = sr.ev if attacks else {**sr.ev, "stem": None}
    row, _ = _evaluate(model, sr.ref_feats, ev, rc, sr.seed, sr.from_trunk)
    row["train"] = {"steps": res.steps, "wall_seconds": res.wall_seconds, "lambdas": res.lambdas,
                    "mean_step_seconds": float(np.mean(res.history["step_seconds"])),
                    "final": {k: v[-1] for k, v in res.history.items() if v}}
    if save_as is not None:
        row["extractor"] = save_immunized(model, save_as, sr.num_classes_p,
                                          extra={"config": rc.name, "method": cfg.method, "seed": sr.seed})
    return row


def run_seed(rc: RunConfig, seed: int, opts: RunOptions, ctx, say=print, *,
             save_extractors: bool = False) -> "dict | None":
    """θ₀, every method and every measurement for one seed; rank 0 returns the rows."""
    out = config_dir(rc, opts)
    sr = prepare_seed(rc, seed, opts, ctx)
    rows, errors = {}, {}
    if ctx.is_main:
        rows["init"], _ = _evaluate(sr.reference.model, sr.ref_feats, sr.ev, rc, seed, sr.from_trunk)
        rows["init"]["train"] = {"theta0_seconds": sr.seconds["theta0"], "cache_seconds": sr.seconds["cache"]}
        say(f"[{rc.name} seed {seed}] θ₀ ({sr.seconds['theta0']:.1f}s): "
            f"D_P top-1 {rows['init']['dp_top1']:.2f}%  "
            f"probe acc@10 {rows['init']['probe_acc_epoch10']:.1f}", flush=True)
    for method in rc.methods:
        cfg = replace(rc.immunize, method=method, seed=seed, virtual_ranks=opts.virtual_ranks,
                      checkpoint_dir=str(out), progress=not opts.quiet)
        save_as = out / f"extractor_{method}.safetensors" if save_extractors else None
        try:
            row = immunize_and_evaluate(sr, cfg, opts, ctx, save_as=save_as)
        except NonFiniteLossError as exc:
            say(f"[{rc.name} seed {seed}] {exc}", flush=True)
            errors[method] = {"message": str(exc), "step": exc.step, "checkpoint": exc.checkpoint}
            continue
        if row is None:
            continue
        rows[method] = row
        r = row["rir"]
        say(f"[{rc.name} seed {seed}] {method:10s} RIR_θ₀ {pm(r['value'])}  "
            f"(i) {fmt(r['harmful_ratio']['mean'])}"
            f"  (ii) {fmt(r['pretrain_ratio']['mean'])}  D_P top-1 {row['dp_top1']:.2f}%  probe acc@10 "
            f"{row['probe_acc_epoch10']:.1f}  [{row['train']['steps']} steps, "
            f"{row['train']['wall_seconds']:.1f}s]",
            flush=True)
    barrier()
    return {"seed": seed, "rows": rows, "errors": errors} if ctx.is_main else None


# --- over seeds -------------------------------------------------------------------------------

def _curve_summary(curves: list[list[float]]) -> dict:
    a = np.asarray(curves, dtype=float)
    return {"mean": a.mean(0).tolist(), "std": a.std(0).tolist(), "min": a.min(0).tolist(),
            "max": a.max(0).tolist()}


def aggregate(per_seed: list[dict], rc: RunConfig) -> dict:
    """``rows.<method>``: every headline number as ``{mean, std, per_seed}`` (population std)."""
    methods = ["init"] + [m for m in rc.methods]
    rows = {}
    for m in methods:
        runs = [s["rows"][m] for s in per_seed if m in s["rows"]]
        if not runs:
            continue
        row = {
            "seeds": [s["seed"] for s in per_seed if m in s["rows"]],
            "rir_theta0": summarize(r["rir"]["value"]["mean"] for r in runs),
            "harmful_ratio": summarize(r["rir"]["harmful_ratio"]["mean"] for r in runs),
            "pretrain_ratio": summarize(r["rir"]["pretrain_ratio"]["mean"] for r in runs),
            "dp_top1": summarize(r["dp_top1"] for r in runs),
            "probe_acc_epoch10": summarize(r["probe_acc_epoch10"] for r in runs),
            "probe_acc_last": summarize(r["probe_acc_last"] for r in runs),
            "success": sum(r["rir"]["harmful_ratio"]["mean"] > 1 and r["rir"]["pretrain_ratio"]["mean"] < 1
                           for r in runs),
            "probe_curve": _curve_summary([r["probe"]["test_accuracy"] for r in runs]),
            "attacks": {},
        }
        for a in ATTACKERS:
            if all(a in r["attacks"] for r in runs):
                curves = [r["attacks"][a] for r in runs]
                row["attacks"][a] = {"curve": _curve_summary(curves),
                                     **{f"epoch{e}": summarize(c[e] for c in curves)
                                        for e in rc.attack_epochs}}
        rows[m] = row
    return rows


def run_config(rc: RunConfig, seeds: list[int], opts: RunOptions, ctx, relocate=None) -> "dict | None":
    """Every seed of ``rc``; rank 0 writes results.json, table.md, finetune.png, attacks.png.

    ``relocate`` (optional) maps the result before it is written, e.g. the CLI's rewriting of
    paths inside its staging folder to the final one."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    t_start = time.perf_counter()
    say = print if ctx.is_main else (lambda *a, **k: None)
    say(f"[{rc.name}] backbone={rc.backbone} scope={rc.scope} seeds={seeds} world={ctx.world} "
        f"threads={torch.get_num_threads()} device={ctx.device}", flush=True)
    per_seed = [run_seed(rc, s, opts, ctx, say, save_extractors=opts.save_extractors and i == 0)
                for i, s in enumerate(seeds)]
    if not ctx.is_main:
        return None
    out = config_dir(rc, opts)
    result = {
        "config": rc.name, "backbone": rc.backbone, "scope": rc.scope, "seeds": list(seeds),
        "threads": torch.get_num_threads(), "world_size": ctx.world, "virtual_ranks": opts.virtual_ranks,
        "run_config": _jsonable(asdict(rc)),
        "rows": aggregate(per_seed, rc), "per_seed": per_seed,
        "errors": {f"seed{s['seed']}": s["errors"] for s in per_seed if s["errors"]},
        "wall_seconds": time.perf_counter() - t_start,
        "environment": environment(),
        "notes": {
            "rir": "RIR_θ₀ = [κ(H̃_H(θ_I))/κ(H̃_H(θ₀))]/[κ(H̃_P(θ_I))/κ(H̃_P(θ₀))] on extracted features "
                   f"against a frozen copy of θ₀, per seed the mean over {rc.rir_groups} groups of "
                   f"{rc.rir_group_size} samples (κ over the nonzero spectrum, float64); "
                   "rows: mean ± std over seeds",
            "probe": "full-batch GD on softmax CE, step 1/λ_max(AᵀA/N), zero init; test accuracy per epoch",
            "attacks": {**ATTACKERS, "adam_lrs": list(rc.adam_lrs), "finetune_lr": rc.finetune_lr,
                        "finetune_pool": rc.finetune_pool},
        },
    }
    if relocate is not None:
        result = relocate(result)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    (out / "table.md").write_text(table_markdown(result, rc))
    plot_probing(result, out / "finetune.png")
    if any(r["attacks"] for r in result["rows"].values()):
        plot_attacks(result, rc, out / "attacks.png")
    say(f"[{rc.name}] wrote {out}/results.json, table.md, finetune.png ({result['wall_seconds']:.1f}s)",
        flush=True)
    return result


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    return o


# --- outputs ----------------------------------------------------------------------------------

def table_markdown(result: dict, rc: RunConfig) -> str:
    rows, seeds = result["rows"], result["seeds"]
    gs = next((s["rows"][m]["rir"]["group_size"] for s in result["per_seed"] for m in s["rows"]),
              rc.rir_group_size)
    lines = [f"# Deep-net immunization: {rc.name} (backbone {rc.backbone}, immunized: {rc.scope}, "
             f"seeds {seeds}, {result['threads']} threads)", "",
             f"Mean ± std over {len(seeds)} seed(s); per seed, RIR_θ₀ against a frozen copy of θ₀ is "
             f"the mean over {rc.rir_groups} groups of {gs} samples. D_P top-1 on the D_P validation split. "
             "Success: "
             "seeds with (i) > 1 and (ii) < 1 (Definition 3.1).", "",
             "| method | (i) κ ratio on D_H ↑ | (ii) κ ratio on D_P ↓ | RIR_θ₀ ↑ | success | D_P top-1 % | "
             f"probe acc. on D_H, epoch 10 ↓ | epoch {rc.probe_epochs} ↓ |"
             + (" paper RIR_θ₀ | paper D_P % |" if rc.paper_key else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if rc.paper_key else "")]
    paper = PAPER_TABLE3.get(rc.paper_key, {}) if rc.paper_key else {}
    for m in ("init",) + tuple(rc.methods):
        if m not in rows:
            fails = [f"seed {k[4:]}: {v[m]['message']}" for k, v in result["errors"].items() if m in v]
            if fails:
                lines.append(f"| {METHOD_LABEL[m]} | failed: {'; '.join(fails)} |")
            continue
        r = rows[m]
        line = (f"| {METHOD_LABEL[m]} | {pm(r['harmful_ratio'])} | {pm(r['pretrain_ratio'])} | "
                f"{pm(r['rir_theta0'])} | "
                f"{r['success']}/{len(r['seeds'])} | {pm(r['dp_top1'])} | {pm(r['probe_acc_epoch10'])} | "
                f"{pm(r['probe_acc_last'])} |")
        if rc.paper_key:
            p = paper.get(m)
            line += f" {p[2]} | {p[3]} |" if p else " | |"
        lines.append(line)
    attackers = [a for a in ATTACKERS if any(a in r["attacks"] for r in rows.values())]
    if attackers:
        lines += ["", "D_H test accuracy (%) reached by each attacker after 1 / 5 / 20 epochs "
                  "(↓ = immunized; mean ± std over seeds):" if tuple(rc.attack_epochs) == (1, 5, 20) else
                  f"D_H test accuracy (%) after {' / '.join(map(str, rc.attack_epochs))} epochs:", "",
                  "| method | " + " | ".join(f"{ATTACKERS[a]}, epoch {e}"
                                            for a in attackers for e in rc.attack_epochs) + " |",
                  "|---|" + "---|" * (len(attackers) * len(rc.attack_epochs))]
        for m in ("init",) + tuple(rc.methods):
            if m in rows:
                cells = [pm(rows[m]["attacks"][a][f"epoch{e}"], 3)
                         for a in attackers for e in rc.attack_epochs]
                lines.append(f"| {METHOD_LABEL[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _style(m):
    return {"lw": 2.2 if m in ("ours", "init") else 1.3, "ls": "--" if m == "init" else "-"}


def plot_probing(result: dict, path: Path) -> None:
    """Figure 3: seed-mean D_H test accuracy of the paper's probe per epoch, band = min..max over seeds."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(5.8, 4.0))
    for m, r in result["rows"].items():
        c = r["probe_curve"]
        x = range(len(c["mean"]))
        line, = ax.plot(x, c["mean"], label=METHOD_LABEL.get(m, m), **_style(m))
        if len(r["seeds"]) > 1:
            ax.fill_between(x, c["min"], c["max"], color=line.get_color(), alpha=0.15, lw=0)
    ax.set_xlabel("linear-probing epoch (full-batch GD, step 1/L)")
    ax.set_ylabel("D_H test accuracy (%)  ↓ better")
    ax.set_title(f"Linear probing on D_H: {result['config']} ({len(result['seeds'])} seeds, band min–max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_attacks(result: dict, rc: RunConfig, path: Path) -> None:
    """One panel per attacker: seed-mean D_H test accuracy per epoch, band = min..max over seeds."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    attackers = [a for a in ATTACKERS if any(a in r["attacks"] for r in result["rows"].values())]
    fig, axes = plt.subplots(1, len(attackers), figsize=(4.4 * len(attackers), 3.8), squeeze=False)
    for ax, a in zip(axes[0], attackers):
        for m, r in result["rows"].items():
            if a not in r["attacks"]:
                continue
            c = {k: np.asarray(v, dtype=float) for k, v in r["attacks"][a]["curve"].items()}
            x = np.flatnonzero(np.isfinite(c["mean"]))  # the fine-tuning attacker is scored at a few epochs
            line, = ax.plot(x, c["mean"][x], label=METHOD_LABEL.get(m, m), marker="o" if len(x) < 8 else None,
                            ms=3, **_style(m))
            if len(r["seeds"]) > 1:
                ax.fill_between(x, c["min"][x], c["max"][x], color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(ATTACKERS[a], fontsize=9)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("D_H test accuracy (%)  ↓ better")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Attackers on D_H: {result['config']}", fontsize=10)
    save_figure(fig, path)


# --- trade-off sweep --------------------------------------------------------------------------

def balance_sweep(rc: RunConfig, balances: list[float], seeds: list[int], opts: RunOptions, ctx,
                  methods: "tuple[str, ...] | None" = None) -> "dict | None":
    """RIR_θ₀, (i), (ii), D_P top-1 and the paper's probe against the balance ``b`` that sets every
    regularizer's λ (λ = b·‖∇CE‖/‖∇term‖): the trade-off behind one configuration's numbers.
    θ₀ and the caches are made once per seed; the attackers other than the paper's are skipped.
    Writes ``balance_sweep.json`` and ``balance_sweep.png`` next to the configuration's results."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    methods = tuple(methods or rc.methods)
    say = print if ctx.is_main else (lambda *a, **k: None)
    runs: dict = {m: {str(b): [] for b in balances} for m in methods}
    t0 = time.perf_counter()
    for seed in seeds:
        sr = prepare_seed(rc, seed, opts, ctx)
        init, _ = _evaluate(sr.reference.model, sr.ref_feats, {**sr.ev, "stem": None},
                            replace(rc, adam_lrs=()), seed, sr.from_trunk) if ctx.is_main else (None, None)
        for m in methods:
            for b in balances:
                cfg = replace(rc.immunize, method=m, seed=seed, balance=b, progress=False,
                              virtual_ranks=opts.virtual_ranks)
                try:
                    row = immunize_and_evaluate(sr, cfg, opts, ctx, attacks=False)
                except NonFiniteLossError as exc:
                    row = {"error": str(exc)}
                if ctx.is_main:
                    row = row if "error" in row else {
                        "rir_theta0": row["rir"]["value"]["mean"],
                        "harmful_ratio": row["rir"]["harmful_ratio"]["mean"],
                        "pretrain_ratio": row["rir"]["pretrain_ratio"]["mean"], "dp_top1": row["dp_top1"],
                        "probe_acc_epoch10": row["probe_acc_epoch10"], "theta0_dp_top1": init["dp_top1"],
                        "theta0_probe_acc_epoch10": init["probe_acc_epoch10"]}
                    runs[m][str(b)].append({"seed": seed, **row})
                    say(f"[{rc.name} sweep seed {seed}] {m} b={b}: {row}", flush=True)
    if not ctx.is_main:
        return None
    result = {"config": rc.name, "seeds": list(seeds), "balances": list(balances), "methods": list(methods),
              "threads": torch.get_num_threads(), "runs": runs, "wall_seconds": time.perf_counter() - t0,
              "rule": _jsonable(asdict(rc.immunize)), "environment": environment()}
    out = config_dir(rc, opts)
    write_json(out / "balance_sweep.json", result)
    plot_balance_sweep(result, out / "balance_sweep.png")
    return result


def plot_balance_sweep(result: dict, path: Path) -> None:
    """Seed-mean RIR_θ₀, D_P top-1 and probe accuracy at epoch 10 against the balance b."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    keys = (("rir_theta0", "RIR_θ₀ ↑", False), ("dp_top1", "D_P top-1 % (θ₀ dashed)", False),
            ("probe_acc_epoch10", "D_H probe acc. @10 % ↓ (θ₀ dashed)", False))
    theta0 = {}
    for m, by_b in result["runs"].items():
        bs = [float(b) for b in by_b if by_b[b] and all("error" not in r for r in by_b[b])]
        for ax, (k, label, log) in zip(axes, keys):
            ys = [np.mean([r[k] for r in by_b[str(b) if str(b) in by_b else b]]) for b in bs]
            ax.plot(bs, ys, marker="o", label=METHOD_LABEL.get(m, m), **_style(m))
            ax.set_xscale("log")
            if log:
                ax.set_yscale("log")
            ax.set_xticks(bs, [f"{b:g}" for b in bs])
            ax.minorticks_off()
            ax.set_xlabel("balance b (λ = b·‖∇CE‖/‖∇term‖, every step)")
            ax.set_title(label, fontsize=9)
            ax.grid(alpha=0.3)
        for r in (r for v in by_b.values() for r in v if "error" not in r):
            theta0 = {"dp_top1": r["theta0_dp_top1"], "probe_acc_epoch10": r["theta0_probe_acc_epoch10"]}
    for ax, (k, _, _) in zip(axes, keys):
        if k in theta0:
            ax.axhline(theta0[k], color="k", ls="--", lw=1)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Trade-off against the balance: {result['config']} ({len(result['seeds'])} seed(s))",
                 fontsize=10)
    save_figure(fig, path)
