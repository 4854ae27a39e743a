"""Algorithm 1 (docs/theory.md §6): the adaptive default, the fixed-λ loop, its certified mode.

The fixed-λ loop (:func:`fixed_lambda_loop`) is also Opt κ's (:mod:`pycore._opt_kappa`): the two
differ only in the θ-gradient terms added to the D_P loss's, an object with the interface of
:class:`RegularizerTerms`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

import pycore._losses as losses
from pycore._adaptive import (
    AdaptiveSettings,
    adaptive_descent,
    kappa_log_ratios,
    regularizer_directions,
)
from pycore._linear_options import AdamOptions
from pycore._loops import (
    Inputs,
    epoch_steps,
    exact_kappas,
    gram_stacks,
    init_head,
    init_theta,
    input_norm,
    log_row,
    logits,
    loss_parts,
    max_abs,
    sum_of_products,
)
from pycore._metrics import def31_exponent_window, rir_ceiling
from pycore._optim import check_growth, check_scale, make_optimizer
from pycore._precondition import FactorPreconditioner, Preconditioner
from pycore._registry import Method, MethodRun, each_run
from pycore._regularizers import (
    hessian_regularizer,
    preconditioned_r_ill_step_bound,
    preconditioned_r_well_step_bound,
)
from pycore._spectral import SpectrumError, gram_spectrum
from pycore._validation import ParameterError


@dataclass(frozen=True)
class OursOptions(AdamOptions):
    """Algorithm 1 (docs/theory.md §6).

    Both λ's "auto" (default) is the adaptive rule (docs/design.md §4); numbers give the paper's
    fixed-λ loop (``PRESETS``).
    """

    lambda_p: float | str = "auto"  # λ_P, weight of R_well(H_P); the paper's: 100
    # λ_H, weight of R_ill(H_H); the paper's 1e7 leaves R_ill inert under Adam
    lambda_h: float | str = "auto"
    precond: str = "pinv"  # K⁺ (K is singular on real data, docs/theory.md §5)
    ridge: float = 0.0  # λ of precond "ridge", (K + λI)⁻¹
    patience: int = 300  # "auto": steps without progress before lr/3 (twice), then stop
    lr: float = 0.03
    epochs: int | None = None  # None: 5000 (a budget) with "auto" λ's, 100 with numbers

    def __post_init__(self):
        if self.epochs is None:
            object.__setattr__(self, "epochs", 5000 if self.lambda_p == "auto" else 100)
        super().__post_init__()
        auto = [name for name in ("lambda_p", "lambda_h") if getattr(self, name) == "auto"]
        if len(auto) == 1:
            # named: the λ that was set to a number (both default to "auto", so it is the one a
            # caller gave), not the one left at its default
            given = "lambda_h" if auto[0] == "lambda_p" else "lambda_p"
            raise ParameterError(
                given,
                f"{given} = {getattr(self, given)!r} picks the fixed-λ loop, which needs "
                f"{auto[0]} as a number too (it is 'auto', the adaptive default's setting of "
                "both λ's)",
            )
        if auto and (self.optimizer != "adam" or self.init != "identity"):
            bad = "optimizer" if self.optimizer != "adam" else "init"
            raise ParameterError(
                bad,
                f"the adaptive default (both λ's 'auto') runs Adam from θ = I; "
                f"{bad} = {getattr(self, bad)!r} needs numbers for both λ's",
            )

    @property
    def auto(self) -> bool:
        """Whether the λ's are "auto": the adaptive rule."""
        return self.lambda_p == "auto"

    @property
    def draws_random(self) -> bool:
        """The adaptive rule runs from θ = I on every row: it draws nothing."""
        return not self.auto


