"""The public deep API (pycore/deep/api.py): what immunize_model and audit_model check before any
work, the warning about a θ₀ near chance, the grouped verdict in the reason, LeViT."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

from pycore.deep import NearChanceWarning, api, audit_model, create_model, immunize_model
from pycore.deep.probes import ProbeCurve
from pycore.validation import ParameterError

torch.set_num_threads(1)


def _data(n, seed, classes=2, side=32):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    return torch.randn(n, 3, side, side, generator=g) + 0.5 * y.view(-1, 1, 1, 1).float(), y


class _Reached(Exception):
    """What a spy raises once the checks are behind: the work would start here."""


@pytest.fixture(scope="module")
def net():
    return create_model("resnet10t", 2, seed=0).eval()


@pytest.fixture
def operators_spy(monkeypatch):
    """Counts the operator runs audit_model starts (θ₀'s budgets first; stops there)."""
    calls = []

    def spy(reference, data, *a, **kw):
        calls.append(data)
        raise _Reached

    monkeypatch.setattr(api, "budgets", spy)
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
        audit_model(net, reference=net, dh=_data(n, 1), max_epochs=1, operators=("gd",), **kw)
    assert e.value.parameter == parameter and not operators_spy


@pytest.mark.parametrize("n,kw", [(6, {}), (4, {"dh_test": _data(2, 9)})])
def test_audit_splits_the_smallest_dh_into_splits_of_two(net, operators_spy, n, kw):
    with pytest.raises(_Reached):
        audit_model(net, reference=net, dh=_data(n, 1), max_epochs=1, operators=("gd",), **kw)
    (data,) = operators_spy
    assert (len(data.train), len(data.val), len(data.test)) == (2, 2, 2)


def test_audit_names_the_reference_that_is_not_a_model(net, operators_spy):
    with pytest.raises(ParameterError) as e:
        audit_model(net, reference=None, dh=_data(20, 1), max_epochs=1, operators=("gd",))
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
        audit_model(net, reference=bad, dh=_data(20, 1), max_epochs=1, operators=("gd",))
    assert e.value.parameter == "reference" and not operators_spy


@pytest.mark.parametrize(
    "kw,parameter",
    [
        ({"max_epochs": 1.5}, "max_epochs"),
        ({"max_epochs": None}, "max_epochs"),
        ({"max_epochs": True}, "max_epochs"),
        ({"max_epochs": 0}, "max_epochs"),
        ({"max_epochs": (1, 2)}, "max_epochs"),
        ({"epochs": 1}, "epochs"),  # the old option: unknown, named
        ({"operators": ("lora",), "lora_ranks": 2.5}, "lora_ranks"),
        ({"operators": ("lora",), "lora_ranks": None}, "lora_ranks"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.0}, "seed"),
    ],
)
def test_audit_options_that_are_not_integers_are_named(net, operators_spy, kw, parameter):
    kw = {"operators": ("gd",), "max_epochs": 1, **kw}
    with pytest.raises(ParameterError) as e:
        audit_model(net, reference=net, dh=_data(20, 1), **kw)
    assert e.value.parameter == parameter and not operators_spy


