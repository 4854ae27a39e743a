"""Deep-net immunization (pycore.deep, experiments/deepnet.py): docs/theory.md §8-9, issue 5.

Everything runs offline (HF_HUB_OFFLINE=1) on CPU at 32 px in a few seconds per test, except the
torchrun end-to-end comparison, which is marked slow.
"""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub (via timm)

import copy  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pycore.deep as deep  # noqa: E402  (installs the torchvision shim before timm)
from pycore.report import to_json  # noqa: E402
from pycore.deep import (  # noqa: E402
    CheckpointError, CheckpointMismatchError, DeepImmunizeConfig, NonFiniteLossError,
    PretrainedUnavailableError, adam_probe_curve, best_adam_probe, build_model, cache_trunk,
    finetune_attack, freeze_reference, immunize, linear_probe_curve, load_immunized, rir_theta0,
    save_immunized,
)
from pycore.deep.data import (  # noqa: E402
    DataError, PairedBatches, ShardedBatches, fetch, image_folder, mnist_demo_tasks,
    model_normalization, timm_transform,
)
from pycore.deep.objectives import imma_harmful_loss, log_kappa, loss_terms  # noqa: E402
from pycore.deep.train import balanced_lambdas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def _images(n, seed, size=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 3, (n,), generator=g)


def _tds(n, seed):
    return torch.utils.data.TensorDataset(*_images(n, seed))


# --- timm / models ----------------------------------------------------------------------------

def test_timm_imports_after_shim():
    timm = deep.import_timm()
    assert hasattr(timm, "create_model")
    # whichever way it was satisfied, torchvision::nms must now be a known operator
    assert torch.ops.torchvision.nms is not None


@pytest.mark.parametrize("backbone", ["resnet18_32px", "vit_tiny_32px"])
def test_split_model_reproduces_timm_forward(backbone):
    m = build_model(backbone, 3, seed=0).eval()
    with torch.no_grad():
        m.layer.weight.add_(0.01 * torch.randn_like(m.layer.weight))   # non-identity layer
        x, _ = _images(4, 1)
        pieces = m.classifier(m.layer(m.pooled(m.trunk(x))))
        full = m(x)
        feats = m.net.forward_head(m.net.forward_features(x), pre_logits=True)
    torch.testing.assert_close(pieces, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.features(x), feats, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backbone,expected", [
    ("resnet18_32px", {"layer3", "layer4", "global_pool", "fc"}),
    ("vit_tiny_32px", {"blocks.3", "norm", "fc_norm", "head"}),
])
def test_only_the_immunized_tail_is_trainable(backbone, expected):
    m = build_model(backbone, 3, seed=0)
    ext, cls = m.set_trainable()
    names = {n for n, p in m.net.named_parameters() if p.requires_grad}
    prefixes = {".".join(n.split(".")[:2]) if n.startswith("blocks.") else n.split(".")[0] for n in names}
    assert prefixes == expected
    assert {id(p) for p in ext}.isdisjoint({id(p) for p in cls})
    assert len(ext) + len(cls) == len(names)
    assert m.trunk_is_frozen()


def test_export_roundtrip_gives_a_ready_timm_model(tmp_path):
    m = build_model("resnet18_32px", 3, seed=0).eval()
    with torch.no_grad():
        m.layer.weight.copy_(torch.eye(512) + 0.05 * torch.randn(512, 512))
    path = save_immunized(m, tmp_path / "ext.safetensors", num_classes=3)
    net = load_immunized(path)
    x, _ = _images(3, 2)
    with torch.no_grad():
        torch.testing.assert_close(net(x), m(x), rtol=1e-5, atol=1e-5)
        z = net.forward_head(net.forward_features(x), pre_logits=True)
        torch.testing.assert_close(z, m.features(x), rtol=1e-5, atol=1e-5)
    assert type(net).__module__.startswith("timm.")


def test_checkpoint_errors_are_one_line(tmp_path):
    m = build_model("resnet18_32px", 3, seed=0)
    with pytest.raises(CheckpointError, match="not found"):
        build_model("resnet18_32px", 3, checkpoint=tmp_path / "nope.safetensors")
    # a good safetensors θ₀ checkpoint loads and reproduces the weights
    from safetensors.torch import save_file
    sd = {k: v.contiguous() for k, v in m.net.state_dict().items() if not k.startswith("global_pool.1")}
    save_file(sd, str(tmp_path / "theta0.safetensors"))
    m2 = build_model("resnet18_32px", 3, checkpoint=tmp_path / "theta0.safetensors", seed=123)
    torch.testing.assert_close(m2.net.conv1.weight, m.net.conv1.weight)
    # wrong architecture / wrong class count
    with pytest.raises(CheckpointMismatchError, match="does not match"):
        build_model("vit_tiny_32px", 3, checkpoint=tmp_path / "theta0.safetensors")
    with pytest.raises(CheckpointMismatchError, match="shape mismatch"):
        build_model("resnet18_32px", 7, checkpoint=tmp_path / "theta0.safetensors")
    # a raw pickle of an arbitrary object is refused, not unpickled
    torch.save({"model": m.net}, tmp_path / "raw.pt")
    with pytest.raises(CheckpointError, match="weights-only"):
        build_model("resnet18_32px", 3, checkpoint=tmp_path / "raw.pt")
    # a weights-only torch state_dict (DDP prefix) loads
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}}, tmp_path / "sd.pt")
    m3 = build_model("resnet18_32px", 3, checkpoint=tmp_path / "sd.pt")
    torch.testing.assert_close(m3.net.fc.weight, m.net.fc.weight)


