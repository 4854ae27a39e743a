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
    """Immunize a copy of ``model`` (a timm classifier, or a module with timm's
    ``forward_features`` / ``forward_head(pre_logits=True)`` / ``get_classifier()``) against ``dh``
    while it keeps ``dp``. ``opts`` are the fields of :class:`~pycore.deep.train.DeepOptions` (a
    bad one is a ParameterError naming it). The default, ``ours`` with scope ``"layer"``, solves
    the layer on the frozen backbone's features computed once by the linear default's adaptive
    rule (docs/design.md §4). A non-finite loss of the SGD loop raises
    :class:`~pycore.deep.train.NonFiniteLossError` naming the option to change."""
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
    ceiling, window, why = attainability(*before)
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
    """Every operator of :mod:`pycore.deep.operators` (linear probes, LoRA at each of
    ``lora_ranks``, upper-stage and full fine-tuning) on the harmful task against ``model`` and
    against ``reference`` (θ₀), each tuned on a seeded ``val_fraction`` of the attacker's data and
    scored on ``dh_test`` (default: a seeded ``test_fraction`` of ``dh``) after each of
    ``epochs``; options :data:`AUDIT_OPTIONS`. Returns an
    :class:`~pycore.deep.operators.AuditResult`: per operator the accuracies, the signed deficit,
    RFD, best-so-far, and the worst case over operators."""
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
