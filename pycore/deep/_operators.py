"""Every operator an attacker has against a released extractor, and the audit that runs them.

Every operator an attacker has against a released extractor, and the audit that runs them
against θ₀'s budget (docs/design.md §3, docs/findings.md §7).

An operator learns D_H from the model it is given, at each setting of its grid
(:data:`LR_GRIDS`, widened per model by :mod:`pycore.deep._slowdown`):

* ``gd``: linear probe on the frozen features, full-batch GD with step 1/L (the paper's threat
  model, Eq. (4)); nothing to tune.
* ``adam``: the Adam probe on features scaled to unit RMS row norm or standardised.
* ``adam_whitened``: the Adam probe on features whitened with the attacker's own covariance (it
  undoes every invertible linear map of the features).
* ``remove_layer``: the immunization layer replaced by the identity (folded into the new head),
  then the Adam probe: what an attacker holding the weights gets by taking a layer-only defense
  off. On a model whose backbone is θ₀'s it is θ₀'s ``adam``, number for number.
* ``lora``: LoRA adapters (peft) of rank ``r`` on every linear and ungrouped convolution layer of
  the backbone and the layer, plus a new head; one operator per rank, ``lora_r<r>``.
* ``finetune_upper``: the backbone's last stage (timm's ``feature_info``), the layer and a new
  head.
* ``finetune_full``: the whole network and a new head.
* ``retrain_tail``: the stages the defense changed (:func:`retrain_scope`) re-initialised and
  trained from the frozen earlier stages with the layer (reset to the identity) and a new head:
  the attacker's fallback when fine-tuning is slowed. On θ₀ (its reference) the same modules
  are fine-tuned from θ₀'s weights.

Deep operators train a copy with Adam on seeded mini-batches in eval mode (the released model's
normalisation statistics: on the demo's ResNet18 full fine-tuning in train mode reached about 50 %
where eval mode reached 83 %, after 20 steps at lr 1e-4), the layer as a plain ``nn.Linear`` (a
released model's layer has no preconditioner); the retrain trains its re-initialised modules in
train mode (their BatchNorm statistics are new and must be learned). Every copy is evaluated in
eval mode. A setting whose loss or logits become non-finite is marked diverged and left out of
the best-of-grid.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import pycore.deep._slowdown as slowdown
from pycore._threads import bounded_blas
from pycore._validation import ParameterError, check_counts
from pycore.deep._convs import one_position_convs
from pycore.deep._data import ShardedBatches, dataset_labels, fetch
from pycore.deep._models import as_immunized, tail_modules
from pycore.deep._probes import AdamProbe, GDProbe, preprocess_features, probe_inputs
from pycore.deep._slowdown import Budget, Eval, Slowdown
from pycore.deep._tail import TailRunner, stage_names

OPERATORS = (
    "gd",
    "adam",
    "adam_whitened",
    "remove_layer",
    "lora",
    "finetune_upper",
    "finetune_full",
    "retrain_tail",
)
PROBES = ("gd", "adam", "adam_whitened", "remove_layer")
_ROOT10 = math.sqrt(10.0)


def _rates(low: float, n: int) -> tuple:
    """``n`` learning rates from ``low`` a factor √10 apart (the grid's own widening ratio)."""
    return tuple(float(f"{low * _ROOT10**k:.3g}") for k in range(n))


# Each operator's starting grid ({variant: learning rates}); every grid is widened per model
# while its best setting sits at an end (pycore.deep._slowdown). GD's step is 1/L.
LR_GRIDS = {
    "gd": {"": (1.0,)},
    "adam": {"scale": _rates(1e-3, 5), "standardize": _rates(1e-3, 5)},
    "adam_whitened": {"whiten": _rates(1e-3, 5)},
    "remove_layer": {"scale": _rates(1e-3, 5), "standardize": _rates(1e-3, 5)},
    "lora": {"": _rates(1e-4, 3)},
    "finetune_upper": {"": _rates(1e-4, 3)},
    "finetune_full": {"": _rates(3.16e-5, 3)},
    "retrain_tail": {"": _rates(1e-4, 3)},
}
LORA_RANKS = (8, 32)  # the ranks of the operator-transfer report cited in docs/findings.md §7


@dataclass(frozen=True)
class AttackData:
    """The attacker's data.

    Images to train on, a validation split to watch, a test split to be scored on, the number
    of classes, and the name of the argument each split came from (in errors).
    """

    train: Dataset
    val: Dataset
    test: Dataset
    classes: int
    names: tuple = ("dh", "dh", "dh")  # the argument each split came from, named in errors

    @property
    def chance(self) -> float:
        """The accuracy (%) of always answering the validation split's most frequent class."""
        y = dataset_labels(self.val)
        return 100.0 * float(np.bincount(y).max()) / len(y)


@dataclass(frozen=True)
class Schedule:
    """How long operators run (in optimizer steps) and how often they are evaluated.

    Probes every step, from ``probe_min_steps`` to ``probe_max_steps``; deep operators every
    ``deep_eval_every`` steps (0: once an epoch of the training split), from ``deep_min_epochs`` to
    ``deep_max_epochs`` epochs; mini-batches of ``batch_size``.
    """

    batch_size: int = 64
    probe_min_steps: int = 40
    probe_max_steps: int = 3000
    deep_eval_every: int = 0
    deep_min_epochs: int = 4
    deep_max_epochs: int = 60


def operator_names(operators=OPERATORS, lora_ranks=LORA_RANKS) -> tuple:
    """The operator names a selection expands to (``lora`` → ``lora_r<r>`` per rank).

    Parameters
    ----------
    operators : str or sequence of str, default OPERATORS
        Names of :data:`OPERATORS`.
    lora_ranks : int or sequence of int, default LORA_RANKS
        The LoRA ranks, positive integers (``numbers.Integral``, not bool).

    Returns
    -------
    tuple of str
        The names, in order, each once.

    Raises
    ------
    ParameterError
        An unknown or empty selection, or one that is not a name or names (None), or ``lora``
        without peft installed (``"operators"``); a rank that is not a positive integer
        (``"lora_ranks"``).
    """
    if isinstance(operators, str):
        operators = (operators,)
    if not isinstance(operators, Iterable):
        raise ParameterError(
            "operators",
            f"operators must be a name or a sequence of names of {', '.join(OPERATORS)}, got "
            f"{operators!r}",
        )
    operators = tuple(operators)
    bad = [o for o in operators if not isinstance(o, str) or o not in OPERATORS]
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
    """A deep copy of a model as the attacker gets it.

    Frozen, in eval mode, its layer a plain ``nn.Linear`` with the same weights, a new seeded
    linear head.

    Parameters
    ----------
    model : torch.nn.Module
        A timm classifier or an :class:`ImmunizedNet` (an identity layer is inserted into a
        classifier); not changed.
    num_classes : int
        The attacker's classes (the new head's outputs).
    seed : int
        Seeds the new head.

    Returns
    -------
    torch.nn.Module
        backbone → layer → head, with ``net``, ``layer`` and ``head`` attributes.

    Raises
    ------
    ParameterError
        A model whose classifier is not one linear layer on its pre-logits.
    """
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
    """The modules LoRA adapts, each with its adapter's rank.

    Every ``nn.Linear`` and ungrouped ``nn.Conv2d`` of the backbone and the layer (not the heads),
    at ``min(rank, width)`` with ``width = min(out, in·kernel)`` (a wider adapter adds no rank).

    Parameters
    ----------
    attacked : torch.nn.Module
        The attacker's copy (:func:`attack_copy`).
    rank : int
        The adapters' rank.

    Returns
    -------
    dict of str to int
        Module name → rank.

    Raises
    ------
    ParameterError
        A model without a target (``"model"``), or a rank above the width of every target
        (``"lora_ranks"``).
    """
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
    """The peft LoRA adapters (α = r: the update is BA) on :func:`lora_targets`.

    Only the adapters and the head train.
    """
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


def retrain_scope(model, reference) -> tuple[str, ...] | None:
    """The modules of the backbone a removal by retraining re-initialises.

    The fewest last stages (timm's ``feature_info``, with the modules after them but the
    classifier: :func:`~pycore.deep.tail_modules`) that hold every tensor ``model`` changed against
    ``reference``; every top-level module but the classifier when no tail holds them all (the stem
    changed).

    Parameters
    ----------
    model : torch.nn.Module
        The defended model.
    reference : torch.nn.Module
        θ₀, the model it came from.

    Returns
    -------
    tuple of str or None
        The module names; None when the backbones are equal (a layer-only defense, which
        ``remove_layer`` takes off).

    Raises
    ------
    ParameterError
        The two differ in structure (``"reference"``).
    """
    net, ref = as_immunized(model).net, as_immunized(reference).net
    mine, base = net.state_dict(), ref.state_dict()
    if mine.keys() != base.keys() or any(v.shape != base[k].shape for k, v in mine.items()):
        raise ParameterError("reference", "the model and its reference differ in structure")
    names = {id(m): n for n, m in net.named_modules()}
    head = names.get(id(net.get_classifier()), "")
    changed = [
        k
        for k, v in mine.items()
        if not torch.equal(v, base[k]) and not (head and k.startswith(head + "."))
    ]
    if not changed:
        return None
    for k in range(1, len(stage_names(net)) + 1):
        scope = tuple(_module_names(tail_modules(net, k), net))
        if all(any(c.startswith(n + ".") for n in scope) for c in changed):
            return scope
    return tuple(n for n, _ in net.named_children() if n != head)


@torch.no_grad()
def _reinitialise(modules, seed: int) -> None:
    """PyTorch's default initialisation of every layer in ``modules``, drawn from ``seed``.

    PyTorch's default initialisation of every layer in ``modules`` (``reset_parameters``),
    BatchNorm statistics reset, drawn from ``seed`` without touching the global generator.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for mod in modules:
            for m in mod.modules():
                if hasattr(m, "reset_running_stats"):
                    m.reset_running_stats()
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()


def _attacker(model, data: AttackData, op: str, seed: int, scope=None, reinit=False) -> _Attacked:
    """The copy operator ``op`` trains.

    Its trainable parameters marked, convolutions with one output position computed as products
    (:mod:`pycore.deep._convs`: the same values up to round-off, ~10× less CPU time on a ResNet's
    1×1 maps).
    """
    m = attack_copy(model, data.classes, seed=seed)
    if op.startswith("lora_r"):
        m = _with_lora(m, int(op[6:]), seed)
    else:
        if op == "finetune_full":
            mods = [m]
        elif op == "retrain_tail":
            mods = [m.net.get_submodule(n) for n in scope] + [m.layer, m.head]
            if reinit:
                _reinitialise(mods[:-2], seed)
                with torch.no_grad():
                    m.layer.weight.copy_(torch.eye(*m.layer.weight.shape))
                    if m.layer.bias is not None:
                        m.layer.bias.zero_()
        else:
            mods = [*tail_modules(m.net, 1), m.layer, m.head]
        for mod in mods:
            mod.requires_grad_(True)
    m.head.requires_grad_(True)
    # channels-last: CPU convolutions train ~1.2x and infer ~1.2-1.7x faster in it
    return one_position_convs(m).to(memory_format=torch.channels_last)


def _inputs(x: torch.Tensor, dev) -> torch.Tensor:
    x = x.to(dev)
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


def _accuracy(m: nn.Module, ds: Dataset) -> float | str:
    """Accuracy (%) of ``m`` (eval mode) on ``ds``; a string when a logit is non-finite."""
    dev = next(m.parameters()).device
    y = torch.as_tensor(dataset_labels(ds), dtype=torch.int64)
    hits = 0
    with torch.no_grad():
        for s in range(0, len(ds), 256):
            logits = m(_inputs(fetch(ds, torch.arange(s, min(s + 256, len(ds))))[0], dev))
            if not bool(torch.isfinite(logits).all()):
                return "non-finite logits"
            hits += int((logits.argmax(1).cpu() == y[s : s + 256]).sum())
    return 100.0 * hits / len(ds)


class _DeepRuns:
    """:class:`pycore.deep._slowdown.Runs` of one deep operator.

    One attack copy and one Adam per learning rate, every copy on the same seeded mini-batches.
    """

    def __init__(
        self, build: Callable, lrs, data: AttackData, *, seed, batch_size, eval_every, fresh=False
    ):
        self.models = [build() for _ in lrs]
        self.trainable = [[p for p in m.parameters() if p.requires_grad] for m in self.models]
        self.opts = [torch.optim.Adam(ps, lr=lr) for ps, lr in zip(self.trainable, lrs)]
        # with ``fresh`` (a retrain) the modules that own a trainable parameter run in train mode
        self.owners = [
            [
                mod
                for mod in m.modules()
                if fresh and any(p.requires_grad for p in mod.parameters(recurse=False))
            ]
            for m in self.models
        ]
        self.data, self.eval_every = data, eval_every
        self.y = torch.as_tensor(dataset_labels(data.train), dtype=torch.int64)
        self.batches = ShardedBatches(len(data.train), batch_size, seed=seed)
        self.steps = [0] * len(lrs)

    def _batch(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, len(self.batches))
        if k == 0 or not hasattr(self, "_order") or self._order[0] != epoch:
            self._order = (epoch, [idx for (idx,) in self.batches.epoch(epoch)])
        return self._order[1][k]

    def _train(self, g: int) -> str | None:
        m, opt = self.models[g], self.opts[g]
        dev = next(m.parameters()).device
        m.eval()
        for mod in self.owners[g]:
            mod.train()
        try:
            for _ in range(self.eval_every):
                idx = self._batch(self.steps[g])
                loss = F.cross_entropy(
                    m(_inputs(fetch(self.data.train, idx)[0], dev)), self.y[idx].to(dev)
                )
                if not bool(torch.isfinite(loss)):
                    return f"non-finite loss at step {self.steps[g] + 1}"
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                self.steps[g] += 1
        finally:
            m.eval()
        return None

    def advance(self, active: list[bool], test: bool) -> list:
        out = []
        for g, on in enumerate(active):
            if not on:
                out.append(None)
                continue
            why = self._train(g)
            if why is None:
                val = _accuracy(self.models[g], self.data.val)
                tst = _accuracy(self.models[g], self.data.test) if test else float("nan")
                why = next((a for a in (val, tst) if isinstance(a, str)), None)
            out.append(why or Eval(self.steps[g], val, tst))
        return out


@dataclass(frozen=True)
class Operator:
    """One operator against one model, ready to run: its run factory, grid and schedule."""

    name: str
    make: Callable
    grid: dict
    min_steps: int
    max_steps: int
    labels: Callable | None = None


def _features(model, data: AttackData, what: str, model_name: str | None = None) -> tuple:
    from pycore.deep._features import extract  # noqa: PLC0415

    return tuple(
        extract(model, d, what=what, data_name=n, model_name=model_name)
        for d, n in zip((data.train, data.val, data.test), data.names)
    )


def operator(
    model,
    data: AttackData,
    name: str,
    *,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    features: dict | None = None,
    scope: tuple | None = None,
    reinit: bool = False,
    model_name: str | None = None,
) -> Operator:
    """One operator against a model on the attacker's data, ready to run.

    Parameters
    ----------
    model : torch.nn.Module
        The model attacked (θ₀ for a budget, the defended model for a slowdown).
    data : AttackData
        The attacker's splits.
    name : str
        One of :func:`operator_names`.
    seed : int, default 0
        Seeds the operator's runs.
    schedule : Schedule, default Schedule()
        How long the runs go and how often they are evaluated.
    features : dict, optional
        ``{"Z": (train, val, test), "X": ...}`` of the model when already extracted (the immunized
        features, and the layer's inputs for ``remove_layer``).
    scope : tuple of str, optional
        The module names ``retrain_tail`` trains (:func:`retrain_scope`).
    reinit : bool, default False
        Re-initialise ``scope`` first (a retrain, not a fine-tuning).
    model_name : str, optional
        The model's name in errors (``"model"``, ``"reference"``).

    Returns
    -------
    Operator
        Its run factory ``make``, learning-rate grid, step bounds and setting labels.
    """
    net = as_immunized(model).eval()
    y = [dataset_labels(d) for d in (data.train, data.val, data.test)]
    base = name.split("_r")[0] if name.startswith("lora_r") else name
    grid = LR_GRIDS["lora" if name.startswith("lora_r") else base]
    if name in PROBES:
        what = "X" if name == "remove_layer" else "Z"
        Zt, Zv, Zs = (features or {}).get(what) or _features(net, data, what, model_name)
        prep = {}

        def make(variant: str, lrs: tuple):
            if name == "gd":
                A, Av, As = probe_inputs(Zt, Zv, Zs)
                return GDProbe(A, y[0], (Av, y[1]), (As, y[2]), classes=data.classes)
            if variant not in prep:
                a, b = preprocess_features(Zt, np.concatenate([Zv, Zs]), variant)
                prep[variant] = probe_inputs(a, b[: len(Zv)], b[len(Zv) :])
            A, Av, As = prep[variant]
            return AdamProbe(
                A,
                y[0],
                (Av, y[1]),
                (As, y[2]),
                lrs=lrs,
                classes=data.classes,
                batch_size=schedule.batch_size,
                seed=seed,
            )

        labels = (lambda v, lr: "step 1/L") if name == "gd" else None
        return Operator(
            name, make, grid, schedule.probe_min_steps, schedule.probe_max_steps, labels
        )
    if name == "retrain_tail" and not scope:
        raise ParameterError("scope", "retrain_tail needs the modules to retrain (retrain_scope)")
    bs = min(schedule.batch_size, len(data.train))
    per_epoch = len(data.train) // bs
    every = schedule.deep_eval_every or per_epoch
    build = lambda: _attacker(net, data, name, seed, scope, reinit)  # noqa: E731
    k = _tail_stages(net.net, name, scope)
    if k:  # the frozen earlier stages' outputs, once per image (pycore.deep._tail)
        runner = TailRunner(net.net, k)
        shape = tuple(fetch(data.train, torch.arange(1))[0].shape[1:])
        images = data
        data = AttackData(
            *(runner.dataset(net.net, d) for d in (images.train, images.val, images.test)),
            images.classes,
        )

        def build():
            m = _attacker(net, images, name, seed, scope, reinit)
            m.net = runner.attach(m.net, shape)
            return m

        first = fetch(images.train, torch.arange(min(8, len(images.train))))[0]
        runner.check(net.net, runner.attach(copy.deepcopy(net.net), shape), first)

    def make(variant: str, lrs: tuple):
        return _DeepRuns(
            build,
            lrs,
            data,
            seed=seed,
            batch_size=bs,
            eval_every=every,
            fresh=reinit and name == "retrain_tail",
        )

    return Operator(
        name,
        make,
        grid,
        _whole(schedule.deep_min_epochs * per_epoch, every),
        _whole(schedule.deep_max_epochs * per_epoch, every),
    )


def _tail_stages(net: nn.Module, name: str, scope) -> int:
    """How many last stages operator ``name`` trains with every earlier stage frozen.

    How many last stages operator ``name`` trains with every earlier stage frozen (0: it
    trains more, or the network has no stages).
    """
    stages = stage_names(net)
    if not stages:
        return 0
    if name == "finetune_upper":
        return 1
    if name == "retrain_tail":
        k = sum(s in scope for s in stages)
        return k if k and set(scope) == set(_module_names(tail_modules(net, k), net)) else 0
    return 0


def _module_names(mods, net) -> list[str]:
    names = {id(m): n for n, m in net.named_modules()}
    return [names[id(m)] for m in mods]


def _whole(steps: int, every: int) -> int:
    return max(every, every * math.ceil(steps / every))


@bounded_blas
def budgets(
    reference,
    data: AttackData,
    operators=OPERATORS,
    *,
    lora_ranks=LORA_RANKS,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    scope: tuple | None = None,
    features: dict | None = None,
    progress: Callable = lambda name: None,
    model_name: str | None = None,
) -> dict[str, Budget]:
    """θ₀'s :class:`~pycore.deep.Budget` of every operator, against the reference.

    ``retrain_tail`` runs only with a ``scope``: θ₀'s own modules of that scope fine-tuned, the
    reference of a retrain.

    Parameters
    ----------
    reference : torch.nn.Module
        θ₀.
    data : AttackData
        The attacker's splits.
    operators : str or sequence of str, default OPERATORS
        As for :func:`operator_names`.
    lora_ranks : int or sequence of int, default LORA_RANKS
        As for :func:`operator_names`.
    seed : int, default 0
        Seeds every run.
    schedule : Schedule, default Schedule()
        How long the runs go and how often they are evaluated.
    scope : tuple of str, optional
        :func:`retrain_scope` of the defended model.
    features : dict, optional
        As for :func:`operator`.
    progress : callable, optional
        Called with each operator's name as it starts.
    model_name : str, optional
        The reference's name in errors.

    Returns
    -------
    dict of str to Budget
        Operator name → θ₀'s budget.

    Raises
    ------
    ParameterError
        As :func:`operator_names` raises.
    """
    names = operator_names(operators, lora_ranks)
    chance, out = data.chance, {}
    for n in names:
        if n == "retrain_tail" and not scope:
            continue
        progress(n)
        op = operator(
            reference,
            data,
            n,
            seed=seed,
            schedule=schedule,
            scope=scope,
            features=features,
            model_name=model_name,
        )
        out[n] = slowdown.budget(
            n,
            op.make,
            op.grid,
            chance=chance,
            min_steps=op.min_steps,
            max_steps=op.max_steps,
            labels=op.labels,
        )
    return out


@bounded_blas
def slowdowns(
    model,
    data: AttackData,
    reference_budgets: dict[str, Budget],
    *,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    scope: tuple | None = None,
    features: dict | None = None,
    progress: Callable = lambda name: None,
    model_name: str | None = None,
) -> dict[str, Slowdown]:
    """Every operator of θ₀'s budgets against a model, under those budgets.

    ``retrain_tail`` re-initialises ``scope`` (it is left out when there is none).

    Parameters
    ----------
    model : torch.nn.Module
        The defended model.
    data : AttackData
        The attacker's splits (those of the budgets).
    reference_budgets : dict of str to Budget
        :func:`budgets` of θ₀.
    seed : int, default 0
        Seeds every run.
    schedule : Schedule, default Schedule()
        How long the runs go and how often they are evaluated.
    scope : tuple of str, optional
        :func:`retrain_scope` of the model.
    features : dict, optional
        As for :func:`operator`.
    progress : callable, optional
        Called with each operator's name as it starts.
    model_name : str, optional
        The model's name in errors.

    Returns
    -------
    dict of str to Slowdown
        Operator name → its :class:`~pycore.deep.Slowdown`.

    Raises
    ------
    FloatingPointError
        Every setting of an operator diverged on ``model``; the message names it and them.
    """
    out = {}
    for n, ref in reference_budgets.items():
        if n == "retrain_tail" and not scope:
            continue
        progress(n)
        op = operator(
            model,
            data,
            n,
            seed=seed,
            schedule=schedule,
            scope=scope,
            reinit=True,
            features=features,
            model_name=model_name,
        )
        out[n] = slowdown.attack(n, op.make, ref, labels=op.labels)
    return out


@dataclass(frozen=True)
class AuditResult:
    """Every operator's :class:`~pycore.deep.Slowdown` against one model, and the two worst cases.

    ``worst_slowdown``, the smallest slowdown over operators (the attacker's best way around the
    defense; ``worst_slowdown_censored`` when even that one is a censored lower bound), and
    ``worst``, the operator that reaches the highest test accuracy at θ₀'s budget, with its
    deficit; ``skipped``: the operators asked for that were not run, each with why.
    """

    operators: tuple  # Slowdown, in the order run
    worst_slowdown: float
    worst_slowdown_operator: str
    worst_slowdown_censored: bool
    worst: str
    worst_deficit: float
    extra: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # operator name → why it was not run

    def __getitem__(self, name: str) -> Slowdown:
        for s in self.operators:
            if s.operator == name:
                return s
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "operators": {s.operator: s.to_dict() for s in self.operators},
            "worst_slowdown": self.worst_slowdown,
            "worst_slowdown_operator": self.worst_slowdown_operator,
            "worst_slowdown_censored": self.worst_slowdown_censored,
            "worst": self.worst,
            "worst_deficit": self.worst_deficit,
            **({"skipped": dict(self.skipped)} if self.skipped else {}),
            **self.extra,
        }


def audit_result(results: dict[str, Slowdown], skipped: dict | None = None) -> AuditResult:
    """The :class:`AuditResult` of one model's slowdowns.

    Parameters
    ----------
    results : dict of str to Slowdown
        Operator name → slowdown (:func:`slowdowns`).
    skipped : dict of str to str, optional
        Operator name → why it was asked for and not run.

    Returns
    -------
    AuditResult
        The slowdowns in order, the smallest one (the attacker's best way around the defense) and
        the operator of highest test accuracy at θ₀'s budget, with its deficit.

    Raises
    ------
    ParameterError
        No operator was run (``"operators"``).
    """
    if not results:
        raise ParameterError("operators", "no operator was run")
    rows = tuple(results.values())
    slow = min(rows, key=lambda s: (s.slowdown, s.censored))
    # an operator with no test accuracy at B₀ (NaN: its run diverged on the way) is never the
    # worst; max() over NaN keys depends on the order
    worst = max(
        rows, key=lambda s: -math.inf if math.isnan(s.test_at_budget) else s.test_at_budget
    )
    return AuditResult(
        rows,
        slow.slowdown,
        slow.operator,
        slow.censored,
        worst.operator,
        worst.deficit,
        skipped=dict(skipped or {}),
    )
