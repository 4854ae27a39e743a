"""Deep immunization of an :class:`~pycore.deep.ImmunizedNet` in place.

Paper Eq. (11), Algorithm 1 on deep nets, §5.2; docs/theory.md §9; docs/design.md §4.

With ``rule="adaptive"`` (the default of ``ours``) and for ``closed_form`` the layer is set from
the linear problem on the frozen features (:mod:`pycore.deep._layer`). Otherwise (``rule="sgd"``,
the paper's loop, and every baseline), per step: a D_P and a D_H batch (the paired loader of App.
C.2), the method's terms (:mod:`pycore.deep._objectives`), the λ's (fixed, or balanced: ``λ =
b·‖∇CE‖/‖∇term‖`` on the extractor parameters, App. C.2's rule automated, every
``balance_every`` steps: R_ill's gradient grows like ``1/d²`` as it works, §3, so one balance at
step 0 soon swamps or fades), one backward and one SGD step. The model stays in eval mode: its
normalisation statistics belong to θ₀, so the regularizers shape exactly the features RIR_θ₀
measures. Under ``torchrun`` each rank evaluates the regularizers on its own batch (DDP averages
gradients; balancing all-reduces the term gradients); ``virtual_ranks=W`` reproduces that
objective in one process.
"""

from __future__ import annotations

import inspect
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import pycore._ops as ops
from pycore._report import progress as progress_bar
from pycore._validation import ParameterError
from pycore.deep._data import PairedBatches, ShardedBatches, dataset_labels, fetch
from pycore.deep._deep_options import (  # noqa: F401  (re-exported: pycore.deep imports them here)
    OPTION_CHOICES,
    OPTION_RULES,
    DeepOptions,
    NonFiniteLossError,
    TrainResult,
    options,
)
from pycore.deep._hardening import harden
from pycore.deep._models import fold_batchnorm_checked, tail_modules
from pycore.deep._objectives import (
    DEEP_METHODS,
    LAMBDA_OF_TERM,
    SIMULATED_METHODS,
    combine_terms,
    loss_terms,
)
from pycore.deep._simulated import SimulatedOptions, immunize_simulated
from pycore.deep._tail import TailRunner


class _Objective(nn.Module):
    """forward(shards) -> mean over shards of each unweighted term (what DDP wraps)."""

    def __init__(self, model, method: str, opts: DeepOptions, num_classes_h: int):
        super().__init__()
        self.model, self.method, self.opts, self.num_classes_h = model, method, opts, num_classes_h

    def forward(self, shards):
        o, mean = self.opts, {}
        for xP, yP, xH, yH in shards:
            t = loss_terms(
                self.model,
                self.method,
                xP,
                yP,
                xH,
                yH,
                self.num_classes_h,
                label_smoothing=o.label_smoothing,
                imma_inner_steps=o.imma_inner_steps,
                imma_inner_lr=o.imma_inner_lr,
                kstep_steps=o.kstep_steps,
            )
            for k, v in t.items():
                mean[k] = mean.get(k, 0.0) + v.double() / len(shards)
        return mean


def balanced_lambdas(
    terms: dict,
    params,
    balance: float,
    *,
    world: int = 1,
    previous: dict | None = None,
    weights: dict | None = None,
) -> dict[str, float]:
    """The λ of each term that balances its gradient against the cross-entropy's.

    ``λ_term = balance·‖∇CE‖/‖∇term‖`` on ``params`` (``weights`` replaces ``balance`` for the λ's
    it names), gradients averaged over ranks, no ``.grad`` touched.

    Parameters
    ----------
    terms : dict of str to torch.Tensor
        ``"ce"`` and the method's terms (:func:`loss_terms`), each a scalar with a graph.
    params : sequence of torch.Tensor
        The parameters whose gradients are compared.
    balance : float
        The ratio of each term's weighted gradient norm to the cross-entropy's.
    world : int, default 1
        Ranks to average the gradients over (all-reduced when above 1).
    previous : dict, optional
        The λ's in force, kept for a term whose gradient norm is 0 or non-finite.
    weights : dict, optional
        Ratios that replace ``balance`` for the λ's they name.

    Returns
    -------
    dict of str to float
        λ name (``"lambda_p"``, ``"lambda_h"``, ...) → value.

    Raises
    ------
    FloatingPointError
        A term whose gradient norm is 0 or non-finite, with no ``previous`` λ.
    """
    flat = {}
    for k, v in terms.items():
        gs = torch.autograd.grad(v, params, retain_graph=True, allow_unused=True)
        flat[k] = torch.cat(
            [
                (torch.zeros_like(p) if g is None else g).reshape(-1).double()
                for p, g in zip(params, gs)
            ]
        )
    if world > 1:
        stacked = torch.stack([flat[k] for k in sorted(flat)])
        dist.all_reduce(stacked)
        flat = {k: stacked[i] / world for i, k in enumerate(sorted(flat))}
    ce, out = float(flat["ce"].norm()), {}
    for k, g in flat.items():
        if k == "ce":
            continue
        n, key = float(g.norm()), LAMBDA_OF_TERM[k]
        if math.isfinite(n) and n > 0 and math.isfinite(ce):
            out[key] = (weights or {}).get(key, balance) * ce / n
        elif previous and key in previous:
            out[key] = previous[key]
        else:
            raise FloatingPointError(
                f"cannot balance λ for {k}: its gradient norm is {n} (CE: {ce})"
            )
    return out


