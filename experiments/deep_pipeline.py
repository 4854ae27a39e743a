"""The deep-net experiment over seeds on pycore.deep (docs/findings.md §7; paper §5.2, Table 3,
Figure 3).

Per seed: the images split so that the attacker's are disjoint from every image the defense saw
(:class:`Sizes`; θ₀'s own images do not depend on the attacker's setting); θ₀ (trained on D_P
here, loaded, or pretrained); θ₀'s side of the judge on the attacker's images
(:func:`pycore.deep.reference_path`: every operator's plateau on θ₀, the one target, scratch, the
FLOP cap, the cheapest path on θ₀, the ceiling); then every row of the configuration immunizes a
copy of θ₀ and is measured: D_P top-1; (i), (ii), RIR_θ₀ and Definition 3.1 on the defense's rows
(exact κ's) and by the paper's groups; the GD probe curve of Figure 3 on the attacker's images;
the attacker's cheapest path on it and what the defense is worth
(:func:`pycore.deep.cheapest_path`, :func:`pycore.deep.worth`); full fine-tuning on fresh D_P
images against θ₀'s (the deep (ii), ``dp_finetune``); and, on the seeds asked, the judge again
with several times the attacker's images. Everything random is seeded from the seed, torch runs
deterministic algorithms: one seed and thread count give one set of digits.

The measurements are frozen dataclasses (:class:`RowResult`, :class:`SeedResult`,
:class:`RowSummary`) with ``to_dict()``; results.json is their JSON."""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, TensorDataset

from pycore import feature_rir, grouped_feature_rir, immunized_def31
from pycore._evaluate import chance_accuracy
from pycore._options import Options
from pycore._spectral import gram_spectrum
from pycore._threads import bounded_blas
from pycore.deep import (
    OPERATORS,
    AttackData,
    CheapestPath,
    DataError,
    DeepOptions,
    GroupedRIR,
    ImmunizedNet,
    NonFiniteLossError,
    ReferencePath,
    Worth,
    _slowdown as slowdown,
    cheapest_path,
    create_model,
    image_folder,
    load_model,
    mnist_digits,
    reference_path,
    worth,
)
from pycore.deep._data import ShardedBatches, dataset_labels, fetch, model_normalization
from pycore.deep._distributed import barrier, broadcast_module, init_from_env
from pycore.deep._features import extract, prelogits_dataset
from pycore.deep._layer import attainability
from pycore.deep._models import tail_modules
from pycore.deep._operators import LORA_RANKS, Schedule, operator, retrain_scope
from pycore.deep._probes import linear_probe_curve
from pycore.deep._slowdown import Budget
from pycore.deep._train import immunize_in_place
from pycore.report import environment, summarize


@dataclass(frozen=True)
class Row:
    """One immunization of every seed: its key in the results, the method and its options (the
    method's own option set: :class:`~pycore.deep.DeepOptions`, or
    :class:`~pycore.deep.SimulatedOptions`), and how tables label it."""

    name: str
    method: str
    options: Options = field(default_factory=DeepOptions)
    label: str = ""

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "method": self.method,
            "options": self.options.to_dict(),
            "label": self.label,
        }


@dataclass(frozen=True)
class Sizes:
    """Images per split. ``defense``: per task, the images the defense immunizes with; ``dp_val``:
    D_P's validation images (D_P top-1); ``dp_finetune``: with ``dp_attack``, the training,
    validation and test images of fresh D_P data for the D_P fine-tuning check; θ₀ trains on the
    defense's D_P images and every D_P image no other split holds, none of which depends on the
    attacker's setting. The attacker's D_H splits (``attack_*``, disjoint from the defense's):
    its validation and test splits are cut before its training images, so that they too stay the
    same for any ``attack_train``; ``more_data``: the second attacker's training images as a
    multiple of ``attack_train`` (1: none)."""

    defense: int = 960
    dp_val: int = 250
    attack_train: int = 128
    attack_val: int = 128
    attack_test: int = 256
    more_data: int = 4
    dp_attack: bool = True
    dp_finetune: tuple = (128, 128, 256)