@dataclass(frozen=True)
class CertifiedOptions(OursOptions):
    """:func:`immunize_certified`: ``safety`` is the fraction of each §5 step bound taken."""

    safety: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        if self.auto:
            raise ParameterError(
                "lambda_p",
                "certified mode needs numbers for lambda_p and lambda_h "
                "(preset='house_price' gives the table's)",
            )
        if self.precond not in ("exact", "pinv"):
            raise ParameterError(
                "precond",
                "certified mode needs precond 'exact' or 'pinv' "
                "(the bounds of docs/theory.md §5 are for K⁻¹/K⁺)",
            )


class RegularizerTerms:
    """Algorithm 1's θ-gradient terms beside the D_P loss's: the preconditioned regularizers.

    ``λ_H K_H⁺∇_θR_ill(H_H)`` and ``λ_P K_P⁺∇_θR_well(H_P)`` as low-rank factors (the K⁺, ridge
    or K⁻¹ preconditioner of ``o.precond``). In certified mode (options with ``safety``) none of
    them joins the Adam step: each is applied after it, clipped to ``safety`` × its bound of
    docs/theory.md §5, and κ is checked (:meth:`certified_steps`).

    The interface the fixed-λ loop calls: ``restrict(o)`` (a class method: whether the loop may
    step θ's live rows only), the constructor ``(task, inp, o, theta0, diags)``, ``certified``,
    ``parts(theta, gram_P, gram_H, where)`` → ``(factor pairs, the option each term blames)``,
    ``certified_steps(theta)`` and ``finish(diags)``.
    """

    @staticmethod
    def restrict(o) -> bool:
        return not _is_certified(o) and o.precond != "exact"

    def __init__(self, task, inp, o, theta0, diags):
        self.task, self.o = task, o
        self.certified = _is_certified(o)
        self.pre_P = FactorPreconditioner(inp.factor_P, o.precond, o.ridge)
        self.pre_H = FactorPreconditioner(inp.factor_H, o.precond, o.ridge)
        if self.certified:  # the certified steps check κ on the D×D path, one run at a time
            self.cpre_P = Preconditioner(task.K_P, o.precond, o.ridge, task.X_P)
            self.cpre_H = Preconditioner(task.K_H, o.precond, o.ridge, task.X_H)
            self.certs = [dict.fromkeys(_CERTIFIED_COUNTS, 0) for _ in diags]

    def parts(self, theta, gram_P, gram_H, where):
        try:
            term_P, term_H = gram_P.term("well"), gram_H.term("ill")
        except SpectrumError as exc:
            raise SpectrumError(f"{where}: {exc}") from None
        if self.certified:
            return [], ()
        o = self.o
        parts, names = [self.pre_H.parts(theta, gram_H, term_H, o.lambda_h)], ("lambda_h",)
        if o.lambda_p:
            parts.append(self.pre_P.parts(theta, gram_P, term_P, o.lambda_p))
            names += ("lambda_p",)
        return parts, names

    def certified_steps(self, theta):
        """Each run's regularizer steps within their bounds (:func:`_certified_steps`)."""
        return np.stack(
            [
                _certified_steps(th, self.task, self.o, self.cpre_P, self.cpre_H, c)
                for th, c in zip(theta, self.certs)
            ]
        )

    def finish(self, diags):
        if self.certified:
            for d, c in zip(diags, self.certs):
                d["certified"] = c


_CERTIFIED_COUNTS = (
    "violations_P",
    "violations_H",
    "clipped_P",
    "clipped_H",
    "skipped_P",
    "skipped_H",
    "checked",
)


def _is_certified(o) -> bool:
    return getattr(o, "safety", None) is not None


def _blame(parts, names):
    """The step's θ-gradient terms by the option to lower (only if a step diverges)."""
    out: dict = {}
    for name, (L, R) in zip(names, parts):
        out[name] = out.get(name, 0.0) + L @ R
    return out


