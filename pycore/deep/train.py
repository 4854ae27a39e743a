"""Immunization of deep extractors: the training loop (paper Eq. (11), Algorithm 1 on deep nets, §5.2).

The objective of each method is built term by term in :mod:`pycore.deep.objectives`; this
module runs it. One call of :func:`immunize` is, in order:

1. the paired, sharded batches of D_P and D_H (:class:`_Batches`, paper App. C.2);
2. the preconditioner ridge, calibrated on the first D_P batch (:func:`calibrate_ridge`);
3. per step: the terms (:class:`_Objective`), the λ's (fixed, or balanced against the CE
   gradient -- :func:`balanced_lambdas` -- at step 0 or every ``balance_every`` steps), one
   backward and one SGD step (:func:`_train_step`), with the NaN agreement across ranks;
4. on a non-finite loss or gradient: stop, save the last good model (:func:`_stop`).

Optimiser (docs/theory.md §9): SGD, Nesterov momentum 0.9, weight decay 0 on the extractor and
2e-5 on the classifier. The whole model stays in eval mode: normalisation statistics and
dropout are part of θ₀, and the regularizers then shape exactly the features that RIR_θ₀
measures.

λ balancing (paper App. C.2: "we choose λ_P and λ_H by balancing the gradient norm"): with
``balance = b`` every regularizer term gets ``λ = b · ‖∇CE‖ / ‖∇term‖`` on the extractor
parameters (everything immunization trains but the classifier), so each term moves the
extractor as hard as the D_P loss does. Each balancing costs one extra gradient per term:
negligible when only the immunization layer is trained (scope ``"layer"``), several plain
steps when the backbone tail is (bench/bench_deepnet.py). The paper balances
once; R_ill's gradient grows like ``1/d²`` as it works (docs/theory.md §3), so a λ fixed at
step 0 soon lets it swamp everything else or fade. ``balance_every = s`` re-balances every
``s`` steps; the same rule then holds for every method, which is what makes the comparison
of methods fair (no per-method λ).

Distributed (``torchrun``): DistributedDataParallel averages gradients across ranks. Each
rank evaluates R_well / R_ill on its OWN batch (per-rank Hessians ``Z_rᵀZ_r``), so a W-rank
run optimises the mean over ranks of per-rank regularizers, not the regularizer of the
concatenated global batch. ``virtual_ranks=W`` reproduces exactly this objective in one
process (same shards, mean of per-shard losses), which is how the 2-process test checks DDP.
Balancing uses the gradient of that mean objective (per-rank term gradients all-reduced), so
every rank gets the same λ's.
"""
from __future__ import annotations

import inspect
import math
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from pycore.deep.data import PairedBatches, ShardedBatches, fetch
from pycore.deep.harden import HARDENINGS, harden
from pycore.deep.models import ImmunizableModel, save_immunized
from pycore.deep.objectives import DEEP_METHODS, LAMBDA_OF_TERM, combine_terms, loss_terms
from pycore.report import progress
from pycore.validation import PicklableError

__all__ = [
    "DEEP_METHODS", "DeepImmunizeConfig", "DeepImmunizationResult", "NonFiniteLossError",
    "immunize", "balanced_lambdas", "calibrate_ridge", "cache_trunk", "train_classifier",
    "recalibrate_batchnorm", "random_shift",
]


class NonFiniteLossError(PicklableError, FloatingPointError):
    """The immunization loss (or its gradient) became NaN/Inf; the model keeps the last good step."""

    def __init__(self, message: str, step: int, checkpoint: "str | None"):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


