"""Immunization of deep extractors (paper Eq. (11), Algorithm 1 transposed to deep nets, §5.2).

Per step, with a D_P batch ``(x_P, y_P)`` and a D_H batch ``x_H`` (paired loader, App. C.2):

* ``X = pooled(tail(trunk(x)))`` are the pre-layer features, ``Z = X Wᵀ + b`` the output of
  the identity-initialised immunization layer (App. C.3);
* ``ours``:       ``CE_ls(classifier(Z_P), y_P) + λ_P R_well(Z_PᵀZ_P) + λ_H R_ill(Z_HᵀZ_H)``;
* ``r_ill_only``: the same without the R_well term (ablation; the D_P loss is kept so that
  D_P accuracy stays comparable, as in the paper's Table 3);
* ``opt_kappa``:  ``CE + λ_κ (log κ(Z_PᵀZ_P) − log κ(Z_HᵀZ_H))`` -- the Opt-κ baseline (SPEC §7)
  in its documented log form, through ``torch.linalg.eigvalsh`` of the smaller Gram matrix in
  float64 (eigenvalue-only backward ``∂λ/∂G = vvᵀ``, no eigenvector-gap terms);
* ``imma``:       ``CE − λ_imma · CE_H(w_T)`` -- bi-level IMMA (Zheng & Yeh 2024): the lower
  level unrolls ``imma_inner_steps`` gradient steps of a zero-initialised linear probe ``w``
  on the D_H batch features (step ``imma_inner_lr / λ_max(AᵀA/N)``, the attacker of
  :func:`pycore.deep.metrics.linear_probe_curve`); the upper level maximises the harmful loss
  after those steps, differentiating through them.  A deliberate adaptation of SPEC §7 (whose
  lower level fine-tunes θ, as :func:`pycore.immunize.imma_objective` does for linear models):
  unrolling steps of the whole trainable tail would differentiate through several backbone
  fine-tuning steps per update, while the probe is exactly the attacker of the threat model;
  the D_P loss is the plain CE at θ, not at the attacked parameters.

R_well / R_ill are evaluated by the fused op :func:`pycore.ops.cond_regularizer` on float64
features (SPEC §3; DESIGN §2). The regularizer paths go through the immunization layer with
the preconditioned weight gradient ``grad_W (XᵀX + λI)⁻¹`` (Algorithm 1 line 6, with the ridge
of App. C.3) where ``X`` is that batch's own pre-layer features; the CE path uses the same
weights *without* preconditioning (Algorithm 1 does not precondition ``∇_θ L``).

Optimiser (SPEC §9): SGD, Nesterov momentum 0.9, weight decay 0 on the extractor and 2e-5 on
the classifier. The whole model stays in eval mode: normalisation statistics and dropout are
part of θ₀, and the regularizers then shape exactly the features that RIR_θ₀ measures.

Distributed (``torchrun``): DistributedDataParallel averages gradients across ranks. Each
rank evaluates R_well / R_ill on its OWN batch (per-rank Hessians ``Z_rᵀZ_r``), so a W-rank
run optimises the mean over ranks of per-rank regularizers, not the regularizer of the
concatenated global batch. ``virtual_ranks=W`` reproduces exactly this objective in one
process (same shards, mean of per-shard losses), which is how the 2-process test checks DDP.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from pycore.deep._ops import ops
from pycore.deep.data import PairedBatches, ShardedBatches, fetch
from pycore.deep.models import ImmunizableModel, save_immunized

__all__ = [
    "METHODS", "ImmunizeConfig", "ImmunizeResult", "NonFiniteLossError", "immunize",
    "cache_trunk", "train_classifier", "log_kappa", "imma_harmful_loss", "loss_terms",
]

METHODS = ("ours", "r_ill_only", "imma", "opt_kappa")


class NonFiniteLossError(FloatingPointError):
    """The immunization loss (or its gradient) became NaN/Inf; the model keeps the last good step."""

    def __init__(self, message: str, step: int, checkpoint: "str | None"):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class ImmunizeConfig:
    """Hyper-parameters of deep immunization (defaults: paper Table 4, ResNet18 vs Cars)."""

    method: str = "ours"
    epochs: int = 1                 # epochs of the paired loader (longer task sets the length)
    max_steps: "int | None" = None
    batch_size: int = 64            # per rank
    lr: float = 1e-5
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay_extractor: float = 0.0
    weight_decay_classifier: float = 2e-5
    label_smoothing: float = 0.1
    lambda_p: float = 5e-5          # R_well weight
    lambda_h: float = 2e6           # R_ill weight
    lambda_kappa: float = 1.0       # Opt-κ weight
    lambda_imma: float = 1.0        # IMMA harmful-loss weight
    balance: "float | None" = None  # if set: λ := balance·‖∇CE‖/‖∇term‖ at step 0 (App. C.2)
    imma_inner_steps: int = 3
    imma_inner_lr: float = 1.0      # in units of 1/λ_max(AᵀA/N)
    ridge_rel: "float | None" = 1e-6  # preconditioner ridge λ relative to tr(XᵀX)/N; None: keep the layer's
    seed: int = 0
    virtual_ranks: int = 1
    checkpoint_dir: "str | None" = None
    progress: bool = True

    def validate(self) -> "ImmunizeConfig":
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {METHODS}")
        for name in ("lr", "batch_size", "epochs", "virtual_ranks"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        return self


@dataclass
class ImmunizeResult:
    method: str
    steps: int
    wall_seconds: float
    lambdas: dict
    history: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# --- loss pieces ------------------------------------------------------------------------------

def log_kappa(Z: torch.Tensor) -> torch.Tensor:
    """Differentiable ``log κ(ZᵀZ)`` over the nonzero spectrum (Opt-κ baseline, float64).

    Uses the eigenvalues of the smaller Gram matrix (``ZZᵀ`` when N < D: same nonzero
    spectrum), rank tolerance ``λ_max · n · eps`` as in :mod:`pycore.spectral`.
    """
    Z = Z.double()
    G = Z @ Z.T if Z.shape[0] <= Z.shape[1] else Z.T @ Z
    ev = torch.linalg.eigvalsh(G)
    tol = ev[-1].detach() * G.shape[0] * torch.finfo(torch.float64).eps
    nz = ev[ev > tol]
    return torch.log(nz[-1]) - torch.log(nz[0])


def imma_harmful_loss(Z: torch.Tensor, y: torch.Tensor, num_classes: int, *, steps: int,
                      inner_lr: float) -> torch.Tensor:
    """IMMA lower level: CE of a linear probe after ``steps`` unrolled GD steps on ``(Z, y)``.

    Zero-initialised probe with a bias column; step ``inner_lr / λ_max(AᵀA/N)`` (λ_max
    detached: the step size is the attacker's choice, not something the extractor can game
    by rescaling). The returned loss is differentiable w.r.t. ``Z`` through every step.
    """
    Z = Z.double()
    n = Z.shape[0]
    A = torch.cat([Z, torch.ones(n, 1, dtype=Z.dtype, device=Z.device)], 1)
    L = (torch.linalg.matrix_norm(A.detach(), ord=2) ** 2 / n).clamp_min(1e-300)
    eta = inner_lr / L
    Y = F.one_hot(y, num_classes).to(A.dtype)
    W = torch.zeros(A.shape[1], num_classes, dtype=A.dtype, device=A.device)
    for _ in range(steps):
        W = W - eta * (A.T @ (torch.softmax(A @ W, 1) - Y)) / n
    return F.cross_entropy(A @ W, y)


def _cond(Z: torch.Tensor, kind: str) -> torch.Tensor:
    """Fused-op R_ill / R_well of ``ZᵀZ`` in float64; NaN (not an exception) for non-finite ``Z``
    so that the training loop's NaN handling (stop at the last good step, report it) takes over."""
    Z = Z.double()
    if not bool(torch.isfinite(Z).all()):
        return Z.sum() * float("nan")
    return ops().cond_regularizer(Z, kind)


