"""Per-run evaluation of an immunized linear extractor (SPEC §8, §10): everything a table needs."""
from __future__ import annotations

import numpy as np

from pycore.losses import best_probe_loss
from pycore.metrics import Ceiling, rir
from pycore.probe import gd_exact_line_search
from pycore.tasks import LinearTask
from pycore.threads import bounded_blas


@bounded_blas
def evaluate_linear(theta: np.ndarray, train: LinearTask, heldout: LinearTask | None,
                    ceiling: Ceiling) -> dict:
    """RIR and factors on training rows, held-out RIR, fraction of the range-restricted ceiling,
    and the best D_P / D_H probing loss with θ vs with I (Definition 3.1(c))."""
    r = rir(theta, train.X_P, train.X_H)
    out = {
        "rir": r.value, "harmful_ratio": r.harmful_ratio, "pretrain_ratio": r.pretrain_ratio,
        "kappa_H": r.kappa_H, "kappa_P": r.kappa_P, "rank_H": r.rank_H, "rank_P": r.rank_P,
        "fraction_of_ceiling": r.value / ceiling.range_restricted,
        # Def. 3.1(c): best D_P loss of a linear head on the features, before (θ = I) and after.
        "dp_loss_before": best_probe_loss(train.loss, train.X_P, train.Y_P),
        "dp_loss_after": best_probe_loss(train.loss, train.X_P @ theta, train.Y_P),
    }
    if heldout is not None:
        h = rir(theta, heldout.X_P, heldout.X_H)
        out.update({"heldout_rir": h.value, "heldout_harmful_ratio": h.harmful_ratio,
                    "heldout_pretrain_ratio": h.pretrain_ratio,
                    "heldout_dp_loss_before": best_probe_loss(heldout.loss, heldout.X_P, heldout.Y_P),
                    "heldout_dp_loss_after": best_probe_loss(heldout.loss, heldout.X_P @ theta, heldout.Y_P)})
    return out


@bounded_blas
def norm_ratio_curves(theta: np.ndarray, task: LinearTask, steps: int) -> dict:
    """Figure 1: ‖w_t − w*‖²/‖w_0 − w*‖² of exact-line-search GD probing on D_P and D_H."""
    return {"D_P": gd_exact_line_search(task.X_P @ theta, task.Y_P, steps).norm_ratio,
            "D_H": gd_exact_line_search(task.X_H @ theta, task.Y_H, steps).norm_ratio}
