"""The two tasks of an immunization problem: pre-training D_P, harmful D_H (docs/theory.md §1)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pycore._validation import ParameterError, as_float_matrix, as_target

LOSSES = ("mse", "bce")


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    """A private, read-only copy: the task never sees a caller's later edit of its array."""
    out = np.array(a, dtype=np.float64, order="C", copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class LinearTask:
    """Inputs and targets of the pre-training task D_P and the harmful task D_H.

    Both tasks share one input space of ``D`` columns; a linear feature extractor θ (D×D) maps
    inputs ``X`` to features ``Z = Xθ`` (docs/theory.md §1). D_P is trained with ``loss``; D_H
    is probed with the squared loss, whose Hessian is ``θᵀK_Hθ`` (paper Eq. (9)).

    Parameters
    ----------
    X_P, X_H : array_like, shape (N_P, D) and (N_H, D)
        Inputs of D_P and D_H, one row per sample; real and finite.
    Y_P, Y_H : array_like, shape (N_P,) or (N_P, m), and (N_H,) or (N_H, m)
        Targets (a 1-D target becomes one column).
    loss : {"mse", "bce"}
        D_P's loss: squared error, or logistic with one target column in {0, 1}.
    name : str
        Named in every error about this task.

    Raises
    ------
    ParameterError
        A loss not in :data:`LOSSES`, tasks of different widths, or a BCE target that is not one
        0/1 column; ``.parameter`` names the argument.
    ValueError
        An input that is empty, not 2-D, not real, or holds NaN or inf (the message names it).

    Notes
    -----
    The task owns read-only float64 copies of its inputs: editing the caller's arrays afterwards
    changes nothing here, and the matrices derived from them (``K_P``, ``K_H``, the reference
    condition numbers) are computed once, on first use, as cached properties.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask
    >>> X = np.arange(12.0).reshape(4, 3) ** 2
    >>> task = LinearTask(X, X[:, 0], X + 1.0, X[:, 1], name="demo")
    >>> task.D, task.K_P.shape
    (3, (3, 3))
    >>> X[0, 0] = 1e6                      # the caller's array, not the task's
    >>> float(task.X_P[0, 0])
    0.0
    >>> task.X_P.flags.writeable
    False
    """

    X_P: np.ndarray
    Y_P: np.ndarray
    X_H: np.ndarray
    Y_H: np.ndarray
    loss: str = "mse"
    name: str = "task"

    def __post_init__(self):
        X_P = as_float_matrix(self.X_P, f"{self.name}: X_P")
        X_H = as_float_matrix(self.X_H, f"{self.name}: X_H")
        if X_P.shape[1] != X_H.shape[1]:
            raise ParameterError(
                "X_H",
                f"{self.name}: X_P has {X_P.shape[1]} columns but X_H has "
                f"{X_H.shape[1]}; both tasks must share the input space",
            )
        Y_P = as_target(self.Y_P, X_P.shape[0], f"{self.name}: Y_P")
        Y_H = as_target(self.Y_H, X_H.shape[0], f"{self.name}: Y_H")
        if self.loss not in LOSSES:
            raise ParameterError(
                "loss", f"{self.name}: loss must be one of {LOSSES}, got {self.loss!r}"
            )
        if self.loss == "bce" and Y_P.shape[1] != 1:
            raise ParameterError(
                "Y_P",
                f"{self.name}: loss 'bce' needs one target column in Y_P (a binary "
                f"label), got {Y_P.shape[1]} columns",
            )
        if self.loss == "bce" and not np.all((Y_P == 0) | (Y_P == 1)):
            raise ParameterError("Y_P", f"{self.name}: loss 'bce' needs Y_P in {{0, 1}}")
        for k, v in (("X_P", X_P), ("Y_P", Y_P), ("X_H", X_H), ("Y_H", Y_H)):
            object.__setattr__(self, k, _frozen_copy(v))

    @property
    def D(self) -> int:
        """Width of the shared input space (θ is D×D)."""
        return self.X_P.shape[1]

    @cached_property
    def K_P(self) -> np.ndarray:
        """``K_P = X_PᵀX_P`` (Algorithm 1, line 1), read-only."""
        return _read_only(self.X_P.T @ self.X_P)

    @cached_property
    def K_H(self) -> np.ndarray:
        """``K_H = X_HᵀX_H`` (Algorithm 1, line 2), read-only."""
        return _read_only(self.X_H.T @ self.X_H)

    @cached_property
    def reference_kappas(self) -> tuple[float, float]:
        """``(κ(H_P(I)), κ(H_H(I)))``, the denominators of (ii) and (i).

        docs/theory.md §8, from the SVDs of ``X_P`` and ``X_H``
        (:func:`pycore._spectral.gram_spectrum`).
        """
        from pycore._spectral import gram_spectrum  # spectral's checks import this module's peers

        return (
            gram_spectrum(self.X_P, vectors=False).kappa,
            gram_spectrum(self.X_H, vectors=False).kappa,
        )

    @cached_property
    def norm2_X_H(self) -> float:
        """``‖X_H‖₂``, the largest singular value of D_H's inputs (IMMA's attacker step)."""
        return float(np.linalg.norm(self.X_H, 2))

    @cached_property
    def factor_P(self):
        """:class:`pycore.linalg.RowFactor` of ``X_P``, once per task.

        A thin SVD with K_P's rank rule: the small side of every ``H_P(θ)`` and K_P's
        preconditioner.
        """
        from pycore._spectral import RowFactor

        return RowFactor.of(self.X_P)

    @cached_property
    def factor_H(self):
        """:class:`pycore.linalg.RowFactor` of ``X_H`` (see :attr:`factor_P`)."""
        from pycore._spectral import RowFactor

        return RowFactor.of(self.X_H)


def _read_only(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a
