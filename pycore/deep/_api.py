"""The public deep API (docs/design.md §3): :func:`immunize_model`, and :func:`audit_model`.

For any timm classifier and data given as an ``(X, y)`` tensor pair, a ``Dataset`` or a
``DataLoader``; :func:`audit_model` lives in :mod:`pycore.deep._audit_model`.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from pycore._evaluate import chance_accuracy, immunized_def31, near_chance
from pycore._metrics import ExponentWindow, feature_rir, grouped_feature_rir
from pycore._validation import (
    check_choice,
    check_flag,
    check_number,
    check_seed,
)
from pycore.deep._data import as_dataset, dataset_labels, label_count
from pycore.deep._features import extract, prelogits_dataset
from pycore.deep._layer import attainability
from pycore.deep._models import ImmunizedNet, as_immunized, check_model
from pycore.deep._objectives import DEEP_METHODS, SIMULATED_METHODS
from pycore.deep._probes import linear_probe_curve
from pycore.deep._simulated import SOPHON, SimulatedOptions
from pycore.deep._train import DeepOptions, immunize_in_place, options


class NearChanceWarning(UserWarning):
    """The model given to :func:`immunize_model` scores near chance on D_P's given rows.

    By :func:`pycore.near_chance`: ``.parameter`` names the model (``"model"``), ``.top1`` and
    ``.chance`` are the two accuracies (%).
    """

    def __init__(self, parameter: str, message: str, top1: float, chance: float):
        super().__init__(message)
        self.parameter, self.top1, self.chance = parameter, top1, chance


@dataclass(frozen=True)
class GroupedRIR:
    """RIR_θ₀ by the paper's protocol (docs/theory.md §8).

    Means over ``groups`` random groups of ``group_size`` rows of (i), (ii) and RIR, and Definition
    3.1 on those means.
    """

    harmful_ratio: float
    pretrain_ratio: float
    rir: float
    groups: int
    group_size: int

    @property
    def immunized(self) -> bool:
        return immunized_def31(self.harmful_ratio, self.pretrain_ratio)

    @classmethod
    def of(cls, Z_P, Z_H, Z_P0, Z_H0, *, rng, groups: int, group_size: int) -> GroupedRIR:
        """The means of :func:`pycore.grouped_feature_rir` over the features after and before."""
        g = grouped_feature_rir(
            Z_P, Z_H, Z_P0, Z_H0, rng=rng, groups=groups, group_size=group_size
        )
        return cls(
            g["harmful_ratio"]["mean"],
            g["pretrain_ratio"]["mean"],
            g["value"]["mean"],
            g["groups"],
            g["group_size"],
        )


# The held-out check of immunize_model: the share of dh held out from the immunization (at least
# MIN_HELDOUT rows: the GD probe trains on half of them and is scored on the other half, so each
# half has 4), and the GD steps at which the probe is scored (the demo's Figure 3 reads 10 and 60).
HELDOUT, MIN_HELDOUT, PROBE_STEPS = 0.25, 8, (10, 60)


@dataclass(frozen=True)
class HeldOutProbe:
    """The paper's GD probe on D_H rows held out from the immunization.

    The paper's GD probe (step 1/L, :func:`pycore.deep._probes.linear_probe_curve`) on D_H rows
    held out from the immunization: trained on ``rows[0]`` of them, scored (D_H accuracy, %) on
    the other ``rows[1]`` after each of ``steps`` full-batch GD steps, on θ₀'s features
    (``reference``) and on the immunized model's (``model``). ``deficit`` = reference − model in
    points: > 0 the attacker learns D_H slower from the immunized model, < 0 faster.
    """

    steps: tuple
    rows: tuple
    reference: tuple
    model: tuple

    @property
    def deficit(self) -> tuple:
        return tuple(r - m for r, m in zip(self.reference, self.model))

    @property
    def faster(self) -> bool:
        """The probe learned D_H faster from the immunized model at some scored step."""
        return any(d < 0 for d in self.deficit)

    def to_dict(self) -> dict:
        return {**self.__dict__, "deficit": self.deficit, "faster": self.faster}


@dataclass(frozen=True)
class DeepImmunization:
    """:func:`immunize_model`'s result: the immunized copy.

    (i) ``harmful_ratio``, (ii) ``pretrain_ratio`` and ``rir`` of its features against the given
    model's on ALL rows it was immunized on (``dp``, and ``dh`` less the held-out rows; exact κ's,
    the quantities of the linear problem the layer is, docs/theory.md §8, §10), Definition 3.1 on
    them (``immunized``); the paper's grouped RIR_θ₀ (``grouped``: means over 20 groups of 100
    rows, the quantity the paper's tables report, with its own Definition 3.1 verdict
    ``grouped.immunized``; the two can disagree, docs/design.md §4); the RIR ceiling of the given
    model's features and the closed form's Definition 3.1 window on them (``None``: κ(C) = 1; with
    a NaN ceiling: features whose κ's are float32 round-off's); ``probe``: the paper's GD probe on
    D_H rows held out from the immunization, on θ₀'s features and on the model's
    (:class:`HeldOutProbe`; None when ``dh`` was too small to hold rows out or ``heldout=0``);
    ``reason``: how training ended, when Definition 3.1 fails why, the grouped verdict when it
    differs from the all-rows one, and when the held-out probe learned D_H faster from the model
    than from θ₀.
    """

    model: ImmunizedNet
    method: str
    harmful_ratio: float
    pretrain_ratio: float
    rir: float
    immunized: bool
    grouped: GroupedRIR
    ceiling: float
    window: ExponentWindow | None
    steps: int
    options: DeepOptions
    reason: str
    wall_seconds: float
    hardening: dict | None = None
    lambdas: dict = field(default_factory=dict)
    history: dict = field(default_factory=dict)
    probe: HeldOutProbe | None = None

    def to_dict(self) -> dict:
        """Every field but the model (and the per-step history), JSON-ready."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        del out["model"], out["history"]
        out["grouped"] = {**self.grouped.__dict__, "immunized": self.grouped.immunized}
        out["probe"] = None if self.probe is None else self.probe.to_dict()
        out["window"] = None if self.window is None else self.window.to_dict()
        out["options"] = self.options.__dict__
        return out


