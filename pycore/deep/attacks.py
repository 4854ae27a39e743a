"""Attackers on deep extractors: how fast can D_H be learned from θ's features? (docs/deep.md)

* :func:`linear_probe_curve` -- the paper's threat model (Eq. (4), Figure 3): full-batch GD with step
  ``1/L`` on frozen features, slowed by their condition number.
* :func:`best_adam_probe` -- Adam on mini-batches of scaled or standardised features, the best learning
  rate and preprocessing per epoch (the defender's worst case); with ``("whiten",)`` the adaptive
  attacker who whitens its own features.
* :func:`finetune_attack` -- the last stage, the layer and a new head retrained with Adam on D_H.

Each returns D_H test accuracy (%) after every epoch (index 0 = before training).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from pycore.deep.data import ShardedBatches, dataset_labels, fetch
from pycore.deep.models import as_immunized, tail_modules
from pycore.threads import bounded_blas

__all__ = ["ProbeCurve", "linear_probe_curve", "adam_probe_curve", "preprocess_features", "best_adam_probe",
           "feature_attacks", "finetune_attack", "ADAM_PREPROCESSING", "ADAM_LRS"]


@dataclass
class ProbeCurve:
    """Test accuracy (%) of the attacker after each epoch (index 0 = before training)."""

    test_accuracy: list[float]
    train_loss: list[float]
    step_size: float


def _probe_tensors(Z_train, y_train, Z_test, y_test, num_classes):
    Zt = torch.as_tensor(np.asarray(Z_train, dtype=np.float64))
    Zv = torch.as_tensor(np.asarray(Z_test, dtype=np.float64))
    yt = torch.as_tensor(np.asarray(y_train), dtype=torch.int64)
    yv = torch.as_tensor(np.asarray(y_test), dtype=torch.int64)
    if Zt.ndim != 2 or Zv.shape[1:] != Zt.shape[1:] or not (Zt.isfinite().all() and Zv.isfinite().all()):
        raise ValueError(f"probe features must be finite N x D, got {tuple(Zt.shape)}, {tuple(Zv.shape)}")
    C = int(num_classes or int(max(yt.max(), yv.max())) + 1)
    # Bias column at the RMS row norm of the training features: rescaling Z by s then rescales
    # A by s exactly, so a step tied to λ_max(AᵀA) gives unchanged iterates (and accuracies).
    c = float(Zt.pow(2).sum(1).mean().sqrt()) or 1.0
    A = torch.cat([Zt, torch.full((Zt.shape[0], 1), c, dtype=Zt.dtype)], 1)
    Av = torch.cat([Zv, torch.full((Zv.shape[0], 1), c, dtype=Zv.dtype)], 1)
    return A, yt, Av, yv, C


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float((logits.argmax(1) == y).double().mean())


def linear_probe_curve(Z_train: np.ndarray, y_train: np.ndarray, Z_test: np.ndarray,
                       y_test: np.ndarray, *, epochs: int = 50, step_scale: float = 1.0,
                       num_classes: "int | None" = None) -> ProbeCurve:
    """Linear probing attack on frozen features (paper Eq. (4), Figure 3), float64: softmax CE by full-batch
    GD from zero, step ``η = step_scale / λ_max(AᵀA/N)``, ``A = [Z, c·1]`` (bias column at Z's RMS row norm).
    The CE Hessian is bounded by ``½·(AᵀA/N) ⊗ I``, so ``1/L`` is safe, and tied to λ_max a rescaling of
    the features cannot fake immunization: only the spread of the spectrum slows it (Eq. (2))."""
    A, yt, Av, yv, C = _probe_tensors(Z_train, y_train, Z_test, y_test, num_classes)
    n = A.shape[0]
    eta = step_scale / float(torch.linalg.matrix_norm(A, ord=2) ** 2 / n)
    W = torch.zeros(A.shape[1], C, dtype=torch.float64)
    onehot = F.one_hot(yt, C).double()
    accs, losses = [_accuracy(Av @ W, yv)], []
    for _ in range(epochs):
        logits = A @ W
        losses.append(float(F.cross_entropy(logits, yt)))
        W = W - eta * (A.T @ (torch.softmax(logits, 1) - onehot)) / n
        accs.append(_accuracy(Av @ W, yv))
    return ProbeCurve(accs, losses, eta)


def adam_probe_curve(Z_train, y_train, Z_test, y_test, *, epochs: int, lr: float, batch_size: int = 64,
                     seed: int = 0, num_classes: "int | None" = None) -> ProbeCurve:
    """Linear probe (same ``A = [Z, c·1]`` as :func:`linear_probe_curve`) trained by Adam
    (β = (0.9, 0.999), ε = 1e-8) on seeded mini-batches, float64, zero init."""
    A, yt, Av, yv, C = _probe_tensors(Z_train, y_train, Z_test, y_test, num_classes)
    W = torch.zeros(A.shape[1], C, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([W], lr=lr)
    batches = ShardedBatches(A.shape[0], min(batch_size, A.shape[0]), seed=seed)
    accs, losses = [_accuracy(Av @ W.detach(), yv)], []
    for e in range(epochs):
        total = 0.0
        for (idx,) in batches.epoch(e):
            loss = F.cross_entropy(A[idx] @ W, yt[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach())
        losses.append(total / len(batches))
        accs.append(_accuracy(Av @ W.detach(), yv))
    return ProbeCurve(accs, losses, lr)


ADAM_PREPROCESSING = ("scale", "standardize", "whiten")
ADAM_LRS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def preprocess_features(Z_train, Z_test, kind: str, *, ridge: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """The attacker's preprocessing, its statistics from ``Z_train`` only: ``"scale"`` divides by the RMS
    row norm (so no extractor fakes a slow-down by shrinking its features against a fixed learning-rate
    grid), ``"standardize"`` z-scores each coordinate (std 0: only centred), ``"whiten"`` whitens with the
    covariance's eigendecomposition (eigenvalues floored at ``ridge·λ_max``): the adaptive attacker, who
    undoes any invertible linear map of the features, conditioning included."""
    Zt = np.asarray(Z_train, dtype=np.float64)
    Zv = np.asarray(Z_test, dtype=np.float64)
    if kind == "scale":
        c = float(np.sqrt((Zt * Zt).sum(1).mean())) or 1.0
        return Zt / c, Zv / c
    mu = Zt.mean(0)
    if kind == "standardize":
        sd = Zt.std(0)
        sd = np.where(sd > 0, sd, 1.0)
        return (Zt - mu) / sd, (Zv - mu) / sd
    if kind == "whiten":
        lam, V = np.linalg.eigh(np.cov((Zt - mu).T, bias=True))
        lam = np.maximum(lam, 0.0) + ridge * max(float(lam.max()), 1e-300)
        T = V / np.sqrt(lam)
        return (Zt - mu) @ T, (Zv - mu) @ T
    raise ValueError(f"unknown preprocessing {kind!r}; choose one of {ADAM_PREPROCESSING}")


@bounded_blas
def best_adam_probe(Z_train, y_train, Z_test, y_test, *, epochs: int, lrs=ADAM_LRS,
                    preprocessing=("scale", "standardize"), batch_size: int = 64, seed: int = 0,
                    num_classes: "int | None" = None) -> dict:
    """Adam probes over ``preprocessing`` × ``lrs`` (:func:`preprocess_features`,
    :func:`adam_probe_curve`); the defender's worst case per epoch is the best of them.

    Returns ``{"test_accuracy": per-epoch max, "best": per-epoch "preprocessing@lr" of the max,
    "per_config": {"preprocessing@lr": curve}}``."""
    curves = {}
    for kind in preprocessing:
        a, b = preprocess_features(Z_train, Z_test, kind)
        for lr in lrs:
            curves[f"{kind}@{float(lr):g}"] = adam_probe_curve(
                a, y_train, b, y_test, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                num_classes=num_classes).test_accuracy
    if not curves:
        raise ValueError("best_adam_probe needs at least one preprocessing and one learning rate")
    keys = list(curves)
    acc = np.array([curves[k] for k in keys])
    return {"test_accuracy": acc.max(0).tolist(), "best": [keys[i] for i in acc.argmax(0)],
            "per_config": curves}


def feature_attacks(Z_train, y_train, Z_test, y_test, *, epochs: int, gd_epochs: "int | None" = None,
                    adam_lrs=ADAM_LRS, seed: int = 0, num_classes: "int | None" = None) -> dict:
    """The probes on fixed features: ``gd`` (``gd_epochs``, default ``epochs``), and with ``adam_lrs``
    ``adam`` (scaled or standardised) and ``adam_whitened``, with ``*_best`` naming the winning
    configuration per epoch."""
    out = {"gd": linear_probe_curve(Z_train, y_train, Z_test, y_test, epochs=gd_epochs or epochs,
                                    num_classes=num_classes).test_accuracy}
    for key, prep in (("adam", ("scale", "standardize")), ("adam_whitened", ("whiten",))):
        if adam_lrs:
            r = best_adam_probe(Z_train, y_train, Z_test, y_test, epochs=epochs, lrs=adam_lrs, seed=seed,
                                preprocessing=prep, num_classes=num_classes)
            out[key], out[f"{key}_best"] = r["test_accuracy"], r["best"]
    return out


def finetune_attack(model, h_train: Dataset, h_test: Dataset, *, num_classes: int, epochs: int,
                    lr: float = 1e-4, batch_size: int = 64, seed: int = 0, eval_batch: int = 256,
                    eval_epochs: "tuple[int, ...] | None" = None) -> ProbeCurve:
    """Fine-tune the backbone's last stage (:func:`~pycore.deep.models.tail_modules`, one stage: ResNet's
    ``layer4``, a ViT's last block and norm), the immunization layer and a NEW linear head with Adam on
    the D_H images ``h_train``: what an attacker with a modest budget retrains. ``model`` (a timm
    classifier or an ImmunizedNet) is not modified: a deep copy is attacked, in eval mode (θ's
    normalisation statistics, no dropout), so a seed gives one result. Test accuracy on ``h_test`` after
    the epochs in ``eval_epochs`` (default: every epoch); other entries of the curve are NaN."""
    m = as_immunized(model).eval().requires_grad_(False)
    dev = next(m.parameters()).device
    ytr = torch.as_tensor(dataset_labels(h_train), dtype=torch.int64)
    yte = torch.as_tensor(dataset_labels(h_test), dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(m.num_features, num_classes).to(dev)
    with torch.no_grad():
        bound = 1.0 / m.num_features ** 0.5
        head.weight.copy_(torch.empty_like(head.weight).uniform_(-bound, bound, generator=g))
        head.bias.copy_(torch.empty_like(head.bias).uniform_(-bound, bound, generator=g))
    params = [p for mod in tail_modules(m.net, 1) + [m.layer] for p in mod.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params + list(head.parameters()), lr=lr)
    batches = ShardedBatches(len(h_train), min(batch_size, len(h_train)), seed=seed)
    wanted = set(range(epochs + 1)) if eval_epochs is None else {0, *eval_epochs}

    @torch.no_grad()
    def test_acc() -> float:
        n = len(h_test)
        batches = (torch.arange(s, min(s + eval_batch, n)) for s in range(0, n, eval_batch))
        logits = [head(m.features(fetch(h_test, idx)[0].to(dev))) for idx in batches]
        return _accuracy(torch.cat(logits).cpu(), yte)

    accs, losses = [test_acc()], []
    for e in range(epochs):
        total = 0.0
        for (idx,) in batches.epoch(e):
            X = m.prelogits(fetch(h_train, idx)[0].to(dev))
            z = F.linear(X, m.layer.weight, m.layer.bias)                    # the attacker's plain gradient
            loss = F.cross_entropy(head(z), ytr[idx].to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach())
        losses.append(total / len(batches))
        accs.append(test_acc() if e + 1 in wanted else float("nan"))
    return ProbeCurve(accs, losses, lr)