def loss_terms(model: ImmunizableModel, cfg: ImmunizeConfig, hP, yP, hH, yH,
               num_classes_h: int) -> dict[str, torch.Tensor]:
    """The unweighted terms of the method's objective on one (rank-local) batch pair."""
    cond = _cond
    layer = model.layer
    XP = model.pooled(hP)
    ZP = F.linear(XP, layer.weight, layer.bias)          # CE path: no preconditioning
    terms = {"ce": F.cross_entropy(model.classifier(ZP), yP, label_smoothing=cfg.label_smoothing)}
    m = cfg.method
    if m == "ours":
        terms["r_well"] = cond(layer(XP), "well")
    if m in ("ours", "r_ill_only"):
        terms["r_ill"] = cond(layer(model.pooled(hH)), "ill")
    elif m == "opt_kappa":
        ZH = F.linear(model.pooled(hH), layer.weight, layer.bias)
        terms["log_kappa_gap"] = log_kappa(ZP) - log_kappa(ZH)
    elif m == "imma":
        ZH = F.linear(model.pooled(hH), layer.weight, layer.bias)
        terms["imma_harm"] = imma_harmful_loss(ZH, yH, num_classes_h, steps=cfg.imma_inner_steps,
                                               inner_lr=cfg.imma_inner_lr)
    return terms


