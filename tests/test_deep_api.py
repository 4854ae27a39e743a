"""The public deep API (pycore/deep/_api.py): what immunize_model and audit_model check before any
work, the warning about a θ₀ near chance, the grouped verdict in the reason, LeViT."""

from __future__ import annotations

import copy
import sys
import warnings

import numpy as np
import pytest
import torch

from pycore import DivergenceError, ParameterError
from pycore.deep import (
    SOPHON,
    AttackData,
    ImmunizedNet,
    NearChanceWarning,
    SimulatedOptions,
    audit_model,
    create_model,
    immunize_model,
)
from pycore.deep._operators import LR_GRIDS

torch.set_num_threads(1)


def _data(n, seed, classes=2, side=32):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    return torch.randn(n, 3, side, side, generator=g) + 0.5 * y.view(-1, 1, 1, 1).float(), y


class WorkStarted(Exception):
    """What :func:`operators_spy` raises once audit_model's checks are behind."""


@pytest.fixture(scope="module")
def net():
    return create_model("resnet10t", 2, seed=0).eval()


@pytest.fixture
def operators_spy(monkeypatch):
    """The attacker's data audit_model splits dh into (:class:`pycore.deep.AttackData`), made
    once every check is behind and before any model is copied or attacked: raises
    :class:`WorkStarted` there, after recording it."""
    calls, real = [], AttackData.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        calls.append(self)
        raise WorkStarted

    monkeypatch.setattr(AttackData, "__init__", spy)
    return calls


@pytest.mark.parametrize(
    "n,kw,parameter",
    [
        (2, {}, "dh"),
        (5, {}, "dh"),
        (40, {"test_fraction": 0.99}, "test_fraction"),
        (40, {"test_fraction": 0.95}, "test_fraction"),
        (40, {"val_fraction": 0.99}, "val_fraction"),
        (3, {"dh_test": _data(4, 9)}, "dh"),
    ],
)
def test_audit_refuses_attacker_splits_below_two_samples_before_any_operator(
    net, operators_spy, n, kw, parameter
):
    with pytest.raises(ParameterError) as e:
        audit_model(net, reference=net, dh=_data(n, 1), max_steps=1, operators=("gd",), **kw)
    assert e.value.parameter == parameter and not operators_spy


@pytest.mark.parametrize("n,kw", [(6, {}), (4, {"dh_test": _data(2, 9)})])
def test_audit_splits_the_smallest_dh_into_splits_of_two(net, operators_spy, n, kw):
    with pytest.raises(WorkStarted):
        audit_model(net, reference=net, dh=_data(n, 1), max_steps=1, operators=("gd",), **kw)
    (data,) = operators_spy
    assert (len(data.train), len(data.val), len(data.test)) == (2, 2, 2)


def test_audit_names_the_reference_that_is_not_a_model(net, operators_spy):
    with pytest.raises(ParameterError) as e:
        audit_model(net, reference=None, dh=_data(20, 1), max_steps=1, operators=("gd",))
    assert e.value.parameter == "reference" and not operators_spy


def _converted(kind):
    net = create_model("resnet10t", 2, seed=0).eval()
    if kind == "meta":
        with torch.device("meta"):
            return create_model("resnet10t", 2)
    return net.to(
        {"half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}[kind]
    )


@pytest.mark.parametrize("kind", ["half", "bfloat16", "double", "meta"])
def test_models_not_float32_on_a_device_are_refused_naming_them(
    net, kind, work_spy, operators_spy
):
    bad = _converted(kind)
    with pytest.raises(ParameterError) as e:
        immunize_model(bad, _data(8, 1), _data(8, 2), adaptive_steps=5)
    assert e.value.parameter == "model" and not work_spy
    with pytest.raises(ParameterError) as e:
        audit_model(net, reference=bad, dh=_data(20, 1), max_steps=1, operators=("gd",))
    assert e.value.parameter == "reference" and not operators_spy


@pytest.mark.parametrize(
    "kw,parameter",
    [
        ({"max_steps": 1.5}, "max_steps"),
        ({"max_steps": None}, "max_steps"),
        ({"max_steps": True}, "max_steps"),
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": (1, 2)}, "max_steps"),
        ({"scratch_max_steps": 0}, "scratch_max_steps"),
        ({"max_epochs": 1}, "max_epochs"),  # the old option: unknown, named
        ({"operators": ("lora",), "lora_ranks": 2.5}, "lora_ranks"),
        ({"operators": ("lora",), "lora_ranks": None}, "lora_ranks"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.0}, "seed"),
    ],
)
def test_audit_options_that_are_not_integers_are_named(net, operators_spy, kw, parameter):
    kw = {"operators": ("gd",), "max_steps": 1, **kw}
    with pytest.raises(ParameterError) as e:
        audit_model(net, reference=net, dh=_data(20, 1), **kw)
    assert e.value.parameter == parameter and not operators_spy


