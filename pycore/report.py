"""Shared plumbing for experiment outputs: summaries, provenance, JSON, quiet progress bars."""
from __future__ import annotations

import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np


def summarize(values) -> dict:
    """``{"mean", "std", "per_seed"}`` with the population std (ddof = 0) over seeds."""
    a = np.asarray(list(values), dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std()), "per_seed": [float(x) for x in a]}


def fmt(x: float, digits: int = 4) -> str:
    """Compact number for tables: 4 significant digits, scientific outside [1e-3, 1e5)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if math.isinf(x):
        return "∞"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    # Round to `digits` significant digits, then print positionally (720, not 7.2e+02).
    return f"{float(f'{x:.{digits}g}'):g}"


def pm(summary: dict, digits: int = 4) -> str:
    """``mean ± std``; a std at round-off level of the mean (deterministic methods: identity, the
    closed form) prints as 0 instead of noise like 3.5e-18."""
    mean, std = summary["mean"], summary["std"]
    if math.isfinite(mean) and std <= 1e-12 * abs(mean):
        std = 0.0
    return f"{fmt(mean, digits)} ± {fmt(std, 2)}"


def environment() -> dict:
    """Versions and the command line, recorded in every results.json."""
    import scipy

    versions = {"python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__}
    for mod in ("torch", "timm", "pandas", "matplotlib"):
        if mod in sys.modules:
            versions[mod] = getattr(sys.modules[mod], "__version__", "?")
    from pycore import __version__

    versions["pycore"] = __version__
    return {"versions": versions, "command": [Path(sys.executable).name] + sys.argv,
            "platform": platform.platform()}


def write_json(path: Path, obj) -> None:
    """JSON with ``Infinity`` allowed (an infinite RIR ceiling is a real answer, not an error)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=True, default=_default))
    tmp.replace(path)  # never leave a half-written results file behind


def _default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def progress(iterable=None, **kw):
    """tqdm that stays silent when stderr is not a terminal (CI, pipes)."""
    from tqdm.auto import tqdm

    kw.setdefault("disable", not sys.stderr.isatty())
    kw.setdefault("leave", False)
    return tqdm(iterable, **kw)


def parse_methods(text: str, choices) -> list[str]:
    """``"ours,imma"`` → ["ours", "imma"]; a ValueError names any method not in ``choices``."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in choices]
    if bad or not methods:
        raise ValueError(f"unknown method(s) {bad or text!r}; choose from {', '.join(choices)}")
    return methods


def parse_seeds(text: str) -> list[int]:
    """``"5"`` → [0..4]; ``"0,3,7"`` → [0, 3, 7]; ``"2-4"`` → [2, 3, 4]."""
    text = text.strip()
    try:
        if "," in text:
            return [int(s) for s in text.split(",") if s.strip()]
        if "-" in text[1:]:
            a, b = text.split("-", 1)
            return list(range(int(a), int(b) + 1))
        n = int(text)
    except ValueError:
        raise ValueError(f"--seeds must be a count (5), a list (0,3,7) or a range (2-4), "
                         f"got {text!r}") from None
    if n < 1:
        raise ValueError(f"--seeds count must be ≥ 1, got {n}")
    return list(range(n))


def finish_experiment(prog: str, args, run, table_markdown, plot=None, plot_name: str | None = None) -> int:
    """The shared ``main()`` of the linear experiments: ``run(args)``, then ``table.md``, the plot
    (unless ``args.no_plot``) and ``results.json`` in ``args.out``, and the table on stdout.

    The errors a user can cause (a missing or malformed data file, a diverging configuration)
    come back as ONE line on stderr with exit status 2, and nothing half-written is left.
    ``results.json`` gets ``wall_seconds_with_plot``: the run plus table and figure.
    """
    try:
        result = run(args)
    except (FileNotFoundError, ValueError, FloatingPointError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    table = table_markdown(result)
    written = [args.out / "results.json", args.out / "table.md"]
    if plot is not None and not args.no_plot:
        plot(result, args.out / plot_name)
        written.append(args.out / plot_name)
    result["wall_seconds_with_plot"] = result["wall_seconds"] + (time.perf_counter() - t0)
    write_json(args.out / "results.json", result)
    (args.out / "table.md").write_text(table)
    print(table)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """``tight_layout``, save (creating the folder) and close, so figures never pile up."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
