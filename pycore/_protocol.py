"""The strict evaluation protocol (docs/theory.md §10).

It is decided on D_P's training rows and applied with the same maps to both tasks, training and
held-out: (1) drop the columns constant on D_P's training rows; (2) if null(K_P) is still not
empty, restrict every input to range(K_P) = span(V_r), as ``X V_r V_rᵀ`` (``"project"``) or ``X
V_r`` (``"basis"``; the same κ's, ceiling and closed form). Afterwards null(K_P) ⊆ null(K_H): the
RIR ceiling is finite.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pycore._metrics import right_singular_vectors
from pycore._spectral import numerical_rank
from pycore._tasks import LinearTask
from pycore._threads import bounded_blas
from pycore._validation import ParameterError, check_choice

# null(K_P) ⊆ null(K_H) is ‖X_H N‖₂² ≤ NULL_RTOL·‖X_H‖₂², the rule of rir_ceiling.
NULL_RTOL = 1e-10
RESTRICTIONS = ("project", "basis")


@dataclass(frozen=True)
class StrictReport:
    """What the strict protocol removed and what it checked (leaks as ‖X_H N‖₂²/‖X_H‖₂²)."""

    dropped_columns: list[str]  # names of the columns constant on D_P's training rows
    dropped_indices: list[int]
    D_input: int  # input dimension before
    D_after_drop: int
    rank_K_P: int  # rank of K_P after dropping (unchanged by the restriction)
    null_dim_after_drop: int  # dim null(K_P) left after dropping
    null_leak_after_drop: float  # D_H's weight on that null space (0 if empty)
    restricted: bool  # inputs restricted to range(K_P)
    restriction: str  # "project" (X V_r V_rᵀ) or "basis" (X V_r)
    D: int  # final input dimension (θ is D×D)
    null_leak: float  # the same leak after the protocol (round-off)
    inclusion_holds: bool  # null(K_P) ⊆ null(K_H) after the protocol
    heldout_null_leak_after_drop: float | None = None  # held-out D_H's weight on that null space

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _range_basis(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal bases of the row space of X and of its complement."""
    s, Vt = right_singular_vectors(X)
    r = numerical_rank(s, X.shape)
    return Vt[:r].T, Vt[r:].T


def _leak(X_H: np.ndarray, N: np.ndarray) -> float:
    top = np.linalg.norm(X_H, 2) ** 2 if N.shape[1] else 0.0
    return float(np.linalg.norm(X_H @ N, 2) ** 2 / top) if top > 0 else 0.0


@bounded_blas
def strict_protocol(
    train: LinearTask,
    heldout: LinearTask | None = None,
    feature_names: list[str] | None = None,
    *,
    restriction: str = "project",
    null_rtol: float = NULL_RTOL,
) -> tuple[LinearTask, LinearTask | None, StrictReport]:
    """Both tasks under the strict protocol (module docstring).

    Decided on D_P's training rows; the held-out rows get the same maps (they may vary where both
    training sets do not).

    Parameters
    ----------
    train : LinearTask
        The training rows of D_P and D_H.
    heldout : LinearTask, optional
        Held-out rows of the same columns.
    feature_names : list of str, optional
        The input columns' names (default ``x0, x1, …``), for the report.
    restriction : {"project", "basis"}, default "project"
        How inputs are restricted to range(K_P) when null(K_P) is not empty: ``X V_r V_rᵀ`` or
        ``X V_r`` (the same κ's, ceiling and closed form).
    null_rtol : float, default 1e-10
        The largest relative weight of D_H on null(K_P) that counts as none.

    Returns
    -------
    train : LinearTask
        The training task under the protocol.
    heldout : LinearTask or None
        The held-out task under the same maps.
    report : StrictReport
        The columns dropped, the ranks and null-space leaks before and after, the restriction.

    Raises
    ------
    ParameterError
        An unknown restriction, a held-out task or names of another width.
    ValueError
        Every input column constant on D_P's training rows.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask, strict_protocol
    >>> rng = np.random.default_rng(0)
    >>> X_P = np.hstack([rng.standard_normal((20, 2)), np.ones((20, 1))])  # a constant column
    >>> X_H = rng.standard_normal((20, 3))
    >>> task = LinearTask(X_P, rng.standard_normal(20), X_H, rng.standard_normal(20))
    >>> train, _, report = strict_protocol(task, feature_names=["a", "b", "c"])
    >>> train.D, report.dropped_columns
    (2, ['c'])
    """
    check_choice(restriction, "restriction", RESTRICTIONS)
    D0 = train.D
    if heldout is not None and heldout.D != D0:
        raise ParameterError(
            "heldout", f"heldout has {heldout.D} input columns but train has {D0}"
        )
    names = list(feature_names) if feature_names is not None else [f"x{j}" for j in range(D0)]
    if len(names) != D0:
        raise ParameterError(
            "feature_names",
            f"feature_names has {len(names)} names but the inputs have {D0} columns",
        )
    drop = np.flatnonzero(np.ptp(train.X_P, axis=0) == 0)  # constant, decided on the values
    keep = np.setdiff1d(np.arange(D0), drop)
    if keep.size == 0:
        raise ValueError(
            "every input column is constant on D_P's training rows: nothing is left to immunize"
        )

    def cols(t, M):
        pick = (lambda X: X @ M) if M.ndim == 2 else (lambda X: X[:, M])
        return None if t is None else replace(t, X_P=pick(t.X_P), X_H=pick(t.X_H))

    tr, ho = cols(train, keep), cols(heldout, keep)
    V_r, V_null = _range_basis(tr.X_P)
    leak_drop = _leak(tr.X_H, V_null)
    held_leak = None if ho is None else _leak(ho.X_H, V_null)
    restricted = V_null.shape[1] > 0
    if restricted:
        M = V_r if restriction == "basis" else V_r @ V_r.T
        tr, ho = cols(tr, M), cols(ho, M)
    leak_after = _leak(tr.X_H, _range_basis(tr.X_P)[1])
    if not leak_after <= null_rtol:  # cannot happen once restricted; guards a broken basis
        raise ValueError(
            f"strict protocol: null(K_P) ⊄ null(K_H) after the restriction (leak {leak_after:.3e})"
        )
    report = StrictReport(
        [names[j] for j in drop],
        [int(j) for j in drop],
        D0,
        int(keep.size),
        int(V_r.shape[1]),
        int(V_null.shape[1]),
        leak_drop,
        restricted,
        restriction,
        tr.D,
        leak_after,
        True,
        held_leak,
    )
    return tr, ho, report
