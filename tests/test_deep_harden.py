"""Hardening of the immunization layer (pycore/deep/harden.py, docs/deep.md "Hardening")."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub (via timm)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from pycore.deep import DeepOptions, ImmunizedNet, create_model, immunize  # noqa: E402
from pycore.deep.features import extract, prelogits_dataset  # noqa: E402
from pycore.deep.harden import apply_feature_map, haar_rotation, harden, hardening_map, label_subspace  # noqa: E402
from pycore.metrics import grouped_feature_rir  # noqa: E402
from pycore.validation import ParameterError  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_blas_thread():
    from pycore.threads import blas_threads
    with blas_threads(1):   # the arrays here are small: more threads only wait on each other
        yield


def _layer_model(seed=0, n=60, classes=3):
    """A resnet10t at 32 px with the layer's inputs of two labelled sets computed once."""
    g = torch.Generator().manual_seed(seed)
    m = ImmunizedNet(create_model("resnet10t", classes, seed=seed)).eval()
    sets = []
    for k in range(2):
        y = torch.arange(n) % classes
        x = torch.randn(n, 3, 32, 32, generator=g) + 2.0 * y.view(-1, 1, 1, 1).float()   # class-dependent inputs
        sets.append(prelogits_dataset(m, TensorDataset(x, y)))
    return m, sets[0], sets[1]


def _logits(m, ds):
    Z = extract(m, ds, cached=True)
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
    Zh = extract(m, dh, cached=True)
    info = harden(m, dh, "rotate", num_classes=3, rng=np.random.default_rng(0), cached=True)
    after, Zp2 = _logits(m, dp)
    Zh2 = extract(m, dh, cached=True)
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
    Zh = extract(m, dh, cached=True)
    y = dh.tensors[1].numpy()
    U = label_subspace(Zh, y, 3)
    info = harden(m, dh, "label_subspace", num_classes=3, rng=np.random.default_rng(0), scale=0.01,
                  cached=True)
    after, _ = _logits(m, dp)
    Zh2 = extract(m, dh, cached=True)
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
    opts = DeepOptions(max_steps=2, batch_size=16, lr=1e-2)
    assert immunize(m, dp, dh, "ours", opts, num_classes_h=3, cached=True).hardening is None
    m2, dp2, dh2 = _layer_model()
    res = immunize(m2, dp2, dh2, "ours", DeepOptions(**{**opts.__dict__, "harden": "label_subspace"}), num_classes_h=3,
                   cached=True)
    assert res.hardening["kind"] == "label_subspace" and res.hardening["subspace_dim"] == 2
    # the hardened model is the plain one hardened with the seed's map
    harden(m, dh, "label_subspace", num_classes=3, rng=np.random.default_rng([0, 99]), cached=True)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    with pytest.raises(ParameterError) as e:
        immunize(m, dp, dh, "ours", DeepOptions(harden="shuffle"), num_classes_h=3, cached=True)
    assert e.value.parameter == "harden"
