"""The deep-net experiment over seeds (docs/deep.md; paper §5.2, Table 3, Figure 3) on pycore.deep.

Per seed: θ₀ (trained on D_P here, loaded, or pretrained), its features computed once, every method
immunizing a copy of θ₀, and each extractor (θ₀ included; with a hardening also its hardened copy,
the row ``"<row>+<kind>"``) measured: D_P top-1, RIR_θ₀ with (i) and (ii) against θ₀, Definition
3.1 and the attackers (GD 1/L, Adam, whitened Adam, fine-tuning). :func:`aggregate` gives mean ± std
over seeds; :func:`tradeoff_sweep` varies the balance; :func:`audit` measures a given model against
a given θ₀. Everything random is seeded from the seed, and ``torch.use_deterministic_algorithms`` is
on: the same seed and thread count give the same digits.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from pycore.deep import DEEP_METHODS, DeepOptions, NonFiniteLossError, create_model, harden, immunize, load_model
from pycore.deep.attacks import ADAM_LRS, best_adam_probe, finetune_attack, linear_probe_curve
from pycore.deep.data import DataError, ShardedBatches, dataset_labels, fetch, image_folder, mnist_demo_tasks
from pycore.deep.distributed import barrier, broadcast_module
from pycore.deep.features import extract, prelogits_dataset
from pycore.deep.models import ImmunizedNet
from pycore.evaluate import immunized_def31
from pycore.metrics import grouped_feature_rir
from pycore.report import environment, summarize
from pycore.spectral import gram_spectrum
from pycore.threads import bounded_blas

ATTACKERS = ("gd", "adam", "adam_whitened", "finetune")


@dataclass
class RunConfig:
    """One experiment: the timm model, the data, the immunization options and the evaluation sizes."""

    name: str
    model: str                               # a timm model name
    data: str                                # "folders" | "mnist"
    options: DeepOptions = field(default_factory=DeepOptions)
    model_kwargs: dict = field(default_factory=dict)
    methods: tuple = DEEP_METHODS
    theta0_epochs: int = 0                   # θ₀ trained here on D_P (no checkpoint, not pretrained)
    theta0_lr: float = 1e-3
    theta0_shift: int = 0                    # θ₀ training: random translations of up to this many pixels
    per_digit: "int | None" = None           # MNIST demo: images per digit
    rir_groups: int = 20
    rir_group_size: int = 100
    rir_pool: "int | None" = None            # samples per task the RIR groups are drawn from
    probe_epochs: int = 50
    eval_batch: int = 256
    attack_epochs: tuple = (1, 5, 20)
    adam_lrs: tuple = ADAM_LRS               # empty: no Adam attackers
    finetune_lr: float = 1e-4
    finetune_pool: "int | None" = 256        # D_H training images of the fine-tuning attacker
    finetune_test: "int | None" = 500        # D_H test images it is scored on
    finetune: bool = True


@dataclass
class RunOptions:
    """What is not a hyper-parameter: data roots, the θ₀ source, distribution."""

    dp_root: "str | None" = None
    dh_root: "str | None" = None
    val_split: str = "val"
    checkpoint: "str | None" = None
    pretrained: bool = False
    quiet: bool = False


class Clock:
    """Wall and CPU seconds per phase."""

    def __init__(self):
        self.seconds: dict = {}

    def __call__(self, phase: str):
        clock, t = self, {}

        class Phase:
            def __enter__(self):
                t.update(w=time.perf_counter(), c=time.process_time())

            def __exit__(self, *exc):
                s = clock.seconds.setdefault(phase, {"wall": 0.0, "cpu": 0.0})
                s["wall"] += time.perf_counter() - t["w"]
                s["cpu"] += time.process_time() - t["c"]
        return Phase()


# --- θ₀ ---------------------------------------------------------------------------------------

def random_shift(x: torch.Tensor, max_shift: int, rng: np.random.Generator) -> torch.Tensor:
    """Each image translated by its own offset in ``[-max_shift, max_shift]²``, edge pixels filling in."""
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4, mode="replicate")
    off = rng.integers(0, 2 * max_shift + 1, size=(n, 2))
    return torch.stack([padded[i, :, a:a + h, b:b + w] for i, (a, b) in enumerate(off)])


def train_classifier(net, data, *, epochs: int, lr: float, seed: int, batch_size: int = 64, max_shift: int = 0,
                     device="cpu") -> list[float]:
    """θ₀ for the demo: the whole model by AdamW (weight decay 1e-4) with a one-cycle schedule and the
    label-smoothing CE that immunization uses (a θ₀ trained without it is over-confident, and the
    smoothed loss then wrecks D_P accuracy in the first immunization steps); BatchNorm statistics
    re-estimated for the final weights on the un-augmented data (the running averages lag behind)."""
    net.to(device).train().requires_grad_(True)
    batch_size = min(batch_size, len(data))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    batches = ShardedBatches(len(data), batch_size, seed=seed)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(batches), pct_start=0.2)
    shift_rng, losses = np.random.default_rng([seed, 7]), []
    for e in range(epochs):
        for (idx,) in batches.epoch(e):
            x, y = fetch(data, idx)
            loss = F.cross_entropy(net(random_shift(x, max_shift, shift_rng).to(device)), y.to(device),
                                   label_smoothing=0.1)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"θ₀ training diverged (loss {float(loss)}) at step {len(losses)}: "
                                         "lower theta0_lr")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
    bns = {m: m.momentum for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    with torch.no_grad():
        for m in bns:
            m.reset_running_stats()
            m.momentum = None              # cumulative average over one pass
        for s in range(0, len(data) - batch_size + 1, batch_size) if bns else ():
            net(fetch(data, torch.arange(s, s + batch_size))[0].to(device))
        for m, momentum in bns.items():
            m.momentum = momentum
    net.eval().requires_grad_(False)
    return losses


def _theta0(rc: RunConfig, opts: RunOptions, num_classes: int, seed: int):
    if opts.checkpoint:
        model, _ = load_model(opts.checkpoint, rc.model, **rc.model_kwargs)
        if model.classifier.out_features != num_classes:
            raise DataError(f"{opts.checkpoint} classifies {model.classifier.out_features} classes but D_P has "
                            f"{num_classes}")
        return model
    return create_model(rc.model, num_classes, pretrained=opts.pretrained, seed=seed, **rc.model_kwargs)


def _data(rc: RunConfig, opts: RunOptions, rng):
    """(p_train, p_val, h_train, h_test, classes of D_P, classes of D_H), decoded for the model."""
    probe = create_model(rc.model, 1, seed=0, **rc.model_kwargs)        # its data config only
    if rc.data == "mnist":
        t = mnist_demo_tasks(rng, probe, per_digit=rc.per_digit)
        return t.p_train, t.p_val, t.h_train, t.h_test, t.num_classes_p, t.num_classes_h
    sets = [image_folder(root, split, probe) for root in (opts.dp_root, opts.dh_root)
            for split in ("train", opts.val_split)]
    for root, tr, va in ((opts.dp_root, *sets[:2]), (opts.dh_root, *sets[2:])):
        if tr.classes != va.classes:
            raise DataError(f"{root}: train/ and {opts.val_split}/ hold different class folders")
    return (*sets, len(sets[0].classes), len(sets[2].classes))


def _subset(ds, n, rng):
    if n is None or n >= len(ds):
        return ds
    idx = np.sort(rng.choice(len(ds), size=n, replace=False))
    return TensorDataset(*(t[torch.from_numpy(idx)] for t in ds.tensors)) if isinstance(ds, TensorDataset) \
        else Subset(ds, idx.tolist())


# --- measuring one extractor ------------------------------------------------------------------

@bounded_blas
def spectrum_spread(Z, Z_ref, *, rng, groups: int, group_size: int) -> dict:
    """Where a κ ratio comes from: per random group of rows (the same rows of both), the top and the
    bottom of the nonzero spectrum of ``ZᵀZ`` relative to its median, divided by the same for ``Z_ref``;
    geometric means over groups. ``top / bottom`` is the groups' κ ratio; ``top > 1``: the largest
    eigenvalue rose above the bulk, ``bottom < 1``: the smallest fell below it."""
    m, logs = min(group_size, len(Z)), np.zeros((groups, 2))
    for g in range(groups):
        idx = rng.choice(len(Z), size=m, replace=False)
        a, b = gram_spectrum(Z[idx], vectors=False), gram_spectrum(Z_ref[idx], vectors=False)
        ma, mb = np.median(a.sigma[:a.rank]), np.median(b.sigma[:b.rank])
        logs[g] = (np.log(a.sigma_max / ma) - np.log(b.sigma_max / mb), np.log(a.sigma_min / ma) - np.log(b.sigma_min / mb))
    top, bottom = np.exp(logs.mean(0))
    return {"top": float(top), "bottom": float(bottom), "groups": groups, "group_size": m}


@bounded_blas
def evaluate_extractor(model, ref, ev: dict, rc: RunConfig, seed: int, clock: Clock) -> dict:
    """D_P top-1, RIR_θ₀ against θ₀'s features ``ref``, Definition 3.1 and the attackers."""
    with clock("features_rir"):
        f = {k: extract(model, ds, cached=ev["cached"], batch_size=rc.eval_batch) for k, ds in ev["sets"].items()}
        with torch.no_grad():
            head = model.classifier
            logits = head(torch.from_numpy(f["p_val"]).to(head.weight.device, head.weight.dtype)).cpu()
        acc = 100.0 * float((logits.argmax(1).numpy() == ev["y"]["p_val"]).mean())
        hp = ev["h_pool_idx"]                     # the D_H RIR pool: rows of the probe's training set
        rir = grouped_feature_rir(f["p_pool"], f["h_train"][hp], ref["p_pool"], ref["h_train"][hp],
                                  rng=np.random.default_rng([seed, 17]), groups=rc.rir_groups,
                                  group_size=rc.rir_group_size)
        spread = spectrum_spread(f["h_train"][hp], ref["h_train"][hp], rng=np.random.default_rng([seed, 18]),
                                 groups=rc.rir_groups, group_size=rc.rir_group_size)
    yt, yv, nch, last = ev["y"]["h_train"], ev["y"]["h_test"], ev["classes_h"], max(rc.attack_epochs)
    with clock("gd_probe"):
        probe = linear_probe_curve(f["h_train"], yt, f["h_test"], yv, epochs=max(rc.probe_epochs, last),
                                   num_classes=nch)
    attacks = {"gd": probe.test_accuracy[:last + 1]}
    for key, prep in (("adam", ("scale", "standardize")), ("adam_whitened", ("whiten",))):
        if rc.adam_lrs:
            with clock(f"{key}_probe"):
                r = best_adam_probe(f["h_train"], yt, f["h_test"], yv, epochs=last, lrs=rc.adam_lrs,
                                    preprocessing=prep, seed=seed, num_classes=nch)
            attacks[key], attacks[f"{key}_best"] = r["test_accuracy"], r["best"]
    if rc.finetune:
        with clock("finetune"):
            attacks["finetune"] = finetune_attack(model, ev["ft_train"], ev["ft_test"], num_classes=nch, epochs=last,
                                                  lr=rc.finetune_lr, seed=seed, eval_batch=rc.eval_batch,
                                                  eval_epochs=rc.attack_epochs).test_accuracy
    curve = probe.test_accuracy[:rc.probe_epochs + 1]
    i, ii = rir["harmful_ratio"]["mean"], rir["pretrain_ratio"]["mean"]
    return {"dp_top1": acc, "rir": rir, "immunized": immunized_def31(i, ii), "harmful_spread": spread,
            "probe": {"test_accuracy": curve, "step_size": probe.step_size},
            "probe_acc_epoch10": curve[min(10, len(curve) - 1)], "probe_acc_last": curve[-1], "attacks": attacks}


