"""The features of an :class:`~pycore.deep.ImmunizedNet` (what RIR_θ₀ and the probes measure)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from pycore._validation import DivergenceError, ParameterError
from pycore.deep._data import DataError, dataset_labels, fetch


@torch.no_grad()
def extract(
    model,
    data: Dataset,
    *,
    cached: bool = False,
    batch_size: int = 256,
    what: str = "Z",
    data_name: str = "data",
    model_name: str | None = None,
) -> np.ndarray:
    """Float64 features of a dataset, the model in eval mode.

    The model's training mode is restored afterwards.

    Parameters
    ----------
    model : ImmunizedNet
        The model.
    data : torch.utils.data.Dataset
        Samples ``(input, label)``; with ``cached`` the inputs are the layer's inputs X.
    cached : bool, default False
        ``data`` holds X (from :func:`prelogits_dataset`), not images.
    batch_size : int, default 256
        Samples per forward pass.
    what : {"Z", "X"}, default "Z"
        The immunized features (the layer's output) or the layer's input.
    data_name : str, default "data"
        The data's name in errors.
    model_name : str, optional
        The model's name in errors (``.parameter`` of a DivergenceError).

    Returns
    -------
    ndarray, shape (N, D)
        The features.

    Raises
    ------
    DataError
        Features not finite at a sample whose input is not finite, naming ``data_name`` and the
        sample; every feature zero because every input is.
    DivergenceError
        Features not finite from finite inputs (the model's weights overflow); ``.parameter`` is
        ``model_name``.
    ParameterError
        Every feature zero from inputs that are not (``.parameter`` is ``model_name``; a
        ``ValueError`` without one).
    """
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    out, signal = [], False
    try:
        for s in range(0, len(data), batch_size):
            x = fetch(data, torch.arange(s, min(s + batch_size, len(data))))[0].to(dev)
            signal = signal or bool(x.any())
            X = x if cached else model.prelogits(x)
            out.append((model.layer(X) if what == "Z" else X).double().cpu())
            bad = ~torch.isfinite(out[-1]).all(1)
            if bool(bad.any()):
                _non_finite(model, x, s + int(bad.nonzero()[0]), s, data_name, model_name)
    finally:
        model.train(was)
    Z = torch.cat(out).numpy()
    if not Z.any():
        if not signal:
            raise DataError(
                f"{data_name}: every one of its {len(Z)} inputs is zero", argument=data_name
            )
        message = (
            f"{model_name + ': ' if model_name else ''}every feature of the "
            f"{type(model.net).__name__} is zero on these {len(Z)} samples of {data_name} "
            "though their inputs are not (its weights give no signal)"
        )
        raise ParameterError(model_name, message) if model_name else ValueError(message)
    return Z


def _non_finite(model, x, i: int, start: int, data_name: str, model_name) -> None:
    """Raise for sample ``i``, whose features are not finite.

    Raise for sample ``i`` (row ``i - start`` of the batch ``x``), whose features are not
    finite: its input's fault, or the model's.
    """
    if not bool(torch.isfinite(x[i - start]).all()):
        raise DataError(
            f"{data_name}: sample {i}'s input contains NaN or inf", argument=data_name, sample=i
        )
    who = f"{model_name}: " if model_name else ""
    raise DivergenceError(
        model_name,
        f"{who}the {type(model.net).__name__}'s features of {data_name} sample {i} contain "
        "NaN/inf though its input is finite (weights that overflow?)",
    )


def prelogits_dataset(
    model,
    data: Dataset,
    *,
    batch_size: int = 256,
    data_name: str = "data",
    model_name: str | None = None,
) -> TensorDataset:
    """``TensorDataset(X, y)`` of the layer's inputs, computed once.

    What scope ``"layer"`` trains on: the backbone is frozen, so its output is computed once.

    Parameters
    ----------
    model : ImmunizedNet
        The model.
    data : torch.utils.data.Dataset
        Samples ``(input, label)``.
    batch_size : int, default 256
        Samples per forward pass.
    data_name : str, default "data"
        The data's name in errors.
    model_name : str, optional
        The model's name in errors.

    Returns
    -------
    torch.utils.data.TensorDataset
        The layer's inputs (in the layer's dtype) and the labels.

    Raises
    ------
    DataError, DivergenceError, ParameterError, ValueError
        As :func:`extract` raises.
    """
    X = extract(
        model, data, batch_size=batch_size, what="X", data_name=data_name, model_name=model_name
    )
    X = torch.from_numpy(X).to(model.layer.weight.dtype)
    return TensorDataset(X, torch.from_numpy(dataset_labels(data, data_name)))
