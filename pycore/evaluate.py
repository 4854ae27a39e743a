"""Per-run evaluation of an immunized linear extractor (docs/theory.md §8, §10): everything a table needs.

A table evaluates many θ (methods × seeds) on the same tasks.  What does not depend on θ -- the
spectra at the reference θ = I, the basis of range(K_P) of the training rows and the products of
every input matrix with it, the best D_P loss before immunization -- is computed once per task
pair by :class:`EvaluationReference` and reused for every θ; each θ then costs one product per
input matrix, the SVDs of its features and two small products per part of the range/null split.
"""
from __future__ import annotations

import numpy as np

from pycore.losses import best_probe_loss
from pycore.metrics import RIR, Ceiling, rir_ceiling
from pycore.probe import gd_exact_line_search
from pycore.spectral import EPS, gram_spectrum, rank_tolerance
from pycore.tasks import LinearTask
from pycore.threads import bounded_blas
from pycore.validation import ParameterError, check_theta


def immunized_def31(harmful_ratio: float, pretrain_ratio: float) -> bool:
    """Definition 3.1 for one run (docs/theory.md §8): (i) > 1 AND (ii) < 1.

    RIR alone cannot decide it: whitening D_P reaches the RIR ceiling whatever it does to (i).
    """
    return bool(harmful_ratio > 1.0 and pretrain_ratio < 1.0)


def null_part_fraction(theta: np.ndarray, theta_null: np.ndarray) -> float:
    """Fraction of ‖θ − I‖_F² in the null(K_P) part: ‖θ_null − I‖_F²/‖θ − I‖_F².

    θ − I = P_R(θ − I) + P_N(θ − I), two Frobenius-orthogonal pieces, and θ_null − I is the
    second one, so the fraction is in [0, 1]; NaN for θ = I (nothing moved, no fraction).
    """
    eye = np.eye(theta.shape[0])
    total = float(np.sum((theta - eye) ** 2))
    return float(np.sum((theta_null - eye) ** 2)) / total if total > 0 else float("nan")


class _Rows:
    """One input matrix X of a task with what every θ reuses: the spectrum of XᵀX (θ = I) and
    ``XV`` for the basis V of range(K_P)."""

    def __init__(self, X: np.ndarray, V: np.ndarray):
        self.X = X
        self.ref = gram_spectrum(X, vectors=False)
        self.XV = X @ V
        self.X_range = X - self.XV @ V.T      # X P_N
        self.X_null = self.XV @ V.T           # X P_R