def _record(hists, inp, theta, epoch, loss, grams=None):
    """One history row per run: κ's from the step's spectra, or exact (by SVD) at the ends."""
    for b, hist in enumerate(hists):
        kP, kH = (
            exact_kappas(inp, theta[b])
            if grams is None
            else (float(grams[0].kappa[b]), float(grams[1].kappa[b]))
        )
        log_row(hist, epoch, float(loss[b]), kP, kH)


def _start(task, o, rngs, restrict):
    """θ₀, the inputs the loop steps on and its first θ rows, ω and bias, each run's own draws."""
    theta0 = np.stack([init_theta(task.D, o, rng) for rng in rngs])
    inp = Inputs.of(task, restrict=restrict)
    heads = [init_head(task, rng) for rng in rngs]
    omega, bias = np.stack([h[0] for h in heads]), np.stack([h[1] for h in heads])
    return theta0, inp, inp.take(theta0), omega, bias


def fixed_lambda_loop(task, method, o, rngs, terms_of=RegularizerTerms):
    """Algorithm 1 with fixed λ's (certified when ``o`` has ``safety``), or Opt κ.

    One loop for a stack of runs; ω and θ step from gradients at the same point. ``terms_of``
    gives the θ-gradient terms beside the D_P loss's (:class:`RegularizerTerms`, or Opt κ's
    ``λ_κ(w_Pκ(H_P) − w_Hκ(H_H))``); every term is a low-rank product, all summed by one product
    per step (:func:`pycore._loops.sum_of_products`).
    """
    B = len(rngs)
    theta0, inp, theta, omega, bias = _start(task, o, rngs, terms_of.restrict(o))
    opt_t, opt_w, opt_b = (
        make_optimizer(o.optimizer, o.lr, o.betas, o.adam_eps, param=p) for p in ("θ", "ω", "bias")
    )
    hists = [{"epoch": [], "loss_P": [], "kappa_P": [], "kappa_H": []} for _ in rngs]
    diags = [{"steps": 0, "ties_P": 0, "ties_H": 0} for _ in rngs]
    terms = terms_of(task, inp, o, theta0, diags)
    XP, YP = inp.X_P, inp.Y_P
    x_norm, start = input_norm(task), max_abs(theta)
    _record(
        hists,
        inp,
        theta,
        0,
        losses.residual(task.loss, logits(inp, XP, theta, omega, bias), YP)[0],
    )
    steps = 0
    for epoch in range(1, o.epochs + 1):
        ep_loss, n_seen = np.zeros(B), 0
        for rows in epoch_steps(XP.shape[0], o.batch_size, rngs):
            gram_P, gram_H = gram_stacks(inp, theta, method, epoch, steps)
            n = XP.shape[0] if rows is None else rows.shape[1]
            loss, g_w, XtR, omT, g_b = loss_parts(inp, rows, theta, omega, bias, gram_P.F)
            ep_loss += loss * n
            n_seen += n
            extra, names = terms.parts(
                theta, gram_P, gram_H, f"{method}: epoch {epoch}, step {steps}"
            )
            for d, tP, tH in zip(diags, gram_P.tie_max, gram_H.tie_min):
                d["ties_P"] += bool(tP)
                d["ties_H"] += bool(tH)
            omega = opt_w.step(omega, g_w, blame="lr")
            if g_b is not None:
                bias = opt_b.step(bias, g_b, blame="lr")
            parts = [(XtR, omT), *extra]
            blame = functools.partial(_blame, parts, ("lr", *names))
            theta = opt_t.step(theta, sum_of_products(parts), blame=blame)
            check_scale(theta, x_norm, f"{method}: epoch {epoch}", o.optimizer, o.lr, blame)
            if terms.certified:
                theta = terms.certified_steps(theta)
                check_scale(theta, x_norm, f"{method}: epoch {epoch}", o.optimizer, o.lr, "lr")
            steps += 1
        last = epoch == o.epochs
        _record(
            hists, inp, theta, epoch, ep_loss / max(n_seen, 1), None if last else (gram_P, gram_H)
        )
    check_growth(theta, start, f"{method}: after {o.epochs} epochs")
    theta = inp.put(theta0, theta)
    for d in diags:
        d["steps"] = steps
    terms.finish(diags)
    out = []
    for b in range(B):
        # exact (SVD) at the last record
        diags[b]["kappa_end"] = (hists[b]["kappa_P"][-1], hists[b]["kappa_H"][-1])
        why = f"ran the {o.epochs} epochs asked for"
        out.append(MethodRun(theta[b], omega[b], hists[b], diags[b], why))
    return out


