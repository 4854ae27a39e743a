"""Hardening of the immunization layer (pycore/deep/harden.py, docs/deep.md "Hardening")."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub (via timm)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import pycore.deep  # noqa: E402,F401  (installs the torchvision shim before timm)
from pycore.deep import build_model, cache_trunk, immunize  # noqa: E402
from pycore.deep.feature_metrics import extract_features  # noqa: E402
from pycore.deep.harden import (  # noqa: E402
    apply_feature_map, haar_rotation, harden, hardening_map, label_subspace,
)
from pycore.deep.train import DeepImmunizeConfig  # noqa: E402
from pycore.metrics import grouped_feature_rir  # noqa: E402

torch.set_num_threads(1)


def _layer_model(seed=0, n=60, classes=3):
    """A ResNet18 at 32 px in scope "layer" with cached pooled features of two labelled sets."""
    g = torch.Generator().manual_seed(seed)
    m = build_model("resnet18_32px", classes, seed=seed).set_scope("layer")
    m.set_trainable()
    m.eval()
    sets = []
    for k in range(2):
        x = torch.randn(n, 3, 32, 32, generator=g)
        y = torch.arange(n) % classes
        x = x + 2.0 * y.view(-1, 1, 1, 1).float()                        # class-dependent inputs
        sets.append(cache_trunk(m, TensorDataset(x, y)))
    return m, sets[0], sets[1]


def _logits(m, ds):
    Z = extract_features(m, ds, from_trunk=True)
    with torch.no_grad():
        return m.classifier(torch.from_numpy(Z).float()).double().numpy(), Z


def test_haar_rotation_is_orthogonal_and_seeded():
    q = haar_rotation(7, np.random.default_rng(0))
    np.testing.assert_allclose(q.T @ q, np.eye(7), atol=1e-12)
    np.testing.assert_array_equal(q, haar_rotation(7, np.random.default_rng(0)))
    assert not np.allclose(q, haar_rotation(7, np.random.default_rng(1)))


def test_label_subspace_spans_the_centred_class_means():
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(4), 30)
    means = rng.standard_normal((4, 9))
    Z = means[y] + 0.1 * rng.standard_normal((120, 9))
    U = label_subspace(Z, y, 4)
    assert U.shape == (9, 3)                                              # C − 1 directions
    np.testing.assert_allclose(U.T @ U, np.eye(3), atol=1e-12)
    centred = np.stack([Z[y == c].mean(0) - Z.mean(0) for c in range(4)])
    np.testing.assert_allclose(centred @ U @ U.T, centred, atol=1e-10)    # the means lie in span(U)
    with pytest.raises(ValueError, match="two classes"):
        label_subspace(Z[y == 0], y[y == 0], 4)


def test_rotation_keeps_every_spectrum_and_the_dp_predictions():
    m, dp, dh = _layer_model()
    before, Zp = _logits(m, dp)
    Zh = extract_features(m, dh, from_trunk=True)
    info = harden(m, dh, "rotate", num_classes=3, rng=np.random.default_rng(0), from_trunk=True)
    after, Zp2 = _logits(m, dp)
    Zh2 = extract_features(m, dh, from_trunk=True)
    assert info.kind == "rotate" and info.subspace_dim == 0 and info.logit_change < 1e-4
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    assert not np.allclose(Zp2, Zp, atol=1e-3)                            # the features did move
    for a, b in ((Zp, Zp2), (Zh, Zh2)):
        np.testing.assert_allclose(np.linalg.svd(b, compute_uv=False), np.linalg.svd(a, compute_uv=False),
                                   rtol=1e-4)
    r = grouped_feature_rir(Zp2, Zh2, Zp, Zh, rng=np.random.default_rng(0), groups=3, group_size=20)
    assert r["value"]["mean"] == pytest.approx(1.0, rel=1e-3)              # RIR, (i), (ii) unchanged
    assert r["harmful_ratio"]["mean"] == pytest.approx(1.0, rel=1e-3)


def test_label_subspace_squashes_the_class_means_and_keeps_dp_predictions():
    m, dp, dh = _layer_model()
    before, _ = _logits(m, dp)
    Zh = extract_features(m, dh, from_trunk=True)
    y = dh.tensors[1].numpy()
    U = label_subspace(Zh, y, 3)
    info = harden(m, dh, "label_subspace", num_classes=3, rng=np.random.default_rng(0), scale=0.01,
                  from_trunk=True)
    after, _ = _logits(m, dp)
    Zh2 = extract_features(m, dh, from_trunk=True)
    assert info.subspace_dim == 2 and info.scale == 0.01 and info.logit_change < 1e-3
    np.testing.assert_allclose(after, before, rtol=1e-3, atol=1e-3 * np.abs(before).max())
    # Undo the rotation: the class-mean part of the features is scaled by 0.01, the rest kept.
    M, r = hardening_map("label_subspace", Zh, y, num_classes=3, rng=np.random.default_rng(0), scale=0.01)
    Q = haar_rotation(Zh.shape[1], np.random.default_rng(0))
    back = Zh2 @ Q.T
    np.testing.assert_allclose(back @ U, 0.01 * (Zh @ U), rtol=1e-3, atol=1e-4 * np.abs(Zh @ U).max())
    rest = np.eye(Zh.shape[1]) - U @ U.T
    np.testing.assert_allclose(back @ rest, Zh @ rest, rtol=1e-3, atol=1e-4 * np.abs(Zh).max())
    assert r == 2


def test_apply_feature_map_rejects_a_wrong_shape():
    m, _, _ = _layer_model()
    with pytest.raises(ValueError, match="feature map must be"):
        apply_feature_map(m, np.eye(3))
    with pytest.raises(ValueError, match="kind"):
        hardening_map("none", np.zeros((4, 3)), np.zeros(4), num_classes=2, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="scale"):
        hardening_map("label_subspace", np.zeros((4, 3)), np.zeros(4), num_classes=2,
                      rng=np.random.default_rng(0), scale=0.0)


def test_immunize_applies_the_hardening_option_last():
    m, dp, dh = _layer_model()
    cfg = DeepImmunizeConfig(method="ours", max_steps=2, batch_size=16, lr=1e-2, balance=1.0, progress=False)
    plain = immunize(m, dp, dh, cfg, num_classes_h=3, from_trunk=True)
    assert plain.hardening is None
    m2, dp2, dh2 = _layer_model()
    res = immunize(m2, dp2, dh2, DeepImmunizeConfig(**{**cfg.__dict__, "harden": "label_subspace"}),
                   num_classes_h=3, from_trunk=True)
    assert res.hardening["kind"] == "label_subspace" and res.hardening["subspace_dim"] == 2
    # the hardened model is the plain one hardened with the seed's map
    harden(m, dh, "label_subspace", num_classes=3, rng=np.random.default_rng([0, 99]), from_trunk=True)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    with pytest.raises(ValueError, match="unknown hardening"):
        DeepImmunizeConfig(harden="shuffle").validate()
