"""Hardening of the immunization layer (pycore/deep/_hardening.py, docs/findings.md §7)."""

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from pycore import ParameterError, grouped_feature_rir
from pycore._hardening import haar_rotation
from pycore._threads import blas_threads
from pycore.deep import DeepOptions, ImmunizedNet, create_model
from pycore.deep._features import extract, prelogits_dataset
from pycore.deep._hardening import harden
from pycore.deep._train import immunize_in_place

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_blas_thread():
    with blas_threads(1):  # small arrays: more threads only wait on each other
        yield


def _layer_model(seed=0, n=60, classes=3):
    """A resnet10t at 32 px with the layer's inputs of two labelled sets computed once."""
    g = torch.Generator().manual_seed(seed)
    m = ImmunizedNet(create_model("resnet10t", classes, seed=seed)).eval()
    sets = []
    for k in range(2):
        y = torch.arange(n) % classes
        # class-dependent
        x = torch.randn(n, 3, 32, 32, generator=g) + 2.0 * y.view(-1, 1, 1, 1).float()
        sets.append(prelogits_dataset(m, TensorDataset(x, y)))
    return m, sets[0], sets[1]


def _logits(m, ds):
    Z = extract(m, ds, cached=True)
    with torch.no_grad():
        return m.classifier(torch.from_numpy(Z).float()).double().numpy(), Z


def test_rotation_keeps_every_spectrum_and_the_dp_predictions():
    m, dp, dh = _layer_model()
    before, Zp = _logits(m, dp)
    Zh = extract(m, dh, cached=True)
    info = harden(m, dh, "haar", num_classes=3, rng=np.random.default_rng(0), cached=True)
    after, Zp2 = _logits(m, dp)
    Zh2 = extract(m, dh, cached=True)
    assert info["kind"] == "haar" and info["subspace_dim"] == 0 and info["logit_change"] < 1e-4
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    assert not np.allclose(Zp2, Zp, atol=1e-3)  # the features did move
    for a, b in ((Zp, Zp2), (Zh, Zh2)):
        np.testing.assert_allclose(
            np.linalg.svd(b, compute_uv=False), np.linalg.svd(a, compute_uv=False), rtol=1e-4
        )
    r = grouped_feature_rir(
        Zp2, Zh2, Zp, Zh, rng=np.random.default_rng(0), groups=3, group_size=20
    )
    assert r["value"]["mean"] == pytest.approx(1.0, rel=1e-3)  # RIR, (i), (ii) unchanged
    assert r["harmful_ratio"]["mean"] == pytest.approx(1.0, rel=1e-3)


def _class_means_basis(Z, y, classes):
    """An orthonormal basis of the span of the centred class means (classes − 1 directions)."""
    means = np.stack([Z[y == c].mean(0) - Z.mean(0) for c in range(classes)], axis=1)
    return np.linalg.svd(means, full_matrices=False)[0][:, : classes - 1]


def test_label_subspace_squashes_the_class_means_and_keeps_dp_predictions():
    m, dp, dh = _layer_model()
    before, _ = _logits(m, dp)
    Zh = extract(m, dh, cached=True)
    y = dh.tensors[1].numpy()
    U = _class_means_basis(Zh, y, 3)
    info = harden(
        m,
        dh,
        "label_subspace",
        num_classes=3,
        rng=np.random.default_rng(0),
        scale=0.01,
        cached=True,
    )
    after, _ = _logits(m, dp)
    Zh2 = extract(m, dh, cached=True)
    assert info["subspace_dim"] == 2 and info["scale"] == 0.01 and info["logit_change"] < 1e-3
    np.testing.assert_allclose(after, before, rtol=1e-3, atol=1e-3 * np.abs(before).max())
    # Undo the rotation: the class-mean part of the features is scaled by 0.01, the rest kept.
    Q = haar_rotation(Zh.shape[1], np.random.default_rng(0))
    back = Zh2 @ Q.T
    np.testing.assert_allclose(
        back @ U, 0.01 * (Zh @ U), rtol=1e-3, atol=1e-4 * np.abs(Zh @ U).max()
    )
    rest = np.eye(Zh.shape[1]) - U @ U.T
    np.testing.assert_allclose(back @ rest, Zh @ rest, rtol=1e-3, atol=1e-4 * np.abs(Zh).max())


def test_immunize_applies_the_hardening_option_last():
    m, dp, dh = _layer_model()
    opts = DeepOptions(rule="sgd", max_steps=2, batch_size=16, lr=1e-2)
    assert (
        immunize_in_place(m, dp, dh, "ours", opts, num_classes_h=3, cached=True).hardening is None
    )
    m2, dp2, dh2 = _layer_model()
    res = immunize_in_place(
        m2,
        dp2,
        dh2,
        "ours",
        DeepOptions(**{**opts.__dict__, "harden": "label_subspace"}),
        num_classes_h=3,
        cached=True,
    )
    assert res.hardening["kind"] == "label_subspace" and res.hardening["subspace_dim"] == 2
    # the hardened model is the plain one hardened with the seed's map
    harden(m, dh, "label_subspace", num_classes=3, rng=np.random.default_rng([0, 99]), cached=True)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    with pytest.raises(ParameterError) as e:
        immunize_in_place(
            m, dp, dh, "ours", DeepOptions(harden="shuffle"), num_classes_h=3, cached=True
        )
    assert e.value.parameter == "harden"
