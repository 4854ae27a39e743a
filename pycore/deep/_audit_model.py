"""The attacker's audit of a defended model against its θ₀ (docs/theory.md §12)."""

from __future__ import annotations

import numpy as np
from torch.utils.data import Subset

from pycore._report import progress as progress_bar
from pycore._validation import ParameterError, check_flag, check_number, check_seed
from pycore.deep._data import as_dataset, dataset_labels, label_count
from pycore.deep._judge import AuditResult, audit
from pycore.deep._models import check_model
from pycore.deep._operators import (
    LORA_RANKS,
    OPERATORS,
    AttackData,
    Schedule,
    operator_names,
    retrain_depths,
)

# The fewest samples in each of the attacker's splits of D_H (training, validation, test): an
# accuracy on one sample is 0 or 100 %, and a split of none cannot be trained or scored.
MIN_SPLIT = 2

AUDIT_OPTIONS = {
    "operators": OPERATORS,
    "lora_ranks": LORA_RANKS,
    "test_fraction": 0.2,
    "val_fraction": 0.2,
    "max_steps": Schedule.deep_max_steps,
    "scratch_max_steps": 600,
    "progress": True,
}


def audit_model(model, *, reference, dh, dh_test=None, seed: int = 0, **opts) -> AuditResult:
    """Attack a defended model and its θ₀ on the harmful task: what the defense is worth in FLOPs.

    Every operator attacks ``reference`` (θ₀) until its plateau is confirmed; the best plateau sets
    one target (90 % of its gain over chance). Each operator's cost is its FLOPs to the target,
    its learning rates tuned; the attacker's cost on a model is the cheapest operator's. The
    defense's worth is the attacker's cost on ``model`` over the cost on θ₀, against the ceiling
    of training the same architecture from scratch (docs/theory.md §12).

    The operators of :data:`~pycore.deep.OPERATORS`: linear probes (GD at 1/L, Adam, whitened
    Adam), the layer removed, LoRA adapters at each of ``lora_ranks``, fine-tuning of the last
    stage and of the whole network, the retrain of every suffix of stages (re-initialised by the
    architecture's own initialisation) and training from scratch.

    Parameters
    ----------
    model, reference : torch.nn.Module
        The defended model and the model it came from (θ₀), float32 on a CPU or CUDA device;
        neither is changed.
    dh : tuple of tensors, Dataset or DataLoader
        The attacker's labelled D_H data (as :func:`immunize_model`'s ``dh``). It is split into
        the attacker's training, validation and (without ``dh_test``) test splits of at least
        :data:`MIN_SPLIT` (2) samples each: ``dh`` needs 6 samples (4 with ``dh_test``).
    dh_test : same, optional
        D_H test data (default: a seeded ``test_fraction`` of ``dh``, at least 2 samples, held
        out).
    seed : int
        Seeds the splits and every operator; an integer in [0, 2**63 − 1].
    **opts
        ``operators`` (a subset of :data:`~pycore.deep.OPERATORS`, or ``lora_r<r>``,
        ``retrain_last<k>``), ``lora_ranks``
        (positive integers), ``test_fraction``, ``val_fraction`` (in (0, 1); the held-out
        split has max(2, round(fraction·n)) samples and must leave the splits their 2),
        ``max_steps`` (the longest a deep operator runs on θ₀ to its plateau, in optimizer
        steps), ``scratch_max_steps`` (the longest scratch trains to reach the target),
        ``progress`` (a bar over the operators, θ₀'s budgets then the model's, with the
        time left, on a terminal only: :func:`pycore._report.progress`; False: none)
        (:data:`AUDIT_OPTIONS`).

    Returns
    -------
    AuditResult
        θ₀'s side (plateaus, target, scratch, the FLOP cap, θ₀'s cheapest path), the model's
        cheapest path (per operator its :class:`~pycore.deep.AttackCost`) and its
        :class:`~pycore.deep.Worth`.

    Raises
    ------
    ParameterError
        An unknown option or a bad value, named, before any work: a ``model`` or ``reference``
        that is not a float32 module on a CPU or CUDA device; ``dh`` too small for the three
        splits, or a ``test_fraction`` or ``val_fraction`` that leaves a split below 2 samples;
        a LoRA operator without peft installed, ``operators`` that are not names, or
        ``retrain_tail`` alone against an unchanged backbone (``operators``); a ``model`` or
        ``reference`` whose weights are NaN, inf or all zero, or whose features are all zero.
    DataError
        ``.argument`` names ``dh`` or ``dh_test`` (``.sample`` the first bad sample): unbounded
        or non-integer labels, a ``dh`` of one class, inputs with NaN or inf or all zero, images
        of another rank, channel count, size or dtype, samples that are not ``(input, label)``
        pairs.

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import audit_model, create_model
    >>> net = create_model("test_resnet", 2, seed=0, img_size=32)  # timm's tiny test ResNet
    >>> g = torch.Generator().manual_seed(0)
    >>> dh = (torch.randn(60, 3, 32, 32, generator=g), torch.arange(60) % 2)
    >>> audit = audit_model(net, reference=net, dh=dh, operators=("gd", "adam"))
    >>> audit.path.names(), audit.worth.worth, audit.slowdown("adam")
    (['gd', 'adam'], 1.0, (1.0, False))
    """
    check_model(model, "model")
    check_model(reference, "reference")
    seed = check_seed(seed)
    bad = [k for k in opts if k not in AUDIT_OPTIONS]
    if bad:
        raise ParameterError(
            bad[0],
            f"unknown option {bad[0]!r} of audit_model; options: {', '.join(AUDIT_OPTIONS)}",
        )
    o = {**AUDIT_OPTIONS, **opts}
    names = operator_names(o["operators"], o["lora_ranks"])  # names, ranks, peft: before any work
    for k in ("test_fraction", "val_fraction"):
        check_number(o[k], k, low=0, high=1, low_open=True, high_open=True)
    max_steps = check_number(o["max_steps"], "max_steps", low=1, high=1_000_000, integer=True)
    scratch_steps = check_number(
        o["scratch_max_steps"], "scratch_max_steps", low=1, high=1_000_000, integer=True
    )
    check_flag(o["progress"], "progress")
    train = as_dataset(dh, "dh", model)
    test = None if dh_test is None else as_dataset(dh_test, "dh_test", model)
    # labels bounded before the attacker's heads are sized by them (data.label_count), each
    # named by its index in the argument that holds it
    classes = max(
        label_count(dataset_labels(d, name), name, least=least)
        for d, name, least in ((train, "dh", 2), (test, "dh_test", 1))  # a test split: any
        if d is not None
    )
    n = len(train)
    if n < MIN_SPLIT * (2 if test is not None else 3):
        raise ParameterError(
            "dh",
            f"dh has {n} samples; the attacker's training and validation splits"
            + (" and its test split" if test is None else "")
            + f" need at least {MIN_SPLIT} each",
        )
    rng = np.random.default_rng([seed, 4])
    if test is None:
        perm = rng.permutation(n).tolist()
        k = max(MIN_SPLIT, int(round(o["test_fraction"] * n)))
        if n - k < 2 * MIN_SPLIT:
            raise ParameterError(
                "test_fraction",
                f"test_fraction {o['test_fraction']:g} holds out {k} of dh's {n} samples, "
                f"leaving {n - k}; the attacker's training and validation splits need at least "
                f"{MIN_SPLIT} each",
            )
        train, test = Subset(train, sorted(perm[k:])), Subset(train, sorted(perm[:k]))
    m = len(train)
    perm = rng.permutation(m).tolist()
    k = max(MIN_SPLIT, int(round(o["val_fraction"] * m)))
    if m - k < MIN_SPLIT:
        raise ParameterError(
            "val_fraction",
            f"val_fraction {o['val_fraction']:g} keeps {k} of the attacker's {m} samples to "
            f"validate on, leaving {m - k} to train on; at least {MIN_SPLIT} are needed",
        )
    train, val = Subset(train, sorted(perm[k:])), Subset(train, sorted(perm[:k]))
    data = AttackData(
        train, val, test, classes, ("dh", "dh", "dh" if dh_test is None else "dh_test")
    )
    schedule = Schedule(deep_max_steps=max_steps)
    names = operator_names(o["operators"], o["lora_ranks"], depths=retrain_depths(reference))
    bar = progress_bar(
        total=2 * len(names), desc="audit_model", **({} if o["progress"] else {"disable": True})
    )

    def say(name):  # each operator as it starts: θ₀'s plateaus, then the model's race
        bar.set_postfix_str(name)
        bar.update(1)

    try:
        return audit(
            model,
            reference,
            data,
            operators=o["operators"],
            lora_ranks=o["lora_ranks"],
            seed=seed,
            schedule=schedule,
            scratch_max_steps=scratch_steps,
            progress=say,
        )
    finally:
        bar.close()
