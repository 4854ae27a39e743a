"""Per-run evaluation of an immunized linear extractor (docs/theory.md §8, §10).

Everything a table needs; what does not depend on θ is computed once per task pair
(:class:`EvaluationReference`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pycore._losses import best_probe_loss
from pycore._metrics import RIR, Ceiling, rir_ceiling, row_space_basis
from pycore._probe import gd_exact_line_search
from pycore._spectral import EPS, gram_spectrum
from pycore._tasks import LinearTask
from pycore._threads import bounded_blas
from pycore._validation import ParameterError, check_theta, check_work


def immunized_def31(harmful_ratio: float, pretrain_ratio: float) -> bool:
    """Definition 3.1 (docs/theory.md §8): (i) > 1 AND (ii) < 1 (RIR alone cannot decide it).

    Parameters
    ----------
    harmful_ratio : float
        (i) = κ(H_H(θ))/κ(H_H(I)).
    pretrain_ratio : float
        (ii) = κ(H_P(θ))/κ(H_P(I)).

    Returns
    -------
    bool
        Whether θ immunizes: False when either ratio is NaN.

    Examples
    --------
    >>> from pycore import immunized_def31
    >>> immunized_def31(2.0, 0.5), immunized_def31(2.0, 1.5), immunized_def31(2.0, float("nan"))
    (True, False, False)
    """
    return bool(harmful_ratio > 1.0 and pretrain_ratio < 1.0)


def chance_accuracy(labels) -> float:
    """The top-1 (%) of a classifier that learned nothing.

    The share of the most frequent label: an imbalanced task's constant predictor scores it, not
    100/classes.

    Parameters
    ----------
    labels : array_like
        The labels of the rows scored (any shape; flattened).

    Returns
    -------
    float
        The accuracy in percent of always answering the most frequent label.
    """
    y = np.asarray(labels).reshape(-1)
    return 100.0 * float(np.unique(y, return_counts=True)[1].max()) / y.size


def near_chance(top1: float, chance: float) -> bool:
    """Whether a top-1 accuracy is near chance.

    Near means below ``min(1.5·chance, (chance + 100)/2)``: a model that scores there has barely
    learned its task, so no immunization of it means anything.

    Parameters
    ----------
    top1 : float
        The accuracy (%) measured.
    chance : float
        The accuracy (%) of :func:`chance_accuracy` on the same rows.

    Returns
    -------
    bool
        True when ``top1`` is near ``chance``.

    Examples
    --------
    >>> from pycore import near_chance
    >>> near_chance(55.0, 50.0), near_chance(90.0, 50.0)  # the bar is 75 % here
    (True, False)
    """
    return bool(top1 < min(1.5 * chance, 0.5 * (chance + 100.0)))


class _Rows:
    """One input matrix X with what every θ reuses.

    The spectrum of XᵀX and ``XV``, V of range(K_P).
    """

    def __init__(self, X: np.ndarray, V: np.ndarray):
        self.X = X
        self.ref = gram_spectrum(X, vectors=False)
        self.XV = X @ V
        self.X_range = X - self.XV @ V.T  # X P_N
        self.X_null = self.XV @ V.T  # X P_R


class EvaluationReference:
    """What the evaluation of any θ on ``train`` (and ``heldout``) shares.

    P_R = VVᵀ projects onto range(K_P) of D_P's TRAINING rows (docs/theory.md §8); with T = Vᵀθ the
    parts' features are ``X θ_range = X P_N + (XV)T`` and ``X θ_null = X P_R + Xθ − (XV)T``: no D³
    products.
    """

    @bounded_blas  # built once in an experiment's main process, before its workers
    def __init__(self, train: LinearTask, heldout: LinearTask | None = None):
        for name, t in (("train", train), ("heldout", heldout)):
            if t is not None and not isinstance(t, LinearTask):
                raise ParameterError(
                    name, f"{name} must be a pycore.LinearTask, got {type(t).__name__}"
                )
        if heldout is not None and heldout.D != train.D:
            raise ParameterError(
                "heldout",
                f"the held-out task has {heldout.D} input columns but the "
                f"training task {train.D}: θ acts on one input space",
            )
        rows = sum(t.X_P.shape[0] + t.X_H.shape[0] for t in (train, heldout) if t is not None)
        check_work(train.D, rows, 4, 7, "evaluate_linear")
        self.train, self.heldout = train, heldout
        self.V = row_space_basis(train.X_P)
        self.rows = {
            (rows, k): _Rows(getattr(t, "X_" + k), self.V)
            for rows, t in (("train", train), ("heldout", heldout))
            if t is not None
            for k in "PH"
        }
        self._dp_loss_before: dict = {}

    def dp_loss_before(self, rows: str = "train") -> float:  # at θ = I, on first use
        """D_P's best loss at θ = I on ``rows`` ("train" or "heldout"), computed on first use."""
        if rows not in self._dp_loss_before:
            t = self.train if rows == "train" else self.heldout
            self._dp_loss_before[rows] = best_probe_loss(t.loss, t.X_P, t.Y_P)
        return self._dp_loss_before[rows]

    def features(self, theta: np.ndarray, rows: str = "train") -> dict:
        """The features of θ and of its range and null parts on a set of rows.

        ``{(part, task): X·θ_part}`` on ``rows``, part in ("theta", "range", "null"),
        task "P"/"H".
        """
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
        """:func:`pycore.rir` of the features ``Z_P = X_Pθ``, ``Z_H = X_Hθ``."""
        return RIR.of(
            gram_spectrum(Z_P, vectors=False),
            gram_spectrum(Z_H, vectors=False),
            self.rows[(rows, "P")].ref,
            self.rows[(rows, "H")].ref,
        )

    def null_part_fraction(self, theta: np.ndarray) -> float:
        """‖P_N(θ − I)‖_F²/‖θ − I‖_F² ∈ [0, 1], the share of θ's change D_P never sees.

        NaN at θ = I.
        """
        M = theta - np.eye(theta.shape[0])
        total = float(np.sum(M**2))
        if not total > 0:
            return float("nan")
        N = M - self.V @ (self.V.T @ M)
        return float(np.sum(N**2)) / total


