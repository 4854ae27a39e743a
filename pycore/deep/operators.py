"""Every operator an attacker has against a released extractor, each tuned on the attacker's own
validation split (docs/design.md §3, docs/findings.md §7).

An operator learns D_H from the model it is given and is scored by D_H test accuracy (%) after
each scored epoch:

* ``gd``: linear probe on frozen features, full-batch GD with step 1/L (the paper's threat model,
  Eq. (4)); no setting to tune.
* ``adam``: linear probe by Adam on features scaled to unit RMS row norm or standardised, the
  learning rate and the preprocessing picked from :data:`LR_GRIDS`.
* ``adam_whitened``: the Adam probe on features whitened with the attacker's own covariance (it
  undoes every invertible linear map of the features).
* ``lora``: LoRA adapters (peft) of rank ``r`` on every linear and (non-grouped) convolution layer
  of the backbone and the immunization layer, plus a new head; one operator per rank,
  ``lora_r<r>``.
* ``finetune_upper``: the backbone's last stage (timm's ``feature_info``), the layer and a new
  head.
* ``finetune_full``: the whole network and a new head.

Deep operators attack a copy in eval mode (θ's normalisation statistics, no dropout: a seed gives
one result), with the immunization layer as a plain ``nn.Linear`` (a released model's layer has no
preconditioner) and Adam. Each operator's setting is the one of best accuracy on the validation
split after the last scored epoch; its test accuracies are reported."""

from __future__ import annotations

import copy
import importlib.util
import re
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from pycore.deep.attacks import (
    adam_probe_curve,
    linear_probe_curve,
    preprocess_features,
)
from pycore.deep.convs import one_position_convs
from pycore.deep.data import ShardedBatches, dataset_labels, fetch
from pycore.deep.models import as_immunized, tail_modules
from pycore.threads import bounded_blas
from pycore.validation import ParameterError, check_counts

__all__ = [
    "OPERATORS",
    "LR_GRIDS",
    "LORA_RANKS",
    "AttackData",
    "OperatorCurve",
    "operator_names",
    "lora_targets",
    "attack_copy",
    "run_operators",
    "OperatorComparison",
    "AuditResult",
    "compare",
]

OPERATORS = ("gd", "adam", "adam_whitened", "lora", "finetune_upper", "finetune_full")
# Each operator's grid, stated once (docs/design.md §3): Adam probes over lr × preprocessing,
# the deep operators over the lr of Adam (new head included).
LR_GRIDS = {
    "adam": (1e-3, 1e-2, 1e-1),
    "adam_whitened": (1e-3, 1e-2, 1e-1),
    "lora": (1e-3, 1e-2),
    "finetune_upper": (1e-4, 1e-3),
    "finetune_full": (1e-4, 1e-3),
}
LORA_RANKS = (8, 32)  # the ranks of the operator-transfer report cited in docs/findings.md §7


@dataclass(frozen=True)
class AttackData:
    """The attacker's D_H data: images to train on, a validation split to tune on, a test split to
    be scored on, and the number of classes."""

    train: Dataset
    val: Dataset
    test: Dataset
    classes: int


@dataclass(frozen=True)
class OperatorCurve:
    """One operator against one model: the chosen setting, D_H test accuracy (%) after each of
    ``epochs`` (the probes also at 0, before training; a deep operator's new head starts at
    chance), the validation accuracy the setting was chosen by, and every setting tried with its
    validation accuracy."""

    operator: str
    setting: str
    epochs: tuple
    test_accuracy: tuple
    validation_accuracy: float
    grid: tuple  # ((setting, validation accuracy), ...)

    def to_dict(self) -> dict:
        return asdict(self)


def operator_names(operators=OPERATORS, lora_ranks=LORA_RANKS) -> tuple:
    """The operator names ``operators`` expand to (``lora`` → ``lora_r<r>`` per rank); an unknown
    name, a rank that is not a positive integer (``numbers.Integral``, not bool) or ``lora``
    without peft installed is a ParameterError naming it."""
    if isinstance(operators, str):
        operators = (operators,)
    bad = [o for o in operators if o not in OPERATORS]
    if bad or not operators:
        raise ParameterError(
            "operators",
            f"unknown operator {bad[0]!r}; choose from {', '.join(OPERATORS)}"
            if bad
            else "operators is empty",
        )
    if "lora" in operators:
        ranks = check_counts(lora_ranks, "lora_ranks", low=1)
        if importlib.util.find_spec("peft") is None:  # before the other operators compute
            raise ParameterError(
                "operators",
                "the lora operator needs peft, which is not installed: pip install "
                "'model-immunization[deep]' (or leave lora out of operators)",
            )
    out = []
    for o in operators:
        out += [f"lora_r{r}" for r in ranks] if o == "lora" else [o]
    return tuple(dict.fromkeys(out))


