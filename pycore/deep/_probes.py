"""Linear probes: the attacker who trains a new head on frozen features.

Paper Eq. (4), Figure 3; docs/design.md §3.

Every probe is softmax cross-entropy on ``A = [Z, c·1]`` from ``W = 0`` in float64 NumPy, ``c`` the
RMS row norm of the training features (rescaling Z then rescales A exactly, so no extractor fakes
a slow-down by shrinking its features):

* :class:`GDProbe`, full-batch gradient descent with step ``1/λ_max(AᵀA/N)`` (the paper's threat
  model; the CE Hessian is bounded by ``½·(AᵀA/N) ⊗ I``, so the step is safe and only the
  spectrum's spread slows it, Eq. (2));
* :class:`AdamProbe`, Adam on seeded mini-batches, the learning rates of a grid stepped together
  as one ``(settings, D + 1, classes)`` array (each setting's arithmetic is the one it has alone);
* :func:`preprocess_features`, the attacker's preprocessing: scaling, standardising, whitening.

Both are :class:`pycore.deep._slowdown.Runs`: they train each setting to the step asked for and
report its validation accuracy there; ``test`` scores a head on the test split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pycore.deep._slowdown import Eval

PREPROCESSINGS = ("scale", "standardize", "whiten")
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults


@dataclass(frozen=True)
class ProbeCurve:
    """Test (and validation) accuracy (%) of the attacker after each epoch.

    Index 0 is before training.
    """

    test_accuracy: list[float]
    validation_accuracy: list[float] = field(default_factory=list)


def _finite_matrix(Z, name: str) -> np.ndarray:
    Z = np.asarray(Z, dtype=np.float64)
    if Z.ndim != 2 or not np.isfinite(Z).all():
        raise ValueError(f"{name}: probe features must be a finite N x D array, got {Z.shape}")
    return Z


def probe_inputs(Z_train, *Z_eval) -> list[np.ndarray]:
    """The probe's design matrices: each feature matrix with a bias column.

    The column is ``c·1``, ``c`` the RMS row norm of ``Z_train`` (1 if that is 0), the same for
    every matrix.

    Parameters
    ----------
    Z_train : array_like, shape (N, D)
        The training features.
    *Z_eval : array_like, shape (M, D)
        Features to evaluate on.

    Returns
    -------
    list of ndarray
        ``[A_train, *A_eval]``, each with D + 1 columns.

    Raises
    ------
    ValueError
        Features that are not finite real matrices (named), or of another width.
    """
    Zt = _finite_matrix(Z_train, "Z_train")
    c = float(np.sqrt((Zt * Zt).sum(1).mean())) or 1.0
    out = []
    for k, Z in enumerate((Zt, *Z_eval)):
        Z = _finite_matrix(Z, "Z_train" if k == 0 else f"Z_eval[{k - 1}]")
        if Z.shape[1] != Zt.shape[1]:
            raise ValueError(f"probe features have {Z.shape[1]} columns, training {Zt.shape[1]}")
        out.append(np.hstack([Z, np.full((len(Z), 1), c)]))
    return out


def preprocess_features(
    Z_train, Z_test, kind: str, *, ridge: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """The attacker's preprocessing of features, statistics from the training rows.

    ``"scale"`` by the RMS row norm, ``"standardize"`` (a column of std 0 is only centred),
    ``"whiten"`` by the covariance's eigenvalues floored at ``ridge·λ_max``: the adaptive attacker,
    who undoes any invertible linear map of the features, conditioning included.

    Parameters
    ----------
    Z_train : array_like, shape (N, D)
        The training features (the statistics).
    Z_test : array_like, shape (M, D)
        Other features, preprocessed the same way.
    kind : {"scale", "standardize", "whiten"}
        The preprocessing.
    ridge : float, default 1e-6
        The whitening floor, relative to λ_max.

    Returns
    -------
    train, test : ndarray
        Both preprocessed, in float64.

    Raises
    ------
    ValueError
        An unknown kind.
    """
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
    raise ValueError(f"unknown preprocessing {kind!r}; choose one of {PREPROCESSINGS}")


def _softmax_residual(logits: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """``softmax(logits) − Y`` along the last axis (max-shifted: no overflow)."""
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True) - Y


def _accuracy(A: np.ndarray, W: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Accuracy (%) of the head(s) ``W`` (``(D, C)`` or ``(G, D, C)``) on ``(A, y)``."""
    return 100.0 * (np.argmax(A @ W, -1) == y).mean(-1)


