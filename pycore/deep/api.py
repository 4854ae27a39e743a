"""The public deep API (docs/design.md §3): :func:`immunize_model` and :func:`audit_model`, for any
timm classifier and data given as an ``(X, y)`` tensor pair, a ``Dataset`` or a ``DataLoader``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Subset

from pycore.deep.attacks import ADAM_LRS, feature_attacks, finetune_attack
from pycore.deep.data import as_dataset, dataset_labels, label_count
from pycore.deep.features import extract, prelogits_dataset
from pycore.deep.models import ImmunizedNet, as_immunized
from pycore.deep.train import DeepOptions, immunize, options
from pycore.evaluate import immunized_def31
from pycore.metrics import grouped_feature_rir
from pycore.validation import ParameterError, check_number

__all__ = ["DeepImmunization", "immunize_model", "audit_model", "AUDIT_OPTIONS"]


@dataclass
class DeepImmunization:
    """:func:`immunize_model`'s result: the immunized copy, (i) ``harmful_ratio``, (ii)
    ``pretrain_ratio`` and ``rir`` of its features against the given model's (docs/theory.md §8),
    Definition 3.1."""

    model: ImmunizedNet
    method: str
    harmful_ratio: float
    pretrain_ratio: float
    rir: float
    immunized: bool
    steps: int
    lambdas: dict
    history: dict
    options: DeepOptions
    hardening: "dict | None"
    wall_seconds: float
    reason: str  # why training ended before its last step ("": it did not)


def immunize_model(
    model, dp, dh, *, method: str = "ours", seed: int = 0, **opts
) -> DeepImmunization:
    """Immunize a copy of ``model`` (a timm classifier, or a module with timm's
    ``forward_features`` / ``forward_head(pre_logits=True)`` / ``get_classifier()``) against ``dh``
    while it keeps ``dp``. ``opts`` are the fields of :class:`~pycore.deep.train.DeepOptions` (a
    bad one is a ParameterError naming it); scope ``"layer"`` trains on the frozen backbone's
    features computed once. A non-finite loss raises :class:`~pycore.deep.train.NonFiniteLossError`
    naming the option to change."""
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
    res = immunize(
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
    r = grouped_feature_rir(
        *after, *before, rng=np.random.default_rng(seed), groups=20, group_size=100
    )
    i, ii = r["harmful_ratio"]["mean"], r["pretrain_ratio"]["mean"]
    return DeepImmunization(
        out.eval(),
        method,
        i,
        ii,
        r["value"]["mean"],
        immunized_def31(i, ii),
        res.steps,
        res.lambdas,
        res.history,
        o,
        res.hardening,
        time.perf_counter() - t0,
        res.stopped,
    )


AUDIT_OPTIONS = {
    "epochs": (1, 5, 20),
    "adam_lrs": ADAM_LRS,
    "finetune": True,
    "finetune_lr": 1e-4,
    "test_fraction": 0.2,
}


def audit_model(model, *, reference, dh, dh_test=None, seed: int = 0, **opts) -> dict:
    """The attackers of :mod:`pycore.deep.attacks` (``gd``, ``adam``, ``adam_whitened``,
    ``finetune``) on the harmful task against ``model`` and against ``reference`` (θ₀), trained on
    ``dh`` and tested on ``dh_test`` or a seeded ``test_fraction`` of ``dh``; options
    :data:`AUDIT_OPTIONS`. Returns ``{"model": {attacker: {epoch: D_H test accuracy %}},
    "reference": {...}}``."""
    bad = [k for k in opts if k not in AUDIT_OPTIONS]
    if bad:
        raise ParameterError(
            bad[0],
            f"unknown option {bad[0]!r} of audit_model; options: {', '.join(AUDIT_OPTIONS)}",
        )
    o = {**AUDIT_OPTIONS, **opts}
    epochs = sorted({o["epochs"]} if isinstance(o["epochs"], int) else set(o["epochs"]))
    if not (epochs and all(isinstance(e, int) and 1 <= e <= 1000 for e in epochs)):
        raise ParameterError(
            "epochs", f"epochs must be integers in [1, 1000], got {o['epochs']!r}"
        )
    check_number(o["test_fraction"], "test_fraction", low=0, high=1, low_open=True, high_open=True)
    train = as_dataset(dh, "dh")
    if dh_test is None:
        perm = np.random.default_rng([seed, 4]).permutation(len(train)).tolist()
        k = max(1, int(round(o["test_fraction"] * len(train))))
        train, test = Subset(train, sorted(perm[k:])), Subset(train, sorted(perm[:k]))
    else:
        test = as_dataset(dh_test, "dh_test")
    yt, yv = dataset_labels(train), dataset_labels(test)
    classes = max(label_count(yt, "dh"), label_count(yv, "dh_test"))
    out = {}
    for name, m in (("model", model), ("reference", reference)):
        net = as_immunized(m).eval()
        curves = feature_attacks(
            extract(net, train),
            yt,
            extract(net, test),
            yv,
            epochs=epochs[-1],
            adam_lrs=o["adam_lrs"],
            seed=seed,
            num_classes=classes,
        )
        if o["finetune"]:
            curves["finetune"] = finetune_attack(
                net,
                train,
                test,
                num_classes=classes,
                epochs=epochs[-1],
                lr=o["finetune_lr"],
                seed=seed,
                eval_epochs=tuple(epochs),
            ).test_accuracy
        out[name] = {
            a: {e: float(c[e]) for e in epochs}
            for a, c in curves.items()
            if not a.endswith("_best")
        }
    return out
