"""What the linear immunizers' loops share (docs/design.md §6).

Each loop takes a task, the method's resolved options and ONE GENERATOR PER RUN, steps the runs
together as a stack (θ is B×D×D, every Hessian from its small side,
:class:`pycore.linalg.GramStack`) and returns one :class:`pycore.MethodRun` per generator. A run's
numbers do not depend on the other runs of its stack.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

import pycore._losses as losses
from pycore._batch import GramStack
from pycore._spectral import RowFactor, SpectrumError, gram_spectrum


def init_theta(D, o, rng):
    if o.init == "identity":
        return np.eye(D)
    b = 1.0 / np.sqrt(D)
    return rng.uniform(-b, b, size=(D, D))


def init_head(task, rng):
    m = task.Y_P.shape[1]  # a small random head: a zero one makes ∇_θL vanish at the first step
    return rng.normal(0.0, 1.0 / np.sqrt(task.D), size=(task.D, m)), np.zeros(m)


def _batches(n, batch_size, rng):
    if batch_size is None or batch_size >= n:
        yield np.arange(n)
        return
    perm = rng.permutation(n)
    for s in range(0, n, batch_size):
        yield perm[s : s + batch_size]


def epoch_steps(n, batch_size, rngs):
    """One epoch's D_P rows for every run.

    A B×b index array per step, or None for all rows (full batch); each run draws its own
    permutation, as it would alone.
    """
    if batch_size is None or batch_size >= n:
        return [None]
    return [np.stack(rows) for rows in zip(*(_batches(n, batch_size, rng) for rng in rngs))]


def log_row(hist: dict, *values):  # one entry per key of hist, in order
    for key, v in zip(hist, values):
        hist[key].append(v)


def max_abs(theta) -> float:  # θ's scale at a run's start (optim.check_growth)
    return float(np.max(np.abs(theta)))


def input_norm(task):  # max_i ‖x_i‖₁ over both tasks: |Xθ| ≤ it × max|θ| (optim.check_scale)
    return max(np.max(np.sum(np.abs(task.X_P), axis=1)), np.max(np.sum(np.abs(task.X_H), axis=1)))


@dataclass(frozen=True, eq=False)
class Inputs:
    """A task's inputs at the input ``rows`` of θ that a step can change (None: all of them).

    An input column that is zero in every row of both tasks (a pixel no training image of either
    digit inks) has a zero row in every θ-gradient of the methods here (``Xᵀ(·)``, ``K(·)`` and
    the K-preconditioners all vanish on it), so Adam and GD leave θ's row there as it started:
    the loops step ``θ[rows]`` (L×D) only, with X, K and the factors restricted to those columns
    (docs/design.md §6).  The features ``Xθ`` are unchanged: X is zero on the other columns.
    """

    X_P: np.ndarray
    Y_P: np.ndarray
    X_H: np.ndarray
    Y_H: np.ndarray
    loss: str
    factor_P: RowFactor
    factor_H: RowFactor
    norm2_X_H: float
    rows: np.ndarray | None
    task: object

    @classmethod
    def of(cls, task, restrict: bool = True) -> Inputs:
        live = task.factor_P.live | task.factor_H.live
        rows = np.flatnonzero(live) if restrict and not live.all() else None
        if rows is None:
            return cls(*(getattr(task, k) for k in _INPUT_FIELDS), None, task)
        return cls(
            task.X_P[:, rows],
            task.Y_P,
            task.X_H[:, rows],
            task.Y_H,
            task.loss,
            task.factor_P.restricted(rows),
            task.factor_H.restricted(rows),
            task.norm2_X_H,
            rows,
            task,
        )

    @functools.cached_property
    def K_H(self) -> np.ndarray:
        return self.task.K_H if self.rows is None else self.X_H.T @ self.X_H

    def take(self, theta: np.ndarray) -> np.ndarray:
        """The rows of a θ stack the loop steps."""
        return theta if self.rows is None else theta[:, self.rows, :]

    def put(self, theta0: np.ndarray, theta_rows: np.ndarray) -> np.ndarray:
        """Full θ's: ``theta0`` with the stepped rows replaced."""
        if self.rows is None:
            return theta_rows
        out = theta0.copy()
        out[:, self.rows, :] = theta_rows
        return out


_INPUT_FIELDS = ("X_P", "Y_P", "X_H", "Y_H", "loss", "factor_P", "factor_H", "norm2_X_H")


def head_bias(bias):
    """A stack's biases (B×m) as B×1×m, to add to B×n×m logits."""
    return None if bias is None else bias[:, None, :]


def logits(task, X, theta, omega, bias):
    """D_P's logits ``Xθω`` of every run, with the head's bias for BCE."""
    P = X @ (theta @ omega)
    return P if task.loss == "mse" else P + head_bias(bias)


def loss_parts(task, rows, theta, omega, bias, F_P):
    """D_P's loss of every run on its rows, and its gradients as low-rank factors.

    ``rows`` are B×b indices; None: all rows, through the features ``F_P = A_Pθ``,
    ``Xθω = U(F_Pω)``. Returns the loss, ∇_ω, ∇_θL = (XᵀR)ωᵀ as its two factors (a rank-m term,
    never formed D×D) and ∇_bias (None for MSE).
    """
    if rows is None:
        f = task.factor_P
        X, Y, P = task.X_P, task.Y_P, f.U @ (F_P @ omega)
    else:
        X, Y = task.X_P[rows], task.Y_P[rows]
        P = X @ (theta @ omega)
    if task.loss == "bce":
        P = P + head_bias(bias)
    loss, R = losses.residual(task.loss, P, Y)
    XtR = X.mT @ R
    g_w = F_P.mT @ (f.U.T @ R) if rows is None else theta.mT @ XtR
    return loss, g_w, XtR, omega.mT, None if task.loss == "mse" else R.sum(axis=-2)


def sum_of_products(parts):
    """``Σ Lᵢ @ Rᵢ`` for low-rank factor pairs as ONE product of the joined factors.

    The pairs are B×D×kᵢ and B×kᵢ×D: the θ-gradient of a step without a D×D temporary per term.
    """
    if len(parts) == 1:
        return parts[0][0] @ parts[0][1]
    return np.concatenate([L for L, _ in parts], axis=2) @ np.concatenate(
        [R for _, R in parts], axis=1
    )


def exact_kappas(task, theta):
    """(κ(H_P), κ(H_H)) of one θ from the SVDs of the features (docs/theory.md §2)."""
    return tuple(gram_spectrum(X @ theta, vectors=False).kappa for X in (task.X_P, task.X_H))


def gram_stacks(inp, theta, method, epoch, step):
    """The :class:`GramStack` of H_P and H_H for every run (θ's stepped rows ``theta``).

    A run whose spectrum is undefined is a :class:`SpectrumError` naming the method, epoch and
    step.
    """
    D = theta.shape[-1]
    try:
        return (
            GramStack(inp.factor_P.features(theta), D),
            GramStack(inp.factor_H.features(theta), D),
        )
    except SpectrumError as exc:
        raise SpectrumError(f"{method}: epoch {epoch}, step {step}: {exc}") from None
