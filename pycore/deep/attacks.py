"""Attackers on deep extractors: how fast can D_H be learned from θ's features? (docs/findings.md
§7)

:func:`linear_probe_curve` is the paper's threat model (Eq. (4), Figure 3); :func:`best_adam_probe`
the defender's worst case over Adam learning rates and preprocessings; :func:`finetune_attack`
retrains the last stage, the layer and a new head. Each gives D_H test accuracy (%) per epoch."""

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

__all__ = [
    "ProbeCurve",
    "linear_probe_curve",
    "adam_probe_curve",
    "preprocess_features",
    "best_adam_probe",
    "feature_attacks",
    "finetune_attack",
    "ADAM_PREPROCESSING",
    "ADAM_LRS",
]


@dataclass
class ProbeCurve:
    """Test accuracy (%) of the attacker after each epoch (index 0 = before training)."""

    test_accuracy: list[float]


def _probe_tensors(Z_train, y_train, Z_test, y_test, num_classes):
    Zt, Zv = (torch.as_tensor(np.asarray(Z, dtype=np.float64)) for Z in (Z_train, Z_test))
    yt, yv = (torch.as_tensor(np.asarray(y), dtype=torch.int64) for y in (y_train, y_test))
    if (
        Zt.ndim != 2
        or Zv.shape[1:] != Zt.shape[1:]
        or not (Zt.isfinite().all() and Zv.isfinite().all())
    ):
        raise ValueError(
            f"probe features must be finite N x D, got {tuple(Zt.shape)}, {tuple(Zv.shape)}"
        )
    C = int(num_classes or int(max(yt.max(), yv.max())) + 1)
    # Bias column at the RMS row norm of the training features: rescaling Z by s then rescales
    # A by s exactly, so a step tied to λ_max(AᵀA) gives unchanged iterates (and accuracies).
    c = float(Zt.pow(2).sum(1).mean().sqrt()) or 1.0
    A, Av = (torch.cat([Z, torch.full((Z.shape[0], 1), c, dtype=Z.dtype)], 1) for Z in (Zt, Zv))
    return A, yt, Av, yv, C


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return 100.0 * float((logits.argmax(1) == y).double().mean())


def linear_probe_curve(
    Z_train: np.ndarray,
    y_train: np.ndarray,
    Z_test: np.ndarray,
    y_test: np.ndarray,
    *,
    epochs: int = 50,
    step_scale: float = 1.0,
    num_classes: "int | None" = None,
) -> ProbeCurve:
    """Linear probe on frozen features (Eq. (4), Figure 3), float64: softmax CE by full-batch GD
    from zero, step ``step_scale / λ_max(AᵀA/N)``, ``A = [Z, c·1]``. The CE Hessian is bounded by
    ``½·(AᵀA/N) ⊗ I``, so ``1/L`` is safe, and no rescaling of the features fakes immunization:
    only the spectrum's spread slows it (Eq. (2))."""
    A, yt, Av, yv, C = _probe_tensors(Z_train, y_train, Z_test, y_test, num_classes)
    n = A.shape[0]
    eta = step_scale / float(torch.linalg.matrix_norm(A, ord=2) ** 2 / n)
    W = torch.zeros(A.shape[1], C, dtype=torch.float64)
    onehot = F.one_hot(yt, C).double()
    accs = [_accuracy(Av @ W, yv)]
    for _ in range(epochs):
        W = W - eta * (A.T @ (torch.softmax(A @ W, 1) - onehot)) / n
        accs.append(_accuracy(Av @ W, yv))
    return ProbeCurve(accs)