def test_pretrained_offline_says_what_to_do():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    t = time.perf_counter()
    with pytest.raises(PretrainedUnavailableError, match="--checkpoint"):
        build_model("resnet18", 10, pretrained=True)
    assert time.perf_counter() - t < 30


# --- data -------------------------------------------------------------------------------------

def test_image_folder_errors_and_loading(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        image_folder(tmp_path / "missing", "train", None)
    (tmp_path / "root").mkdir()
    with pytest.raises(DataError, match="no 'train' split"):
        image_folder(tmp_path / "root", "train", None)
    (tmp_path / "root" / "train").mkdir()
    with pytest.raises(DataError, match="no class sub-directories"):
        image_folder(tmp_path / "root", "train", None)
    (tmp_path / "root" / "train" / "a").mkdir()
    (tmp_path / "root" / "train" / "b").mkdir()
    with pytest.raises(DataError, match="no images"):
        image_folder(tmp_path / "root", "train", None)
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in "ab":
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(
                tmp_path / "root" / "train" / c / f"{i}.png")
    m = build_model("vit_tiny_32px", 2, seed=0)
    ds = image_folder(tmp_path / "root", "train", timm_transform(m))
    x, y = fetch(ds, torch.arange(4))
    assert x.shape == (4, 3, 32, 32) and sorted(y.tolist()) == [0, 0, 1, 1]


def test_mnist_demo_tasks_are_real_disjoint_digits():
    m = build_model("resnet18_32px", 5, seed=0)
    mean, std = model_normalization(m)
    t = mnist_demo_tasks(np.random.default_rng(0), per_digit=20, mean=mean, std=std)
    assert t.p_train.tensors[0].shape[1:] == (3, 32, 32)
    assert len(t.p_train) + len(t.p_val) == 100 and len(t.h_train) + len(t.h_test) == 100
    assert set(t.p_train.tensors[1].tolist()) == set(range(5))
    # zero background maps to (0 - mean)/std, i.e. real normalised digits, not noise
    corner = t.p_train.tensors[0][:, 0, 0, 0]
    torch.testing.assert_close(corner, torch.full_like(corner, (0 - mean[0]) / std[0]))
    with pytest.raises(DataError, match="overlap"):
        mnist_demo_tasks(np.random.default_rng(0), p_digits=(1, 2), h_digits=(2, 3), model=m)


def test_mnist_demo_tasks_use_the_models_own_normalisation():
    """No silent default: a ResNet18 scored on images normalised with (0.5, 0.5, 0.5) lost most of
    its D_P accuracy without any error."""
    m = build_model("resnet18_32px", 5, seed=0)
    mean, std = model_normalization(m)
    assert mean != (0.5, 0.5, 0.5)                                   # ImageNet statistics for ResNet18
    a = mnist_demo_tasks(np.random.default_rng(0), per_digit=10, model=m)
    b = mnist_demo_tasks(np.random.default_rng(0), per_digit=10, mean=mean, std=std)
    assert torch.equal(a.p_train.tensors[0], b.p_train.tensors[0])
    with pytest.raises(DataError, match="normalisation"):
        mnist_demo_tasks(np.random.default_rng(0), per_digit=10)
    with pytest.raises(DataError, match="disagree"):
        mnist_demo_tasks(np.random.default_rng(0), per_digit=10, model=m, mean=(0.5,) * 3, std=(0.5,) * 3)


def test_paired_batches_cycle_the_shorter_task_and_shard():
    p, h = ShardedBatches(40, 4, seed=0, world=1), ShardedBatches(12, 4, seed=1, world=1)
    pb = PairedBatches(p, h)
    steps = list(pb.epoch(0))
    assert len(steps) == len(pb) == 10
    h_idx = [s[1][0] for s in steps]
    first_cycle = torch.cat(h_idx[:3])
    assert sorted(first_cycle.tolist()) == list(range(12))           # one full pass
    assert sorted(torch.cat(h_idx[3:6]).tolist()) == list(range(12))  # then a fresh pass
    assert not torch.equal(first_cycle, torch.cat(h_idx[3:6]))         # re-shuffled
    # shards: rank r of a 2-rank run gets the r-th slice of the same global batch
    two = ShardedBatches(40, 4, seed=0, world=2)
    one = ShardedBatches(40, 8, seed=0, world=1)
    for a, b in zip(two.epoch(3), one.epoch(3)):
        assert torch.equal(torch.cat(a), b[0])
    with pytest.raises(DataError, match="fewer than one global batch"):
        ShardedBatches(5, 4, seed=0, world=2)


# --- losses -----------------------------------------------------------------------------------

def test_loss_terms_use_the_op_and_precondition_only_the_regularizers():
    ops = deep._ops.ops() if hasattr(deep, "_ops") else __import__("pycore.ops").ops
    m = build_model("resnet18_32px", 3, seed=0, lambda_reg=1e-3)
    m.set_trainable()
    m.eval()
    (xP, yP), (xH, yH) = _images(8, 0), _images(8, 1)
    hP, hH = m.trunk(xP).detach(), m.trunk(xH).detach()
    t = loss_terms(m, "ours", hP, yP, hH, yH, 3)
    ZP = m.layer(m.pooled(hP)).double()
    ZH = m.layer(m.pooled(hH)).double()
    torch.testing.assert_close(t["r_well"], ops.reference_cond_regularizer(ZP, "well"), rtol=1e-8, atol=0)
    torch.testing.assert_close(t["r_ill"], ops.reference_cond_regularizer(ZH, "ill"), rtol=1e-8, atol=0)
    # CE path: the layer's weight gradient is the plain one (no (XᵀX+λI)⁻¹)
    m.zero_grad()
    t["ce"].backward(retain_graph=True)
    X = m.pooled(hP).detach()
    W = m.layer.weight.detach().clone().requires_grad_(True)
    ce = F.cross_entropy(m.classifier(X @ W.T), yP, label_smoothing=0.1)
    (gW,) = torch.autograd.grad(ce, W)
    torch.testing.assert_close(m.layer.weight.grad, gW, rtol=1e-4, atol=1e-7)
    # R_ill path: right-preconditioned grad_W (XᵀX + λI)⁻¹
    m.zero_grad()
    t["r_ill"].backward()
    XH = m.pooled(hH).detach().double()
    W = m.layer.weight.detach().double().clone().requires_grad_(True)
    (g_plain,) = torch.autograd.grad(ops.reference_cond_regularizer(XH @ W.T, "ill"), W)
    expected = g_plain @ torch.linalg.inv(XH.T @ XH + 1e-3 * torch.eye(XH.shape[1], dtype=torch.float64))
    torch.testing.assert_close(m.layer.weight.grad.double(), expected, rtol=2e-3,
                               atol=1e-3 * expected.abs().max().item())


def test_log_kappa_matches_the_spectrum_and_is_differentiable():
    g = torch.Generator().manual_seed(0)
    for n, d in ((6, 10), (12, 5)):
        Z = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
        s = np.linalg.svd(Z.detach().numpy(), compute_uv=False)
        assert abs(float(log_kappa(Z).detach()) - 2 * np.log(s[0] / s[-1])) < 1e-9
        log_kappa(Z).backward()
        assert torch.isfinite(Z.grad).all()


def test_imma_lower_level_is_unrolled_and_scale_free():
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(20, 6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 3, (20,), generator=g)
    l0 = imma_harmful_loss(Z, y, 3, steps=0, inner_lr=1.0)
    assert abs(float(l0.detach()) - np.log(3)) < 1e-12             # zero-initialised probe
    l3 = imma_harmful_loss(Z, y, 3, steps=3, inner_lr=1.0)
    assert float(l3.detach()) < float(l0.detach())                  # the attacker makes progress
    l3.backward()
    assert torch.isfinite(Z.grad).all() and Z.grad.abs().sum() > 0  # differentiable through steps


# --- training ---------------------------------------------------------------------------------

def _tiny_setup(seed=0, n=48):
    m = build_model("resnet18_32px", 3, seed=seed)
    m.set_trainable()
    cp, ch = cache_trunk(m, _tds(n, 10)), cache_trunk(m, _tds(n, 11))
    return m, cp, ch


def test_immunize_moves_only_the_tail_and_records_history():
    m, cp, ch = _tiny_setup()
    before = copy.deepcopy(m.state_dict())
    res = immunize(m, cp, ch, DeepImmunizeConfig(method="ours", max_steps=2, batch_size=8, lr=1e-3,
                                             balance=0.5, progress=False), num_classes_h=3, from_trunk=True)
    assert res.steps == 2 and len(res.history["r_ill"]) == 2 and res.lambdas["lambda_h"] > 0
    after = m.state_dict()
    changed = {k.split(".")[1] for k in before if not torch.equal(before[k], after[k])}
    assert changed <= {"layer3", "layer4", "global_pool", "fc"} and "layer4" in changed
    assert torch.equal(before["net.layer2.0.conv1.weight"], after["net.layer2.0.conv1.weight"])


def test_nan_loss_stops_keeps_last_good_step_and_checkpoint(tmp_path):
    m, cp, ch = _tiny_setup()
    cfg = DeepImmunizeConfig(method="ours", max_steps=50, batch_size=8, lr=1e4, balance=1.0,
                         progress=False, checkpoint_dir=str(tmp_path))
    with pytest.raises(NonFiniteLossError, match="at step") as info:
        immunize(m, cp, ch, cfg, num_classes_h=3, from_trunk=True)
    err = info.value
    assert err.step >= 1 and Path(err.checkpoint).is_file()
    assert all(torch.isfinite(p).all() for p in m.parameters())
    # the stopped model is exactly the model after `err.step` good steps
    m2, cp2, ch2 = _tiny_setup()
    immunize(m2, cp2, ch2,
             DeepImmunizeConfig(**{**cfg.__dict__, "max_steps": err.step, "checkpoint_dir": None}),
             num_classes_h=3, from_trunk=True)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    torch.testing.assert_close(load_immunized(err.checkpoint).fc.weight, m.net.fc.weight)


def test_balanced_lambdas_equalise_gradient_norms():
    m, cp, ch = _tiny_setup()
    ext, _ = m.set_trainable()
    hP, yP = cp.tensors[0][:8], cp.tensors[1][:8]
    hH, yH = ch.tensors[0][:8], ch.tensors[1][:8]
    t = loss_terms(m, "ours", hP, yP, hH, yH, 3)
    lam = balanced_lambdas(t, ext, 0.5)

    def norm(v):
        gs = torch.autograd.grad(v, ext, retain_graph=True, allow_unused=True)
        return float(torch.sqrt(sum((g.double() ** 2).sum() for g in gs if g is not None)))

    ce = norm(t["ce"])
    assert lam["lambda_h"] * norm(t["r_ill"]) == pytest.approx(0.5 * ce, rel=1e-9)
    assert lam["lambda_p"] * norm(t["r_well"]) == pytest.approx(0.5 * ce, rel=1e-9)
    assert all(p.grad is None for p in ext)                           # .grad untouched


def test_lambdas_are_rebalanced_every_step_only_when_asked():
    runs = {}
    for every in (0, 1, 2):
        m, cp, ch = _tiny_setup()
        res = immunize(m, cp, ch, DeepImmunizeConfig(method="ours", max_steps=4, batch_size=8, lr=1e-3,
                                                     balance=1.0, balance_every=every, progress=False),
                       num_classes_h=3, from_trunk=True)
        runs[every] = res.history["lambda_h"]
    assert len(set(runs[0])) == 1                                     # fixed after step 0
    assert len(set(runs[1])) == 4                                     # a new λ each step
    assert runs[2][0] == runs[2][1] and runs[2][2] == runs[2][3] and runs[2][1] != runs[2][2]
    assert runs[0][0] == runs[1][0] == runs[2][0]                     # same step-0 balance


def test_scope_layer_trains_only_the_immunization_layer_on_cached_features():
    m = build_model("resnet18_32px", 3, seed=0).eval()
    x, _ = _images(4, 3)
    with torch.no_grad():
        full = m.features(x)
        X = m.pooled(m.trunk(x))
        m.set_scope("layer")
        torch.testing.assert_close(m.trunk(x), X)                     # the trunk now ends at X
        torch.testing.assert_close(m.features(x), full)
    ext, cls = m.set_trainable()
    assert {id(p) for p in ext} == {id(p) for p in m.layer.parameters()}
    assert m.trunk_is_frozen() and not any(p.requires_grad for p in m.net.layer4.parameters())
    with pytest.raises(ValueError, match="scope"):
        m.set_scope("everything")


# --- attackers --------------------------------------------------------------------------------

def test_adam_probe_learns_and_best_of_sweep_is_the_per_epoch_max():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 300)
    Z = rng.standard_normal((300, 6)) + 3.0 * np.eye(6)[y]
    a = adam_probe_curve(Z[:200], y[:200], Z[200:], y[200:], epochs=5, lr=1e-1)
    assert a.test_accuracy[0] < 50 and a.test_accuracy[-1] > 90
    b = best_adam_probe(Z[:200], y[:200], Z[200:], y[200:], epochs=5, lrs=(1e-4, 1e-1))
    assert set(b["per_config"]) == {"scale@0.0001", "scale@0.1", "standardize@0.0001", "standardize@0.1"}
    per = np.array(list(b["per_config"].values()))
    assert b["test_accuracy"] == per.max(0).tolist()
    assert b["test_accuracy"][-1] > np.array(b["per_config"]["scale@0.0001"])[-1]


