"""The objective of each deep immunization method, term by term.

Paper Eq. (11); docs/theory.md §6-7.

With ``X`` the layer's inputs and ``Z = X Wᵀ + b`` its outputs (App. C.3), per batch pair:

* ``ours``: ``CE_ls(classifier(Z_P), y_P) + λ_P R_well(Z_PᵀZ_P) + λ_H R_ill(Z_HᵀZ_H)``;
* ``r_ill_only``: the same without R_well (ablation; the D_P loss is kept, as in Table 3);
* ``opt_kappa``: ``CE + λ_κ (log κ(Z_PᵀZ_P) − log κ(Z_HᵀZ_H))``, the Opt-κ baseline in its log form
  (eigenvalues of the smaller Gram matrix, float64, eigenvalue-only backward);
* ``imma``: ``CE − λ_imma · CE_H(w_T)``, bi-level IMMA whose lower level unrolls
  ``imma_inner_steps`` GD steps of a zero-initialised linear probe on the D_H features (the threat
  model's attacker; docs/theory.md §7's lower level fine-tunes θ, which would differentiate through
  backbone steps).

R_well / R_ill: the fused op on float64 features through the layer's preconditioned weight gradient
``grad_W (XᵀX + λI)⁻¹`` (Algorithm 1 line 6); the CE path uses the same weights
unpreconditioned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pycore._ops as ops

# "closed_form" has no objective: the layer is set to the linear closed form (pycore.deep._layer);
# the simulated-attacker methods train by pycore.deep._simulated
SIMULATED_METHODS = ("simulated", "sophon")
DEEP_METHODS = (
    "ours",
    "closed_form",
    "kstep",
    "imma",
    "opt_kappa",
    "r_ill_only",
    *SIMULATED_METHODS,
)

# Sign of each regularizer term in the minimised objective and the config field weighting it.
_SIGN = {
    "r_well": 1.0,
    "r_ill": 1.0,
    "log_kappa_gap": 1.0,
    "imma_harm": -1.0,
    "kstep_p": 1.0,
    "kstep_h": -1.0,
}
LAMBDA_OF_TERM = {
    "r_well": "lambda_p",
    "r_ill": "lambda_h",
    "log_kappa_gap": "lambda_kappa",
    "imma_harm": "lambda_imma",
    "kstep_p": "lambda_p",
    "kstep_h": "lambda_h",
}


def log_kappa(Z: torch.Tensor) -> torch.Tensor:
    """Differentiable ``log κ(ZᵀZ)`` over the nonzero spectrum (Opt-κ, float64).

    Computed from the smaller Gram matrix, rank tolerance ``λ_max · n · eps``.

    Parameters
    ----------
    Z : torch.Tensor, shape (N, D)
        The features.

    Returns
    -------
    torch.Tensor
        A scalar; NaN when no eigenvalue is above the tolerance (the loop's NaN handling).
    """
    Z = Z.double()
    G = Z @ Z.T if Z.shape[0] <= Z.shape[1] else Z.T @ Z
    ev = torch.linalg.eigvalsh(G)
    tol = ev[-1].detach() * G.shape[0] * torch.finfo(torch.float64).eps
    nz = ev[ev > tol]
    if nz.numel() == 0:
        return Z.sum() * float("nan")
    return torch.log(nz[-1]) - torch.log(nz[0])


def imma_harmful_loss(
    Z: torch.Tensor, y: torch.Tensor, num_classes: int, *, steps: int, inner_lr: float
) -> torch.Tensor:
    """IMMA's lower level: the CE of an attacker's probe after a few unrolled GD steps.

    The probe is linear and zero-initialised (with a bias column), trained ``steps`` GD steps of
    ``inner_lr / λ_max(AᵀA/N)`` on ``(Z, y)``, differentiable in ``Z`` through every step. λ_max is
    detached: the step is the attacker's choice, which no rescaling of the features games.

    Parameters
    ----------
    Z : torch.Tensor, shape (N, D)
        The harmful features.
    y : torch.Tensor of int64, shape (N,)
        Their class labels.
    num_classes : int
        The harmful task's classes.
    steps : int
        The attacker's unrolled GD steps.
    inner_lr : float
        The attacker's step, in units of 1/λ_max(AᵀA/N).

    Returns
    -------
    torch.Tensor
        The scalar cross-entropy after the steps.
    """
    Z = Z.double()
    n = Z.shape[0]
    A = torch.cat([Z, torch.ones(n, 1, dtype=Z.dtype, device=Z.device)], 1)
    eta = inner_lr / (torch.linalg.matrix_norm(A.detach(), ord=2) ** 2 / n).clamp_min(1e-300)
    Y = F.one_hot(y, num_classes).to(A.dtype)
    W = torch.zeros(A.shape[1], num_classes, dtype=A.dtype, device=A.device)
    for _ in range(steps):
        W = W - eta * (A.T @ (torch.softmax(A @ W, 1) - Y)) / n
    return F.cross_entropy(A @ W, y)


def kstep_loss(
    Z: torch.Tensor, y: torch.Tensor, *, steps: int, num_classes: int, bias: bool = True
) -> torch.Tensor:
    """E_k, the k-step remaining fraction of a GD probe on ``(Z, y)``, differentiable in ``Z``.

    The torch twin of :func:`pycore.kstep_remaining` (docs/theory.md §11), in float64, by autograd:
    ``k`` unrolled GD steps of step ``1/s_1²`` (``s_1 = ‖A‖₂``, through ``svdvals``; N cancels),
    and ``E_k = [L(W_k) − L(W*)]/[L(0) − L(W*)]`` with the least-squares solution W* detached: by
    the envelope theorem its derivative is that of ``L* = min_W L``, and both differences are
    written so that the small term ``A(W_k − W*)`` is formed directly. Where Z is rank-deficient
    the gradient is that of E_k at fixed rank; at a λ_max tie that of one of its eigenvectors.

    Parameters
    ----------
    Z : torch.Tensor, shape (N, D)
        The features.
    y : torch.Tensor of int64, shape (N,)
        Class labels (one-hot targets of ``num_classes``).
    steps : int
        k.
    num_classes : int
        The classes of the one-hot targets.
    bias : bool, default True
        The column ``c·1``, c the RMS row norm of Z, part of the graph.

    Returns
    -------
    torch.Tensor
        The scalar E_k in [0, 1].
    """
    A = Z.double()
    n = A.shape[0]
    if bias:
        c = A.pow(2).sum(1).mean().sqrt()
        A = torch.cat([A, c.expand(n, 1)], 1)
    Y = F.one_hot(y, num_classes).to(A.dtype)
    with torch.no_grad():  # W* = A⁺Y over the rank of docs/theory.md §2
        U, s, Vh = torch.linalg.svd(A, full_matrices=False)
        r = int((s > s[0] * max(A.shape) * torch.finfo(A.dtype).eps).sum())
        W_star = Vh[:r].T @ ((U[:, :r].T @ Y) / s[:r, None])
    eta = 1.0 / torch.linalg.matrix_norm(A, ord=2) ** 2
    W = torch.zeros_like(W_star)
    for _ in range(steps):
        W = W - eta * (A.T @ (A @ W - Y))
    AW_star = A @ W_star
    Ae = A @ W - AW_star  # A(W_k − W*)
    excess = 0.5 * (Ae * (Ae + 2.0 * (AW_star - Y))).sum()  # L(W_k) − L(W*), ×N
    initial = 0.5 * (AW_star * (2.0 * Y - AW_star)).sum()  # L(0) − L(W*), ×N
    return excess / initial


def _cond(Z: torch.Tensor, kind: str) -> torch.Tensor:
    """Fused-op R_kind of ``ZᵀZ`` in float64.

    NaN for non-finite ``Z`` (the loop's NaN handling).
    """
    Z = Z.double()
    if not bool(torch.isfinite(Z).all()):
        return Z.sum() * float("nan")
    return ops.cond_regularizer(Z, kind)


def loss_terms(
    model,
    method: str,
    XP,
    yP,
    XH,
    yH,
    num_classes_h: int,
    *,
    label_smoothing: float = 0.1,
    imma_inner_steps: int = 3,
    imma_inner_lr: float = 1.0,
    kstep_steps: int = 10,
) -> dict[str, torch.Tensor]:
    """The unweighted terms of a method's objective on one batch pair of the layer's inputs.

    The batch is rank-local under several processes. ``"ce"`` is D_P's cross-entropy through the
    layer without preconditioning; the other terms are the keys of :data:`LAMBDA_OF_TERM` the
    method has (``kstep``: ``log E_k`` of each task's batch, docs/theory.md §11, driven down on D_P
    and up on D_H).

    Parameters
    ----------
    model : ImmunizedNet
        The model (its layer and classifier are read).
    method : str
        One of :data:`DEEP_METHODS` (the closed form and the simulated attackers have only ``"ce"``
        here).
    XP, yP : torch.Tensor
        D_P's layer inputs and labels.
    XH, yH : torch.Tensor
        D_H's layer inputs and labels.
    num_classes_h : int
        D_H's classes.
    label_smoothing : float, default 0.1
        Of the D_P cross-entropy.
    imma_inner_steps : int, default 3
        IMMA's unrolled attacker steps (:func:`imma_harmful_loss`).
    imma_inner_lr : float, default 1.0
        IMMA's attacker step.
    kstep_steps : int, default 10
        k of the k-step terms.

    Returns
    -------
    dict of str to torch.Tensor
        ``"ce"`` and the method's terms: ``"r_well"``, ``"r_ill"``, ``"log_kappa_gap"``,
        ``"kstep_p"``, ``"kstep_h"`` or ``"imma_harm"``.
    """
    layer = model.layer
    ZP = F.linear(XP, layer.weight, layer.bias)  # CE path: no preconditioning
    terms = {"ce": F.cross_entropy(model.classifier(ZP), yP, label_smoothing=label_smoothing)}
    if method == "ours":
        terms["r_well"] = _cond(layer(XP), "well")
    if method in ("ours", "r_ill_only"):
        terms["r_ill"] = _cond(layer(XH), "ill")
    elif method == "opt_kappa":
        terms["log_kappa_gap"] = log_kappa(ZP) - log_kappa(F.linear(XH, layer.weight, layer.bias))
    elif method == "kstep":
        kw = dict(steps=kstep_steps, bias=True)
        C = model.classifier.out_features
        terms["kstep_p"] = torch.log(kstep_loss(ZP, yP, num_classes=C, **kw))
        ZH = F.linear(XH, layer.weight, layer.bias)
        terms["kstep_h"] = torch.log(kstep_loss(ZH, yH, num_classes=num_classes_h, **kw))
    elif method == "imma":
        terms["imma_harm"] = imma_harmful_loss(
            F.linear(XH, layer.weight, layer.bias),
            yH,
            num_classes_h,
            steps=imma_inner_steps,
            inner_lr=imma_inner_lr,
        )
    return terms


def combine_terms(terms: dict[str, torch.Tensor], lambdas: dict[str, float]) -> torch.Tensor:
    """``CE + Σ sign·λ·term`` in float64 (``lambdas`` keyed by config field, e.g. ``lambda_h``)."""
    loss = terms["ce"].double()
    for k, v in terms.items():
        if k != "ce":
            loss = loss + _SIGN[k] * lambdas[LAMBDA_OF_TERM[k]] * v
    return loss