class _Attacked(nn.Module):
    """backbone → immunization layer (a plain linear map) → new head."""

    def __init__(self, net: nn.Module, layer: nn.Linear, head: nn.Linear):
        super().__init__()
        self.net, self.layer, self.head = net, layer, head

    def features(self, x):
        return self.layer(self.net.forward_head(self.net.forward_features(x), pre_logits=True))

    def forward(self, x):
        return self.head(self.features(x))


def attack_copy(model, num_classes: int, *, seed: int) -> _Attacked:
    """A deep copy of ``model`` (timm classifier or ImmunizedNet) as the attacker gets it: frozen,
    eval mode, its layer a plain ``nn.Linear`` with the same weights, a new seeded linear head."""
    m = as_immunized(model).eval()
    old = m.layer
    layer = nn.Linear(old.weight.shape[1], old.weight.shape[0], bias=old.bias is not None)
    head = nn.Linear(layer.out_features, num_classes)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(old.weight)
        if old.bias is not None:
            layer.bias.copy_(old.bias)
        bound = 1.0 / layer.out_features**0.5
        for p in (head.weight, head.bias):
            p.copy_(torch.empty_like(p).uniform_(-bound, bound, generator=g))
    dev = old.weight.device
    return _Attacked(m.net, layer.to(dev), head.to(dev)).eval().requires_grad_(False)


def _width(mod: nn.Module) -> int:
    if isinstance(mod, nn.Linear):
        return min(mod.in_features, mod.out_features)
    k = int(np.prod(mod.kernel_size))
    return min(mod.in_channels * k, mod.out_channels)


def lora_targets(attacked: nn.Module, rank: int) -> dict[str, int]:
    """The modules LoRA adapts, each with its adapter's rank: every ``nn.Linear`` and ungrouped
    ``nn.Conv2d`` of the backbone and the layer (not the heads), at ``min(rank, width)`` with
    ``width = min(out, in·kernel)`` (a wider adapter adds no rank). A rank above the width of every
    target, or a model without one, is a ParameterError."""
    skip = {id(attacked.head), id(attacked.net.get_classifier())}
    widths = {
        n: _width(mod)
        for n, mod in attacked.named_modules()
        if id(mod) not in skip
        and (isinstance(mod, nn.Linear) or (isinstance(mod, nn.Conv2d) and mod.groups == 1))
    }
    if not widths:
        raise ParameterError(
            "model", f"{type(attacked.net).__name__} has no linear or convolution layer for LoRA"
        )
    widest = max(widths, key=widths.get)
    if rank > widths[widest]:
        raise ParameterError(
            "lora_ranks",
            f"LoRA rank {rank} exceeds the width of every layer, the widest being {widest!r} "
            f"(min(out, in·kernel) = {widths[widest]})",
        )
    return {n: min(rank, w) for n, w in widths.items()}


def _with_lora(attacked: _Attacked, rank: int, seed: int) -> _Attacked:
    """peft LoRA adapters (α = r: the update is BA) on :func:`lora_targets`; only the adapters
    and the head train."""
    from peft import LoraConfig, inject_adapter_in_model  # noqa: PLC0415  (peft imports slowly)

    ranks = lora_targets(attacked, rank)
    pattern = "^(" + "|".join(re.escape(n) for n in ranks) + ")$"
    narrow = {n: r for n, r in ranks.items() if r < rank}
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        lora_dropout=0.0,
        target_modules=pattern,
        rank_pattern={f"^{re.escape(n)}$": r for n, r in narrow.items()},
        alpha_pattern={f"^{re.escape(n)}$": r for n, r in narrow.items()},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # peft draws A from torch's global generator
        attacked = inject_adapter_in_model(config, attacked)
    for n, p in attacked.named_parameters():
        p.requires_grad_("lora_" in n or n.startswith("head."))
    return attacked.eval()


def _accuracy_of(m, ds) -> float:
    """D_H accuracy (%) of the attacked model ``m`` on ``ds``; ``m`` trains no more, so it is
    put in channels-last memory format, in which CPU convolutions infer ~1.7× faster (a
    network without 4-D weights is unchanged)."""
    dev = next(m.parameters()).device
    m.to(memory_format=torch.channels_last)
    y = torch.as_tensor(dataset_labels(ds), dtype=torch.int64)
    n, hits = len(ds), 0
    with torch.no_grad():
        for s in range(0, n, 256):
            x = fetch(ds, torch.arange(s, min(s + 256, n)))[0].to(dev)
            if x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            hits += int((m(x).argmax(1).cpu() == y[s : s + 256]).sum())
    return 100.0 * hits / n


