"""Results as files: strict JSON, θ archives, summaries over seeds, table cells, figures.

The library computes and returns; the experiments write with these (docs/design.md §1).
"""

from pycore._public import publish
from pycore._registry import METHOD_LABELS
from pycore._report import (
    dumps_json,
    environment,
    fmt,
    pm,
    read_json,
    save_figure,
    summarize,
    write_json,
)
from pycore._thetas import load_thetas, save_thetas

__all__ = [
    "METHOD_LABELS",
    "summarize",
    "fmt",
    "pm",
    "environment",
    "save_figure",
    "dumps_json",
    "write_json",
    "read_json",
    "save_thetas",
    "load_thetas",
]
publish(__name__, globals(), __all__)
del publish
