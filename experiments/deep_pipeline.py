"""The deep-net experiment over seeds on pycore.deep (docs/findings.md §7; paper §5.2, Table 3,
Fig. 3).

Per seed: θ₀ (trained on D_P here, loaded, or pretrained), every method (at each balance of a
sweep) immunizing a copy, and every row -- θ₀ included, each also hardened as ``"<row>+<kind>"`` --
measured: D_P top-1, RIR_θ₀ with (i) and (ii), Definition 3.1, the attackers. Everything random is
seeded from
the seed, torch runs deterministic algorithms: one seed and thread count give one set of digits."""

from __future__ import annotations

import copy
import io
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import reduce
from operator import getitem

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from pycore.deep import (
    DEEP_METHODS,
    DeepOptions,
    ImmunizedNet,
    NonFiniteLossError,
    create_model,
    harden,
    immunize_in_place,
    load_model,
)
from pycore.deep.attacks import linear_probe_curve
from pycore.deep.operators import (
    LORA_RANKS,
    OPERATORS,
    AttackData,
    OperatorCurve,
    compare,
    run_operators,
)
from pycore.deep.data import (
    DataError,
    ShardedBatches,
    dataset_labels,
    fetch,
    image_folder,
    mnist_demo_tasks,
)
from pycore.deep.distributed import barrier, broadcast_module, init_from_env
from pycore.deep.features import extract, prelogits_dataset
from pycore.deep.layer import attainability
from pycore.evaluate import chance_accuracy, immunized_def31
from pycore.metrics import feature_rir, grouped_feature_rir
from pycore.report import environment, summarize
from pycore.spectral import gram_spectrum
from pycore.threads import bounded_blas


@dataclass
class RunConfig:
    """One experiment: the timm model, the data, the immunization options and the evaluation
    sizes."""

    name: str
    model: str  # a timm model name
    data: str  # "folders" | "mnist"
    options: DeepOptions = field(default_factory=DeepOptions)
    model_kwargs: dict = field(default_factory=dict)
    methods: tuple = DEEP_METHODS
    sweep: tuple = ()  # (b, b_ill or None) balances: one row per method and point
    theta0_epochs: int = 0  # θ₀ trained here on D_P (no checkpoint, not pretrained)
    theta0_lr: float = 1e-3
    per_digit: "int | None" = None  # MNIST demo: images per digit
    rir_groups: int = 20
    rir_group_size: int = 100
    rir_pool: "int | None" = None  # samples per task the RIR groups are drawn from
    probe_epochs: int = 50
    eval_batch: int = 256
    attack_epochs: tuple = (1, 5)
    operators: tuple = OPERATORS  # pycore.deep.operators, each tuned on the attacker's val split
    lora_ranks: tuple = LORA_RANKS
    attack_train: "int | None" = 256  # D_H training images of every operator
    attack_val: int = 128  # further D_H training images: the attacker's validation split
    attack_test: "int | None" = None  # D_H test images the operators are scored on (None: all)


@dataclass
class RunOptions:
    """What is not a hyper-parameter: data roots, the θ₀ source."""

    dp_root: "str | None" = None
    dh_root: "str | None" = None
    val_split: str = "val"
    checkpoint: "str | None" = None
    pretrained: bool = False
    quiet: bool = False


def clock(seconds: dict):
    """``with clock(seconds)(phase):`` adds the wall and CPU seconds of the block to
    ``seconds[phase]``."""

    @contextmanager
    def phase(name):
        w, c = time.perf_counter(), time.process_time()
        yield
        s = seconds.setdefault(name, {"wall": 0.0, "cpu": 0.0})
        s["wall"], s["cpu"] = (
            s["wall"] + time.perf_counter() - w,
            s["cpu"] + time.process_time() - c,
        )

    return phase


