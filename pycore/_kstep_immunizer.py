"""The k-step immunizer (docs/theory.md §11): the adaptive rule on a GD probe's k-step ratios."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import pycore._losses as losses
from pycore._adaptive import AdaptiveSettings, adaptive_descent
from pycore._kstep import DEFAULT_STEPS, KStepProbe
from pycore._linear_options import LinearOptions
from pycore._registry import Method, MethodRun, each_run
from pycore._spectral import SpectrumError
from pycore._validation import ParameterError

# the k-step immunizer's directions: the θ-gradient, or K⁺ times it (pycore.linalg.KStepProbe)
KSTEP_PRECONDITIONERS = ("none", "pinv")


@dataclass(frozen=True)
class KStepOptions(LinearOptions):
    """The k-step immunizer (docs/theory.md §11).

    The adaptive rule on the k-step ratios of a GD probe of ``steps`` steps (the deep demo's
    GD-probe epoch), with a bias column when ``bias``; ``lr``, ``epochs``, ``patience`` as for the
    adaptive "ours". ``precond``: the θ-gradients as they are ("none", the default: Adam scales
    each entry itself) or K⁺-preconditioned ("pinv", Algorithm 1's; docs/findings.md §2 measures
    both).
    """

    steps: int = DEFAULT_STEPS
    lr: float = 0.03
    epochs: int = 5000
    patience: int = 300
    bias: bool = False
    precond: str = "none"

    def __post_init__(self):
        super().__post_init__()
        if self.precond not in KSTEP_PRECONDITIONERS:
            raise ParameterError(
                "precond",
                f"kstep's precond must be one of {KSTEP_PRECONDITIONERS}, got {self.precond!r}",
            )

    @property
    def draws_random(self) -> bool:
        """It runs from θ = I on every row: it draws nothing."""
        return False


class _KStepProblem:
    """The k-step objective of a task for :func:`pycore._adaptive.adaptive_descent`.

    docs/theory.md §11: ``(ln (i)_k, ln (ii)_k)`` with (i)_k = E_k,H(θ)/E_k,H(I) and (ii)_k =
    E_k,P(θ)/E_k,P(I), and the θ-gradients of ``ln E_k,P`` (descent lowers it) and of
    ``−ln E_k,H`` (descent raises E_k,H), plain (``precond`` "none") or K⁺-preconditioned
    ("pinv"). One SVD per task and θ serves both callables; a λ_max tie (docs/theory.md §3) is
    counted, not warned.
    """

    def __init__(self, task, o):
        probes = []
        for name, X, Y, f in (
            ("Y_P", task.X_P, task.Y_P, task.factor_P),
            ("Y_H", task.X_H, task.Y_H, task.factor_H),
        ):
            try:
                probes.append(KStepProbe(X, Y, steps=o.steps, bias=o.bias, factor=f))
            except ParameterError as exc:  # the task's own name for the targets
                raise ParameterError(name, f"{task.name}: {name}: {exc}") from None
        self.probes, self.precond = tuple(probes), o.precond
        self._at, self._out = None, None
        self.ties = {"ties_P": 0, "ties_H": 0}
        eye = np.eye(task.D)
        self.reference = tuple(p.remaining(eye).remaining for p in self.probes)  # (P, H)

    def _evaluate(self, theta):
        if self._at is not theta:
            try:
                out = tuple(p.evaluate(theta) for p in self.probes)
            except SpectrumError as exc:  # θ collapsed a task's features
                out = exc
            else:
                for key, (info, _) in zip(self.ties, out):
                    self.ties[key] += info.tie_max
            self._at, self._out = theta, out
        return self._out

    def log_ratios(self, theta):
        out = self._evaluate(theta)
        if isinstance(out, SpectrumError):
            return np.nan, np.nan
        (eP, _), (eH, _) = out
        with np.errstate(divide="ignore"):  # E_k = 0: the probe is done in k steps, ln = −∞
            return (
                float(np.log(eH.remaining / self.reference[1])),
                float(np.log(eP.remaining / self.reference[0])),
            )

    def ratios(self, theta) -> tuple[float, float]:
        """((i)_k, (ii)_k) at θ."""
        eP, eH = (p.remaining(theta).remaining for p in self.probes)
        return eH / self.reference[1], eP / self.reference[0]

    def directions(self, theta):
        out = self._evaluate(theta)
        if isinstance(out, SpectrumError):
            raise out
        (_, gP), (_, gH) = out
        # ∇ln E = ∇E/E: the same direction, and the rule takes unit directions
        pre = self.precond == "pinv"
        return (
            self.probes[0].from_features(gP, precondition=pre),
            -self.probes[1].from_features(gH, precondition=pre),
        )


def kstep(task, o, rngs) -> list[MethodRun]:
    """The k-step immunizer (docs/theory.md §11).

    The adaptive rule of :func:`pycore._adaptive.adaptive_descent` from θ = I on the k-step ratios
    (i)_k = E_k,H(θ)/ E_k,H(I) (raised) and (ii)_k = E_k,P(θ)/E_k,P(I) (lowered), on the
    θ-gradients of ``−ln E_k,H`` and ``ln E_k,P`` (``o.precond``: "none", or K⁺ as Algorithm 1's);
    D_P's head solved exactly at the end (Definition 3.1(c)). It draws nothing from the generators:
    the runs are one run.
    """
    problem = _KStepProblem(task, o)
    theta = np.eye(task.D)
    ref_P, ref_H = problem.reference
    if not (ref_P > 0 and ref_H > 0):
        which = "D_P" if not ref_P > 0 else "D_H"
        stop = (
            f"no step taken: {which}'s GD probe is done in {o.steps} steps at θ = I (E_k = 0), "
            "so its k-step ratio is undefined"
        )
        hist, run = {}, None
    else:
        run = adaptive_descent(
            theta,
            problem.log_ratios,
            problem.directions,
            AdaptiveSettings(lr=o.lr, epochs=o.epochs, patience=o.patience),
        )
        theta, hist = run.theta, run.history
        hist = {
            "step": hist["step"],
            "kstep_harmful_ratio": hist["harmful_ratio"],
            "kstep_pretrain_ratio": hist["pretrain_ratio"],
            "weight_h": hist["weight_h"],
        }
    i_k, ii_k = problem.ratios(theta) if run is not None else (1.0, 1.0)
    if run is not None:
        stop = run.stop + (
            f"; best margin at step {run.best_step}" if run.margin > 0 else "; no step helped"
        )
    stop += f"; k-step ratios (k = {o.steps}): (i)_k = {i_k:.4g}, (ii)_k = {ii_k:.4g}"
    omega, bias = losses.best_head(task.loss, task.X_P @ theta, task.Y_P)
    diag = {
        "steps": 0 if run is None else run.steps,
        "best_step": 0 if run is None else run.best_step,
        "restarts": 0 if run is None else run.restarts,
        "stop": stop,
        "kstep_harmful_ratio": i_k,
        "kstep_pretrain_ratio": ii_k,
        "kstep_reference": {"P": ref_P, "H": ref_H},
        **problem.ties,
        "bias": None if bias is None else bias.tolist(),
    }
    return each_run(MethodRun(theta, omega, hist, diag, stop), rngs)


KSTEP = Method("kstep", "k-step (docs/theory.md §11)", KStepOptions, kstep, work=(18, 5))