def _eval_sets(data: dict, images: dict, cached: bool, rc: RunConfig, seed: int, nch: int) -> dict:
    """The RIR pools (D_P training rows; D_H indices into the probe's training rows), D_P validation,
    D_H train/test with labels, and the fine-tuning attacker's D_H images."""
    rng = np.random.default_rng([seed, 3])
    n_h = len(data["h_train"]) if rc.rir_pool is None else min(rc.rir_pool, len(data["h_train"]))
    ev = {"sets": {"p_pool": _subset(data["p_train"], rc.rir_pool, rng), "p_val": data["p_val"],
                   "h_train": data["h_train"], "h_test": data["h_test"]},
          "h_pool_idx": np.sort(rng.choice(len(data["h_train"]), size=n_h, replace=False)), "classes_h": nch,
          "cached": cached, "ft_train": _subset(images["h_train"], rc.finetune_pool, np.random.default_rng([seed, 5])),
          "ft_test": _subset(images["h_test"], rc.finetune_test, np.random.default_rng([seed, 6]))}
    ev["y"] = {k: dataset_labels(ev["sets"][k]) for k in ("p_val", "h_train", "h_test")}
    return ev


# --- one seed ---------------------------------------------------------------------------------

@dataclass
class SeedRun:
    """What one seed's methods share: θ₀ (never trained further), the data, the evaluation sets."""

    rc: RunConfig
    seed: int
    theta0: ImmunizedNet
    data: dict
    ev: dict
    ref: "dict | None"
    classes_p: int
    classes_h: int
    clock: Clock