def _certified_steps(theta, task, o, pre_P, pre_H, cert):
    """Each regularizer step clipped to ``safety`` × its bound (docs/theory.md §5).

    κ is checked after each; a bound of 0 (a tie) skips the step.
    """
    cert["checked"] += 1
    for tag, X, lam, pre in (
        ("P", task.X_P, o.lambda_p, pre_P),
        ("H", task.X_H, o.lambda_h, pre_H),
    ):
        if tag == "P" and not lam:
            continue
        reg = hessian_regularizer(X @ theta, "well" if tag == "P" else "ill")
        bound = (
            preconditioned_r_well_step_bound(reg.info, D=task.D)
            if tag == "P"
            else preconditioned_r_ill_step_bound(reg.info)
        )
        eta = min(o.lr * lam, o.safety * bound)
        cert["clipped_" + tag] += eta < o.lr * lam
        if not eta > 0:
            cert["skipped_" + tag] += 1
            continue
        new = theta - eta * pre(theta, reg.G)
        k_new, k_old = (gram_spectrum(X @ th, vectors=False).kappa for th in (new, theta))
        cert["violations_" + tag] += not (k_new < k_old if tag == "P" else k_new > k_old)
        theta = new
    return theta


def algorithm1_auto(task, o) -> MethodRun:
    """Algorithm 1 (docs/theory.md §6) with its λ's measured on the task (docs/design.md §4).

    The adaptive rule of :func:`pycore._adaptive.adaptive_descent` from θ = I on the task's exact
    κ's, ``λ_P = (1 − w)/‖K_P⁺∇_θR_well‖_F``, ``λ_H = w/‖K_H⁺∇_θR_ill‖_F``, ``w = σ(−γ(ln(i) +
    ln(ii)))``: scale-free, aiming at ln(i) = −ln(ii). No D_P loss term (its θ-gradient vanishes at
    the optimal head, solved at the end).
    """
    XP, XH = task.X_P, task.X_H
    theta = np.eye(task.D)
    ceiling = rir_ceiling(XP, XH)
    # sup RIR ≤ 1 (to round-off): (i) > 1 > (ii) is out of reach (§10)
    if not ceiling.exact > 1 + 1e-6:
        stop = (
            f"no step taken: Definition 3.1 is out of reach of every θ, the RIR "
            f"ceiling is {ceiling.exact:.4g} ≤ 1 (docs/theory.md §10)"
        )
        omega = losses.best_head(task.loss, XP, task.Y_P)[0]
        return MethodRun(theta, omega, {}, {"steps": 0, "stop": stop}, stop)
    log_ratios = kappa_log_ratios(XP, XH, theta)
    run = adaptive_descent(
        theta,
        log_ratios,
        regularizer_directions(
            XP, XH, precond=o.precond, ridge=o.ridge, K_P=task.K_P, K_H=task.K_H
        ),
        AdaptiveSettings(
            lr=o.lr, epochs=o.epochs, patience=o.patience, betas=o.betas, adam_eps=o.adam_eps
        ),
    )
    best, best_m, stop, advice = run.theta, run.margin, run.stop, None
    log_i, log_ii = log_ratios(best)
    fraction = float(np.exp(log_i - log_ii)) / ceiling.range_restricted
    if best_m <= 0:
        stop, advice = _not_reached(stop, ceiling, budget=run.steps == o.epochs)
    elif fraction < SMALL_FRACTION:
        stop, advice = _far_below(stop, ceiling, fraction, XP)
    omega, bias = losses.best_head(task.loss, XP @ best, task.Y_P)
    diag = {
        "advice": advice,
        "fraction_of_ceiling": fraction,
        "steps": run.steps,
        "best_step": run.best_step,
        "restarts": run.restarts,
        "stop": stop,
        "bias": None if bias is None else bias.tolist(),
    }
    return MethodRun(best, omega, run.history, diag, stop)