@dataclass
class DeepImmunizeConfig:
    """Hyper-parameters of deep immunization (defaults: paper Table 4, ResNet18 vs Cars).

    The linear twin is :class:`pycore.immunize.ImmunizeConfig`.
    """

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
    balance: "float | None" = None  # if set: λ := balance·‖∇CE‖/‖∇term‖ (App. C.2), overrides lambda_*
    balance_every: int = 0          # 0: balance at step 0 only; s > 0: every s steps
    balance_ill: "float | None" = None  # balance of the R_ill term alone (ours, r_ill_only); None: balance
    imma_inner_steps: int = 3
    imma_inner_lr: float = 1.0      # in units of 1/λ_max(AᵀA/N)
    ridge_rel: "float | None" = 1e-6  # preconditioner ridge λ relative to tr(XᵀX)/N; None: keep the layer's
    seed: int = 0
    virtual_ranks: int = 1
    checkpoint_dir: "str | None" = None
    progress: bool = True
    # Hardening of the immunization layer after training (pycore.deep.harden): every method alike.
    harden: str = "none"            # "none" | "rotate" | "label_subspace"
    harden_scale: float = 0.01      # label_subspace: factor on D_H's class-mean directions

    def validate(self) -> "DeepImmunizeConfig":
        if self.method not in DEEP_METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {DEEP_METHODS}")
        for name in ("lr", "batch_size", "epochs", "virtual_ranks"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.balance is not None and not (math.isfinite(self.balance) and self.balance > 0):
            raise ValueError(f"balance must be a finite number > 0, got {self.balance}")
        if self.balance_every < 0:
            raise ValueError(f"balance_every must be >= 0, got {self.balance_every}")
        if self.balance_ill is not None:
            if self.balance is None:
                raise ValueError("balance_ill needs balance (it re-weights the balanced R_ill term)")
            if not (math.isfinite(self.balance_ill) and self.balance_ill > 0):
                raise ValueError(f"balance_ill must be a finite number > 0, got {self.balance_ill}")
        if self.harden not in HARDENINGS:
            raise ValueError(f"unknown hardening {self.harden!r}; choose one of {HARDENINGS}")
        if not (math.isfinite(self.harden_scale) and 0 < self.harden_scale <= 1):
            raise ValueError(f"harden_scale must be in (0, 1], got {self.harden_scale}")
        return self


@dataclass
class DeepImmunizationResult:
    """What :func:`immunize` did: steps, time, the λ's in force at the end, per-step history
    (loss, each unweighted term, each balanced λ, step seconds). Linear twin:
    :class:`pycore.immunize.ImmunizationResult`."""

    method: str
    steps: int
    wall_seconds: float
    lambdas: dict
    history: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    hardening: "dict | None" = None   # what pycore.deep.harden.harden applied (cfg.harden)

    def as_dict(self) -> dict:
        return asdict(self)


# --- pieces of the loop -----------------------------------------------------------------------

class _Objective(nn.Module):
    """forward(shards) -> (mean over shards of each unweighted term, their float values).

    This is what DDP wraps: the terms are combined with the λ's outside, after balancing."""

    def __init__(self, model: ImmunizableModel, cfg: DeepImmunizeConfig, num_classes_h: int):
        super().__init__()
        self.model, self.cfg, self.num_classes_h = model, cfg, num_classes_h

    def forward(self, batches):
        cfg, mean = self.cfg, {}
        for hP, yP, hH, yH in batches:
            t = loss_terms(self.model, cfg.method, hP, yP, hH, yH, self.num_classes_h,
                           label_smoothing=cfg.label_smoothing, imma_inner_steps=cfg.imma_inner_steps,
                           imma_inner_lr=cfg.imma_inner_lr)
            for k, v in t.items():
                mean[k] = mean.get(k, 0.0) + v.double() / len(batches)
        return mean


class _Batches:
    """The paired loader of one run and the fetch of a step's shards (trunk applied if needed)."""

    def __init__(self, model, p_train, h_train, cfg, shards, from_trunk, device):
        self.model, self.p, self.h, self.from_trunk, self.device = model, p_train, h_train, from_trunk, device
        self.paired = PairedBatches(ShardedBatches(len(p_train), cfg.batch_size, seed=cfg.seed, world=shards),
                                    ShardedBatches(len(h_train), cfg.batch_size, seed=cfg.seed + 1,
                                                   world=shards))

    def steps(self, epochs: int):
        for epoch in range(epochs):
            yield from self.paired.epoch(epoch)

    def load(self, pair, ranks) -> list[tuple]:
        sp, sh = pair
        out = []
        for r in ranks:
            xP, yP = fetch(self.p, sp[r])
            xH, yH = fetch(self.h, sh[r])
            xP, xH = xP.to(self.device), xH.to(self.device)
            if not self.from_trunk:
                with torch.no_grad():
                    xP, xH = self.model.trunk(xP), self.model.trunk(xH)
            out.append((xP, yP.to(self.device), xH, yH.to(self.device)))
        return out


def calibrate_ridge(model: ImmunizableModel, hP: torch.Tensor, ridge_rel: float) -> float:
    """Scale-aware ridge of the preconditioner ``(XᵀX + λI)⁻¹``: ``λ = ridge_rel · tr(XᵀX)/N`` on a
    D_P batch (relative to the mean squared feature norm: an absolute λ means nothing for
    features whose scale depends on the backbone). Sets and returns ``model.layer.lambda_reg``."""
    with torch.no_grad():
        X = model.pooled(hP).double()
    model.layer.lambda_reg = float(ridge_rel * (X * X).sum() / X.shape[0])
    return model.layer.lambda_reg


def balanced_lambdas(terms: dict[str, torch.Tensor], params, balance: float, *, world: int = 1,
                     previous: "dict[str, float] | None" = None,
                     weights: "dict[str, float] | None" = None) -> dict[str, float]:
    """``λ_term = balance · ‖∇CE‖ / ‖∇term‖`` on ``params`` (paper App. C.2, automated).

    ``weights`` (keyed by config field, e.g. ``{"lambda_h": 3.0}``) replaces ``balance`` for
    those terms: the R_ill weight of the (i)/(ii) trade-off sweep.

    Gradients by :func:`torch.autograd.grad` (no ``.grad`` is touched, no DDP hook fires); with
    ``world > 1`` the per-rank gradients are averaged first, so every rank gets the same λ. A
    term whose gradient norm is 0 or non-finite keeps its ``previous`` λ; without one that is an
    error (nothing to balance against)."""
    flat = {}
    for k, v in terms.items():
        gs = torch.autograd.grad(v, params, retain_graph=True, allow_unused=True)
        flat[k] = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double()
                             for p, g in zip(params, gs)])
    if world > 1:
        import torch.distributed as dist  # noqa: PLC0415

        stacked = torch.stack([flat[k] for k in sorted(flat)])
        dist.all_reduce(stacked)
        flat = {k: stacked[i] / world for i, k in enumerate(sorted(flat))}
    ce = float(flat["ce"].norm())
    out = {}
    for k, g in flat.items():
        if k == "ce":
            continue
        n, key = float(g.norm()), LAMBDA_OF_TERM[k]
        if math.isfinite(n) and n > 0 and math.isfinite(ce):
            out[key] = (weights or {}).get(key, balance) * ce / n
        elif previous and key in previous:
            out[key] = previous[key]
        else:
            raise FloatingPointError(f"cannot balance λ for {k}: its gradient norm is {n} (CE: {ce})")
    return out