_SIGN = {"r_well": 1.0, "r_ill": 1.0, "log_kappa_gap": 1.0, "imma_harm": -1.0}
_LAMBDA_KEY = {"r_well": "lambda_p", "r_ill": "lambda_h", "log_kappa_gap": "lambda_kappa",
               "imma_harm": "lambda_imma"}


def _combine(terms: dict[str, torch.Tensor], lambdas: dict[str, float]) -> torch.Tensor:
    loss = terms["ce"].double()
    for k, v in terms.items():
        if k != "ce":
            loss = loss + _SIGN[k] * lambdas[_LAMBDA_KEY[k]] * v
    return loss


_OP_ERROR_PREFIXES = ("cond_regularizer:", "ImmunizationHead")


def _any_rank(flag: bool, world: int, device) -> bool:
    """True on every rank when ``flag`` is True on any rank (one all-reduce; no-op when world = 1)."""
    if world <= 1:
        return flag
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


class _Objective(nn.Module):
    """forward(shards) -> mean over shards of the weighted loss (what DDP wraps)."""

    def __init__(self, model: ImmunizableModel, cfg: ImmunizeConfig, num_classes_h: int):
        super().__init__()
        self.model, self.cfg, self.num_classes_h = model, cfg, num_classes_h
        self.lambdas: dict[str, float] = {}

    def forward(self, batches):
        total, logs = 0.0, {}
        for hP, yP, hH, yH in batches:
            t = loss_terms(self.model, self.cfg, hP, yP, hH, yH, self.num_classes_h)
            total = total + _combine(t, self.lambdas)
            for k, v in t.items():
                logs[k] = logs.get(k, 0.0) + float(v.detach()) / len(batches)
        return total / len(batches), logs


# --- helpers ----------------------------------------------------------------------------------

@torch.no_grad()
def cache_trunk(model: ImmunizableModel, data: Dataset, *, batch_size: int = 256,
                device: "torch.device | str" = "cpu") -> TensorDataset:
    """Run the frozen trunk once over ``data`` (eval mode): ``TensorDataset(h, y)``.

    Exact only because the trunk is frozen, in eval mode, and the inputs are deterministic
    (no random augmentation); the immunization then trains the tail on these tensors.
    """
    if not model.trunk_is_frozen():
        raise RuntimeError("cache_trunk needs a frozen trunk (call model.set_trainable() first)")
    was = model.training
    model.eval()
    hs, ys = [], []
    try:
        for s in range(0, len(data), batch_size):
            x, y = fetch(data, torch.arange(s, min(s + batch_size, len(data))))
            hs.append(model.trunk(x.to(device)).cpu())
            ys.append(y)
    finally:
        model.train(was)
    return TensorDataset(torch.cat(hs), torch.cat(ys))


