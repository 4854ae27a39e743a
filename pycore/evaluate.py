"""Per-run evaluation of an immunized linear extractor (docs/theory.md §8, §10): everything a table needs."""
from __future__ import annotations

import numpy as np

from pycore.losses import best_probe_loss
from pycore.metrics import Ceiling, range_null_split, rir
from pycore.probe import gd_exact_line_search
from pycore.tasks import LinearTask
from pycore.threads import bounded_blas


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


@bounded_blas
def evaluate_linear(theta: np.ndarray, train: LinearTask, heldout: LinearTask | None,
                    ceiling: Ceiling) -> dict:
    """RIR and factors on training rows, held-out RIR, fraction of the range-restricted ceiling,
    and the best D_P / D_H probing loss with θ vs with I (Definition 3.1(c)).

    Range/null decomposition (docs/theory.md §8): with P_R the projector onto range(K_P) of the
    TRAINING rows of D_P (what the defender sees; also for the held-out rows), ``rir_range_part``
    is the RIR of θ_range = P_N + P_Rθ and ``rir_null_part`` that of θ_null = P_R + P_Nθ, on the
    training rows and (``heldout_`` prefix) on the held-out rows; ``null_part_fraction`` is the
    share of ‖θ − I‖_F² that lies in the null part.  ``immunized`` is Definition 3.1.
    """
    r = rir(theta, train.X_P, train.X_H)
    theta_range, theta_null = range_null_split(theta, train.X_P)
    out = {
        "rir": r.value, "harmful_ratio": r.harmful_ratio, "pretrain_ratio": r.pretrain_ratio,
        "kappa_H": r.kappa_H, "kappa_P": r.kappa_P, "rank_H": r.rank_H, "rank_P": r.rank_P,
        "fraction_of_ceiling": r.value / ceiling.range_restricted,
        "immunized": immunized_def31(r.harmful_ratio, r.pretrain_ratio),
        "rir_range_part": rir(theta_range, train.X_P, train.X_H).value,
        "rir_null_part": rir(theta_null, train.X_P, train.X_H).value,
        "null_part_fraction": null_part_fraction(theta, theta_null),
        # Def. 3.1(c): best D_P loss of a linear head on the features, before (θ = I) and after.
        "dp_loss_before": best_probe_loss(train.loss, train.X_P, train.Y_P),
        "dp_loss_after": best_probe_loss(train.loss, train.X_P @ theta, train.Y_P),
    }
    if heldout is not None:
        h = rir(theta, heldout.X_P, heldout.X_H)
        out.update({"heldout_rir": h.value, "heldout_harmful_ratio": h.harmful_ratio,
                    "heldout_pretrain_ratio": h.pretrain_ratio,
                    "heldout_immunized": immunized_def31(h.harmful_ratio, h.pretrain_ratio),
                    "heldout_rir_range_part": rir(theta_range, heldout.X_P, heldout.X_H).value,
                    "heldout_rir_null_part": rir(theta_null, heldout.X_P, heldout.X_H).value,
                    "heldout_dp_loss_before": best_probe_loss(heldout.loss, heldout.X_P, heldout.Y_P),
                    "heldout_dp_loss_after": best_probe_loss(heldout.loss, heldout.X_P @ theta, heldout.Y_P)})
    return out


@bounded_blas
def norm_ratio_curves(theta: np.ndarray, task: LinearTask, steps: int) -> dict:
    """Figure 1: ‖w_t − w*‖²/‖w_0 − w*‖² of exact-line-search GD probing on D_P and D_H."""
    return {"D_P": gd_exact_line_search(task.X_P @ theta, task.Y_P, steps).norm_ratio,
            "D_H": gd_exact_line_search(task.X_H @ theta, task.Y_H, steps).norm_ratio}


def def31_summary(flags) -> dict:
    """How many runs satisfy Definition 3.1: ``{"count", "runs", "per_seed"}`` (a table prints k/n)."""
    flags = [bool(f) for f in flags]
    return {"count": sum(flags), "runs": len(flags), "per_seed": flags}
