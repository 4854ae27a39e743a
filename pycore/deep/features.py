"""The features of an :class:`~pycore.deep.models.ImmunizedNet` (what RIR_θ₀ and the probes
measure)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from pycore.deep.data import dataset_labels, fetch

__all__ = ["extract", "prelogits_dataset"]


@torch.no_grad()
def extract(
    model, data: Dataset, *, cached: bool = False, batch_size: int = 256, what: str = "Z"
) -> np.ndarray:
    """Float64 (N × D) features of ``data``, ``model`` in eval mode: ``what="Z"`` the immunized
    features, ``"X"`` the layer's input (``cached=True``: ``data`` holds ``X``). Non-finite or
    all-zero ones raise."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    out = []
    try:
        for s in range(0, len(data), batch_size):
            x = fetch(data, torch.arange(s, min(s + batch_size, len(data))))[0].to(dev)
            X = x if cached else model.prelogits(x)
            out.append((model.layer(X) if what == "Z" else X).double().cpu())
    finally:
        model.train(was)
    Z = torch.cat(out).numpy()
    if not np.isfinite(Z).all():
        raise FloatingPointError(f"the {type(model.net).__name__}'s features contain NaN/inf")
    if not Z.any():
        raise ValueError(
            f"every feature of the {type(model.net).__name__} is zero on these {len(Z)} samples "
            "(its weights give no signal)"
        )
    return Z


def prelogits_dataset(model, data: Dataset, *, batch_size: int = 256) -> TensorDataset:
    """``TensorDataset(X, y)`` of the layer's inputs, computed once (what scope ``"layer"``
    trains on)."""
    X = torch.from_numpy(extract(model, data, batch_size=batch_size, what="X")).to(
        model.layer.weight.dtype
    )
    return TensorDataset(X, torch.as_tensor(dataset_labels(data), dtype=torch.int64))
