"""The strict evaluation protocol for linear immunization (docs/theory.md §10, "Strict protocol").

Under the paper's protocol the RIR can be inflated through input directions that D_P's training
rows never vary in: there θ may shrink or stretch D_H's inputs without touching H_P, and the
supremum of RIR is infinite as soon as null(K_P) ⊄ null(K_H).  The strict protocol removes
those directions from BOTH tasks before anything is immunized or measured, so that RIR measures
conditioning alone and its exact ceiling is finite:

1. drop every input column that is constant on D_P's training rows (named in the report);
2. if null(K_P) is still not empty (columns that vary but are linearly dependent on D_P's rows),
   restrict every input, training and held-out, of both tasks to range(K_P), with V_r an
   orthonormal basis of it (from the SVD of D_P's training rows), in one of two equivalent forms:

   * ``"project"`` (default): ``X ← X V_r V_rᵀ``.  The input keeps its D named coordinates; the
     component of every row outside range(K_P) is removed, so no row of either task, training or
     held-out, varies in null(K_P) and null(K_P) ⊆ null(K_H) holds exactly.
   * ``"basis"``: ``X ← X V_r``, so θ is r×r and K_P has full rank (null(K_P) = {0}).

   Both give the same κ's, ceiling and closed form (one is the other up to a rotation and D − r
   dead coordinates); they differ only for a coordinate-wise optimizer such as Adam, which sees
   named columns in the first and principal axes of D_P, with scales spread by √κ(K_P), in the
   second.

Step 2 keeps every D_P training row exactly (``X_P V_r V_rᵀ = X_P``), so D_P's best loss and
κ(K_P) are unchanged; on D_H it keeps only the part of each row that lies in range(K_P), which is
the only part a θ fitted to D_P is ever asked to act on.  Everything is dataset-agnostic: it
takes :class:`~pycore.tasks.LinearTask`s.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pycore.metrics import right_singular_vectors
from pycore.spectral import rank_tolerance
from pycore.tasks import LinearTask

# null(K_P) ⊆ null(K_H) is tested as ‖X_H N‖₂² ≤ NULL_RTOL·‖X_H‖₂² (N an orthonormal basis of
# null(K_P)), the rule of pycore.metrics.rir_ceiling: far above round-off (~1e-31 after the
# restriction) and far below a real leak (House Prices: 1.6e-3 after dropping, 7.9e-2 before).
NULL_RTOL = 1e-10


@dataclass(frozen=True)
class StrictReport:
    """What the strict protocol removed and what it checked."""

    dropped_columns: list[str]       # names of the columns constant on D_P's training rows
    dropped_indices: list[int]
    D_input: int                     # input dimension before
    D_after_drop: int
    rank_K_P: int                    # rank of K_P after dropping (unchanged by the restriction)
    null_dim_after_drop: int         # dim null(K_P) left after dropping
    null_leak_after_drop: float      # ‖K_H N‖₂/‖K_H‖₂ on that null space (0 if empty)
    restricted: bool                 # inputs restricted to range(K_P)
    restriction: str                 # "project" (X V_r V_rᵀ) or "basis" (X V_r)
    D: int                           # final input dimension (θ is D×D)
    null_leak: float                 # the same leak after the protocol (~1e-31: round-off)
    inclusion_holds: bool            # null(K_P) ⊆ null(K_H) after the protocol
    heldout_null_leak_after_drop: float | None = None  # held-out D_H's weight on that null space

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def constant_columns(X: np.ndarray) -> np.ndarray:
    """Indices of the columns of ``X`` whose values are all equal (decided on values, ``ptp == 0``)."""
    return np.flatnonzero(np.ptp(X, axis=0) == 0)


def _range_basis(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(V_r, V_null): orthonormal bases of the row space of X and of its complement.

    The rank uses numpy's ``matrix_rank`` cut-off on the singular values of X, the rule every κ
    and ceiling of this project uses (:mod:`pycore.spectral`).
    """
    s, Vt = right_singular_vectors(X)   # all D right singular vectors, never an N×N U
    r = int(np.count_nonzero(s > rank_tolerance(s[0], X.shape))) if s.size and s[0] > 0 else 0
    return Vt[:r].T, Vt[r:].T


def _leak(X_H: np.ndarray, N: np.ndarray) -> float:
    """‖K_H N‖₂/‖K_H‖₂-style weight of D_H on the span of N: ‖X_H N‖₂²/‖X_H‖₂²."""
    if N.shape[1] == 0:
        return 0.0
    top = np.linalg.norm(X_H, 2) ** 2
    return float(np.linalg.norm(X_H @ N, 2) ** 2 / top) if top > 0 else 0.0


RESTRICTIONS = ("project", "basis")


def strict_protocol(train: LinearTask, heldout: LinearTask | None = None,
                    feature_names: list[str] | None = None, *, restriction: str = "project",
                    null_rtol: float = NULL_RTOL) -> tuple[LinearTask, LinearTask | None, StrictReport]:
    """Apply the strict protocol to a training task and, with the same maps, its held-out task.

    Everything is decided on the TRAINING rows of D_P (what the defender sees): the constant
    columns and the basis of range(K_P).  The restriction to range(K_P) is applied whenever
    null(K_P) is not empty after dropping, not only when the training D_H leaks into it: held-out
    rows may vary in a direction both training sets ignore.  Returns
    ``(train', heldout', report)``; ``report.inclusion_holds`` must be True (checked here).
    """
    if restriction not in RESTRICTIONS:
        raise ValueError(f"restriction must be one of {RESTRICTIONS}, got {restriction!r}")
    D0 = train.D
    names = list(feature_names) if feature_names is not None else [f"x{j}" for j in range(D0)]
    if len(names) != D0:
        raise ValueError(f"feature_names has {len(names)} names but the inputs have {D0} columns")
    drop = constant_columns(train.X_P)
    keep = np.setdiff1d(np.arange(D0), drop)
    if keep.size == 0:
        raise ValueError("every input column is constant on D_P's training rows: nothing is left to immunize")

    def cols(t, M):
        return None if t is None else replace(t, X_P=t.X_P @ M if M.ndim == 2 else t.X_P[:, M],
                                              X_H=t.X_H @ M if M.ndim == 2 else t.X_H[:, M], _cache={})

    tr, ho = cols(train, keep), cols(heldout, keep)
    V_r, V_null = _range_basis(tr.X_P)
    leak_drop = _leak(tr.X_H, V_null)
    held_leak = None if ho is None else _leak(ho.X_H, V_null)
    restricted = V_null.shape[1] > 0
    if restricted:
        M = V_r if restriction == "basis" else V_r @ V_r.T
        tr, ho = cols(tr, M), cols(ho, M)
    _, N_after = _range_basis(tr.X_P)
    leak_after = _leak(tr.X_H, N_after)
    holds = leak_after <= null_rtol
    if not holds:  # cannot happen once restricted; guards a broken basis
        raise ValueError(f"strict protocol: null(K_P) ⊄ null(K_H) after the restriction "
                         f"(leak {leak_after:.3e})")
    report = StrictReport([names[j] for j in drop], [int(j) for j in drop], D0, int(keep.size),
                          int(V_r.shape[1]), int(V_null.shape[1]), leak_drop, restricted, restriction, tr.D,
                          leak_after, bool(holds), held_leak)
    return tr, ho, report
