"""The closed form (docs/theory.md §10): the θ that attains the range-restricted RIR ceiling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycore._linear_options import LinearOptions
from pycore._metrics import def31_exponent_window, rir_ceiling
from pycore._registry import Method, MethodRun, each_run
from pycore._tasks import LinearTask
from pycore._validation import DivergenceError


@dataclass(frozen=True)
class ClosedFormOptions(LinearOptions):
    """Exponent a of s² = λ_C^a (docs/theory.md §10).

    A number, or "auto" (:func:`auto_exponent`).
    """

    exponent: float | str = "auto"

    @property
    def draws_random(self) -> bool:
        return False


def closed_form(task, exponent: float, ceiling):
    """θ = [U_r Λ_r^{-½} Q_C diag(s), 0], s² = λ_C^a (docs/theory.md §10).

    RIR = the range-restricted ``ceiling`` for a ≥ 0.  The zero null(K_P) columns keep D_P's best
    loss (Definition 3.1(c)); C's null space keeps s = 1 (θ injective on range(K_P)).
    """
    lam = ceiling.lambda_C
    s = np.ones_like(lam)
    pos = np.arange(lam.size) < ceiling.rank_C
    with np.errstate(over="ignore"):  # overflow is checked on θ below
        s[pos] = lam[pos] ** (exponent / 2)
    theta = np.zeros((task.D, task.D))
    r = ceiling.basis.shape[1]
    theta[:, :r] = ceiling.basis * s
    if not np.all(np.isfinite(theta)):
        raise DivergenceError(
            "exponent",
            f"closed_form: λ_C^(a/2) overflows float64 at exponent a = {exponent:g} "
            f"(κ(C) = {ceiling.kappa_C:.3e})",
        )
    return theta, {
        "exponent": exponent,
        "ceiling_range_restricted": ceiling.range_restricted,
        "ceiling_exact": ceiling.exact,
        "rank_K_P": ceiling.rank_K_P,
        "null_columns_zeroed": task.D - r,
    }


def auto_exponent(task: LinearTask, ceiling=None) -> tuple[float, str]:
    """The closed form's default exponent, and why.

    The balanced exponent of the Definition 3.1 window ((i) = 1/(ii) = √ceiling) clamped into it,
    or 0 (H_P = I) when Definition 3.1 is out of reach of the closed form.

    Parameters
    ----------
    task : LinearTask
        The task the closed form immunizes.
    ceiling : Ceiling, optional
        ``rir_ceiling(task.X_P, task.X_H)`` when already computed.

    Returns
    -------
    exponent : float
        The exponent a of ``s² = λ_C^a`` (docs/theory.md §10).
    reason : str
        Why this exponent: the window it lies in, or why Definition 3.1 is not attainable.
    """
    ceiling = ceiling if ceiling is not None else rir_ceiling(task.X_P, task.X_H)
    no = "exponent 0: Definition 3.1 is not attainable by the closed form"
    if not ceiling.kappa_C > 1 + 1e-8:  # 1e-8: far above κ(C)'s round-off at 1 (~p·eps)
        return (
            0.0,
            f"{no}, κ(C) = {ceiling.kappa_C:.6g} ≈ 1 (every exponent gives the same spectra)",
        )
    w = def31_exponent_window(ceiling)
    if w.empty:
        return 0.0, (
            f"{no}, its window [{w.low:.4g}, {w.high:.4g}) is empty (range-restricted ceiling "
            f"{ceiling.range_restricted:.4g} ≤ 1)"
        )
    a = min(max(w.balanced, w.low), w.high)
    spread = float(np.max(np.abs(np.log(ceiling.lambda_C[: ceiling.rank_C]))))
    if abs(a) * spread / 2 > 300:  # s = λ_C^(a/2) beyond 1e±130: θ is no longer representable
        return 0.0, (
            f"{no} in float64, its balanced exponent {a:.4g} scales θ's columns past 1e130 "
            f"(κ(C) = {ceiling.kappa_C:.6g} is too close to 1)"
        )
    return a, (
        f"exponent {a:.4g}: the balanced exponent of the Definition 3.1 window "
        f"[{w.low:.4g}, {w.high:.4g})" + (", clamped at 0" if a != w.balanced else "")
    )


def _closed_form_run(task, o, rngs) -> list[MethodRun]:
    """The closed form at the options' exponent, or at :func:`auto_exponent`'s: no draw."""
    ceiling = rir_ceiling(task.X_P, task.X_H)
    if o.exponent == "auto":
        a, why = auto_exponent(task, ceiling)
    else:
        a, why = float(o.exponent), f"exponent {float(o.exponent):.4g} as given"
    theta, diag = closed_form(task, a, ceiling)
    return each_run(MethodRun(theta, None, {}, diag, why), rngs)


CLOSED_FORM = Method(
    "closed_form",
    "Closed form (docs/theory.md §10)",
    ClosedFormOptions,
    _closed_form_run,
    work=(2, 3),
    in_tables=True,
)
