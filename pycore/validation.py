"""Input checks shared by the linear core: one clear line per problem, never a deep traceback."""
from __future__ import annotations

import numpy as np


class ParameterError(ValueError):
    """A parameter value the library cannot use (non-finite, out of range, or one that makes a
    run diverge).  ``parameter`` is the name of the offending field or argument (for example
    ``"lambda_h"``), so that a command-line layer can name the flag the user typed."""

    def __init__(self, parameter: str, message: str):
        super().__init__(message)
        self.parameter = parameter


class DivergenceError(FloatingPointError):
    """A run became non-finite (θ, a loss, or optimizer state).  ``parameter`` names the
    setting most likely responsible (for example ``"lambda_h"`` or ``"lr"``), or is None."""

    def __init__(self, message: str, parameter: str | None = None):
        super().__init__(message)
        self.parameter = parameter


def as_float_matrix(A, name: str = "matrix", *, ndim: int = 2) -> np.ndarray:
    """Return ``A`` as a C-contiguous float64 array of ``ndim`` dims, or raise ``ValueError``.

    Rejects non-numeric dtypes (object, strings), the wrong number of dimensions, empty arrays
    and NaN/inf entries, naming the offending argument and, for non-finite values, the first
    offending index.
    """
    arr = np.asarray(A)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise ValueError(f"{name} contains NaN or inf (first at index {bad})")
    return arr


def as_target(Y, n_rows: int, name: str = "Y") -> np.ndarray:
    """Targets as an ``(N, m)`` float64 matrix with ``N == n_rows``."""
    arr = np.asarray(Y)
    if arr.ndim == 1:
        arr = arr[:, None]
    arr = as_float_matrix(arr, name)
    if arr.shape[0] != n_rows:
        raise ValueError(f"{name} has {arr.shape[0]} rows but the inputs have {n_rows}")
    return arr


def check_square(A: np.ndarray, name: str) -> None:
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"{name} must be square, got shape {A.shape}")


def check_theta(theta, D: int, name: str = "theta") -> np.ndarray:
    """A D×D float64 feature extractor (SPEC §1)."""
    theta = as_float_matrix(theta, name)
    if theta.shape != (D, D):
        raise ValueError(f"{name} must be {D}×{D} to match the data's {D} columns, got shape {theta.shape}")
    return theta
