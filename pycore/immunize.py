"""Immunizers of a linear feature extractor θ ∈ R^{D×D}: Algorithm 1 and the baselines.

All methods share one entry point, :func:`immunize`, one configuration type and one result type.
Methods (docs/theory.md §6-7, §10):

* ``"ours"`` — Algorithm 1: the D_P loss, ``λ_P R_well(H_P)`` and ``λ_H R_ill(H_H)``, the two
  regularizer gradients preconditioned by ``K⁻¹`` in the exact form ``2θG`` (docs/theory.md §4).
* ``"r_ill_only"`` — ``λ_H R_ill(H_H)`` alone (no D_P loss, no R_well) by Algorithm 1's
  preconditioned step under plain GD; RIR ≥ 1 at every step (docs/theory.md §7).
* ``"imma"`` — bi-level (Zheng & Yeh 2024): an attacker fine-tunes θ on D_H for a few unrolled
  GD steps; the upper level maximises the attacker's harmful loss minus the D_P loss at the
  fine-tuned θ, differentiating through the unrolled steps (:func:`imma_objective`).
* ``"opt_kappa"`` — ``κ(H_P(θ)) − κ(H_H(θ))`` in place of Algorithm 1's regularizers (D_P loss
  kept, Ours' optimizer); ``"opt_kappa_balanced"`` weights the κ_H term so that both terms'
  θ-gradients have equal norms at the initial θ.
* ``"closed_form"`` — the optimal immunizer restricted to range(K_P) (docs/theory.md §10).
* ``"identity"`` — θ = I.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
from scipy.special import expit

from pycore import losses
from pycore.harden import HARDENINGS, harden, hardening_rotation, orthogonality_defect
from pycore.metrics import rir_ceiling
from pycore.optim import OPTIMIZERS, check_scale, largest_term, make_optimizer
from pycore.precondition import PRECONDITIONERS, Preconditioner
from pycore.regularizers import (hessian_regularizer, preconditioned_r_ill_step_bound,
                                 preconditioned_r_well_step_bound)
from pycore.spectral import ProductGramSpectrum, SpectrumError, gram_spectrum
from pycore.tasks import LinearTask
from pycore.validation import DivergenceError, ParameterError, check_choice, check_number
from pycore.threads import bounded_blas


# Upper bounds of the counts (a typo such as epochs=10**23 must fail at once, not run until
# killed): 100× the largest value of the paper (Table 4: 1000 epochs) and ~300× IMMA's default of
# 3 unrolled steps (each costs 2 D×D×m products per outer step).
MAX_EPOCHS = 100_000
MAX_IMMA_INNER_STEPS = 1_000


@dataclass(frozen=True)
class ImmunizeConfig:
    """Hyper-parameters; defaults are the paper's House Prices values (docs/theory.md §9, Table 4).

    Where we depart from the paper it is documented field by field.
    """

    epochs: int = 100            # paper Sec. 5.1 text (Table 4 says 1000)
    lr: float = 0.02             # paper: 0.005 (grid {5e-4,1e-3,5e-3,1e-2}); docs/results.md §1
    lambda_p: float = 100.0      # λ_P, weight of R_well(H_P): the paper's value
    lambda_h: float = 1e10       # λ_H, weight of R_ill(H_H); paper: 1e7 (leaves R_ill inert under Adam here)
    optimizer: str = "adam"      # the paper's choice for linear models; "gd" = Algorithm 1 as printed
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    batch_size: int | None = 64  # D_P mini-batch for the loss term (paper: 64); None = full batch
    precond: str = "pinv"        # K⁺ (docs/theory.md §5: K is singular on real data);
                                 # "exact" 2θG | "ridge" | "none"
    ridge: float = 0.0           # λ of the "ridge" preconditioner (K+λI)⁻¹
    init: str = "identity"       # "identity" | "random" (nn.Linear's U(±1/√D))
    # opt_kappa(_balanced): weight λ_κ of w_Pκ(H_P) − w_Hκ(H_H) (log κ when opt_kappa_log)
    lambda_kappa: float = 1.0
    opt_kappa_log: bool = False
    # imma: unrolled attacker steps and their size as a fraction of 1/L of the lower problem
    imma_inner_steps: int = 3
    imma_inner_lr: float = 0.5
    # closed_form: s² = λ_C^a scales (i) and (ii) by κ(C)^a together, RIR constant for a ≥ 0
    # (a = 0: H_P = I, the best pre-training conditioning; a < 0 lowers the RIR)
    closed_form_exponent: float = 0.0
    # certified-monotone mode (docs/theory.md §10): clip each regularizer step to the §5 bound and check κ
    certified: bool = False
    certified_safety: float = 0.9  # also caps the R_ill-only step at this fraction of its §5 bound
    # [attacks] spectrum-preserving hardening θ → θQ, Q orthogonal, applied after any method
    # (pycore.harden, docs/attacks.md): "none" | "haar" (Q from the run's rng, drawn after the
    # method) | "equalize" (deterministic: equal diagonal of H_H(θ) on the training rows)
    harden: str = "none"

    @classmethod
    def paper(cls, **overrides) -> "ImmunizeConfig":
        """The paper's House Prices values verbatim (Table 4 / docs/theory.md §9): η = 0.005, λ_H = 1e7."""
        base = dict(lr=0.005, lambda_h=1e7, precond="ridge", ridge=1e-7)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def strict(cls, **overrides) -> "ImmunizeConfig":
        """Defaults of the strict protocol (``--protocol strict``, docs/theory.md §10).

        Rule: the paper's Table 4 values verbatim, η = 0.005, λ_P = 100, λ_H = 1e7, batch 64,
        ridge solve (K + 1e-7 I)⁻¹, with Table 4's 1000 epochs.  Our paper-protocol defaults
        (η = 0.02, λ_H = 1e10, 100 epochs) were chosen on the 79-column inputs, where most of the
        RIR comes from directions D_P never varies in; once those are gone the RIR must be earned by
        conditioning D_P (the ceiling is reached by whitening it, docs/theory.md §10), which Adam
        does in about 600 epochs at η = 0.005 (docs/results.md §1, Hyper-parameters).
        """
        return cls.paper(**{"epochs": 1000, **overrides})

    @classmethod
    def mnist(cls, paper: bool = False, **overrides) -> "ImmunizeConfig":
        """MNIST settings (paper Sec. 5.1): 30 full-batch epochs, λ_P = 1.

        ``paper=True``: the paper's Table 4 values verbatim, η = 0.001, λ_H = 5e7, ridge
        (K + 1e-7 I)⁻¹.  Default: η = 0.002, λ_H = 1e12, K⁺ -- λ_H from the paper's own rule of
        balancing the two preconditioned gradient norms (≈1e4 for R_well, ≈1e-8 for R_ill at
        θ = I with pixels/255), which 5e7 leaves ~1e-4 apart (docs/results.md §2).
        """
        base = dict(epochs=30, lambda_p=1.0, batch_size=None, ridge=1e-7)  # ridge: used by precond="ridge"
        base.update(dict(lr=0.001, lambda_h=5e7, precond="ridge") if paper
                    else dict(lr=0.002, lambda_h=1e12, precond="pinv"))
        base.update(overrides)
        return cls(**base)

    def __post_init__(self):
        # Every numeric field finite and in range, named (ParameterError.parameter = the field):
        # NaN passes every `x < 0` test, so each bound is checked positively.
        num = check_number
        num(self.epochs, "epochs", low=0, high=MAX_EPOCHS, integer=True)
        num(self.lr, "lr", low=0.0, low_open=True)
        num(self.lambda_p, "lambda_p", low=0.0)
        num(self.lambda_h, "lambda_h", low=0.0)
        check_choice(self.optimizer, "optimizer", OPTIMIZERS)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ParameterError("betas", f"betas must be a pair (β₁, β₂), got {self.betas!r}")
        for b in self.betas:
            num(b, "betas", low=0.0, high=1.0, high_open=True)
        num(self.adam_eps, "adam_eps", low=0.0, low_open=True)
        num(self.batch_size, "batch_size", low=1, integer=True, none_ok=True)
        check_choice(self.precond, "precond", PRECONDITIONERS)
        num(self.ridge, "ridge", low=0.0)
        if self.precond == "ridge" and not self.ridge > 0:
            raise ParameterError("ridge", f"precond 'ridge' needs ridge > 0, got {self.ridge!r}")
        check_choice(self.init, "init", ("identity", "random"))
        num(self.lambda_kappa, "lambda_kappa", low=0.0)
        check_choice(self.opt_kappa_log, "opt_kappa_log", (False, True))
        num(self.imma_inner_steps, "imma_inner_steps", low=0, high=MAX_IMMA_INNER_STEPS, integer=True)
        # the attacker's GD step is imma_inner_lr/L: stable on its quadratic below 2
        num(self.imma_inner_lr, "imma_inner_lr", low=0.0, high=2.0, high_open=True)
        num(self.closed_form_exponent, "closed_form_exponent")
        check_choice(self.certified, "certified", (False, True))
        num(self.certified_safety, "certified_safety", low=0.0, high=1.0, low_open=True, high_open=True)
        check_choice(self.harden, "harden", HARDENINGS)  # [attacks]
        if self.certified and self.precond not in ("exact", "pinv"):
            raise ParameterError("precond", "certified mode needs precond 'exact' or 'pinv' "
                                            "(the bounds of docs/theory.md §5 are for K⁻¹/K⁺)")