def _attacker(model, data: AttackData, op: str, seed: int) -> _Attacked:
    """The attack copy ``op`` trains, with its trainable parameters marked and its convolutions
    with one output position computed as products (:mod:`pycore.deep.convs`: the same values up
    to round-off, ~10× less CPU time on a ResNet's 1×1 maps)."""
    m = attack_copy(model, data.classes, seed=seed)
    if op.startswith("lora_r"):
        m = _with_lora(m, int(op[6:]), seed)
    else:
        mods = [m] if op == "finetune_full" else [*tail_modules(m.net, 1), m.layer, m.head]
        for mod in mods:
            mod.requires_grad_(True)
    m.head.requires_grad_(True)
    return one_position_convs(m)


def _deep_grid(model, data: AttackData, op: str, grid, epochs, seed: int, batch_size: int):
    """Train one deep operator at each lr of ``grid``: ``{lr: (model, its trained parameters
    after each scored epoch, validation accuracy after the last)}``; only the chosen setting is
    then scored on the test split (:func:`_scored`).

    Every lr starts from the same copy and the same first batch, so the first step's gradient is
    computed once and each lr's Adam takes its first step from it: bit for bit the run of that
    lr alone (Adam's state starts empty), one forward and backward fewer per further lr."""
    first = _attacker(model, data, op, seed)
    dev = next(first.parameters()).device
    ytr = torch.as_tensor(dataset_labels(data.train), dtype=torch.int64)
    batches = ShardedBatches(len(data.train), min(batch_size, len(data.train)), seed=seed)

    def loss(m, idx):
        return F.cross_entropy(m(fetch(data.train, idx)[0].to(dev)), ytr[idx].to(dev))

    steps = [idx for e in range(max(epochs)) for (idx,) in batches.epoch(e)]
    loss(first, steps[0]).backward()
    out = {}
    for lr in grid:
        m = copy.deepcopy(first)
        params = {n: p for n, p in m.named_parameters() if p.requires_grad}
        for n, p in first.named_parameters():
            if p.grad is not None:  # (a parameter the loss does not reach has none)
                params[n].grad = p.grad.clone()
        opt = torch.optim.Adam(params.values(), lr=lr)
        snaps = []  # epoch 0 is a random new head: chance, not scored
        for k, idx in enumerate(steps, start=1):
            if k > 1:
                opt.zero_grad(set_to_none=True)
                loss(m, idx).backward()
            opt.step()
            if k % len(batches) == 0 and k // len(batches) in epochs:
                snaps.append({n: p.detach().clone() for n, p in params.items()})
        out[lr] = (m, snaps, _accuracy_of(m, data.val))
    return out


def _scored(m, snaps, test) -> list[float]:
    """Test accuracy of ``m`` at each of its snapshots (the chosen setting's epochs)."""
    params = dict(m.named_parameters())
    out = []
    with torch.no_grad():
        for snap in snaps:
            for n, v in snap.items():
                params[n].copy_(v)
            out.append(_accuracy_of(m, test))
    return out


def _probe_runs(op, Z, y, epochs, seed, classes):
    """A feature operator's settings: ``{setting: (test accuracy per epoch, validation accuracy at
    the last epoch)}``."""
    (Zt, Zv, Zs), (yt, yv, ys) = Z, y
    last = max(epochs)
    if op == "gd":
        c = linear_probe_curve(
            Zt, yt, Zs, ys, epochs=last, num_classes=classes, validation=(Zv, yv)
        )
        return {"step 1/L": (c.test_accuracy, c.validation_accuracy[-1])}
    preps = ("whiten",) if op == "adam_whitened" else ("scale", "standardize")
    out = {}
    for prep in preps:
        a, b = preprocess_features(Zt, np.concatenate([Zv, Zs]), prep)
        av, at = b[: len(Zv)], b[len(Zv) :]
        for lr in LR_GRIDS[op]:
            kw = dict(epochs=last, lr=lr, seed=seed, num_classes=classes)
            c = adam_probe_curve(a, yt, at, ys, validation=(av, yv), **kw)
            out[f"{prep}@{lr:g}"] = (c.test_accuracy, c.validation_accuracy[-1])
    return out


