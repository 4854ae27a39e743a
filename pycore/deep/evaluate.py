"""The deep-net evaluation pipeline (docs/theory.md §8-10; paper §5.2, Table 3, Figure 3).

Per seed: make θ₀ (train it on D_P for the demo, or load it), freeze a copy as the RIR_θ₀
reference, cache the frozen trunk once, immunize a deep copy of θ₀ with every method, and
measure each extractor (θ₀ included): D_P top-1, RIR_θ₀ with its factors (i) and (ii),
Definition 3.1, and how fast the attackers of :mod:`pycore.deep.attacks` learn D_H from its
features. With a hardening (``DeepImmunizeConfig.harden``, :mod:`pycore.deep.harden`) every
extractor, θ₀ included, is also measured hardened, as the row ``"<method>+<hardening>"``: one
rule for every method. Over seeds: mean ± std of every number (:func:`aggregate`).

This module computes and returns results; it writes no file. Named configurations, tables,
figures and outputs are the experiment layer's (``experiments/deep_configs.py``,
``experiments/deep_report.py``, ``experiments/deepnet.py``). A caller that wants the
extractors passes ``on_extractor`` (called with each immunized model, and with the last good
model of a run that stopped on a non-finite loss).

Reproducibility: everything random is seeded from the run's seed (data split, θ₀'s init and
its batches, the immunization batches, RIR groups, attackers, hardening rotations), and
:func:`run_config` turns on ``torch.use_deterministic_algorithms``; the same seed and thread
count give the same digits (the thread count changes float reduction order, so it is recorded).
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from pycore.deep.attacks import ADAM_LRS, best_adam_probe, finetune_attack, linear_probe_curve
from pycore.deep.data import (
    DataError, dataset_labels, image_folder, mnist_demo_tasks, timm_transform,
)
from pycore.deep.distributed import barrier, broadcast_module
from pycore.deep.feature_metrics import extract_features, freeze_reference
from pycore.deep.harden import harden
from pycore.deep.models import build_model
from pycore.deep.objectives import DEEP_METHODS
from pycore.deep.train import DeepImmunizeConfig, NonFiniteLossError, cache_trunk, immunize, train_classifier
from pycore.evaluate import immunized_def31
from pycore.metrics import grouped_feature_rir
from pycore.report import environment, summarize
from pycore.spectral import gram_spectrum

__all__ = ["RunConfig", "RunOptions", "SeedRun", "ATTACKERS", "ExtractorHook", "run_config", "run_seed",
           "prepare_seed", "evaluate_extractor", "immunize_and_evaluate", "aggregate", "tradeoff_sweep",
           "hardened_key", "audit", "spectrum_spread"]

# The attackers measured per extractor (pycore.deep.attacks); their labels are the report's.
ATTACKERS = ("gd", "adam", "adam_whitened", "finetune")


@dataclass
class RunConfig:
    """One experiment: backbone, data, immunization hyper-parameters and evaluation sizes."""

    name: str
    backbone: str
    data: str                                # "folders" | "mnist"
    immunize: DeepImmunizeConfig = field(default_factory=DeepImmunizeConfig)
    methods: tuple[str, ...] = DEEP_METHODS
    scope: str = "tail"                      # what immunization trains: see ImmunizableModel.set_scope
    # θ₀ (demo: trained here on D_P)
    theta0_epochs: int = 0
    theta0_lr: float = 1e-3
    theta0_shift: int = 0                    # θ₀ training: random translations of up to this many pixels
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
    adam_lrs: tuple[float, ...] = ADAM_LRS   # empty: no Adam attackers
    finetune_lr: float = 1e-4                # best of {1e-4, 3e-4, 1e-3} for the attacker on θ₀
                                             # (ResNet18, seed 0)
    finetune_pool: "int | None" = 256        # D_H training samples the fine-tuning attacker gets
    finetune_test: "int | None" = 500        # D_H test samples it is scored on
    finetune: bool = True                    # False: skip the fine-tuning attacker


@dataclass
class RunOptions:
    """Run-time choices that are not hyper-parameters (data roots, θ₀ source, distribution)."""

    dp_root: "str | None" = None
    dh_root: "str | None" = None
    val_split: str = "val"
    checkpoint: "str | None" = None
    pretrained: bool = False
    cache_trunk: bool = False                # folder data: keep trunk outputs in memory
    virtual_ranks: int = 1
    quiet: bool = False


# on_extractor(model, variant, seed, status) -> a path (recorded in the row) or None.
# ``variant`` is a row key ("init" is θ₀, a method, or "<row>+<hardening>"); ``status`` is "immunized" or
# "last_good" (a run stopped on a non-finite loss; the model keeps its last good step).
ExtractorHook = Callable[[object, str, int, str], "str | None"]


def hardened_key(variant: str, kind: str) -> str:
    """The row key of ``variant`` hardened with ``kind`` (e.g. ``"ours+label_subspace"``)."""
    return f"{variant}+{kind}"


# --- data -------------------------------------------------------------------------------------

def _load_data(rc: RunConfig, model, opts: RunOptions, rng):
    """Returns (p_train, p_val, h_train, h_test, n_classes_p, n_classes_h, cacheable)."""
    if rc.data == "mnist":
        t = mnist_demo_tasks(rng, img_size=rc.img_size, per_digit=rc.per_digit, model=model)
        return t.p_train, t.p_val, t.h_train, t.h_test, t.num_classes_p, t.num_classes_h, True
    if not opts.dp_root or not opts.dh_root:
        raise DataError(f"config {rc.name} needs --dp-root and --dh-root (ImageFolder roots with "
                        f"train/ and {opts.val_split}/ splits)")
    tf = timm_transform(model, training=False)
    p_tr, p_va = image_folder(opts.dp_root, "train", tf), image_folder(opts.dp_root, opts.val_split, tf)
    h_tr, h_te = image_folder(opts.dh_root, "train", tf), image_folder(opts.dh_root, opts.val_split, tf)
    for root, tr, va in ((opts.dp_root, p_tr, p_va), (opts.dh_root, h_tr, h_te)):
        if list(tr.classes) != list(va.classes):
            raise DataError(f"{root}: the train/ and {opts.val_split}/ splits have different classes "
                            f"({len(tr.classes)} vs {len(va.classes)})")
    return p_tr, p_va, h_tr, h_te, len(p_tr.classes), len(h_tr.classes), opts.cache_trunk


def _subset(ds, n, rng):
    if n is None or n >= len(ds):
        return ds
    idx = np.sort(rng.choice(len(ds), size=n, replace=False))
    if isinstance(ds, TensorDataset):
        return TensorDataset(*(t[torch.from_numpy(idx)] for t in ds.tensors))
    return Subset(ds, idx.tolist())


@torch.no_grad()
def _through_tail(model, ds: TensorDataset, batch: int) -> TensorDataset:
    """Cached stem outputs -> cached pooled features X (scope "layer"), one pass."""
    h = ds.tensors[0]
    out = [model._tail(h[s:s + batch]) for s in range(0, len(h), batch)]
    return TensorDataset(torch.cat(out), ds.tensors[1])


# --- measuring one extractor ------------------------------------------------------------------

def spectrum_spread(Z: np.ndarray, Z_ref: np.ndarray, *, rng: np.random.Generator, groups: int,
                    group_size: int) -> dict:
    """Where a κ ratio comes from: per random group of rows (the same rows of both), the top and
    the bottom of the nonzero spectrum of ``ZᵀZ`` relative to its MEDIAN eigenvalue, divided by
    the same for ``Z_ref``; geometric means over groups. ``top / bottom`` is then the κ ratio of
    the groups (its geometric mean), scale cannot enter, and a few extreme eigenvalues do not move
    the median: ``top > 1`` means the largest eigenvalue rose above the bulk of the spectrum,
    ``bottom < 1`` that the smallest fell below it."""
    n = Z.shape[0]
    m = min(group_size, n)
    logs = np.zeros((groups, 2))
    for g in range(groups):
        idx = rng.choice(n, size=m, replace=False)
        a, b = gram_spectrum(Z[idx], vectors=False), gram_spectrum(Z_ref[idx], vectors=False)
        ma, mb = np.median(a.sigma[:a.rank]), np.median(b.sigma[:b.rank])
        logs[g] = (np.log(a.sigma_max / ma) - np.log(b.sigma_max / mb),
                   np.log(a.sigma_min / ma) - np.log(b.sigma_min / mb))
    top, bottom = np.exp(logs.mean(0))
    return {"top": float(top), "bottom": float(bottom), "groups": groups, "group_size": m}


class _Clock:
    """Wall and CPU seconds per phase (the CPU time of every thread of this process)."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = {}

    def __call__(self, phase: str):
        clock = self

        class _Phase:
            def __enter__(self):
                self.t, self.c = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                s = clock.seconds.setdefault(phase, {"wall": 0.0, "cpu": 0.0})
                s["wall"] += time.perf_counter() - self.t
                s["cpu"] += time.process_time() - self.c
                return False
        return _Phase()