def prepare_seed(rc: RunConfig, seed: int, opts: RunOptions, ctx) -> SeedRun:
    """θ₀ (trained, loaded or pretrained), its features computed once (scope "layer"), the evaluation sets."""
    clock, rng = Clock(), np.random.default_rng(seed)
    torch.manual_seed(seed)
    p_tr, p_va, h_tr, h_te, ncp, nch = _data(rc, opts, rng)
    net = _theta0(rc, opts, ncp, seed)
    with clock("theta0"):
        if rc.theta0_epochs and not opts.checkpoint and not opts.pretrained:
            if ctx.is_main:
                train_classifier(net, p_tr, epochs=rc.theta0_epochs, lr=rc.theta0_lr, seed=seed,
                                 max_shift=rc.theta0_shift, device=ctx.device)
            broadcast_module(net)
    theta0 = (net if isinstance(net, ImmunizedNet) else ImmunizedNet(net)).to(ctx.device).eval().requires_grad_(False)
    images = {"p_train": p_tr, "p_val": p_va, "h_train": h_tr, "h_test": h_te}
    cached = rc.options.scope == "layer"
    with clock("cache"):
        data = {k: prelogits_dataset(theta0, d, batch_size=rc.eval_batch) for k, d in images.items()} if cached \
            else images
    ev = _eval_sets(data, images, cached, rc, seed, nch)
    ref = None
    if ctx.is_main:
        with clock("features_rir"):
            ref = {k: extract(theta0, d, cached=cached, batch_size=rc.eval_batch) for k, d in ev["sets"].items()}
    return SeedRun(rc, seed, theta0, data, ev, ref, ncp, nch, clock)