@dataclass
class ImmunizationResult:
    """θ_I and what happened on the way there."""

    method: str
    theta: np.ndarray
    omega: np.ndarray | None
    history: dict[str, list] = field(default_factory=dict)
    wall_seconds: float = 0.0
    diagnostics: dict = field(default_factory=dict)
    config: ImmunizeConfig | None = None
    # [attacks] with config.harden != "none": theta = theta_unhardened @ rotation (exactly as
    # computed), omega rotated with it; both None without hardening
    theta_unhardened: np.ndarray | None = None
    rotation: np.ndarray | None = None


@bounded_blas
def immunize(task: LinearTask, method: str, *, rng: np.random.Generator,
             config: ImmunizeConfig | None = None, progress=None) -> ImmunizationResult:
    """Immunize a linear feature extractor for ``task`` with ``method`` (one of :data:`METHODS`).

    ``rng`` drives θ's random initialisation (``init="random"``) and the mini-batch order.
    ``progress`` is an optional callable ``progress(epoch)`` (e.g. a tqdm update).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    cfg = config or ImmunizeConfig()
    t0 = time.perf_counter()
    res = RUNNERS[method](task, cfg, rng, progress)
    if cfg.harden != "none":  # [attacks] after the method, so its own draws from rng are unchanged
        _harden_result(res, task, cfg, rng)
    res.wall_seconds = time.perf_counter() - t0
    res.config = cfg
    return res


def _harden_result(res: ImmunizationResult, task: LinearTask, cfg: ImmunizeConfig, rng) -> None:
    """θ → θQ and ω → Qᵀω with the rotation of ``cfg.harden`` (pycore.harden; docs/attacks.md §2):
    every κ, the RIR and the best D_P loss are unchanged, the feature basis is not."""
    Z_H = task.X_H @ res.theta if cfg.harden == "equalize" else None
    Q = hardening_rotation(cfg.harden, task.D, rng=rng, Z=Z_H)
    res.theta_unhardened = res.theta
    res.theta, res.omega = harden(res.theta, Q, res.omega)
    res.rotation = Q
    res.diagnostics["harden"] = {"kind": cfg.harden, "orthogonality_defect": orthogonality_defect(Q)}


# --------------------------------------------------------------------------------------------

def _init_theta(D, cfg, rng):
    if cfg.init == "identity":
        return np.eye(D)
    b = 1.0 / np.sqrt(D)
    return rng.uniform(-b, b, size=(D, D))


def _init_head(task, rng):
    m = task.Y_P.shape[1]
    # Small random head: a zero head makes ∇_θ L vanish at the first step.
    return rng.normal(0.0, 1.0 / np.sqrt(task.D), size=(task.D, m)), np.zeros(m)


def _batches(n, batch_size, rng):
    if batch_size is None or batch_size >= n:
        yield np.arange(n)
        return
    perm = rng.permutation(n)
    for s in range(0, n, batch_size):
        yield perm[s:s + batch_size]


def _loss_grads(task, X, Y, theta, omega, bias, grad_theta=True):
    if task.loss == "mse":
        loss, g_w, g_t = losses.mse(X, theta, omega, Y, grad_theta=grad_theta)
        return loss, g_w, g_t, None
    return losses.bce(X, theta, omega, Y, bias, grad_theta=grad_theta)


def _loss_grads_from_Z(task, X, Z, Y, omega, bias):
    """:func:`_loss_grads` on the full D_P with the features ``Z = Xθ`` already formed (the
    regularizers need them anyway): the same quantities as :func:`pycore.losses.mse` /
    :func:`pycore.losses.bce`, with ``Zᵀ R`` read off the formed ``Z`` (equal to round-off).
    ∇_θL = ``(XᵀR)ωᵀ`` is associated through the head, as in :mod:`pycore.losses`: an outer
    product, not the D×N×D product ``Xᵀ(Rωᵀ)`` (the same matrix up to round-off)."""
    if task.loss == "mse":
        E = Z @ omega - Y
        n = E.size
        R = (2.0 / n) * E
        return float(np.sum(E * E) / n), Z.T @ R, (X.T @ R) @ omega.T, None
    logits = Z @ omega + bias
    loss = float(np.mean(np.logaddexp(0.0, logits) - Y * logits))
    R = (expit(logits) - Y) / Y.size
    return loss, Z.T @ R, (X.T @ R) @ omega.T, R.sum(axis=0)


def _kappa_grad_parts(reg, log: bool):
    """(a, v₁, b, v_k) with ∂κ/∂H = a·v₁v₁ᵀ − b·v_kv_kᵀ (or ∂log κ/∂H), see :func:`kappa_grad_H`."""
    info = reg.info
    v1, vk = reg.vector(0), reg.vector(info.rank - 1)
    if log:
        return 1.0 / info.sigma_max, v1, 1.0 / info.sigma_min, vk
    return 1.0 / info.sigma_min, v1, info.kappa / info.sigma_min, vk


def kappa_grad_H(reg, log: bool = False) -> np.ndarray:
    """∂κ/∂H = (v₁v₁ᵀ − κ v_kv_kᵀ)/σ_k, or ∂log κ/∂H = v₁v₁ᵀ/σ₁ − v_kv_kᵀ/σ_k (docs/theory.md §7).

    From ``κ = σ₁/σ_k`` with ``∂σ₁/∂H = v₁v₁ᵀ`` and ``∂σ_k/∂H = v_kv_kᵀ`` (simple extreme
    eigenvalues of the symmetric H; σ_k the smallest nonzero one).  ``reg`` is a
    :class:`pycore.regularizers.HessianRegularizer` (only its spectrum and eigenvectors are used).
    """
    a, v1, b, vk = _kappa_grad_parts(reg, log)
    return a * np.outer(v1, v1) - b * np.outer(vk, vk)


def _kappa_theta_grads(reg_P, reg_H, X_P, X_H, Z_P, Z_H, log):
    """θ-gradients of κ(H_P) and of κ(H_H): ∇_θ f(θᵀKθ) = 2KθG = 2Xᵀ(XθG), and G is rank 2, so
    ``2XᵀZG = 2a(XᵀZv₁)v₁ᵀ − 2b(XᵀZv_k)v_kᵀ``: O(N·D) work, no D×D product."""
    def grad(reg, X, Z):
        a, v1, b, vk = _kappa_grad_parts(reg, log)
        return 2.0 * (a * np.outer(X.T @ (Z @ v1), v1) - b * np.outer(X.T @ (Z @ vk), vk))
    return grad(reg_P, X_P, Z_P), grad(reg_H, X_H, Z_H)


def opt_kappa_objective(theta, X_P, X_H, *, weights=(1.0, 1.0), log: bool = False):
    """Opt κ's condition-number term ``w_P κ(H_P(θ)) − w_H κ(H_H(θ))`` (log κ when ``log``) and its
    θ-gradient (docs/theory.md §7), the quantity the "opt_kappa" methods descend.

    Returns ``(value, gradient, (grad_P, grad_H))`` with the unweighted per-term θ-gradients.
    """
    theta = np.asarray(theta, dtype=np.float64)
    Z_P, Z_H = X_P @ theta, X_H @ theta
    reg_P, reg_H = hessian_regularizer(Z_P, "well"), hessian_regularizer(Z_H, "well")
    f = np.log if log else (lambda x: x)
    value = weights[0] * f(reg_P.info.kappa) - weights[1] * f(reg_H.info.kappa)
    g_P, g_H = _kappa_theta_grads(reg_P, reg_H, X_P, X_H, Z_P, Z_H, log)
    return float(value), weights[0] * g_P - weights[1] * g_H, (g_P, g_H)


def _regularized(task, method, cfg, rng, progress):
    """Algorithm 1 (ours) and Opt κ (literal and balanced): one loop, different θ-gradients.

    Opt κ (docs/theory.md §7) replaces Algorithm 1's two regularizers by
    ``λ_κ(w_P κ(H_P) − w_H κ(H_H))`` (the paper: "directly minimizes κ(H_P(θ)) − κ(H_H(θ)) ...
    instead of using our proposed regularizers"), so the D_P loss of Eq. (11) is KEPT and the
    optimizer is Ours' (Adam by default); no preconditioning.  ``"opt_kappa"``: the literal
    objective, w_P = w_H = 1.  ``"opt_kappa_balanced"``: w_P = 1 and w_H = ‖∇_θκ(H_P)‖/‖∇_θκ(H_H)‖
    at the initial θ, so both terms start with equal gradient norms (with unit weights the κ_H term
    is ~27× the κ_P term at θ = I on House Prices and drives κ(H_P) up).
    """
    D = task.D
    opt_kappa = method in ("opt_kappa", "opt_kappa_balanced")
    theta = _init_theta(D, cfg, rng)
    omega, bias = _init_head(task, rng)
    opt_t = make_optimizer(cfg.optimizer, cfg.lr, cfg.betas, cfg.adam_eps, param="θ")
    opt_w = make_optimizer(cfg.optimizer, cfg.lr, cfg.betas, cfg.adam_eps, param="ω")
    opt_b = make_optimizer(cfg.optimizer, cfg.lr, cfg.betas, cfg.adam_eps, param="bias")
    lam_p = cfg.lambda_p
    pre_P = Preconditioner(task.K_P, cfg.precond, cfg.ridge, task.X_P) if not opt_kappa else None
    pre_H = Preconditioner(task.K_H, cfg.precond, cfg.ridge, task.X_H) if not opt_kappa else None
    hist = {"epoch": [], "loss_P": [], "kappa_P": [], "kappa_H": []}
    diag = {"steps": 0, "ties_P": 0, "ties_H": 0}
    cert = {"violations_P": 0, "violations_H": 0, "clipped_P": 0, "clipped_H": 0,
            "skipped_P": 0, "skipped_H": 0, "checked": 0}
    XP, YP, XH = task.X_P, task.Y_P, task.X_H
    x_norm = max(np.max(np.sum(np.abs(XP), axis=1)), np.max(np.sum(np.abs(XH), axis=1)))
    w_P = w_H = 1.0
    if opt_kappa:
        _, _, (g_P0, g_H0) = opt_kappa_objective(theta, XP, XH, log=cfg.opt_kappa_log)
        ratio = float(np.linalg.norm(g_H0) / np.linalg.norm(g_P0))
        diag["kappa_grad_ratio_H_over_P_at_init"] = ratio
        if method == "opt_kappa_balanced":
            w_H = 1.0 / ratio
        diag["kappa_weights"] = [w_P, w_H]

    def record(epoch, loss, kP=None, kH=None):
        # In-loop κ's come from the step's own spectra (free); the end points are exact (SVD).
        hist["epoch"].append(epoch)
        hist["loss_P"].append(loss)
        hist["kappa_P"].append(kP if kP is not None else gram_spectrum(XP @ theta, vectors=False).kappa)
        hist["kappa_H"].append(kH if kH is not None else gram_spectrum(XH @ theta, vectors=False).kappa)

    record(0, losses.task_loss(task.loss, XP, theta, omega, YP, bias))
    for epoch in range(1, cfg.epochs + 1):
        ep_loss, n_seen = 0.0, 0
        for idx in _batches(XP.shape[0], cfg.batch_size, rng):
            Z_P, Z_H = XP @ theta, XH @ theta
            if len(idx) == XP.shape[0]:  # full batch: reuse Z_P (idx is arange(n), see _batches)
                loss, g_w, g_t, g_b = _loss_grads_from_Z(task, XP, Z_P, YP, omega, bias)
            else:
                loss, g_w, g_t, g_b = _loss_grads(task, XP[idx], YP[idx], theta, omega, bias)
            ep_loss += loss * len(idx)
            n_seen += len(idx)
            try:
                # D×D H and G are only needed by the certified mode (and, when N ≥ D, always formed).
                mats = cfg.certified
                reg_P = hessian_regularizer(Z_P, "well", matrices=mats)
                reg_H = hessian_regularizer(Z_H, "ill", matrices=mats) if not opt_kappa else \
                    hessian_regularizer(Z_H, "well", matrices=mats)  # only its spectrum/vectors are used
            except SpectrumError as exc:
                raise SpectrumError(f"{method}: epoch {epoch}, step {diag['steps']}: {exc}") from None
            diag["ties_P"] += reg_P.tie
            diag["ties_H"] += reg_H.info.tie_min
            # Algorithm 1 line 4: ω uses the gradient at (ω_t, θ_t).
            omega = opt_w.step(omega, g_w, blame="lr")
            if g_b is not None:
                bias = opt_b.step(bias, g_b, blame="lr")
            if opt_kappa:
                g_P, g_H = _kappa_theta_grads(reg_P, reg_H, XP, XH, Z_P, Z_H, cfg.opt_kappa_log)
                d_k = cfg.lambda_kappa * (w_P * g_P - w_H * g_H)
                g = g_t + d_k
                blame = lambda step=None, g_t=g_t, d_k=d_k: largest_term(step, lr=g_t, lambda_kappa=d_k)
                theta = opt_t.step(theta, g, blame=blame)
            elif cfg.certified:
                blame = lambda step=None: "lr"
                theta = opt_t.step(theta, g_t, blame=blame)
                check_scale(theta, x_norm, f"{method}: epoch {epoch}", cfg.optimizer, cfg.lr, blame)
                theta = _certified_steps(theta, task, cfg, lam_p, pre_P, pre_H, cert)
            else:
                d_H = cfg.lambda_h * pre_H.direction(theta, reg_H, Z_H)
                g = g_t + d_H
                d_P = lam_p * pre_P.direction(theta, reg_P, Z_P) if lam_p else None
                if lam_p:
                    g = g + d_P
                blame = lambda step=None, g_t=g_t, d_H=d_H, d_P=d_P: largest_term(
                    step, lr=g_t, lambda_h=d_H, lambda_p=d_P)
                theta = opt_t.step(theta, g, blame=blame)
            check_scale(theta, x_norm, f"{method}: epoch {epoch}", cfg.optimizer, cfg.lr, blame)
            diag["steps"] += 1
        last = epoch == cfg.epochs
        record(epoch, ep_loss / max(n_seen, 1), None if last else reg_P.info.kappa,
               None if last else reg_H.info.kappa)
        if progress is not None:
            progress(epoch)
        if not np.all(np.isfinite(theta)):
            raise DivergenceError(f"{method}: θ became non-finite at epoch {epoch}; lower lr or λ",
                                  parameter="lr")
    if cfg.certified:
        diag["certified"] = cert
    return ImmunizationResult(method, theta, omega, hist, diagnostics=diag)


def r_ill_only_step_size(info, cfg: ImmunizeConfig) -> float:
    """Step of the R_ill-only baseline: ``η_t = min(lr·λ_H, c·η̄(H_H))`` with η̄ the corrected
    Theorem 4.3(2) bound (:func:`pycore.regularizers.preconditioned_r_ill_step_bound`) and
    ``c = certified_safety`` < 1: Ours' ηλ_H, clipped where the theorem would no longer hold."""
    return min(cfg.lr * cfg.lambda_h, cfg.certified_safety * preconditioned_r_ill_step_bound(info))


def rir_change_tolerance(kappas_before: tuple[float, float], kappas_after: tuple[float, float]) -> float:
    """Relative change of the RIR below which two measured RIRs cannot be told apart.

    Each κ(H) = κ(Z)² of :func:`pycore.spectral.gram_spectrum` / :class:`ProductGramSpectrum` comes
    from singular values with absolute error ≲ p·eps·σ_max, so σ_min has relative error
    ≲ p·eps·κ(Z) and κ(H) ≲ 2p·eps·√κ(H); an RIR (a ratio of two κ's over two more) adds them up.
    With p = 4 (the LAPACK bound's modest growth factor and the QR of X) the tolerance is
    ``8·eps·Σ√κ`` over the four κ's, and never below 1e-9.  At κ(H) = 6e13 that is ~3e-8: steps of
    R_ill only that no longer move κ show RIR changes of ±1.6e-9 there, of either sign and
    different on each BLAS kernel type, which a fixed 1e-9 counted as decreases.
    """
    total = sum(np.sqrt(k) for k in (*kappas_before, *kappas_after))
    return max(1e-9, 8.0 * np.finfo(np.float64).eps * float(total))


def _r_ill_only(task, cfg, rng, progress):
    """R_ill only (docs/theory.md §7): minimise ``λ_H R_ill(H_H(θ))`` alone — no D_P loss, no
    R_well — with Algorithm 1's preconditioned step under plain GD,

        θ ← θ − η_t K_H⁺∇_θR_ill(H_H(θ)) = θ − 2η_t Π_H θG,   η_t = :func:`r_ill_only_step_size`,

    ``cfg.optimizer`` is not used (the baseline is defined by this step), nor the head ω.  The step
    budget is Ours': ``epochs × ⌈N_P / batch_size⌉`` steps.

    Guarantee (RIR ≥ 1 at every step): with ``"exact"`` preconditioning, or ``"pinv"`` from
    θ = I (θ then stays a polynomial in K_H, so Π_HθG = θG), each step is θ → θM with
    ``M = I − 2η_tG`` symmetric and sharing H_H's eigenvectors, eigenvalues
    ``1 + 2η_tσ_i/(kd²)`` (i < k), ``1 − 2η_tσ_k(1 − 1/k)/d²`` and 1 on null(H_H).  Below the
    bound all are positive and the smallest and largest sit on v_k and v₁, so κ(H_H) grows by
    exactly κ(M)² while κ(H_P) = κ(MH_PM) grows by at most κ(M)²: the RIR cannot fall.  The κ's of
    every step are recorded (exact, from the SVD of the features) and steps where the RIR fell
    (beyond :func:`rir_change_tolerance`) are counted in ``diagnostics["rir_decreases"]``.
    """
    XP, XH = task.X_P, task.X_H
    theta = _init_theta(task.D, cfg, rng)
    pre_H = Preconditioner(task.K_H, cfg.precond, cfg.ridge, XH)
    n_batches = 1 if cfg.batch_size is None else -(-XP.shape[0] // cfg.batch_size)
    hist = {"step": [], "kappa_P": [], "kappa_H": [], "rir": [], "eta": []}
    diag = {"steps": 0, "ties_H": 0, "clipped": 0, "rir_decreases": 0, "optimizer": "gd"}

    spec_P, spec_H = ProductGramSpectrum(XP), ProductGramSpectrum(XH)  # exact κ's, X factored once

    def kappas(th):
        return spec_P(th).kappa, spec_H(th).kappa

    kP0, kH0 = kappas(theta)
    prev, prev_kappas = 1.0, (kP0, kH0)
    hist["step"].append(0)
    hist["kappa_P"].append(kP0)
    hist["kappa_H"].append(kH0)
    hist["rir"].append(1.0)
    for epoch in range(1, cfg.epochs + 1):
        for _ in range(n_batches):
            Z_H = XH @ theta
            try:
                reg = hessian_regularizer(Z_H, "ill", matrices=False)
            except SpectrumError as exc:
                raise SpectrumError(f"r_ill_only: epoch {epoch}, step {diag['steps']}: {exc}") from None
            diag["ties_H"] += reg.info.tie_min
            eta = r_ill_only_step_size(reg.info, cfg)
            diag["clipped"] += eta < cfg.lr * cfg.lambda_h
            theta = theta - eta * pre_H.direction(theta, reg, Z_H)
            diag["steps"] += 1
            kP, kH = kappas(theta)
            r = (kH / kH0) / (kP / kP0)
            # a fall counts only beyond what the two measured RIRs can resolve
            diag["rir_decreases"] += r < prev * (1 - rir_change_tolerance(prev_kappas, (kP, kH)))
            prev, prev_kappas = r, (kP, kH)
            for key, val in (("step", diag["steps"]), ("kappa_P", kP), ("kappa_H", kH), ("rir", r),
                             ("eta", eta)):
                hist[key].append(val)
        if progress is not None:
            progress(epoch)
        if not np.all(np.isfinite(theta)):
            raise DivergenceError(f"r_ill_only: θ became non-finite at epoch {epoch}; lower lambda_h",
                                  parameter="lambda_h")
    return ImmunizationResult("r_ill_only", theta, None, hist, diagnostics=diag)


def _certified_steps(theta, task, cfg, lam_p, pre_P, pre_H, cert):
    """Clip each regularizer step to the corrected bounds of docs/theory.md §5 and verify κ moved.

    The R_well step is ``θ ← θ − η_P·K_P⁻¹∇R_well`` with ``η_P = min(lr·λ_P, c·bound_P)``, then
    κ(H_P) must have dropped; the R_ill step likewise must raise κ(H_H).  ``c`` =
    ``certified_safety`` < 1 keeps the step strictly inside the open interval of the theorem.
    Both sides of each check are κ(Xθ)² from the SVD of the features (one rank rule, accurate
    at any κ); a bound of 0 (a tie, where no step is safe) skips the step.
    """
    D = task.D
    cert["checked"] += 1

    def kappa(X, th):
        return gram_spectrum(X @ th, vectors=False).kappa

    if lam_p:
        reg = hessian_regularizer(task.X_P @ theta, "well")
        bound = preconditioned_r_well_step_bound(reg.info, D=D)
        eta = min(cfg.lr * lam_p, cfg.certified_safety * bound)
        cert["clipped_P"] += eta < cfg.lr * lam_p
        if eta > 0:
            new = theta - eta * pre_P(theta, reg.G)
            if not kappa(task.X_P, new) < kappa(task.X_P, theta):
                cert["violations_P"] += 1
            theta = new
        else:
            cert["skipped_P"] += 1
    reg = hessian_regularizer(task.X_H @ theta, "ill")
    bound = preconditioned_r_ill_step_bound(reg.info)
    eta = min(cfg.lr * cfg.lambda_h, cfg.certified_safety * bound)
    cert["clipped_H"] += eta < cfg.lr * cfg.lambda_h
    if eta > 0:
        new = theta - eta * pre_H(theta, reg.G)
        if not kappa(task.X_H, new) > kappa(task.X_H, theta):
            cert["violations_H"] += 1
        theta = new
    else:
        cert["skipped_H"] += 1
    return theta


# --------------------------------------------------------------------------------------------
# IMMA (bi-level)
# --------------------------------------------------------------------------------------------

def imma_inner_step_size(task: LinearTask, w: np.ndarray, cfg: ImmunizeConfig) -> float:
    """Step of the attacker's unrolled GD on θ: ``imma_inner_lr / L`` with L the Lipschitz
    constant of θ ↦ ∇_θ L_H(w, θ) = (2/N)(K_Hθww ᵀ − X_Hᵀy wᵀ), i.e. ``L = (2/N)λ_max(K_H)‖w‖²``."""
    n = task.Y_H.size
    norm = task._cache.get("norm2_X_H")
    if norm is None:  # ‖X_H‖₂ (an SVD) is a constant of the task: once, not once per step
        norm = task._cache["norm2_X_H"] = np.linalg.norm(task.X_H, 2)
    L = 2.0 / n * norm ** 2 * float(np.sum(w * w))
    return cfg.imma_inner_lr / L if L > 0 else 0.0


def imma_objective(theta, w, omega, task: LinearTask, cfg: ImmunizeConfig, bias=None, batch_P=None):
    """F(θ) = L_H(w, θ_J) − L_P(ω, θ_J) with θ_J = J unrolled attacker GD steps from θ; and ∇_θF.

    The attacker and L_H use all of D_H; ``batch_P = (X, Y)`` (default: all of D_P) is the D_P
    mini-batch of L_P.

    Each attacker step is affine in θ: ``θ_{j+1} = θ_j − α(2/N)(K_Hθ_j M − B)``, ``M = wwᵀ``,
    ``B = X_HᵀY_H wᵀ``; its adjoint maps an upstream gradient Ḡ to ``Ḡ − α(2/N)K_HḠM``, so the
    exact gradient through the unrolled steps costs J extra D×D products (reverse mode by hand).

    Both recursions stay low-rank, which is how they are computed: every step subtracts a matrix
    ``(·)wᵀ``, so ``θ_J = θ − S wᵀ`` with ``S`` (D×m) accumulated from
    ``S ← S + c(K_H(θw − S wᵀw) − X_HᵀY_H)``; the loss gradients at θ_J are ``g_h = a wᵀ`` and
    ``g_p = p ωᵀ``, and the adjoint steps only change the factor of wᵀ, ``a ← a − cK_H(a wᵀw + p ωᵀw)``.
    ∇_θF = ``a wᵀ − p ωᵀ`` is formed once, at the end: O(J·D²·m) work and one D×D product
    instead of J + 2 D×D matrices per direction (the same expressions associated through the
    head, so equal to the unrolled matrices up to round-off).
    """
    n = task.Y_H.size
    alpha = imma_inner_step_size(task, w, cfg)
    c = alpha * 2.0 / n
    b = task.X_H.T @ task.Y_H                # D×m: B = b wᵀ
    KH = task.K_H
    ww = w.T @ w                             # m×m
    tw = theta @ w                           # θw (D×m)
    S = np.zeros_like(tw)                    # θ_j = θ − S wᵀ
    for _ in range(cfg.imma_inner_steps):
        S = S + c * (KH @ (tw - S @ ww) - b)
    # L_H at θ_J (losses.mse with θ_J w = θw − S wᵀw)
    E = task.X_H @ (tw - S @ ww) - task.Y_H
    lh = float(np.sum(E * E) / E.size)
    a = task.X_H.T @ ((2.0 / E.size) * E)    # g_h = a wᵀ
    X_P, Y_P = (task.X_P, task.Y_P) if batch_P is None else batch_P
    to = theta @ omega - S @ (w.T @ omega)   # θ_J ω
    if task.loss == "mse":
        E_P = X_P @ to - Y_P
        lp = float(np.sum(E_P * E_P) / E_P.size)
        p = X_P.T @ ((2.0 / E_P.size) * E_P)  # g_p = p ωᵀ
    else:
        logits = X_P @ to + (0.0 if bias is None else bias)
        lp = float(np.mean(np.logaddexp(0.0, logits) - Y_P * logits))
        p = X_P.T @ ((expit(logits) - Y_P) / Y_P.size)
    # adjoint: Ḡ = a wᵀ − p ωᵀ, Ḡw = a wᵀw − p ωᵀw
    pw = p @ (omega.T @ w)
    for _ in range(cfg.imma_inner_steps):
        a = a - c * (KH @ (a @ ww - pw))
    return lh - lp, a @ w.T - p @ omega.T


def _imma(task, cfg, rng, progress):
    D = task.D
    theta = _init_theta(D, cfg, rng)
    omega, bias = _init_head(task, rng)
    w = rng.normal(0.0, 1.0 / np.sqrt(D), size=(D, task.Y_H.shape[1]))
    opt_t = make_optimizer(cfg.optimizer, cfg.lr, cfg.betas, cfg.adam_eps, param="θ")
    opt_w = make_optimizer(cfg.optimizer, cfg.lr, cfg.betas, cfg.adam_eps, param="w")
    opt_o = make_optimizer(cfg.optimizer, cfg.lr, cfg.betas, cfg.adam_eps, param="ω")
    opt_b = make_optimizer(cfg.optimizer, cfg.lr, cfg.betas, cfg.adam_eps, param="bias")
    hist = {"epoch": [], "objective": [], "kappa_P": [], "kappa_H": []}
    spec_P, spec_H = ProductGramSpectrum(task.X_P), ProductGramSpectrum(task.X_H)
    n_P = task.X_P.shape[0]
    x_norm = max(np.max(np.sum(np.abs(task.X_P), axis=1)), np.max(np.sum(np.abs(task.X_H), axis=1)))
    for epoch in range(1, cfg.epochs + 1):
        for idx in _batches(n_P, cfg.batch_size, rng):
            # D_P mini-batch, as Algorithm 1's loss term (no copy for the full batch)
            X_b, Y_b = (task.X_P, task.Y_P) if len(idx) == n_P else (task.X_P[idx], task.Y_P[idx])
            F, gF = imma_objective(theta, w, omega, task, cfg, bias, batch_P=(X_b, Y_b))
            # Heads: the attacker's w and the defender's ω each minimise their own loss at θ.
            _, g_w, _ = losses.mse(task.X_H, theta, w, task.Y_H, grad_theta=False)
            _, g_o, _, g_b = _loss_grads(task, X_b, Y_b, theta, omega, bias, grad_theta=False)
            theta = opt_t.step(theta, -gF, blame="lr")          # ascent on F
            check_scale(theta, x_norm, f"imma: epoch {epoch}", cfg.optimizer, cfg.lr, lambda step=None: "lr")
            w = opt_w.step(w, g_w, blame="lr")
            omega = opt_o.step(omega, g_o, blame="lr")
            if g_b is not None:
                bias = opt_b.step(bias, g_b, blame="lr")
        hist["epoch"].append(epoch)
        hist["objective"].append(F)
        hist["kappa_P"].append(spec_P(theta).kappa)
        hist["kappa_H"].append(spec_H(theta).kappa)
        if progress is not None:
            progress(epoch)
        if not np.all(np.isfinite(theta)):
            raise DivergenceError(f"imma: θ became non-finite at epoch {epoch}; lower lr", parameter="lr")
    return ImmunizationResult("imma", theta, omega, hist)


# --------------------------------------------------------------------------------------------
# Closed form (docs/theory.md §10)
# --------------------------------------------------------------------------------------------

def _closed_form(task, cfg):
    """θ = [U_r Λ_r^{-½} Q_C diag(s), 0] with s² = λ_C^a: RIR = the range-restricted ceiling.

    On range(K_P) this is ``K_P^{+½} Q_C diag(s)``: H_P = diag(s²), H_H = diag(s²λ_C).  The
    D − r columns for null(K_P) are ZERO: D_P's training rows have no component there, so
    ``X_Pθ`` spans the same space as ``X_P`` and the best D_P loss is unchanged
    (Definition 3.1(c)), while every feature direction D_P never varies in is dropped.  Any
    nonzero choice there could only push the harmful κ towards the infinite exact supremum by
    rescaling directions D_P ignores, which is exactly the loophole the range restriction excludes.
    """
    ceil = rir_ceiling(task.X_P, task.X_H)
    lam = ceil.lambda_C
    # Scale only the numerically nonzero λ_C (C's rank, the same rule as its κ); the columns of
    # C's null space keep s = 1 so that θ stays injective on range(K_P).
    s = np.ones_like(lam)
    pos = np.arange(lam.size) < ceil.rank_C
    with np.errstate(over="ignore"):  # overflow is checked on θ below
        s[pos] = lam[pos] ** (cfg.closed_form_exponent / 2)
    theta = np.zeros((task.D, task.D))
    r = ceil.basis.shape[1]
    theta[:, :r] = ceil.basis * s
    if not np.all(np.isfinite(theta)):
        raise DivergenceError(f"closed_form: λ_C^(a/2) overflows float64 at closed_form_exponent "
                              f"a = {cfg.closed_form_exponent:g} (κ(C) = {ceil.kappa_C:.3e})",
                              parameter="closed_form_exponent")
    diag = {"ceiling_range_restricted": ceil.range_restricted, "ceiling_exact": ceil.exact,
            "rank_K_P": ceil.rank_K_P, "null_columns_zeroed": task.D - r}
    return ImmunizationResult("closed_form", theta, None, {}, diagnostics=diag)


# --------------------------------------------------------------------------------------------
# Method registry: name -> runner(task, cfg, rng, progress) -> ImmunizationResult
# --------------------------------------------------------------------------------------------

def _identity(task, cfg, rng, progress):
    return ImmunizationResult("identity", np.eye(task.D), None)


def _regularized_runner(method):
    def run(task, cfg, rng, progress):
        return _regularized(task, method, cfg, rng, progress)
    run.__name__ = f"_run_{method}"
    return run


RUNNERS = {
    "identity": _identity,
    "r_ill_only": _r_ill_only,
    "imma": lambda task, cfg, rng, progress: _imma(task, cfg, rng, progress),
    "opt_kappa": _regularized_runner("opt_kappa"),
    "opt_kappa_balanced": _regularized_runner("opt_kappa_balanced"),
    "ours": _regularized_runner("ours"),
    "closed_form": lambda task, cfg, rng, progress: _closed_form(task, cfg),
}
METHODS = tuple(RUNNERS)


# The ImmunizeConfig fields each method reads (docs/cli.md: a flag that no chosen method reads
# is refused).  FIELDS_OF_EVERY_METHOD: fields that apply whatever the method; METHOD_FIELDS: the
# method's own.  Derived from the runners above and checked by tests/test_one_source.py (changing
# a field a method does not read leaves its θ bit-identical; changing one it reads moves θ).
FIELDS_OF_EVERY_METHOD: tuple[str, ...] = ("harden",)   # θ → θQ after any method (pycore.harden)
_OPTIMIZER = ("lr", "optimizer", "betas", "adam_eps")
_LOOP = ("epochs", "batch_size", "init")
METHOD_FIELDS: dict[str, tuple[str, ...]] = {
    "identity": (),
    "ours": (*_LOOP, *_OPTIMIZER, "lambda_p", "lambda_h", "precond", "ridge", "certified",
             "certified_safety"),
    # plain GD by its own step rule: cfg.optimizer, betas and adam_eps are not used
    "r_ill_only": (*_LOOP, "lr", "lambda_h", "precond", "ridge", "certified_safety"),
    "imma": (*_LOOP, *_OPTIMIZER, "imma_inner_steps", "imma_inner_lr"),
    "opt_kappa": (*_LOOP, *_OPTIMIZER, "lambda_kappa", "opt_kappa_log"),
    "opt_kappa_balanced": (*_LOOP, *_OPTIMIZER, "lambda_kappa", "opt_kappa_log"),
    "closed_form": ("closed_form_exponent",),
}


def fields_read_by(method: str) -> frozenset[str]:
    """The :class:`ImmunizeConfig` fields ``method`` reads (:data:`METHOD_FIELDS`)."""
    return frozenset(FIELDS_OF_EVERY_METHOD) | frozenset(METHOD_FIELDS[method])


def check_fields_apply(fields, methods) -> None:
    """Raise :class:`ParameterError` naming the first of ``fields`` (settings a user gave) that
    none of ``methods`` reads: a setting that silently changes nothing is a mistake to report
    (``imma_inner_steps`` with only ``ours``)."""
    methods = list(methods)
    used = frozenset().union(*(fields_read_by(m) for m in methods))
    for name in fields:
        if name not in used:
            readers = [m for m in METHODS if name in fields_read_by(m)]
            raise ParameterError(name, f"{name} is not read by the chosen method(s) {', '.join(methods)}; "
                                       f"it applies to {', '.join(readers) or 'no method'}")


def config_dict(cfg: ImmunizeConfig) -> dict:
    return asdict(cfg)


__all__ = ["METHODS", "RUNNERS", "METHOD_FIELDS", "FIELDS_OF_EVERY_METHOD", "fields_read_by",
           "check_fields_apply", "kappa_grad_H", "opt_kappa_objective", "r_ill_only_step_size",
           "ImmunizeConfig", "ImmunizationResult", "immunize", "imma_objective",
           "imma_inner_step_size", "config_dict", "replace"]