def train_classifier(model: nn.Module, data: Dataset, *, epochs: int, batch_size: int = 64,
                     lr: float = 1e-3, weight_decay: float = 1e-4, label_smoothing: float = 0.1,
                     seed: int = 0, device: "torch.device | str" = "cpu",
                     progress: bool = False) -> list[float]:
    """Plain supervised training of the whole model (makes θ₀ for the demo).

    AdamW with a one-cycle schedule and the same label-smoothing CE that immunization uses
    (a θ₀ trained without it is over-confident, and the smoothed loss then starts with large
    gradients that wreck D_P accuracy in the first immunization steps). BatchNorm statistics
    are re-estimated for the final weights (:func:`recalibrate_batchnorm`).
    """
    model.to(device).train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    batches = ShardedBatches(len(data), batch_size, seed=seed)
    total = epochs * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.2)
    losses = []
    it = _progress(range(total), progress, "θ₀ training")
    step = 0
    for e in range(epochs):
        for (idx,) in batches.epoch(e):
            x, y = fetch(data, idx)
            loss = F.cross_entropy(model(x.to(device)), y.to(device), label_smoothing=label_smoothing)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"θ₀ training diverged (loss {float(loss)}) at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step += 1
            it.update(1) if hasattr(it, "update") else None
    if hasattr(it, "close"):
        it.close()
    recalibrate_batchnorm(model, data, batch_size=batch_size, device=device)
    model.eval()
    return losses


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, data: Dataset, *, batch_size: int = 64,
                          device: "torch.device | str" = "cpu") -> int:
    """Re-estimate BatchNorm running statistics for the FINAL weights (cumulative average).

    The exponential running averages kept during training lag behind the weights; eval-mode
    features (the ones RIR measures and immunization trains) are then off-distribution and the
    eval-mode loss surface is needlessly sharp. One pass in train mode with ``momentum=None``
    gives the exact average of per-batch statistics. Returns the number of BN layers reset.
    """
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return 0
    saved = [(m, m.momentum) for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    was = model.training
    model.train()
    try:
        for s in range(0, len(data) - batch_size + 1, batch_size):
            x, _ = fetch(data, torch.arange(s, s + batch_size))
            model(x.to(device))
    finally:
        for m, mom in saved:
            m.momentum = mom
        model.train(was)
    return len(bns)


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return iterable
    import sys  # noqa: PLC0415

    return tqdm(iterable, desc=desc, disable=not sys.stderr.isatty(), leave=False)


def _grad_vector(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p in params])


def _balance_lambdas(obj: _Objective, params, batches, cfg: ImmunizeConfig) -> dict[str, float]:
    """λ_term = balance · ‖∇CE‖ / ‖∇term‖ on the extractor parameters (paper App. C.2:
    "we choose λ_P and λ_H by balancing the gradient norm"), on the step-0 batches."""
    grads: dict[str, torch.Tensor] = {}
    for hP, yP, hH, yH in batches:
        t = loss_terms(obj.model, cfg, hP, yP, hH, yH, obj.num_classes_h)
        for k, v in t.items():
            for p in params:
                p.grad = None
            v.backward(retain_graph=True)
            g = _grad_vector(params) / len(batches)
            grads[k] = grads.get(k, 0) + g
    for p in obj.model.parameters():
        p.grad = None
    ce = float(grads["ce"].norm())
    out = {}
    for k, g in grads.items():
        if k == "ce":
            continue
        n = float(g.norm())
        if not (math.isfinite(n) and n > 0):
            raise FloatingPointError(f"cannot balance λ for {k}: its gradient norm is {n}")
        out[_LAMBDA_KEY[k]] = cfg.balance * ce / n
    return out