def _hardened(model, sr: SeedRun, o: DeepOptions):
    h = copy.deepcopy(model)
    info = harden(h, sr.data["h_train"], o.harden, num_classes=sr.classes_h, rng=np.random.default_rng([sr.seed, 99]),
                  scale=o.harden_scale, cached=sr.ev["cached"], batch_size=sr.rc.eval_batch)
    return h, info.as_dict()


def immunize_and_evaluate(sr: SeedRun, method: str, o: DeepOptions, ctx, *, attacks: bool = True,
                          on_extractor=None, progress: bool = False) -> "dict | None":
    """Immunize a copy of θ₀ with ``method`` and measure it (and, with ``o.harden``, its hardened copy);
    rank 0 returns ``{row: measurements}``. A :class:`NonFiniteLossError` is re-raised after the last
    good model went to ``on_extractor(model, row, seed, "last_good")``."""
    rc = sr.rc if attacks else replace(sr.rc, adam_lrs=(), finetune=False)
    model = copy.deepcopy(sr.theta0)
    try:
        with sr.clock("immunize"):
            res = immunize(model, sr.data["p_train"], sr.data["h_train"], method, replace(o, harden="none"),
                           seed=sr.seed, num_classes_h=sr.classes_h, cached=sr.ev["cached"], device=ctx.device,
                           rank=ctx.rank, world=ctx.world, ddp=ctx.distributed, progress=progress)
    except NonFiniteLossError as exc:
        if ctx.is_main and on_extractor is not None:
            exc.checkpoint = on_extractor(model, method, sr.seed, "last_good")
        raise
    if not ctx.is_main:
        return None
    train = {"steps": res.steps, "wall_seconds": res.wall_seconds, "lambdas": res.lambdas,
             "mean_step_seconds": float(np.mean(res.history["step_seconds"])),
             "final": {k: v[-1] for k, v in res.history.items() if v}}
    variants = {method: (model, None)}
    if o.harden != "none":
        variants[f"{method}+{o.harden}"] = _hardened(model, sr, o)
    rows = {}
    for key, (m, hardening) in variants.items():
        rows[key] = {**evaluate_extractor(m, sr.ref, sr.ev, rc, sr.seed, sr.clock), "train": train}
        if hardening is not None:
            rows[key]["hardening"] = hardening
        path = on_extractor(m, key, sr.seed, "immunized") if on_extractor else None
        if path:
            rows[key]["extractor"] = path
    return rows