def _all_reduce(values: list[float], world: int, device, op: str = "sum") -> list[float]:
    if world <= 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist() if op == "max" else (t / world).tolist()


def _rescale(model, c: float) -> None:
    """Classifier weight × c, layer bias ÷ c.

    On inputs X/c the model gives the logits it gave on X.
    """
    model.classifier.weight.mul_(c)
    if model.layer.bias is not None:
        model.layer.bias.div_(c)


def _dp_accuracy(model, data, cached: bool, device, seed: int, scale: float):
    """A function giving the model's top-1 (%) on up to 1024 seeded D_P training samples.

    With its own head.
    """
    idx = torch.from_numpy(
        np.sort(np.random.default_rng([seed, 11]).permutation(len(data))[:1024])
    )
    x, y = fetch(data, idx)

    @torch.no_grad()
    def accuracy() -> float:
        X = (x.to(device) if cached else model.prelogits(x.to(device))) / scale
        logits = model.classifier(F.linear(X, model.layer.weight, model.layer.bias))
        return 100.0 * float((logits.argmax(1).cpu() == y).double().mean())

    return accuracy


def immunize_in_place(
    model,
    p_train,
    h_train,
    method: str = "ours",
    opts: DeepOptions = DeepOptions(),
    *,
    seed: int = 0,
    num_classes_h: int,
    cached: bool = False,
    device="cpu",
    rank: int = 0,
    world: int = 1,
    ddp: bool = False,
    progress: bool = False,
) -> TrainResult:
    """Immunize an :class:`~pycore.deep.ImmunizedNet` in place with a method.

    The loop of paper Eq. (11) (its steps, λ balancing, hardening), the layer solved as the linear
    problem (the closed form, and the adaptive rule of ``"ours"``/``"kstep"``), or the simulated
    attackers (:class:`~pycore.deep.SimulatedOptions`). Under ``torchrun`` pass ``rank``/``world``
    and ``ddp=True``.

    Parameters
    ----------
    model : ImmunizedNet
        The model, changed in place.
    p_train, h_train : torch.utils.data.Dataset
        D_P's and D_H's training samples ``(x, y)``: images, or with ``cached=True`` (scope
        ``"layer"``) the layer's inputs ``X``.
    method : str, default "ours"
        One of :data:`DEEP_METHODS`.
    opts : DeepOptions or SimulatedOptions, default DeepOptions()
        The method's options (:func:`options`).
    seed : int, default 0
        Seeds the batches and every draw.
    num_classes_h : int
        D_H's classes.
    cached : bool, default False
        The datasets hold the layer's inputs (required by the methods that solve the layer).
    device : str or torch.device, default "cpu"
        Where the model trains.
    rank, world : int, default 0 and 1
        This process's rank and the number of processes.
    ddp : bool, default False
        Wrap the objective in DistributedDataParallel.
    progress : bool, default False
        A bar with the time left on a terminal.

    Returns
    -------
    TrainResult
        The steps taken, the λ's in force at the end (and the ridge), the per-step history, the
        hardening, and why training stopped early ("" when it did not).

    Raises
    ------
    ParameterError
        An unknown method, options of the wrong kind or inconsistent with the data (``scope`` with
        cached features, ``virtual_ranks`` with several processes), named.
    NonFiniteLossError
        A non-finite loss or gradient; ``model`` is left at its last good step.
    """
    if method not in DEEP_METHODS:
        raise ParameterError("method", f"unknown method {method!r}; choose one of {DEEP_METHODS}")
    if method in SIMULATED_METHODS:
        return _simulated(model, p_train, h_train, method, opts, seed, num_classes_h, cached)
    if not isinstance(opts, DeepOptions):
        raise ParameterError("opts", f"{method} takes DeepOptions, got {type(opts).__name__}")
    if cached and opts.scope != "layer":
        raise ParameterError("scope", "cached features fix the backbone: scope must be 'layer'")
    if world > 1 and opts.virtual_ranks > 1:
        raise ParameterError(
            "virtual_ranks", "virtual_ranks emulates a multi-rank run in ONE process"
        )
    if method == "closed_form" or (method in ("ours", "kstep") and opts.rule == "adaptive"):
        if not cached:
            raise ParameterError(
                "scope", f"{method} solves the layer on frozen features: pass cached features"
            )
        return _linear_layer(
            model, p_train, h_train, method, opts, seed, num_classes_h, device, progress
        )
    model.to(device)
    ext, cls = model.set_trainable(opts.scope, opts.stages)
    model.eval()
    tail, h_images = None, h_train
    if opts.scope == "tail" and opts.fold_batchnorm:
        x0 = fetch(p_train, torch.arange(min(16, len(p_train))))[0].to(device)
        fold_batchnorm_checked(model, tail_modules(model.net, opts.stages), x0)
    if opts.scope == "tail" and world == 1:
        # the frozen earlier stages' outputs once per image; the tail runs from them
        runner_ = TailRunner(model.net, opts.stages)
        shape = tuple(fetch(p_train, torch.arange(1))[0].shape[1:])
        p_train, h_train = (runner_.dataset(model.net, d) for d in (p_train, h_train))
        tail = runner_.attach(model.net, shape)
        model.net = tail
    shards = max(world, opts.virtual_ranks)
    bs = min(opts.batch_size, len(p_train) // shards, len(h_train) // shards)
    paired = PairedBatches(
        ShardedBatches(len(p_train), max(bs, 1), seed=seed, world=shards),
        ShardedBatches(len(h_train), max(bs, 1), seed=seed + 1, world=shards),
    )

    def prelogits(x):
        if cached:
            return x.to(device)
        with torch.set_grad_enabled(opts.scope == "tail"):
            return model.prelogits(x.to(device))

    def load(pair, ranks):
        out = []
        for r in ranks:
            (xP, yP), (xH, yH) = fetch(p_train, pair[0][r]), fetch(h_train, pair[1][r])
            out.append(
                (prelogits(xP) / scale, yP.to(device), prelogits(xH) / scale, yH.to(device))
            )
        return out

    # normalize: train in the coordinates where the layer's inputs have unit mean square norm (X/c,
    # the
    # classifier cV): the same lr then suits every backbone; predictions are unchanged (undone at
    # the end)
    scale = 1.0
    with torch.no_grad():
        X0 = load(next(iter(paired.epoch(0))), [0])[0][0]
        if opts.normalize:
            scale = float(X0.double().pow(2).sum(1).mean().sqrt())
            X0 = X0 / scale
            _rescale(model, scale)
        # the preconditioner's ridge relative to tr(XᵀX)/N: an absolute λ means nothing across
        # backbones
        model.layer.lambda_reg = ridge = float(
            opts.ridge_rel * X0.double().pow(2).sum() / X0.shape[0]
        )
    runner = _Objective(model, method, opts, num_classes_h)
    # BN statistics are frozen (eval mode) and equal on every rank: no re-broadcast
    if ddp and world > 1:
        sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else {"broadcast_buffers": False}
        )
        dev = torch.device(device)
        runner = DDP(runner, device_ids=[dev.index] if dev.type == "cuda" else None, **sync)
    groups = [
        {"params": ext, "weight_decay": opts.weight_decay_extractor},
        {"params": cls, "weight_decay": opts.weight_decay_classifier},
    ]
    opt = (
        torch.optim.SGD(groups, lr=opts.lr, momentum=opts.momentum, nesterov=opts.nesterov)
        if opts.optimizer == "sgd"
        else torch.optim.Adam(groups, lr=opts.lr)
    )
    mine = [rank] if world > 1 else list(range(shards))
    lambdas = {
        k: getattr(opts, k) for k in ("lambda_p", "lambda_h", "lambda_kappa", "lambda_imma")
    }
    total = min(len(paired) * opts.epochs, opts.max_steps or math.inf)
    history: dict[str, list] = {"loss": [], "step_seconds": []}
    quiet = {} if progress and rank == 0 else {"disable": True}  # else: a bar on a terminal only
    bar = progress_bar(total=total, desc=f"immunize[{method}]", **quiet)
    accuracy = (
        _dp_accuracy(model, p_train, cached, device, seed, scale)  # the D_P guard's probe
        if opts.dp_tolerance is not None
        else None
    )
    start, keep, kept, stopped = (
        accuracy and accuracy(),
        [p.detach().clone() for p in ext + cls],
        0,
        "",
    )
    t0 = time.perf_counter()
    pairs = (pair for epoch in range(opts.epochs) for pair in paired.epoch(epoch))
    try:
        for step, pair in zip(range(total), pairs):
            ts = time.perf_counter()
            rebalance = (
                None
                if opts.balance is None
                else "first"
                if step == 0
                else "again"
                if opts.balance_every and step % opts.balance_every == 0
                else None
            )
            loss, logs, lambdas, failure = _step(
                runner,
                load(pair, mine),
                opt,
                ext + cls,
                ext,
                opts,
                lambdas,
                rebalance,
                world,
                device,
            )
            if failure:
                _stop(method, opts, step, failure)
            history["loss"].append(loss)
            for k, v in logs.items():
                history.setdefault(k, []).append(v)
            for k in sorted(
                {LAMBDA_OF_TERM[t] for t in logs if t != "ce"} if opts.balance else ()
            ):
                history.setdefault(k, []).append(lambdas[k])
            history["step_seconds"].append(time.perf_counter() - ts)
            bar.update(1)
            # the D_P guard, every 10 steps
            if accuracy and ((step + 1) % 10 == 0 or step + 1 == total):
                if accuracy() >= start - opts.dp_tolerance:
                    keep, kept = [p.detach().clone() for p in ext + cls], step + 1
        if accuracy and kept < len(history["loss"]):  # end on the last state that kept D_P
            with torch.no_grad():
                for p, k in zip(ext + cls, keep):
                    p.copy_(k)
            stopped = (
                f"D_P top-1 fell below {start:.1f} − {opts.dp_tolerance:g} %: back to step {kept}"
            )
    finally:
        bar.close()
        model.requires_grad_(False)
        with torch.no_grad():
            _rescale(model, 1.0 / scale)
        if tail is not None:
            model.net = tail.detach()
    steps = kept if stopped else len(history["loss"])
    # every rank computes the same map from the same seeded inputs
    hardening = _harden(model, h_images, opts, seed, num_classes_h, cached)
    lambdas["ridge"] = ridge
    return TrainResult(
        method, steps, time.perf_counter() - t0, lambdas, history, hardening, stopped
    )