# Below this fraction of the range-restricted RIR ceiling a run that met Definition 3.1 says how
# far it is from what the closed form attains: on raw columns of unequal scales the adaptive
# rule stops on patience at 3e-6 to 2 % of it (four of tests/test_defaults.py's raw tasks; iris
# 30 %), on their standardised twins at 6 to 99 %.
SMALL_FRACTION = 0.05


def _far_below(stop: str, ceiling, fraction: float, XP: np.ndarray) -> tuple[str, str | None]:
    """``stop`` of a run that met Definition 3.1 at a small ``fraction`` of the RIR ceiling.

    With where more is: the closed form (``"closed_form"``, which attains the range-restricted
    ceiling, when its window is not empty), and standardised columns when D_P's column scales
    differ by more than 100×.
    """
    window = def31_exponent_window(ceiling) if ceiling.kappa_C > 1 else None
    stop += (
        f"; its RIR is {fraction:.2%} of the range-restricted RIR ceiling "
        f"{ceiling.range_restricted:.4g} (docs/theory.md §10)"
    )
    advice = None
    if window is not None and not window.empty:
        stop += ", which the closed form (method 'closed_form') attains"
        advice = "closed_form"
    scale = np.sqrt(np.mean(XP**2, axis=0))
    scale = scale[scale > 0]
    if scale.size > 1 and scale.max() > 100.0 * scale.min():
        stop += (
            f"; D_P's column scales span {scale.max() / scale.min():.3g}×: z-scoring the "
            "columns first lets the adaptive rule reach more of it"
        )
    return stop, advice


def _not_reached(stop: str, ceiling, *, budget: bool) -> tuple[str, str | None]:
    """``stop`` with what is true about a run that never had (i) > 1 > (ii), and the method to try.

    ``"closed_form"`` when its window is not empty (it attains the range-restricted ceiling).
    """
    window = def31_exponent_window(ceiling) if ceiling.kappa_C > 1 else None
    root = float(np.sqrt(ceiling.range_restricted))
    stop += f"; Definition 3.1 was not reached though the RIR ceiling is {ceiling.exact:.4g} > 1"
    if window is not None and not window.empty:
        stop += (
            f": the closed form (method 'closed_form') meets it at the exponents "
            f"[{window.low:.4g}, {window.high:.4g}), where (i) and 1/(ii) share the ceiling "
            f"{ceiling.range_restricted:.4g} (each ≈ {root:.4g} at the balanced exponent)"
        )
        advice = "closed_form"
    else:
        stop += (
            f": the closed form cannot (its range-restricted ceiling is "
            f"{ceiling.range_restricted:.4g}); only θ that rescale null(K_P) raise the RIR"
        )
        advice = None
    if budget and ceiling.range_restricted > 2.0:  # a wide window, and the run was cut short
        stop += "; a larger epochs budget may also reach it"
    return stop, advice


def ours(task, o, rngs) -> list[MethodRun]:
    """Algorithm 1: the adaptive default or the fixed-λ loop.

    The adaptive default (:func:`algorithm1_auto`) runs from θ = I and draws nothing: the runs
    are one run, computed once.
    """
    if not o.auto:
        return fixed_lambda_loop(task, "ours", o, rngs)
    return each_run(algorithm1_auto(task, o), rngs)


OURS = Method("ours", "Ours (Alg. 1)", OursOptions, ours, work=(21, 7), in_tables=True)
