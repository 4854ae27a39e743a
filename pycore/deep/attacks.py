"""Linear probes on deep features: how fast can D_H be learned from θ's features? (docs/findings.md
§7)

:func:`linear_probe_curve` is the paper's threat model (Eq. (4), Figure 3),
:func:`adam_probe_curve` the Adam probe, :func:`preprocess_features` the attacker's
preprocessings; each gives D_H test (and validation) accuracy (%) per epoch.
:mod:`pycore.deep.operators` runs them beside the deep operators, each tuned on the attacker's
validation split."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pycore.deep.data import ShardedBatches

__all__ = [
    "ProbeCurve",
    "linear_probe_curve",
    "adam_probe_curve",
    "preprocess_features",
    "ADAM_PREPROCESSING",
]


@dataclass(frozen=True)
class ProbeCurve:
    """Test (and validation) accuracy (%) of the attacker after each epoch (index 0 = before
    training)."""

    test_accuracy: list[float]
    validation_accuracy: list[float] = field(default_factory=list)


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


def _probe_sets(Z_train, y_train, Z_test, y_test, num_classes, validation):
    """:func:`_probe_tensors` of the test split and, when given, the validation split (the same
    bias column: the training features')."""
    A, yt, Av, yv, C = _probe_tensors(Z_train, y_train, Z_test, y_test, num_classes)
    evals = [(Av, yv)]
    if validation is not None:
        _, _, Aw, yw, _ = _probe_tensors(Z_train, y_train, *validation, C)
        evals.append((Aw, yw))
    return A, yt, evals, C


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
    validation=None,
) -> ProbeCurve:
    """Linear probe on frozen features (Eq. (4), Figure 3), float64: softmax CE by full-batch GD
    from zero, step ``step_scale / λ_max(AᵀA/N)``, ``A = [Z, c·1]``. The CE Hessian is bounded by
    ``½·(AᵀA/N) ⊗ I``, so ``1/L`` is safe, and no rescaling of the features fakes immunization:
    only the spectrum's spread slows it (Eq. (2)). ``validation=(Z_val, y_val)`` is scored too."""
    A, yt, evals, C = _probe_sets(Z_train, y_train, Z_test, y_test, num_classes, validation)
    n = A.shape[0]
    eta = step_scale / float(torch.linalg.matrix_norm(A, ord=2) ** 2 / n)
    W = torch.zeros(A.shape[1], C, dtype=torch.float64)
    onehot = F.one_hot(yt, C).double()
    accs = [[_accuracy(Av @ W, yv)] for Av, yv in evals]
    for _ in range(epochs):
        W = W - eta * (A.T @ (torch.softmax(A @ W, 1) - onehot)) / n
        for a, (Av, yv) in zip(accs, evals):
            a.append(_accuracy(Av @ W, yv))
    return ProbeCurve(*accs)


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
    validation=None,
) -> ProbeCurve:
    """The linear probe of :func:`linear_probe_curve` trained from zero by Adam on seeded
    mini-batches."""
    A, yt, evals, C = _probe_sets(Z_train, y_train, Z_test, y_test, num_classes, validation)
    W = torch.zeros(A.shape[1], C, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([W], lr=lr)
    batches = ShardedBatches(A.shape[0], min(batch_size, A.shape[0]), seed=seed)
    accs = [[_accuracy(Av @ W.detach(), yv)] for Av, yv in evals]
    for e in range(epochs):
        for (idx,) in batches.epoch(e):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(A[idx] @ W, yt[idx]).backward()
            opt.step()
        for a, (Av, yv) in zip(accs, evals):
            a.append(_accuracy(Av @ W.detach(), yv))
    return ProbeCurve(*accs)


ADAM_PREPROCESSING = ("scale", "standardize", "whiten")


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
