"""The attacker's cheapest path in FLOPs and what a defense is worth (pycore/deep/_cost.py,
pycore/deep/_judge.py; docs/theory.md §12): FLOP counts against their analytic values, the
judge's arithmetic on paths built by hand, and the judge run end to end on a tiny network."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pycore import ParameterError
from pycore.deep import (
    AttackCost,
    AttackData,
    CheapestPath,
    ImmunizedNet,
    ReferencePath,
    cheapest_path,
    create_model,
    reference_path,
    worth,
)
from pycore.deep._cost import (
    Cost,
    check_forward_flops,
    counted_flops,
    forward_flops,
    head_step_flops,
)
from pycore.deep._judge import CAP_FACTOR, MIN_CEILING, audit
from pycore.deep._operators import Schedule, _attacker, architecture, operator, retrain_modules

SCHEDULE = Schedule(batch_size=8, min_steps=5, probe_max_steps=200, deep_max_steps=20)


@pytest.mark.parametrize("n,d,k", [(1, 3, 2), (16, 64, 10), (7, 513, 5)])
def test_a_linear_layers_forward_flops_are_2ndk(n, d, k):
    layer = nn.Linear(d, k, bias=False)
    assert forward_flops(layer, torch.randn(n, d)) == 2 * n * d * k


@pytest.mark.parametrize("n,d,k", [(8, 64, 5), (128, 513, 10)])
def test_a_probes_step_is_counted_as_flopcountermode_counts_a_heads_training_step(n, d, k):
    """The NumPy probes' steps by the rule FlopCounterMode applies to torch: a head's forward
    and its weight gradient (the features need none)."""
    head = nn.Linear(d, k, bias=False)
    x, y = torch.randn(n, d), torch.randint(0, k, (n,))

    def step():
        nn.functional.cross_entropy(head(x), y).backward()

    assert counted_flops(step) == head_step_flops(n, d, k)


def test_a_cost_is_its_setup_and_its_steps():
    c = Cost(100.0, 7.0)
    assert c.at(None) is None and c.at(0) == 100.0 and c.at(3) == 121.0
    assert c.steps_within(99.0) == 0 and c.steps_within(120.9) == 2 and c.steps_within(121) == 3


def _net(seed=0, classes=2):
    return create_model("test_resnet", classes, seed=seed, img_size=32)


def _data(n=24, seed=0, shift=1.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    X = torch.randn(n, 3, 32, 32, generator=g) + shift * y[:, None, None, None]
    return X, y


def _attack_data(n=24):
    sets = [torch.utils.data.TensorDataset(*_data(n, s)) for s in (1, 2, 3)]
    return AttackData(*sets, 2)


def test_a_deep_operators_step_counts_its_backward_through_frozen_layers():
    """Full fine-tuning costs about three forward passes a step; LoRA, which trains adapters
    only, still pays the backward pass through every frozen layer above its lowest adapter, so
    its step costs well over a forward pass; the probe's setup is one forward pass an image."""
    theta0, data = ImmunizedNet(_net()), _attack_data()
    x = torch.utils.data.default_collate([data.train[i][0] for i in range(8)])
    fwd = forward_flops(theta0, x)
    full = operator(theta0, data, "finetune_full", schedule=SCHEDULE).cost
    lora = operator(theta0, data, "lora_r2", schedule=SCHEDULE).cost
    probe = operator(theta0, data, "adam", schedule=SCHEDULE).cost
    assert full.setup == 0 and 2.5 < full.per_step / fwd < 3.5
    assert 1.8 < lora.per_step / fwd < full.per_step / fwd
    feats = forward_flops(theta0, x) - 2 * 8 * theta0.classifier.in_features * 2  # no head
    assert probe.setup == pytest.approx(feats * len(data.train) / 8, rel=1e-6)


def test_a_tail_operator_pays_its_frozen_stages_once_and_its_tail_a_step():
    theta0, data = ImmunizedNet(_net()), _attack_data()
    full = operator(theta0, data, "finetune_full", schedule=SCHEDULE).cost
    upper = operator(theta0, data, "finetune_upper", schedule=SCHEDULE).cost
    assert upper.setup > 0 and upper.per_step < full.per_step / 2