def run_seed(rc: RunConfig, seed: int, opts: RunOptions, ctx, say, on_extractor=None) -> "dict | None":
    """θ₀, every method and every measurement of one seed; rank 0 returns the rows."""
    sr = prepare_seed(rc, seed, opts, ctx)
    rows, errors, o = {}, {}, rc.options
    if ctx.is_main:
        variants = {"init": (sr.theta0, None)}
        if o.harden != "none":
            variants[f"init+{o.harden}"] = _hardened(sr.theta0, sr, o)
        for key, (m, hardening) in variants.items():
            rows[key] = {**evaluate_extractor(m, sr.ref, sr.ev, rc, seed, sr.clock), "hardening": hardening}
            path = on_extractor(m, key, seed, "immunized") if on_extractor else None
            if path:
                rows[key]["extractor"] = path
        init = rows["init"]
        say(f"[{rc.name} seed {seed}] θ₀ ({sr.clock.seconds['theta0']['wall']:.1f}s): D_P top-1 "
            f"{init['dp_top1']:.2f}%  probe acc@10 {init['probe_acc_epoch10']:.1f}")
    for method in rc.methods:
        try:
            got = immunize_and_evaluate(sr, method, o, ctx, on_extractor=on_extractor, progress=not opts.quiet)
        except NonFiniteLossError as exc:
            say(f"[{rc.name} seed {seed}] {exc}")
            errors[method] = {"message": str(exc), "step": exc.step, "checkpoint": exc.checkpoint,
                              "parameter": exc.parameter}
            continue
        for key, row in (got or {}).items():
            rows[key] = row
            r = row["rir"]
            say(f"[{rc.name} seed {seed}] {key:24s} RIR_θ₀ {r['value']['mean']:.4g}  (i) "
                f"{r['harmful_ratio']['mean']:.4g}  (ii) {r['pretrain_ratio']['mean']:.4g}  D_P top-1 "
                f"{row['dp_top1']:.2f}%  probe acc@10 {row['probe_acc_epoch10']:.1f}  [{row['train']['steps']} steps]")
    barrier()
    return ({"seed": seed, "rows": rows, "errors": errors, "phase_seconds": sr.clock.seconds,
             "classes": [sr.classes_p, sr.classes_h]} if ctx.is_main else None)


# --- over seeds -------------------------------------------------------------------------------

def _curve(curves) -> dict:
    a = np.asarray(curves, dtype=float)
    return {k: getattr(np, k)(a, 0).tolist() for k in ("mean", "std", "min", "max")}