def test_adam_probe_is_scale_free_and_whitening_undoes_a_linear_map():
    """Shrinking the features cannot fake a slow-down of the Adam attacker (it could against a
    fixed learning-rate grid on raw features), and the whitening attacker sees through an
    invertible linear map of the features (up to a rotation of the whitened frame)."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 300)
    Z = rng.standard_normal((300, 6)) + 2.0 * np.eye(6)[y]
    kw = dict(epochs=4, lrs=(1e-2, 1e-1), num_classes=3)
    a = best_adam_probe(Z[:200], y[:200], Z[200:], y[200:], **kw)
    b = best_adam_probe(1e-3 * Z[:200], y[:200], 1e-3 * Z[200:], y[200:], **kw)
    assert a["test_accuracy"] == pytest.approx(b["test_accuracy"])
    raw = [max(adam_probe_curve(s * Z[:200], y[:200], s * Z[200:], y[200:], epochs=4, lr=lr).test_accuracy[1]
               for lr in (1e-2, 1e-1)) for s in (1.0, 1e-3)]
    assert raw[1] < raw[0] - 10                                       # the raw probe is fooled by scale
    M = rng.standard_normal((6, 6)) @ np.diag([1e-3, 1, 1, 1, 1, 1e2])
    w1 = best_adam_probe(Z[:200], y[:200], Z[200:], y[200:], preprocessing=("whiten",), **kw)
    w2 = best_adam_probe(Z[:200] @ M, y[:200], Z[200:] @ M, y[200:], preprocessing=("whiten",), **kw)
    # whitened features are unique up to a rotation, to which Adam is not invariant: equal to 3 points
    assert w1["test_accuracy"] == pytest.approx(w2["test_accuracy"], abs=3.0)
    assert w2["test_accuracy"][-1] > 80


def test_finetune_attack_trains_the_stage_and_leaves_the_model_alone():
    m = build_model("resnet18_32px", 3, seed=0).eval()
    m.set_trainable()
    h = cache_trunk(m, _tds(48, 12))
    m.set_scope("layer")
    ref = freeze_reference(m)
    c = finetune_attack(m, h, h, num_classes=3, epochs=4, lr=1e-3, batch_size=16, seed=0)
    assert len(c.test_accuracy) == 5 and c.test_accuracy[-1] > c.test_accuracy[0] + 20   # memorises
    assert c.train_loss[-1] < c.train_loss[0]
    assert deep.feature_metrics.fingerprint(m) == ref.digest and m.scope == "layer"


# --- metrics ----------------------------------------------------------------------------------

def test_rir_uses_a_frozen_copy_of_theta0_not_the_model_itself():
    m, cp, ch = _tiny_setup(n=64)
    ref = freeze_reference(m)
    rng = np.random.default_rng(0)
    same = rir_theta0(m, ref, cp, ch, rng=rng, groups=3, group_size=20, from_trunk=True)
    assert same["value"]["mean"] == pytest.approx(1.0, abs=1e-9)    # θ_I = θ₀ ⇒ RIR_θ₀ = 1
    immunize(m, cp, ch, DeepImmunizeConfig(method="ours", max_steps=3, batch_size=16, lr=1e-3, balance=1.0,
                                       progress=False), num_classes_h=3, from_trunk=True)
    ref.verify()                                                    # immunizing did not touch θ₀
    r = rir_theta0(m, ref, cp, ch, rng=np.random.default_rng(0), groups=3, group_size=20, from_trunk=True)
    # The authors' mistake (comparing the model with itself) gives exactly 1 for every group.
    assert all(abs(v - 1.0) > 1e-6 for v in r["value"]["per_group"])
    with pytest.raises(ValueError, match="with itself"):
        rir_theta0(m, type(ref)(m, ref.digest), cp, ch, rng=rng, from_trunk=True)
    shallow = type(ref)(copy.copy(m), ref.digest)                   # shares parameter storage
    with pytest.raises(ValueError, match="shares parameter storage"):
        rir_theta0(m, shallow, cp, ch, rng=rng, from_trunk=True)
    with torch.no_grad():
        next(ref.model.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match="modified"):
        rir_theta0(m, ref, cp, ch, rng=rng, from_trunk=True)


def test_linear_probe_is_scale_free_and_slowed_by_conditioning():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400)
    Z = rng.standard_normal((400, 8)) + 2.0 * np.eye(8)[y]             # separable-ish classes
    a = linear_probe_curve(Z[:300], y[:300], Z[300:], y[300:], epochs=20)
    b = linear_probe_curve(100 * Z[:300], y[:300], 100 * Z[300:], y[300:], epochs=20)
    assert a.test_accuracy == pytest.approx(b.test_accuracy)           # rescaling cannot fake immunity
    ill = Z @ np.diag([300.0, 1, 1, 1, 1, 1, 1, 1])                  # one stretched direction: κ up
    c = linear_probe_curve(ill[:300], y[:300], ill[300:], y[300:], epochs=20)
    assert a.test_accuracy[5] > 80 and c.test_accuracy[5] < a.test_accuracy[5]


# --- experiment script ------------------------------------------------------------------------

def _ci(tmp_path, *extra):
    sys.path.insert(0, str(ROOT))
    from experiments import deepnet
    rc = deepnet.main(["--config", "ci", "--out", str(tmp_path), "--quiet", "--threads", "1", *extra])
    assert rc == 0
    return json.loads((tmp_path / "ci" / "results.json").read_text())


def test_pipeline_ci_end_to_end(tmp_path):
    res = _ci(tmp_path, "--seeds", "2")
    rows = res["rows"]
    plain = {"init", "ours", "r_ill_only", "imma", "opt_kappa"}
    assert set(rows) == plain | {f"{m}+label_subspace" for m in plain}, res.get("errors")
    assert res["seeds"] == [0, 1] and res["threads"] == 1
    keys = ("rir_theta0", "dp_top1", "probe_acc_epoch10", "probe_acc_last", "immunized",
            "adam_probe_acc_epoch1", "adam_probe_acc_epoch5", "finetune_acc_epoch1", "finetune_acc_epoch5")
    for key in keys:
        s = rows["ours"][key]
        per = s["per_seed"]
        assert (len(per) == 2 and s["mean"] == pytest.approx(np.mean(per))
                and s["std"] == pytest.approx(np.std(per)))
    for k, seed_run in enumerate(res["per_seed"]):
        row = seed_run["rows"]["ours"]
        # the per-seed summary is the seed's own RIR (mean over its groups)
        assert rows["ours"]["rir_theta0"]["per_seed"][k] == row["rir"]["value"]["mean"]
        assert len(row["rir"]["value"]["per_group"]) == 4
        assert rows["ours"]["adam_probe_acc_epoch5"]["per_seed"][k] == row["attacks"]["adam"][5]
        assert rows["ours"]["finetune_acc_epoch1"]["per_seed"][k] == row["attacks"]["finetune"][1]
        # Definition 3.1 from pycore.evaluate, per seed and counted
        i, ii = row["rir"]["harmful_ratio"]["mean"], row["rir"]["pretrain_ratio"]["mean"]
        assert row["immunized"] == (i > 1 and ii < 1)
    for m in rows:
        flags = [s["rows"][m]["immunized"] for s in res["per_seed"]]
        assert rows[m]["immunized_count"] == sum(flags) == rows[m]["success"]
    assert rows["init"]["rir_theta0"]["per_seed"] == pytest.approx([1.0, 1.0], abs=1e-9)
    assert abs(rows["ours"]["rir_theta0"]["mean"] - 1.0) > 1e-6
    # hardening keeps D_P predictions: the hardened θ₀ has θ₀'s D_P top-1 on every seed
    assert rows["init+label_subspace"]["dp_top1"]["per_seed"] == rows["init"]["dp_top1"]["per_seed"]
    for m in rows:
        assert Path(res["per_seed"][0]["rows"][m]["extractor"]).is_file(), m
        assert "extractor" not in res["per_seed"][1]["rows"][m]                  # first seed only
        for a in ("gd", "adam", "adam_whitened", "finetune"):
            assert len(rows[m]["attacks"][a]["epoch5"]["per_seed"]) == 2
    assert set(res["phase_seconds"]) >= {"theta0", "cache", "immunize", "gd_probe", "adam_probe", "finetune"}
    out = tmp_path / "ci"
    assert (out / "finetune.png").stat().st_size > 1000 and (out / "attacks.png").stat().st_size > 1000
    table = (out / "table.md").read_text()
    assert "| **Ours (Alg. 1)** |" in table and " ± " in table and "Adam" in table and "minus θ₀" in table
    assert res["environment"]


def test_library_pipeline_writes_no_file(tmp_path, monkeypatch):
    """pycore.deep computes and returns; files are the experiment layer's (or the caller's hook)."""
    sys.path.insert(0, str(ROOT))
    from experiments.deep_configs import CONFIGS
    from pycore.deep.distributed import init_from_env
    from pycore.deep.evaluate import RunOptions, run_config
    monkeypatch.chdir(tmp_path)
    rc = replace(CONFIGS["ci"], methods=("ours",), attack_epochs=(1,), finetune=False)
    seen = []
    res = run_config(rc, [0], RunOptions(quiet=True), init_from_env("cpu"),
                     on_extractor=lambda m, variant, seed, status: seen.append((variant, status)) or None)
    assert list(tmp_path.iterdir()) == []
    assert ("ours", "immunized") in seen and ("init", "immunized") in seen
    assert set(res["rows"]) == {"init", "ours", "init+label_subspace", "ours+label_subspace"}
    json.dumps(to_json(res), allow_nan=False)                                   # strict JSON as it is


def test_pipeline_is_deterministic_for_a_seed_and_thread_count(tmp_path):
    """Same seed and --threads: every number in results.json is identical (issue 12)."""
    a = _ci(tmp_path / "a", "--methods", "ours,opt_kappa")
    b = _ci(tmp_path / "b", "--methods", "ours,opt_kappa")
    strip = lambda r: json.dumps({"rows": r["rows"], "per_seed": [  # noqa: E731  (timings and paths aside)
        {**{k: v for k, v in s.items() if k != "phase_seconds"},
         "rows": {m: {k: v for k, v in row.items() if k not in ("train", "extractor")}
                  for m, row in s["rows"].items()}} for s in r["per_seed"]]}, sort_keys=True)
    assert strip(a) == strip(b)
    # and a different seed gives different numbers (the comparison above can fail)
    c = _ci(tmp_path / "c", "--methods", "ours,opt_kappa", "--seeds", "1-1")
    assert strip(a) != strip(c)


def test_script_reports_bad_roots_in_one_line(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    from experiments import deepnet
    rc = deepnet.main(["--config", "resnet18-cars", "--dp-root", str(tmp_path / "nope"),
                       "--dh-root", str(tmp_path / "nope2"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--dp-root: no such folder" in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_script_refuses_folder_flags_on_a_digits_configuration(tmp_path, capsys):
    """--dp-root/--dh-root (even roots full of corrupt images) used to be ignored by --config ci and
    --demo, which then ran on the bundled digits and exited 0."""
    sys.path.insert(0, str(ROOT))
    from experiments import deepnet
    bad = tmp_path / "corrupt" / "train" / "a"
    bad.mkdir(parents=True)
    (bad / "x.png").write_bytes(b"not an image")
    for argv, flag in ((["--config", "ci", "--dp-root", str(tmp_path / "corrupt")], "--dp-root"),
                       (["--demo", "--dh-root", str(tmp_path / "corrupt")], "--dh-root"),
                       (["--config", "ci", "--val-split", "test"], "--val-split"),
                       (["--config", "ci", "--cache-trunk"], "--cache-trunk")):
        rc = deepnet.main([*argv, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert rc == 2 and f"{flag}:" in err and "MNIST" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_device_cuda_without_a_gpu_is_a_usage_error(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    from experiments import deepnet
    rc = deepnet.main(["--config", "ci", "--device", "cuda", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("deepnet.py: error: --device:") and "Traceback" not in err


# --- distributed ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from pycore.deep.distributed import init_from_env, shutdown
    ctx = init_from_env("cpu")
    m = build_model("resnet18_32px", 3, seed=0)
    res = immunize(m, _tds(32, 10), _tds(32, 11),
                   DeepImmunizeConfig(method="ours", max_steps=2, batch_size=4, lr=1e-3, balance=1.0,
                                      balance_every=1, progress=False),
                   num_classes_h=3, rank=ctx.rank, world=ctx.world, ddp=True)
    if rank == 0:
        torch.save({"state": m.state_dict(), "loss": res.history["loss"], "lambdas": res.lambdas}, out)
    shutdown()


def test_ddp_gloo_two_processes_match_virtual_ranks(tmp_path):
    out = str(tmp_path / "ddp.pt")
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    ddp = torch.load(out, weights_only=True)
    m = build_model("resnet18_32px", 3, seed=0)
    res = immunize(m, _tds(32, 10), _tds(32, 11),
                   DeepImmunizeConfig(method="ours", max_steps=2, batch_size=4, lr=1e-3, balance=1.0,
                                      balance_every=1, progress=False, virtual_ranks=2), num_classes_h=3)
    # λ's re-balanced at step 1 from the all-reduced per-rank gradients = the virtual-rank mean
    assert ddp["lambdas"] == pytest.approx(res.lambdas, rel=1e-6)
    assert res.history["lambda_h"][0] != res.history["lambda_h"][1]
    assert ddp["loss"] == pytest.approx(res.history["loss"], rel=1e-5)
    moved = 0
    for k, v in m.state_dict().items():
        torch.testing.assert_close(ddp["state"][k], v, rtol=1e-4, atol=1e-6, msg=k)
        moved += (int(not torch.equal(v, build_model("resnet18_32px", 3, seed=0).state_dict()[k]))
                  if "layer4.1.conv2" in k else 0)
    assert moved == 1


def _ddp_nan_worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import pycore.deep.objectives as T
    from pycore.deep.distributed import init_from_env, shutdown
    cond = T._cond
    # Rank 1 alone gets a non-finite R_ill (what _cond returns for a non-finite feature batch).
    T._cond = lambda Z, kind: cond(Z, kind) * (float("nan") if rank == 1 and kind == "ill" else 1.0)
    ctx = init_from_env("cpu", timeout_s=60)
    m = build_model("resnet18_32px", 3, seed=0)
    try:
        immunize(m, _tds(16, 10), _tds(16, 11), DeepImmunizeConfig(method="ours", max_steps=2, batch_size=4,
                                                                lr=1e-3, progress=False),
                 num_classes_h=3, rank=ctx.rank, world=ctx.world, ddp=True)
        outcome = "returned"
    except NonFiniteLossError as exc:
        outcome = f"NonFiniteLossError at step {exc.step}"
    Path(f"{out}.{rank}").write_text(outcome)
    shutdown()


def test_ddp_nan_on_one_rank_stops_every_rank_cleanly(tmp_path):
    """A NaN loss on ONE rank must stop all ranks at the same step (no collective mismatch or
    hang: the ranks agree before DDP's gradient all-reduce)."""
    out = str(tmp_path / "nan")
    torch.multiprocessing.spawn(_ddp_nan_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    for rank in (0, 1):
        assert Path(f"{out}.{rank}").read_text() == "NonFiniteLossError at step 0"


@pytest.mark.slow
def test_torchrun_script_matches_single_process(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    common = ["--config", "ci", "--methods", "ours,r_ill_only", "--quiet", "--threads", "1"]
    subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", str(ROOT / "experiments" / "deepnet.py"),
                    *common, "--out", str(tmp_path / "ddp")], check=True, env=env, cwd=ROOT, timeout=600)
    subprocess.run([sys.executable, str(ROOT / "experiments" / "deepnet.py"), *common, "--virtual-ranks", "2",
                    "--out", str(tmp_path / "one")], check=True, env=env, cwd=ROOT, timeout=600)
    a = json.loads((tmp_path / "ddp" / "ci" / "results.json").read_text())["rows"]
    b = json.loads((tmp_path / "one" / "ci" / "results.json").read_text())["rows"]
    from safetensors.torch import load_file
    for m in ("ours", "r_ill_only"):
        # Stated tolerance: 1e-3 relative on RIR_θ₀ (a ratio of four κ's of up to ~1e4 each;
        # measured 6e-5), 1e-5 absolute on every exported weight (measured 5e-7), equal D_P top-1.
        assert a[m]["rir_theta0"]["mean"] == pytest.approx(b[m]["rir_theta0"]["mean"], rel=1e-3)
        assert a[m]["dp_top1"]["mean"] == b[m]["dp_top1"]["mean"]
        wa = load_file(str(tmp_path / "ddp" / "ci" / f"extractor_{m}.safetensors"))
        wb = load_file(str(tmp_path / "one" / "ci" / f"extractor_{m}.safetensors"))
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-5, msg=k)


