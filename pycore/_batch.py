"""Same-size runs stepped together (docs/design.md §6).

The spectra and regularizer terms of a stack of B runs on ONE task, from the small side of every
Gram matrix.

θ is a B×D×D stack and a task's features are ``F = Aθ`` (B×r×D, ``A = diag(s)Vᵀ`` of
:class:`pycore.linalg.RowFactor`): the Hessian ``H = θᵀKθ = FᵀF`` is known through the r×r
``W = FFᵀ``, whose eigenvalues are H's nonzero ones (r ≤ min(N, D)), never through the D×D H.
Every operation acts on each run alone (a matmul per slice, reductions along a run's own axes,
one LAPACK reduction per run), so a run's numbers do not depend on the other runs of its stack:
a stack of one gives the same bits (tests/test_batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycore._spectral import (
    EPS,
    TIE_RTOL,
    SpectrumError,
    SpectrumInfo,
    SymmetricEigen,
)


@dataclass(frozen=True)
class GramTerm:
    """One regularizer's gradient for every run of a stack, carried on the small side.

    One regularizer's gradient ``G = a·vvᵀ − b·H`` for every run of a stack (docs/theory.md §4),
    carried on the small side: ``FG = EF`` with ``E = a·uuᵀ − b·W`` (r×r), u the unit eigenvector
    of W with ``v = Fᵀu/‖Fᵀu‖`` (``Fvvᵀ = uuᵀF`` because ``Wu = λu`` and ``‖Fᵀu‖² = λ``).
    """

    kind: str
    a: np.ndarray  # (B,)
    b: np.ndarray  # (B,)
    index: np.ndarray  # (B,) descending index of the eigenpair the gradient uses
    E: np.ndarray  # (B, r, r)
    d: np.ndarray | None  # R_ill's denominator per run; None for R_well


class GramStack:
    """Spectra of ``H_b = F_bᵀF_b`` for a stack ``F`` (B×r×D) from ``W_b = F_bF_bᵀ``.

    One dense symmetric reduction per run (:class:`pycore._spectral.SymmetricEigen`, dsyevr's own
    calls), summarised as :func:`pycore._spectral.summarise` summarises the D eigenvalues of H (its
    D − r zeros exact, rank cut with H's shape D×D).
    """

    def __init__(self, F: np.ndarray, D: int, *, what: str = "ZᵀZ"):
        if F.shape[1] == 0:  # the task's inputs are zero: rank 0
            raise SpectrumError(f"{what} is zero: its condition number is undefined")
        self.F, self.D = F, D
        self.W = F @ F.mT
        self.eig = [SymmetricEigen(w, symmetric=True) for w in self.W]  # FFᵀ by syrk
        lam = np.stack([e.values[::-1] for e in self.eig])  # descending
        np.clip(lam, 0.0, None, out=lam)
        B, r = lam.shape
        smax = lam[:, 0]
        if not np.all(smax > 0.0):
            raise SpectrumError(f"{what} is zero: its condition number is undefined")
        tol = smax * (D * EPS)  # rank_tolerance(smax, (D, D)) for every run
        k = np.count_nonzero(lam > tol[:, None], axis=1)
        rows = np.arange(B)
        smin = lam[rows, k - 1]
        two = k >= 2
        second = lam[:, 1] if r >= 2 else smax
        self.lam, self.rank, self.tol, self.fro2 = lam, k, tol, np.sum(lam * lam, axis=1)
        self.sigma_max, self.sigma_min, self.kappa = smax, smin, smax / smin
        self.gap_max = np.where(two, smax - second, np.inf)
        self.gap_min = np.where(two, lam[rows, np.maximum(k - 2, 0)] - smin, np.inf)
        self.tie_max = two & (self.gap_max <= TIE_RTOL * smax)
        self.tie_min = two & (self.gap_min <= np.maximum(TIE_RTOL * smin, tol))
        self._u: dict = {}

    def __len__(self) -> int:
        return self.lam.shape[0]

    def u(self, index) -> np.ndarray:
        """Unit eigenvectors of the W's (B×r) for the ``index``-th largest eigenvalue of each run.

        By inverse iteration at the dsterf eigenvalue (:meth:`SymmetricEigen.vector_at_value`).
        """
        index = np.broadcast_to(np.asarray(index), (len(self),))
        key = tuple(int(i) for i in index)
        if key not in self._u:
            r = self.lam.shape[1]
            self._u[key] = np.stack(
                [e.vector_at_value(r - 1 - int(i)) for e, i in zip(self.eig, index)]
            )
        return self._u[key]

    def v(self, index) -> np.ndarray:
        """Unit eigenvectors of the H's (B×D).

        ``Fᵀu/‖Fᵀu‖`` (= ``Fᵀu/√λ`` to round-off; exactly zero where F's column is, i.e. on a dead
        feature of H).
        """
        v = (self.u(index)[:, None, :] @ self.F)[:, 0, :]
        return v / np.sqrt(np.sum(v * v, axis=1))[:, None]

    def info(self, b: int) -> SpectrumInfo:
        """Run ``b``'s :class:`SpectrumInfo` of H (D eigenvalues, the D − r beyond W's zero)."""
        sigma = np.zeros(self.D)
        sigma[: self.lam.shape[1]] = self.lam[b]
        return SpectrumInfo(
            sigma,
            int(self.rank[b]),
            float(self.tol[b]),
            float(self.sigma_max[b]),
            float(self.sigma_min[b]),
            float(self.kappa[b]),
            float(self.gap_max[b]),
            float(self.gap_min[b]),
            bool(self.tie_max[b]),
            bool(self.tie_min[b]),
        )

    def term(self, kind: str) -> GramTerm:
        """R_well (``p = D``, Theorem 4.2) or R_ill (``k`` = rank) of every run.

        ``a``, ``b`` of ``G = a·vvᵀ − b·H`` and the small-side ``E``; R_ill undefined on a run (κ =
        1, rank ≤ 1) is a :class:`SpectrumError`, as :func:`pycore.linalg.hessian_regularizer`
        raises.
        """
        from pycore._regularizers import r_ill_denominator

        B = len(self)
        if kind == "well":
            index, d = np.zeros(B, dtype=int), None
            a, b = self.sigma_max, np.full(B, 1.0 / self.D)
        else:
            index = self.rank - 1
            d = np.array(
                [r_ill_denominator(self.lam[j], int(self.rank[j]), self.fro2[j]) for j in range(B)]
            )
            d2 = d * d
            a, b = self.sigma_min / d2, 1.0 / (self.rank * d2)
        u = self.u(index)
        E = a[:, None, None] * (u[:, :, None] * u[:, None, :]) - b[:, None, None] * self.W
        return GramTerm(kind, a, b, index, E, d)