def test_audit_takes_numpy_integers(net, operators_spy):
    with pytest.raises(_Reached):
        audit_model(
            net,
            reference=net,
            dh=_data(20, 1),
            max_epochs=np.int64(2),
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
        audit_model(net, reference=net, dh=_data(20, 1), max_epochs=1, operators=("gd", "lora"))
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


def test_the_reason_gives_the_grouped_verdict_when_it_differs(net, monkeypatch):
    dp, dh = _data(48, 1), _data(48, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)
        first = immunize_model(net, dp, dh, adaptive_steps=50)
        # the groups' (i) and (ii) made to disagree with the verdict on all rows
        i, ii = (0.5, 2.0) if first.immunized else (2.0, 0.5)

        def grouped(*a, **k):
            mean = lambda v: {"mean": v, "std": 0.0, "per_group": [v]}  # noqa: E731
            out = {"harmful_ratio": mean(i), "pretrain_ratio": mean(ii), "value": mean(i / ii)}
            return {**out, "groups": 20, "group_size": 48}

        monkeypatch.setattr(api, "grouped_feature_rir", grouped)
        res = immunize_model(net, dp, dh, adaptive_steps=50)
    assert res.immunized == first.immunized and res.grouped.immunized != res.immunized
    assert f"{i:.4g}" in res.reason and f"{ii:.4g}" in res.reason
    assert f"{i:.4g}" not in first.reason or first.grouped.immunized == first.immunized


def test_levit_is_audited_by_every_deep_operator(monkeypatch):
    """LeViT caches its attention biases in eval mode, where the attacker's copies are scored: the
    copies are made and trained without the cache, and LeViT against itself is slowed by 1 and
    loses nothing (one learning rate per operator: the grid is not what is tested here)."""
    from pycore.deep import operators

    net = create_model("levit_128s", 2, seed=0, img_size=32).eval()
    ops = ("finetune_upper", "finetune_full")
    for op in ops:
        monkeypatch.setitem(operators.LR_GRIDS, op, {"": (1e-3,)})
    audit = audit_model(net, reference=net, dh=_data(12, 1), max_epochs=2, operators=ops)
    for op in ops:
        assert (audit[op].slowdown, audit[op].deficit, audit[op].censored) == (1.0, 0.0, False)
        assert 0.0 <= audit[op].test_at_budget <= 100.0


# --- the held-out GD probe and the progress bar -------------------------------------------------


def test_the_held_out_probe_keeps_its_rows_out_of_the_immunization_and_signs_its_deficit(
    net, monkeypatch
):
    """A quarter of dh's 48 rows (12) is held out: the layer sees 36, the GD probe trains on 6
    and scores 6, on θ₀'s features first, then the model's; deficit = θ₀'s accuracy − the
    model's, negative when the attacker got faster."""
    seen, real = [], api.immunize_in_place
    monkeypatch.setattr(
        api,
        "immunize_in_place",
        lambda m, p, h, *a, **k: seen.append(len(h)) or real(m, p, h, *a, **k),
    )
    curves = {}

    def probe(Z_fit, y_fit, Z_score, y_score, *, epochs, num_classes):
        acc = curves.pop(0) if 0 in curves else curves.pop(1)
        assert len(Z_fit) == len(Z_score) == 6 and num_classes == 2 and epochs == 60
        return ProbeCurve([acc + t for t in range(epochs + 1)])

    monkeypatch.setattr(api, "linear_probe_curve", probe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)
        for ref, model, faster in ((20.0, 35.0, True), (40.0, 10.0, False)):
            curves.update({0: ref, 1: model})
            res = immunize_model(net, _data(48, 1), _data(48, 2), adaptive_steps=5)
            assert seen.pop() == 36 and res.probe.rows == (6, 6) and res.probe.steps == (10, 60)
            assert res.probe.reference == (ref + 10, ref + 60)
            assert res.probe.deficit == (ref - model, ref - model)
            assert res.probe.faster is faster and res.to_dict()["probe"]["faster"] is faster


def test_no_probe_without_rows_to_spare_or_with_heldout_zero(net, monkeypatch):
    seen, real = [], api.immunize_in_place
    monkeypatch.setattr(
        api,
        "immunize_in_place",
        lambda m, p, h, *a, **k: seen.append(len(h)) or real(m, p, h, *a, **k),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)
        off = immunize_model(net, _data(16, 1), _data(16, 2), heldout=0, adaptive_steps=5)
        small = immunize_model(net, _data(16, 1), _data(9, 2), adaptive_steps=5)
        real_probe = immunize_model(net, _data(16, 1), _data(16, 2), adaptive_steps=5)
    assert seen == [16, 9, 8] and off.probe is None and small.probe is None
    assert off.to_dict()["probe"] is None
    p = real_probe.probe  # the paper's GD probe itself: 4 rows to fit, 4 to score
    assert p.rows == (4, 4) and all(0 <= a <= 100 for a in p.reference + p.model)


@pytest.mark.parametrize("heldout", [1.0, -0.1, float("nan"), "a quarter"])
def test_a_bad_heldout_is_refused_naming_it_before_any_work(net, work_spy, heldout):
    with pytest.raises(ParameterError) as e:
        immunize_model(net, _data(16, 1), _data(16, 2), heldout=heldout)
    assert e.value.parameter == "heldout" and not work_spy


@pytest.mark.parametrize("progress", [True, False])
def test_progress_false_shows_no_bar(net, monkeypatch, progress):
    from pycore import adaptive

    bars = []
    monkeypatch.setattr(adaptive, "progress_bar", lambda **kw: bars.append(kw) or _NoBar())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NearChanceWarning)
        immunize_model(net, _data(16, 1), _data(16, 2), adaptive_steps=5, progress=progress)
    assert len(bars) == int(progress)


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
    """audit_model's bar: one count per operator run, θ₀'s budgets then the model's slowdowns,
    named as it starts; ``progress=False`` disables it."""
    from pycore.deep import api

    seen = []

    class Bar:
        def __init__(self, total, desc, disable=False):
            self.total, self.disable, self.n = total, disable, 0
            seen.append(self)

        def set_postfix_str(self, name):
            self.name = name

        def update(self, k=1):
            self.n += k

        def close(self):
            pass

    monkeypatch.setattr(api, "progress_bar", Bar)
    audit_model(
        net,
        reference=net,
        dh=_data(12, 1),
        max_epochs=1,
        operators=("gd", "adam"),
        progress=progress,
    )
    (bar,) = seen
    assert (bar.total, bar.n, bar.disable) == (4, 4, not progress)