def train_classifier(
    net, data, *, epochs: int, lr: float, seed: int, batch_size: int = 64, device="cpu"
) -> None:
    """θ₀ trained here: the whole model by AdamW (weight decay 1e-4), one-cycle, with the
    label-smoothing CE immunization uses (without it θ₀ is over-confident and the first
    immunization steps wreck D_P); BatchNorm statistics then re-estimated for the final weights
    (the running averages lag behind)."""
    net.to(device).train().requires_grad_(True)
    batches = ShardedBatches(len(data), min(batch_size, len(data)), seed=seed)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, lr, total_steps=epochs * len(batches), pct_start=0.2
    )
    for step, (idx,) in enumerate(b for e in range(epochs) for b in batches.epoch(e)):
        x, y = fetch(data, idx)
        loss = F.cross_entropy(net(x.to(device)), y.to(device), label_smoothing=0.1)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"θ₀ training diverged at step {step}: lower theta0_lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    bns = {
        m: m.momentum
        for m in net.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    }
    with torch.no_grad():
        for m in bns:
            m.reset_running_stats()
            m.momentum = None
        for s in range(0, len(data) - batches.batch_size + 1, batches.batch_size) if bns else ():
            net(fetch(data, torch.arange(s, s + batches.batch_size))[0].to(device))
        for m, momentum in bns.items():
            m.momentum = momentum
    net.eval().requires_grad_(False)


def load_data(rc: RunConfig, opts: RunOptions, rng) -> tuple[dict, int, int]:
    """The images by split (p_train, p_val, h_train, h_test), decoded for the model, and the
    class counts."""
    probe = create_model(rc.model, 1, seed=0, **rc.model_kwargs)  # its data config only
    if rc.data == "mnist":
        return mnist_demo_tasks(rng, probe, per_digit=rc.per_digit), 5, 5
    sets = {
        f"{t}_{s}": image_folder(root, split, probe)
        for t, root in (("p", opts.dp_root), ("h", opts.dh_root))
        for s, split in (("train", "train"), ("val" if t == "p" else "test", opts.val_split))
    }
    for root, tr, va in ((opts.dp_root, "p_train", "p_val"), (opts.dh_root, "h_train", "h_test")):
        if sets[tr].classes != sets[va].classes:
            raise DataError(f"{root}: train/ and {opts.val_split}/ hold different class folders")
    return sets, len(sets["p_train"].classes), len(sets["h_train"].classes)


def _take(ds, idx: np.ndarray):
    """Rows ``idx`` of ``ds``: a TensorDataset of them, or a Subset of an image folder."""
    if isinstance(ds, TensorDataset):
        return TensorDataset(*(t[torch.from_numpy(idx)] for t in ds.tensors))
    return Subset(ds, idx.tolist())


def _subset(ds, n, rng):
    if n is None or n >= len(ds):
        return ds
    idx = np.sort(rng.choice(len(ds), size=n, replace=False))
    if isinstance(ds, TensorDataset):
        return TensorDataset(*(t[torch.from_numpy(idx)] for t in ds.tensors))
    return Subset(ds, idx.tolist())


def spectrum_spread(Z, Z_ref, *, rng, groups: int, group_size: int) -> dict:
    """Where a κ ratio comes from: per random group of rows (the same rows of both), the largest
    and the smallest nonzero eigenvalue of ``ZᵀZ`` relative to its median, divided by the same for
    ``Z_ref``; geometric means over groups (``top / bottom`` is the groups' κ ratio, and scale
    cancels)."""
    m, logs = min(group_size, len(Z)), np.zeros((groups, 2))
    for g in range(groups):
        idx = rng.choice(len(Z), size=m, replace=False)
        a, b = gram_spectrum(Z[idx], vectors=False), gram_spectrum(Z_ref[idx], vectors=False)
        ma, mb = np.median(a.sigma[: a.rank]), np.median(b.sigma[: b.rank])
        logs[g] = np.log(
            [a.sigma_max / ma * mb / b.sigma_max, a.sigma_min / ma * mb / b.sigma_min]
        )
    top, bottom = np.exp(logs.mean(0))
    return {"top": float(top), "bottom": float(bottom)}