class EvaluationReference:
    """What the evaluation of any θ on ``train`` (and ``heldout``) shares, computed once.

    P_R = VVᵀ projects onto range(K_P) of the TRAINING rows of D_P (docs/theory.md §8), V from
    the SVD of X_P with the rank rule of :mod:`pycore.spectral` (as
    :func:`pycore.metrics.range_null_split`).  With T = Vᵀθ (r×D) the features of the two parts,
    ``X θ_range = X P_N + (XV)T`` and ``X θ_null = X P_R + Xθ − (XV)T``, are those of
    ``θ_range = P_N + P_Rθ`` and ``θ_null = P_R + P_Nθ`` associated differently: r×D×D and
    N×r×D products instead of D×D×D ones (on MNIST, D = 784 and r ≤ 100, an 8× smaller count);
    the two associations agree to round-off, ~eps‖X‖‖θ‖, the rounding of forming Xθ itself.
    """

    def __init__(self, train: LinearTask, heldout: LinearTask | None = None):
        for name, t in (("train", train), ("heldout", heldout)):
            if t is not None and not isinstance(t, LinearTask):
                raise ParameterError(name, f"{name} must be a pycore.LinearTask, got {type(t).__name__}")
        if heldout is not None and heldout.D != train.D:
            raise ParameterError("heldout", f"the held-out task has {heldout.D} input columns but the "
                                            f"training task {train.D}: θ acts on one input space")
        self.train, self.heldout = train, heldout
        X_P = train.X_P
        _, s, Vt = np.linalg.svd(X_P, full_matrices=False)
        r = int(np.count_nonzero(s > rank_tolerance(s[0], X_P.shape)))
        self.V = Vt[:r].T
        self.rows = {("train", "P"): _Rows(train.X_P, self.V), ("train", "H"): _Rows(train.X_H, self.V)}
        self._dp_loss_before: dict = {}
        if heldout is not None:
            self.rows[("heldout", "P")] = _Rows(heldout.X_P, self.V)
            self.rows[("heldout", "H")] = _Rows(heldout.X_H, self.V)

    def dp_loss_before(self, rows: str = "train") -> float:
        """Best D_P loss of a linear head on the inputs (θ = I), computed on first use (a damped
        Newton solve for BCE, which a caller that never asks for it should not pay for)."""
        if rows not in self._dp_loss_before:
            t = self.train if rows == "train" else self.heldout
            self._dp_loss_before[rows] = best_probe_loss(t.loss, t.X_P, t.Y_P)
        return self._dp_loss_before[rows]

    def features(self, theta: np.ndarray, rows: str = "train") -> dict:
        """Features of θ, θ_range and θ_null on the ``rows`` ("train" or "heldout") of both
        tasks: ``{(part, task): X·θ_part}``, part in ("theta", "range", "null"), task in ("P", "H")."""
        T = self.V.T @ theta
        out = {}
        for task in ("P", "H"):
            R = self.rows[(rows, task)]
            Z = R.X @ theta
            XVT = R.XV @ T
            out[("theta", task)] = Z
            out[("range", task)] = R.X_range + XVT
            out[("null", task)] = R.X_null + (Z - XVT)
        return out

    def rir(self, Z_P: np.ndarray, Z_H: np.ndarray, rows: str = "train") -> RIR:
        """RIR (docs/theory.md §8) of the features ``Z_P = X_Pθ``, ``Z_H = X_Hθ`` against θ = I;
        the arithmetic of :func:`pycore.metrics.rir` with the reference spectra kept."""
        sP, sH = gram_spectrum(Z_P, vectors=False), gram_spectrum(Z_H, vectors=False)
        rP, rH = self.rows[(rows, "P")].ref, self.rows[(rows, "H")].ref
        hr = sH.kappa / rH.kappa
        pr = sP.kappa / rP.kappa
        return RIR(hr / pr, hr, pr, sH.kappa, sP.kappa, rH.kappa, rP.kappa, sH.rank, sP.rank)

    def null_part_fraction(self, theta: np.ndarray) -> float:
        """:func:`null_part_fraction` of θ: ‖P_N(θ − I)‖_F²/‖θ − I‖_F²."""
        M = theta - np.eye(theta.shape[0])
        total = float(np.sum(M ** 2))
        if not total > 0:
            return float("nan")
        N = M - self.V @ (self.V.T @ M)
        return float(np.sum(N ** 2)) / total


