"""R_ill only (docs/theory.md §7): GD on R_ill(H_H) alone, each step within its bound."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycore._batch import GramStack
from pycore._linear_options import LoopOptions
from pycore._loops import Inputs, init_theta, log_row, max_abs
from pycore._optim import check_growth
from pycore._precondition import FactorPreconditioner
from pycore._registry import Method, MethodRun, each_run
from pycore._regularizers import preconditioned_r_ill_step_bound
from pycore._spectral import ProductGramSpectrum, SpectrumError
from pycore._validation import DivergenceError


@dataclass(frozen=True)
class RIllOnlyOptions(LoopOptions):
    """R_ill only (docs/theory.md §7): plain GD with step min(lr·λ_H, safety·bound)."""

    lambda_h: float = 1e10
    precond: str = "pinv"
    ridge: float = 0.0
    safety: float = 0.9

    @property
    def draws_random(self) -> bool:
        """From θ = I it draws nothing: every run is the same run."""
        return self.init != "identity"


def rir_change_tolerance(
    kappas_before: tuple[float, float], kappas_after: tuple[float, float]
) -> float:
    """Relative RIR change two measured RIRs cannot resolve.

    ``max(1e-9, 8·eps·Σ√κ)`` over the four κ's: κ(H) = κ(Z)² from an SVD errs by ≲ 2p·eps·√κ(H), p
    = 4 (LAPACK's growth factor, the QR of X).
    """
    total = sum(np.sqrt(k) for k in (*kappas_before, *kappas_after))
    return max(1e-9, 8.0 * np.finfo(np.float64).eps * float(total))


def r_ill_only(task, o, rngs) -> list[MethodRun]:
    """R_ill only (docs/theory.md §7).

    ``θ ← θ − η_t K_H⁺∇_θR_ill(H_H(θ))`` by GD, no D_P loss or head, ``epochs × ⌈N_P/batch_size⌉``
    steps; RIR falls beyond :func:`rir_change_tolerance` are counted.  From θ = I it draws nothing
    from the generators: every run is the same run.
    """
    if o.init == "identity":
        return each_run(_r_ill_only(task, o, np.eye(task.D)[None])[0], rngs)
    return _r_ill_only(task, o, np.stack([init_theta(task.D, o, rng) for rng in rngs]))


def _r_ill_only(task, o, theta0):
    B, D = theta0.shape[0], task.D
    inp = Inputs.of(task, restrict=o.precond != "exact")
    theta = inp.take(theta0)
    n_batches = 1 if o.batch_size is None else -(-task.X_P.shape[0] // o.batch_size)
    hists = [{"step": [], "kappa_P": [], "kappa_H": [], "rir": [], "eta": []} for _ in range(B)]
    diags = [
        {"steps": 0, "ties_H": 0, "clipped": 0, "rir_decreases": 0, "optimizer": "gd"}
        for _ in range(B)
    ]
    pre_H = FactorPreconditioner(inp.factor_H, o.precond, o.ridge)
    # exact κ's, X factored once
    spec_P, spec_H = ProductGramSpectrum(inp.X_P), ProductGramSpectrum(inp.X_H)
    k0 = [(spec_P(th).kappa, spec_H(th).kappa) for th in theta]
    prev, prev_kappas = [1.0] * B, list(k0)
    for b in range(B):
        log_row(hists[b], 0, *k0[b], 1.0)
    step_max = o.lr * o.lambda_h
    kappas = list(k0)
    start = max_abs(theta)
    for epoch in range(1, o.epochs + 1):
        for _ in range(n_batches):
            try:
                gram = GramStack(inp.factor_H.features(theta), D)
                term = gram.term("ill")
            except SpectrumError as exc:
                raise SpectrumError(
                    f"r_ill_only: epoch {epoch}, step {diags[0]['steps']}: {exc}"
                ) from None
            # Thm 4.3(2)
            eta = np.array(
                [
                    min(step_max, o.safety * preconditioned_r_ill_step_bound(gram.info(b)))
                    for b in range(B)
                ]
            )
            L, R = pre_H.parts(theta, gram, term, eta)
            theta = theta - L @ R
            for b in range(B):
                d, h = diags[b], hists[b]
                d["ties_H"] += bool(gram.tie_min[b])
                d["clipped"] += bool(eta[b] < step_max)
                d["steps"] += 1
                kappas[b] = (spec_P(theta[b]).kappa, spec_H(theta[b]).kappa)
                kP, kH = kappas[b]
                r = (kH / k0[b][1]) / (kP / k0[b][0])
                tol = rir_change_tolerance(prev_kappas[b], kappas[b])
                d["rir_decreases"] += bool(r < prev[b] * (1 - tol))
                prev[b], prev_kappas[b] = r, kappas[b]
                log_row(h, d["steps"], kP, kH, r, float(eta[b]))
        if not np.all(np.isfinite(theta)):
            raise DivergenceError(
                "lambda_h", f"r_ill_only: θ became non-finite at epoch {epoch}; lower lambda_h"
            )
    # its step is lr·λ_h wherever Thm 4.3's bound does not clip it
    check_growth(theta, start, f"r_ill_only: after {o.epochs} epochs")
    theta = inp.put(theta0, theta)
    for b in range(B):
        diags[b]["kappa_end"] = kappas[b]
    why = f"ran the {o.epochs} epochs asked for"
    return [MethodRun(theta[b], None, hists[b], diags[b], why) for b in range(B)]


R_ILL_ONLY = Method(
    "r_ill_only", "R_ill only", RIllOnlyOptions, r_ill_only, (6, 4), in_tables=True
)