class _Probe:
    """What both probes share: the training rows, the two evaluation splits, the classes."""

    def __init__(self, A_train, y_train, validation, test, classes: int):
        self.A, self.y = A_train, np.asarray(y_train, dtype=np.int64)
        self.evals = [(A, np.asarray(y, dtype=np.int64)) for A, y in (validation, test)]
        self.Y = np.eye(classes)[self.y]
        self.n = len(self.A)

    def _heads(self) -> np.ndarray:
        """The heads, ``(settings, D + 1, classes)``."""
        raise NotImplementedError

    def _report(self, targets, steps) -> list:
        """Each head with a target: its evaluation; None for the others.

        An :class:`~pycore.deep._slowdown.Eval`, or a string when the head is no longer finite.
        """
        W = self._heads()
        Av, yv = self.evals[0]
        val = np.atleast_1d(_accuracy(Av, W, yv))
        bad = ~np.isfinite(W).all(axis=(-2, -1))
        return [
            None
            if t is None
            else "non-finite head"
            if bad[g]
            else Eval(int(steps[g]), float(val[g]))
            for g, t in enumerate(targets)
        ]

    def test(self, index: int) -> float | str:
        """The test accuracy (%) of head ``index`` as it is now (a string: not finite)."""
        W = self._heads()[index]
        if not np.isfinite(W).all():
            return "non-finite head"
        At, yt = self.evals[1]
        return float(_accuracy(At, W, yt))


class GDProbe(_Probe):
    """Full-batch GD with step ``1/λ_max(AᵀA/N)`` from ``W = 0`` (module docstring)."""

    def __init__(self, A_train, y_train, validation, test, *, classes: int):
        super().__init__(A_train, y_train, validation, test, classes)
        self.eta = self.n / float(np.linalg.norm(self.A, 2) ** 2)
        self.W = np.zeros((self.A.shape[1], classes))
        self.steps = 0

    def _heads(self) -> np.ndarray:
        return self.W[None]

    def advance(self, targets: list) -> list:
        """GD steps of the head to ``targets[0]``, then its evaluation (``[None]`` without one)."""
        if targets[0] is None:
            return [None]
        while self.steps < targets[0]:
            self.W -= self.eta * (self.A.T @ _softmax_residual(self.A @ self.W, self.Y)) / self.n
            self.steps += 1
        return self._report(targets, [self.steps])