def immunize_model(
    model,
    dp,
    dh,
    *,
    method: str = "ours",
    seed: int = 0,
    heldout: float = HELDOUT,
    progress: bool = True,
    **opts,
) -> DeepImmunization:
    """Immunize a copy of ``model`` against ``dh`` while it keeps ``dp`` (paper §5.2).

    The default, ``method="ours"`` with scope ``"layer"``, inserts an immunization layer between
    the frozen backbone and the head and trains it on the backbone's features, computed once, by
    the adaptive rule of the linear default (docs/design.md §4): the layer is the linear problem
    of docs/theory.md §10, so its ceiling and the closed form's window on the same features say
    whether a miss is the method's or the features'. Where the window is open the rule starts
    from the closed form at the window's balanced exponent, whose margin no θ of the layer
    exceeds (it then takes no step). The paper's fixed-λ SGD loop is ``rule="sgd"``;
    ``"imma"``, ``"opt_kappa"``, ``"r_ill_only"`` are the baselines.

    A seeded ``heldout`` share of ``dh`` (at least :data:`MIN_HELDOUT` rows) is kept out of the
    immunization; the paper's GD probe (step 1/L) is trained on half of it and scored on the
    other half after each of :data:`PROBE_STEPS` steps, on θ₀'s features and on the immunized
    model's (``probe``): Definition 3.1 on the immunization's rows never stands alone next to an
    attacker that got faster on rows it did not see.

    Parameters
    ----------
    model : torch.nn.Module
        A timm classifier, or any module with timm's ``forward_features``,
        ``forward_head(pre_logits=True)`` and ``get_classifier()``, float32 on a CPU or CUDA
        device. Left as it is.
    dp, dh : tuple of tensors, Dataset or DataLoader
        The pre-training task D_P (labels are ``model``'s classes) and the harmful task D_H, each
        of at least 2 classes: an ``(X, y)`` pair, or a Dataset (a DataLoader's) of ``(input
        tensor, label)`` pairs; labels are integers (class indices), inputs finite images of the
        model's channels, one size, float32 (float64 and float16 are cast)
        (:func:`pycore.deep._data.as_dataset`).
    method : str
        One of :data:`~pycore.deep.DEEP_METHODS`.
    seed : int
        Seeds the training, the held-out split and the paper's grouped RIR_θ₀; an integer in
        [0, 2**63 − 1].
    heldout : float
        The share of ``dh`` held out for the GD probe, in [0, 1): ``round(heldout·n)`` rows, at
        least :data:`MIN_HELDOUT`, provided 2 rows are left to immunize on (else no probe, and the
        ``reason`` says so); 0: no probe, every row immunizes.
    progress : bool
        A progress bar with the time left for the long steps (the adaptive rule, the SGD loop), on
        a terminal only (:func:`pycore._report.progress`); False: none.
    **opts
        Fields of :class:`~pycore.deep.DeepOptions`; for ``simulated`` and ``sophon`` of
        :class:`~pycore.deep.SimulatedOptions` (``sophon``'s start from
        :data:`~pycore.deep.SOPHON`), whose scope trains the backbone on the images.

    Returns
    -------
    DeepImmunization
        The immunized copy and, on ALL rows it was immunized on (``dp``, ``dh`` less the held-out
        rows), (i), (ii), RIR and Definition 3.1 against the given model's features
        (``immunized``); the paper's grouped RIR_θ₀ with its own verdict (``grouped.immunized``:
        what the paper reports, docs/theory.md §8); the ceiling and window; the held-out GD
        probe (``probe``, its signed ``deficit``); ``reason``.

    Raises
    ------
    ParameterError
        An unknown ``method``, an unknown or out-of-range option, ``seed``, ``heldout`` or
        ``progress``, named; a ``model`` that is not float32 on a CPU or CUDA device (half,
        bfloat16, float64, the meta device), or whose weights are NaN, inf or all zero, or
        whose features are all zero.
    DataError
        ``.argument`` names ``dp`` or ``dh`` (``.sample`` the first bad sample): labels of
        ``dp`` outside the model's classes, unbounded or non-integer labels, one class, inputs
        with NaN or inf or all zero, images of another rank, channel count, size or dtype,
        samples that are not ``(input, label)`` pairs.
    NonFiniteLossError
        The SGD loop's loss became non-finite; names the option to change.

    Warns
    -----
    NearChanceWarning
        The given model's D_P top-1 on ``dp`` is near chance (:func:`pycore.near_chance`):
        it has not learned D_P, so keeping D_P (Definition 3.1(c)) means little.

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import create_model, immunize_model
    >>> net = create_model("test_resnet", 2, seed=0, img_size=32)  # timm's tiny test ResNet
    >>> g = torch.Generator().manual_seed(0)
    >>> X, y = torch.randn(96, 3, 32, 32, generator=g), torch.arange(96) % 2
    >>> res = immunize_model(net, (X[:48], y[:48]), (X[48:], y[48:]), adaptive_steps=200)
    >>> res.method, res.model is net, res.immunized == (res.harmful_ratio > 1 > res.pretrain_ratio)
    ('ours', False, True)
    >>> res.probe.steps, res.probe.rows  # 12 of dh's 48 rows held out: 6 to train, 6 to score
    ((10, 60), (6, 6))
    """
    check_model(model, "model")
    seed = check_seed(seed)
    check_number(heldout, "heldout", low=0.0, high=1.0, high_open=True)
    check_flag(progress, "progress")
    o = _method_options(method, opts)
    p, h = as_dataset(dp, "dp", model), as_dataset(dh, "dh", model)
    classes_h = label_count(dataset_labels(h, "dh"), "dh")  # before the harmful head is sized
    y_p = dataset_labels(p, "dp")
    keep, held_rows, why_no_probe = _hold_out(len(h), heldout, seed)
    out = as_immunized(model).eval()
    label_count(y_p, "dp", out.classifier.out_features)
    cached = getattr(o, "scope", None) == "layer"
    if cached:
        p = prelogits_dataset(out, p, data_name="dp", model_name="model")
        h = prelogits_dataset(out, h, data_name="dh", model_name="model")
    # all of dh's features at once, split by rows after: an error names dh's own sample
    before = [
        extract(out, d, cached=cached, data_name=n, model_name="model")
        for d, n in ((p, "dp"), (h, "dh"))
    ]
    held = None
    if held_rows is not None:
        held, held_before = _take(h, held_rows), before[1][held_rows]
        h, before[1] = _take(h, keep), before[1][keep]
    _warn_near_chance(out, before[0], y_p)
    t0 = time.perf_counter()
    res = immunize_in_place(
        out,
        p,
        h,
        method,
        o,
        seed=seed,
        num_classes_h=classes_h,
        cached=cached,
        device=next(out.parameters()).device,
        progress=progress,
    )
    after = [extract(out, d, cached=cached) for d in (p, h)]
    r = feature_rir(*after, *before)
    grouped = GroupedRIR.of(
        *after, *before, rng=np.random.default_rng(seed), groups=20, group_size=100
    )
    ceiling, window, why = attainability(*before, precision=out.layer.weight.dtype)
    ok = immunized_def31(r.harmful_ratio, r.pretrain_ratio)
    reason = res.stopped or f"trained {res.steps} steps"
    if not ok and why not in reason:
        reason += (
            "; Definition 3.1 does not hold on the immunization's rows "
            f"((i) = {r.harmful_ratio:.4g}, (ii) = {r.pretrain_ratio:.4g}): {why}"
        )
    if grouped.immunized != ok:
        reason += (
            f"; by the paper's grouped RIR_θ₀ (means over {grouped.groups} groups of "
            f"{grouped.group_size} rows, docs/theory.md §8: (i) = {grouped.harmful_ratio:.4g}, "
            f"(ii) = {grouped.pretrain_ratio:.4g}) Definition 3.1 "
            f"{'holds' if grouped.immunized else 'does not hold'}, unlike on all rows "
            f"((i) = {r.harmful_ratio:.4g}, (ii) = {r.pretrain_ratio:.4g}): the groups measure "
            "the conditioning of low-dimensional projections, another quantity (docs/design.md §4)"
        )
    probe = None
    if held is not None:
        y_held = dataset_labels(held, "dh")
        probe = _probe(held_before, extract(out, held, cached=cached), y_held, classes_h, seed)
        if probe.faster:
            worse = ", ".join(
                f"{-d:.3g} points at step {t}" for t, d in zip(probe.steps, probe.deficit) if d < 0
            )
            reason += (
                f"; on {sum(probe.rows)} D_H rows held out from the immunization the paper's GD "
                f"probe (step 1/L) learns D_H faster from this model than from the given one: "
                f"{worse} more accuracy (the κ's above do not slow it)"
            )
    else:
        reason += f"; {why_no_probe}"
    return DeepImmunization(
        out.eval(),
        method,
        r.harmful_ratio,
        r.pretrain_ratio,
        r.value,
        ok,
        grouped,
        ceiling,
        window,
        res.steps,
        o,
        reason,
        time.perf_counter() - t0,
        res.hardening,
        res.lambdas,
        res.history,
        probe,
    )


