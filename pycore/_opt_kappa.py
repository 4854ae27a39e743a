"""Opt κ (docs/theory.md §7): Adam on ``λ_κ(w_Pκ(H_P) − w_Hκ(H_H))`` beside the D_P loss.

It runs Algorithm 1's fixed-λ loop (:func:`pycore._algorithm1.fixed_lambda_loop`) with the κ
terms of :class:`KappaTerms` in place of the regularizers; ``"opt_kappa_balanced"`` weighs the
harmful term so that both θ-gradients have one norm at the initial θ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pycore._algorithm1 import fixed_lambda_loop
from pycore._linear_options import AdamOptions
from pycore._registry import Method
from pycore._regularizers import hessian_regularizer


@dataclass(frozen=True)
class OptKappaOptions(AdamOptions):
    """Opt κ (docs/theory.md §7): the weight of κ(H_P) − κ(H_H), on κ or (``log``) log κ."""

    lambda_kappa: float = 1.0
    log: bool = False


def _kappa_weights(sigma_max, sigma_min, kappa, log):
    """``(a, b)`` of ``∂κ/∂H = a·v₁v₁ᵀ − b·v_kv_kᵀ`` (docs/theory.md §7).

    With ``log``, those of ∂ log κ/∂H. Numbers, or one per run.
    """
    if log:
        return 1.0 / sigma_max, 1.0 / sigma_min
    return 1.0 / sigma_min, kappa / sigma_min


def _kappa_parts(gram, f, weight, log):
    """``weight ×`` the θ-gradient of κ(H) (or log κ) of every run as (L, R) factors.

    docs/theory.md §7: ``∂κ/∂H = a·v₁v₁ᵀ − b·v_kv_kᵀ`` and ``∇_θ = 2Kθ(∂κ/∂H)``, with
    ``Kθv = V diag(s) (Fv)``: O(r·D) work per vector, no D×D product.
    """
    a, b = _kappa_weights(gram.sigma_max, gram.sigma_min, gram.kappa, log)
    v1, vk = gram.v(0), gram.v(gram.rank - 1)
    V = np.stack([v1, vk], axis=2)  # B×D×2
    KtV = f.V @ (f.s[:, None] * (gram.F @ V))
    w = 2.0 * np.asarray(weight, dtype=np.float64)
    coef = np.stack([w * a, -w * b], axis=1)  # B×2
    return KtV * coef[:, None, :], V.mT


def _kappa_theta_grads(reg_P, reg_H, X_P, X_H, Z_P, Z_H, log):
    """θ-gradients of κ(H_P), κ(H_H) or of log κ (docs/theory.md §7).

    ∂κ/∂H = a·v₁v₁ᵀ − b·v_kv_kᵀ, so 2XᵀZ(∂κ/∂H) is O(N·D) work, no D×D product.
    """

    def grad(reg, X, Z):
        i = reg.info
        v1, vk = reg.vector(0), reg.vector(i.rank - 1)
        a, b = _kappa_weights(i.sigma_max, i.sigma_min, i.kappa, log)
        return 2.0 * (a * np.outer(X.T @ (Z @ v1), v1) - b * np.outer(X.T @ (Z @ vk), vk))

    return grad(reg_P, X_P, Z_P), grad(reg_H, X_H, Z_H)


def opt_kappa_objective(theta, X_P, X_H, *, weights=(1.0, 1.0), log: bool = False):
    """Opt κ's objective ``w_P κ(H_P(θ)) − w_H κ(H_H(θ))`` (or on log κ) and its θ-gradients.

    docs/theory.md §7: ``∂κ/∂H = a·v₁v₁ᵀ − b·v_kv_kᵀ``, so each θ-gradient is O(N·D) work past the
    SVD, no D×D product.

    Parameters
    ----------
    theta : array_like, shape (D, D)
        The feature extractor.
    X_P, X_H : ndarray, shape (N_P, D) and (N_H, D)
        The rows of D_P and D_H.
    weights : pair of float, default (1.0, 1.0)
        ``(w_P, w_H)``.
    log : bool, default False
        On log κ instead of κ.

    Returns
    -------
    value : float
        The objective.
    grad : ndarray, shape (D, D)
        Its θ-gradient.
    parts : tuple of ndarray
        The unweighted θ-gradients of κ(H_P) and κ(H_H) (or of their logs).

    Raises
    ------
    SpectrumError
        A task's features have no condition number (they are zero).
    """
    theta = np.asarray(theta, dtype=np.float64)
    Z_P, Z_H = X_P @ theta, X_H @ theta
    reg_P, reg_H = hessian_regularizer(Z_P, "well"), hessian_regularizer(Z_H, "well")
    f = np.log if log else (lambda x: x)
    value = weights[0] * f(reg_P.info.kappa) - weights[1] * f(reg_H.info.kappa)
    g_P, g_H = _kappa_theta_grads(reg_P, reg_H, X_P, X_H, Z_P, Z_H, log)
    return float(value), weights[0] * g_P - weights[1] * g_H, (g_P, g_H)


class KappaTerms:
    """Opt κ's θ-gradient terms beside the D_P loss's, for the fixed-λ loop.

    ``λ_κ w_P ∇_θκ(H_P)`` and ``−λ_κ w_H ∇_θκ(H_H)`` as low-rank factors; ``w_P = 1`` and
    ``w_H = 1``, or (``balanced``) ``w_H = ‖∇_θκ(H_P)‖/‖∇_θκ(H_H)‖`` at each run's initial θ.
    The interface is :class:`pycore._algorithm1.RegularizerTerms`'.
    """

    certified = False

    @staticmethod
    def restrict(o) -> bool:
        return True

    balanced = False

    def __init__(self, task, inp, o, theta0, diags):
        self.inp, self.o = inp, o
        self.w_P, self.w_H = 1.0, np.ones(len(diags))
        for b, (th, d) in enumerate(zip(theta0, diags)):
            _, _, (g_P0, g_H0) = opt_kappa_objective(th, task.X_P, task.X_H, log=o.log)
            ratio = float(np.linalg.norm(g_H0) / np.linalg.norm(g_P0))
            d["kappa_grad_ratio_H_over_P_at_init"] = ratio
            if self.balanced:
                self.w_H[b] = 1.0 / ratio
            d["kappa_weights"] = [self.w_P, float(self.w_H[b])]

    def parts(self, theta, gram_P, gram_H, where):
        lk, log = self.o.lambda_kappa, self.o.log
        parts = [
            _kappa_parts(gram_P, self.inp.factor_P, lk * self.w_P, log),
            _kappa_parts(gram_H, self.inp.factor_H, -lk * self.w_H, log),
        ]
        return parts, ("lambda_kappa", "lambda_kappa")

    def finish(self, diags):
        pass


class BalancedKappaTerms(KappaTerms):
    """:class:`KappaTerms` with ``w_H`` balancing the two θ-gradients at the initial θ."""

    balanced = True


def opt_kappa(task, o, rngs):
    """Opt κ: the fixed-λ loop on the κ terms."""
    return fixed_lambda_loop(task, "opt_kappa", o, rngs, KappaTerms)


def opt_kappa_balanced(task, o, rngs):
    """Opt κ with the harmful term weighed to the pre-training term's gradient norm."""
    return fixed_lambda_loop(task, "opt_kappa_balanced", o, rngs, BalancedKappaTerms)


OPT_KAPPA = Method("opt_kappa", "Opt κ", OptKappaOptions, opt_kappa, work=(21, 5), in_tables=True)
OPT_KAPPA_BALANCED = Method(
    "opt_kappa_balanced",
    "Opt κ (balanced)",
    OptKappaOptions,
    opt_kappa_balanced,
    work=(21, 5),
    in_tables=True,
)