def evaluate_extractor(model, ref_feats: dict, ev: dict, rc: RunConfig, seed: int, from_trunk: bool,
                       clock: "_Clock | None" = None) -> dict:
    """D_P top-1, RIR_θ₀ against the frozen θ₀'s features, Definition 3.1, and the attackers."""
    clock = clock or _Clock()
    with clock("features_rir"):
        f = {k: extract_features(model, ds, batch_size=rc.eval_batch, from_trunk=from_trunk)
             for k, ds in ev["sets"].items()}
        with torch.no_grad():
            dev = next(model.parameters()).device
            head = model.classifier
            logits = head(torch.from_numpy(f["p_val"]).to(dev, head.weight.dtype)).cpu()
        acc = 100.0 * float((logits.argmax(1).numpy() == ev["y"]["p_val"]).mean())
        hp = ev["h_pool_idx"]  # the D_H RIR pool is a subset of the probe's D_H training rows
        rir = grouped_feature_rir(f["p_pool"], f["h_train"][hp], ref_feats["p_pool"],
                                  ref_feats["h_train"][hp], rng=np.random.default_rng([seed, 17]),
                                  groups=rc.rir_groups, group_size=rc.rir_group_size)
        # (i) decomposed on D_H groups of the same size (its own groups: a diagnostic)
        spread = spectrum_spread(f["h_train"][hp], ref_feats["h_train"][hp],
                                 rng=np.random.default_rng([seed, 18]), groups=rc.rir_groups,
                                 group_size=rc.rir_group_size)
    yt, yv, nch = ev["y"]["h_train"], ev["y"]["h_test"], ev["n_classes_h"]
    last = max(rc.attack_epochs)
    with clock("gd_probe"):
        probe = linear_probe_curve(f["h_train"], yt, f["h_test"], yv, epochs=max(rc.probe_epochs, last),
                                   num_classes=nch)
    attacks = {"gd": probe.test_accuracy[:last + 1]}
    if rc.adam_lrs:
        with clock("adam_probe"):
            adam = best_adam_probe(f["h_train"], yt, f["h_test"], yv, epochs=last, lrs=rc.adam_lrs,
                                   seed=seed, num_classes=nch)
            attacks["adam"] = adam["test_accuracy"]
            attacks["adam_best"] = adam["best"]
        with clock("adam_whitened"):
            white = best_adam_probe(f["h_train"], yt, f["h_test"], yv, epochs=last, lrs=rc.adam_lrs,
                                    preprocessing=("whiten",), seed=seed, num_classes=nch)
            attacks["adam_whitened"] = white["test_accuracy"]
            attacks["adam_whitened_best"] = white["best"]
    if rc.finetune and ev.get("stem") is not None:
        with clock("finetune"):
            ft = finetune_attack(model, ev["stem"]["h_train"], ev["stem"]["h_test"], num_classes=nch,
                                 epochs=last, lr=rc.finetune_lr, seed=seed, eval_batch=rc.eval_batch,
                                 eval_epochs=rc.attack_epochs, from_trunk=ev["stem"]["cached"])
            attacks["finetune"] = ft.test_accuracy
    curve = probe.test_accuracy[:rc.probe_epochs + 1]
    i, ii = rir["harmful_ratio"]["mean"], rir["pretrain_ratio"]["mean"]
    return {"dp_top1": acc, "rir": rir, "immunized": immunized_def31(i, ii), "harmful_spread": spread,
            "probe": {"test_accuracy": curve, "step_size": probe.step_size},
            "probe_acc_epoch10": curve[min(10, len(curve) - 1)], "probe_acc_last": curve[-1],
            "attacks": attacks}