def test_audit_takes_numpy_integers(net, operators_spy):
    with pytest.raises(WorkStarted):
        audit_model(
            net,
            reference=net,
            dh=_data(20, 1),
            max_steps=np.int64(2),
            operators=("gd", "lora"),
            lora_ranks=(np.int32(4),),
            seed=np.int64(3),
        )
    assert len(operators_spy) == 1


def test_a_lora_operator_without_peft_is_refused_before_any_operator(
    net, operators_spy, monkeypatch
):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ParameterError) as e:
        audit_model(net, reference=net, dh=_data(20, 1), max_steps=1, operators=("gd", "lora"))
    assert e.value.parameter == "operators" and not operators_spy


def test_a_negative_seed_is_refused_before_any_work(net, work_spy):
    with pytest.raises(ParameterError) as e:
        immunize_model(net, _data(16, 1), _data(16, 2), seed=-1, adaptive_steps=5)
    assert e.value.parameter == "seed" and not work_spy


def test_a_model_near_chance_on_dp_is_warned_about_naming_it(net):
    X, y = _data(48, 1)
    with pytest.warns(NearChanceWarning) as w:  # a random network: about half of 2 classes
        immunize_model(net, (X, y), _data(48, 2), adaptive_steps=5)
    warning = next(r.message for r in w if isinstance(r.message, NearChanceWarning))
    assert warning.parameter == "model" and warning.top1 < 75.0 and warning.chance == 50.0
    sure = create_model("resnet10t", 2, seed=0).eval()
    with torch.no_grad():
        sure.fc.weight.normal_(generator=torch.Generator().manual_seed(0))
        own = sure(X).argmax(1)  # D_P's labels the model's own predictions: top-1 100 %
    assert own.unique().numel() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", NearChanceWarning)
        immunize_model(sure, (X, own), _data(48, 2), adaptive_steps=5)


def test_the_reason_gives_the_grouped_verdict_when_it_differs(net):
    """On 150 rows a task the closed form meets Definition 3.1 on all rows by orders of magnitude
    ((i) ≈ 1e3, (ii) ≈ 1e-3) while the paper's means over groups of 100 rows miss it ((i) ≈ 0.04):
    the reason gives the groups' (i) and (ii) beside the verdict on all rows."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)
        res = immunize_model(net, _data(150, 1), _data(150, 50), method="closed_form", heldout=0)
    g = res.grouped
    assert res.immunized and not g.immunized and g.group_size == 100
    assert f"{g.harmful_ratio:.4g}" in res.reason and f"{g.pretrain_ratio:.4g}" in res.reason


def test_levit_is_audited_by_every_deep_operator(monkeypatch):
    """LeViT caches its attention biases in eval mode, where the attacker's copies are scored: the
    copies are made and trained without the cache, and LeViT against itself costs what it costs
    on itself (one learning rate per operator: the grid is not what is tested here)."""
    net = create_model("levit_128s", 2, seed=0, img_size=32).eval()
    ops = ("finetune_upper", "finetune_full")
    for op in ops:
        monkeypatch.setitem(LR_GRIDS, op, {"": (1e-3,)})
    audit = audit_model(net, reference=net, dh=_data(12, 1), max_steps=4, operators=ops)
    for op in ops:
        assert audit[op].cost.per_step > 0 and audit.reference.path[op].reach is not None
    best = audit.reference.cheapest
    assert audit[best.operator].flops_to_target == best.flops_to_target
    assert audit.worth.worth == 1.0


# --- the held-out GD probe and the progress bar -------------------------------------------------


def test_the_held_out_probe_keeps_its_rows_out_of_the_immunization(net):
    """A quarter of dh's rows, at least 8, is held out: the layer is immunized on the others (the
    grouped RIR's groups are as large as the fewer rows of a task, here dh's), the paper's GD
    probe trains on half of the held-out rows and scores the other half, on θ₀'s features (the
    same whatever the method) and on the model's."""
    dp = _data(48, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)
        res = {
            method: immunize_model(net, dp, _data(48, 2), method=method, adaptive_steps=5)
            for method in ("ours", "closed_form")
        }
        off = immunize_model(net, dp, _data(16, 2), heldout=0, adaptive_steps=5)
        small = immunize_model(net, dp, _data(9, 2), adaptive_steps=5)
        eight = immunize_model(net, dp, _data(16, 2), adaptive_steps=5)
    for r in res.values():
        assert r.grouped.group_size == 36 and r.probe.rows == (6, 6)
        assert r.probe.steps == (10, 60) and r.to_dict()["probe"]["faster"] is r.probe.faster
        assert all(0 <= a <= 100 for a in r.probe.reference + r.probe.model)
    assert res["ours"].probe.reference == res["closed_form"].probe.reference
    assert off.probe is None and off.to_dict()["probe"] is None and off.grouped.group_size == 16
    assert small.probe is None and small.grouped.group_size == 9  # too few rows to hold 8 out
    assert eight.probe.rows == (4, 4) and eight.grouped.group_size == 8


