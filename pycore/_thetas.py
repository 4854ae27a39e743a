"""Archives of immunized extractors.

Every run's θ in one ``.npz`` (keys :func:`theta_key`, the inputs under ``"data/..."``, a
``"meta"`` JSON string), read with ``allow_pickle=False`` and a memory cap.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
from pathlib import Path

import numpy as np

from pycore import limits
from pycore._report import dumps_json, from_json
from pycore._validation import ParameterError, check_number, check_regular_file

_KEY = re.compile(r"^[A-Za-z0-9_.+\-]+(/[A-Za-z0-9_.+\-]+)*$")
_HEADERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}


def run_name(method: str, harden: str = "none") -> str:
    return method if harden == "none" else f"{method}+{harden}"


def theta_key(method: str, seed: int, harden: str = "none", part: str | None = None) -> str:
    """The archive key of a run.

    ``"ours/seed0"``, ``"ours+haar/seed0"``, ``"ours+haar/seed0/Q"``.
    """
    return f"{run_name(method, harden)}/seed{int(seed)}" + (f"/{part}" if part else "")


def run_thetas(res, method: str, seed: int, harden: str = "none", prefix: str = "") -> dict:
    """A result's archive entries.

    Its θ and, when hardened, the unhardened θ and the rotation Q.
    """
    out = {prefix + theta_key(method, seed, harden): res.theta}
    if res.theta_unhardened is not None:
        out[prefix + theta_key(method, seed)] = res.theta_unhardened
        out[prefix + theta_key(method, seed, harden, "Q")] = res.rotation
    return out


def task_arrays(tasks: dict, prefix: str = "") -> dict:
    """The archive entries of the inputs the θ's of ``{name: LinearTask}`` act on.

    ``{prefix}data/<name>/<X_P|Y_P|X_H|Y_H>``: the inputs the θ's of ``{name: LinearTask}``
    act on.
    """
    return {
        f"{prefix}data/{name}/{k}": getattr(t, k)
        for name, t in tasks.items()
        if t is not None
        for k in ("X_P", "Y_P", "X_H", "Y_H")
    }


def save_thetas(path, arrays: dict, meta: dict | None = None) -> Path:
    """Write ``arrays`` (key → numeric array) and ``meta`` (strict JSON) to a θ archive.

    Parameters
    ----------
    path : path
        The ``.npz`` file.
    arrays : dict of str to ndarray
        The θ's (and task arrays) by key.
    meta : dict, optional
        What the archive records beside them (the settings).

    Returns
    -------
    pathlib.Path
        The file written.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> import numpy as np
    >>> from pycore.report import load_thetas, save_thetas
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = pathlib.Path(folder.name) / "thetas.npz"
    >>> arrays, meta = load_thetas(save_thetas(path, {"ours": np.eye(2)}, {"seed": 0}))
    >>> sorted(arrays), meta
    (['ours'], {'seed': 0})
    >>> folder.cleanup()
    """
    out = {}
    for k, v in arrays.items():
        if (
            not isinstance(k, str)
            or not _KEY.match(k)
            or k == "meta"
            or {".", ".."} & set(k.split("/"))
        ):
            raise ParameterError(
                "arrays",
                f"archive key {k!r} must be '/'-separated parts of letters, "
                "digits and _.+- (no '.' or '..' part, not 'meta')",
            )
        a = np.asarray(v)
        if a.dtype.kind not in "biuf":
            raise ParameterError("arrays", f"archive entry {k!r} is not numeric (dtype {a.dtype})")
        out[k] = a
    out["meta"] = np.array(dumps_json(meta or {}, sort_keys=True))
    with open(path, "wb") as fh:
        np.savez_compressed(fh, **out)
    return Path(path)


def _refusal(zf: zipfile.ZipFile, limit: int) -> str | None:
    """Why the archive is refused before reading.

    Declared sizes over ``limit``, or a member whose .npy header declares more than it holds (numpy
    would allocate it first).
    """
    total = sum(i.file_size for i in zf.infolist())
    if total > limit:
        return (
            f"its members declare {total} bytes decompressed, more than the {limit} byte limit "
            "(max_bytes; pycore.limits.MAX_ARCHIVE_BYTES)"
        )
    for info in zf.infolist():
        with zf.open(info) as fh:
            version = np.lib.format.read_magic(fh)
            if version not in _HEADERS:
                return f"member {info.filename!r} is a .npy file of version {version}"
            shape, _, dtype = _HEADERS[version](fh)
        if dtype.hasobject or math.prod(shape) * dtype.itemsize > info.file_size:
            return (
                f"member {info.filename!r} declares a {shape} {dtype} array in "
                f"{info.file_size} bytes"
            )
    return None


def load_thetas(path, *, max_bytes: int | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, meta)`` of a :func:`save_thetas` archive, at most ``max_bytes`` decompressed.

    Parameters
    ----------
    path : path
        The archive.
    max_bytes : int, optional
        The most bytes it may decompress to (default :data:`pycore.limits.MAX_ARCHIVE_BYTES`).

    Returns
    -------
    arrays : dict of str to ndarray
        The arrays by key.
    meta : dict
        The metadata.

    Raises
    ------
    ValueError
        A file that is not such an archive, or one past ``max_bytes``, named.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> import numpy as np
    >>> from pycore.report import load_thetas, save_thetas
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     saved = save_thetas(pathlib.Path(folder) / "t.npz", {"ours": np.eye(3)})
    ...     load_thetas(saved)[0]["ours"].shape
    (3, 3)
    """
    limit = limits.MAX_ARCHIVE_BYTES if max_bytes is None else max_bytes
    check_number(limit, "max_bytes", low=0, integer=True)
    check_regular_file(path, "a θ archive (.npz)", max_bytes=limit)
    try:
        with zipfile.ZipFile(path) as zf:
            refusal = _refusal(zf, limit)
        if refusal is None:
            with np.load(Path(path), allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files if k != "meta"}
                meta = from_json(json.loads(str(z["meta"]))) if "meta" in z.files else {}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise ValueError(
            f"{path}: not a readable θ archive ({type(exc).__name__}: {exc})"
        ) from None
    if refusal is not None:
        raise ValueError(f"{path}: {refusal}")
    return arrays, meta
