"""Metrics on the features of deep extractors (docs/theory.md §8, paper Eq. (17)-(18), Table 3).

The deep twin of :mod:`pycore.metrics` (which holds the array-level RIR and the group
sampling these functions call); the attackers that probe the features are in
:mod:`pycore.deep.attacks`.

* :func:`freeze_reference` -- the FROZEN COPY of θ₀ that RIR_θ₀ is measured against. The
  authors' public code evaluates the immunized model against itself (ratio ≡ 1); here θ₀ is
  deep-copied before immunization, frozen, fingerprinted, and :func:`rir_theta0` refuses a
  reference that is the model itself, shares its parameters, or changed since it was frozen.
* :func:`rir_theta0` -- RIR_θ₀ = [κ(H̃_H(θ_I))/κ(H̃_H(θ₀))] / [κ(H̃_P(θ_I))/κ(H̃_P(θ₀))] with
  H̃ = X̃(θ)ᵀX̃(θ) on extracted features, averaged over 20 random groups of 100 samples (paper
  §5.2); κ over the nonzero spectrum, float64, via :func:`pycore.metrics.grouped_feature_rir`.
* :func:`top1` -- D_P accuracy before / after.
"""
from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from pycore.metrics import grouped_feature_rir

from pycore.deep.data import fetch

__all__ = [
    "FrozenReference", "freeze_reference", "fingerprint", "extract_features", "rir_theta0",
    "top1",
]


def fingerprint(module: nn.Module) -> str:
    """SHA-256 over every parameter and buffer (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        a = t.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(str(tuple(a.shape)).encode())
        h.update(a.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class FrozenReference:
    """A deep copy of θ₀ with gradients off, in eval mode, and its fingerprint."""

    model: nn.Module
    digest: str

    def verify(self) -> None:
        if fingerprint(self.model) != self.digest:
            raise RuntimeError("the frozen θ₀ reference was modified after it was frozen")


def freeze_reference(model: nn.Module) -> FrozenReference:
    """Deep-copy ``model`` as the θ₀ reference (call BEFORE immunizing)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return FrozenReference(ref, fingerprint(ref))


@torch.no_grad()
def extract_features(model: nn.Module, data: Dataset, *, batch_size: int = 256,
                     from_trunk: bool = False) -> np.ndarray:
    """Immunized features ``Z`` (float64, N x D) of every sample, model in eval mode.

    ``from_trunk=True`` means ``data`` holds cached trunk outputs (see ``train.cache_trunk``).
    """
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    out = []
    try:
        for s in range(0, len(data), batch_size):
            x, _ = fetch(data, torch.arange(s, min(s + batch_size, len(data))))
            x = x.to(dev)
            h = x if from_trunk else model.trunk(x)
            out.append(model.layer(model.pooled(h)).double().cpu())
    finally:
        model.train(was)
    Z = torch.cat(out).numpy()
    if not np.isfinite(Z).all():
        raise FloatingPointError("extracted features contain NaN/Inf")
    return Z


def rir_theta0(model: nn.Module, reference: FrozenReference, data_p: Dataset, data_h: Dataset, *,
               rng: np.random.Generator, groups: int = 20, group_size: int = 100,
               from_trunk: bool = False, batch_size: int = 256) -> dict:
    """RIR_θ₀ of ``model`` against the frozen θ₀ ``reference`` (paper Eq. (17), docs/theory.md §8).

    Returns the dict of :func:`pycore.metrics.grouped_feature_rir` (mean/std/per-group of
    ``value`` = RIR, ``harmful_ratio`` = (i), ``pretrain_ratio`` = (ii)). The same sample
    indices are used for both extractors in each group.
    """
    if not isinstance(reference, FrozenReference):
        raise TypeError("reference must come from freeze_reference(θ₀) (a frozen deep copy)")
    if reference.model is model:
        raise ValueError("RIR_θ₀ compares the model with itself (always 1): pass a frozen copy of θ₀")
    own = {p.data_ptr() for p in model.parameters()}
    if any(p.data_ptr() in own for p in reference.model.parameters()):
        raise ValueError("the θ₀ reference shares parameter storage with the model: pass a frozen copy")
    reference.verify()
    zp = extract_features(model, data_p, from_trunk=from_trunk, batch_size=batch_size)
    zh = extract_features(model, data_h, from_trunk=from_trunk, batch_size=batch_size)
    rp = extract_features(reference.model, data_p, from_trunk=from_trunk, batch_size=batch_size)
    rh = extract_features(reference.model, data_h, from_trunk=from_trunk, batch_size=batch_size)
    return grouped_feature_rir(zp, zh, rp, rh, rng=rng, groups=groups, group_size=group_size)


@torch.no_grad()
def top1(model: nn.Module, data: Dataset, *, batch_size: int = 256, from_trunk: bool = False) -> float:
    """Top-1 accuracy (%) of ``model``'s own classifier on ``data``."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    correct = 0
    try:
        for s in range(0, len(data), batch_size):
            x, y = fetch(data, torch.arange(s, min(s + batch_size, len(data))))
            x, y = x.to(dev), y.to(dev)
            if from_trunk:
                logits = model.classifier(model.layer(model.pooled(x)))
            else:
                logits = model(x)
            correct += int((logits.argmax(1) == y).sum())
    finally:
        model.train(was)
    return 100.0 * correct / max(len(data), 1)