# --- one seed ---------------------------------------------------------------------------------

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
    clock: _Clock


def prepare_seed(rc: RunConfig, seed: int, opts: RunOptions, ctx) -> SeedRun:
    """θ₀ (trained, loaded or pretrained), its frozen copy, the cached trunk and the evaluation sets."""
    clock = _Clock()
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)  # nothing should draw from it; belt and braces for third-party code
    probe_model = build_model(rc.backbone, 1, seed=seed)  # only to resolve the model's normalisation
    p_tr, p_va, h_tr, h_te, ncp, nch, cacheable = _load_data(rc, probe_model, opts, rng)
    if rc.scope == "layer" and not cacheable:
        raise ValueError(f"config {rc.name}: scope 'layer' needs cached features (--cache-trunk)")
    theta0 = build_model(rc.backbone, ncp, pretrained=opts.pretrained, checkpoint=opts.checkpoint,
                         seed=seed).to(ctx.device)
    with clock("theta0"):
        if rc.theta0_epochs and opts.checkpoint is None and not opts.pretrained:
            if ctx.is_main:
                train_classifier(theta0, p_tr, epochs=rc.theta0_epochs, lr=rc.theta0_lr, seed=seed,
                                 device=ctx.device, progress=not opts.quiet, max_shift=rc.theta0_shift)
            broadcast_module(theta0)
    theta0.eval()
    reference = freeze_reference(theta0)          # the FROZEN copy RIR_θ₀ is measured against
    theta0.set_trainable()
    from_trunk = bool(cacheable)
    stem = None
    with clock("cache"):
        if from_trunk:
            stem = {k: cache_trunk(theta0, d, batch_size=rc.eval_batch, device=ctx.device)
                    for k, d in (("p_train", p_tr), ("h_train", h_tr), ("p_val", p_va), ("h_test", h_te))}
            data = ({k: _through_tail(theta0, d, rc.eval_batch) for k, d in stem.items()}
                    if rc.scope == "layer" else stem)
        else:
            data = {"p_train": p_tr, "h_train": h_tr, "p_val": p_va, "h_test": h_te}
    reference.model.set_scope(rc.scope)

    ev = _eval_sets(data, stem or {"h_train": h_tr, "h_test": h_te}, from_trunk, rc, seed, nch)
    ref_feats = None
    if ctx.is_main:
        reference.verify()
        with clock("features_rir"):
            ref_feats = {k: extract_features(reference.model, ds, batch_size=rc.eval_batch,
                                             from_trunk=from_trunk) for k, ds in ev["sets"].items()}
    return SeedRun(rc, seed, reference, data, ev, ref_feats, from_trunk, ncp, nch, clock)


