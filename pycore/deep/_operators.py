"""Every operator an attacker has against a released extractor (docs/theory.md §12).

An operator learns D_H from the model it is given, at each setting of its grid
(:data:`LR_GRIDS`, widened per model by :mod:`pycore.deep._slowdown`), and has a cost in FLOPs
(:mod:`pycore.deep._cost`):

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
* ``retrain``: the last ``k`` stages re-initialised by the architecture's own initialisation (a
  fresh ``timm.create_model``) and trained from the frozen earlier stages with the layer (reset to
  the identity) and a new head, one operator per ``k`` (``retrain_last<k>``, every suffix of
  stages): the attacker who keeps only what the release's early stages give.
* ``scratch``: the same architecture from its own random initialisation, trained on the
  attacker's images: the attacker who ignores the release. It is the same run on every model.

Deep operators train a copy with Adam on seeded mini-batches in eval mode (the released model's
normalisation statistics: on the demo's ResNet18 full fine-tuning in train mode reached about 50 %
where eval mode reached 83 %, after 20 steps at lr 1e-4), the layer as a plain ``nn.Linear`` (a
released model's layer has no preconditioner); a retrain trains its re-initialised modules, and
``scratch`` its whole network, in train mode (their BatchNorm statistics are new and must be
learned). Every copy is evaluated in eval mode. A setting whose loss or logits become non-finite
is marked diverged and left out of the best-of-grid.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import pycore.deep._slowdown as slowdown
from pycore._threads import bounded_blas
from pycore._validation import ParameterError, check_counts
from pycore.deep._convs import one_position_convs
from pycore.deep._cost import (
    Cost,
    counted_flops,
    forward_flops,
    head_step_flops,
    preprocessing_flops,
)
from pycore.deep._data import ShardedBatches, dataset_labels, fetch
from pycore.deep._models import as_immunized, create_model, tail_modules
from pycore.deep._probes import AdamProbe, GDProbe, preprocess_features, probe_inputs
from pycore.deep._slowdown import Budget, Eval
from pycore.deep._tail import TailRunner, stage_names

OPERATORS = (
    "gd",
    "adam",
    "adam_whitened",
    "remove_layer",
    "lora",
    "finetune_upper",
    "finetune_full",
    "retrain",
    "scratch",
)
PROBES = ("gd", "adam", "adam_whitened", "remove_layer")
_ROOT10 = math.sqrt(10.0)
_RETRAIN = re.compile(r"retrain_last([1-9][0-9]*)")
_LORA = re.compile(r"lora_r([1-9][0-9]*)")


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
    "retrain": {"": _rates(1e-4, 3)},
    "scratch": {"": _rates(3.16e-4, 3)},
}
LORA_RANKS = (8, 32)  # the ranks of the operator-transfer report cited in docs/findings.md §7


def family(name: str) -> str:
    """The operator family of an operator name: its key in :data:`LR_GRIDS`.

    Parameters
    ----------
    name : str
        An operator name (``lora_r8``, ``retrain_last2``, ``adam``, ...).

    Returns
    -------
    str
        ``"lora"``, ``"retrain"`` or the name itself.
    """
    if name.startswith("lora_r"):
        return "lora"
    if _RETRAIN.fullmatch(name):
        return "retrain"
    return name


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
    """How long operators run, in optimizer steps of mini-batches of ``batch_size``.

    Every operator is evaluated at :func:`pycore.deep._slowdown.next_eval`'s steps; a plateau is
    confirmed after ``min_steps`` at the earliest (every kind of operator alike); probes run at
    most ``probe_max_steps``, deep operators ``deep_max_steps``, on θ₀.
    """

    batch_size: int = 64
    min_steps: int = 40
    probe_max_steps: int = 20000
    deep_max_steps: int = 300


def operator_names(operators=OPERATORS, lora_ranks=LORA_RANKS, *, depths: tuple | None = None):
    """The operator names a selection expands to.

    ``lora`` → ``lora_r<r>`` per rank; ``retrain`` → ``retrain_last<k>`` for every ``k`` of
    ``depths`` (kept as ``retrain`` when ``depths`` is None: the model is not known yet).

    Parameters
    ----------
    operators : str or sequence of str, default OPERATORS
        Names of :data:`OPERATORS`, or ``retrain_last<k>``.
    lora_ranks : int or sequence of int, default LORA_RANKS
        The LoRA ranks, positive integers (``numbers.Integral``, not bool).
    depths : tuple of int, optional
        The model's :func:`retrain_depths`.

    Returns
    -------
    tuple of str
        The names, in order, each once.

    Raises
    ------
    ParameterError
        An unknown, empty or absent selection, a ``retrain_last<k>`` beyond the model's stages,
        or ``lora`` without peft installed (``"operators"``); a rank that is not a positive
        integer (``"lora_ranks"``).
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
    bad = [
        o
        for o in operators
        if not isinstance(o, str)
        or not (o in OPERATORS or _RETRAIN.fullmatch(o) or _LORA.fullmatch(o))
    ]
    if bad or not operators:
        raise ParameterError(
            "operators",
            f"unknown operator {bad[0]!r}; choose from {', '.join(OPERATORS)}"
            if bad
            else "operators is empty",
        )
    if "lora" in operators:
        ranks = check_counts(lora_ranks, "lora_ranks", low=1)
    if any(family(o) == "lora" for o in operators):
        if importlib.util.find_spec("peft") is None:  # before the other operators compute
            raise ParameterError(
                "operators",
                "the lora operator needs peft, which is not installed: pip install "
                "'model-immunization[deep]' (or leave lora out of operators)",
            )
    out = []
    for o in operators:
        if o == "lora":
            out += [f"lora_r{r}" for r in ranks]
        elif o == "retrain" and depths is not None:
            out += [f"retrain_last{k}" for k in depths]
        else:
            if depths is not None and (m := _RETRAIN.fullmatch(o)) and int(m[1]) not in depths:
                raise ParameterError(
                    "operators",
                    f"{o}: the model's distinct suffixes of stages are the last "
                    f"{', '.join(map(str, depths))} (timm's feature_info)",
                )
            out.append(o)
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


