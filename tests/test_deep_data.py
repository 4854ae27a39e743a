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

from pycore.deep import DataError, audit_model, create_model, image_folder, immunize_model
from pycore.deep._data import as_dataset, dataset_labels
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


@pytest.fixture(scope="module")
def tiny():
    return create_model("test_resnet", 2, seed=0, img_size=32).eval()


class _Lazy(Dataset):
    """``_data(24, 1)`` read one sample at a time, sample ``k`` replaced by ``bad(x, y)``."""

    def __init__(self, k, bad):
        self.X, self.y = _data(24, 1)
        self.k, self.bad = k, bad

    def __len__(self):
        return len(self.X)

    def __getitem__(self, i):
        x, y = self.X[i], self.y[i]
        return self.bad(x, y) if i == self.k else (x, y)


@pytest.mark.parametrize(
    "images",
    [
        lambda X: X[:, :1],  # one channel into a 3-channel model
        lambda X: torch.cat([X, X[:, :1]], 1),  # four
        lambda X: X[:, 0],  # (N, H, W): no channel axis (once read as 16 channels)
        lambda X: X[:, None],  # 5-D
        lambda X: (X * 100).to(torch.uint8),  # not floating point
        lambda X: X.to(torch.complex64),
    ],
    ids=["1 channel", "4 channels", "3-D", "5-D", "uint8", "complex"],
)
def test_images_of_another_form_are_named_before_any_work(tiny, work_spy, images):
    X, y = _data(16, 1)
    for kw, argument in (
        (dict(dp=(X, y), dh=(images(X), y)), "dh"),
        (dict(dp=(images(X), y), dh=(X, y)), "dp"),
    ):
        with pytest.raises(DataError) as e:
            immunize_model(tiny, kw["dp"], kw["dh"], adaptive_steps=5, progress=False)
        assert e.value.argument == argument and not work_spy
    with pytest.raises(DataError) as e:
        audit_model(tiny, reference=tiny, dh=(X, y), dh_test=(images(X), y), operators="gd")
    assert e.value.argument == "dh_test" and not work_spy


def test_float64_and_float16_images_are_the_float32_images_they_hold(tiny):
    X, y = _data(16, 1)
    for cast in (torch.float64, torch.float16, torch.bfloat16):
        ds = as_dataset((X.to(cast), y), "dh", tiny)
        assert ds.tensors[0].dtype == torch.float32
        assert torch.equal(ds.tensors[0], X.to(cast).float())
        x, label = as_dataset(_Lazy(3, lambda x, y: (x.double(), y)), "dh", tiny)[3]
        assert x.dtype == torch.float32 and torch.equal(x, _data(24, 1)[0][3]) and label == 1
    audit = audit_model(tiny, reference=tiny, dh=(X.double(), y), operators="gd", progress=False)
    assert audit.slowdown("gd")[0] in (1.0, None) and audit.worth.worth == 1.0


def test_a_float64_input_beyond_float32_is_named_with_its_sample(tiny, work_spy):
    X, y = _data(16, 1)
    X = X.double()
    X[6, 0, 1, 1] = 1e300
    with pytest.raises(DataError) as e:
        immunize_model(tiny, (X, y), _data(16, 2), progress=False)
    assert (e.value.argument, e.value.sample) == ("dp", 6) and not work_spy


@pytest.mark.parametrize(
    "bad",
    [
        lambda x, y: (x[:, :28, :28], y),  # another size
        lambda x, y: (x[:1], y),  # another channel count
        lambda x, y: {"image": x, "label": y},  # another form (Hugging Face's)
        lambda x, y: (x, 0.5),  # a label that is no class
        lambda x, y: (x * float("nan"), y),
        lambda x, y: (x.to(torch.int32), y),
    ],
    ids=["size", "channels", "dict", "label", "nan", "int"],
)
def test_a_lazy_datasets_bad_sample_is_named_by_its_index_where_it_is_read(tiny, bad):
    """Sample 7 of 24 (never sample 0, the one checked at the door) is named with the argument
    that holds it, by its index in that argument, however deep the read: immunize_model's
    features, audit_model's splits (Subsets) read in a thread pool."""
    with pytest.raises(DataError) as e:
        immunize_model(tiny, _data(16, 2), _Lazy(7, bad), adaptive_steps=5, progress=False)
    assert (e.value.argument, e.value.sample) == ("dh", 7)
    with pytest.raises(DataError) as e:
        audit_model(tiny, reference=tiny, dh=_Lazy(7, bad), operators="gd", progress=False)
    assert (e.value.argument, e.value.sample) == ("dh", 7)


def test_a_model_of_one_image_size_names_images_of_another(work_spy):
    vit = create_model("vit_tiny_patch16_224", 2, seed=0, img_size=32)
    X, y = _data(8, 1)
    with pytest.raises(DataError) as e:
        immunize_model(vit, (X, y), (X[:, :, :16, :16], y), progress=False)
    assert e.value.argument == "dh" and not work_spy


def test_labels_out_of_range_name_their_argument_and_sample(tiny):
    X, y = _data(16, 1)
    neg = y.clone()
    neg[4] = -1
    for call, argument in (
        (lambda: immunize_model(tiny, (X, y), (X, neg), progress=False), "dh"),
        (lambda: immunize_model(tiny, (X, y + 1), (X, y), progress=False), "dp"),
        (lambda: audit_model(tiny, reference=tiny, dh=(X, neg), operators="gd"), "dh"),
        (lambda: audit_model(tiny, reference=tiny, dh=(X, y), dh_test=(X, neg)), "dh_test"),
    ):
        with pytest.raises(DataError) as e:
            call()
        assert (e.value.argument, e.value.sample) == (argument, 1 if argument == "dp" else 4)


def test_a_task_of_one_class_is_refused_naming_it(tiny, work_spy):
    """One class: a slowdown of 1.0 and immunized=True about nothing."""
    X, y = _data(16, 1)
    for call, argument in (
        (lambda: immunize_model(tiny, (X, y), (X, y * 0), progress=False), "dh"),
        (lambda: audit_model(tiny, reference=tiny, dh=(X, y * 0 + 1), operators="gd"), "dh"),
    ):
        with pytest.raises(DataError) as e:
            call()
        assert e.value.argument == argument and not work_spy
    with pytest.raises(DataError) as e:  # checked with the model's classes, on its copy
        immunize_model(tiny, (X, y * 0), (X, y), progress=False)
    assert e.value.argument == "dp"
    X_test, y_test = _data(4, 3)  # a test split of one class is a test split
    audit = audit_model(
        tiny,
        reference=tiny,
        dh=(X, y),
        dh_test=(X_test, y_test * 0),
        operators="gd",
        progress=False,
    )
    assert audit.slowdown("gd")[0] in (1.0, None) and audit.worth.worth == 1.0


def test_inputs_that_are_all_zero_are_blamed_on_the_inputs(tiny, work_spy):
    X, y = _data(16, 1)
    zero = _Lazy(-1, None)
    zero.X = torch.zeros_like(zero.X)
    for call, argument in (
        (lambda: immunize_model(tiny, (X * 0, y), (X, y), progress=False), "dp"),
        (lambda: audit_model(tiny, reference=tiny, dh=(X * 0, y), operators="gd"), "dh"),
    ):
        with pytest.raises(DataError) as e:
            call()
        assert e.value.argument == argument and not work_spy
    with pytest.raises(DataError) as e:  # a lazy Dataset's: when its features are computed
        immunize_model(tiny, (X, y), zero, progress=False)
    assert e.value.argument == "dh"