def _method_options(method, opts: dict):
    """The options of ``method``, each checked.

    :class:`DeepOptions`, or for the simulated attackers :class:`SimulatedOptions` (``sophon``
    from :data:`SOPHON`'s): their scope trains the backbone, so images are never cached.
    """
    check_choice(method, "method", DEEP_METHODS)
    if method in SIMULATED_METHODS:
        base = SOPHON if method == "sophon" else SimulatedOptions()
        return SimulatedOptions.build(base, f"method {method!r}", **opts)
    return options(**opts)


def _hold_out(n: int, heldout: float, seed: int):
    """The rows of ``dh`` to immunize on, the held-out rows (or None), and why none.

    ``(rows to immunize on, held-out rows or None, why none)`` of ``dh``'s ``n``: a seeded
    ``heldout`` share, at least :data:`MIN_HELDOUT` rows, when 2 rows are left to immunize on.
    """
    if heldout == 0:
        return None, None, "no held-out GD probe (heldout=0)"
    k = max(MIN_HELDOUT, int(round(heldout * n)))
    if n - k < 2:
        return (
            None,
            None,
            (
                f"no held-out GD probe: dh's {n} rows cannot spare the {MIN_HELDOUT} it needs and "
                "leave 2 to immunize on"
            ),
        )
    perm = np.random.default_rng([seed, 5]).permutation(n)
    return np.sort(perm[k:]), np.sort(perm[:k]), ""