@bounded_blas
def evaluate_extractor(
    model,
    ref: dict,
    ev: dict,
    rc: RunConfig,
    seed: int,
    phase,
    *,
    operators: bool = True,
    name: "str | None" = None,
) -> dict:
    """D_P top-1, (i), (ii) and RIR_θ₀ against θ₀'s features ``ref`` on the whole pools (exact
    κ's: the linear problem the layer is) and by the paper's groups, Definition 3.1 on each, the
    probe curve of Figure 3 and every operator of :mod:`pycore.deep.operators` (with ``operators
    = False`` the row has ``"operator_features"`` instead: :func:`row_operators` adds them).
    ``name``: the argument that gave ``model``, named by a non-finite feature's error."""
    with phase("features_rir"):
        f = {
            k: extract(
                model,
                d,
                cached=ev["cached"],
                batch_size=rc.eval_batch,
                data_name=k,
                model_name=name,
            )
            for k, d in ev["sets"].items()
        }
        head = model.classifier
        with torch.no_grad():
            logits = head(
                torch.from_numpy(f["p_val"]).to(head.weight.device, head.weight.dtype)
            ).cpu()
        acc = 100.0 * float((logits.argmax(1).numpy() == ev["y"]["p_val"]).mean())
        hp, kw = ev["h_pool_idx"], {"groups": rc.rir_groups, "group_size": rc.rir_group_size}
        pools = (f["p_pool"], f["h_train"][hp], ref["p_pool"], ref["h_train"][hp])
        r = feature_rir(*pools)
        rir = {
            "value": r.value,
            "harmful_ratio": r.harmful_ratio,
            "pretrain_ratio": r.pretrain_ratio,
        }
        groups = grouped_feature_rir(*pools, rng=np.random.default_rng([seed, 17]), **kw)
        spread = spectrum_spread(
            f["h_train"][hp], ref["h_train"][hp], rng=np.random.default_rng([seed, 18]), **kw
        )
    with phase("probe_curve"):
        curve = linear_probe_curve(
            f["h_train"],
            ev["y"]["h_train"],
            f["h_test"],
            ev["y"]["h_test"],
            epochs=rc.probe_epochs,
            num_classes=ev["classes_h"],
        ).test_accuracy
    tr, va = ev["attack_idx"]
    features = (f["h_train"][tr], f["h_train"][va], f["h_test"][ev["attack_test_idx"]])
    row = {
        "dp_top1": acc,
        "rir": rir,
        "rir_groups": groups,
        "immunized": immunized_def31(r.harmful_ratio, r.pretrain_ratio),
        "immunized_groups": immunized_def31(
            groups["harmful_ratio"]["mean"], groups["pretrain_ratio"]["mean"]
        ),
        "harmful_spread": spread,
        "probe": curve,
        "probe_acc_epoch10": curve[min(10, len(curve) - 1)],
        "probe_acc_last": curve[-1],
    }
    if not operators:
        return {**row, "operator_features": features}
    with phase("operators"):
        return {**row, "operators": row_operators(model, ev["attack"], rc, seed, features)}


def row_operators(model, attack: AttackData, rc: RunConfig, seed: int, features) -> dict:
    """Every operator of ``rc`` against ``model`` (:func:`pycore.deep.operators.run_operators`),
    as a row stores them."""
    ops = run_operators(
        model,
        attack,
        rc.operators,
        epochs=rc.attack_epochs,
        lora_ranks=rc.lora_ranks,
        seed=seed,
        features=features,
    )
    return {k: v.to_dict() for k, v in ops.items()}