# --- the loop ---------------------------------------------------------------------------------

def immunize(model: ImmunizableModel, p_train: Dataset, h_train: Dataset, cfg: ImmunizeConfig, *,
             num_classes_h: int, from_trunk: bool = False, device: "torch.device | str" = "cpu",
             rank: int = 0, world: int = 1, ddp: bool = False) -> ImmunizeResult:
    """Immunize ``model`` in place (paper Eq. (11)); returns the loss history and λ's used.

    ``p_train`` / ``h_train`` yield ``(x, y)``; with ``from_trunk=True`` they hold cached trunk
    outputs (:func:`cache_trunk`). Under ``torchrun`` pass ``rank``/``world`` and ``ddp=True``
    (the process group must be initialised); each rank then trains on its own shard of every
    global batch and DDP averages the gradients.

    Raises :class:`NonFiniteLossError` if the loss or gradient becomes NaN/Inf (or the op refuses
    non-finite features): that step's update is not applied, so the model keeps the parameters
    of the last good step, which are written to ``checkpoint_dir`` when set. Under torchrun all
    ranks agree on the failure (all-reduce of a flag); an exception raised inside the op on one
    rank is re-raised as is, since the other ranks cannot be told.
    """
    cfg.validate()
    if world > 1 and cfg.virtual_ranks > 1:
        raise ValueError("virtual_ranks emulates a multi-rank run in ONE process; "
                         "do not combine it with torchrun")
    model.to(device)
    ext_params, cls_params = model.set_trainable()
    if not from_trunk and not model.trunk_is_frozen():  # pragma: no cover - set_trainable guarantees it
        raise RuntimeError("trunk must be frozen")
    model.eval()  # see module docstring: normalisation statistics belong to θ₀
    obj = _Objective(model, cfg, num_classes_h)
    shards = max(world, cfg.virtual_ranks)
    pb = PairedBatches(ShardedBatches(len(p_train), cfg.batch_size, seed=cfg.seed, world=shards),
                       ShardedBatches(len(h_train), cfg.batch_size, seed=cfg.seed + 1, world=shards))
    mine = [rank] if world > 1 else list(range(shards))

    def load(step_shards, ranks):
        (sp, sh) = step_shards
        out = []
        for r in ranks:
            xP, yP = fetch(p_train, sp[r])
            xH, yH = fetch(h_train, sh[r])
            xP, xH = xP.to(device), xH.to(device)
            if not from_trunk:
                with torch.no_grad():
                    xP, xH = model.trunk(xP), model.trunk(xH)
            out.append((xP, yP.to(device), xH, yH.to(device)))
        return out

    lambdas = {k: getattr(cfg, k) for k in ("lambda_p", "lambda_h", "lambda_kappa", "lambda_imma")}
    first = next(iter(pb.epoch(0)))
    if cfg.ridge_rel is not None and hasattr(model.layer, "lambda_reg"):
        # Scale-aware ridge of the preconditioner (XᵀX + λI)⁻¹: λ = ridge_rel · tr(XᵀX)/N on
        # the step-0 D_P batch, i.e. relative to the mean squared feature norm (an absolute λ
        # means nothing for features whose scale depends on the backbone).
        with torch.no_grad():
            X = model.pooled(load(first, [0])[0][0]).double()
        model.layer.lambda_reg = float(cfg.ridge_rel * (X * X).sum() / X.shape[0])
    lambdas["ridge"] = float(getattr(model.layer, "lambda_reg", float("nan")))
    if cfg.balance is not None:
        # Every rank computes the same λ from ALL shards of step 0 (no communication needed).
        lambdas.update(_balance_lambdas(obj, ext_params, load(first, range(shards)), cfg))
    obj.lambdas = lambdas

    runner: nn.Module = obj
    if ddp and world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

        import inspect  # noqa: PLC0415

        # Buffers (BN statistics) are frozen in eval mode and identical on every rank: no need
        # to re-broadcast them each forward (the keyword was renamed in recent torch).
        sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                else {"broadcast_buffers": False})
        dev = torch.device(device)
        runner = DDP(obj, device_ids=[dev.index] if dev.type == "cuda" else None, **sync)
    opt = torch.optim.SGD(
        [{"params": ext_params, "weight_decay": cfg.weight_decay_extractor},
         {"params": cls_params, "weight_decay": cfg.weight_decay_classifier}],
        lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    trainable = ext_params + cls_params
    total = len(pb) * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, len(pb) * cfg.epochs)
    history: dict[str, list] = {"loss": [], "step_seconds": []}
    bar = _progress(range(total), cfg.progress and rank == 0, f"immunize[{cfg.method}]")
    t0 = time.perf_counter()
    step = 0
    for epoch in range(cfg.epochs):
        for pair in pb.epoch(epoch):
            if step >= total:
                break
            ts = time.perf_counter()
            batches = load(pair, mine)
            opt.zero_grad(set_to_none=True)
            failure = ""
            try:
                loss, logs = runner(batches)
                # Ranks agree on a non-finite loss BEFORE the backward: DDP all-reduces gradients
                # inside backward(), so a rank that skipped it would desynchronise the collectives.
                bad = _any_rank(not bool(torch.isfinite(loss)), world, device)
                if not bad:
                    loss.backward()
                    bad = not all(bool(torch.isfinite(p.grad).all()) for p in trainable if p.grad is not None)
            except RuntimeError as exc:
                # The op refuses overflowing features and a singular preconditioner with its own
                # message; treat that like a NaN loss (stop and report the step).  Anything else
                # (a shape error, an op without a kernel for this device) is a bug: re-raise it.
                if world > 1 or not str(exc).lstrip().startswith(_OP_ERROR_PREFIXES):
                    raise
                failure = str(exc).strip().splitlines()[0]
                loss, logs, bad = torch.tensor(float("nan")), {}, True
            if world > 1:
                import torch.distributed as dist  # noqa: PLC0415

                bad = _any_rank(bad, world, device)
                vals = torch.tensor([float(loss.detach())] + [logs[k] for k in sorted(logs)],
                                    dtype=torch.float64, device=device)
                dist.all_reduce(vals)
                vals /= world
                loss_val = float(vals[0])
                logs = {k: float(v) for k, v in zip(sorted(logs), vals[1:].tolist())}
            else:
                loss_val = float(loss.detach())
            if bad:
                # The failing step's update is never applied (the check precedes opt.step), so
                # the model still holds the last good parameters: save them and stop.
                opt.zero_grad(set_to_none=True)
                ckpt = None
                if cfg.checkpoint_dir and rank == 0:
                    path = os.path.join(cfg.checkpoint_dir, f"last_good_{cfg.method}.safetensors")
                    ckpt = save_immunized(model, path,
                                          num_classes=model.classifier.out_features,
                                          extra={"step": step, "reason": "non-finite loss"})
                terms = failure or ", ".join(f"{k}={v:.3g}" for k, v in logs.items())
                raise NonFiniteLossError(
                    f"[{cfg.method}] non-finite loss or gradient at step {step} ({terms}); stopped, "
                    f"the model keeps its state after step {step - 1}"
                    + (f", saved to {ckpt}" if ckpt else ""),
                    step, ckpt)
            opt.step()
            history["loss"].append(loss_val)
            for k, v in logs.items():
                history.setdefault(k, []).append(v)
            history["step_seconds"].append(time.perf_counter() - ts)
            step += 1
            if hasattr(bar, "update"):
                bar.update(1)
        if step >= total:
            break
    if hasattr(bar, "close"):
        bar.close()
    for p in model.parameters():
        p.requires_grad_(False)
    return ImmunizeResult(cfg.method, step, time.perf_counter() - t0, lambdas, history, asdict(cfg))
