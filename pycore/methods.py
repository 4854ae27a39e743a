"""The immunizers' loops (docs/theory.md §6, §7, §10) behind :func:`pycore.immunize`: each
takes a task, the method's resolved options and the generator; returns ``(θ, ω, history,
diagnostics)``."""

from __future__ import annotations

import numpy as np

from pycore import losses
from pycore.adaptive import adaptive_descent, kappa_log_ratios, regularizer_directions
from pycore.metrics import def31_exponent_window, rir_ceiling
from pycore.optim import check_scale, make_optimizer
from pycore.precondition import Preconditioner
from pycore.regularizers import (
    hessian_regularizer,
    preconditioned_r_ill_step_bound,
    preconditioned_r_well_step_bound,
)
from pycore.spectral import ProductGramSpectrum, SpectrumError, gram_spectrum
from pycore.validation import DivergenceError


def _init_theta(D, o, rng):
    if o.init == "identity":
        return np.eye(D)
    b = 1.0 / np.sqrt(D)
    return rng.uniform(-b, b, size=(D, D))


def _init_head(task, rng):
    m = task.Y_P.shape[1]  # a small random head: a zero one makes ∇_θL vanish at the first step
    return rng.normal(0.0, 1.0 / np.sqrt(task.D), size=(task.D, m)), np.zeros(m)


def _batches(n, batch_size, rng):
    if batch_size is None or batch_size >= n:
        yield np.arange(n)
        return
    perm = rng.permutation(n)
    for s in range(0, n, batch_size):
        yield perm[s : s + batch_size]


def _loss_grads(task, X, Y, theta, omega, bias, grad_theta=True):
    if task.loss == "mse":
        return (*losses.mse(X, theta, omega, Y, grad_theta=grad_theta), None)
    return losses.bce(X, theta, omega, Y, bias, grad_theta=grad_theta)


def _loss_grads_from_Z(task, X, Z, Y, omega, bias):
    """:func:`_loss_grads` on all of D_P with ``Z = Xθ`` formed (the regularizers need it): ``ZᵀR``
    from Z, ∇_θL = ``(XᵀR)ωᵀ`` through the head (equal to round-off)."""
    mse = task.loss == "mse"
    loss, R = losses.residual(task.loss, Z @ omega if mse else Z @ omega + bias, Y)
    return loss, Z.T @ R, (X.T @ R) @ omega.T, None if mse else R.sum(axis=0)


def _log(hist: dict, *values):  # one entry per key of hist, in order
    for key, v in zip(hist, values):
        hist[key].append(v)


def _x_norm(task):  # max_i ‖x_i‖₁ over both tasks: |Xθ| ≤ it × max|θ| (optim.check_scale)
    return max(np.max(np.sum(np.abs(task.X_P), axis=1)), np.max(np.sum(np.abs(task.X_H), axis=1)))


def _kappa_theta_grads(reg_P, reg_H, X_P, X_H, Z_P, Z_H, log):
    """θ-gradients of κ(H_P), κ(H_H) or of log κ (docs/theory.md §7): ∂κ/∂H = a·v₁v₁ᵀ − b·v_kv_kᵀ,
    so 2XᵀZ(∂κ/∂H) is O(N·D) work, no D×D product."""

    def grad(reg, X, Z):
        i = reg.info
        v1, vk = reg.vector(0), reg.vector(i.rank - 1)
        a, b = (
            (1.0 / i.sigma_max, 1.0 / i.sigma_min)
            if log
            else (1.0 / i.sigma_min, i.kappa / i.sigma_min)
        )
        return 2.0 * (a * np.outer(X.T @ (Z @ v1), v1) - b * np.outer(X.T @ (Z @ vk), vk))

    return grad(reg_P, X_P, Z_P), grad(reg_H, X_H, Z_H)


def opt_kappa_objective(theta, X_P, X_H, *, weights=(1.0, 1.0), log: bool = False):
    """``w_P κ(H_P(θ)) − w_H κ(H_H(θ))`` (or log κ), its θ-gradient and the two unweighted ones."""
    theta = np.asarray(theta, dtype=np.float64)
    Z_P, Z_H = X_P @ theta, X_H @ theta
    reg_P, reg_H = hessian_regularizer(Z_P, "well"), hessian_regularizer(Z_H, "well")
    f = np.log if log else (lambda x: x)
    value = weights[0] * f(reg_P.info.kappa) - weights[1] * f(reg_H.info.kappa)
    g_P, g_H = _kappa_theta_grads(reg_P, reg_H, X_P, X_H, Z_P, Z_H, log)
    return float(value), weights[0] * g_P - weights[1] * g_H, (g_P, g_H)