def architecture(model) -> Callable[[int, int], nn.Module]:
    """The model's architecture from its own initialisation: ``fresh(num_classes, seed)``.

    A network made by :func:`~pycore.deep.create_model` or :func:`~pycore.deep.load_model` is
    rebuilt from the name and options it records; any other timm network from the architecture
    its ``pretrained_cfg`` names, when that builds the same shapes.

    Parameters
    ----------
    model : torch.nn.Module
        A timm classifier or an :class:`~pycore.deep.ImmunizedNet`.

    Returns
    -------
    callable
        ``fresh(num_classes, seed) -> torch.nn.Module``, drawn from ``seed`` without touching the
        global generator.

    Raises
    ------
    ParameterError
        ``"model"``: the architecture cannot be rebuilt.
    """
    net = getattr(model, "net", model)
    args = getattr(net, "model_args", None)
    if args:
        name, kw = args["name"], {k: v for k, v in args.items() if k != "name"}
        return lambda classes, seed: create_model(name, classes, seed=seed, **kw)
    arch = (getattr(net, "pretrained_cfg", None) or {}).get("architecture")
    if arch and timm.is_model(arch):

        def fresh(classes: int, seed: int) -> nn.Module:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return timm.create_model(arch, num_classes=classes)

        mine = {k: v.shape for k, v in net.state_dict().items()}
        theirs = {k: v.shape for k, v in fresh(_classes(net), 0).state_dict().items()}
        head = _classifier_prefix(net)
        same = lambda d: {k: v for k, v in d.items() if not (head and k.startswith(head))}  # noqa: E731
        if same(mine) == same(theirs):
            return fresh
    raise ParameterError(
        "model",
        f"{type(net).__name__} cannot be rebuilt from its own initialisation (it records no "
        "pycore.deep.create_model options, and its pretrained_cfg's architecture has other "
        "shapes): make it with pycore.deep.create_model or load_model, or leave the retrain and "
        "scratch operators out",
    )


def _classes(net: nn.Module) -> int:
    return int(getattr(net, "num_classes", 0) or 1)


