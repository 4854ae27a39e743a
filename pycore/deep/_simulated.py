"""Immunization against simulated attackers (docs/theory.md §12, docs/design.md §4).

The non-fine-tunable-learning family, of which SOPHON (Deng et al., IEEE S&P 2024) is the named
instance.

The defense changes the backbone's *function* so that an attacker's own first steps on D_H make
little progress, which no reparameterization of the features undoes. Per outer step:

1. an attacker is drawn: an operator of ``operators`` (``finetune``: the defended parameters and
   a new head; ``lora``: rank-``lora_rank`` adapters on the defended linear and convolution
   layers, ``W + BA``, and a new head; ``probe``: a new head alone, on features scaled or
   standardised as the audit's Adam probe does), a learning rate log-uniform in that operator's
   range (:data:`INNER_LRS`), a new head drawn at random;
2. it takes ``inner_steps`` steps of its optimizer on D_H batches, each on one half of its batch;
   after each step the suppression loss of its model on the other half (``kl_uniform``: the KL
   divergence of the uniform distribution from its predictions; ``inverse_ce``: ``−log(1 −
   p_y)``) is differentiated with respect to the defended weights as the attacker holds them
   then (``W + BA`` for LoRA) and summed over the trajectory: first order, no second
   derivatives, so it fits a CPU. The probe, whose run costs only its head, trains
   ``probe_steps`` steps on the features of ``inner_steps`` half-batches and is scored at four
   points of that longer run (:func:`_probe_trajectory`): the horizon at which the real probe
   reaches θ₀'s target is tens of steps, not eight;
3. the defender takes an Adam step (lr ``lr``) along that sum, clipped to norm ``clip``;
4. ``dp_steps`` Adam steps (lr ``dp_lr``) on D_P's cross-entropy with the model's own head.

D_P top-1 on up to 1024 of the given D_P rows is checked every ``check_every`` outer steps, and
the model ends on the last checked state within ``dp_tolerance`` points of where it started.
``scope="tail"`` defends the backbone's last ``stages`` stages and the immunization layer (run
from their stored inputs, :mod:`pycore.deep._tail`); ``"backbone"`` every backbone parameter.
The model stays in eval mode, as in :func:`pycore.deep._train.immunize_in_place`, its defended
BatchNorms folded into their convolutions first (``fold_batchnorm``; the function unchanged,
:func:`pycore.deep._models.fold_batchnorm`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from pycore._options import Options
from pycore._validation import ParameterError
from pycore.deep._data import ShardedBatches, dataset_labels, fetch
from pycore.deep._models import fold_batchnorm_checked, tail_modules
from pycore.deep._tail import TailRunner

SIMULATED_OPERATORS = ("finetune", "lora", "probe")
SUPPRESSIONS = ("kl_uniform", "inverse_ce")
# each simulated operator's learning rates, drawn log-uniformly: the span of the audit's grids
# for the same operator (pycore.deep._operators.LR_GRIDS, as widened on the demo's θ₀)
INNER_LRS = {"finetune": (1e-4, 1e-2), "lora": (1e-4, 1e-2), "probe": (1e-3, 1e-1)}


def _operators(value, name):
    """A non-empty tuple of simulated operators."""
    if (
        not isinstance(value, tuple)
        or not value
        or any(v not in SIMULATED_OPERATORS for v in value)
    ):
        raise ParameterError(
            name, f"{name} must be a non-empty tuple of {SIMULATED_OPERATORS}, got {value!r}"
        )


def _count(low, high):
    return dict(low=low, high=high, integer=True)


@dataclass(frozen=True)
class SimulatedOptions(Options):
    """Options of the simulated-attacker immunizer (module docstring)."""

    RULES = {
        "steps": _count(1, 100_000),
        "inner_steps": _count(1, 10_000),
        "probe_steps": _count(4, 100_000),
        "lora_rank": _count(1, 4096),
        "dp_steps": _count(0, 1000),
        "batch_size": _count(2, 65_536),
        "stages": _count(1, 1000),
        "check_every": _count(1, 100_000),
        **{k: dict(low=0.0, low_open=True) for k in ("lr", "dp_lr", "clip")},
        "inner_lr": dict(low=0.0, low_open=True, none_ok=True),
        "dp_tolerance": dict(low=0.0, none_ok=True),
    }
    CHOICES = {
        "suppression": SUPPRESSIONS,
        "inner_optimizer": ("adam", "sgd"),
        "scope": ("tail", "backbone"),
    }
    CHECKS = {"operators": _operators}

    steps: int = 100
    inner_steps: int = 8
    probe_steps: int = 64  # the probe attacker's head steps (its run is cheap: docs above)
    operators: tuple = SIMULATED_OPERATORS
    inner_optimizer: str = "adam"
    inner_lr: float | None = None  # None: drawn log-uniformly from INNER_LRS per attacker
    lora_rank: int = 8
    suppression: str = "kl_uniform"
    lr: float = 1e-4
    dp_lr: float = 1e-4
    dp_steps: int = 1
    clip: float = 1.0
    fold_batchnorm: bool = True  # the defended BatchNorms folded first (docs/design.md §4)
    batch_size: int = 64
    scope: str = "tail"
    stages: int = 1
    check_every: int = 10
    dp_tolerance: float | None = 1.0


# SOPHON's published classification settings (its inverse-loss script: fine-tuning simulated by
# first-order MAML with SGD at a fixed 1e-4, 50 adaptation batches per outer loop, the
# suppression step Adam at 3·1e-4 and the D_P step at 5·1e-4, one of each per loop, gradients
# clipped to 0.5), with the demo's scale: 8 adaptation steps instead of 50 and 100 outer loops
# instead of 1000 (a CPU budget), batches of 64 split in halves instead of 150 split 90/10.
SOPHON = SimulatedOptions(
    operators=("finetune",),
    inner_optimizer="sgd",
    inner_lr=1e-4,
    suppression="inverse_ce",
    lr=3e-4,
    dp_lr=5e-4,
    clip=0.5,
)


def suppression_loss(logits: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    """The loss the defender drives DOWN on the attacker's model.

    ``kl_uniform`` is ``KL(u ‖ p)`` (zero when the predictions are uniform), ``inverse_ce`` is
    ``−log(1 − p_y)`` (zero when the true class gets no probability); means over the batch, in
    float64.

    Parameters
    ----------
    logits : torch.Tensor, shape (N, C)
        The attacker's model's logits.
    y : torch.Tensor of int64, shape (N,)
        The true classes.
    kind : {"kl_uniform", "inverse_ce"}
        The suppression.

    Returns
    -------
    torch.Tensor
        The scalar loss.

    Raises
    ------
    ParameterError
        An unknown kind (``.parameter`` is ``"suppression"``).
    """
    logp = torch.log_softmax(logits.double(), 1)
    if kind == "kl_uniform":
        return -math.log(logits.shape[1]) - logp.mean(1).mean()
    if kind == "inverse_ce":
        p_y = logp.gather(1, y.view(-1, 1)).squeeze(1).exp()
        return -torch.log1p(-p_y.clamp(max=1 - 1e-12)).mean()
    raise ParameterError(
        "suppression", f"unknown suppression {kind!r}; choose from {SUPPRESSIONS}"
    )


class _Features(nn.Module):
    """model → its immunized features (the attacker's new head reads them)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.features(x)


def _lora_factors(params: dict, rank: int, gen: torch.Generator) -> dict:
    """``{name: (A, B)}`` for every 2-D or 4-D weight of ``params``.

    ``A`` as peft draws it (Kaiming-uniform, a = √5), ``B = 0``, so ``W + BA`` starts at ``W``.
    """
    out = {}
    for n, w in params.items():
        if not n.endswith("weight") or w.dim() not in (2, 4):
            continue
        fan_in = int(np.prod(w.shape[1:]))
        r = min(rank, w.shape[0], fan_in)
        bound = 1.0 / math.sqrt(fan_in)
        A = ((torch.rand(r, fan_in, generator=gen, dtype=w.dtype) * 2 - 1) * bound).to(w.device)
        out[n] = (
            A.requires_grad_(True),
            torch.zeros(w.shape[0], r, dtype=w.dtype, device=w.device).requires_grad_(True),
        )
    return out


def _dp_checker(model, data, seed: int, device):
    idx = torch.from_numpy(
        np.sort(np.random.default_rng([seed, 11]).permutation(len(data))[:1024])
    )
    x, y = (t.to(device) for t in fetch(data, idx))

    @torch.no_grad()
    def accuracy() -> float:
        return 100.0 * float((model(x).argmax(1) == y).double().mean())

    return accuracy


def immunize_simulated(
    model, p_train, h_train, opts: SimulatedOptions, *, seed: int, num_classes_h: int
) -> dict:
    """Immunize an :class:`~pycore.deep.ImmunizedNet` in place against simulated attackers.

    Immunize the :class:`~pycore.deep.ImmunizedNet` ``model`` in place against
    simulated attackers (module docstring) on the images ``p_train`` (its own classes) and
    ``h_train``; returns what it did: ``{"steps", "kept", "reason", "history", "seconds"}``.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng([seed, 21])
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    model.eval().requires_grad_(False)
    mods = (
        [*tail_modules(model.net, opts.stages), model.layer]
        if opts.scope == "tail"
        else [model.net, model.layer]
    )
    original = {k: v.clone() for k, v in model.state_dict().items()}
    if opts.fold_batchnorm:
        x0 = fetch(p_train, torch.arange(min(16, len(p_train))))[0]
        fold_batchnorm_checked(model, mods, x0.to(next(model.parameters()).device))
    # the defended parameters, and the data the defense trains from
    if opts.scope == "tail":
        runner = TailRunner(model.net, opts.stages)
        shape = tuple(fetch(p_train, torch.arange(1))[0].shape[1:])
        P, H = (runner.dataset(model.net, d) for d in (p_train, h_train))
        tail = runner.attach(model.net, shape)
        model.net = tail
    else:
        P, H, tail = p_train, h_train, None
    head_params = {id(p) for p in model.classifier.parameters()}
    defended = {id(p): p for m in mods for p in m.parameters() if id(p) not in head_params}
    # plain gradients everywhere: the layer's preconditioner belongs to Algorithm 1's regularizers
    precondition = getattr(model.layer, "precondition", None)
    if precondition is not None:
        model.layer.precondition = False
    feats = _Features(model)
    names = {id(p): n for n, p in feats.named_parameters()}
    scope = {names[i]: p for i, p in defended.items()}
    for p in scope.values():
        p.requires_grad_(True)
    sup_opt = torch.optim.Adam(list(scope.values()), lr=opts.lr)
    dp_params = [*scope.values(), *model.classifier.parameters()]
    for p in model.classifier.parameters():
        p.requires_grad_(True)
    dp_opt = torch.optim.Adam(dp_params, lr=opts.dp_lr)
    bs = min(opts.batch_size, len(H), len(P))
    hb = ShardedBatches(len(H), bs, seed=seed + 1)
    pb = ShardedBatches(len(P), bs, seed=seed)
    yP = torch.as_tensor(dataset_labels(P), dtype=torch.int64)
    h_stream = (idx for e in range(1 << 30) for (idx,) in hb.epoch(e))
    p_stream = (idx for e in range(1 << 30) for (idx,) in pb.epoch(e))
    dev = next(model.parameters()).device
    accuracy = _dp_checker(model, P, seed, dev) if opts.dp_tolerance is not None else None
    start = accuracy() if accuracy else None
    kept_state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    kept = 0
    history = {"suppression": [], "dp_loss": [], "operator": [], "inner_lr": [], "dp_top1": []}
    reason = ""
    try:
        for step in range(1, opts.steps + 1):
            op = opts.operators[int(rng.integers(len(opts.operators)))]
            lo, hi = INNER_LRS[op]
            lr = float(np.exp(rng.uniform(np.log(lo), np.log(hi))))
            lr = opts.inner_lr or lr
            sup = _trajectory(feats, scope, H, h_stream, op, lr, opts, num_classes_h, gen, dev)
            total = torch.nn.utils.clip_grad_norm_(list(scope.values()), opts.clip)
            if not bool(torch.isfinite(total)):
                reason = f"non-finite suppression gradient at step {step}"
                break
            sup_opt.step()
            sup_opt.zero_grad(set_to_none=True)
            dp_loss = 0.0
            for _ in range(opts.dp_steps):
                idx = next(p_stream)
                loss = F.cross_entropy(model(fetch(P, idx)[0].to(dev)), yP[idx].to(dev))
                dp_opt.zero_grad(set_to_none=True)
                loss.backward()
                dp_opt.step()
                dp_loss = float(loss.detach())
            dp_opt.zero_grad(set_to_none=True)
            for k, v in zip(history, (sup, dp_loss, op, lr, math.nan)):
                history[k].append(v)
            if accuracy and (step % opts.check_every == 0 or step == opts.steps):
                acc = accuracy()
                history["dp_top1"][-1] = acc
                if acc >= start - opts.dp_tolerance:
                    kept_state = {n: p.detach().clone() for n, p in model.state_dict().items()}
                    kept = step
        if accuracy is None:
            kept = len(history["suppression"])
        elif kept < len(history["suppression"]):
            reason = reason or (
                f"D_P top-1 fell below {start:.1f} − {opts.dp_tolerance:g} %: back to step {kept}"
            )
    finally:
        if accuracy is not None:
            model.load_state_dict(kept_state)
        model.requires_grad_(False)
        if precondition is not None:
            model.layer.precondition = precondition
        if tail is not None:
            model.net = tail.detach()
        if accuracy is not None and kept == 0:  # back to the start: every tensor as it was
            model.load_state_dict(original)
    return {
        "steps": len(history["suppression"]),
        "kept": kept,
        "reason": reason,
        "history": history,
        "seconds": time.perf_counter() - t0,
    }


def _accumulate(scope: dict, params: dict, loss: torch.Tensor, weight: float) -> None:
    """``weight·∂loss/∂params`` added to ``.grad`` of the defended parameters.

    ``scope`` holds the defended parameters; ``params`` the attacker's copies of them, by name
    (first order).
    """
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    for (n, p), g in zip(scope.items(), grads):
        if g is not None:
            p.grad = weight * g if p.grad is None else p.grad + weight * g


def _new_head(classes: int, dim: int, gen, dev) -> list:
    """A linear head as ``nn.Linear`` draws it (uniform in ±1/√dim), from ``gen``."""
    bound = 1.0 / math.sqrt(dim)
    return [
        ((torch.rand(classes, dim, generator=gen) * 2 - 1) * bound).to(dev).requires_grad_(True),
        ((torch.rand(classes, generator=gen) * 2 - 1) * bound).to(dev).requires_grad_(True),
    ]


def _probe_trajectory(feats, scope, H, stream, lr, opts, classes, gen, dev) -> float:
    """The probe attacker (module docstring).

    Its head alone trains, so its whole run is cheap. The features of ``inner_steps`` batches'
    first halves, computed once, are scaled or standardised (statistics of them, as the audit's
    Adam probe does); a new head takes ``probe_steps`` Adam steps on them (mini-batches of half a
    batch); the suppression loss of the head at four points of that run (a quarter, half, three
    quarters, the end), on the batches' other halves, is differentiated with respect to the
    defended weights (the head held fixed: first order). Returns the mean suppression loss.
    """
    xs, ys = zip(*((t.to(dev) for t in fetch(H, next(stream))) for _ in range(opts.inner_steps)))
    half = len(xs[0]) // 2
    xa, ya = torch.cat([x[:half] for x in xs]), torch.cat([y[:half] for y in ys])
    xe, ye = torch.cat([x[half:] for x in xs]), torch.cat([y[half:] for y in ys])
    with torch.no_grad():
        za = functional_call(feats, scope, (xa,), strict=False)
    scale_ = (
        (za.mean(0), za.std(0).clamp_min(1e-12))
        if int(torch.randint(2, (1,), generator=gen))
        else (torch.zeros_like(za[0]), za.pow(2).sum(1).mean().sqrt().clamp_min(1e-12))
    )
    za = (za - scale_[0]) / scale_[1]
    head = _new_head(classes, za.shape[1], gen, dev)
    inner = torch.optim.Adam(head, lr=lr)
    marks = {opts.probe_steps * k // 4 for k in (1, 2, 3, 4)}
    snaps = []
    for t in range(1, opts.probe_steps + 1):
        idx = torch.randint(len(za), (half,), generator=gen)
        loss = F.cross_entropy(F.linear(za[idx], *head), ya[idx])
        if not bool(torch.isfinite(loss)):
            break
        inner.zero_grad(set_to_none=True)
        loss.backward()
        inner.step()
        if t in marks:
            snaps.append([h.detach().clone() for h in head])
    if not snaps:
        return float("nan")
    eff = {n: p.detach().requires_grad_(True) for n, p in scope.items()}
    ze = (functional_call(feats, eff, (xe,), strict=False) - scale_[0]) / scale_[1]
    s = sum(suppression_loss(F.linear(ze, *h), ye, opts.suppression) for h in snaps) / len(snaps)
    if not bool(torch.isfinite(s)):
        return float("nan")
    _accumulate(scope, eff, s, 1.0)
    return float(s.detach())


def _trajectory(feats, scope, H, stream, op, lr, opts, classes, gen, dev) -> float:
    """One simulated attacker's trajectory (module docstring, steps 1-2).

    Accumulates the summed suppression gradient into ``.grad`` of the defended parameters
    ``scope``; returns the mean suppression loss.
    """
    if op == "probe":
        return _probe_trajectory(feats, scope, H, stream, lr, opts, classes, gen, dev)
    head = _new_head(classes, feats.model.layer.weight.shape[0], gen, dev)
    weights = {n: p.detach().clone().requires_grad_(op == "finetune") for n, p in scope.items()}
    factors = _lora_factors(weights, opts.lora_rank, gen) if op == "lora" else {}
    trainable = head + (
        list(weights.values()) if op == "finetune" else [t for ab in factors.values() for t in ab]
    )
    make = torch.optim.Adam if opts.inner_optimizer == "adam" else torch.optim.SGD
    inner = make(trainable, lr=lr)

    def effective():
        out = dict(weights)
        for n, (A, B) in factors.items():
            out[n] = weights[n] + (B @ A).view_as(weights[n])
        return out

    losses = []
    for _ in range(opts.inner_steps):
        idx = next(stream)
        half = len(idx) // 2
        x, y = (t.to(dev) for t in fetch(H, idx))
        # the attacker's step on one half
        z = functional_call(feats, effective(), (x[:half],), strict=False)
        loss = F.cross_entropy(F.linear(z, *head), y[:half])
        if not bool(torch.isfinite(loss)):  # this attacker diverged: nothing more to suppress
            break
        inner.zero_grad(set_to_none=True)
        loss.backward()
        inner.step()
        # the suppression loss at the attacker's new weights, on the other half
        eff = {n: w.detach().requires_grad_(True) for n, w in effective().items()}
        z = functional_call(feats, eff, (x[half:],), strict=False)
        s = suppression_loss(F.linear(z, *(h.detach() for h in head)), y[half:], opts.suppression)
        if not bool(torch.isfinite(s)):
            break
        _accumulate(scope, eff, s, 1.0 / opts.inner_steps)
        losses.append(float(s.detach()))
    return float(np.mean(losses)) if losses else float("nan")