def algorithm1(task, method, o, rng):
    """Algorithm 1 with fixed λ's (certified when ``o`` has ``safety``) and Opt κ, one loop; ω and
    θ step from gradients at the same point.  Opt κ puts ``λ_κ(w_Pκ(H_P) − w_Hκ(H_H))`` in place of
    the regularizers (docs/theory.md §7), balanced: w_H = ‖∇_θκ(H_P)‖/‖∇_θκ(H_H)‖ at the initial
    θ."""
    D = task.D
    opt_kappa = method.startswith("opt_kappa")
    certified = getattr(o, "safety", None) is not None
    theta = _init_theta(D, o, rng)
    omega, bias = _init_head(task, rng)
    opt_t, opt_w, opt_b = (
        make_optimizer(o.optimizer, o.lr, o.betas, o.adam_eps, param=p) for p in ("θ", "ω", "bias")
    )
    if not opt_kappa:
        pre_P = Preconditioner(task.K_P, o.precond, o.ridge, task.X_P)
        pre_H = Preconditioner(task.K_H, o.precond, o.ridge, task.X_H)
    hist = {"epoch": [], "loss_P": [], "kappa_P": [], "kappa_H": []}
    diag = {"steps": 0, "ties_P": 0, "ties_H": 0}
    cert = dict.fromkeys(
        (
            "violations_P",
            "violations_H",
            "clipped_P",
            "clipped_H",
            "skipped_P",
            "skipped_H",
            "checked",
        ),
        0,
    )
    XP, YP, XH = task.X_P, task.Y_P, task.X_H
    x_norm = _x_norm(task)
    w_P = w_H = 1.0
    if opt_kappa:
        _, _, (g_P0, g_H0) = opt_kappa_objective(theta, XP, XH, log=o.log)
        ratio = float(np.linalg.norm(g_H0) / np.linalg.norm(g_P0))
        diag["kappa_grad_ratio_H_over_P_at_init"] = ratio
        if method == "opt_kappa_balanced":
            w_H = 1.0 / ratio
        diag["kappa_weights"] = [w_P, w_H]

    def record(epoch, loss, kP=None, kH=None):  # in-loop κ's from the step's spectra, ends by SVD
        _log(
            hist,
            epoch,
            loss,
            kP if kP is not None else gram_spectrum(XP @ theta, vectors=False).kappa,
            kH if kH is not None else gram_spectrum(XH @ theta, vectors=False).kappa,
        )

    record(0, _loss_grads(task, XP, YP, theta, omega, bias)[0])
    for epoch in range(1, o.epochs + 1):
        ep_loss, n_seen = 0.0, 0
        for idx in _batches(XP.shape[0], o.batch_size, rng):
            Z_P, Z_H = XP @ theta, XH @ theta
            if len(idx) == XP.shape[0]:  # full batch: reuse Z_P (idx is arange(n), see _batches)
                loss, g_w, g_t, g_b = _loss_grads_from_Z(task, XP, Z_P, YP, omega, bias)
            else:
                loss, g_w, g_t, g_b = _loss_grads(task, XP[idx], YP[idx], theta, omega, bias)
            ep_loss += loss * len(idx)
            n_seen += len(idx)
            try:  # D×D H and G only for the certified mode (and always formed when N ≥ D)
                reg_P = hessian_regularizer(Z_P, "well", matrices=certified)
                reg_H = hessian_regularizer(
                    Z_H, "well" if opt_kappa else "ill", matrices=certified
                )
            except SpectrumError as exc:
                raise SpectrumError(
                    f"{method}: epoch {epoch}, step {diag['steps']}: {exc}"
                ) from None
            diag["ties_P"] += reg_P.tie
            diag["ties_H"] += reg_H.info.tie_min
            omega = opt_w.step(omega, g_w, blame="lr")
            if g_b is not None:
                bias = opt_b.step(bias, g_b, blame="lr")
            if opt_kappa:
                g_P, g_H = _kappa_theta_grads(reg_P, reg_H, XP, XH, Z_P, Z_H, o.log)
                d_k = o.lambda_kappa * (w_P * g_P - w_H * g_H)
                blame = {"lr": g_t, "lambda_kappa": d_k}
                theta = opt_t.step(theta, g_t + d_k, blame=blame)
            elif certified:
                blame = "lr"
                theta = opt_t.step(theta, g_t, blame=blame)
                check_scale(theta, x_norm, f"{method}: epoch {epoch}", o.optimizer, o.lr, blame)
                theta = _certified_steps(theta, task, o, pre_P, pre_H, cert)
            else:
                d_H = o.lambda_h * pre_H.direction(theta, reg_H, Z_H)
                d_P = o.lambda_p * pre_P.direction(theta, reg_P, Z_P) if o.lambda_p else None
                blame = {"lr": g_t, "lambda_h": d_H, "lambda_p": d_P}
                theta = opt_t.step(
                    theta, g_t + d_H if d_P is None else g_t + d_H + d_P, blame=blame
                )
            check_scale(theta, x_norm, f"{method}: epoch {epoch}", o.optimizer, o.lr, blame)
            diag["steps"] += 1
        last = epoch == o.epochs
        record(
            epoch,
            ep_loss / max(n_seen, 1),
            None if last else reg_P.info.kappa,
            None if last else reg_H.info.kappa,
        )
    if certified:
        diag["certified"] = cert
    # exact (SVD) at the last record
    diag["kappa_end"] = (hist["kappa_P"][-1], hist["kappa_H"][-1])
    return theta, omega, hist, diag


