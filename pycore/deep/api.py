"""The public deep API (docs/design.md §3): :func:`immunize_model` and :func:`audit_model`, for any
timm classifier and data given as an ``(X, y)`` tensor pair, a ``Dataset`` or a ``DataLoader``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import numpy as np
from torch.utils.data import Subset

from pycore.deep.data import as_dataset, dataset_labels, label_count
from pycore.deep.features import extract, prelogits_dataset
from pycore.deep.layer import attainability
from pycore.deep.models import ImmunizedNet, as_immunized
from pycore.deep.operators import (
    LORA_RANKS,
    OPERATORS,
    AttackData,
    AuditResult,
    compare,
    run_operators,
)
from pycore.deep.train import DeepOptions, immunize_in_place, options
from pycore.evaluate import immunized_def31
from pycore.metrics import ExponentWindow, feature_rir, grouped_feature_rir
from pycore.validation import ParameterError, check_number

__all__ = ["DeepImmunization", "GroupedRIR", "immunize_model", "audit_model", "AUDIT_OPTIONS"]


@dataclass(frozen=True)
class GroupedRIR:
    """RIR_θ₀ by the paper's protocol (docs/theory.md §8): means over ``groups`` random groups of
    ``group_size`` rows of (i), (ii) and RIR, and Definition 3.1 on those means."""

    harmful_ratio: float
    pretrain_ratio: float
    rir: float
    groups: int
    group_size: int

    @property
    def immunized(self) -> bool:
        return immunized_def31(self.harmful_ratio, self.pretrain_ratio)


@dataclass(frozen=True)
class DeepImmunization:
    """:func:`immunize_model`'s result: the immunized copy; (i) ``harmful_ratio``, (ii)
    ``pretrain_ratio`` and ``rir`` of its features against the given model's on ALL given rows
    (exact κ's, the quantities of the linear problem the layer is, docs/theory.md §8, §10),
    Definition 3.1 on them; the paper's grouped RIR_θ₀; the RIR ceiling of the given model's
    features and the closed form's Definition 3.1 window on them (``None``: κ(C) = 1); ``reason``:
    how training ended and, when Definition 3.1 fails, why."""

    model: ImmunizedNet
    method: str
    harmful_ratio: float
    pretrain_ratio: float
    rir: float
    immunized: bool
    grouped: GroupedRIR
    ceiling: float
    window: "ExponentWindow | None"
    steps: int
    options: DeepOptions
    reason: str
    wall_seconds: float
    hardening: "dict | None" = None
    lambdas: dict = field(default_factory=dict)
    history: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Every field but the model (and the per-step history), JSON-ready."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        del out["model"], out["history"]
        out["grouped"] = {**self.grouped.__dict__, "immunized": self.grouped.immunized}
        out["window"] = None if self.window is None else self.window.to_dict()
        out["options"] = self.options.__dict__
        return out


def immunize_model(
    model, dp, dh, *, method: str = "ours", seed: int = 0, **opts
) -> DeepImmunization:
    """Immunize a copy of ``model`` against ``dh`` while it keeps ``dp`` (paper §5.2).

    The default, ``method="ours"`` with scope ``"layer"``, inserts an immunization layer between
    the frozen backbone and the head and trains it on the backbone's features, computed once, by
    the adaptive rule of the linear default (docs/design.md §4): the layer is the linear problem
    of docs/theory.md §10, so its ceiling and the closed form's window on the same features say
    whether a miss is the method's or the features'. The paper's fixed-λ SGD loop is
    ``rule="sgd"``; ``"imma"``, ``"opt_kappa"``, ``"r_ill_only"`` are the baselines.

    Parameters
    ----------
    model : torch.nn.Module
        A timm classifier, or any module with timm's ``forward_features``,
        ``forward_head(pre_logits=True)`` and ``get_classifier()``. Left as it is.
    dp, dh : tuple of tensors, Dataset or DataLoader
        The pre-training task D_P (labels are ``model``'s classes) and the harmful task D_H
        (``(X, y)`` with integer labels).
    method : str
        One of :data:`~pycore.deep.train.DEEP_METHODS`.
    seed : int
        Seeds the training and the paper's grouped RIR_θ₀.
    **opts
        Fields of :class:`~pycore.deep.train.DeepOptions`.

    Returns
    -------
    DeepImmunization
        The immunized copy and, on ALL given rows, (i), (ii), RIR and Definition 3.1 against the
        given model's features; the grouped RIR_θ₀; the ceiling and window; ``reason``.

    Raises
    ------
    ParameterError
        An unknown or out-of-range option, named.
    DataError
        Labels of ``dp`` outside the model's classes, or unbounded labels of ``dh``.
    NonFiniteLossError
        The SGD loop's loss became non-finite; names the option to change.

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import create_model, immunize_model
    >>> net = create_model("resnet10t", 2, seed=0)
    >>> g = torch.Generator().manual_seed(0)
    >>> X, y = torch.randn(96, 3, 32, 32, generator=g), torch.arange(96) % 2
    >>> res = immunize_model(net, (X[:48], y[:48]), (X[48:], y[48:]), adaptive_steps=200)
    >>> res.method, res.model is net, res.immunized == (res.harmful_ratio > 1 > res.pretrain_ratio)
    ('ours', False, True)
    """
    o = options(**opts)
    p, h = as_dataset(dp, "dp"), as_dataset(dh, "dh")
    classes_h = label_count(dataset_labels(h), "dh")  # before the harmful head is sized by it
    out = as_immunized(model).eval()
    cached = o.scope == "layer"
    if cached:
        p, h = prelogits_dataset(out, p), prelogits_dataset(out, h)
    label_count(dataset_labels(p), "dp", out.classifier.out_features)
    before = [extract(out, d, cached=cached) for d in (p, h)]
    t0 = time.perf_counter()
    res = immunize_in_place(
        out,
        p,
        h,
        method,
        o,
        seed=seed,
        num_classes_h=classes_h,
        cached=cached,
        device=next(out.parameters()).device,
    )
    after = [extract(out, d, cached=cached) for d in (p, h)]
    r = feature_rir(*after, *before)
    g = grouped_feature_rir(
        *after, *before, rng=np.random.default_rng(seed), groups=20, group_size=100
    )
    grouped = GroupedRIR(
        g["harmful_ratio"]["mean"],
        g["pretrain_ratio"]["mean"],
        g["value"]["mean"],
        g["groups"],
        g["group_size"],
    )
    ceiling, window, why = attainability(*before, precision=out.layer.weight.dtype)
    ok = immunized_def31(r.harmful_ratio, r.pretrain_ratio)
    reason = res.stopped or f"trained {res.steps} steps"
    if not ok and why not in reason:
        reason += (
            f"; Definition 3.1 does not hold on the given rows ((i) = {r.harmful_ratio:.4g}, "
            f"(ii) = {r.pretrain_ratio:.4g}): {why}"
        )
    return DeepImmunization(
        out.eval(),
        method,
        r.harmful_ratio,
        r.pretrain_ratio,
        r.value,
        ok,
        grouped,
        ceiling,
        window,
        res.steps,
        o,
        reason,
        time.perf_counter() - t0,
        res.hardening,
        res.lambdas,
        res.history,
    )


AUDIT_OPTIONS = {
    "epochs": (1, 5),
    "operators": OPERATORS,
    "lora_ranks": LORA_RANKS,
    "test_fraction": 0.2,
    "val_fraction": 0.2,
}


def audit_model(model, *, reference, dh, dh_test=None, seed: int = 0, **opts) -> AuditResult:
    """Attack ``model`` and ``reference`` (θ₀) on the harmful task with every operator and
    compare what the attacker gets from each (docs/design.md §3).

    The operators of :mod:`pycore.deep.operators`: linear probes (GD at 1/L, Adam, whitened
    Adam), LoRA adapters at each of ``lora_ranks`` on the backbone's linear and convolution
    layers, fine-tuning of the upper stages and of the whole network. Each picks its setting from
    its grid (:data:`~pycore.deep.operators.LR_GRIDS`) on a seeded ``val_fraction`` of the
    attacker's data, as an attacker who tunes would, and is scored on ``dh_test`` after each of
    ``epochs``.

    Parameters
    ----------
    model, reference : torch.nn.Module
        The defended model and the model it came from (θ₀); neither is changed.
    dh : tuple of tensors, Dataset or DataLoader
        The attacker's labelled D_H data.
    dh_test : same, optional
        D_H test data (default: a seeded ``test_fraction`` of ``dh``, held out).
    seed : int
        Seeds the splits and every operator.
    **opts
        ``epochs`` (an int or a tuple, default ``(1, 5)``), ``operators`` (a subset of
        :data:`~pycore.deep.operators.OPERATORS`), ``lora_ranks``, ``test_fraction``,
        ``val_fraction`` (:data:`AUDIT_OPTIONS`).

    Returns
    -------
    AuditResult
        Per operator the D_H test accuracies of both models at each epoch, the signed deficit
        (``reference − model`` in points; > 0: the defense slowed the attacker), the signed and the
        absolute RFD, best-so-far accuracies; and the worst case over operators.

    Raises
    ------
    ParameterError
        An unknown option or a bad value, named.
    DataError
        Unbounded labels of ``dh`` or ``dh_test``.

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import audit_model, create_model
    >>> net = create_model("resnet10t", 2, seed=0)
    >>> g = torch.Generator().manual_seed(0)
    >>> dh = (torch.randn(40, 3, 32, 32, generator=g), torch.arange(40) % 2)
    >>> audit = audit_model(net, reference=net, dh=dh, epochs=1, operators=("gd", "adam"))
    >>> [c.operator for c in audit.operators], audit["gd"].mean_deficit
    (['gd', 'adam'], 0.0)
    """
    bad = [k for k in opts if k not in AUDIT_OPTIONS]
    if bad:
        raise ParameterError(
            bad[0],
            f"unknown option {bad[0]!r} of audit_model; options: {', '.join(AUDIT_OPTIONS)}",
        )
    o = {**AUDIT_OPTIONS, **opts}
    epochs = tuple(sorted({o["epochs"]} if isinstance(o["epochs"], int) else set(o["epochs"])))
    if not (epochs and all(isinstance(e, int) and 1 <= e <= 1000 for e in epochs)):
        raise ParameterError(
            "epochs", f"epochs must be integers in [1, 1000], got {o['epochs']!r}"
        )
    for k in ("test_fraction", "val_fraction"):
        check_number(o[k], k, low=0, high=1, low_open=True, high_open=True)
    train = as_dataset(dh, "dh")
    rng = np.random.default_rng([seed, 4])
    if dh_test is None:
        perm = rng.permutation(len(train)).tolist()
        k = max(1, int(round(o["test_fraction"] * len(train))))
        train, test = Subset(train, sorted(perm[k:])), Subset(train, sorted(perm[:k]))
    else:
        test = as_dataset(dh_test, "dh_test")
    perm = rng.permutation(len(train)).tolist()
    k = max(1, int(round(o["val_fraction"] * len(train))))
    # labels bounded before the attacker's heads are sized by them (data.label_count)
    classes = max(label_count(dataset_labels(d), n) for d, n in ((train, "dh"), (test, "dh_test")))
    train, val = Subset(train, sorted(perm[k:])), Subset(train, sorted(perm[:k]))
    data = AttackData(train, val, test, classes)
    kw = dict(operators=o["operators"], epochs=epochs, lora_ranks=o["lora_ranks"], seed=seed)
    return compare(run_operators(model, data, **kw), run_operators(reference, data, **kw))
