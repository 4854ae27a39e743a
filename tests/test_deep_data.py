"""The data the deep API takes (pycore/deep/_data.py): every input form held to one rule for
labels and samples, the first bad sample named with the argument that holds it, labels bounded
before anything is sized by them, image folders that are not files refused without reading."""

from __future__ import annotations

import os
import pickle
import signal
import types

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pycore.deep import (
    DataError,
    as_dataset,
    audit_model,
    create_model,
    dataset_labels,
    image_folder,
    immunize_model,
)
from tests.helpers import image_root

torch.set_num_threads(1)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.arange(n) % 2


class _Pairs(Dataset):
    """A Dataset of ``(x, label)`` with labels of any type, read one sample at a time."""

    def __init__(self, X, labels):
        self.X, self.labels = X, labels

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        return self.X[i], self.labels[i]


class _Targets(_Pairs):
    """The same, with its labels also as ``.targets`` (torchvision's convention)."""

    @property
    def targets(self):
        return self.labels


class _Dicts(_Pairs):
    """Hugging Face's form: one dict per sample."""

    def __getitem__(self, i):
        return {"image": self.X[i], "label": int(self.labels[i])}


@pytest.fixture(scope="module")
def net():
    return create_model("resnet10t", 2, seed=0).eval()


def _forms(X, labels):
    """Every form the API takes, holding ``labels`` (a list of Python numbers)."""
    y = torch.tensor(labels)
    return {
        "pair": (X, y),
        "tensor dataset": TensorDataset(X, y),
        "dataset": _Pairs(X, labels),
        "dataset of tensors": _Pairs(X, list(y)),
        "targets": _Targets(X, labels),
        "loader": DataLoader(_Pairs(X, labels), batch_size=4),
    }


@pytest.mark.parametrize(
    "form", ["pair", "tensor dataset", "dataset", "dataset of tensors", "targets", "loader"]
)
def test_non_integer_labels_are_refused_naming_the_data_and_sample(net, work_spy, form):
    X, _ = _data(16, 1)
    labels = [0.0, 1.0, 1.0, 0.2, 0.7] + [float(i % 2) for i in range(11)]
    with pytest.raises(DataError) as e:
        immunize_model(net, _forms(X, labels)[form], _data(16, 2), adaptive_steps=5)
    assert (e.value.argument, e.value.sample) == ("dp", 3) and not work_spy
    with pytest.raises(DataError) as e:
        immunize_model(net, _data(16, 2), _forms(X, labels)[form], adaptive_steps=5)
    assert (e.value.argument, e.value.sample) == ("dh", 3) and not work_spy


@pytest.mark.parametrize(
    "form", ["pair", "tensor dataset", "dataset", "dataset of tensors", "targets", "loader"]
)
def test_integral_float_labels_are_the_classes_they_name(form):
    X, _ = _data(8, 1)
    ds = as_dataset(_forms(X, [float(i % 3) for i in range(8)])[form], "dp")
    labels = dataset_labels(ds, "dp")
    assert labels.dtype == np.int64 and labels.tolist() == [i % 3 for i in range(8)]


def test_samples_that_are_not_pairs_are_refused_naming_the_data(net, work_spy):
    X, y = _data(16, 1)
    for data in (DataLoader(_Dicts(X, y.tolist())), _Dicts(X, y.tolist())):
        with pytest.raises(DataError) as e:
            immunize_model(net, _data(16, 2), data, adaptive_steps=5)
        assert (e.value.argument, e.value.sample) == ("dh", 0) and not work_spy


def test_the_first_non_finite_input_of_a_tensor_pair_is_named_before_any_work(net, work_spy):
    X, y = _data(16, 1)
    X[7, 1, 2, 3], X[9, 0, 0, 0] = float("nan"), float("inf")
    with pytest.raises(DataError) as e:
        immunize_model(net, (X, y), _data(16, 2), adaptive_steps=5)
    assert (e.value.argument, e.value.sample) == ("dp", 7) and not work_spy
    again = pickle.loads(pickle.dumps(e.value))  # from a worker process, as itself
    assert (type(again), again.argument, again.sample) == (DataError, "dp", 7)


def test_the_first_non_finite_input_of_a_dataset_is_named(net):
    """A Dataset's samples are read when its features are: the error names the sample there,
    before any training could meet its non-finite features."""
    X, y = _data(16, 1)
    X[5, 0, 0, 0] = float("inf")
    with pytest.raises(DataError) as e:
        immunize_model(net, _data(16, 2), _Pairs(X, y.tolist()), adaptive_steps=5)
    assert (e.value.argument, e.value.sample) == ("dh", 5)


def test_one_huge_label_is_refused_before_a_classifier_is_sized_by_it(net, work_spy):
    """One label of 5,000,000 among 16 samples would size a 20.5 GB classifier."""
    X, y = _data(16, 1)
    huge = y.clone()
    huge[5] = 5_000_000
    with pytest.raises(DataError, match="5000000") as e:
        immunize_model(net, (X, y), (X, huge), epochs=1)
    assert str(e.value).startswith("dh") and "sample 5" in str(e.value)
    with pytest.raises(DataError, match="5000000"):
        audit_model(net, reference=net, dh=(X, huge), operators="gd")
    assert not work_spy
    with pytest.raises(DataError, match="dp"):  # D_P's labels must be the model's classes
        immunize_model(net, (X, y + 1), (X, y), epochs=1)


def test_a_named_pipe_called_png_is_refused_not_read(tmp_path):
    """A FIFO x.png in a class folder, there when the folder is listed or put there after: a
    DataError naming it, never a read that blocks for ever (an alarm ends the wait here)."""
    image_root(tmp_path / "dp" / "train")
    model = types.SimpleNamespace(pretrained_cfg={"input_size": (3, 16, 16)})  # a data config
    listed = image_folder(tmp_path / "dp", "train", model)  # every image a file when listed
    fifo = tmp_path / "dp" / "train" / "a" / "x.png"
    os.mkfifo(fifo)

    def hung(signum, frame):
        raise TimeoutError("blocked reading the pipe")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(DataError, match="x.png"):
            image_folder(tmp_path / "dp", "train", model)
        fifo.unlink()
        (tmp_path / "dp" / "train" / "a" / "0.png").unlink()
        os.mkfifo(tmp_path / "dp" / "train" / "a" / "0.png")  # a pipe put there after the listing
        with pytest.raises(DataError, match="0.png"):
            listed[0]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