@pytest.mark.parametrize("heldout", [1.0, -0.1, float("nan"), "a quarter"])
def test_a_bad_heldout_is_refused_naming_it_before_any_work(net, work_spy, heldout):
    with pytest.raises(ParameterError) as e:
        immunize_model(net, _data(16, 1), _data(16, 2), heldout=heldout)
    assert e.value.parameter == "heldout" and not work_spy


@pytest.mark.parametrize("progress", [True, False])
def test_progress_false_shows_no_bar(net, monkeypatch, progress):
    import tqdm.auto

    bars = []
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **kw: bars.append(kw) or _NoBar())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)
        immunize_model(net, _data(16, 1), _data(16, 2), adaptive_steps=5, progress=progress)
    assert bool(bars) == progress


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix(self, **kw):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("progress", [True, False])
def test_the_audit_counts_every_operator_run_on_its_bar_only_when_asked(
    net, monkeypatch, progress
):
    """audit_model's bar: one count per operator run, θ₀'s side then the model's race,
    named as it starts; ``progress=False`` disables it (on a terminal too)."""
    import io

    import tqdm.auto

    seen = []

    class Bar:
        def __init__(self, iterable=None, *, total, desc, disable, leave):
            self.total, self.disable, self.n = total, disable, 0
            seen.append(self)

        def set_postfix_str(self, name):
            self.name = name

        def update(self, k=1):
            self.n += k

        def close(self):
            pass

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setattr(sys, "stderr", Terminal())
    audit_model(
        net,
        reference=net,
        dh=_data(12, 1),
        max_steps=1,
        operators=("gd", "adam"),
        progress=progress,
    )
    (bar,) = seen
    assert (bar.total, bar.n, bar.disable) == (4, 4, not progress)


@pytest.fixture(scope="module")
def tiny():
    return create_model("test_resnet", 2, seed=0, img_size=32).eval()


@pytest.mark.parametrize("operators", [None, 3, ("gd", None), ()])
def test_audit_operators_that_are_not_names_are_named(tiny, operators_spy, operators):
    with pytest.raises(ParameterError) as e:
        audit_model(tiny, reference=tiny, dh=_data(20, 1), operators=operators)
    assert e.value.parameter == "operators" and not operators_spy


@pytest.mark.parametrize("progress", ["yes", 1, None])
def test_a_progress_that_is_not_a_bool_is_named_before_any_work(
    tiny, work_spy, operators_spy, progress
):
    with pytest.raises(ParameterError) as e:
        immunize_model(tiny, _data(16, 1), _data(16, 2), progress=progress)
    assert e.value.parameter == "progress" and not work_spy
    with pytest.raises(ParameterError) as e:
        audit_model(tiny, reference=tiny, dh=_data(20, 1), operators="gd", progress=progress)
    assert e.value.parameter == "progress" and not operators_spy