class AdamProbe(_Probe):
    """Adam from ``W = 0`` on seeded mini-batches, one head per learning rate, stepped together.

    Adam from ``W = 0`` on seeded mini-batches (each epoch a permutation of the training rows,
    ``default_rng([seed, epoch])``, an incomplete last batch dropped), one head per learning rate
    of ``lrs``, stepped together. Each head's arithmetic is ``torch.optim.Adam``'s with its
    defaults, in float64; a head without a target in a call to :meth:`advance` keeps its state and
    step count (the heads at one step move as one array).
    """

    def __init__(
        self,
        A_train,
        y_train,
        validation,
        test,
        *,
        lrs,
        classes: int,
        batch_size: int = 64,
        seed: int = 0,
    ):
        super().__init__(A_train, y_train, validation, test, classes)
        self.lr = np.asarray(lrs, dtype=np.float64)[:, None, None]
        shape = (len(self.lr), self.A.shape[1], classes)
        self.W, self.m, self.v = np.zeros(shape), np.zeros(shape), np.zeros(shape)
        self.steps = np.zeros(len(self.lr), dtype=np.int64)
        self.bs, self.seed = min(batch_size, self.n), seed
        self.per_epoch = self.n // self.bs
        self.orders: dict[int, np.ndarray] = {}

    def _heads(self) -> np.ndarray:
        return self.W

    def _batch(self, step: int) -> np.ndarray:
        epoch, k = divmod(step, self.per_epoch)
        if epoch not in self.orders:
            self.orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.n)}
        return self.orders[epoch][k * self.bs : (k + 1) * self.bs]

    def _step(self, g: np.ndarray) -> None:
        """One Adam step of the heads ``g`` (all at the same step count)."""
        (b1, b2), t = ADAM_BETAS, int(self.steps[g[0]]) + 1
        idx = self._batch(t - 1)
        A, Y = self.A[idx], self.Y[idx]
        grad = np.matmul(A.T, _softmax_residual(np.matmul(A, self.W[g]), Y)) / len(idx)
        self.m[g] = b1 * self.m[g] + (1 - b1) * grad
        self.v[g] = b2 * self.v[g] + (1 - b2) * grad * grad
        c1, c2 = 1 - b1**t, 1 - b2**t
        self.W[g] -= (self.lr[g] / c1) * self.m[g] / (np.sqrt(self.v[g]) / np.sqrt(c2) + ADAM_EPS)
        self.steps[g] = t

    def advance(self, targets: list) -> list:
        """Adam steps of each head with a target to that step, then each one's evaluation."""
        goal = np.array([-1 if t is None else t for t in targets], dtype=np.int64)
        while True:
            on = np.flatnonzero(self.steps < goal)
            if not on.size:
                break
            # the heads at one step count move as one array; the lowest count first
            t = self.steps[on].min()
            self._step(on[self.steps[on] == t])
        return self._report(targets, self.steps)


def linear_probe_curve(
    Z_train,
    y_train,
    Z_test,
    y_test,
    *,
    epochs: int = 50,
    num_classes: int | None = None,
    validation=None,
) -> ProbeCurve:
    """The paper's probe (Eq. (4), Figure 3): a GD-trained linear head's accuracy, epoch by epoch.

    :class:`GDProbe` (full-batch GD, step 1/L, a bias column) on ``Z_train``; test (and validation)
    accuracy (%) before training and after each of ``epochs`` steps.

    Parameters
    ----------
    Z_train : array_like, shape (N, D)
        The training features.
    y_train : array_like of int, shape (N,)
        Their labels.
    Z_test : array_like, shape (M, D)
        The test features.
    y_test : array_like of int, shape (M,)
        Their labels.
    epochs : int, default 50
        Full-batch GD steps.
    num_classes : int, optional
        The classes (default: the largest label + 1).
    validation : pair of array_like, optional
        ``(Z_val, y_val)``, also scored after every step.

    Returns
    -------
    ProbeCurve
        Test (and validation) accuracy (%) at each of the ``epochs + 1`` points.

    Raises
    ------
    ValueError
        Features that are not finite real matrices, or of other widths.
    FloatingPointError
        The probe's head became non-finite.
    """
    y_train, y_test = np.asarray(y_train), np.asarray(y_test)
    Zv, yv = validation if validation is not None else (Z_test, y_test)
    A, At, Av = probe_inputs(Z_train, Z_test, Zv)
    C = int(num_classes or max(y_train.max(), y_test.max(), np.max(yv)) + 1)
    probe = GDProbe(A, y_train, (Av, yv), (At, y_test), classes=C)
    val, test = [], []
    for epoch in range(epochs + 1):
        if epoch:
            probe.advance([epoch])
        t = probe.test(0)
        if isinstance(t, str):
            raise FloatingPointError("the GD probe's head became non-finite")
        val.append(float(_accuracy(Av, probe.W, np.asarray(yv))))
        test.append(t)
    return ProbeCurve(test, val if validation is not None else [])