def _eval_sets(data: dict, attack_src: dict, from_trunk: bool, rc: RunConfig, seed: int, nch: int) -> dict:
    """The evaluation sets of one seed: the RIR pools (D_P training samples; D_H indices into the
    probe's training rows), D_P validation, D_H train/test with labels, and the fine-tuning
    attacker's D_H subsets of ``attack_src`` (stem outputs when ``from_trunk``, else images)."""
    ev_rng = np.random.default_rng([seed, 3])
    n_h_pool = len(data["h_train"]) if rc.rir_pool is None else min(rc.rir_pool, len(data["h_train"]))
    ev = {"sets": {"p_pool": _subset(data["p_train"], rc.rir_pool, ev_rng), "p_val": data["p_val"],
                   "h_train": data["h_train"], "h_test": data["h_test"]},
          "h_pool_idx": np.sort(ev_rng.choice(len(data["h_train"]), size=n_h_pool, replace=False)),
          "n_classes_h": nch}
    ev["y"] = {k: dataset_labels(ev["sets"][k]) for k in ("p_val", "h_train", "h_test")}
    ev["stem"] = {"h_train": _subset(attack_src["h_train"], rc.finetune_pool,
                                     np.random.default_rng([seed, 5])),
                  "h_test": _subset(attack_src["h_test"], rc.finetune_test, np.random.default_rng([seed, 6])),
                  "cached": from_trunk}
    return ev