@bounded_blas
def evaluate_linear(theta: np.ndarray, train: LinearTask, heldout: LinearTask | None = None, *,
                    ceiling: Ceiling | None = None, reference: EvaluationReference | None = None) -> dict:
    """RIR and factors on training rows, held-out RIR, fraction of the range-restricted ceiling,
    and the best D_P / D_H probing loss with θ vs with I (Definition 3.1(c)).

    Range/null decomposition (docs/theory.md §8): P_R projects onto range(K_P) of the TRAINING
    rows of D_P (also for the held-out rows); ``rir_range_part`` is the RIR of θ_range = P_N + P_Rθ,
    ``rir_null_part`` that of θ_null = P_R + P_Nθ (``heldout_`` prefix: held-out rows);
    ``null_part_fraction`` is the share of ‖θ − I‖_F² in the null part.  ``ceiling``
    (:func:`pycore.metrics.rir_ceiling` of the training rows) and ``reference`` (an
    :class:`EvaluationReference` of these tasks) are computed when not given; a ceiling whose
    κ(K_P), κ(K_H) are not the training rows' is refused.
    """
    if reference is not None and (reference.train is not train or reference.heldout is not heldout):
        raise ParameterError("reference", "reference was built for other tasks: pass "
                                          "EvaluationReference(train, heldout) of these tasks")
    ref = reference if reference is not None else EvaluationReference(train, heldout)
    if ceiling is None:
        ceiling = rir_ceiling(train.X_P, train.X_H)
    for mine, task in ((ceiling.kappa_K_P, "P"), (ceiling.kappa_K_H, "H")):
        rows = ref.rows[("train", task)]
        if not _same_kappa(mine, rows.ref.kappa, min(rows.X.shape)):
            raise ParameterError("ceiling", f"ceiling was computed on other data: its κ(K_{task}) = "
                                            f"{mine:.6g}, the training rows' {rows.ref.kappa:.6g}")
    theta = check_theta(theta, train.D)
    f = ref.features(theta, "train")
    r = ref.rir(f[("theta", "P")], f[("theta", "H")])
    out = {
        "rir": r.value, "harmful_ratio": r.harmful_ratio, "pretrain_ratio": r.pretrain_ratio,
        "kappa_H": r.kappa_H, "kappa_P": r.kappa_P, "rank_H": r.rank_H, "rank_P": r.rank_P,
        "fraction_of_ceiling": r.value / ceiling.range_restricted,
        "immunized": immunized_def31(r.harmful_ratio, r.pretrain_ratio),
        "rir_range_part": ref.rir(f[("range", "P")], f[("range", "H")]).value,
        "rir_null_part": ref.rir(f[("null", "P")], f[("null", "H")]).value,
        "null_part_fraction": ref.null_part_fraction(theta),
        # Def. 3.1(c): best D_P loss of a linear head on the features, before (θ = I) and after.
        "dp_loss_before": ref.dp_loss_before("train"),
        "dp_loss_after": best_probe_loss(train.loss, f[("theta", "P")], train.Y_P),
    }
    if heldout is not None:
        g = ref.features(theta, "heldout")
        h = ref.rir(g[("theta", "P")], g[("theta", "H")], "heldout")
        out.update({"heldout_rir": h.value, "heldout_harmful_ratio": h.harmful_ratio,
                    "heldout_pretrain_ratio": h.pretrain_ratio,
                    "heldout_immunized": immunized_def31(h.harmful_ratio, h.pretrain_ratio),
                    "heldout_rir_range_part": ref.rir(g[("range", "P")], g[("range", "H")], "heldout").value,
                    "heldout_rir_null_part": ref.rir(g[("null", "P")], g[("null", "H")], "heldout").value,
                    "heldout_dp_loss_before": ref.dp_loss_before("heldout"),
                    "heldout_dp_loss_after": best_probe_loss(heldout.loss, g[("theta", "P")], heldout.Y_P)})
    return out


def _same_kappa(a: float, b: float, p: int) -> bool:
    """κ(K) = κ(X)² from two SVDs of the same rows: σ_min agrees to ~p·eps·σ_max, so κ(K) to
    2p·eps·√κ(K) relative (a factor 2 margin, at least 1e-9); other rows miss by orders of magnitude."""
    return abs(a - b) <= max(1e-9, 4 * p * EPS * np.sqrt(max(a, b))) * b


@bounded_blas
def norm_ratio_curves(theta: np.ndarray, task: LinearTask, steps: int) -> dict:
    """Figure 1: ‖w_t − w*‖²/‖w_0 − w*‖² of exact-line-search GD probing on D_P and D_H."""
    return {"D_P": gd_exact_line_search(task.X_P @ theta, task.Y_P, steps).norm_ratio,
            "D_H": gd_exact_line_search(task.X_H @ theta, task.Y_H, steps).norm_ratio}


def def31_summary(flags) -> dict:
    """How many runs satisfy Definition 3.1: ``{"count", "runs", "per_seed"}`` (a table prints k/n)."""
    flags = [bool(f) for f in flags]
    return {"count": sum(flags), "runs": len(flags), "per_seed": flags}