def adam_probe_curve(
    Z_train,
    y_train,
    Z_test,
    y_test,
    *,
    epochs: int,
    lr: float,
    batch_size: int = 64,
    seed: int = 0,
    num_classes: "int | None" = None,
) -> ProbeCurve:
    """The linear probe of :func:`linear_probe_curve` trained from zero by Adam on seeded
    mini-batches."""
    A, yt, Av, yv, C = _probe_tensors(Z_train, y_train, Z_test, y_test, num_classes)
    W = torch.zeros(A.shape[1], C, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([W], lr=lr)
    batches = ShardedBatches(A.shape[0], min(batch_size, A.shape[0]), seed=seed)
    accs = [_accuracy(Av @ W.detach(), yv)]
    for e in range(epochs):
        for (idx,) in batches.epoch(e):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(A[idx] @ W, yt[idx]).backward()
            opt.step()
        accs.append(_accuracy(Av @ W.detach(), yv))
    return ProbeCurve(accs)


ADAM_PREPROCESSING = ("scale", "standardize", "whiten")
ADAM_LRS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def preprocess_features(
    Z_train, Z_test, kind: str, *, ridge: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """The attacker's preprocessing, statistics from ``Z_train``: ``"scale"`` by the RMS row norm
    (no extractor fakes a slow-down by shrinking its features against a fixed lr grid),
    ``"standardize"`` (std 0: only centred), ``"whiten"`` by the covariance's eigenvalues floored
    at ``ridge·λ_max``: the adaptive attacker, who undoes any invertible linear map of the
    features, conditioning included."""
    Zt, Zv = (np.asarray(Z, dtype=np.float64) for Z in (Z_train, Z_test))
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
def best_adam_probe(
    Z_train,
    y_train,
    Z_test,
    y_test,
    *,
    epochs: int,
    lrs=ADAM_LRS,
    preprocessing=("scale", "standardize"),
    batch_size: int = 64,
    seed: int = 0,
    num_classes: "int | None" = None,
) -> dict:
    """Adam probes over ``preprocessing`` × ``lrs``: ``{"test_accuracy": the per-epoch max (the
    defender's worst case), "best": per epoch the "preprocessing@lr" of the max}``."""
    curves = {}
    for kind in preprocessing:
        a, b = preprocess_features(Z_train, Z_test, kind)
        for lr in lrs:
            curves[f"{kind}@{float(lr):g}"] = adam_probe_curve(
                a,
                y_train,
                b,
                y_test,
                epochs=epochs,
                lr=lr,
                batch_size=batch_size,
                seed=seed,
                num_classes=num_classes,
            ).test_accuracy
    if not curves:
        raise ValueError("best_adam_probe needs at least one preprocessing and one learning rate")
    keys = list(curves)
    acc = np.array([curves[k] for k in keys])
    return {"test_accuracy": acc.max(0).tolist(), "best": [keys[i] for i in acc.argmax(0)]}


def feature_attacks(
    Z_train,
    y_train,
    Z_test,
    y_test,
    *,
    epochs: int,
    gd_epochs: "int | None" = None,
    adam_lrs=ADAM_LRS,
    seed: int = 0,
    num_classes: "int | None" = None,
) -> dict:
    """The probes on fixed features: ``gd`` (``gd_epochs``, default ``epochs``) and, with
    ``adam_lrs``, ``adam`` (scaled or standardised) and ``adam_whitened``, ``*_best`` naming each
    epoch's winner."""
    out = {
        "gd": linear_probe_curve(
            Z_train, y_train, Z_test, y_test, epochs=gd_epochs or epochs, num_classes=num_classes
        ).test_accuracy
    }
    for key, prep in (("adam", ("scale", "standardize")), ("adam_whitened", ("whiten",))):
        if adam_lrs:
            r = best_adam_probe(
                Z_train,
                y_train,
                Z_test,
                y_test,
                epochs=epochs,
                lrs=adam_lrs,
                seed=seed,
                preprocessing=prep,
                num_classes=num_classes,
            )
            out[key], out[f"{key}_best"] = r["test_accuracy"], r["best"]
    return out


def finetune_attack(
    model,
    h_train: Dataset,
    h_test: Dataset,
    *,
    num_classes: int,
    epochs: int,
    lr: float = 1e-4,
    batch_size: int = 64,
    seed: int = 0,
    eval_batch: int = 256,
    eval_epochs: "tuple[int, ...] | None" = None,
) -> ProbeCurve:
    """Fine-tune the backbone's last stage (ResNet's ``layer4``, a ViT's last block and norm), the
    layer and a NEW linear head with Adam on the D_H images: a modest attacker. A deep copy of
    ``model`` is attacked in eval mode (θ's normalisation statistics, no dropout: a seed gives one
    result); test accuracy after the epochs in ``eval_epochs`` (default: every epoch), NaN at the
    others."""
    m = as_immunized(model).eval().requires_grad_(False)
    dev = next(m.parameters()).device
    ytr, yte = (torch.as_tensor(dataset_labels(d), dtype=torch.int64) for d in (h_train, h_test))
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(m.num_features, num_classes).to(dev)
    with torch.no_grad():
        bound = 1.0 / m.num_features**0.5
        for p in (head.weight, head.bias):
            p.copy_(torch.empty_like(p).uniform_(-bound, bound, generator=g))
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

    accs = [test_acc()]
    for e in range(epochs):
        for (idx,) in batches.epoch(e):
            X = m.prelogits(fetch(h_train, idx)[0].to(dev))
            z = F.linear(X, m.layer.weight, m.layer.bias)  # the attacker's plain gradient
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(head(z), ytr[idx].to(dev)).backward()
            opt.step()
        accs.append(test_acc() if e + 1 in wanted else float("nan"))
    return ProbeCurve(accs)