def test_tradeoff_sweep_reports_the_frontier(tmp_path):
    sys.path.insert(0, str(ROOT))
    from experiments import deepnet_sweep
    assert deepnet_sweep.main(["--config", "ci", "--balances", "0.25,1", "--ill-balances", "2",
                               "--methods", "ours", "--threads", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "ci-sweep" / "tradeoff.json").read_text())
    a, b = res["runs"]["ours"]["0.25,2"][0], res["runs"]["ours"]["1,2"][0]
    assert a["seed"] == b["seed"] == 0 and list(res["theta0"]) == ["0"]               # θ₀ made once
    assert a["ours"]["rir_theta0"] != b["ours"]["rir_theta0"]                         # b changes the run
    assert {"adam_acc_epoch1", "adam_acc_epoch5", "immunized"} <= set(a["ours"])
    assert "ours+label_subspace" in a                                                  # hardened beside it
    assert (tmp_path / "ci-sweep" / "tradeoff.png").stat().st_size > 1000
    assert "| Ours (Alg. 1) | 0.25 | 2 |" in (tmp_path / "ci-sweep" / "tradeoff.md").read_text()


def test_balance_ill_reweights_only_the_r_ill_term():
    m, cp, ch = _tiny_setup()
    ext, _ = m.set_trainable()
    t = loss_terms(m, "ours", cp.tensors[0][:8], cp.tensors[1][:8], ch.tensors[0][:8], ch.tensors[1][:8], 3)
    one = balanced_lambdas(t, ext, 0.5)
    two = balanced_lambdas(t, ext, 0.5, weights={"lambda_h": 2.0})
    assert two["lambda_h"] == pytest.approx(4 * one["lambda_h"], rel=1e-12)
    assert two["lambda_p"] == one["lambda_p"]
    with pytest.raises(ValueError, match="balance_ill needs balance"):
        DeepImmunizeConfig(balance_ill=2.0).validate()