@dataclass
class RunConfig:
    """One experiment: the timm model, the data, the rows and the evaluation sizes.

    ``operators`` run on θ₀ (they set the target) and ``row_operators`` (default: the same) on
    every row; ``scratch_max_steps`` bounds scratch's race to the target; ``reference_race``
    races θ₀'s operators in FLOPs as a model's (θ₀'s cheapest path exact, the others' costs
    lower bounds: :func:`pycore.deep.reference_path`); ``target_operators`` are those whose
    plateaus on θ₀ set the target (default: every probe, LoRA and fine-tuning operator);
    ``seconds`` is the
    expected CPU-seconds of θ₀'s side and of one row on one seed (the progress line's estimate of
    the time left, corrected by the speed observed)."""

    name: str
    model: str  # a timm model name
    data: str  # "folders" | "mnist"
    rows: tuple = ()
    model_kwargs: dict = field(default_factory=dict)
    theta0_epochs: int = 0  # θ₀ trained here on D_P (no checkpoint, not pretrained)
    theta0_lr: float = 1e-3
    sizes: Sizes = field(default_factory=Sizes)
    rir_groups: int = 20
    rir_group_size: int = 100
    probe_epochs: int = 60
    eval_batch: int = 256
    operators: tuple = OPERATORS
    row_operators: tuple | None = None
    lora_ranks: tuple = LORA_RANKS
    schedule: Schedule = field(default_factory=Schedule)
    scratch_max_steps: int = 600
    reference_race: bool = False  # θ₀'s operators raced as a model's (the quick demo)
    dp_check: bool = True  # the D_P fine-tuning check (its splits are cut either way)
    target_operators: tuple | None = None  # those whose θ₀ plateaus set the target (None: all)
    more_data_seeds: tuple = (0,)  # the seeds the attacker with more images is run on
    seconds: tuple = (600.0, 60.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["rows"] = [r.to_dict() for r in self.rows]
        return out


@dataclass
class RunOptions:
    """What is not a hyper-parameter: data roots, the θ₀ source."""

    dp_root: str | None = None
    dh_root: str | None = None
    val_split: str = "val"
    checkpoint: str | None = None
    pretrained: bool = False
    quiet: bool = False
    cache: str | None = None  # a folder: θ₀ and θ₀'s side kept between runs (Cache)


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
        # shuffled batches: the splits are stored in class order, and batches of one class
        # would average within-class variances only (eval-mode BatchNorm then over-amplifies)
        for (idx,) in batches.epoch(epochs) if bns else ():
            net(fetch(data, idx)[0].to(device))
        for m, momentum in bns.items():
            m.momentum = momentum
    net.eval().requires_grad_(False)


def _take(ds, idx: np.ndarray):
    """Rows ``idx`` of ``ds``: a TensorDataset of them, or a Subset of an image folder."""
    if isinstance(ds, TensorDataset):
        return TensorDataset(*(t[torch.from_numpy(idx)] for t in ds.tensors))
    return Subset(ds, idx.tolist())


# the fewest images a split is shrunk to (an attacker's validation split of 8 reads accuracies in
# steps of 12.5 points: below that no plateau means anything)
MIN_SPLIT_IMAGES = 8


def _fit(sizes: dict, n: int, name: str, argument: str) -> list[int]:
    """``sizes`` (split → images) scaled by one factor so that their sum fits in ``n`` images
    (unchanged when it does); a split that would fall below :data:`MIN_SPLIT_IMAGES` is a
    DataError naming the task, the images it needs and the folder's ``argument``."""
    k = list(sizes.values())
    if sum(k) <= n:
        return k

    def shrunk(m: int) -> list[int]:
        return [int(x * m / sum(k)) for x in k]

    out = shrunk(n)
    if min(out) < MIN_SPLIT_IMAGES:
        enough = (m for m in range(n + 1, sum(k)) if min(shrunk(m)) >= MIN_SPLIT_IMAGES)
        need = next(enough, sum(k))
        split = ", ".join(f"{s} {x}" for s, x in sizes.items())
        raise DataError(
            f"{name}'s training folder has {n} images; it needs at least {need}: its splits "
            f"({split}) shrink alike to the images there are, each to {MIN_SPLIT_IMAGES} or more",
            argument=argument,
        )
    return out


def _parts(ds, sizes: list[int], rng, name: str) -> list:
    """Consecutive parts of one seeded permutation of ``ds`` with ``sizes`` images each."""
    need = sum(sizes)
    if need > len(ds):
        raise DataError(
            f"{name} has {len(ds)} images; this configuration's splits need {need} "
            f"({' + '.join(map(str, sizes))})"
        )
    perm = rng.permutation(len(ds))
    cuts = np.cumsum([0, *sizes])
    return [_take(ds, np.sort(perm[a:b])) for a, b in zip(cuts[:-1], cuts[1:])]


@dataclass(frozen=True)
class Splits:
    """One seed's images: the defense's (``p_train``, ``h_train``), D_P's validation split, the
    attacker's D_H data (and with more images), fresh D_P data to fine-tune on, and θ₀'s training
    images (``theta0_train``: the defense's D_P images and every D_P image no other split holds,
    so that θ₀ is trained as a released model is, on all the pre-training data there is)."""

    p_train: object
    p_val: object
    h_train: object
    attack: AttackData
    attack_more: AttackData | None
    dp_attack: AttackData | None
    classes: tuple
    theta0_train: object


def _join(a, b):
    """The images of two parts of one data set."""
    if isinstance(a, TensorDataset):
        return TensorDataset(*(torch.cat(t) for t in zip(a.tensors, b.tensors)))
    return Subset(a.dataset, sorted([*a.indices, *b.indices]))


# a folder's images are decoded once and held as float32 tensors when they take at most this; a
# larger folder is decoded as it is read (each evaluation decodes its batches again)
HELD_IMAGE_BYTES = 1 << 30


class HeldImages(Dataset):
    """An image folder's ``(image, class)`` pairs decoded once, in the folder's order (so that
    every part taken of it holds the same images as a part of the folder would): ``classes`` and
    ``targets`` as the folder's."""

    def __init__(self, folder):
        self.classes, self.targets = folder.classes, folder.targets
        self.images, self.labels = fetch(folder, torch.arange(len(folder)))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


def _held(folder, side: int):
    """``folder`` decoded once (:class:`HeldImages`) when its images fit in
    :data:`HELD_IMAGE_BYTES`, else as it is."""
    return HeldImages(folder) if len(folder) * 3 * 4 * side**2 <= HELD_IMAGE_BYTES else folder


def load_splits(rc: RunConfig, opts: RunOptions, seed: int) -> Splits:
    """The images of every split (:class:`Sizes`), decoded for the model: MNIST digits 0-4 (D_P)
    and 5-9 (D_H), or the ImageFolder roots (D_H's ``val`` split is the attacker's test split),
    each folder decoded once when it fits (:func:`_held`)."""
    probe = create_model(rc.model, 1, seed=0, **rc.model_kwargs)  # its data config only
    z = rc.sizes
    more = z.attack_train * max(z.more_data, 1)
    # D_P's splits have sizes of their own (not the attacker's): θ₀'s images, the rest of D_P,
    # are the same whatever the attacker's setting
    dp_sizes = {
        "defense": z.defense,
        "validation": z.dp_val,
        **(
            dict(zip(("fine-tuning train", "watch", "test"), z.dp_finetune)) if z.dp_attack else {}
        ),
    }
    if rc.data == "mnist":
        p_all, h_all = mnist_digits(probe, (0, 1, 2, 3, 4)), mnist_digits(probe, (5, 6, 7, 8, 9))
        # the attacker's validation and test splits before its training pool: the same images
        # for any number of training images
        h_sizes = {
            "defense": z.defense,
            "watch": z.attack_val,
            "test": z.attack_test,
            "attack": more,
        }
        ncp = nch = 5
        h_test = None
    else:
        side = model_normalization(probe)["input_size"][-1]
        sets = {
            f"{t}_{s}": _held(image_folder(root, split, probe), side)
            for t, root in (("p", opts.dp_root), ("h", opts.dh_root))
            for s, split in (("train", "train"), ("val", opts.val_split))
        }
        for root, tr, va in (
            (opts.dp_root, "p_train", "p_val"),
            (opts.dh_root, "h_train", "h_val"),
        ):
            if sets[tr].classes != sets[va].classes:
                raise DataError(
                    f"{root}: train/ and {opts.val_split}/ hold different class folders"
                )
        p_all, h_all, h_test = sets["p_train"], sets["h_train"], sets["h_val"]
        h_sizes = {"defense": z.defense, "watch": z.attack_val, "attack": more}
        ncp, nch = len(sets["p_train"].classes), len(sets["h_train"].classes)
    if rc.data != "mnist":  # your own folders: every split shrunk alike to the images there are
        dp_sizes = _fit(dp_sizes, len(p_all), "D_P", "dp_root")
        h_sizes = _fit(h_sizes, len(h_all), "D_H", "dh_root")
    else:
        dp_sizes, h_sizes = list(dp_sizes.values()), list(h_sizes.values())
    # the rest of D_P last, so the other parts do not depend on how many images there are
    rest = max(len(p_all) - sum(dp_sizes), 0)
    p = _parts(p_all, [*dp_sizes, rest], np.random.default_rng([seed, 1]), "D_P")
    h = _parts(h_all, h_sizes, np.random.default_rng([seed, 2]), "D_H")
    if h_test is None:
        h_val, h_test, more_train = h[1], h[2], h[3]
    else:
        h_val, more_train = h[1], h[2]
        if len(h_test) > z.attack_test:
            h_test = _parts(h_test, [z.attack_test], np.random.default_rng([seed, 3]), "D_H test")
            h_test = h_test[0]
    # the attacker with more images has all of the pool; the other a seeded part of it
    pick = np.random.default_rng([seed, 4]).permutation(len(more_train))[: z.attack_train]
    attack_train = _take(more_train, np.sort(pick))
    attack = AttackData(attack_train, h_val, h_test, nch)
    attack_more = AttackData(more_train, h_val, h_test, nch) if z.more_data > 1 else None
    dp_attack = AttackData(p[2], p[3], p[4], ncp) if z.dp_attack else None
    return Splits(p[0], p[1], h[0], attack, attack_more, dp_attack, (ncp, nch), _join(p[0], p[-1]))


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


@dataclass(frozen=True)
class FinetuneReference:
    """θ₀'s side of the D_P fine-tuning check: full fine-tuning's plateau on fresh D_P images, the
    target it sets, and θ₀'s steps to it (the deep (ii): D_P must stay as easy to fine-tune)."""

    budget: Budget
    target: float
    steps: int | None

    def to_dict(self) -> dict:
        return {"budget": self.budget.to_dict(), "target": self.target, "steps": self.steps}


# a model on which D_P fine-tuning needs this many times θ₀'s steps is censored there
FINETUNE_CAP = 10.0


@dataclass(frozen=True)
class FinetuneCheck:
    """Full fine-tuning on fresh D_P images against θ₀'s: the model's steps to θ₀'s target over
    θ₀'s (``censored``: not within :data:`FINETUNE_CAP` times θ₀'s steps, a lower bound)."""

    slowdown: float
    censored: bool
    steps: int | None
    reference_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def finetune_reference(theta0, data: AttackData, rc: RunConfig, seed: int) -> FinetuneReference:
    op = operator(theta0, data, "finetune_full", seed=seed, schedule=rc.schedule)
    b = slowdown.budget(
        op.name,
        op.make,
        op.grid,
        chance=data.chance,
        min_steps=op.min_steps,
        max_steps=op.max_steps,
    )
    target = slowdown.target_level(data.chance, b.plateau)
    r = slowdown.reach(op.name, op.make, b.grid, target=target, limit=b.run_steps)
    return FinetuneReference(b, target, r.steps)


def finetune_check(model, data: AttackData, ref: FinetuneReference, rc, seed) -> FinetuneCheck:
    op = operator(model, data, "finetune_full", seed=seed, schedule=rc.schedule)
    cap = math.ceil(FINETUNE_CAP * ref.steps)
    r = slowdown.reach(op.name, op.make, ref.budget.grid, target=ref.target, limit=cap)
    censored = r.steps is None or r.steps >= FINETUNE_CAP * ref.steps
    return FinetuneCheck(
        FINETUNE_CAP if censored else r.steps / ref.steps,
        bool(censored),
        r.steps,
        ref.steps,
    )


@dataclass(frozen=True)
class Judged:
    """One model judged on one attacker data set: its cheapest path and its worth."""

    path: CheapestPath
    worth: Worth

    def to_dict(self) -> dict:
        return {**self.worth.to_dict(), **self.path.to_dict()}


@dataclass(frozen=True)
class RowResult:
    """One row of one seed (module docstring): D_P top-1 (%); (i), (ii), RIR_θ₀ on the defense's
    rows and by the paper's groups, Definition 3.1 on each; where (i) comes from; the GD probe's
    D_H test accuracy per epoch (Figure 3); the attacker's cheapest path and the defense's worth
    (``judged``), full fine-tuning on fresh D_P images (``dp_finetune``), the judge with more
    images (``more_data``); how training went."""

    row: str
    method: str
    dp_top1: float
    harmful_ratio: float
    pretrain_ratio: float
    rir: float
    grouped: GroupedRIR
    immunized: bool
    harmful_spread: dict
    probe: tuple
    judged: Judged | None = None
    dp_finetune: FinetuneCheck | None = None
    more_data: Judged | None = None
    train: dict = field(default_factory=dict)
    retrain_scope: tuple | None = None
    extractor: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["grouped"] = {**asdict(self.grouped), "immunized": self.grouped.immunized}
        out["immunized_groups"] = self.grouped.immunized
        for k in ("judged", "more_data", "dp_finetune"):
            out[k] = None if getattr(self, k) is None else getattr(self, k).to_dict()
        return out


@dataclass(frozen=True)
class SeedResult:
    """One seed: θ₀'s own row and its side of the judge (D_H, D_P fine-tuning, more images),
    every row, the rows that failed, what any θ of the layer can do on θ₀'s features, the
    classes, chance on D_P, the seconds per phase and the images of each split
    (:func:`split_images`)."""

    seed: int
    theta0: RowResult
    reference: ReferencePath
    dp_reference: FinetuneReference | None
    more_reference: ReferencePath | None
    rows: dict
    errors: dict
    attainability: dict
    classes: tuple
    dp_chance: float
    phase_seconds: dict
    images: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return _chosen_traces(
            {
                "seed": self.seed,
                "theta0": self.theta0.to_dict(),
                "reference": self.reference.to_dict(),
                "dp_reference": self.dp_reference and self.dp_reference.to_dict(),
                "more_reference": self.more_reference and self.more_reference.to_dict(),
                "rows": {k: r.to_dict() for k, r in self.rows.items()},
                "errors": self.errors,
                "attainability": self.attainability,
                "classes": list(self.classes),
                "dp_chance": self.dp_chance,
                "phase_seconds": self.phase_seconds,
                "images": self.images,
            }
        )


def _chosen_traces(d):
    """``d`` with every budget's traces cut to the setting it chose (results.json keeps the
    curve each number was read from, not every setting's)."""
    if isinstance(d, dict):
        out = {k: _chosen_traces(v) for k, v in d.items()}
        if "traces" in out and isinstance(out["traces"], (list, tuple)) and "setting" in out:
            out["traces"] = [t for t in out["traces"] if t["label"] == out["setting"]]
        return out
    if isinstance(d, (list, tuple)):
        return [_chosen_traces(v) for v in d]
    return d


@dataclass(frozen=True)
class Evaluation:
    """What every row of a seed is measured against: the defense's pools and θ₀'s features of
    them, D_P's validation split, the attacker's data, θ₀'s sides of the judge."""

    pools: dict
    reference: dict
    splits: Splits
    attack: ReferencePath
    dp_reference: FinetuneReference | None
    more: ReferencePath | None
    rc: RunConfig
    seed: int


@bounded_blas
def measure(model, ev: Evaluation, row: Row, phase, *, name=None) -> RowResult:
    """Every number of one row but the attackers' (:class:`RowResult`) for ``model`` against θ₀
    (``ev``); ``name``: the argument a non-finite feature's error names (``model``)."""
    rc, seed, sp = ev.rc, ev.seed, ev.splits
    with phase("features_rir"):
        f = {
            k: extract(model, d, batch_size=rc.eval_batch, data_name=k, model_name=name)
            for k, d in ev.pools.items()
        }
        head = model.classifier
        with torch.no_grad():
            X = torch.from_numpy(f["p_val"]).to(head.weight.device, head.weight.dtype)
            logits = head(X).cpu()
        y_val = dataset_labels(sp.p_val)
        acc = 100.0 * float((logits.argmax(1).numpy() == y_val).mean())
        ref = ev.reference
        pools = (f["p_train"], f["h_train"], ref["p_train"], ref["h_train"])
        r = feature_rir(*pools)
        kw = {"groups": rc.rir_groups, "group_size": rc.rir_group_size}
        g = grouped_feature_rir(*pools, rng=np.random.default_rng([seed, 17]), **kw)
        grouped = GroupedRIR(
            g["harmful_ratio"]["mean"],
            g["pretrain_ratio"]["mean"],
            g["value"]["mean"],
            g["groups"],
            g["group_size"],
        )
        spread = spectrum_spread(
            f["h_train"], ref["h_train"], rng=np.random.default_rng([seed, 18]), **kw
        )
    a = sp.attack
    with phase("probe_curve"):
        Za = {
            k: extract(model, getattr(a, k), batch_size=rc.eval_batch) for k in ("train", "test")
        }
        curve = linear_probe_curve(
            Za["train"],
            dataset_labels(a.train),
            Za["test"],
            dataset_labels(a.test),
            epochs=rc.probe_epochs,
            num_classes=a.classes,
        ).test_accuracy
    return RowResult(
        row.name,
        row.method,
        acc,
        r.harmful_ratio,
        r.pretrain_ratio,
        r.value,
        grouped,
        immunized_def31(r.harmful_ratio, r.pretrain_ratio),
        spread,
        tuple(curve),
    )


def judge(model, theta0, ev: Evaluation, result: RowResult, phase, say=None) -> RowResult:
    """``result`` with the attacker's cheapest path and the defense's worth on the attacker's
    images (:func:`pycore.deep.cheapest_path`), the D_P fine-tuning check and, where θ₀ has it,
    the judge with more images."""
    rc, seed, sp = ev.rc, ev.seed, ev.splits
    kw = dict(seed=seed, schedule=rc.schedule, operators=rc.row_operators)
    names = rc.row_operators or ev.attack.operators
    tell = _progress(say, f"[{rc.name} seed {seed}] {result.row} attacked", names)
    with phase("operators"):
        path = cheapest_path(model, sp.attack, ev.attack, theta0, progress=tell, **kw)
        judged = Judged(path, worth(path, ev.attack))
    dp = more = None
    if ev.dp_reference is not None:
        with phase("dp_finetune"):
            dp = finetune_check(model, sp.dp_attack, ev.dp_reference, rc, seed)
    if ev.more is not None:
        with phase("more_data"):
            p = cheapest_path(model, sp.attack_more, ev.more, theta0, **kw)
            more = Judged(p, worth(p, ev.more))
    return replace(result, judged=judged, dp_finetune=dp, more_data=more)


def _quiet(*_a, **_k) -> None:
    return None


def _progress(say, head: str, operators):
    """The ``progress`` callback of the operators' phases: a line per operator as it starts,
    ``head: name (k/n)`` (the phase runs minutes on a CPU with nothing else to show)."""
    names = list(operators)

    def progress(name):
        if say is not None:
            k = f" ({names.index(name) + 1}/{len(names)})" if name in names else ""
            say(f"{head}: {name}{k}")

    return progress


def _judged(model, theta0, ev: Evaluation, result: RowResult, phase, say=None):
    """``(judge(...), None)``, or ``(None, error)`` when every setting of an operator diverged on
    the row's model (the row is reported as failed, the seed goes on)."""
    try:
        return judge(model, theta0, ev, result, phase, say), None
    except FloatingPointError as exc:
        return None, {"message": str(exc), "step": None, "checkpoint": None, "parameter": None}


def seed_setup(rc: RunConfig, seed: int, opts: RunOptions, ctx, phase, say):
    """θ₀ and its :class:`Evaluation` for one seed: the splits, θ₀ (trained, loaded or
    pretrained), then :func:`evaluation`. Returns ``(θ₀, evaluation, θ₀'s row,
    attainability)``."""
    torch.manual_seed(seed)
    sp = load_splits(rc, opts, seed)
    ncp = sp.classes[0]
    if opts.checkpoint:
        net, _ = load_model(opts.checkpoint, rc.model, **rc.model_kwargs)
        if net.classifier.out_features != ncp:
            raise DataError(
                f"{opts.checkpoint}: {net.classifier.out_features} classes, D_P has {ncp}"
            )
    else:
        net = create_model(rc.model, ncp, pretrained=opts.pretrained, seed=seed, **rc.model_kwargs)
    cache = Cache(opts.cache if ctx.world == 1 else None)
    with phase("theta0"):
        if rc.theta0_epochs and not opts.checkpoint and not opts.pretrained:

            def train():
                if ctx.is_main:
                    say(f"[{rc.name} seed {seed}] θ₀: {rc.theta0_epochs} epochs on D_P")
                    train_classifier(
                        net,
                        sp.theta0_train,
                        epochs=rc.theta0_epochs,
                        lr=rc.theta0_lr,
                        seed=seed,
                        device=ctx.device,
                    )
                broadcast_module(net)
                return net.state_dict()

            z = rc.sizes
            key = ("theta0", rc.model, rc.model_kwargs, rc.theta0_epochs, rc.theta0_lr, seed)
            key += (rc.data, z.defense, z.dp_val, z.dp_finetune if z.dp_attack else ())
            net.load_state_dict(cache.get(key, train))
    theta0 = net if isinstance(net, ImmunizedNet) else ImmunizedNet(net)
    theta0.to(ctx.device).eval().requires_grad_(False)
    ev, row0, reach = evaluation(theta0, sp, rc, seed, phase, say, cache=cache)
    return theta0, ev, row0, reach


class Cache:
    """θ₀ and θ₀'s side of the judge kept in a folder (``RunOptions.cache``) between runs, so that
    rerunning a row does not rerun them. An entry's name is a hash of everything it depends on:
    its key (the configuration's fields and the seed it was computed from, θ₀'s weights for θ₀'s
    side) and the source of the code that computes it (pycore/deep and this module), so an entry
    of other code or another setting is never read. Entries are written whole (a temporary file
    renamed into place); without a folder nothing is kept."""

    def __init__(self, folder):
        self.folder = None if folder is None else Path(folder)

    @staticmethod
    def _code() -> bytes:
        import pycore.deep  # noqa: PLC0415

        files = sorted(Path(pycore.deep.__file__).parent.glob("*.py")) + [Path(__file__)]
        return b"".join(f.read_bytes() for f in files)

    def _path(self, key) -> Path:
        h = hashlib.sha256(self._code())
        h.update(repr(key).encode())
        return self.folder / f"{key[0]}-{h.hexdigest()[:20]}.pt"

    def get(self, key: tuple, compute):
        if self.folder is None:
            return compute()
        path = self._path(key)
        if path.exists():
            return torch.load(path, weights_only=False)
        value = compute()
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        torch.save(value, tmp)
        os.replace(tmp, path)
        return value


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def evaluation(
    theta0, sp: Splits, rc: RunConfig, seed: int, phase, say, name=None, cache: Cache = None
):
    """What every row of a seed is measured against (:class:`Evaluation`): θ₀'s features of the
    defense's pools, what any θ of the layer can do on them, θ₀'s side of the judge on the
    attacker's images (and, on the seeds asked, with more images), θ₀'s D_P fine-tuning; θ₀'s own
    row (``name``: the argument a non-finite feature's error names). Returns ``(evaluation, θ₀'s
    row, attainability)``."""
    pools = {"p_train": sp.p_train, "h_train": sp.h_train, "p_val": sp.p_val}
    reference = {
        k: extract(theta0, d, batch_size=rc.eval_batch, data_name=k, model_name=name)
        for k, d in pools.items()
    }
    ceiling, window, why = attainability(
        reference["p_train"], reference["h_train"], precision=theta0.layer.weight.dtype
    )
    reach = {"ceiling": ceiling, "window": window and window.to_dict(), "why": why}
    kw = dict(
        seed=seed,
        schedule=rc.schedule,
        lora_ranks=rc.lora_ranks,
        scratch_max_steps=rc.scratch_max_steps,
        race=rc.reference_race,
        setting=rc.target_operators,
    )

    tell = _progress(say, f"[{rc.name} seed {seed}] θ₀", rc.operators)

    cache = cache or Cache(None)
    key = (_weights_digest(theta0), seed, rc.operators, rc.lora_ranks, rc.schedule)
    key += (rc.scratch_max_steps, rc.reference_race, rc.target_operators, rc.sizes, rc.model)
    key += (rc.model_kwargs,)
    with phase("reference"):
        attack = cache.get(
            ("reference", *key),
            lambda: reference_path(theta0, sp.attack, rc.operators, progress=tell, **kw),
        )
        ceiling_text = "censored" if attack.ceiling_censored else f"{attack.ceiling:.3g}"
        say(
            f"[{rc.name} seed {seed}] θ₀: target {attack.target:.1f}% "
            f"({attack.target_operator}), cheapest {attack.cheapest.operator} "
            f"{attack.cheapest.flops:.3g} FLOPs, ceiling {ceiling_text}"
        )
    dp_ref = more = None
    if sp.dp_attack is not None and rc.dp_check:
        with phase("dp_reference"):
            dp_ref = cache.get(
                ("dp_reference", *key), lambda: finetune_reference(theta0, sp.dp_attack, rc, seed)
            )
    if sp.attack_more is not None and seed in rc.more_data_seeds:
        with phase("more_reference"):
            more = cache.get(
                ("more_reference", *key),
                lambda: reference_path(theta0, sp.attack_more, rc.operators, **kw),
            )
    ev = Evaluation(pools, reference, sp, attack, dp_ref, more, rc, seed)
    row0 = measure(theta0, ev, Row("init", "init"), phase)
    return ev, row0, reach


def _names(net, modules) -> list[str]:
    names = {id(m): n for n, m in net.named_modules()}
    return [names[id(m)] for m in modules]


def _planned_scope(row: Row, theta0) -> tuple | None:
    """The modules a row's method may change, known from its options before it runs (for θ₀'s
    retrain budgets): the tail stages and whatever follows them, or the whole backbone."""
    o = row.options
    scope = getattr(o, "scope", "layer")
    if scope == "layer":
        return None
    net = theta0.net
    if scope == "backbone":
        head = net.get_classifier()
        return tuple(n for n, m in net.named_children() if m is not head)
    return tuple(_names(net, tail_modules(net, o.stages)))


def immunize_row(theta0, ev: Evaluation, row: Row, ctx, phase, say, on_extractor=None):
    """Immunize a copy of θ₀ by ``row`` and measure it: ``(RowResult or None, error or None,
    the model)``."""
    rc, seed, sp = ev.rc, ev.seed, ev.splits
    model = copy.deepcopy(theta0)
    o = row.options
    cached = getattr(o, "scope", None) == "layer"
    p, h = sp.p_train, sp.h_train
    if cached:
        p, h = (prelogits_dataset(theta0, d, batch_size=rc.eval_batch) for d in (p, h))
    try:
        with phase("immunize"):
            res = immunize_in_place(
                model,
                p,
                h,
                row.method,
                o,
                seed=seed,
                num_classes_h=sp.classes[1],
                cached=cached,
                device=ctx.device,
                rank=ctx.rank,
                world=ctx.world,
                ddp=ctx.world > 1,
            )
    except NonFiniteLossError as exc:
        say(f"[{rc.name} seed {seed}] {row.name}: {exc}")
        path = on_extractor(model, row.name, seed, "last_good") if on_extractor else None
        error = {
            "message": str(exc),
            "step": exc.step,
            "checkpoint": path,
            "parameter": exc.parameter,
        }
        return None, error, model
    if not ctx.is_main:
        return None, None, model
    # the retrain re-initialises every module the row's method may change (a change outside
    # them would be a bug of the method: refused here)
    scope = _planned_scope(row, theta0)
    changed = retrain_scope(model, theta0)
    if changed is not None and not set(changed) <= set(scope or ()):
        raise RuntimeError(f"{row.name} changed {changed}, outside its scope {scope}")
    result = measure(model, ev, row, phase)
    train = {
        "steps": res.steps,
        "lambdas": res.lambdas,
        "reason": res.stopped,
        "seconds": res.wall_seconds,
        "hardening": res.hardening,
    }
    result = replace(result, train=train, retrain_scope=scope)
    if on_extractor and (path := on_extractor(model, row.name, seed, "immunized")):
        result = replace(result, extractor=path)
    say(
        f"[{rc.name} seed {seed}] {row.name:18s} (i) {result.harmful_ratio:.4g}  (ii) "
        f"{result.pretrain_ratio:.4g}  D_P top-1 {result.dp_top1:.2f}%"
    )
    return result, None, model


def audit_seed(
    model, reference, rc: RunConfig, seed: int, opts: RunOptions, say, splits=None
) -> SeedResult:
    """Any extractor ``model`` (an ImmunizedNet) judged against a θ₀ ``reference`` on the images
    of ``rc`` for one seed (``splits``: :func:`load_splits`'s, when already loaded): θ₀'s side,
    and the row ``"model"`` measured and judged; a feature that is not finite names the model it
    came from."""
    seconds = {}
    phase = clock(seconds)
    torch.manual_seed(seed)
    sp = load_splits(rc, opts, seed) if splits is None else splits
    ev, row0, reach = evaluation(reference, sp, rc, seed, phase, say, name="reference")
    row = replace(
        measure(model, ev, Row("model", "audit"), phase, name="model"),
        retrain_scope=retrain_scope(model, reference),
    )
    row = judge(model, reference, ev, row, phase, say)
    return seed_result(ev, row0, {"model": row}, {}, reach, seconds)


def run_seed(rc: RunConfig, seed: int, opts: RunOptions, ctx, say, on_extractor=None, eta=None):
    """θ₀, its side of the judge, every row and every measurement of one seed, in this process
    (every rank under torchrun: the ranks immunize together, rank 0 measures); rank 0 returns the
    :class:`SeedResult`."""
    seconds = {}
    phase = clock(seconds)
    theta0, ev, row0, reach = seed_setup(rc, seed, opts, ctx, phase, say)
    if eta:
        eta.done(rc.seconds[0])
    row0 = _with_extractor(row0, theta0, seed, on_extractor if ctx.is_main else None)
    rows, errors = {}, {}
    for row in rc.rows:
        result, error, model = immunize_row(theta0, ev, row, ctx, phase, say, on_extractor)
        if result is not None:
            result, error = _judged(model, theta0, ev, result, phase, say)
        if error:
            errors[row.name] = error
        elif result is not None:
            rows[row.name] = result
        if eta:
            eta.done(rc.seconds[1])
    barrier()
    if not ctx.is_main:
        return None
    return seed_result(ev, row0, rows, errors, reach, seconds)


def _with_extractor(row0: RowResult, theta0, seed: int, on_extractor) -> RowResult:
    """θ₀'s row with the path ``on_extractor`` saved θ₀ to (row ``"init"``: the reference
    audit.py takes), if it did."""
    path = on_extractor and on_extractor(theta0, "init", seed, "immunized")
    return replace(row0, extractor=path) if path else row0


def seed_result(ev: Evaluation, row0, rows, errors, reach, seconds) -> SeedResult:
    return SeedResult(
        ev.seed,
        row0,
        ev.attack,
        ev.dp_reference,
        ev.more,
        rows,
        errors,
        reach,
        ev.splits.classes,
        chance_accuracy(dataset_labels(ev.splits.p_val)),
        seconds,
        split_images(ev.splits),
    )


def split_images(sp: Splits) -> dict:
    """How many images each split holds as run (your own folders shrink them all alike from the
    configuration's :class:`Sizes`)."""
    a, more = sp.attack, sp.attack_more
    return {
        "defense_p": len(sp.p_train),
        "defense_h": len(sp.h_train),
        "dp_val": len(sp.p_val),
        "attack_train": len(a.train),
        "attack_val": len(a.val),
        "attack_test": len(a.test),
        "more_train": len(more.train) if more is not None else None,
    }


class Progress:
    """The time left, from each configuration's expected CPU-seconds (``RunConfig.seconds``)
    corrected by the speed observed so far: after each finished piece of work, the expected
    seconds left times the seconds taken per expected second done."""

    def __init__(self, rcs, seeds, say, jobs: int = 1):
        self.total = sum((rc.seconds[0] + len(rc.rows) * rc.seconds[1]) * len(seeds) for rc in rcs)
        self.done_expected, self.say, self.jobs, self.t0 = 0.0, say, jobs, time.perf_counter()

    def done(self, expected: float) -> None:
        self.done_expected += expected
        took = time.perf_counter() - self.t0
        left = max(self.total - self.done_expected, 0.0) * took / max(self.done_expected, 1e-9)
        share = 100.0 * self.done_expected / max(self.total, 1e-9)
        self.say(
            f"[progress] {share:.0f}% of the planned work in {took:.0f} s; about {left:.0f} s left"
        )


# --------------------------------------------------------------------------- worker processes


@dataclass(frozen=True)
class RowJob:
    """One row of one seed, to run in another process after its seed's θ₀ and budgets: θ₀ as
    ``torch.save``'s bytes, the seed's :class:`Evaluation` (θ₀'s budgets included)."""

    rc: RunConfig
    seed: int
    row: Row
    theta0: bytes
    evaluation: Evaluation
    opts: RunOptions
    device: str
    threads: int
    on_extractor: object = None

    def model(self):
        return torch.load(io.BytesIO(self.theta0), weights_only=False)


def _saved(model) -> bytes:
    buf = io.BytesIO()
    torch.save(model, buf)
    return buf.getvalue()


def _say(on: bool):
    """The progress printer: each line flushed at once (a worker's stdout may be a pipe, which
    would hold its lines until it exits), or nothing."""
    return functools.partial(print, flush=True) if on else (lambda *a, **k: None)


def _worker_torch(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)


def _seed_job(job) -> tuple:
    """θ₀ and its budgets of one (configuration, seed), its rows left to the pool: ``((seed,
    θ₀'s row, attainability, budgets' seconds), [RowJob, ...])``."""
    rc, seed, opts, device, threads, on_extractor = job
    _worker_torch(threads)
    say = _say(not opts.quiet)
    seconds = {}
    ctx = init_from_env(device)
    theta0, ev, row0, reach = seed_setup(rc, seed, opts, ctx, clock(seconds), say)
    row0 = _with_extractor(row0, theta0, seed, on_extractor)
    blob, light = _saved(theta0), replace(ev, splits=None)  # a worker loads the images again
    jobs = [RowJob(rc, seed, r, blob, light, opts, device, threads, on_extractor) for r in rc.rows]
    return (light, row0, reach, seconds), jobs


def _row_job(job: RowJob) -> tuple:
    """One row of a seed in a worker: ``(row name, RowResult or None, error or None, seconds)``."""
    _worker_torch(job.threads)
    say = _say(not job.opts.quiet)
    seconds = {}
    phase = clock(seconds)
    theta0 = job.model()
    ctx = init_from_env(job.device)
    ev = replace(job.evaluation, splits=load_splits(job.rc, job.opts, job.seed))
    result, error, model = immunize_row(theta0, ev, job.row, ctx, phase, say, job.on_extractor)
    if result is not None:
        result, error = _judged(model, theta0, ev, result, phase)
    return job.row.name, result, error, seconds


def _add_seconds(total: dict, more: dict) -> dict:
    for k, v in more.items():
        t = total.setdefault(k, {"wall": 0.0, "cpu": 0.0})
        t["wall"], t["cpu"] = t["wall"] + v["wall"], t["cpu"] + v["cpu"]
    return total


# --------------------------------------------------------------------------- over seeds


def _per_seed_flag(values: list, flags: list) -> dict:
    got = [v for v in values if v is not None]
    return {
        "per_seed": values,
        "censored": flags,
        "min": min(got) if got else None,
        "max": max(got) if got else None,
    }


def _judged_summary(judged: list) -> dict:
    """Per seed: worth (with and without the probes), the retrain bound, the share of the
    headroom, the cheapest operator and, per operator, its FLOPs to the target and its plateau."""
    if not judged or judged[0] is None:
        return {}
    w = [j.worth for j in judged]
    ops = {}
    for name in judged[0].path.names():
        cs = [j.path[name] for j in judged]
        ops[name] = {
            "kind": cs[0].kind,
            "flops_to_target": [c.flops_to_target for c in cs],
            "flops_limit": [c.flops_limit for c in cs],
            "censored": [c.censored for c in cs],
            "steps_to_target": [c.steps_to_target for c in cs],
            "plateau": [c.plateau for c in cs],
            "setting": [c.setting for c in cs],
        }
    return {
        "worth": _per_seed_flag([x.worth for x in w], [x.worth_censored for x in w]),
        "worth_without_probes": _per_seed_flag(
            [x.worth_without_probes for x in w], [x.worth_without_probes_censored for x in w]
        ),
        "retrain_bound": _per_seed_flag(
            [x.retrain_bound for x in w], [x.retrain_bound_censored for x in w]
        ),
        "headroom_share": _per_seed_flag(
            [x.headroom_share for x in w], [x.worth_censored for x in w]
        ),
        "ceiling": _per_seed_flag([x.ceiling for x in w], [x.ceiling_censored for x in w]),
        "cheapest_operator": [x.cheapest_operator for x in w],
        "exact": [j.path.exact for j in judged],
        "operators": ops,
    }


@dataclass(frozen=True)
class RowSummary:
    """One row over the seeds that have it: each headline number's ``{mean, std, per_seed}``,
    the Definition 3.1 counts, the GD probe curve, the judge per seed (worth, worth without the
    probes, retrain bound, share of the headroom, cheapest operator, every operator's FLOPs to the
    target and plateau), the D_P fine-tuning slowdown per seed and its maximum, the same judge
    with more images, and how training went."""

    row: str
    method: str
    label: str
    seeds: tuple
    numbers: dict
    immunized_count: int
    immunized_groups_count: int
    probe_curve: dict
    judged: dict
    dp_finetune_slowdown: dict
    more_data: dict
    train: dict

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(self.numbers)
        del out["numbers"]
        return out


HEADLINE = {
    "rir_theta0": ("rir",),
    "harmful_ratio": ("harmful_ratio",),
    "pretrain_ratio": ("pretrain_ratio",),
    "groups_rir_theta0": ("grouped", "rir"),
    "groups_harmful_ratio": ("grouped", "harmful_ratio"),
    "groups_pretrain_ratio": ("grouped", "pretrain_ratio"),
    "dp_top1": ("dp_top1",),
    "harmful_top_ratio": ("harmful_spread", "top"),
    "harmful_bottom_ratio": ("harmful_spread", "bottom"),
}


def _get(obj, path):
    for p in path:
        obj = obj[p] if isinstance(obj, dict) else getattr(obj, p)
    return obj


def _curve(curves) -> dict:
    a = np.asarray(curves, dtype=float)
    return {k: getattr(np, k)(a, 0).tolist() for k in ("mean", "std", "min", "max")}


def summarize_row(row: Row, seeds: list, results: list, theta0s: list) -> RowSummary:
    """:class:`RowSummary` of ``results`` (one :class:`RowResult` per seed of ``seeds``), θ₀'s
    rows of the same seeds beside them."""
    numbers = {k: summarize(_get(r, p) for r in results) for k, p in HEADLINE.items()}
    numbers["dp_top1_delta"] = summarize(r.dp_top1 - t.dp_top1 for r, t in zip(results, theta0s))
    for e in (10, len(results[0].probe) - 1):
        e = min(e, len(results[0].probe) - 1)
        numbers[f"probe_epoch{e}"] = summarize(r.probe[e] for r in results)
        numbers[f"probe_epoch{e}_delta"] = summarize(
            r.probe[e] - t.probe[e] for r, t in zip(results, theta0s)
        )
    dps = [r.dp_finetune for r in results]
    mores = [r.more_data for r in results if r.more_data is not None]
    return RowSummary(
        row.name,
        row.method,
        row.label,
        tuple(int(s) for s in seeds),
        numbers,
        sum(bool(r.immunized) for r in results),
        sum(bool(r.grouped.immunized) for r in results),
        _curve([r.probe for r in results]),
        _judged_summary([r.judged for r in results]),
        {
            "per_seed": [d.slowdown for d in dps] if dps[0] is not None else [],
            "censored": [d.censored for d in dps] if dps[0] is not None else [],
            "max": max(d.slowdown for d in dps) if dps[0] is not None else None,
        },
        _judged_summary(mores),
        {k: [r.train.get(k) for r in results] for k in ("steps", "reason", "seconds")},
    )


def _theta0_summary(seeds: list[SeedResult]) -> dict:
    """θ₀'s side per seed: the target, the operator whose plateau set it, θ₀'s cheapest operator
    and its FLOPs, scratch's FLOPs, the ceiling, the cap; every operator's plateau, B₀, FLOPs to
    the target on θ₀; the same with more images and D_P fine-tuning's."""

    def side(refs: list) -> dict:
        refs = [r for r in refs if r is not None]
        if not refs:
            return {}
        ops = {}
        for c in refs[0].path.operators:
            n = c.operator
            ops[n] = {
                "kind": c.kind,
                # the budget's confirmed plateau where the operator set the target, else the
                # highest level its race held
                "plateau": [
                    r.budgets[n].plateau if n in r.budgets else r.path[n].plateau for r in refs
                ],
                "budget_steps": [
                    r.budgets[n].budget_steps if n in r.budgets else None for r in refs
                ],
                "confirmed": [
                    r.budgets[n].plateau_reached if n in r.budgets else None for r in refs
                ],
                "flops_to_target": [r.path[n].flops_to_target for r in refs],
                "steps_to_target": [r.path[n].steps_to_target for r in refs],
                "censored": [r.path[n].censored for r in refs],
                "setting": [r.path[n].setting for r in refs],
                "cost": [r.path[n].cost.to_dict() for r in refs],
            }
        return {
            "target": [r.target for r in refs],
            "target_operator": [r.target_operator for r in refs],
            "chance": [r.chance for r in refs],
            "cheapest_operator": [r.cheapest.operator for r in refs],
            "cheapest_flops": [r.cheapest.flops for r in refs],
            "scratch_flops": [r.scratch and r.scratch.flops for r in refs],
            "ceiling": _per_seed_flag(
                [r.ceiling for r in refs], [r.ceiling_censored for r in refs]
            ),
            "cap": [r.cap for r in refs],
            "batch_size": refs[0].batch_size,
            "image_side": refs[0].image_side,
            "operators": ops,
        }

    dps = [s.dp_reference for s in seeds if s.dp_reference is not None]
    return {
        "attack": side([s.reference for s in seeds]),
        "more_data": side([s.more_reference for s in seeds]),
        "dp_finetune": {
            "plateau": [d.budget.plateau for d in dps],
            "target": [d.target for d in dps],
            "steps": [d.steps for d in dps],
            "budget_steps": [d.budget.budget_steps for d in dps],
            "confirmed": [d.budget.plateau_reached for d in dps],
            "setting": [d.budget.setting for d in dps],
        }
        if dps
        else {},
    }


def result_of(
    rc: RunConfig, opts: RunOptions, seeds, per_seed: list, t0, row_specs=None, **extra
) -> dict:
    """results.json of one configuration over ``seeds``: per row its :class:`RowSummary` (θ₀'s
    first; ``row_specs`` default ``rc.rows``), θ₀'s side per seed, every seed's results, the
    seconds."""
    phases = {}
    for s in per_seed:
        _add_seconds(phases, s.phase_seconds)
    shape = ", ".join(f"{k} {v}" for k, v in rc.model_kwargs.items())
    rows = {}
    theta_rows = [s.theta0 for s in per_seed]
    all_seeds = [s.seed for s in per_seed]
    rows["init"] = summarize_row(
        Row("init", "init", label="Init. θ₀"), all_seeds, theta_rows, theta_rows
    )
    for r in rc.rows if row_specs is None else row_specs:
        have = [(s.seed, s.rows[r.name], s.theta0) for s in per_seed if r.name in s.rows]
        if have:
            ss, res, t0s = zip(*have)
            rows[r.name] = summarize_row(r, list(ss), list(res), list(t0s))
    theta0 = _theta0_summary(per_seed)
    return {
        "config": rc.name,
        "model": rc.model,
        "model_text": rc.model + (f" ({shape})" if shape else ""),
        "data": "MNIST digits 0-4 (D_P) vs 5-9 (D_H)"
        if rc.data == "mnist"
        else f"D_P {opts.dp_root} vs D_H {opts.dh_root}",
        "seeds": list(seeds),
        "threads": torch.get_num_threads(),
        "attacker": {
            "batch_size": theta0["attack"].get("batch_size"),
            "image_side": theta0["attack"].get("image_side"),
            "train_images": len(per_seed[0].reference.budgets) and rc.sizes.attack_train,
        },
        "run_config": rc.to_dict(),
        "rows": {k: v.to_dict() for k, v in rows.items()},
        "theta0": theta0,
        "per_seed": [s.to_dict() for s in per_seed],
        "errors": {f"seed{s.seed}": s.errors for s in per_seed if s.errors},
        "wall_seconds": time.perf_counter() - t0,
        "phase_seconds": phases,
        "environment": environment(),
        **extra,
    }


def run_configs(
    rcs: list, seeds: list[int], opts: RunOptions, ctx, *, on_extractor=None, jobs: int = 1
) -> list | None:
    """Every seed of every configuration in ``rcs``; rank 0 returns per configuration its
    results (:func:`result_of`), the other ranks None. With ``jobs > 1`` (one process, no
    torchrun) each (configuration, seed)'s θ₀ and its side of the judge run in a worker process,
    and each of its rows in whichever worker is free once they are done: every number is the same
    as with ``jobs = 1``. ``on_extractor(rc)`` gives each configuration's callback ``(model, row,
    seed, status) -> path or None``."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0, threads = time.perf_counter(), torch.get_num_threads()
    say = _say(ctx.is_main and not opts.quiet)
    # one (configuration, seed) of one row leaves a pool nothing to run side by side
    if len(rcs) * len(seeds) == 1 and max(len(rc.rows) for rc in rcs) <= 1:
        jobs = 1
    for rc in rcs:
        say(
            f"[{rc.name}] model={rc.model} seeds={seeds} rows={[r.name for r in rc.rows]} "
            f"world={ctx.world} threads={threads} device={ctx.device} jobs={jobs}"
        )
    eta = Progress(rcs, seeds, say, jobs)
    hook = (lambda rc: None) if on_extractor is None else on_extractor
    if jobs > 1 and ctx.world == 1:
        from experiments.common import pool_chain  # noqa: PLC0415

        todo = [(rc, s, opts, str(ctx.device), threads, hook(rc)) for rc in rcs for s in seeds]
        done = []

        def tick(stage, task):
            eta.done(task[0].seconds[0] if stage == "first" else task.rc.seconds[1])

        # spawned: torch's OpenMP threads do not survive a fork (experiments.pool.START)
        chained = pool_chain(_seed_job, _row_job, todo, jobs, start="spawn", on_done=tick)
        for (ev, row0, reach, seconds), row_outs in chained:
            rows, errors = {}, {}
            for name, result, error, secs in row_outs:
                _add_seconds(seconds, secs)
                if error:
                    errors[name] = error
                elif result is not None:
                    rows[name] = result
            ev = replace(ev, splits=load_splits(ev.rc, opts, ev.seed))
            done.append(seed_result(ev, row0, rows, errors, reach, seconds))
        per = [done[i * len(seeds) : (i + 1) * len(seeds)] for i in range(len(rcs))]
    else:
        per = [[run_seed(rc, s, opts, ctx, say, hook(rc), eta) for s in seeds] for rc in rcs]
    if not ctx.is_main:
        return None
    return [
        result_of(rc, opts, seeds, per_seed, t0, world=ctx.world, jobs=jobs)
        for rc, per_seed in zip(rcs, per)
    ]


def run_config(
    rc: RunConfig, seeds: list[int], opts: RunOptions, ctx, *, on_extractor=None
) -> dict | None:
    """:func:`run_configs` of one configuration, in this process."""
    hook = None if on_extractor is None else (lambda _: on_extractor)
    res = run_configs([rc], seeds, opts, ctx, on_extractor=hook)
    return None if res is None else res[0]