def _simulated(model, p_train, h_train, method, opts, seed, num_classes_h, cached):
    """:func:`pycore.deep._simulated.immunize_simulated` as a :class:`TrainResult`."""
    if cached:
        raise ParameterError(
            "scope",
            f"{method} trains the backbone (scope {getattr(opts, 'scope', 'tail')!r}): pass its "
            "images with cached=False, not the cached features of scope 'layer'",
        )
    if not isinstance(opts, SimulatedOptions):
        raise ParameterError("opts", f"{method} takes SimulatedOptions, got {type(opts).__name__}")
    out = immunize_simulated(model, p_train, h_train, opts, seed=seed, num_classes_h=num_classes_h)
    return TrainResult(
        method, out["kept"], out["seconds"], {}, out["history"], None, out["reason"]
    )


def _harden(model, h_train, opts, seed, num_classes_h, cached) -> dict | None:
    """``opts.harden`` applied to the trained model, from the seed's generator (None: none)."""
    if opts.harden == "none":
        return None
    return harden(
        model,
        h_train,
        opts.harden,
        num_classes=num_classes_h,
        scale=opts.harden_scale,
        rng=np.random.default_rng([seed, 99]),
        cached=cached,
    )


def _linear_layer(
    model, p_train, h_train, method, opts, seed, num_classes_h, device, progress=False
):
    """The layer as the linear problem on the features of all given rows.

    The layer as the linear problem (:mod:`pycore.deep._layer`) on the features of all given
    rows, the D_P head solved exactly; hardening as in the loop; ``progress``: the adaptive
    rule's bar on a terminal.
    """
    from pycore.deep._features import extract  # noqa: PLC0415
    from pycore.deep._layer import (  # noqa: PLC0415
        adaptive_layer,
        closed_form_layer,
        kstep_layer,
        set_layer,
    )

    t0 = time.perf_counter()
    model.to(device).eval().requires_grad_(False)
    Z_P, Z_H = (extract(model, d, cached=True) for d in (p_train, h_train))
    precision = model.layer.weight.dtype
    if method == "closed_form":
        sol = closed_form_layer(Z_P, Z_H, precision=precision)
    elif method == "kstep":
        sol = kstep_layer(
            Z_P,
            dataset_labels(p_train),
            Z_H,
            dataset_labels(h_train),
            steps=opts.kstep_steps,
            epochs=opts.adaptive_steps,
            patience=opts.patience,
            lr=opts.adaptive_lr,
            num_classes=(model.classifier.out_features, num_classes_h),
            precision=precision,
        )
    else:
        sol = adaptive_layer(
            Z_P,
            Z_H,
            steps=opts.adaptive_steps,
            patience=opts.patience,
            lr=opts.adaptive_lr,
            precision=precision,
            progress=progress,
        )
    kappa_theta = set_layer(model, sol.theta)
    hardening = _harden(model, h_train, opts, seed, num_classes_h, True)
    lambdas = {"kappa_theta": kappa_theta}
    return TrainResult(
        method, sol.steps, time.perf_counter() - t0, lambdas, sol.history, hardening, sol.reason
    )