def test_pipeline_paper_scope_trains_the_tail(tmp_path):
    """The paper's layer choice (last two residual stages + layer) still runs end to end."""
    sys.path.insert(0, str(ROOT))
    from experiments import deepnet
    assert deepnet.main(["--config", "ci-tail", "--methods", "ours", "--out", str(tmp_path), "--quiet",
                         "--threads", "1"]) == 0
    res = json.loads((tmp_path / "ci-tail" / "results.json").read_text())
    assert res["scope"] == "tail" and set(res["rows"]) == {"init", "ours"}, res["errors"]
    row = res["per_seed"][0]["rows"]["ours"]
    assert row["train"]["steps"] == 3 and row["rir"]["value"]["mean"] != pytest.approx(1.0, abs=1e-9)


def test_nothing_to_balance_stops_with_a_clear_error(monkeypatch):
    import pycore.deep.objectives as objectives
    cond = objectives._cond
    monkeypatch.setattr(objectives, "_cond", lambda Z, kind: cond(Z, kind) * (0.0 if kind == "ill" else 1.0))
    m, cp, ch = _tiny_setup()
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(NonFiniteLossError, match="cannot balance λ for r_ill") as info:
        immunize(m, cp, ch, DeepImmunizeConfig(method="ours", max_steps=3, batch_size=8, lr=1e-3, balance=1.0,
                                               balance_every=1, progress=False),
                 num_classes_h=3, from_trunk=True)
    assert info.value.step == 0
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_spectrum_spread_tells_the_top_from_the_bottom_of_a_kappa_ratio():
    from pycore.deep.evaluate import spectrum_spread
    from pycore.spectral import gram_condition_number
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((200, 30))
    up = ref.copy()
    up[:, 0] *= 10.0                                                  # one direction inflated: top rises
    a = spectrum_spread(7.0 * up, ref, rng=np.random.default_rng(1), groups=5, group_size=50)
    assert a["top"] > 5 and 0.5 < a["bottom"] < 1.5                   # and the overall scale 7 cancels
    kappas = []
    g = np.random.default_rng(1)
    for _ in range(5):
        idx = g.choice(200, size=50, replace=False)
        kappas.append(np.log(gram_condition_number(up[idx]) / gram_condition_number(ref[idx])))
    assert a["top"] / a["bottom"] == pytest.approx(np.exp(np.mean(kappas)), rel=1e-9)
    down = ref @ np.diag([1.0] * 29 + [0.01])                         # one direction squashed: bottom falls
    b = spectrum_spread(down, ref, rng=np.random.default_rng(1), groups=5, group_size=50)
    assert b["bottom"] < 0.01 and 0.5 < b["top"] < 2