@dataclass(frozen=True)
class SplitEvaluation:
    """The numbers of one θ on one set of rows (the training rows, or the held-out ones).

    Attributes
    ----------
    rir, harmful_ratio, pretrain_ratio : float
        RIR = (i)/(ii) with (i) = κ(H_H(θ))/κ(H_H(I)) and (ii) = κ(H_P(θ))/κ(H_P(I)) on these rows
        (docs/theory.md §8).
    immunized : bool
        Definition 3.1 on these rows: (i) > 1 and (ii) < 1 (:func:`immunized_def31`).
    kappa_H, kappa_P : float
        κ(H_H(θ)) and κ(H_P(θ)), over the nonzero spectrum.
    rank_H, rank_P : int
        The numerical ranks of the features ``X_Hθ`` and ``X_Pθ``.
    rir_range_part, rir_null_part : float
        The RIR of θ_range = P_N + P_Rθ (what D_P's training rows see) and of θ_null = P_R + P_Nθ,
        P_R the projector onto range(K_P) of the TRAINING rows.
    dp_loss_before, dp_loss_after : float
        The best D_P loss of a linear head on ``X_P`` (θ = I) and on ``X_Pθ``: Definition 3.1(c)
        asks them equal.
    """

    rir: float
    harmful_ratio: float
    pretrain_ratio: float
    immunized: bool
    kappa_H: float
    kappa_P: float
    rank_H: int
    rank_P: int
    rir_range_part: float
    rir_null_part: float
    dp_loss_before: float
    dp_loss_after: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class LinearEvaluation:
    """What :func:`evaluate_linear` measures of one θ.

    The numbers on the training rows (``train``) and on the held-out rows (``heldout``, None
    without a held-out task), the ``fraction_of_ceiling`` (training RIR / the range-restricted
    ceiling, docs/theory.md §10) and the ``null_part_fraction`` ‖P_N(θ − I)‖_F²/‖θ − I‖_F² (NaN at
    θ = I).
    """

    train: SplitEvaluation
    heldout: SplitEvaluation | None
    fraction_of_ceiling: float
    null_part_fraction: float

    def to_dict(self) -> dict:
        return {
            "train": self.train.to_dict(),
            "heldout": None if self.heldout is None else self.heldout.to_dict(),
            "fraction_of_ceiling": self.fraction_of_ceiling,
            "null_part_fraction": self.null_part_fraction,
        }


