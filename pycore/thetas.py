"""Archives of immunized extractors: every run's θ in one ``.npz``, so anyone can re-attack it.

One file holds named float64 arrays (``"<method>/seed<k>"``, ``"<method>+haar/seed<k>"``,
the rotation ``".../Q"``, the inputs the θ's act on under ``"data/..."``) and a ``"meta"`` entry,
a JSON string (protocol, configuration, what each key means). It is written with
``numpy.savez_compressed`` and read back with ``allow_pickle=False``: an archive never executes
code on load. :func:`load_thetas` returns exactly the arrays that were saved (tested bit for bit).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from pycore.report import dumps_json, loads_json
from pycore.validation import ParameterError

__all__ = ["save_thetas", "load_thetas", "theta_key"]

_KEY = re.compile(r"^[A-Za-z0-9_.+\-/]+$")


def theta_key(method: str, seed: int, harden: str = "none", part: str | None = None) -> str:
    """The archive key of a run: ``"ours/seed0"``, ``"ours+haar/seed0"``, ``"ours+haar/seed0/Q"``."""
    name = method if harden == "none" else f"{method}+{harden}"
    return f"{name}/seed{int(seed)}" + (f"/{part}" if part else "")


def save_thetas(path, arrays: dict, meta: dict | None = None) -> Path:
    """Write ``arrays`` (name → float array) and ``meta`` (JSON-able, strict encoding of
    :func:`pycore.report.to_json`) to ``path`` (``.npz``). Names: letters, digits and ``_.+-/``."""
    path = Path(path)
    out = {}
    for k, v in arrays.items():
        if not isinstance(k, str) or not _KEY.match(k) or k == "meta":
            raise ParameterError("arrays", f"archive key {k!r} must use letters, digits and _.+-/ only "
                                           "(and not be 'meta')")
        a = np.asarray(v)
        if a.dtype.kind not in "biuf":
            raise ParameterError("arrays", f"archive entry {k!r} is not numeric (dtype {a.dtype})")
        out[k] = a
    out["meta"] = np.array(dumps_json(meta or {}, sort_keys=True))
    with open(path, "wb") as fh:
        np.savez_compressed(fh, **out)
    return path


def load_thetas(path) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, meta)`` from an archive written by :func:`save_thetas` (no pickle)."""
    with np.load(Path(path), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
        meta = loads_json(str(z["meta"])) if "meta" in z.files else {}
    return arrays, meta
