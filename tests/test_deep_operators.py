"""Every operator an attacker has (pycore/deep/_operators.py) and the deep default's adaptive layer
(pycore/deep/_layer.py; docs/design.md §3-4, docs/findings.md §7): LoRA adapters change what they
should and nothing else, each setting of a grid trains as it would alone, the layer's removal is
θ₀'s own probe on a layer-only defense, the retrain re-initialises what the defense changed, a
model whose logits are not finite is never scored, the worst cases are the attacker's best
operator; the adaptive default meets Definition 3.1 where the closed form's window is not empty
and says so where it is."""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pycore import DivergenceError, ParameterError
from pycore.deep import (
    AttackData,
    ImmunizedNet,
    audit_model,
    cheapest_path,
    create_model,
    immunize_model,
    reference_path,
)
from pycore.deep._operators import (
    Schedule,
    attack_copy,
    lora_targets,
    operator,
    operator_names,
    retrain_scope,
)

torch.set_num_threads(1)

# the operators' runs at test size: probes for a few dozen steps, deep operators a few
TINY = Schedule(batch_size=8, min_steps=5, probe_max_steps=40, deep_max_steps=6)


def _images(n, seed, classes=3):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g) + 0.5 * y.view(-1, 1, 1, 1), y)


class _Features(nn.Module):
    """The smallest timm-like classifier: its inputs ARE its pre-logit features (D of them), so a
    test chooses the layer's features exactly."""

    def __init__(self, dim: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(dim, classes)

    def forward_features(self, x):
        return x

    def forward_head(self, x, pre_logits: bool = False):
        return x if pre_logits else self.fc(x)

    def get_classifier(self):
        return self.fc

    def forward(self, x):
        return self.fc(x)


def _task(X, classes=3, seed=0):
    y = torch.from_numpy(np.random.default_rng(seed).integers(0, classes, len(X)))
    return torch.as_tensor(X, dtype=torch.float32), y


@pytest.fixture(scope="module")
def theta0():
    """timm's small test ResNet as θ₀, with its (identity) immunization layer."""
    return ImmunizedNet(create_model("test_resnet", 3, seed=0)).eval()


@pytest.fixture(scope="module")
def data():
    return AttackData(_images(24, 1), _images(12, 2), _images(12, 3), 3)


# --- LoRA ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora(data):
    """The attacker's copy of a network, and the same copy with rank-4 adapters as the lora_r4
    operator trains it."""
    net = create_model("test_resnet", 3, seed=0)
    base = {k: v.clone() for k, v in attack_copy(net, 3, seed=0).state_dict().items()}
    adapted = operator(net, data, "lora_r4", seed=0, schedule=TINY).make("", (1e-2,)).models[0]
    return base, adapted


def test_a_lora_adapter_trains_only_its_own_parameters(lora):
    base, adapted = lora
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    opt = torch.optim.Adam([p for p in adapted.parameters() if p.requires_grad], lr=1e-2)
    x, y = _images(16, 1).tensors
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(adapted(x), y).backward()
        opt.step()
    moved = {
        n
        for n, v in adapted.state_dict().items()
        if n in base and not torch.equal(v, base[n])  # base weights keep their names
    }
    assert moved == {"head.weight", "head.bias"}
    # ... while the adapters did move (B starts at zero)
    assert any(p.abs().sum() > 0 for n, p in adapted.named_parameters() if "lora_B" in n)


def test_rank_r_changes_each_layer_by_a_matrix_of_rank_at_most_r(lora):
    """What each adapted layer computes, minus its base layer, is the base operation with one
    weight ``ΔW`` (out × in·kernel) of rank ≤ r: checked on the layer's outputs."""
    _, adapted = lora
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    checked = 0
    for name, mod in adapted.named_modules():
        if not (hasattr(mod, "lora_A") and "default" in mod.lora_A):
            continue
        base, A, B = mod.base_layer, mod.lora_A["default"].weight, mod.lora_B["default"].weight
        s = mod.scaling["default"]
        if isinstance(base, nn.Conv2d):
            dW = s * torch.einsum("or,rihw->oihw", B[:, :, 0, 0], A)
            x = torch.randn(2, base.in_channels, 9, 9)
            delta = nn.functional.conv2d(x, dW, None, base.stride, base.padding)
        else:
            dW, x = s * B @ A, torch.randn(5, base.in_features)
            delta = x @ dW.T
        with torch.no_grad():
            torch.testing.assert_close(mod(x) - base(x), delta, rtol=1e-4, atol=1e-5)
        # float64 product of the factors: the float32 one has round-off singular values
        dW64 = torch.einsum("or,r...->o...", B.double().flatten(1), A.double())
        assert int(torch.linalg.matrix_rank(dW64.reshape(dW.shape[0], -1))) <= 4, name
        checked += 1
    assert checked >= 10


def test_bad_operators_and_ranks_are_one_line_errors_naming_them():
    for kw, param in (
        ({"operators": ("gd", "lbfgs")}, "operators"),
        ({"operators": ()}, "operators"),
        ({"lora_ranks": (0,)}, "lora_ranks"),
        ({"lora_ranks": (-3, 8)}, "lora_ranks"),
        ({"lora_ranks": (2.5,)}, "lora_ranks"),
    ):
        with pytest.raises(ParameterError) as e:
            operator_names(**{"operators": ("gd", "lora"), **kw})
        assert e.value.parameter == param and "\n" not in str(e.value)
    attacked = attack_copy(create_model("test_resnet", 3, seed=0), 3, seed=0)
    with pytest.raises(ParameterError) as e:
        lora_targets(attacked, 97)  # wider than every layer (the widest: 96)
    assert e.value.parameter == "lora_ranks" and "layer4.0.conv1" in str(e.value)
    assert lora_targets(attacked, 20)["net.conv1.0"] == 16  # a narrower layer: its own width


def test_operator_names_take_numpy_integers_and_name_what_is_not_an_integer():
    assert operator_names(("gd", "lora"), np.int64(4)) == ("gd", "lora_r4")
    assert operator_names(("lora",), [np.int32(2), 8]) == ("lora_r2", "lora_r8")
    for ranks in (None, 2.5, True, "8"):
        with pytest.raises(ParameterError) as e:
            operator_names(("lora",), ranks)
        assert e.value.parameter == "lora_ranks"


def test_lora_without_peft_is_refused_before_any_operator_runs(
    monkeypatch, work_spy, theta0, data
):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ParameterError) as e:
        reference_path(theta0, data, ("gd", "lora"), schedule=TINY)
    assert e.value.parameter == "operators" and not work_spy