def _step(
    runner, batches, opt, trainable, balance_params, opts, lambdas, rebalance, world, device
):
    """One step: ``(loss, term values, λ's, failure)``.

    ``failure`` is "" when the update was applied, else the reason (the update is then NOT
    applied). Ranks agree on a non-finite loss BEFORE the backward: DDP all-reduces gradients
    inside backward(), a rank that skipped it would hang the rest.
    """
    opt.zero_grad(set_to_none=True)
    try:
        terms = runner(batches)
        logs = {k: float(v.detach()) for k, v in terms.items()}
        bad = (
            _all_reduce([float(not all(map(math.isfinite, logs.values())))], world, device, "max")[
                0
            ]
            > 0
        )
        if not bad and rebalance:
            weights = {"lambda_h": opts.balance_ill} if opts.balance_ill is not None else None
            prev = lambdas if rebalance == "again" else None
            lambdas = {
                **lambdas,
                **balanced_lambdas(
                    terms,
                    balance_params,
                    opts.balance,
                    world=world,
                    weights=weights,
                    previous=prev,
                ),
            }
        loss = combine_terms(terms, lambdas) if not bad else torch.tensor(float("nan"))
        bad = bad or _all_reduce([float(not torch.isfinite(loss))], world, device, "max")[0] > 0
        if not bad:
            loss.backward()
            bad = not all(
                bool(torch.isfinite(p.grad).all()) for p in trainable if p.grad is not None
            )
    except FloatingPointError as exc:  # nothing to balance against: every rank sees the same norms
        return float("nan"), {}, lambdas, str(exc)
    except ops.CondRegError as exc:  # the op refused the batch (non-finite, degenerate, singular)
        if world > 1:
            raise
        return float("nan"), {}, lambdas, str(exc).strip().splitlines()[0]
    bad = _all_reduce([float(bad)], world, device, "max")[0] > 0
    keys = sorted(logs)
    logs = dict(zip(keys, _all_reduce([logs[k] for k in keys], world, device)))
    loss_val = _all_reduce([float(loss.detach())], world, device)[0]
    if bad:
        opt.zero_grad(set_to_none=True)
        return (
            loss_val,
            logs,
            lambdas,
            ", ".join(f"{k}={v:.3g}" for k, v in logs.items()) or "non-finite",
        )
    opt.step()
    return loss_val, logs, lambdas, ""


def _stop(method, opts, step, reason):
    """Raise :class:`NonFiniteLossError` naming the option to change."""
    balancing = reason.startswith("cannot balance")
    param = "balance" if balancing else "lr"
    advice = (
        "give fixed λ's (balance=None and lambda_p/lambda_h/...)"
        if balancing
        else f"lower lr (now {opts.lr:g})"
        + ("" if opts.balance is not None else " or the fixed λ's")
    )
    raise NonFiniteLossError(
        param,
        f"[{method}] non-finite loss or gradient at step {step} ({reason}); the model "
        f"keeps its state after step {step - 1}: {advice}",
        step,
    )
