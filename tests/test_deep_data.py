"""The data the deep API takes (pycore/deep/_data.py): every input form held to one rule for
labels and samples, the first bad sample named with the argument that holds it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pycore.deep import DataError, as_dataset, create_model, dataset_labels, immunize_model

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