def aggregate(per_seed: list[dict], order: list[str], attack_epochs) -> dict:
    """``rows.<row>``: every headline number as ``{mean, std, per_seed}`` (population std) over the seeds
    that have the row, ``immunized_count`` (Definition 3.1 per seed), and per attacker its curve and its
    accuracy after each of ``attack_epochs``."""
    rows = {}
    for m in order:
        runs = [s["rows"][m] for s in per_seed if m in s["rows"]]
        if not runs:
            continue
        get = lambda f: summarize(f(r) for r in runs)  # noqa: E731
        row = {"seeds": [s["seed"] for s in per_seed if m in s["rows"]],
               "rir_theta0": get(lambda r: r["rir"]["value"]["mean"]),
               "harmful_ratio": get(lambda r: r["rir"]["harmful_ratio"]["mean"]),
               "pretrain_ratio": get(lambda r: r["rir"]["pretrain_ratio"]["mean"]),
               "dp_top1": get(lambda r: r["dp_top1"]), "probe_acc_epoch10": get(lambda r: r["probe_acc_epoch10"]),
               "probe_acc_last": get(lambda r: r["probe_acc_last"]), "immunized": get(lambda r: float(r["immunized"])),
               "harmful_top_ratio": get(lambda r: r["harmful_spread"]["top"]),
               "harmful_bottom_ratio": get(lambda r: r["harmful_spread"]["bottom"]),
               "immunized_count": sum(bool(r["immunized"]) for r in runs),
               "probe_curve": _curve([r["probe"]["test_accuracy"] for r in runs]), "attacks": {}}
        for a in ATTACKERS:
            if all(a in r["attacks"] for r in runs):
                curves = [r["attacks"][a] for r in runs]
                row["attacks"][a] = {"curve": _curve(curves),
                                     **{f"epoch{e}": summarize(c[e] for c in curves) for e in attack_epochs}}
        rows[m] = row
    return rows


def _phase_totals(per_seed) -> dict:
    out = {}
    for s in per_seed:
        for k, v in s["phase_seconds"].items():
            t = out.setdefault(k, {"wall": 0.0, "cpu": 0.0})
            t["wall"], t["cpu"] = t["wall"] + v["wall"], t["cpu"] + v["cpu"]
    return out


def _order(rc: RunConfig, methods) -> list[str]:
    base = ["init", *methods]
    return base + ([f"{m}+{rc.options.harden}" for m in base] if rc.options.harden != "none" else [])


def describe(rc: RunConfig, opts: RunOptions) -> dict:
    """What a table's or figure's title names: the data and the model."""
    data = ("MNIST digits 0-4 (D_P) vs 5-9 (D_H)" if rc.data == "mnist" else
            f"D_P {opts.dp_root} vs D_H {opts.dh_root}")
    shape = ", ".join(f"{k} {v}" for k, v in rc.model_kwargs.items())
    return {"data": data, "model_text": rc.model + (f" ({shape})" if shape else "")}


def run_config(rc: RunConfig, seeds: list[int], opts: RunOptions, ctx, *, on_extractor=None) -> "dict | None":
    """Every seed of ``rc``; rank 0 returns ``rows`` (:func:`aggregate`), ``per_seed``, ``errors``, the wall
    and per-phase seconds and the provenance, the other ranks None."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.perf_counter()
    say = print if ctx.is_main and not opts.quiet else (lambda *a, **k: None)
    say(f"[{rc.name}] model={rc.model} scope={rc.options.scope} seeds={seeds} world={ctx.world} "
        f"threads={torch.get_num_threads()} device={ctx.device}")
    per_seed = [run_seed(rc, s, opts, ctx, say, on_extractor) for s in seeds]
    if not ctx.is_main:
        return None
    return {"config": rc.name, "model": rc.model, "scope": rc.options.scope, "seeds": list(seeds),
            "threads": torch.get_num_threads(), "world_size": ctx.world, "virtual_ranks": rc.options.virtual_ranks,
            "run_config": asdict(rc), "rows": aggregate(per_seed, _order(rc, rc.methods), rc.attack_epochs),
            "per_seed": per_seed, "errors": {f"seed{s['seed']}": s["errors"] for s in per_seed if s["errors"]},
            "wall_seconds": time.perf_counter() - t0, "phase_seconds": _phase_totals(per_seed),
            "environment": environment(), **describe(rc, opts)}


def tradeoff_sweep(rc: RunConfig, points: list, seeds: list[int], opts: RunOptions, ctx, say=print) -> "dict | None":
    """Each method of ``rc`` at each point ``(b, b_ill)`` of the balance (λ = b·‖∇CE‖/‖∇term‖, b_ill for
    R_ill when given), measured without the fine-tuning attacker; θ₀ and its features once per seed.
    Returns ``{"runs": {method: {"b,b_ill": [per-seed point]}}, "theta0": {...}, ...}`` (rank 0)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    quick, t0 = replace(rc, finetune=False), time.perf_counter()
    key = lambda b, bi: f"{b:g}," + ("" if bi is None else f"{bi:g}")  # noqa: E731
    runs, theta0 = {m: {key(b, bi): [] for b, bi in points} for m in rc.methods}, {}
    for seed in seeds:
        sr = prepare_seed(quick, seed, opts, ctx)
        if ctx.is_main:
            theta0[str(seed)] = _point(evaluate_extractor(sr.theta0, sr.ref, sr.ev, quick, seed, sr.clock))
        for m in rc.methods:
            for b, bi in points:
                o = replace(quick.options, balance=b, balance_ill=bi)
                try:
                    got = immunize_and_evaluate(sr, m, o, ctx)
                except NonFiniteLossError as exc:
                    got = {m: {"error": str(exc)}} if ctx.is_main else None
                if ctx.is_main:
                    point = {"seed": seed, **{v: row if "error" in row else _point(row) for v, row in got.items()}}
                    runs[m][key(b, bi)].append(point)
                    say(f"[{rc.name} sweep seed {seed}] {m} b={b:g} b_ill={bi}: " + "; ".join(
                        f"{v}: " + ("diverged" if "error" in p else f"(i) {p['harmful_ratio']:.3g} (ii) "
                                    f"{p['pretrain_ratio']:.3g} D_P {p['dp_top1']:.1f}")
                        for v, p in point.items() if v != "seed"))
    if not ctx.is_main:
        return None
    return {"config": rc.name, "seeds": list(seeds), "points": [list(p) for p in points], "methods": list(rc.methods),
            "threads": torch.get_num_threads(), "theta0": theta0, "runs": runs, "rule": asdict(rc.options),
            "wall_seconds": time.perf_counter() - t0, "environment": environment(), **describe(rc, opts)}