def eval_sets(data: dict, images: dict, cached: bool, rc: RunConfig, seed: int, nch: int) -> dict:
    """The RIR pools (D_P training rows; D_H indices into the probe's training rows), D_P
    validation, D_H train/test with labels, and the operators' D_H images (train, validation,
    test) with their row indices."""
    rng = np.random.default_rng([seed, 3])
    n_h = len(data["h_train"]) if rc.rir_pool is None else min(rc.rir_pool, len(data["h_train"]))
    ev = {
        "sets": {
            "p_pool": _subset(data["p_train"], rc.rir_pool, rng),
            "p_val": data["p_val"],
            "h_train": data["h_train"],
            "h_test": data["h_test"],
        },
        "h_pool_idx": np.sort(rng.choice(len(data["h_train"]), size=n_h, replace=False)),
        "classes_h": nch,
        "cached": cached,
    }
    # the attacker's images: train and validation rows of D_H's training split, the test split
    # (a D_H of fewer images: a quarter for validation, the rest to train on)
    perm = np.random.default_rng([seed, 5]).permutation(len(data["h_train"]))
    n_va = min(rc.attack_val, len(perm) // 4)
    n_tr = min(len(perm) - n_va, rc.attack_train or len(perm))
    if n_va < 1 or n_tr < 2:
        raise DataError(
            f"D_H has {len(perm)} training images; the operators need at least 2 to train on "
            "and 1 to validate on"
        )
    tr, va = np.sort(perm[:n_tr]), np.sort(perm[n_tr : n_tr + n_va])
    n_te = len(data["h_test"])
    te = np.sort(np.random.default_rng([seed, 6]).permutation(n_te)[: rc.attack_test or n_te])
    img = images["h_train"]
    ev["attack_idx"], ev["attack_test_idx"] = (tr, va), te
    ev["attack"] = AttackData(_take(img, tr), _take(img, va), _take(images["h_test"], te), nch)
    ev["y"] = {k: dataset_labels(ev["sets"][k]) for k in ("p_val", "h_train", "h_test")}
    return ev


def _variants(rc: RunConfig) -> list[tuple[str, str, DeepOptions]]:
    """(row, method, options) of every immunization of a seed: each method, at each sweep point
    (the balance b of the paper's loop, ``rule="sgd"``)."""
    if not rc.sweep:
        return [(m, m, rc.options) for m in rc.methods]
    return [
        (
            f"{m}@{b:g}" + ("" if bi is None else f"/{bi:g}"),
            m,
            replace(rc.options, balance=b, balance_ill=bi, rule="sgd"),
        )
        for m in rc.methods
        for b, bi in rc.sweep
    ]


def run_seed(
    rc: RunConfig, seed: int, opts: RunOptions, ctx, say, on_extractor=None, *, defer=None
) -> "dict | None":
    """θ₀, every immunization and every measurement of one seed; rank 0 returns the rows.  With a
    list ``defer`` the operators are not run: each row appends its :class:`OperatorJob` to it
    and the caller runs them (:func:`run_operator_job`) and completes the seed
    (:func:`complete_seed`)."""
    seconds, rng = {}, np.random.default_rng(seed)
    phase = clock(seconds)
    torch.manual_seed(seed)
    images, ncp, nch = load_data(rc, opts, rng)
    if opts.checkpoint:
        net, _ = load_model(opts.checkpoint, rc.model, **rc.model_kwargs)
        if net.classifier.out_features != ncp:
            raise DataError(
                f"{opts.checkpoint}: {net.classifier.out_features} classes, D_P has {ncp}"
            )
    else:
        net = create_model(rc.model, ncp, pretrained=opts.pretrained, seed=seed, **rc.model_kwargs)
    with phase("theta0"):
        if rc.theta0_epochs and not opts.checkpoint and not opts.pretrained:
            if ctx.is_main:
                train_classifier(
                    net,
                    images["p_train"],
                    epochs=rc.theta0_epochs,
                    lr=rc.theta0_lr,
                    seed=seed,
                    device=ctx.device,
                )
            broadcast_module(net)
    theta0 = net if isinstance(net, ImmunizedNet) else ImmunizedNet(net)
    theta0.to(ctx.device).eval().requires_grad_(False)
    cached, kind = rc.options.scope == "layer", rc.options.harden
    with phase("cache"):
        data = {
            k: prelogits_dataset(theta0, d, batch_size=rc.eval_batch) if cached else d
            for k, d in images.items()
        }
    ev = eval_sets(data, images, cached, rc, seed, nch)
    ref = {
        k: extract(theta0, d, cached=cached, batch_size=rc.eval_batch)
        for k, d in ev["sets"].items()
    }
    rows, errors = {}, {}
    ceiling, window, why = attainability(
        ref["p_pool"], ref["h_train"][ev["h_pool_idx"]], precision=theta0.layer.weight.dtype
    )
    reach = {"ceiling": ceiling, "window": window and window.to_dict(), "why": why}

    blob = None  # θ₀ saved once for every deferred row

    def measure(row, model):
        nonlocal blob
        variants = {row: (model, None)}
        if kind != "none":
            h = copy.deepcopy(model)
            info = harden(
                h,
                data["h_train"],
                kind,
                num_classes=nch,
                rng=np.random.default_rng([seed, 99]),
                scale=rc.options.harden_scale,
                cached=cached,
                batch_size=rc.eval_batch,
            )
            variants[f"{row}+{kind}"] = (h, info)
        for key, (m, hardening) in variants.items():
            rows[key] = {
                **evaluate_extractor(m, ref, ev, rc, seed, phase, operators=defer is None),
                "hardening": hardening,
            }
            if defer is not None:
                blob = blob or _saved(theta0)
                changed = _changed(m, theta0)
                defer.append(
                    OperatorJob(
                        rc,
                        seed,
                        key,
                        blob if changed is not None else _saved(m),
                        changed or {},
                        ev["attack"],
                        rows[key].pop("operator_features"),
                    )
                )
            if on_extractor and (path := on_extractor(m, key, seed, "immunized")):
                rows[key]["extractor"] = path
            r = rows[key]["rir"]
            say(
                f"[{rc.name} seed {seed}] {key:24s} RIR_θ₀ {r['value']:.4g}  (i) "
                f"{r['harmful_ratio']:.4g}  (ii) {r['pretrain_ratio']:.4g}  D_P top-1 "
                f"{rows[key]['dp_top1']:.2f}%"
            )

    if ctx.is_main:
        measure("init", theta0)
    for row, method, o in _variants(rc):
        model = copy.deepcopy(theta0)
        try:
            with phase("immunize"):
                res = immunize_in_place(
                    model,
                    data["p_train"],
                    data["h_train"],
                    method,
                    replace(o, harden="none"),
                    seed=seed,
                    num_classes_h=nch,
                    cached=cached,
                    device=ctx.device,
                    rank=ctx.rank,
                    world=ctx.world,
                    ddp=ctx.world > 1,
                    progress=not opts.quiet,
                )
        except NonFiniteLossError as exc:
            say(f"[{rc.name} seed {seed}] {exc}")
            path = (
                on_extractor(model, row, seed, "last_good")
                if on_extractor and ctx.is_main
                else None
            )
            errors[row] = {
                "message": str(exc),
                "step": exc.step,
                "checkpoint": path,
                "parameter": exc.parameter,
            }
            continue
        if ctx.is_main:
            measure(row, model)
            for key in (row, f"{row}+{kind}"):
                if key in rows:
                    rows[key]["train"] = {
                        "steps": res.steps,
                        "lambdas": res.lambdas,
                        "reason": res.stopped,
                    }
    barrier()
    result = (
        {
            "seed": seed,
            "rows": rows,
            "errors": errors,
            "phase_seconds": seconds,
            "classes": [ncp, nch],
            "attainability": reach,
            # D_P's majority class share (%): the accuracy of a θ₀ that learned nothing
            "dp_chance": chance_accuracy(ev["y"]["p_val"]),
        }
        if ctx.is_main
        else None
    )
    return result if defer is not None or result is None else complete_seed(result)


def complete_seed(result: dict) -> dict:
    """The seed's audits, once every row has its operators: each operator against the same
    operator on θ₀."""
    rows = result["rows"]
    if "init" in rows:
        ref_ops = _curves(rows["init"])
        for r in rows.values():
            r["audit"] = compare(_curves(r), ref_ops).to_dict()
    return result


@dataclass(frozen=True)
class OperatorJob:
    """One row's operators, to run in another process: a base model as ``torch.save``'s bytes (θ₀,
    shared by the seed's rows and sent as bytes, not as shared-memory tensors; the row itself
    when it differs from θ₀ in structure) and the row's tensors that differ from it (on the CPU),
    the attacker's images and the row's features."""

    rc: RunConfig
    seed: int
    row: str
    base: bytes
    changed: dict
    attack: AttackData
    features: tuple

    def model(self) -> torch.nn.Module:
        """The row's model, bit for bit."""
        m = torch.load(io.BytesIO(self.base), weights_only=False)
        m.load_state_dict(self.changed, strict=False)
        return m


def _saved(model) -> bytes:
    buf = io.BytesIO()
    torch.save(model, buf)
    return buf.getvalue()


def _changed(model, theta0) -> "dict | None":
    """The tensors of ``model`` that differ from ``theta0``'s, on the CPU (θ₀ plus these is
    ``model``); None when the two differ in structure."""
    mine, base = model.state_dict(), theta0.state_dict()
    if (
        type(model) is not type(theta0)
        or mine.keys() != base.keys()
        or any(v.shape != base[k].shape or v.dtype != base[k].dtype for k, v in mine.items())
    ):
        return None
    return {k: v.detach().cpu().clone() for k, v in mine.items() if not torch.equal(v, base[k])}


def run_operator_job(job: OperatorJob) -> tuple[str, dict, dict]:
    """``(row, its operators, {"wall", "cpu"} seconds)`` of :class:`OperatorJob` ``job``."""
    seconds = {}
    with clock(seconds)("operators"):
        ops = row_operators(job.model(), job.attack, job.rc, job.seed, job.features)
    return job.row, ops, seconds["operators"]


def _curves(row: dict) -> dict:
    """A measured row's operators as ``{name: OperatorCurve}``."""
    return {
        k: OperatorCurve(
            **{
                **v,
                "epochs": tuple(v["epochs"]),
                "test_accuracy": tuple(v["test_accuracy"]),
                "grid": tuple(map(tuple, v["grid"])),
            }
        )
        for k, v in row["operators"].items()
    }


def _curve(curves) -> dict:
    a = np.asarray(curves, dtype=float)
    return {k: getattr(np, k)(a, 0).tolist() for k in ("mean", "std", "min", "max")}


# Each headline number of a row: its path in a seed's row.
HEADLINE = {
    "rir_theta0": ("rir", "value"),
    "harmful_ratio": ("rir", "harmful_ratio"),
    "pretrain_ratio": ("rir", "pretrain_ratio"),
    "groups_rir_theta0": ("rir_groups", "value", "mean"),
    "groups_harmful_ratio": ("rir_groups", "harmful_ratio", "mean"),
    "groups_pretrain_ratio": ("rir_groups", "pretrain_ratio", "mean"),
    "dp_top1": ("dp_top1",),
    "probe_acc_epoch10": ("probe_acc_epoch10",),
    "probe_acc_last": ("probe_acc_last",),
    "harmful_top_ratio": ("harmful_spread", "top"),
    "harmful_bottom_ratio": ("harmful_spread", "bottom"),
    "worst_deficit": ("audit", "worst_deficit"),
    "worst_signed_rfd": ("audit", "worst_signed_rfd"),
}
# Per operator of a row's audit: each number's key in an OperatorComparison.
OPERATOR_NUMBERS = ("mean_deficit", "signed_rfd", "rfd")


def aggregate(per_seed: list[dict], order: list[str]) -> dict:
    """Per row, over the seeds that have it: each headline number's ``{mean, std, per_seed}``, the
    counts meeting Definition 3.1 (whole pools; the paper's groups), the probe curve, and per
    operator the accuracy curves of model and θ₀ and the signed deficit, signed RFD and RFD;
    the worst operator of each seed."""
    rows = {}
    for m in order:
        runs = [s["rows"][m] for s in per_seed if m in s["rows"]]
        if not runs:
            continue
        audits = [r["audit"]["operators"] for r in runs]
        rows[m] = {
            "seeds": [s["seed"] for s in per_seed if m in s["rows"]],
            **{
                k: summarize(reduce(getitem, path, r) for r in runs)
                for k, path in HEADLINE.items()
            },
            "immunized_count": sum(bool(r["immunized"]) for r in runs),
            "immunized_groups_count": sum(bool(r["immunized_groups"]) for r in runs),
            "probe_curve": _curve([r["probe"] for r in runs]),
            "worst": [r["audit"]["worst"] for r in runs],
            "operators": {
                op: {
                    "epochs": audits[0][op]["epochs"],
                    "model": _curve([a[op]["model"] for a in audits]),
                    "reference": _curve([a[op]["reference"] for a in audits]),
                    "best_so_far_model": _curve([a[op]["best_so_far_model"] for a in audits]),
                    "settings": [a[op]["model_setting"] for a in audits],
                    **{k: summarize(a[op][k] for a in audits) for k in OPERATOR_NUMBERS},
                }
                for op in audits[0]
            },
        }
    return rows


def _result(rc: RunConfig, opts: RunOptions, seeds, per_seed, order, t0, **extra) -> dict:
    phases = {}
    for s in per_seed:
        for k, v in s["phase_seconds"].items():
            t = phases.setdefault(k, {"wall": 0.0, "cpu": 0.0})
            t["wall"], t["cpu"] = t["wall"] + v["wall"], t["cpu"] + v["cpu"]
    shape = ", ".join(f"{k} {v}" for k, v in rc.model_kwargs.items())
    return {
        "config": rc.name,
        "model": rc.model,
        "model_text": rc.model + (f" ({shape})" if shape else ""),
        "data": "MNIST digits 0-4 (D_P) vs 5-9 (D_H)"
        if rc.data == "mnist"
        else f"D_P {opts.dp_root} vs D_H {opts.dh_root}",
        "scope": rc.options.scope,
        "seeds": list(seeds),
        "threads": torch.get_num_threads(),
        "run_config": asdict(rc),
        "rows": aggregate(per_seed, order),
        "per_seed": per_seed,
        "errors": {f"seed{s['seed']}": s["errors"] for s in per_seed if s["errors"]},
        "wall_seconds": time.perf_counter() - t0,
        "phase_seconds": phases,
        "environment": environment(),
        **extra,
    }


def _worker_torch(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)


def _seed_job(job) -> tuple[dict, list]:
    """One (configuration, seed) in a worker process of :func:`run_configs` (world size 1), its
    rows' operators left to the pool: ``(seed result, [(OperatorJob, threads), ...])``."""
    rc, seed, opts, device, threads, on_extractor = job
    _worker_torch(threads)
    say = (lambda *a, **k: None) if opts.quiet else print
    deferred = []
    result = run_seed(rc, seed, opts, init_from_env(device), say, on_extractor, defer=deferred)
    return result, [(d, threads) for d in deferred]


def _operator_job(job) -> tuple[str, dict, dict]:
    """One row's operators in a worker process of :func:`run_configs`."""
    job, threads = job
    _worker_torch(threads)
    return run_operator_job(job)


def _with_operators(result: dict, done: list) -> dict:
    """A deferred seed ``result`` with its rows' operators and their seconds, audited."""
    total = result["phase_seconds"].setdefault("operators", {"wall": 0.0, "cpu": 0.0})
    for row, ops, seconds in done:
        result["rows"][row]["operators"] = ops
        total["wall"] += seconds["wall"]
        total["cpu"] += seconds["cpu"]
    return complete_seed(result)


def run_configs(
    rcs: list, seeds: list[int], opts: RunOptions, ctx, *, on_extractor=None, jobs: int = 1
) -> "list | None":
    """Every seed of every configuration in ``rcs``; rank 0 returns per configuration ``rows``
    (:func:`aggregate`), ``per_seed``, ``errors``, the wall and per-phase seconds (wall, CPU) and
    the provenance, the other ranks None. With ``jobs > 1`` (one process, no torchrun) the
    (configuration, seed) runs go to that many worker processes, each with this process's torch
    thread count, and each row's operators to whichever worker is free once its seed has
    immunized (one seed's rows no longer wait on one worker): every number is the same as with
    ``jobs = 1``. ``on_extractor(rc)`` gives each configuration's callback ``(model, row, seed,
    status) -> path or None``."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0, threads = time.perf_counter(), torch.get_num_threads()
    say = print if ctx.is_main and not opts.quiet else (lambda *a, **k: None)
    for rc in rcs:
        say(
            f"[{rc.name}] model={rc.model} scope={rc.options.scope} seeds={seeds} "
            f"world={ctx.world} threads={threads} device={ctx.device} jobs={jobs}"
        )
    hook = (lambda rc: None) if on_extractor is None else on_extractor
    if jobs > 1 and ctx.world == 1:
        from experiments.common import pool_chain  # noqa: PLC0415

        todo = [(rc, s, opts, str(ctx.device), threads, hook(rc)) for rc in rcs for s in seeds]
        done = [
            _with_operators(r, ops) for r, ops in pool_chain(_seed_job, _operator_job, todo, jobs)
        ]
        per = [done[i * len(seeds) : (i + 1) * len(seeds)] for i in range(len(rcs))]
    else:
        per = [[run_seed(rc, s, opts, ctx, say, hook(rc)) for s in seeds] for rc in rcs]
    if not ctx.is_main:
        return None
    out = []
    for rc, per_seed in zip(rcs, per):
        rows = ["init", *(row for row, _, _ in _variants(rc))]
        rows += [f"{r}+{rc.options.harden}" for r in rows] if rc.options.harden != "none" else []
        out.append(_result(rc, opts, seeds, per_seed, rows, t0, world=ctx.world, jobs=jobs))
    return out


def run_config(
    rc: RunConfig, seeds: list[int], opts: RunOptions, ctx, *, on_extractor=None
) -> "dict | None":
    """:func:`run_configs` of one configuration, in this process."""
    hook = None if on_extractor is None else (lambda _: on_extractor)
    res = run_configs([rc], seeds, opts, ctx, on_extractor=hook)
    return None if res is None else res[0]


def audit(
    model,
    reference,
    data: dict,
    rc: RunConfig,
    seeds: list[int],
    opts: RunOptions,
    *,
    classes_h: int,
) -> dict:
    """Any extractor ``model`` against a θ₀ ``reference`` (both ImmunizedNet, each run end to end
    on the images ``data``): :func:`run_config`'s result with the rows ``"init"`` (θ₀) and
    ``"model"``."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0, per_seed = time.perf_counter(), []
    for seed in seeds:
        seconds = {}
        ev = eval_sets(data, data, False, rc, seed, classes_h)
        ref = {
            k: extract(reference, d, batch_size=rc.eval_batch, data_name=k, model_name="reference")
            for k, d in ev["sets"].items()
        }
        rows = {
            k: evaluate_extractor(m, ref, ev, rc, seed, clock(seconds), name=name)
            for k, m, name in (("init", reference, "reference"), ("model", model, "model"))
        }
        for r in rows.values():
            r["audit"] = compare(_curves(r), _curves(rows["init"])).to_dict()
        if not opts.quiet:
            print(
                f"[audit seed {seed}] RIR_θ₀ {rows['model']['rir']['value']:.4g} "
                " D_P top-1 "
                f"{rows['model']['dp_top1']:.2f}% (θ₀ {rows['init']['dp_top1']:.2f}%)"
            )
        per_seed.append({"seed": seed, "rows": rows, "errors": {}, "phase_seconds": seconds})
    return _result(rc, opts, seeds, per_seed, ["init", "model"], t0)