def _certified_steps(theta, task, o, pre_P, pre_H, cert):
    """Each regularizer step clipped to ``safety`` × its bound (docs/theory.md §5) and κ checked
    after it; a bound of 0 (a tie) skips the step."""
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


def rir_change_tolerance(
    kappas_before: tuple[float, float], kappas_after: tuple[float, float]
) -> float:
    """Relative RIR change two measured RIRs cannot resolve, ``max(1e-9, 8·eps·Σ√κ)`` over the four
    κ's: κ(H) = κ(Z)² from an SVD errs by ≲ 2p·eps·√κ(H), p = 4 (LAPACK's growth factor, the QR of
    X)."""
    total = sum(np.sqrt(k) for k in (*kappas_before, *kappas_after))
    return max(1e-9, 8.0 * np.finfo(np.float64).eps * float(total))


def r_ill_only(task, method, o, rng):
    """R_ill only (docs/theory.md §7): ``θ ← θ − η_t K_H⁺∇_θR_ill(H_H(θ))`` by GD, no D_P loss or
    head, ``epochs × ⌈N_P/batch_size⌉`` steps; RIR falls beyond :func:`rir_change_tolerance` are
    counted."""
    XP, XH = task.X_P, task.X_H
    theta = _init_theta(task.D, o, rng)
    pre_H = Preconditioner(task.K_H, o.precond, o.ridge, XH)
    n_batches = 1 if o.batch_size is None else -(-XP.shape[0] // o.batch_size)
    hist = {"step": [], "kappa_P": [], "kappa_H": [], "rir": [], "eta": []}
    diag = {"steps": 0, "ties_H": 0, "clipped": 0, "rir_decreases": 0, "optimizer": "gd"}
    spec_P, spec_H = ProductGramSpectrum(XP), ProductGramSpectrum(XH)  # exact κ's, X factored once
    kP0, kH0 = spec_P(theta).kappa, spec_H(theta).kappa
    prev, prev_kappas = 1.0, (kP0, kH0)
    _log(hist, 0, kP0, kH0, 1.0)
    for epoch in range(1, o.epochs + 1):
        for _ in range(n_batches):
            Z_H = XH @ theta
            try:
                reg = hessian_regularizer(Z_H, "ill", matrices=False)
            except SpectrumError as exc:
                raise SpectrumError(
                    f"r_ill_only: epoch {epoch}, step {diag['steps']}: {exc}"
                ) from None
            diag["ties_H"] += reg.info.tie_min
            # Thm 4.3(2)
            eta = min(o.lr * o.lambda_h, o.safety * preconditioned_r_ill_step_bound(reg.info))
            diag["clipped"] += eta < o.lr * o.lambda_h
            theta = theta - eta * pre_H.direction(theta, reg, Z_H)
            diag["steps"] += 1
            kP, kH = spec_P(theta).kappa, spec_H(theta).kappa
            r = (kH / kH0) / (kP / kP0)
            diag["rir_decreases"] += r < prev * (1 - rir_change_tolerance(prev_kappas, (kP, kH)))
            prev, prev_kappas = r, (kP, kH)
            _log(hist, diag["steps"], kP, kH, r, eta)
        if not np.all(np.isfinite(theta)):
            raise DivergenceError(
                "lambda_h", f"r_ill_only: θ became non-finite at epoch {epoch}; lower lambda_h"
            )
    diag["kappa_end"] = (kP0, kH0) if not diag["steps"] else (kP, kH)
    return theta, None, hist, diag


def imma_inner_step_size(task, w: np.ndarray, o) -> float:
    """``inner_lr / L``, L = (2/N)λ_max(K_H)‖w‖² the Lipschitz constant of θ ↦ ∇_θL_H(w, θ)."""
    n = task.Y_H.size
    # ‖X_H‖₂ (an SVD) is a constant of the task, cached on it: once, not once per step
    L = 2.0 / n * task.norm2_X_H**2 * float(np.sum(w * w))
    return o.inner_lr / L if L > 0 else 0.0


def imma_objective(theta, w, omega, task, o, bias=None, batch_P=None):
    """F(θ) = L_H(w, θ_J) − L_P(ω, θ_J), θ_J = ``o.inner_steps`` attacker GD steps on all of D_H
    from θ, and ∇_θF; L_P on ``batch_P = (X, Y)`` (default all of D_P).  Each attacker step is
    affine in θ and subtracts a matrix (·)wᵀ, so θ_J = θ − S wᵀ (S D×m) and the adjoint (reverse
    mode by hand) only changes the factor of wᵀ: O(J·D²·m) work, equal to the unrolled matrices to
    round-off."""
    n = task.Y_H.size
    c = imma_inner_step_size(task, w, o) * 2.0 / n
    b = task.X_H.T @ task.Y_H  # D×m: B = b wᵀ
    KH = task.K_H
    ww = w.T @ w  # m×m
    tw = theta @ w  # θw (D×m)
    S = np.zeros_like(tw)  # θ_j = θ − S wᵀ
    for _ in range(o.inner_steps):
        S = S + c * (KH @ (tw - S @ ww) - b)
    # L_H at θ_J: θ_J w = θw − S wᵀw
    lh, R = losses.residual("mse", task.X_H @ (tw - S @ ww), task.Y_H)
    a = task.X_H.T @ R  # g_h = a wᵀ
    X_P, Y_P = (task.X_P, task.Y_P) if batch_P is None else batch_P
    Z_P = X_P @ (theta @ omega - S @ (w.T @ omega))  # X_P θ_J ω
    if task.loss == "bce":
        Z_P = Z_P + (0.0 if bias is None else bias)
    lp, R = losses.residual(task.loss, Z_P, Y_P)
    p = X_P.T @ R  # g_p = p ωᵀ
    pw = p @ (omega.T @ w)  # adjoint of Ḡ = a wᵀ − p ωᵀ, through Ḡw
    for _ in range(o.inner_steps):
        a = a - c * (KH @ (a @ ww - pw))
    return lh - lp, a @ w.T - p @ omega.T


def imma(task, method, o, rng):
    """IMMA (docs/theory.md §7): ascent on :func:`imma_objective`; heads w and ω descend their
    losses."""
    D = task.D
    theta = _init_theta(D, o, rng)
    omega, bias = _init_head(task, rng)
    w = rng.normal(0.0, 1.0 / np.sqrt(D), size=(D, task.Y_H.shape[1]))
    opt_t, opt_w, opt_o, opt_b = (
        make_optimizer(o.optimizer, o.lr, o.betas, o.adam_eps, param=p)
        for p in ("θ", "w", "ω", "bias")
    )
    hist = {"epoch": [], "objective": [], "kappa_P": [], "kappa_H": []}
    spec_P, spec_H = ProductGramSpectrum(task.X_P), ProductGramSpectrum(task.X_H)
    n_P = task.X_P.shape[0]
    x_norm = _x_norm(task)
    for epoch in range(1, o.epochs + 1):
        for idx in _batches(n_P, o.batch_size, rng):
            X_b, Y_b = (task.X_P, task.Y_P) if len(idx) == n_P else (task.X_P[idx], task.Y_P[idx])
            F, gF = imma_objective(theta, w, omega, task, o, bias, batch_P=(X_b, Y_b))
            _, g_w, _ = losses.mse(task.X_H, theta, w, task.Y_H, grad_theta=False)
            _, g_o, _, g_b = _loss_grads(task, X_b, Y_b, theta, omega, bias, grad_theta=False)
            theta = opt_t.step(theta, -gF, blame="lr")  # ascent on F
            check_scale(theta, x_norm, f"imma: epoch {epoch}", o.optimizer, o.lr, "lr")
            w = opt_w.step(w, g_w, blame="lr")
            omega = opt_o.step(omega, g_o, blame="lr")
            if g_b is not None:
                bias = opt_b.step(bias, g_b, blame="lr")
        _log(hist, epoch, F, spec_P(theta).kappa, spec_H(theta).kappa)
    end = {"kappa_end": (hist["kappa_P"][-1], hist["kappa_H"][-1])} if hist["epoch"] else {}
    return theta, omega, hist, end


def algorithm1_auto(task, method, o, rng):
    """Algorithm 1 (docs/theory.md §6) with its λ's measured on the task (docs/design.md §4): the
    adaptive rule of :func:`pycore.adaptive.adaptive_descent` from θ = I on the task's exact κ's,
    ``λ_P = (1 − w)/‖K_P⁺∇_θR_well‖_F``, ``λ_H = w/‖K_H⁺∇_θR_ill‖_F``, ``w = σ(−γ(ln(i) +
    ln(ii)))``: scale-free, aiming at ln(i) = −ln(ii). No D_P loss term (its θ-gradient vanishes at
    the optimal head, solved at the end)."""
    XP, XH = task.X_P, task.X_H
    theta = np.eye(task.D)
    ceiling = rir_ceiling(XP, XH)
    # sup RIR ≤ 1 (to round-off): (i) > 1 > (ii) is out of reach (§10)
    if not ceiling.exact > 1 + 1e-6:
        return (
            theta,
            losses.best_head(task.loss, XP, task.Y_P)[0],
            {},
            {
                "steps": 0,
                "stop": f"no step taken: Definition 3.1 is out of reach of every θ, the RIR "
                f"ceiling is {ceiling.exact:.4g} ≤ 1 (docs/theory.md §10)",
            },
        )
    run = adaptive_descent(
        theta,
        kappa_log_ratios(XP, XH, theta),
        regularizer_directions(
            XP, XH, precond=o.precond, ridge=o.ridge, K_P=task.K_P, K_H=task.K_H
        ),
        lr=o.lr,
        epochs=o.epochs,
        patience=o.patience,
        betas=o.betas,
        adam_eps=o.adam_eps,
    )
    best, best_m, stop, advice = run.theta, run.margin, run.stop, None
    if best_m <= 0:
        stop, advice = _not_reached(stop, ceiling, budget=run.steps == o.epochs)
    omega, bias = losses.best_head(task.loss, XP @ best, task.Y_P)
    diag = {
        "advice": advice,
        "steps": run.steps,
        "best_step": run.best_step,
        "restarts": run.restarts,
        "stop": stop,
        "bias": None if bias is None else bias.tolist(),
    }
    return best, omega, run.history, diag


def _not_reached(stop: str, ceiling, *, budget: bool) -> tuple[str, str | None]:
    """``stop`` with what is true about a run that never had (i) > 1 > (ii), and the method to try:
    ``"closed_form"`` when its window is not empty (it attains the range-restricted ceiling)."""
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


def ours(task, method, o, rng):
    return (algorithm1_auto if o.auto else algorithm1)(task, method, o, rng)


RUNNERS = {
    "r_ill_only": r_ill_only,
    "imma": imma,
    "opt_kappa": algorithm1,
    "opt_kappa_balanced": algorithm1,
    "ours": ours,
}


def closed_form(task, exponent: float, ceiling):
    """θ = [U_r Λ_r^{-½} Q_C diag(s), 0], s² = λ_C^a (docs/theory.md §10): RIR = the
    range-restricted ``ceiling`` for a ≥ 0.  The zero null(K_P) columns keep D_P's best loss
    (Definition 3.1(c)); C's null space keeps s = 1 (θ injective on range(K_P))."""
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