def _point(row: dict) -> dict:
    out = {"rir_theta0": row["rir"]["value"]["mean"], "harmful_ratio": row["rir"]["harmful_ratio"]["mean"],
           "pretrain_ratio": row["rir"]["pretrain_ratio"]["mean"], "immunized": row["immunized"],
           "dp_top1": row["dp_top1"], "probe_acc_epoch10": row["probe_acc_epoch10"]}
    for a in ("adam", "adam_whitened"):
        for e in (1, 5):
            if e < len(row["attacks"].get(a, ())):
                out[f"{a}_acc_epoch{e}"] = row["attacks"][a][e]
    return out


def audit(model, reference, data: dict, rc: RunConfig, seeds: list[int], *, classes_h: int, say=None) -> dict:
    """Any extractor ``model`` against a θ₀ ``reference`` (both ImmunizedNet, each run end to end on the
    images ``data``: p_train, p_val, h_train, h_test): the rows ``"init"`` (the reference) and ``"model"``
    in :func:`run_config`'s shape."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    say, t0, per_seed = say or (lambda *a, **k: None), time.perf_counter(), []
    for seed in seeds:
        clock = Clock()
        ev = _eval_sets(data, data, False, rc, seed, classes_h)
        with clock("features_rir"):
            ref = {k: extract(reference, d, batch_size=rc.eval_batch) for k, d in ev["sets"].items()}
        rows = {k: evaluate_extractor(m, ref, ev, rc, seed, clock) for k, m in (("init", reference), ("model", model))}
        say(f"[audit seed {seed}] RIR_θ₀ {rows['model']['rir']['value']['mean']:.4g}  D_P top-1 "
            f"{rows['model']['dp_top1']:.2f}% (reference {rows['init']['dp_top1']:.2f}%)")
        per_seed.append({"seed": seed, "rows": rows, "errors": {}, "phase_seconds": clock.seconds})
    return {"config": rc.name, "model": rc.model, "scope": "audit", "seeds": list(seeds),
            "threads": torch.get_num_threads(), "run_config": asdict(rc),
            "rows": aggregate(per_seed, ["init", "model"], rc.attack_epochs), "per_seed": per_seed, "errors": {},
            "wall_seconds": time.perf_counter() - t0, "phase_seconds": _phase_totals(per_seed),
            "environment": environment()}