def audit(model, reference, data: dict, rc: RunConfig, seeds: list[int], *, num_classes_h: int,
          say=None) -> dict:
    """Measure any extractor ``model`` against a reference θ₀ ``reference`` (both
    :class:`~pycore.deep.models.ImmunizableModel`, e.g. from
    :func:`~pycore.deep.models.load_extractor`) on the image datasets ``data`` (``p_train``,
    ``p_val``, ``h_train``, ``h_test``, normalised for these models): D_P top-1, RIR_θ₀ with (i)
    and (ii), Definition 3.1 and every attacker, per seed (the seed draws the RIR groups, the
    attackers' subsets and batches). Each model runs its own network end to end (nothing is
    shared, so a defense that changed the whole backbone is measured as it is). Returns the
    shape of :func:`run_config`'s result with the rows ``"init"`` (the reference) and ``"model"``."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    say = say or (lambda *a, **k: None)
    t0 = time.perf_counter()
    ref = freeze_reference(reference.set_scope("tail"))
    model = model.set_scope("tail").eval()
    rc = replace(rc, methods=("model",))
    per_seed = []
    for seed in seeds:
        clock = _Clock()
        ev = _eval_sets(data, {"h_train": data["h_train"], "h_test": data["h_test"]}, False, rc, seed,
                        num_classes_h)
        with clock("features_rir"):
            ref_feats = {k: extract_features(ref.model, ds, batch_size=rc.eval_batch)
                         for k, ds in ev["sets"].items()}
        rows = {"init": evaluate_extractor(ref.model, ref_feats, ev, rc, seed, False, clock),
                "model": evaluate_extractor(model, ref_feats, ev, rc, seed, False, clock)}
        ref.verify()
        say(f"[audit seed {seed}] RIR_θ₀ {rows['model']['rir']['value']['mean']:.4g}  "
            f"D_P top-1 {rows['model']['dp_top1']:.2f}% (reference {rows['init']['dp_top1']:.2f}%)",
            flush=True)
        per_seed.append({"seed": seed, "rows": rows, "errors": {}, "phase_seconds": clock.seconds})
    return {"config": rc.name, "backbone": model.spec.key, "scope": "audit", "seeds": list(seeds),
            "threads": torch.get_num_threads(), "run_config": asdict(rc), "rows": aggregate(per_seed, rc),
            "per_seed": per_seed, "errors": {}, "wall_seconds": time.perf_counter() - t0,
            "phase_seconds": _phase_totals(per_seed), "environment": environment()}


def _harden_copy(model, sr: SeedRun, cfg: DeepImmunizeConfig):
    """A hardened deep copy of ``model`` (the same map family and seed for every method)."""
    h = copy.deepcopy(model)
    info = harden(h, sr.data["h_train"], cfg.harden, num_classes=sr.num_classes_h,
                  rng=np.random.default_rng([sr.seed, 99]), scale=cfg.harden_scale,
                  from_trunk=sr.from_trunk, batch_size=sr.rc.eval_batch)
    return h, info.as_dict()


def immunize_and_evaluate(sr: SeedRun, cfg: DeepImmunizeConfig, ctx, *, attacks: bool = True,
                          on_extractor: "ExtractorHook | None" = None) -> "dict | None":
    """Immunize a deep copy of θ₀ with ``cfg`` and measure it; with ``cfg.harden`` also its
    hardened copy. Rank 0 returns ``{variant: row}`` (``cfg.method``, and
    ``"<method>+<hardening>"``). Raises :class:`NonFiniteLossError` when the immunization diverges
    (after passing the last good model to ``on_extractor``)."""
    rc = sr.rc if attacks else replace(sr.rc, adam_lrs=(), finetune=False)
    model = copy.deepcopy(sr.reference.model)
    plain = replace(cfg, harden="none")
    try:
        with sr.clock("immunize"):
            res = immunize(model, sr.data["p_train"], sr.data["h_train"], plain,
                           num_classes_h=sr.num_classes_h, from_trunk=sr.from_trunk, device=ctx.device,
                           rank=ctx.rank, world=ctx.world, ddp=ctx.distributed)
    except NonFiniteLossError as exc:
        if ctx.is_main and on_extractor is not None:
            exc.checkpoint = on_extractor(model, cfg.method, sr.seed, "last_good")
        raise
    if not ctx.is_main:
        return None
    train = {"steps": res.steps, "wall_seconds": res.wall_seconds, "lambdas": res.lambdas,
             "mean_step_seconds": float(np.mean(res.history["step_seconds"])),
             "final": {k: v[-1] for k, v in res.history.items() if v}}
    variants = {cfg.method: (model, None)}
    if cfg.harden != "none":
        variants[hardened_key(cfg.method, cfg.harden)] = _harden_copy(model, sr, cfg)
    rows = {}
    for key, (m, hardening) in variants.items():
        row = evaluate_extractor(m, sr.ref_feats, sr.ev, rc, sr.seed, sr.from_trunk, sr.clock)
        row["train"] = train
        if hardening is not None:
            row["hardening"] = hardening
        path = on_extractor(m, key, sr.seed, "immunized") if on_extractor is not None else None
        if path is not None:
            row["extractor"] = path
        rows[key] = row
    return rows


def run_seed(rc: RunConfig, seed: int, opts: RunOptions, ctx, say=print, *,
             on_extractor: "ExtractorHook | None" = None) -> "dict | None":
    """θ₀, every method and every measurement for one seed; rank 0 returns the rows."""
    sr = prepare_seed(rc, seed, opts, ctx)
    rows, errors = {}, {}
    kind = rc.immunize.harden
    if ctx.is_main:
        init = evaluate_extractor(sr.reference.model, sr.ref_feats, sr.ev, rc, seed, sr.from_trunk, sr.clock)
        init["train"] = {"theta0_seconds": sr.clock.seconds["theta0"]["wall"],
                         "cache_seconds": sr.clock.seconds["cache"]["wall"]}
        rows["init"] = init
        path = on_extractor(sr.reference.model, "init", seed, "immunized") if on_extractor else None
        if path is not None:
            init["extractor"] = path
        say(f"[{rc.name} seed {seed}] θ₀ ({init['train']['theta0_seconds']:.1f}s): "
            f"D_P top-1 {init['dp_top1']:.2f}%  probe acc@10 {init['probe_acc_epoch10']:.1f}", flush=True)
        if kind != "none":
            h, info = _harden_copy(sr.reference.model, sr, rc.immunize)
            key = hardened_key("init", kind)
            rows[key] = {**evaluate_extractor(h, sr.ref_feats, sr.ev, rc, seed, sr.from_trunk, sr.clock),
                         "hardening": info}
            path = on_extractor(h, key, seed, "immunized") if on_extractor else None
            if path is not None:
                rows[key]["extractor"] = path
    for method in rc.methods:
        cfg = replace(rc.immunize, method=method, seed=seed, virtual_ranks=opts.virtual_ranks,
                      checkpoint_dir=None, progress=not opts.quiet)
        try:
            got = immunize_and_evaluate(sr, cfg, ctx, on_extractor=on_extractor)
        except NonFiniteLossError as exc:
            say(f"[{rc.name} seed {seed}] {exc}", flush=True)
            errors[method] = {"message": str(exc), "step": exc.step, "checkpoint": exc.checkpoint}
            continue
        if got is None:
            continue
        rows.update(got)
        for key, row in got.items():
            r = row["rir"]
            say(f"[{rc.name} seed {seed}] {key:24s} RIR_θ₀ {r['value']['mean']:.4g}  "
                f"(i) {r['harmful_ratio']['mean']:.4g}  (ii) {r['pretrain_ratio']['mean']:.4g}  "
                f"D_P top-1 {row['dp_top1']:.2f}%  probe acc@10 {row['probe_acc_epoch10']:.1f}  "
                f"[{row['train']['steps']} steps, {row['train']['wall_seconds']:.1f}s]", flush=True)
    barrier()
    if not ctx.is_main:
        return None
    return {"seed": seed, "rows": rows, "errors": errors, "phase_seconds": sr.clock.seconds}


# --- over seeds -------------------------------------------------------------------------------

def _curve_summary(curves: list[list[float]]) -> dict:
    a = np.asarray(curves, dtype=float)
    return {"mean": a.mean(0).tolist(), "std": a.std(0).tolist(), "min": a.min(0).tolist(),
            "max": a.max(0).tolist()}


def _row_order(rc: RunConfig) -> list[str]:
    base = ["init", *rc.methods]
    kind = rc.immunize.harden
    return base + ([hardened_key(m, kind) for m in base] if kind != "none" else [])


def aggregate(per_seed: list[dict], rc: RunConfig) -> dict:
    """``rows.<variant>``: every headline number as ``{mean, std, per_seed}`` (population std).

    Besides RIR_θ₀, (i), (ii), D_P top-1 and the paper's probe: ``immunized`` (Definition 3.1 per
    seed, 0/1) with ``immunized_count`` (how many seeds; ``success`` is the same count under its
    older name), ``adam_probe_acc_epoch{e}`` and ``finetune_acc_epoch{e}`` for e in 1 and 5 when
    measured, and per attacker the accuracy after each of ``attack_epochs``."""
    rows = {}
    for m in _row_order(rc):
        runs = [s["rows"][m] for s in per_seed if m in s["rows"]]
        if not runs:
            continue
        flags = [immunized_def31(r["rir"]["harmful_ratio"]["mean"], r["rir"]["pretrain_ratio"]["mean"])
                 for r in runs]
        row = {
            "seeds": [s["seed"] for s in per_seed if m in s["rows"]],
            "rir_theta0": summarize(r["rir"]["value"]["mean"] for r in runs),
            "harmful_ratio": summarize(r["rir"]["harmful_ratio"]["mean"] for r in runs),
            "pretrain_ratio": summarize(r["rir"]["pretrain_ratio"]["mean"] for r in runs),
            "dp_top1": summarize(r["dp_top1"] for r in runs),
            "probe_acc_epoch10": summarize(r["probe_acc_epoch10"] for r in runs),
            "probe_acc_last": summarize(r["probe_acc_last"] for r in runs),
            "immunized": summarize(float(f) for f in flags),
            "harmful_top_ratio": summarize(r["harmful_spread"]["top"] for r in runs),
            "harmful_bottom_ratio": summarize(r["harmful_spread"]["bottom"] for r in runs),
            "immunized_count": int(sum(flags)),
            "success": int(sum(flags)),
            "probe_curve": _curve_summary([r["probe"]["test_accuracy"] for r in runs]),
            "attacks": {},
        }
        for a in ATTACKERS:
            if all(a in r["attacks"] for r in runs):
                curves = [r["attacks"][a] for r in runs]
                row["attacks"][a] = {"curve": _curve_summary(curves),
                                     **{f"epoch{e}": summarize(c[e] for c in curves)
                                        for e in rc.attack_epochs}}
        for a, name in (("adam", "adam_probe_acc"), ("finetune", "finetune_acc")):
            for e in (1, 5):
                if a in row["attacks"] and f"epoch{e}" in row["attacks"][a]:
                    row[f"{name}_epoch{e}"] = row["attacks"][a][f"epoch{e}"]
        rows[m] = row
    return rows


def _phase_totals(per_seed: list[dict]) -> dict:
    out: dict[str, dict[str, float]] = {}
    for s in per_seed:
        for k, v in s["phase_seconds"].items():
            t = out.setdefault(k, {"wall": 0.0, "cpu": 0.0})
            t["wall"] += v["wall"]
            t["cpu"] += v["cpu"]
    return out


def run_config(rc: RunConfig, seeds: list[int], opts: RunOptions, ctx, *,
               on_extractor: "ExtractorHook | None" = None) -> "dict | None":
    """Every seed of ``rc``; rank 0 returns the result (``rows`` = :func:`aggregate`,
    ``per_seed``, ``errors``, wall and per-phase seconds, provenance), the others None."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    t_start = time.perf_counter()
    say = print if ctx.is_main and not opts.quiet else (lambda *a, **k: None)
    say(f"[{rc.name}] backbone={rc.backbone} scope={rc.scope} seeds={seeds} world={ctx.world} "
        f"threads={torch.get_num_threads()} device={ctx.device}", flush=True)
    per_seed = [run_seed(rc, s, opts, ctx, say, on_extractor=on_extractor) for s in seeds]
    if not ctx.is_main:
        return None
    return {
        "config": rc.name, "backbone": rc.backbone, "scope": rc.scope, "seeds": list(seeds),
        "threads": torch.get_num_threads(), "world_size": ctx.world, "virtual_ranks": opts.virtual_ranks,
        "run_config": asdict(rc),
        "rows": aggregate(per_seed, rc), "per_seed": per_seed,
        "errors": {f"seed{s['seed']}": s["errors"] for s in per_seed if s["errors"]},
        "wall_seconds": time.perf_counter() - t_start,
        "phase_seconds": _phase_totals(per_seed),
        "environment": environment(),
        "notes": {
            "rir": "RIR_θ₀ = [κ(H̃_H(θ_I))/κ(H̃_H(θ₀))]/[κ(H̃_P(θ_I))/κ(H̃_P(θ₀))] on extracted features "
                   f"against a frozen copy of θ₀, per seed the mean over {rc.rir_groups} groups of "
                   f"{rc.rir_group_size} samples (κ over the nonzero spectrum, float64); "
                   "rows: mean ± std over seeds",
            "immunized": "Definition 3.1: (i) > 1 and (ii) < 1 (pycore.evaluate.immunized_def31)",
            "probe": "full-batch GD on softmax CE, step 1/λ_max(AᵀA/N), zero init; test accuracy per epoch",
            "attacks": {"adam_lrs": list(rc.adam_lrs), "adam_preprocessing": ["scale", "standardize"],
                        "adam_whitened_preprocessing": ["whiten"], "finetune_lr": rc.finetune_lr,
                        "finetune_pool": rc.finetune_pool, "finetune_test": rc.finetune_test},
            "hardening": {"kind": rc.immunize.harden, "scale": rc.immunize.harden_scale},
        },
    }