def _classifier_prefix(net: nn.Module) -> str:
    names = {id(m): n for n, m in net.named_modules()}
    return names.get(id(net.get_classifier()), "")


def retrain_depths(model) -> tuple[int, ...]:
    """The suffixes of stages a retrain can re-initialise, each with parameters of its own.

    ``k`` for each suffix of the last ``k`` stages (timm's ``feature_info``) whose parameters
    differ from the next shorter suffix's (a first stage without parameters adds nothing).

    Parameters
    ----------
    model : torch.nn.Module
        A timm network or an :class:`~pycore.deep.ImmunizedNet`.

    Returns
    -------
    tuple of int
        The depths, shortest first; empty for a network without stages.
    """
    net = getattr(model, "net", model)
    out, seen = [], set()
    for k in range(1, len(stage_names(net)) + 1):
        params = {
            f"{n}.{p}"
            for n in retrain_modules(net, k)
            for p, _ in net.get_submodule(n).named_parameters()
        }
        if params != seen:
            out.append(k)
            seen = params
    return tuple(out)


def retrain_modules(net: nn.Module, k: int) -> tuple[str, ...]:
    """The module names ``retrain_last<k>`` re-initialises: the last ``k`` stages and after.

    Parameters
    ----------
    net : torch.nn.Module
        A timm network.
    k : int
        How many last stages (timm's ``feature_info``).

    Returns
    -------
    tuple of str
        :func:`~pycore.deep.tail_modules`'s names.
    """
    return tuple(_module_names(tail_modules(net, k), net))


@torch.no_grad()
def _reinitialise(net: nn.Module, names, fresh_net: nn.Module) -> None:
    """Modules ``names`` of ``net`` take ``fresh_net``'s weights and buffers (one architecture)."""
    for n in names:
        net.get_submodule(n).load_state_dict(fresh_net.get_submodule(n).state_dict())


def _attacker(model, data: AttackData, op: str, seed: int, fresh=None) -> nn.Module:
    """The copy operator ``op`` trains.

    Its trainable parameters marked, convolutions with one output position computed as products
    (:mod:`pycore.deep._convs`: the same values up to round-off, ~10× less CPU time on a ResNet's
    1×1 maps).
    """
    if op == "scratch":
        m = fresh(data.classes, seed).requires_grad_(True)
        return one_position_convs(m).to(memory_format=torch.channels_last)
    m = attack_copy(model, data.classes, seed=seed)
    if op.startswith("lora_r"):
        m = _with_lora(m, int(op[6:]), seed)
    else:
        if op == "finetune_full":
            mods = [m]
        elif (k := _RETRAIN.fullmatch(op)) is not None:
            names = retrain_modules(m.net, int(k[1]))
            _reinitialise(m.net, names, fresh(_classes(m.net), seed))
            mods = [m.net.get_submodule(n) for n in names] + [m.layer, m.head]
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

    One attack copy and one Adam per learning rate, every copy on the same seeded mini-batches;
    with ``fresh`` the modules that own a trainable parameter train in train mode.
    """

    def __init__(self, build: Callable, lrs, data: AttackData, *, seed, batch_size, fresh=False):
        self.models = [build() for _ in lrs]
        self.trainable = [[p for p in m.parameters() if p.requires_grad] for m in self.models]
        self.opts = [torch.optim.Adam(ps, lr=lr) for ps, lr in zip(self.trainable, lrs)]
        self.owners = [
            [
                mod
                for mod in m.modules()
                if fresh and any(p.requires_grad for p in mod.parameters(recurse=False))
            ]
            for m in self.models
        ]
        self.data = data
        self.y = torch.as_tensor(dataset_labels(data.train), dtype=torch.int64)
        self.batches = ShardedBatches(len(data.train), batch_size, seed=seed)
        self.steps = [0] * len(lrs)

    def _batch(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, len(self.batches))
        if k == 0 or not hasattr(self, "_order") or self._order[0] != epoch:
            self._order = (epoch, [idx for (idx,) in self.batches.epoch(epoch)])
        return self._order[1][k]

    def _train(self, g: int, to: int) -> str | None:
        m, opt = self.models[g], self.opts[g]
        dev = next(m.parameters()).device
        m.eval()
        for mod in self.owners[g]:
            mod.train()
        try:
            while self.steps[g] < to:
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

    def advance(self, targets: list) -> list:
        out = []
        for g, to in enumerate(targets):
            if to is None:
                out.append(None)
                continue
            why = self._train(g, to)
            val = _accuracy(self.models[g], self.data.val) if why is None else why
            out.append(val if isinstance(val, str) else Eval(self.steps[g], val))
        return out

    def test(self, index: int) -> float | str:
        return _accuracy(self.models[index], self.data.test)


@dataclass(frozen=True)
class Operator:
    """One operator against one model, ready to run.

    Its run factory, learning-rate grid, step bounds on θ₀, setting labels and :class:`Cost`.
    """

    name: str
    make: Callable
    grid: dict
    min_steps: int
    max_steps: int
    cost: Cost
    labels: Callable | None = None

    @property
    def probe(self) -> bool:
        return self.name in PROBES


def _features(model, data: AttackData, what: str, model_name: str | None = None) -> tuple:
    from pycore.deep._features import extract  # noqa: PLC0415

    return tuple(
        extract(model, d, what=what, data_name=n, model_name=model_name)
        for d, n in zip((data.train, data.val, data.test), data.names)
    )


# images a forward pass is counted on (FLOPs are linear in the batch)
_COUNT_BATCH = 8


def _probe_cost(net, data: AttackData, name: str, variant_kinds, width: int, bs: int) -> Cost:
    """A probe's cost: the extraction of its training features, its preprocessing, its steps."""
    n = len(data.train)
    x = fetch(data.train, torch.arange(min(_COUNT_BATCH, n)))[0]
    x = x.to(next(net.parameters()).device)
    feats = net.prelogits if name == "remove_layer" else net.features
    setup = forward_flops(_Call(feats), x) * n / len(x)
    pre = max(preprocessing_flops(k, n, width) for k in variant_kinds)
    rows = n if name == "gd" else min(bs, n)
    return Cost(setup + pre, head_step_flops(rows, width + 1, data.classes))


