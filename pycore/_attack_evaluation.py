"""The worst case of one θ against θ = I (:func:`attack_evaluation`, docs/findings.md §4)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

import pycore._attacks as A
from pycore._threads import bounded_blas
from pycore._validation import (
    ParameterError,
    check_number,
    check_rng,
    check_theta,
    check_work,
)
from pycore._worst_case import (
    FamilyResult,
    attacker_grid,
    kappa_bounds,
    run_grid,
    worst_case,
)


@dataclass(frozen=True)
class AttackEvaluation:
    """What :func:`attack_evaluation` found.

    Per attacker family (``families``, in grid order) its :class:`FamilyResult` against θ = I, and
    the defender's ``worst`` case (the fastest configuration of any family on θ against the fastest
    on I); ``eps``, the step ``cap`` and the ``n_rows`` of D_H the attacker held; ``loss``, the
    loss D_H was probed with ("mse" or "bce").
    """

    eps: float
    cap: int
    n_rows: int
    families: Mapping[str, FamilyResult] = field(hash=False)
    worst: FamilyResult
    loss: str = "mse"

    def to_dict(self) -> dict:
        return {
            "eps": self.eps,
            "cap": self.cap,
            "n_rows": self.n_rows,
            "families": {f: r.to_dict() for f, r in self.families.items()},
            "worst": self.worst.to_dict(),
            "loss": self.loss,
        }


@bounded_blas
def attack_evaluation(
    theta,
    task,
    *,
    rng: np.random.Generator,
    rows=None,
    eps: float = 1e-4,
    quick: bool = False,
    max_steps: int = 20000,
    ridge_rel: float = 1e-4,
):
    """Judge θ by what its attackers feel.

    Every attacker family probing D_H through θ and through θ = I (docs/findings.md §4).

    Each configuration of :func:`attacker_grid` (GD, momentum, Adam, Adagrad, CG, L-BFGS,
    Jacobi-PCG, whitening, a solve) trains a linear probe on the features ``Xθ`` of D_H, from
    ``w = 0`` to a relative suboptimality ``eps``: least squares, as
    :class:`~pycore.LinearTask` probes D_H, or ridge-logistic when a "bce" task's D_H targets
    are one column of 0/1 labels (MNIST's ink labels); a family counts with its best
    configuration, the defender with the fastest attacker of all.

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The feature extractor under attack.
    task : LinearTask
        Its ``X_H``, ``Y_H`` are the attacker's data.
    rng : numpy.random.Generator
        Draws each "half" whitening's rows, the same for θ and for I.
    rows : index, optional
        The rows of D_H the attacker holds (default all): a slice, indices or a mask.
    eps : float, default 1e-4
        Relative suboptimality ``(L(w) − L*)/(L(0) − L*)`` an attacker must reach, in (0, 1).
    quick : bool, default False
        A few configurations per family instead of the stated grid.
    max_steps : int, default 20000
        Step cap of every configuration (a capped run gives a bound, ``kind`` ">=" or "<=").
    ridge_rel : float, default 1e-4
        The logistic probe's ridge, relative to ‖Z‖₂²/4 (a "bce" task).

    Returns
    -------
    AttackEvaluation
        ``families[f]`` (:class:`FamilyResult`: the best configuration's steps on θ and on I,
        their ``slowdown`` and ``kind``, the κ ``bound``) and the ``worst`` case.

    Raises
    ------
    ParameterError
        θ of another shape than (D, D) (``"theta"``), rows that select nothing of D_H
        (``"rows"``), ``eps`` outside (0, 1), an ``rng`` that is not a Generator.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask, attack_evaluation, immunize
    >>> rng = np.random.default_rng(0)
    >>> X_P = rng.standard_normal((50, 4)) * [1.0, 0.5, 0.2, 0.1]
    >>> X_H = rng.standard_normal((40, 4)) @ rng.standard_normal((4, 4))
    >>> task = LinearTask(X_P, rng.standard_normal(50), X_H, rng.standard_normal(40))
    >>> theta = immunize(task, "closed_form", rng=rng).theta
    >>> ev = attack_evaluation(theta, task, rng=rng, quick=True, max_steps=500)
    >>> ev.worst.slowdown, ev.worst.kind  # an attacker who solves is not slowed at all
    (1.0, '=')
    >>> list(ev.families)
    ['gd', 'heavy_ball', 'nesterov', 'adam', 'adagrad', 'cg', 'lbfgs', 'pcg_jacobi', 'whiten',
     'closed_form']
    """
    check_rng(rng)
    X, Y = task.X_H, task.Y_H
    theta = check_theta(theta, X.shape[1])
    try:
        idx = np.arange(X.shape[0])[slice(None) if rows is None else rows]
    except (IndexError, TypeError, ValueError) as exc:
        raise ParameterError(
            "rows", f"rows must index the {X.shape[0]} rows of D_H: {exc}"
        ) from None
    if idx.ndim != 1 or idx.size == 0:
        raise ParameterError("rows", "rows must select at least one row of D_H")
    X, Y = X[idx], Y[idx]
    check_work(X.shape[1], X.shape[0], 12, 4, "attack_evaluation")
    eps = check_number(eps, "eps", low=0.0, high=1.0, low_open=True, high_open=True)
    labels = task.loss == "bce" and task.Y_H.shape[1] == 1 and np.isin(task.Y_H, (0, 1)).all()
    loss = "bce" if labels else "mse"  # a continuous D_H target: the squared loss
    grid = attacker_grid("bce" if labels else "mse", quick=quick)
    pairs = ((theta, rng), (np.eye(X.shape[1]), copy.deepcopy(rng)))
    run, ref = (
        run_grid(
            A.make_problem(X @ t, Y, loss, ridge_rel=ridge_rel),
            grid,
            eps=(eps,),
            max_steps=max_steps,
            rng=g,
        )
        for t, g in pairs
    )
    bounds = kappa_bounds(run.kappa, ref.kappa)

    def best(fams, family=None):  # worst_case over the given families, with its bound
        w = worst_case(run, ref, eps, fams)
        family = family or w.family
        return dataclasses.replace(w, family=family, bound=bounds.get(family))

    families = {f: best([f], f) for f in dict.fromkeys(c.family for c in grid)}
    return AttackEvaluation(
        eps=eps,
        cap=max_steps,
        n_rows=X.shape[0],
        families=MappingProxyType(families),
        worst=best(None),
        loss=loss,
    )