def _any_rank(flag: bool, world: int, device) -> bool:
    """True on every rank when ``flag`` is True on any rank (one all-reduce; no-op when world = 1)."""
    if world <= 1:
        return flag
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _mean_over_ranks(values: dict[str, float], world: int, device) -> dict[str, float]:
    if world <= 1 or not values:
        return values
    import torch.distributed as dist  # noqa: PLC0415

    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return {k: float(v) / world for k, v in zip(keys, t.tolist())}


def _wrap_ddp(obj: nn.Module, device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    # Buffers (BN statistics) are frozen in eval mode and identical on every rank: no need to
    # re-broadcast them each forward (the keyword was renamed in recent torch).
    sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else {"broadcast_buffers": False})
    dev = torch.device(device)
    return DDP(obj, device_ids=[dev.index] if dev.type == "cuda" else None, **sync)


_OP_ERROR_PREFIXES = ("cond_regularizer:", "ImmunizationHead")


def _train_step(runner, batches, opt, trainable, balance_params, cfg, lambdas, rebalance, world, device):
    """One step. Returns ``(loss, term values, λ's, failure)``; ``failure`` is "" when the step was
    applied, else the reason (the update is then NOT applied: the model keeps the last good step).
    ``rebalance``: None (keep the λ's), ``"first"`` or ``"again"`` (balance them at this step).

    Ranks agree on a non-finite loss BEFORE the backward: DDP all-reduces gradients inside
    backward(), so a rank that skipped it would desynchronise the collectives."""
    opt.zero_grad(set_to_none=True)
    try:
        terms = runner(batches)
        logs = {k: float(v.detach()) for k, v in terms.items()}
        bad = _any_rank(not all(math.isfinite(v) for v in logs.values()), world, device)
        if not bad and rebalance:
            # At the first balancing there is no earlier λ to fall back on (the config's λ's are
            # not balanced ones): a zero or non-finite gradient norm is then an error.
            weights = {"lambda_h": cfg.balance_ill} if cfg.balance_ill is not None else None
            lambdas = {**lambdas, **balanced_lambdas(terms, balance_params, cfg.balance, world=world,
                                                     previous=lambdas if rebalance == "again" else None,
                                                     weights=weights)}
        loss = combine_terms(terms, lambdas) if not bad else torch.tensor(float("nan"))
        if not bad:
            bad = _any_rank(not bool(torch.isfinite(loss)), world, device)
        if not bad:
            loss.backward()
            bad = not all(bool(torch.isfinite(p.grad).all()) for p in trainable if p.grad is not None)
    except FloatingPointError as exc:
        # Balancing found nothing to balance against (a zero or non-finite term gradient at the
        # first balancing); every rank sees the same all-reduced norms, so all stop together.
        return float("nan"), {}, lambdas, str(exc)
    except RuntimeError as exc:
        # The op refuses overflowing features and a singular preconditioner with its own
        # message; treat that like a NaN loss (stop and report the step). Anything else (a
        # shape error, an op without a kernel for this device) is a bug: re-raise it.
        if world > 1 or not str(exc).lstrip().startswith(_OP_ERROR_PREFIXES):
            raise
        return float("nan"), {}, lambdas, str(exc).strip().splitlines()[0]
    bad = _any_rank(bad, world, device)
    logs = _mean_over_ranks(logs, world, device)
    loss_val = float(_mean_over_ranks({"loss": float(loss.detach())}, world, device)["loss"])
    if bad:
        opt.zero_grad(set_to_none=True)
        return loss_val, logs, lambdas, ", ".join(f"{k}={v:.3g}" for k, v in logs.items()) or "non-finite"
    opt.step()
    return loss_val, logs, lambdas, ""


