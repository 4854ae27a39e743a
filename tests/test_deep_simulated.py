"""The simulated-attacker immunizer (pycore/deep/_simulated.py; docs/theory.md §12, docs/design.md
§4) and its dispatch by ``immunize_in_place``: what it moves, the D_P guard, its options, the
suppression losses."""

from __future__ import annotations

import copy
import math
import types
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from pycore import ParameterError
from pycore.deep import SOPHON, DeepOptions, ImmunizedNet, SimulatedOptions, create_model
from pycore.deep._simulated import suppression_loss
from pycore.deep._train import immunize_in_place

torch.set_num_threads(1)

QUICK = dict(steps=4, inner_steps=2, batch_size=8, check_every=1)


def _images(n, seed, classes=3):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = torch.randn(n, 3, 32, 32, generator=g) + 0.5 * y.view(-1, 1, 1, 1).float()
    return TensorDataset(x, y)


@pytest.fixture(scope="module")
def tasks():
    return _images(32, 1), _images(32, 2)


@pytest.fixture(scope="module")
def theta0(tasks):
    """timm's test ResNet whose head has learned D_P (top-1 100 % on its 32 images)."""
    m = ImmunizedNet(create_model("test_resnet", 3, seed=0)).eval()
    x, y = tasks[0].tensors
    with torch.no_grad():
        f = m.prelogits(x)
    opt = torch.optim.Adam(m.classifier.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        F.cross_entropy(m.classifier(f), y).backward()
        opt.step()
    m.requires_grad_(False)
    assert _top1(m, tasks[0]) == 100.0
    return m


def immunize_simulated(model, p_train, h_train, opts, *, seed, num_classes_h):
    """``immunize_in_place`` of the ``simulated`` method, as what it did: the suppression steps
    taken, the one kept (the D_P guard's last checked state), why it stopped, the history."""
    res = immunize_in_place(
        model, p_train, h_train, "simulated", opts, seed=seed, num_classes_h=num_classes_h
    )
    steps = len(res.history["suppression"])
    return {"steps": steps, "kept": res.steps, "reason": res.stopped, "history": res.history}


def _top1(model, data) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return 100.0 * float((model(x).argmax(1) == y).double().mean())


def _moved(model, before) -> set:
    """The top-level parts (``net.layer4``, ``layer.weight``) whose tensors changed."""
    now = model.state_dict()
    return {".".join(k.split(".")[:2]) for k, v in before.items() if not torch.equal(v, now[k])}


@pytest.mark.parametrize("operators", [("finetune",), ("lora",), ("probe",)])
def test_the_tail_scope_moves_only_the_last_stages_the_layer_and_the_head(
    theta0, tasks, operators
):
    """Scope ``tail`` (the last stage): the defended parameters and the head (D_P's steps) move,
    the stem and the earlier stages keep θ₀'s tensors bit for bit, and the network is given back
    whole (its earlier stages in place)."""
    model = copy.deepcopy(theta0)
    before = copy.deepcopy(model.state_dict())
    opts = SimulatedOptions(operators=operators, dp_tolerance=None, **QUICK)
    out = immunize_simulated(model, *tasks, opts, seed=0, num_classes_h=3)
    assert out["steps"] == out["kept"] == 4 and not out["reason"]
    assert _moved(model, before) == {"net.layer4", "layer.weight", "net.fc"}
    assert type(model.net) is type(theta0.net) and not model.training
    assert dict(model.named_modules()).keys() == dict(theta0.named_modules()).keys()
    assert out["history"]["operator"] == list(operators) * 4


def test_the_backbone_scope_moves_the_stem_too(theta0, tasks):
    model = copy.deepcopy(theta0)
    before = copy.deepcopy(model.state_dict())
    opts = SimulatedOptions(scope="backbone", dp_tolerance=None, **QUICK)
    immunize_simulated(model, *tasks, opts, seed=0, num_classes_h=3)
    assert {"net.conv1", "net.layer1", "net.layer4", "layer.weight"} <= _moved(model, before)


def test_d_p_top1_is_kept_within_its_tolerance_on_the_check_set(theta0, tasks):
    """Suppression steps far too large take D_P to chance without the guard; with it the model
    ends on the last checked state within ``dp_tolerance`` points of θ₀'s D_P top-1 (here θ₀
    itself, step 0: every tensor as it was)."""
    harsh = dict(lr=0.3, dp_lr=1e-5, **QUICK)
    free = copy.deepcopy(theta0)
    immunize_simulated(
        free, *tasks, SimulatedOptions(dp_tolerance=None, **harsh), seed=0, num_classes_h=3
    )
    assert _top1(free, tasks[0]) < 100.0 - 30
    guarded = copy.deepcopy(theta0)
    out = immunize_simulated(
        guarded, *tasks, SimulatedOptions(dp_tolerance=1.0, **harsh), seed=0, num_classes_h=3
    )
    assert _top1(guarded, tasks[0]) >= 100.0 - 1.0 and out["kept"] < out["steps"]
    assert out["reason"] and all(not math.isnan(a) for a in out["history"]["dp_top1"])
    if out["kept"] == 0:
        ref = theta0.state_dict()
        assert all(torch.equal(v, ref[k]) for k, v in guarded.state_dict().items())


def test_a_seed_gives_the_same_model_again(theta0, tasks):
    runs = []
    for _ in range(2):
        m = copy.deepcopy(theta0)
        immunize_simulated(
            m, *tasks, SimulatedOptions(dp_tolerance=None, **QUICK), seed=3, num_classes_h=3
        )
        runs.append(m.state_dict())
    assert all(torch.equal(v, runs[1][k]) for k, v in runs[0].items())


@pytest.mark.parametrize(
    "kw,parameter",
    [
        ({"steps": 0}, "steps"),
        ({"inner_steps": 1.5}, "inner_steps"),
        ({"operators": ("finetune", "retrain")}, "operators"),
        ({"operators": ()}, "operators"),
        ({"operators": "finetune"}, "operators"),
        ({"suppression": "entropy"}, "suppression"),
        ({"inner_optimizer": "lbfgs"}, "inner_optimizer"),
        ({"lr": 0.0}, "lr"),
        ({"clip": -1.0}, "clip"),
        ({"scope": "layer"}, "scope"),
        ({"batch_size": 1}, "batch_size"),
        ({"dp_tolerance": -1.0}, "dp_tolerance"),
    ],
)
def test_options_errors_name_the_option(kw, parameter):
    with pytest.raises(ParameterError) as e:
        SimulatedOptions(**kw)
    assert e.value.parameter == parameter


def test_more_stages_than_the_network_has_are_named(theta0, tasks):
    with pytest.raises(ParameterError) as e:
        immunize_simulated(
            copy.deepcopy(theta0),
            *tasks,
            SimulatedOptions(stages=9, **QUICK),
            seed=0,
            num_classes_h=3,
        )
    assert e.value.parameter == "stages"


def test_suppression_losses_on_known_logits():
    """``kl_uniform``: KL(u ‖ softmax) — 0 on uniform logits, log(C) − log(C) + … on a known
    one; ``inverse_ce``: −log(1 − p_y) — about 0 when the prediction is surely wrong, large
    when it is surely right."""
    y = torch.tensor([0, 1])
    uniform = torch.zeros(2, 4)
    assert float(suppression_loss(uniform, y, "kl_uniform")) == pytest.approx(0.0, abs=1e-15)
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    logp = torch.log_softmax(logits.double(), 1)
    want = float((-math.log(4) - logp.mean(1)).mean())
    assert float(suppression_loss(logits, y, "kl_uniform")) == pytest.approx(want, rel=1e-12)
    assert want > 0
    wrong = torch.tensor([[0.0, 50.0, 0.0], [50.0, 0.0, 0.0]])  # class 1, then 0: never y
    assert float(suppression_loss(wrong, y, "inverse_ce")) == pytest.approx(0.0, abs=1e-15)
    right = torch.tensor([[50.0, 0.0, 0.0], [0.0, 50.0, 0.0]])
    assert float(suppression_loss(right, y, "inverse_ce")) > 20
    p_y = torch.softmax(logits.double(), 1)[[0, 1], [0, 1]]
    assert float(suppression_loss(logits, y, "inverse_ce")) == pytest.approx(
        float(-torch.log1p(-p_y).mean()), rel=1e-12
    )
    assert suppression_loss(logits, y, "kl_uniform").dtype == torch.float64
    with pytest.raises(ParameterError) as e:
        suppression_loss(logits, y, "entropy")
    assert e.value.parameter == "suppression"


def test_immunize_in_place_dispatches_the_simulated_methods_by_their_options(theta0, tasks):
    """``simulated`` and ``sophon`` train with :class:`SimulatedOptions` on images; any other
    option set, or cached features, is refused naming what is wrong."""
    model = copy.deepcopy(theta0)
    res = immunize_in_place(
        model,
        *tasks,
        "sophon",
        SimulatedOptions(**{**SOPHON.to_dict(), **QUICK}),
        seed=0,
        num_classes_h=3,
    )
    assert res.method == "sophon" and len(res.history["suppression"]) == 4
    assert res.steps <= 4 and _top1(model, tasks[0]) >= 100.0 - SOPHON.dp_tolerance
    for method, opts, cached, parameter in (
        ("simulated", DeepOptions(), False, "opts"),
        ("ours", SimulatedOptions(), False, "opts"),
        ("simulated", SimulatedOptions(), True, "scope"),
    ):
        with pytest.raises(ParameterError) as e:
            immunize_in_place(
                copy.deepcopy(theta0), *tasks, method, opts, num_classes_h=3, cached=cached
            )
        assert e.value.parameter == parameter


class _LinearFeatures(torch.nn.Module):
    """The smallest extractor: features ``z = x Wᵀ`` (the attacker's head reads them)."""

    def __init__(self, W):
        super().__init__()
        self.w = torch.nn.Parameter(W.clone())
        self.model = types.SimpleNamespace(layer=types.SimpleNamespace(weight=W))

    def forward(self, x):
        return x @ self.w.T


def test_sophons_inner_loop_is_a_hand_computed_first_order_step():
    """SOPHON's simulated fine-tuning (SGD at 1e-4 in the published settings; lr 0.5 here so the
    step shows), one inner step on a 3-feature extractor: the attacker takes one SGD step of the
    cross-entropy on the batch's first half (its weights W and its new head A, b), and the
    defender's gradient is that of the inverse cross-entropy −log(1 − p_y) at the attacker's new
    W', on the other half, the head held at A', b' (first order): computed here by hand from the
    softmax's derivatives, in float64 (the loop runs in float32: agreement to its round-off)."""
    from pycore.deep._simulated import _new_head, _trajectory

    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 4, generator=g)
    x = torch.randn(8, 4, generator=g)
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    feats = _LinearFeatures(W)
    scope = {"w": feats.w}
    opts = replace(SOPHON, inner_steps=1, inner_lr=0.5)
    lr = 0.5
    sup = _trajectory(
        feats,
        scope,
        TensorDataset(x, y),
        iter([torch.arange(8)]),
        "finetune",
        lr,
        opts,
        3,
        torch.Generator().manual_seed(7),
        "cpu",
    )
    A, b = (t.detach().double() for t in _new_head(3, 3, torch.Generator().manual_seed(7), "cpu"))

    def softmax(logits):
        e = np.exp(logits - logits.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    Wn, An, bn, xn = (t.double().numpy() for t in (W, A, b, x))
    yn = y.numpy()
    xa, ya, xe, ye = xn[:4], yn[:4], xn[4:], yn[4:]
    # the attacker's step: d CE / d logits = (p − Y)/n
    za = xa @ Wn.T
    d = (softmax(za @ An.T + bn) - np.eye(3)[ya]) / len(ya)
    W1 = Wn - lr * (d @ An).T @ xa
    A1, b1 = An - lr * d.T @ za, bn - lr * d.sum(0)
    # the defender's gradient: d/dlogit_j of −log(1 − p_y) = p_y (δ_jy − p_j) / (1 − p_y)
    ze = xe @ W1.T
    p = softmax(ze @ A1.T + b1)
    py = p[np.arange(len(ye)), ye]
    ds = py[:, None] * (np.eye(3)[ye] - p) / (1 - py)[:, None] / len(ye)
    want = (ds @ A1).T @ xe
    assert sup == pytest.approx(float(np.mean(-np.log1p(-py))), rel=1e-5)
    np.testing.assert_allclose(feats.w.grad.numpy(), want, rtol=1e-4, atol=1e-7)
    assert np.abs(want).max() > 1e-3  # a gradient that can be wrong