@bounded_blas
def evaluate_linear(
    theta: np.ndarray,
    train: LinearTask,
    heldout: LinearTask | None = None,
    *,
    ceiling: Ceiling | None = None,
    reference: EvaluationReference | None = None,
) -> LinearEvaluation:
    """Every number a table row needs of a linear extractor θ (docs/theory.md §8, §10).

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The feature extractor; features are ``Xθ``.
    train : LinearTask
        The task θ was immunized on: its rows give (i), (ii), RIR, Definition 3.1 and the
        range/null projectors.
    heldout : LinearTask, optional
        Rows of the same tasks not used for training (same width D), evaluated alike.
    ceiling : Ceiling, optional
        :func:`pycore.rir_ceiling` of ``train`` (computed when not given; one of other
        data is refused).
    reference : EvaluationReference, optional
        What every θ of these tasks shares, computed once (an experiment evaluating many θ's
        passes it); it must have been built for ``train`` and ``heldout``.

    Returns
    -------
    LinearEvaluation
        ``.train`` and ``.heldout`` (:class:`SplitEvaluation`: RIR, (i), (ii), Definition 3.1,
        the κ's and ranks, the RIR of the range and null parts, the best D_P loss before and
        after), ``.fraction_of_ceiling`` and ``.null_part_fraction``.

    Raises
    ------
    ParameterError
        A held-out task of another width (``"heldout"``), a ceiling computed on other rows
        (``"ceiling"``), a reference built for other tasks (``"reference"``), or a task that is
        not a :class:`~pycore.LinearTask`.
    ValueError
        θ not D×D, or not finite.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore import LinearTask, evaluate_linear
    >>> rng = np.random.default_rng(0)
    >>> X_P = rng.standard_normal((40, 3)) * [1.0, 0.5, 0.1]
    >>> X_H = rng.standard_normal((30, 3))
    >>> task = LinearTask(X_P, rng.standard_normal(40), X_H, rng.standard_normal(30))
    >>> ev = evaluate_linear(np.eye(3), task)  # θ = I is the reference: every ratio is 1
    >>> ev.train.rir, ev.train.immunized, ev.heldout
    (1.0, False, None)
    >>> theta = np.diag([1.0, 2.0, 10.0])  # whitens D_P: (ii) < 1
    >>> ev = evaluate_linear(theta, task)
    >>> bool(ev.train.pretrain_ratio < 1)
    True
    >>> round(ev.train.dp_loss_after / ev.train.dp_loss_before, 9)  # Definition 3.1(c)
    1.0
    """
    if reference is not None and (
        reference.train is not train or reference.heldout is not heldout
    ):
        raise ParameterError(
            "reference",
            "reference was built for other tasks: pass "
            "EvaluationReference(train, heldout) of these tasks",
        )
    ref = reference if reference is not None else EvaluationReference(train, heldout)
    if ceiling is None:
        ceiling = rir_ceiling(train.X_P, train.X_H)
    for mine, task in ((ceiling.kappa_K_P, "P"), (ceiling.kappa_K_H, "H")):
        # κ(K) = κ(X)² from two SVDs of the same rows agree to 2p·eps·√κ(K) relative (×2 margin)
        rows = ref.rows[("train", task)]
        k = rows.ref.kappa
        if not abs(mine - k) <= max(1e-9, 4 * min(rows.X.shape) * EPS * np.sqrt(max(mine, k))) * k:
            raise ParameterError(
                "ceiling",
                f"ceiling was computed on other data: its κ(K_{task}) = "
                f"{mine:.6g}, the training rows' {k:.6g}",
            )
    theta = check_theta(theta, train.D)
    splits = {}
    for rows, t in (("train", train), ("heldout", heldout)):
        if t is None:
            continue
        f = ref.features(theta, rows)
        r = ref.rir(f[("theta", "P")], f[("theta", "H")], rows)
        splits[rows] = SplitEvaluation(
            rir=r.value,
            harmful_ratio=r.harmful_ratio,
            pretrain_ratio=r.pretrain_ratio,
            immunized=immunized_def31(r.harmful_ratio, r.pretrain_ratio),
            kappa_H=r.kappa_H,
            kappa_P=r.kappa_P,
            rank_H=r.rank_H,
            rank_P=r.rank_P,
            rir_range_part=ref.rir(f[("range", "P")], f[("range", "H")], rows).value,
            rir_null_part=ref.rir(f[("null", "P")], f[("null", "H")], rows).value,
            dp_loss_before=ref.dp_loss_before(rows),
            dp_loss_after=best_probe_loss(t.loss, f[("theta", "P")], t.Y_P),
        )
    return LinearEvaluation(
        train=splits["train"],
        heldout=splits.get("heldout"),
        fraction_of_ceiling=splits["train"].rir / ceiling.range_restricted,
        null_part_fraction=ref.null_part_fraction(theta),
    )


@bounded_blas
def norm_ratio_curves(theta: np.ndarray, task: LinearTask, steps: int) -> dict:
    """Figure 1: the distance to the optimum of exact-line-search GD probing on D_P and D_H.

    Parameters
    ----------
    theta : ndarray, shape (D, D)
        The feature extractor; the probes fit heads on ``X_Pθ`` and ``X_Hθ``.
    task : LinearTask
        The task whose rows and targets are probed.
    steps : int
        GD steps from w₀ = 0, in [0, :data:`pycore._probe.MAX_PROBE_STEPS`].

    Returns
    -------
    dict
        ``{"D_P": curve, "D_H": curve}``, each an array of ``steps + 1`` ratios
        ‖w_t − w*‖²/‖w_0 − w*‖² (:func:`pycore._probe.gd_exact_line_search`).

    Raises
    ------
    ParameterError
        ``steps`` out of its bounds.
    """
    return {
        "D_P": gd_exact_line_search(task.X_P @ theta, task.Y_P, steps).norm_ratio,
        "D_H": gd_exact_line_search(task.X_H @ theta, task.Y_H, steps).norm_ratio,
    }