def _take(data, rows: np.ndarray):
    """``data``'s ``rows``: a TensorDataset of them (cached features), else a Subset."""
    if isinstance(data, TensorDataset):
        idx = torch.from_numpy(rows)
        return TensorDataset(*(t[idx] for t in data.tensors))
    return Subset(data, rows.tolist())


def _probe(Z_ref, Z, y, classes: int, seed: int) -> HeldOutProbe:
    """:class:`HeldOutProbe` of the held-out rows' features before (``Z_ref``) and after (``Z``).

    The same seeded half trains the probe on both, the other half scores it.
    """
    n = len(y)
    perm = np.random.default_rng([seed, 6]).permutation(n)
    fit, score = np.sort(perm[: n // 2]), np.sort(perm[n // 2 :])
    curves = [
        linear_probe_curve(
            F[fit], y[fit], F[score], y[score], epochs=max(PROBE_STEPS), num_classes=classes
        ).test_accuracy
        for F in (Z_ref, Z)
    ]
    at = lambda c: tuple(float(c[t]) for t in PROBE_STEPS)  # noqa: E731
    return HeldOutProbe(PROBE_STEPS, (len(fit), len(score)), at(curves[0]), at(curves[1]))


def _warn_near_chance(model: ImmunizedNet, Z_P: np.ndarray, y_p: np.ndarray) -> None:
    """A :class:`NearChanceWarning` when the model's own head scores near chance on D_P.

    A :class:`NearChanceWarning` when ``model``'s own head on its D_P features ``Z_P`` (all
    given rows) scores near chance (the rule deepnet.py applies to θ₀).
    """
    head = model.classifier
    W = head.weight.detach().double().cpu().numpy()
    b = 0.0 if head.bias is None else head.bias.detach().double().cpu().numpy()
    top1 = 100.0 * float(np.mean(np.argmax(Z_P @ W.T + b, axis=1) == y_p))
    chance = chance_accuracy(y_p)
    if near_chance(top1, chance):
        warnings.warn(
            NearChanceWarning(
                "model",
                f"model scores {top1:.1f}% on dp's {len(y_p)} rows, near chance ({chance:.1f}%, "
                "its largest class): it has not learned D_P, so what immunization keeps of D_P "
                "means little; train it on D_P first (or pass the model that was)",
                top1,
                chance,
            ),
            stacklevel=3,
        )