# --- the (i)/(ii) trade-off -------------------------------------------------------------------

def tradeoff_sweep(rc: RunConfig, points: list[tuple[float, "float | None"]], seeds: list[int],
                   opts: RunOptions, ctx, methods: "tuple[str, ...] | None" = None,
                   say=None) -> "dict | None":
    """Each method immunized at each point ``(b, b_ill)`` of the balance (λ = b·‖∇CE‖/‖∇term‖ for
    every term, and b_ill instead of b for R_ill when given) and measured: RIR_θ₀, (i), (ii),
    Definition 3.1, D_P top-1, the paper's probe and the Adam attackers (not the fine-tuning one),
    hardened too when the configuration hardens. θ₀ and the caches are made once per seed.
    Returns ``{"runs": {method: {"b,b_ill": [per-seed point]}}, ...}`` (rank 0)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    methods = tuple(methods or rc.methods)
    say = say or (print if ctx.is_main else (lambda *a, **k: None))
    quick = replace(rc, finetune=False)
    key = lambda b, bi: f"{b:g},{bi:g}" if bi is not None else f"{b:g},"  # noqa: E731
    runs: dict = {m: {key(b, bi): [] for b, bi in points} for m in methods}
    theta0 = {}
    t0 = time.perf_counter()
    for seed in seeds:
        sr = prepare_seed(quick, seed, opts, ctx)
        if ctx.is_main:
            init = evaluate_extractor(sr.reference.model, sr.ref_feats, sr.ev, quick, seed, sr.from_trunk)
            theta0[str(seed)] = _point(init)
        for m in methods:
            for b, bi in points:
                cfg = replace(quick.immunize, method=m, seed=seed, balance=b, balance_ill=bi, progress=False,
                              virtual_ranks=opts.virtual_ranks)
                try:
                    got = immunize_and_evaluate(sr, cfg, ctx)
                except NonFiniteLossError as exc:
                    got = {m: {"error": str(exc)}} if ctx.is_main else None
                if ctx.is_main:
                    point = {"seed": seed, **{v: (row if "error" in row else _point(row))
                                              for v, row in got.items()}}
                    runs[m][key(b, bi)].append(point)
                    say(f"[{rc.name} sweep seed {seed}] {m} b={b:g} b_ill={bi}: "
                        + "; ".join(f"{v}: {_short(p)}" for v, p in point.items() if v != "seed"), flush=True)
    if not ctx.is_main:
        return None
    return {"config": rc.name, "seeds": list(seeds), "points": [list(p) for p in points],
            "methods": list(methods), "threads": torch.get_num_threads(), "theta0": theta0, "runs": runs,
            "wall_seconds": time.perf_counter() - t0, "rule": asdict(rc.immunize),
            "environment": environment()}


def _point(row: dict) -> dict:
    out = {"rir_theta0": row["rir"]["value"]["mean"], "harmful_ratio": row["rir"]["harmful_ratio"]["mean"],
           "pretrain_ratio": row["rir"]["pretrain_ratio"]["mean"], "immunized": row["immunized"],
           "dp_top1": row["dp_top1"], "probe_acc_epoch10": row["probe_acc_epoch10"]}
    for a in ("adam", "adam_whitened"):
        if a in row["attacks"]:
            for e in (1, 5):
                if e < len(row["attacks"][a]):
                    out[f"{a}_acc_epoch{e}"] = row["attacks"][a][e]
    return out


def _short(p: dict) -> str:
    if "error" in p:
        return "diverged"
    return (f"(i) {p['harmful_ratio']:.3g} (ii) {p['pretrain_ratio']:.3g} D_P {p['dp_top1']:.1f} "
            f"GD@10 {p['probe_acc_epoch10']:.1f} Adam@1/5 {p.get('adam_acc_epoch1', float('nan')):.1f}/"
            f"{p.get('adam_acc_epoch5', float('nan')):.1f}")