def test_an_unknown_method_is_named_before_any_work(tiny, work_spy):
    with pytest.raises(ParameterError) as e:
        immunize_model(tiny, _data(16, 1), _data(16, 2), method="sophon2")
    assert e.value.parameter == "method" and not work_spy


def test_the_retrain_of_a_backbone_the_defense_left_alone_is_theta0s(tiny):
    """A defense of the layer alone: every retrain re-initialises stages the defense did not
    touch, so it runs as on θ₀ and is taken from θ₀'s side, cost for cost (no operator is dropped
    or refused); ``retrain_tail``, the old name, is refused naming ``operators``."""
    defended = ImmunizedNet(copy.deepcopy(tiny))
    with torch.no_grad():
        defended.layer.weight.mul_(2.0)  # the layer changed, the backbone not
    audit = audit_model(
        defended,
        reference=tiny,
        dh=_data(20, 1),
        operators=("gd", "retrain_last1"),
        max_steps=4,
        progress=False,
    )
    assert audit.path.names() == ["gd", "retrain_last1"]
    mine, base = audit["retrain_last1"], audit.reference.path["retrain_last1"]
    assert mine.reach is base.reach or mine.flops_limit <= base.flops
    with pytest.raises(ParameterError) as e:
        audit_model(defended, reference=tiny, dh=_data(20, 1), operators="retrain_tail")
    assert e.value.parameter == "operators"


@pytest.mark.parametrize("method", ["simulated", "sophon"])
def test_the_simulated_attackers_run_on_images_with_their_own_options(tiny, method):
    """Their options are SimulatedOptions (sophon's from SOPHON), scope 'tail' by default: the
    images are passed as they are, never cached as features."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)  # a random-init model
        res = immunize_model(
            tiny, _data(16, 1), _data(16, 2), method=method, steps=2, progress=False
        )
    assert res.method == method and isinstance(res.options, SimulatedOptions)
    assert res.options.lr == (SOPHON.lr if method == "sophon" else SimulatedOptions().lr)
    assert res.steps <= 2 and res.model is not tiny
    for kw, parameter in (
        ({"scope": "layer"}, "scope"),
        ({"adaptive_steps": 5}, "adaptive_steps"),
    ):
        with pytest.raises(ParameterError) as e:
            immunize_model(tiny, _data(16, 1), _data(16, 2), method=method, **kw)
        assert e.value.parameter == parameter


def _broken(model, how):
    bad = copy.deepcopy(model)
    with torch.no_grad():
        if how == "nan":
            next(bad.parameters())[0] = float("nan")
        else:
            for p in bad.parameters():
                p.zero_()
    return bad


@pytest.mark.parametrize("how", ["nan", "zero"])
def test_weights_that_give_no_features_name_the_model_they_belong_to(
    tiny, work_spy, operators_spy, how
):
    bad = _broken(tiny, how)
    work_spy.clear()  # the copy made here
    with pytest.raises(ParameterError) as e:
        immunize_model(bad, _data(16, 1), _data(16, 2), progress=False)
    assert e.value.parameter == "model" and not work_spy
    for model, reference, name in ((bad, tiny, "model"), (tiny, bad, "reference")):
        with pytest.raises(ParameterError) as e:
            audit_model(model, reference=reference, dh=_data(20, 1), operators="gd")
        assert e.value.parameter == name and not operators_spy


@pytest.mark.parametrize("scale,error", [(0.0, ParameterError), (3e38, DivergenceError)])
def test_zero_or_overflowing_features_name_the_model_they_come_from(tiny, scale, error):
    """Finite weights whose features are all zero (a zeroed immunization layer) or overflow
    float32 (a layer of 3e38): blamed on the model that gives them, the inputs being fine."""
    dead = ImmunizedNet(copy.deepcopy(tiny))
    with torch.no_grad():
        dead.layer.weight.fill_(scale)
    with pytest.raises(error) as e:
        immunize_model(dead, _data(16, 1), _data(16, 2), progress=False)
    assert e.value.parameter == "model"
    for model, reference, name in ((dead, tiny, "model"), (tiny, dead, "reference")):
        with pytest.raises(error) as e:
            audit_model(
                model, reference=reference, dh=_data(20, 1), operators="gd", progress=False
            )
        assert e.value.parameter == name
