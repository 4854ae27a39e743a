"""Hardening of the immunization layer (docs/theory.md §10, docs/findings.md §7).

A feature map ``Z → ZM`` after immunization, the D_P classifier compensated (``W' = MᵀW``, ``V' =
VM⁻ᵀ``).

* ``"haar"``: ``M = Q`` Haar-random orthogonal (:func:`pycore._hardening.haar_rotation`, the linear
  side's ``"haar"``): every spectrum (κ, RIR_θ₀, the GD probe) is kept; it removes the alignment
  with the coordinate axes that a per-coordinate optimiser (Adam) exploits.
* ``"label_subspace"`` (deep only): ``M = (I − (1 − s)·P_U)·Q``, the span ``U`` of D_H's centred
  class means scaled by ``s``, rotated. Not conditioning: it usually LOWERS (i); whitening or
  fine-tuning undoes it.

Which kind exists on which side, and why: :mod:`pycore._hardening`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from pycore._hardening import HARDENINGS, haar_rotation
from pycore._threads import bounded_blas
from pycore.deep._data import dataset_labels
from pycore.deep._features import extract


def label_subspace(Z: np.ndarray, y: np.ndarray, num_classes: int) -> np.ndarray:
    """Orthonormal basis of the span of the centred class means of ``(Z, y)``.

    Orthonormal basis (D × r, r ≤ num_classes − 1) of the span of the centred class means of
    ``(Z, y)``, directions below ``1e-10`` of the largest singular value dropped.
    """
    Z, y = np.asarray(Z, dtype=np.float64), np.asarray(y)
    if Z.ndim != 2 or y.shape != (Z.shape[0],):
        raise ValueError(f"Z must be N x D and y of length N, got {Z.shape} and {y.shape}")
    present = [c for c in range(num_classes) if np.any(y == c)]
    if len(present) < 2:
        raise ValueError(f"label_subspace needs at least two classes present, got {len(present)}")
    mu = Z.mean(0)
    means = np.stack([Z[y == c].mean(0) - mu for c in present], axis=1)  # D × C
    U, s, _ = np.linalg.svd(means, full_matrices=False)
    keep = s > 1e-10 * s[0] if s[0] > 0 else np.zeros_like(s, dtype=bool)
    return U[:, keep][:, : len(present) - 1]


def hardening_map(
    kind: str,
    Z_H: np.ndarray,
    y_H: np.ndarray,
    *,
    num_classes: int,
    rng: np.random.Generator,
    scale: float = 0.01,
) -> tuple[np.ndarray, int]:
    """The map ``M`` of ``kind`` from the defender's D_H features and labels.

    Returns ``(M, the squashed dimension)``.
    """
    if kind not in HARDENINGS["deep"] or kind == "none":
        raise ValueError(f"kind must be one of {HARDENINGS['deep'][1:]}, got {kind!r}")
    if not (np.isfinite(scale) and 0 < scale <= 1):
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    d = np.asarray(Z_H).shape[1]
    Q = haar_rotation(d, rng)
    if kind == "haar":
        return Q, 0
    U = label_subspace(Z_H, y_H, num_classes)
    return (np.eye(d) - (1.0 - scale) * (U @ U.T)) @ Q, U.shape[1]


@torch.no_grad()
def apply_feature_map(model, M: np.ndarray) -> None:
    """Make an ImmunizedNet's features ``Z M``, its classifier ``V M⁻ᵀ`` (a float64 solve)."""
    layer, head = model.layer, model.classifier
    W = layer.weight
    Mt = torch.as_tensor(np.asarray(M, dtype=np.float64), device=W.device)
    if Mt.shape != (W.shape[0], W.shape[0]):
        raise ValueError(f"feature map must be {W.shape[0]} x {W.shape[0]}, got {tuple(Mt.shape)}")
    layer.weight.copy_((Mt.T @ W.double()).to(W.dtype))
    if getattr(layer, "bias", None) is not None:
        layer.bias.copy_((layer.bias.double() @ Mt).to(layer.bias.dtype))
    head.weight.copy_(torch.linalg.solve(Mt, head.weight.double().T).T.to(head.weight.dtype))


@bounded_blas
@torch.no_grad()
def harden(
    model,
    data_h: Dataset,
    kind: str,
    *,
    num_classes: int,
    rng: np.random.Generator,
    scale: float = 0.01,
    cached: bool = False,
    batch_size: int = 256,
) -> dict:
    """Harden ``model``'s immunization layer in place.

    Features ``Z → ZM`` with the D_P head compensated, so that D_P's logits are unchanged (module
    docstring; docs/findings.md §7).

    Parameters
    ----------
    model : ImmunizedNet
        The model whose layer is changed.
    data_h : Dataset
        Labelled D_H samples (images, or the backbone's features when ``cached``).
    kind : {"haar", "label_subspace"}
        The map: a Haar rotation, or the span of D_H's class means scaled by ``scale``, rotated.
    num_classes : int
        D_H's classes.
    rng : numpy.random.Generator
        Draws the rotation.
    scale : float
        ``s`` of ``label_subspace``.
    cached, batch_size
        As :func:`pycore.deep._features.extract`.

    Returns
    -------
    dict
        ``kind``, ``scale``, ``subspace_dim`` and ``logit_change``: the largest change of the
        D_P logits on those features relative to their largest magnitude (float32 round-off when
        the compensation holds).

    Examples
    --------
    >>> import numpy as np, torch
    >>> from torch.utils.data import TensorDataset
    >>> from pycore.deep import ImmunizedNet, create_model
    >>> from pycore.deep._hardening import harden
    >>> net = ImmunizedNet(create_model("test_resnet", 2, seed=0, img_size=32)).eval()
    >>> g = torch.Generator().manual_seed(0)
    >>> dh = TensorDataset(torch.randn(32, 3, 32, 32, generator=g), torch.arange(32) % 4)
    >>> info = harden(net, dh, "label_subspace", num_classes=4, rng=np.random.default_rng(0))
    >>> info["subspace_dim"], info["logit_change"] < 1e-4
    (3, True)
    """
    Z, head = extract(model, data_h, batch_size=batch_size, cached=cached), model.classifier
    M, r = hardening_map(
        kind, Z, dataset_labels(data_h), num_classes=num_classes, rng=rng, scale=scale
    )
    before = head(torch.from_numpy(Z).to(head.weight)).double()
    apply_feature_map(model, M)
    Z2 = extract(model, data_h, batch_size=batch_size, cached=cached)
    after = head(torch.from_numpy(Z2).to(head.weight)).double()
    change = float((after - before).abs().max() / before.abs().max().clamp_min(1e-300))
    return {
        "kind": kind,
        "scale": float(scale) if kind == "label_subspace" else 1.0,
        "subspace_dim": r,
        "logit_change": change,
    }