def test_a_retrain_reinitialises_its_stages_from_the_architectures_own_initialisation():
    """No parameter of the re-initialised modules equals θ₀'s; every one equals a freshly
    created network's (timm's own initialisation, not PyTorch's per-layer defaults); the
    stages before them are θ₀'s (θ₀'s weights moved off their initialisation, as training does)."""
    theta0, data = ImmunizedNet(_net(seed=3)), _attack_data()
    with torch.no_grad():
        for p in theta0.parameters():
            p.add_(0.01 * torch.randn_like(p))
    fresh = architecture(theta0)
    m = _attacker(theta0, data, "retrain_last2", seed=5, fresh=fresh)
    names = retrain_modules(theta0.net, 2)
    new, seen = fresh(2, 5), 0
    for n in names:
        mine = dict(m.net.get_submodule(n).named_parameters())
        base = dict(theta0.net.get_submodule(n).named_parameters())
        ref = dict(new.get_submodule(n).named_parameters())
        seen += len(mine)
        for k, p in mine.items():
            assert not torch.equal(p, base[k]), f"{n}.{k} kept θ₀'s weights"
            assert torch.equal(p, ref[k])
    assert seen > 0
    for n, p in m.net.named_parameters():
        if not any(n.startswith(s + ".") for s in names):
            assert torch.equal(p, theta0.net.get_parameter(n))


def test_a_defended_model_that_costs_more_per_forward_pass_is_refused():
    small, big = nn.Linear(8, 4), nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))
    x = torch.randn(2, 8)
    with pytest.raises(ParameterError) as exc:
        check_forward_flops(big, small, x)
    assert exc.value.parameter == "model"
    assert check_forward_flops(small, small, x) == 1.0
    theta0 = ImmunizedNet(_net())
    bigger = ImmunizedNet(_net())
    w = torch.ones(300, 300)  # 5.4e7 FLOPs more a forward pass: a network made bigger
    bigger.net.layer4.register_forward_hook(lambda mod, i, o: o + 0 * (w @ w).sum())
    data = _attack_data()
    ref = reference_path(theta0, data, ("adam",), schedule=SCHEDULE)
    with pytest.raises(ParameterError) as exc:
        cheapest_path(bigger, data, ref, theta0, schedule=SCHEDULE)
    assert exc.value.parameter == "model"


def test_theta0_against_itself_is_worth_one_and_its_share_of_the_headroom_is_zero():
    theta0, data = ImmunizedNet(_net()), _attack_data()
    got = audit(theta0, theta0, data, operators=("adam", "scratch"), schedule=SCHEDULE)
    assert got.worth.worth == 1.0 and not got.worth.worth_censored
    assert got.path["adam"].flops_to_target == got.reference.path["adam"].flops_to_target
    assert got.slowdown("adam") == (1.0, False)
    if got.worth.ceiling is not None and got.worth.ceiling >= MIN_CEILING:
        assert got.worth.headroom_share == 0.0
    # the cap is twice scratch's cost, and scratch is the same run on every model
    s = got.reference.scratch
    if not s.censored:
        assert got.reference.cap == CAP_FACTOR * s.flops
    assert got.path["scratch"] is s


def _cost(name, kind, flops, *, censored=False, limit=None):
    return AttackCost(
        name,
        kind,
        80.0,
        None if censored else flops,
        flops if limit is None else limit,
        None if censored else 10,
        90.0,
        "lr 1",
        Cost(0.0, 1.0),
        "limit" if censored else "reached",
    )


def _reference(theta0_costs, scratch):
    path = CheapestPath(80.0, CAP_FACTOR * scratch.flops, tuple([*theta0_costs, scratch]))
    return ReferencePath(
        {}, 80.0, "adam", 20.0, scratch, CAP_FACTOR * scratch.flops, path, (), {}, 64, 32
    )