class _NoLayer(_Features):
    """Pre-logits straight from the input: nothing but the (replaced) head and the layer."""

    def __init__(self):
        super().__init__(4, 3)


def test_a_model_without_a_lora_layer_is_named(monkeypatch):
    attacked = attack_copy(_NoLayer(), 3, seed=0)
    # the immunization layer itself is a linear layer: remove it from what LoRA may adapt
    monkeypatch.setattr(attacked, "layer", nn.Identity())
    with pytest.raises(ParameterError) as e:
        lora_targets(attacked, 2)
    assert e.value.parameter == "model" and "_NoLayer" in str(e.value)


# --- each operator's runs -----------------------------------------------------------------------


@pytest.mark.parametrize("op", ["finetune_upper", "finetune_full", "lora_r4"])
def test_each_setting_of_a_deep_grid_trains_as_it_would_alone(op, theta0, data):
    """The settings of one grid are separate copies on the same seeded batches: the second
    setting's evaluations and weights are bit for bit those of a grid holding only it; the two
    settings end apart, so the check can fail."""
    make = operator(theta0, data, op, seed=0, schedule=TINY).make
    both, alone = make("", (1e-3, 1e-2)), make("", (1e-2,))
    for k in (1, 2, 3):
        (_, two), (one,) = both.advance([k, k]), alone.advance([k])
        assert (two.step, two.validation) == (one.step, one.validation)
        assert both.test(1) == alone.test(0)
    a, b, c = (m.state_dict() for m in (*both.models, alone.models[0]))
    assert all(torch.equal(b[k], c[k]) for k in c)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def _names(net, mods) -> list[str]:
    names = {id(m): n for n, m in net.named_modules()}
    return [names[id(m)] for m in mods]


def _bn_modes(runs) -> tuple[dict, list, dict]:
    """One training period and its evaluations of ``runs``' first model: its BatchNorm layers,
    every BatchNorm forward's (name, training flag) in order, and their running means before."""
    m = runs.models[0]
    bns = {n: b for n, b in m.named_modules() if isinstance(b, nn.BatchNorm2d)}
    seen, before = [], {n: b.running_mean.clone() for n, b in bns.items()}
    for n, b in bns.items():
        b.register_forward_hook(lambda mod, i, o, n=n: seen.append((n, mod.training)))
    runs.advance([1])
    return bns, seen, before


def test_fine_tuning_trains_and_scores_in_eval_mode_on_the_released_statistics(theta0, data):
    """Fine-tuning the last stage: every BatchNorm forward, training or scoring, in eval mode, and
    no running statistic moves (the released model's)."""
    runs = operator(theta0, data, "finetune_upper", schedule=TINY).make("", (1e-3,))
    bns, seen, before = _bn_modes(runs)
    assert seen and not any(t for _, t in seen) and not runs.models[0].training
    assert all(torch.equal(b.running_mean, before[n]) for n, b in bns.items())
    assert any(b.weight.requires_grad for b in bns.values())  # it does train some of them


