"""Results plumbing: summaries, table numbers, provenance, strict JSON, progress bar, figures."""

from __future__ import annotations

import json
import math
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np


def summarize(values) -> dict:
    """Mean, population std (ddof = 0) and the values of a number over seeds.

    Parameters
    ----------
    values : iterable of float
        One value per seed.

    Returns
    -------
    dict
        ``{"mean", "std", "per_seed"}``.

    Examples
    --------
    >>> from pycore.report import summarize
    >>> summarize([1.0, 2.0, 3.0])["mean"], summarize([1.0, 3.0])["std"]
    (2.0, 1.0)
    """
    a = np.asarray(list(values), dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std()), "per_seed": [float(x) for x in a]}


def fmt(x: float, digits: int = 4) -> str:
    """A table cell: 4 significant digits, scientific outside [1e-3, 1e5); ∞ and n/a spelled out.

    Parameters
    ----------
    x : float or None
        The number.
    digits : int, default 4
        Significant digits of ``x``.

    Returns
    -------
    str
        ``x`` as a table prints it.

    Examples
    --------
    >>> from pycore.report import fmt
    >>> fmt(3.14159), fmt(123456.0), fmt(0.00012345), fmt(float("inf")), fmt(float("nan"))
    ('3.142', '1.235e+05', '1.234e-04', '∞', 'n/a')
    """
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if math.isinf(x):
        return "∞"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{float(f'{x:.{digits}g}'):g}"


def pm(summary: dict, digits: int = 4) -> str:
    """``mean ± std`` of a :func:`summarize`; a std at round-off level of the mean prints as 0.

    Parameters
    ----------
    summary : dict
        ``{"mean", "std", ...}``.
    digits : int, default 4
        Significant digits of the mean (the std has 2).

    Returns
    -------
    str
        The cell's text.

    Examples
    --------
    >>> from pycore.report import pm, summarize
    >>> pm(summarize([1.0, 3.0])), pm({"mean": 1.0, "std": 3.5e-18})
    ('2 ± 1', '1 ± 0')
    """
    mean, std = summary["mean"], summary["std"]
    if math.isfinite(mean) and std <= 1e-12 * abs(mean):
        std = 0.0
    return f"{fmt(mean, digits)} ± {fmt(std, 2)}"


def environment() -> dict:
    """Versions and the command line, recorded in every results.json.

    Returns
    -------
    dict
        ``{"versions", "command", "platform"}``: Python's, NumPy's, SciPy's and pycore's versions
        (and torch's, timm's, pandas' and matplotlib's when imported), ``sys.argv``, the platform.

    Examples
    --------
    >>> from pycore.report import environment
    >>> env = environment()
    >>> sorted(env), {"numpy", "scipy", "pycore"} <= set(env["versions"])
    (['command', 'platform', 'versions'], True)
    """
    import scipy

    from pycore import __version__

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scipy": scipy.__version__,
    }
    for mod in ("torch", "timm", "pandas", "matplotlib"):
        if mod in sys.modules:
            versions[mod] = getattr(sys.modules[mod], "__version__", "?")
    versions["pycore"] = __version__
    return {
        "versions": versions,
        "command": [Path(sys.executable).name] + sys.argv,
        "platform": platform.platform(),
    }


# Strict JSON has no NaN or infinity, yet an infinite RIR ceiling is an answer: every results.json
# spells non-finite floats as these strings, and read_json turns them back into floats.
NONFINITE = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
# A string value that reads like one of them (a column named "NaN"), or starts with this mark, is
# written with the mark in front and read back without it: every value survives a round trip.
# The mark is U+0000, which no string of an older file began with (argv, paths and CSV headers
# cannot hold it), so older files read as they always did.
STRING_MARK = "\x00"


def to_json(obj):
    """``obj`` as strict JSON values.

    A result object → its ``to_dict()``, NumPy → Python, paths → str, tuples → lists, non-finite
    floats → strings, a string that reads like one of those (or starts with :data:`STRING_MARK`) →
    marked.
    """
    if callable(getattr(obj, "to_dict", None)):
        return to_json(obj.to_dict())
    if isinstance(obj, Mapping):
        return {(k if isinstance(k, str) else str(to_json(k))): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_json(obj.tolist())
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        return (
            x
            if math.isfinite(x)
            else "NaN"
            if math.isnan(x)
            else ("Infinity" if x > 0 else "-Infinity")
        )
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, str):
        return STRING_MARK + obj if obj in NONFINITE or obj.startswith(STRING_MARK) else obj
    if obj is None:
        return obj
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def from_json(obj):
    """The inverse of :func:`to_json` for non-finite floats and marked strings.

    Inverse of :func:`to_json` for the non-finite floats (``"Infinity"`` → ``inf`` etc.) and
    the strings it marked (:data:`STRING_MARK`).
    """
    if isinstance(obj, dict):
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if isinstance(obj, str):
        if obj in NONFINITE:
            return NONFINITE[obj]
        if obj.startswith(STRING_MARK):
            return obj[len(STRING_MARK) :]
    return obj