def _stop(model: ImmunizableModel, cfg: DeepImmunizeConfig, step: int, reason: str, rank: int):
    """Raise :class:`NonFiniteLossError` after saving the last good model (rank 0, when asked)."""
    ckpt = None
    if cfg.checkpoint_dir and rank == 0:
        ckpt = save_immunized(model, os.path.join(cfg.checkpoint_dir, f"last_good_{cfg.method}.safetensors"),
                              num_classes=model.classifier.out_features,
                              extra={"step": step, "reason": "non-finite loss"})
    raise NonFiniteLossError(
        f"[{cfg.method}] non-finite loss or gradient at step {step} ({reason}); stopped, the model "
        f"keeps its state after step {step - 1}" + (f", saved to {ckpt}" if ckpt else ""), step, ckpt)


def _bar(total: int, desc: str, enabled: bool):
    return progress(total=total, desc=desc, disable=True) if not enabled else progress(total=total, desc=desc)


# --- the loop ---------------------------------------------------------------------------------

def immunize(model: ImmunizableModel, p_train: Dataset, h_train: Dataset, cfg: DeepImmunizeConfig, *,
             num_classes_h: int, from_trunk: bool = False, device: "torch.device | str" = "cpu",
             rank: int = 0, world: int = 1, ddp: bool = False) -> DeepImmunizationResult:
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
    model.eval()  # see module docstring: normalisation statistics belong to θ₀
    shards = max(world, cfg.virtual_ranks)
    data = _Batches(model, p_train, h_train, cfg, shards, from_trunk, device)
    mine = [rank] if world > 1 else list(range(shards))

    lambdas = {k: getattr(cfg, k) for k in ("lambda_p", "lambda_h", "lambda_kappa", "lambda_imma")}
    if cfg.ridge_rel is not None and hasattr(model.layer, "lambda_reg"):
        first = next(iter(data.paired.epoch(0)))
        calibrate_ridge(model, data.load(first, [0])[0][0], cfg.ridge_rel)
    ridge = float(getattr(model.layer, "lambda_reg", float("nan")))

    obj = _Objective(model, cfg, num_classes_h)
    runner = _wrap_ddp(obj, device) if ddp and world > 1 else obj
    opt = torch.optim.SGD(
        [{"params": ext_params, "weight_decay": cfg.weight_decay_extractor},
         {"params": cls_params, "weight_decay": cfg.weight_decay_classifier}],
        lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    trainable = ext_params + cls_params
    balance_params = ext_params
    total = len(data.paired) * cfg.epochs
    total = total if cfg.max_steps is None else min(cfg.max_steps, total)
    history: dict[str, list] = {"loss": [], "step_seconds": []}
    bar = _bar(total, f"immunize[{cfg.method}]", cfg.progress and rank == 0)
    t0 = time.perf_counter()
    step = 0
    try:
        for pair in data.steps(cfg.epochs):
            if step >= total:
                break
            ts = time.perf_counter()
            rebalance = (None if cfg.balance is None else "first" if step == 0 else
                         "again" if cfg.balance_every > 0 and step % cfg.balance_every == 0 else None)
            loss, logs, lambdas, failure = _train_step(runner, data.load(pair, mine), opt, trainable,
                                                       balance_params, cfg, lambdas, rebalance, world, device)
            if failure:
                _stop(model, cfg, step, failure, rank)
            history["loss"].append(loss)
            for k, v in logs.items():
                history.setdefault(k, []).append(v)
            if cfg.balance is not None:
                for k in sorted({LAMBDA_OF_TERM[t] for t in logs if t != "ce"}):
                    history.setdefault(k, []).append(lambdas[k])
            history["step_seconds"].append(time.perf_counter() - ts)
            step += 1
            bar.update(1)
    finally:
        bar.close()
        for p in model.parameters():
            p.requires_grad_(False)
    hardening = None
    if cfg.harden != "none":
        # Every rank computes the same map from the same full D_H set (seeded), so the ranks stay equal.
        hardening = harden(model, h_train, cfg.harden, num_classes=num_classes_h,
                           rng=np.random.default_rng([cfg.seed, 99]), scale=cfg.harden_scale,
                           from_trunk=from_trunk).as_dict()
    return DeepImmunizationResult(cfg.method, step, time.perf_counter() - t0, {**lambdas, "ridge": ridge},
                                  history, asdict(cfg), hardening)


# --- θ₀ for the demo and trunk caching -----------------------------------------------------------

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


def random_shift(x: torch.Tensor, max_shift: int, rng: np.random.Generator) -> torch.Tensor:
    """Translate each image of ``x`` (N x C x H x W) by its own random offset in
    ``[-max_shift, max_shift]²`` pixels, filling with the edge pixels (the background of a digit)."""
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4, mode="replicate")
    off = rng.integers(0, 2 * max_shift + 1, size=(n, 2))
    return torch.stack([padded[i, :, a:a + h, b:b + w] for i, (a, b) in enumerate(off)])


