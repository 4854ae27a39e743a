"""Every operator an attacker has (pycore/deep/operators.py) and the deep default's adaptive layer
(pycore/deep/layer.py; docs/design.md §3-4, docs/findings.md §7): LoRA adapters change what they
should and nothing else, the worst case is the attacker's best operator, the adaptive default
meets Definition 3.1 where the closed form's window is not empty and says so where it is."""

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pycore.deep import audit_model, create_model, immunize_model
from pycore.deep.operators import (
    AttackData,
    OperatorCurve,
    _with_lora,
    attack_copy,
    compare,
    lora_targets,
    operator_names,
    run_operators,
)
from pycore.validation import ParameterError

torch.set_num_threads(1)


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


# --- LoRA ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora():
    net = create_model("test_resnet", 3, seed=0)
    attacked = attack_copy(net, 3, seed=0)
    base = {k: v.clone() for k, v in attacked.state_dict().items()}
    adapted = _with_lora(copy.deepcopy(attacked), 4, seed=0)
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


def test_counts_take_numpy_integers_and_name_what_is_not_an_integer():
    assert operator_names(("gd", "lora"), np.int64(4)) == ("gd", "lora_r4")
    assert operator_names(("lora",), [np.int32(2), 8]) == ("lora_r2", "lora_r8")
    for ranks in (None, 2.5, True, "8"):
        with pytest.raises(ParameterError) as e:
            operator_names(("lora",), ranks)
        assert e.value.parameter == "lora_ranks"
    net, data = (
        create_model("test_resnet", 3, seed=0),
        AttackData(*map(_images, (8, 6, 6), (1, 2, 3)), 3),
    )
    for epochs in (1.5, None, (1, None)):
        with pytest.raises(ParameterError) as e:
            run_operators(net, data, ("gd",), epochs=epochs)
        assert e.value.parameter == "epochs"
    curve = run_operators(net, data, ("gd",), epochs=np.int64(2))["gd"]
    assert curve.epochs == (0, 2)


def test_lora_without_peft_is_refused_before_any_operator_runs(monkeypatch):
    import sys

    from pycore.deep import operators

    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    ran = []
    monkeypatch.setattr(operators, "_probe_runs", lambda *a, **k: ran.append(1))
    data = AttackData(*map(_images, (8, 6, 6), (1, 2, 3)), 3)
    with pytest.raises(ParameterError) as e:
        run_operators(create_model("test_resnet", 3, seed=0), data, ("gd", "lora"), epochs=1)
    assert e.value.parameter == "operators" and not ran


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


# --- summaries ----------------------------------------------------------------------------------


def _curve(op, accs):
    return OperatorCurve(op, "s", (0, 1, 2), tuple(accs), 50.0, (("s", 50.0),))


def test_the_worst_case_is_the_operator_of_highest_accuracy_and_deficits_are_signed():
    model = {
        "gd": _curve("gd", (20, 30, 40)),  # slowed: +20, +30 points against θ₀
        "adam": _curve("adam", (20, 80, 90)),  # the attacker's best against the model
        "finetune_full": _curve("finetune_full", (20, 70, 75)),  # helped: −10, −5
    }
    ref = {
        "gd": _curve("gd", (20, 50, 70)),
        "adam": _curve("adam", (20, 85, 95)),
        "finetune_full": _curve("finetune_full", (20, 60, 70)),
    }
    a = compare(model, ref)
    assert a.worst == "adam" and a.worst_deficit == pytest.approx(5.0)
    ft = a["finetune_full"]
    assert ft.deficit == (-10.0, -5.0) and ft.mean_deficit == pytest.approx(-7.5)
    assert ft.signed_rfd == pytest.approx(np.mean([-10 / 60, -5 / 70]))
    assert ft.rfd == pytest.approx(np.mean([10 / 60, 5 / 70]))  # |·| counts help as protection
    assert a["gd"].best_so_far_model == (30.0, 40.0) and a.epochs == (1, 2)
    assert a.to_dict()["operators"]["gd"]["deficit"] == (20.0, 30.0)
    with pytest.raises(ParameterError):
        compare(model, {"gd": ref["gd"]})


def test_operators_pick_their_setting_on_the_validation_split():
    net = create_model("test_resnet", 3, seed=0)
    data = AttackData(_images(24, 1), _images(12, 2), _images(12, 3), 3)
    out = run_operators(net, data, ("gd", "adam", "finetune_upper"), epochs=(1, 2), seed=0)
    assert list(out) == ["gd", "adam", "finetune_upper"]
    for c in out.values():
        assert c.validation_accuracy == max(v for _, v in c.grid)
        assert c.setting == next(k for k, v in c.grid if v == c.validation_accuracy)
        assert all(0 <= a <= 100 for a in c.test_accuracy)
    assert out["gd"].epochs == (0, 1, 2) and out["finetune_upper"].epochs == (1, 2)


@pytest.mark.parametrize("op", ["finetune_full", "finetune_upper", "lora_r4"])
def test_a_setting_trains_as_it_would_alone_in_its_grid(op):
    """The grid's settings share their first step's gradient: each setting's parameters after
    every scored epoch, and its validation accuracy, are bit for bit those of a grid holding only
    that setting; the two settings end apart, so the check can fail."""
    from pycore.deep.data import ShardedBatches
    from pycore.deep.operators import _attacker, _deep_grid

    net = create_model("test_resnet", 3, seed=0)
    data = AttackData(_images(24, 1), _images(12, 2), _images(12, 3), 3)
    both = _deep_grid(net, data, op, (1e-3, 1e-2), epochs=(1, 2), seed=0, batch_size=8)
    last = [snaps[-1] for _, snaps, _ in both.values()]
    assert any(not torch.equal(last[0][n], last[1][n]) for n in last[0])
    x, y = data.train.tensors
    for lr, (_, snaps, _) in both.items():
        # the plain loop: a fresh copy, Adam at lr, three batches an epoch, two epochs
        m = _attacker(net, data, op, seed=0)
        params = {n: p for n, p in m.named_parameters() if p.requires_grad}
        opt, alone = torch.optim.Adam(params.values(), lr=lr), []
        for e in range(2):
            for (idx,) in ShardedBatches(24, 8, seed=0).epoch(e):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(m(x[idx]), y[idx]).backward()
                opt.step()
            alone.append({n: p.detach().clone() for n, p in params.items()})
        for a, b in zip(alone, snaps, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


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
    from pycore.deep.layer import adaptive_layer, attainability, resolution

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


def test_audit_model_returns_every_operator_and_the_worst_case():
    net = create_model("test_resnet", 3, seed=0)
    out = immunize_model(net, _images(48, 1), _images(48, 2), method="closed_form")
    a = audit_model(out.model, reference=net, dh=_images(60, 4), epochs=(1,), lora_ranks=(2, 4))
    names = [c.operator for c in a.operators]
    assert names == [
        "gd",
        "adam",
        "adam_whitened",
        "lora_r2",
        "lora_r4",
        "finetune_upper",
        "finetune_full",
    ]
    assert a.worst == max(a.operators, key=lambda c: np.mean(c.model)).operator
    assert set(a.to_dict()["operators"]) == set(names)