@bounded_blas
def run_operators(
    model,
    data: AttackData,
    operators=OPERATORS,
    *,
    epochs=(1, 5),
    lora_ranks=LORA_RANKS,
    seed: int = 0,
    features=None,
    batch_size: int = 64,
) -> dict[str, OperatorCurve]:
    """Every operator of ``operators`` (:func:`operator_names`) against ``model`` on ``data``,
    each at its best setting on ``data.val``: ``{name: OperatorCurve}``, test accuracy after 0 and
    each of ``epochs``. ``features`` = ``(Z_train, Z_val, Z_test)`` of the model's immunized
    features when already extracted (else they are, from the images)."""
    names = operator_names(operators, lora_ranks)
    epochs = check_counts(epochs, "epochs", low=1)
    scored = tuple(sorted({0, *epochs}))
    net = as_immunized(model).eval()
    for n in names:  # a bad rank is refused before any training
        if n.startswith("lora_r"):
            lora_targets(attack_copy(net, data.classes, seed=seed), int(n[6:]))
    y = tuple(dataset_labels(d) for d in (data.train, data.val, data.test))
    if any(n in ("gd", "adam", "adam_whitened") for n in names) and features is None:
        from pycore.deep.features import extract  # noqa: PLC0415

        features = tuple(extract(net, d) for d in (data.train, data.val, data.test))
    out = {}
    for n in names:
        if n in ("gd", "adam", "adam_whitened"):
            runs = _probe_runs(n, features, y, scored[1:], seed, data.classes)
            runs = {k: ([t[e] for e in scored], v) for k, (t, v) in runs.items()}
        else:
            grid = LR_GRIDS["lora" if n.startswith("lora_r") else n]
            trained = {
                f"lr {lr:g}": run
                for lr, run in _deep_grid(net, data, n, grid, scored[1:], seed, batch_size).items()
            }
            pick = max(trained, key=lambda k: trained[k][2])  # first of the best (grids ascend)
            runs = {k: ([], v) for k, (_, _, v) in trained.items()}
            runs[pick] = (_scored(*trained[pick][:2], data.test), trained[pick][2])
            del trained
        best = max(runs, key=lambda k: runs[k][1])  # first of the best (grids ascend)
        out[n] = OperatorCurve(
            n,
            best,
            scored if len(runs[best][0]) == len(scored) else scored[1:],
            tuple(float(a) for a in runs[best][0]),
            float(runs[best][1]),
            tuple((k, float(v)) for k, (_, v) in runs.items()),
        )
    return out


@dataclass(frozen=True)
class OperatorComparison:
    """One operator against the defended model and against θ₀, per scored epoch ≥ 1: D_H test
    accuracies, the signed deficit ``reference − model`` in points (> 0: the defense slowed the
    attacker) and relative to the reference, their means over the epochs (``signed_rfd``: RFD of
    Sarker et al. without the absolute value), ``rfd`` (with it, for comparison), and the
    best-so-far accuracy of each (the attacker keeps its best epoch)."""

    operator: str
    epochs: tuple
    model: tuple
    reference: tuple
    model_setting: str
    reference_setting: str
    deficit: tuple
    relative_deficit: tuple
    mean_deficit: float
    signed_rfd: float
    rfd: float
    best_so_far_model: tuple
    best_so_far_reference: tuple

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AuditResult:
    """:func:`compare` / :func:`pycore.deep.audit_model`: every operator's comparison, and the
    worst case: the operator of highest mean D_H accuracy against the defended model (the one
    that recovers D_H fastest), with its signed deficit against the same operator on θ₀."""

    epochs: tuple
    operators: tuple  # OperatorComparison, in the order run
    worst: str
    worst_deficit: float
    worst_signed_rfd: float

    def __getitem__(self, name: str) -> OperatorComparison:
        for c in self.operators:
            if c.operator == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "epochs": list(self.epochs),
            "operators": {c.operator: c.to_dict() for c in self.operators},
            "worst": self.worst,
            "worst_deficit": self.worst_deficit,
            "worst_signed_rfd": self.worst_signed_rfd,
        }


def compare(model: dict, reference: dict) -> AuditResult:
    """:class:`AuditResult` of two ``{name: OperatorCurve}`` of the same operators and epochs
    (:func:`run_operators` against the defended model and against θ₀)."""
    if list(model) != list(reference):
        raise ParameterError(
            "reference", f"operators differ: {list(model)} against {list(reference)}"
        )
    rows = []
    for name, m in model.items():
        r = reference[name]
        if m.epochs != r.epochs:
            raise ParameterError("reference", f"{name}: epochs {m.epochs} against {r.epochs}")
        keep = [i for i, e in enumerate(m.epochs) if e >= 1]
        a, b = np.array(m.test_accuracy)[keep], np.array(r.test_accuracy)[keep]
        d = b - a
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(b > 0, d / b, np.nan)
        rows.append(
            OperatorComparison(
                name,
                tuple(m.epochs[i] for i in keep),
                tuple(a.tolist()),
                tuple(b.tolist()),
                m.setting,
                r.setting,
                tuple(d.tolist()),
                tuple(rel.tolist()),
                float(d.mean()),
                float(np.mean(rel)),
                float(np.mean(np.abs(rel))),
                tuple(np.maximum.accumulate(np.array(m.test_accuracy))[keep].tolist()),
                tuple(np.maximum.accumulate(np.array(r.test_accuracy))[keep].tolist()),
            )
        )
    worst = max(rows, key=lambda c: np.mean(c.model))
    return AuditResult(
        rows[0].epochs, tuple(rows), worst.operator, worst.mean_deficit, worst.signed_rfd
    )