def dumps_json(obj, **kw) -> str:
    """``obj`` as a strict JSON string (:func:`to_json`: non-finite floats as marked strings).

    Parameters
    ----------
    obj : object
        A result object (its ``to_dict()``), NumPy values, paths, containers of those.
    **kw
        ``json.dumps``'s options (``indent``, ``sort_keys``, ...).

    Returns
    -------
    str
        The JSON text, with no NaN or Infinity literal.

    Examples
    --------
    >>> from pycore.report import dumps_json
    >>> dumps_json({"ceiling": float("inf"), "rir": 2.5})
    '{"ceiling": "Infinity", "rir": 2.5}'
    """
    return json.dumps(to_json(obj), allow_nan=False, **kw)


def write_json(path: Path, obj) -> None:
    """``obj`` as strict JSON, via a temporary file renamed into place (never half a file).

    Non-finite floats are the strings ``"Infinity"``, ``"-Infinity"``, ``"NaN"`` (:func:`read_json`
    reads them back as floats).

    Parameters
    ----------
    path : path
        The file.
    obj : object
        A result object (its ``to_dict()``), NumPy values, paths, containers of those.

    Returns
    -------
    None

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from pycore.report import read_json, write_json
    >>> folder = tempfile.TemporaryDirectory()
    >>> path = pathlib.Path(folder.name) / "results.json"
    >>> write_json(path, {"ceiling": float("inf"), "rir": 2.5})
    >>> '"Infinity"' in path.read_text(), read_json(path)
    (True, {'ceiling': inf, 'rir': 2.5})
    >>> folder.cleanup()
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(dumps_json(obj, indent=2) + "\n")
    tmp.replace(path)


def read_json(path: Path):
    """A ``results.json`` back, with ``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` as floats.

    Parameters
    ----------
    path : path
        A file :func:`write_json` wrote.

    Returns
    -------
    object
        The JSON values, non-finite floats restored.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from pycore.report import read_json
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = pathlib.Path(folder) / "results.json"
    ...     _ = path.write_text('{"values": [1.0, "NaN"], "ceiling": "Infinity"}')
    ...     read_json(path)
    {'values': [1.0, nan], 'ceiling': inf}
    """
    return from_json(json.loads(Path(path).read_text()))


def _is_terminal(stream) -> bool:
    """Whether ``stream`` is an open terminal.

    False for a closed stderr (``2>&-`` makes ``sys.stderr`` None) or a closed file.
    """
    try:
        return stream is not None and bool(stream.isatty())
    except (ValueError, OSError):
        return False


def progress(iterable=None, **kw):
    """A tqdm progress bar that stays silent when stderr is not a terminal (CI, pipes).

    Parameters
    ----------
    iterable : iterable, optional
        What the bar iterates over.
    **kw
        tqdm's options; ``disable`` defaults to "stderr is not a terminal" and ``leave`` to False.

    Returns
    -------
    tqdm.tqdm
        The bar.
    """
    from tqdm.auto import tqdm

    kw.setdefault("disable", not _is_terminal(sys.stderr))
    kw.setdefault("leave", False)
    return tqdm(iterable, **kw)


def save_figure(fig, path: Path, dpi: int = 120, rect=None) -> None:
    """``tight_layout`` (within ``rect``), save (creating the folder) and close the figure.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        The figure.
    path : path
        The file; its folder is created.
    dpi : int, default 120
        Resolution.
    rect : tuple of float, optional
        ``tight_layout``'s rectangle.

    Returns
    -------
    None

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")  # no display needed
    >>> import pathlib, tempfile
    >>> import matplotlib.pyplot as plt
    >>> from pycore.report import save_figure
    >>> folder = tempfile.TemporaryDirectory()
    >>> fig, ax = plt.subplots()
    >>> _ = ax.plot([0, 1], [1, 0])
    >>> save_figure(fig, pathlib.Path(folder.name) / "plots" / "line.png")
    >>> (pathlib.Path(folder.name) / "plots" / "line.png").exists(), plt.fignum_exists(fig.number)
    (True, False)
    >>> folder.cleanup()
    """
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