def test_a_retrain_learns_its_new_statistics_and_scores_in_eval_mode(theta0, data):
    """The retrain's re-initialised BatchNorms train on batch statistics (their running ones
    move), the frozen stages' stay in eval mode; every evaluation runs in eval mode."""
    op = operator(theta0, data, "retrain_last1", schedule=TINY)
    runs = op.make("", (1e-3,))
    bns, seen, before = _bn_modes(runs)
    trained = {n for n, b in bns.items() if b.weight.requires_grad}
    assert trained and trained != set(bns)
    k = len(bns)  # the training step's forward pass, then the evaluations
    assert all(t == (n in trained) for n, t in seen[:k])
    assert len(seen) > k and not any(t for _, t in seen[k:])
    moved = {n for n, b in bns.items() if not torch.equal(b.running_mean, before[n])}
    assert moved == trained


@pytest.fixture(scope="module")
def layer_only(theta0):
    """θ₀ with only its immunization layer changed (an ill-conditioning map)."""
    m = copy.deepcopy(theta0)
    D = m.layer.weight.shape[0]
    Q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        m.layer.weight.copy_(Q @ torch.diag(torch.logspace(-3, 0, D)) @ Q.T)
    return m


def test_remove_layer_on_a_layer_only_defense_is_theta0s_own_probe(theta0, layer_only, data):
    """The layer taken off, the attacker probes θ₀'s own pre-logits: the same cost and every
    evaluation θ₀'s; on θ₀ itself (identity layer) it is its Adam probe, number for number; the
    layer does change the Adam probe, so the check can fail."""
    ops = ("remove_layer", "adam")
    ref = reference_path(theta0, data, ops, schedule=TINY)
    strip = lambda b: {k: v for k, v in b.to_dict().items() if k != "operator"}  # noqa: E731
    assert strip(ref.budgets["remove_layer"]) == strip(ref.budgets["adam"])
    got = cheapest_path(layer_only, data, ref, theta0, schedule=TINY)
    removed, base = got["remove_layer"], ref.path["remove_layer"]
    assert removed.steps_to_target == base.steps_to_target and not removed.censored
    assert removed.reach.traces == base.reach.traces
    assert [t.validation for t in got["adam"].reach.traces] != [
        t.validation for t in removed.reach.traces
    ]


def test_retrain_scope_names_the_stages_the_defense_changed(theta0):
    """The fewest last stages (with what follows them but the head) holding every changed tensor,
    buffers included; every top-level module but the head when the stem changed; None when only
    the layer or the head changed; another structure is refused naming the reference."""

    def changed(*names, scale=1.5):
        m = copy.deepcopy(theta0)
        with torch.no_grad():
            for n in names:
                m.get_parameter(n).mul_(scale) if "running" not in n else m.get_buffer(n).add_(1)
        return retrain_scope(m, theta0)

    assert changed("layer.weight") is None and changed("net.fc.weight", "net.fc.bias") is None
    assert retrain_scope(theta0, theta0) is None
    assert changed("net.layer4.0.conv1.weight") == ("layer4", "global_pool")
    assert changed("net.layer3.0.bn1.running_mean", "layer.weight") == (
        "layer3",
        "layer4",
        "global_pool",
    )
    everything = tuple(n for n, _ in theta0.net.named_children() if n != "fc")
    assert changed("net.conv1.0.weight", "net.layer4.0.conv1.weight") == everything
    with pytest.raises(ParameterError) as e:
        retrain_scope(ImmunizedNet(create_model("test_resnet", 4, seed=0)), theta0)
    assert e.value.parameter == "reference"


def test_a_model_whose_features_or_logits_are_not_finite_is_never_scored(theta0, data):
    """Features that overflow float32: the probes refuse the model, every fine-tuning setting
    diverges at its first step (an error naming the operator, not an accuracy); non-finite
    logits at an evaluation are a divergence, not an argmax."""
    bad = copy.deepcopy(theta0)
    with torch.no_grad():
        bad.layer.weight.fill_(3e38)
    ref = reference_path(theta0, data, ("gd", "finetune_upper"), schedule=TINY)
    with pytest.raises(DivergenceError):
        cheapest_path(bad, data, ref, theta0, schedule=TINY, operators=("gd",))
    with pytest.raises(FloatingPointError, match="finetune_upper"):
        cheapest_path(bad, data, ref, theta0, schedule=TINY, operators=("finetune_upper",))


# --- the adaptive default -----------------------------------------------------------------------