def train_classifier(model: nn.Module, data: Dataset, *, epochs: int, batch_size: int = 64,
                     lr: float = 1e-3, weight_decay: float = 1e-4, label_smoothing: float = 0.1,
                     seed: int = 0, device: "torch.device | str" = "cpu",
                     progress: bool = False, max_shift: int = 0) -> list[float]:
    """Plain supervised training of the whole model (makes θ₀ for the demo).

    AdamW with a one-cycle schedule and the same label-smoothing CE that immunization uses
    (a θ₀ trained without it is over-confident, and the smoothed loss then starts with large
    gradients that wreck D_P accuracy in the first immunization steps). ``max_shift > 0``
    augments every batch with random translations (:func:`random_shift`, seeded from ``seed``).
    BatchNorm statistics are re-estimated for the final weights on the un-augmented data
    (:func:`recalibrate_batchnorm`).
    """
    model.to(device).train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    batches = ShardedBatches(len(data), batch_size, seed=seed)
    shift_rng = np.random.default_rng([seed, 7])
    total = epochs * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.2)
    losses = []
    it = _bar(total, "θ₀ training", progress)
    step = 0
    for e in range(epochs):
        for (idx,) in batches.epoch(e):
            x, y = fetch(data, idx)
            x = random_shift(x, max_shift, shift_rng)
            loss = F.cross_entropy(model(x.to(device)), y.to(device), label_smoothing=label_smoothing)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"θ₀ training diverged (loss {float(loss)}) at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step += 1
            it.update(1)
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