def test_the_worth_ceiling_and_share_follow_from_the_costs():
    """θ₀: probe 1e9, fine-tuning 1e10, retrain 3e10, scratch 1e11 (ceiling 100). A row whose
    probe is censored and whose fine-tuning costs 1e10 is worth 10, share ½; one whose cheapest
    attacker is scratch is worth the ceiling, share 1; one that helps the attacker has a negative
    share; without the probes θ₀'s cheapest is the fine-tuning."""
    scratch = _cost("scratch", "scratch", 1e11)
    ref = _reference(
        [
            _cost("adam", "probe", 1e9),
            _cost("finetune_full", "deep", 1e10),
            _cost("retrain_last1", "retrain", 3e10),
        ],
        scratch,
    )
    assert ref.ceiling == pytest.approx(100.0) and not ref.ceiling_censored
    half = CheapestPath(
        80.0,
        ref.cap,
        (
            _cost("adam", "probe", 1e10, censored=True),
            _cost("finetune_full", "deep", 1e10),
            _cost("retrain_last1", "retrain", 3e10),
            scratch,
        ),
    )
    w = worth(half, ref)
    assert w.worth == pytest.approx(10.0) and w.headroom_share == pytest.approx(0.5)
    assert w.worth_without_probes == pytest.approx(1.0) and w.cheapest_operator == "finetune_full"
    assert w.retrain_bound == pytest.approx(30.0)
    full = CheapestPath(
        80.0,
        ref.cap,
        (
            _cost("adam", "probe", 1e11, censored=True),
            _cost("finetune_full", "deep", 1e11, censored=True),
            _cost("retrain_last1", "retrain", 1e11, censored=True),
            scratch,
        ),
    )
    w = worth(full, ref)
    assert w.worth == pytest.approx(100.0) and w.headroom_share == pytest.approx(1.0)
    assert w.cheapest_operator == "scratch" and not w.worth_censored
    helped = CheapestPath(80.0, ref.cap, (_cost("adam", "probe", 1e8), scratch))
    assert worth(helped, ref).headroom_share == pytest.approx(math.log(0.1) / math.log(100))


def test_no_share_of_the_headroom_without_a_measured_ceiling_of_at_least_min_ceiling():
    low = _reference([_cost("adam", "probe", 1e9)], _cost("scratch", "scratch", 2e9))
    path = CheapestPath(80.0, low.cap, (_cost("adam", "probe", 1e9), low.scratch))
    assert low.ceiling == 2.0 and worth(path, low).headroom_share is None
    censored = _reference(
        [_cost("adam", "probe", 1e9)], _cost("scratch", "scratch", 1e12, censored=True)
    )
    w = worth(CheapestPath(80.0, censored.cap, (_cost("adam", "probe", 1e9),)), censored)
    assert censored.ceiling_censored and w.ceiling_censored and w.headroom_share is None


def test_a_censored_cheapest_path_reports_the_cap():
    """Scratch cannot reach the target in the steps it is given, and the defended model gives
    the probe nothing (its first convolution zeroed: one feature vector for every image): every
    operator is censored at the cap, and the path's cheapest is the cap itself, flagged."""
    theta0, data = ImmunizedNet(_net()), _attack_data()
    ref = reference_path(theta0, data, ("adam", "scratch"), schedule=SCHEDULE, scratch_max_steps=1)
    assert ref.scratch.censored and ref.ceiling_censored
    assert ref.cap == ref.scratch.flops_limit
    dead = ImmunizedNet(_net()).eval()
    first = next(m for m in dead.net.modules() if isinstance(m, nn.Conv2d))
    norm = next(m for m in dead.net.modules() if isinstance(m, nn.BatchNorm2d))
    with torch.no_grad():
        first.weight.zero_()  # the stem sees nothing: one feature vector for every image
        norm.bias.fill_(1.0)
    path = cheapest_path(dead, data, ref, theta0, schedule=SCHEDULE)
    best = path.cheapest()
    assert best.censored and best.flops == ref.cap
    assert worth(path, ref).worth_censored