def test_the_adaptive_default_meets_definition_3_1_where_the_window_is_open():
    rng = np.random.default_rng(0)
    D = 6
    X_P = rng.standard_normal((80, D)) @ np.diag([3.0, 2, 1, 1, 0.5, 0.2])
    X_H = rng.standard_normal((80, D)) @ np.diag([0.2, 0.5, 1, 1, 2, 3.0]) + 0.1
    model = _Features(D, 3)
    out = immunize_model(model, _task(X_P), _task(X_H, seed=1), seed=0)
    assert out.window is not None and not out.window.empty
    assert out.immunized and out.harmful_ratio > 1 > out.pretrain_ratio
    assert "holds" in out.reason and out.to_dict()["method"] == "ours"
    # the D_P head is solved exactly: θ₀'s predictions on D_P
    x = _task(X_P)[0]
    torch.testing.assert_close(out.model(x), model(x), rtol=1e-3, atol=1e-3)


def test_the_adaptive_default_says_when_no_layer_can_meet_definition_3_1():
    """D_P's features already have κ = 1 (orthogonal rows): (ii) < 1 is out of every θ's reach,
    the closed form's window is empty, and the result says so instead of naming the step it
    stopped at."""
    rng = np.random.default_rng(1)
    D = 5
    X_P = np.vstack([np.eye(D)] * 8) * 2.0
    X_H = rng.standard_normal((60, D)) @ np.diag([5.0, 2, 1, 0.5, 0.1])
    out = immunize_model(_Features(D, 3), _task(X_P), _task(X_H, seed=1), seed=0)
    assert out.window is not None and out.window.empty and not out.immunized
    assert "empty" in out.reason and "no θ of this layer" in out.reason


def test_features_with_a_round_off_direction_report_no_window():
    """Float32 features whose rows sum to zero (a LayerNorm without bias): the smallest
    direction is float32 round-off, so κ is round-off's and no Definition 3.1 window is claimed,
    by the library call and by the layer; the same features in float64, and well-resolved
    float32 ones, keep their window (so the check can fail)."""
    from pycore.deep._layer import adaptive_layer, attainability, resolution

    rng = np.random.default_rng(3)
    D = 24
    scales = np.linspace(1.0, 3.0, D)

    def centred(n, dtype):
        X = (rng.standard_normal((n, D)) * scales).astype(dtype)
        return X - X.mean(axis=1, keepdims=True)  # each row sums to zero, up to round-off

    X_P, X_H = centred(200, np.float32), centred(200, np.float32) @ np.diag(scales[::-1])
    X_H = X_H.astype(np.float32)
    floor = resolution(torch.float32, X_P, X_H)
    stable = max(np.linalg.norm(X) / np.linalg.norm(X.astype(float), 2) for X in (X_P, X_H))
    assert floor == pytest.approx(np.finfo(np.float32).eps * stable, rel=1e-6)
    assert attainability(X_P, X_H)[1] is not None  # float64's rule sees a full-rank pair
    assert attainability(X_P, X_H, precision=torch.float32)[1] is None
    sol = adaptive_layer(X_P, X_H, steps=3, patience=3, precision=torch.float32)
    assert sol.window is None and not sol.reason.endswith("the miss is the method's")
    out = immunize_model(_Features(D, 3), _task(X_P), _task(X_H, seed=1), seed=0)
    assert out.window is None
    # resolved features: float32 rows that do not sum to zero
    Y_P = (rng.standard_normal((200, D)) * scales).astype(np.float32)
    Y_H = (rng.standard_normal((200, D)) * scales[::-1]).astype(np.float32)
    assert attainability(Y_P, Y_H, precision=torch.float32)[1] is not None


def test_audit_model_returns_every_operator_and_what_the_defense_is_worth():
    """A layer-only defense (the closed form) against θ₀: every operator asked for, the layer's
    removal costing exactly θ₀'s Adam probe, the worth the cheapest operator's cost over θ₀'s,
    scratch the same run on both."""
    net = create_model("test_resnet", 3, seed=0)
    out = immunize_model(net, _images(48, 1), _images(48, 2), method="closed_form")
    ops = ("gd", "remove_layer", "adam", "lora", "finetune_upper", "scratch")
    a = audit_model(
        out.model,
        reference=net,
        dh=_images(30, 4),
        operators=ops,
        lora_ranks=(2,),
        max_steps=6,
        scratch_max_steps=6,
        progress=False,
    )
    names = a.path.names()
    assert names == ["gd", "remove_layer", "adam", "lora_r2", "finetune_upper", "scratch"]
    removed, base = a["remove_layer"], a.reference.path["adam"]
    if not base.censored:
        assert removed.steps_to_target == base.steps_to_target
    best = a.path.cheapest()
    assert a.worth.cheapest_operator == best.operator
    assert a.worth.worth == pytest.approx(best.flops / a.reference.cheapest.flops)
    assert a["scratch"] is a.reference.scratch
    assert set(a.to_dict()["path"]["operators"]) == set(names)