class _Call(nn.Module):
    """A bound method as a module (FLOPs are counted on module calls)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _step_flops(build: Callable, data: AttackData, bs: int) -> float:
    """The FLOPs of one training step of a fresh copy from ``build`` on the first batch."""
    m = build()
    dev = next(m.parameters()).device
    x = _inputs(fetch(data.train, torch.arange(bs))[0], dev)
    y = torch.as_tensor(dataset_labels(data.train)[:bs], dtype=torch.int64, device=dev)

    def step():
        F.cross_entropy(m(x), y).backward()

    return counted_flops(step)


def operator(
    model,
    data: AttackData,
    name: str,
    *,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    features: dict | None = None,
    fresh: Callable | None = None,
    model_name: str | None = None,
) -> Operator:
    """One operator against a model on the attacker's data, ready to run, with its cost.

    Parameters
    ----------
    model : torch.nn.Module
        The model attacked (θ₀, or a defended model).
    data : AttackData
        The attacker's splits.
    name : str
        One of :func:`operator_names`'s expanded names.
    seed : int, default 0
        Seeds the operator's runs (and a retrain's or scratch's initialisation).
    schedule : Schedule, default Schedule()
        The batch size and the step bounds.
    features : dict, optional
        ``{"Z": (train, val, test), "X": ...}`` of the model when already extracted (the immunized
        features, and the layer's inputs for ``remove_layer``).
    fresh : callable, optional
        ``fresh(num_classes, seed)``, the architecture from its own initialisation
        (:func:`architecture`; default: the model's own).
    model_name : str, optional
        The model's name in errors (``"model"``, ``"reference"``).

    Returns
    -------
    Operator
        Its run factory ``make``, learning-rate grid, step bounds, labels and FLOPs.
    """
    net = as_immunized(model).eval()
    y = [dataset_labels(d) for d in (data.train, data.val, data.test)]
    base = family(name)
    grid = LR_GRIDS[base]
    bs = min(schedule.batch_size, len(data.train))
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

        kinds = ("gd",) if name == "gd" else tuple(grid)
        cost = _probe_cost(net, data, name, kinds, Zt.shape[1], schedule.batch_size)
        labels = (lambda v, lr: "step 1/L") if name == "gd" else None
        return Operator(
            name, make, grid, schedule.min_steps, schedule.probe_max_steps, cost, labels
        )
    if (base in ("retrain", "scratch")) and fresh is None:
        fresh = architecture(net)
    build = lambda: _attacker(net, data, name, seed, fresh)  # noqa: E731
    k = _tail_stages(net.net, name)
    setup = waste = 0.0
    if k:  # the frozen earlier stages' outputs, once per image (pycore.deep._tail)
        runner = TailRunner(net.net, k)
        shape = tuple(fetch(data.train, torch.arange(1))[0].shape[1:])
        images = data
        # the attacker's one-time work: its training images through the frozen stages
        trained = []
        setup = counted_flops(lambda: trained.append(runner.dataset(net.net, images.train)))
        data = AttackData(
            trained[0],
            *(runner.dataset(net.net, d) for d in (images.val, images.test)),
            images.classes,
        )

        def build():
            m = _attacker(net, images, name, seed, fresh)
            m.net = runner.attach(m.net, shape)
            return m

        first = fetch(images.train, torch.arange(min(8, len(images.train))))[0]
        runner.check(net.net, runner.attach(copy.deepcopy(net.net), shape), first)
        # the stem runs on zeros in every tail step and its output is discarded (_tail): not
        # the attacker's work, so not counted
        zeros = torch.zeros((bs, *shape), device=first.device)
        stem = runner.attach(copy.deepcopy(net.net), shape).net
        waste = counted_flops(lambda: runner.inputs(stem, zeros))
    cost = Cost(setup, _step_flops(build, data, bs) - waste)

    def make(variant: str, lrs: tuple):
        return _DeepRuns(
            build,
            lrs,
            data,
            seed=seed,
            batch_size=bs,
            fresh=base in ("retrain", "scratch"),
        )

    return Operator(name, make, grid, schedule.min_steps, schedule.deep_max_steps, cost)


def _tail_stages(net: nn.Module, name: str) -> int:
    """How many last stages operator ``name`` trains with every earlier stage frozen.

    0: it trains more, or the network has no stages.
    """
    stages = stage_names(net)
    if not stages:
        return 0
    if name == "finetune_upper":
        return 1
    if (m := _RETRAIN.fullmatch(name)) is not None:
        return int(m[1])
    return 0


def _module_names(mods, net) -> list[str]:
    names = {id(m): n for n, m in net.named_modules()}
    return [names[id(m)] for m in mods]


@bounded_blas
def budgets(
    reference,
    data: AttackData,
    operators=OPERATORS,
    *,
    lora_ranks=LORA_RANKS,
    seed: int = 0,
    schedule: Schedule = Schedule(),
    features: dict | None = None,
    fresh: Callable | None = None,
    progress: Callable = lambda name: None,
    model_name: str | None = None,
) -> dict[str, tuple[Budget, Operator]]:
    """θ₀'s plateau of every operator but ``scratch`` (which does not use θ₀), with its operator.

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
        The batch size and the step bounds.
    features : dict, optional
        As for :func:`operator`.
    fresh : callable, optional
        As for :func:`operator`.
    progress : callable, optional
        Called with each operator's name as it starts.
    model_name : str, optional
        The reference's name in errors.

    Returns
    -------
    dict of str to (Budget, Operator)
        Operator name → θ₀'s budget and the operator it was run with.

    Raises
    ------
    ParameterError
        As :func:`operator_names` raises.
    """
    net = as_immunized(reference)
    names = operator_names(operators, lora_ranks, depths=retrain_depths(net))
    chance, out = data.chance, {}
    for n in names:
        if n == "scratch":
            continue
        progress(n)
        op = operator(
            net,
            data,
            n,
            seed=seed,
            schedule=schedule,
            features=features,
            fresh=fresh,
            model_name=model_name,
        )
        out[n] = (
            slowdown.budget(
                n,
                op.make,
                op.grid,
                chance=chance,
                min_steps=op.min_steps,
                max_steps=op.max_steps,
                labels=op.labels,
            ),
            op,
        )
    return out
