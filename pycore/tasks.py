"""The two tasks of an immunization problem: pre-training D_P, harmful D_H (docs/theory.md §1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pycore.validation import ParameterError, as_float_matrix, as_target

LOSSES = ("mse", "bce")


@dataclass(frozen=True)
class LinearTask:
    """Inputs and targets of D_P and D_H, float64, one row per sample.  ``loss`` is D_P's:
    ``"mse"`` or ``"bce"`` (one label column in {0, 1}); D_H is probed with ℓ2, Hessian ``θᵀK_Hθ``
    (Eq. (9))."""

    X_P: np.ndarray
    Y_P: np.ndarray
    X_H: np.ndarray
    Y_H: np.ndarray
    loss: str = "mse"
    name: str = "task"
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

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
            object.__setattr__(self, k, v)

    @property
    def D(self) -> int:
        return self.X_P.shape[1]

    @property
    def K_P(self) -> np.ndarray:
        """K_P = X_PᵀX_P (Algorithm 1, line 1)."""
        if "K_P" not in self._cache:
            self._cache["K_P"] = self.X_P.T @ self.X_P
        return self._cache["K_P"]

    @property
    def K_H(self) -> np.ndarray:
        """K_H = X_HᵀX_H (Algorithm 1, line 2)."""
        if "K_H" not in self._cache:
            self._cache["K_H"] = self.X_H.T @ self.X_H
        return self._cache["K_H"]
