"""``import torchvision`` (hence ``import timm``) beside a CPU-only torch (docs/design.md §5).

Imported first by :mod:`pycore.deep`, before anything imports timm; nothing else in the
interpreter is changed, and nothing runs at interpreter start. PyPI's torchvision 0.28 ships a
CUDA build of its ``_C`` library that cannot load beside the CPU torch 2.13 wheel; torchvision then
fails on its meta registrations ("operator torchvision::nms does not exist"). Only in that case are
the two schemas it needs (``nms``, ``qnms``) defined; timm never calls them. Where torchvision is
absent, already imported, or its library loads, nothing is defined. A failure here is swallowed:
torchvision's own import then reports what is wrong.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
LIBRARY = None  # the torch.library.Library that defines SCHEMAS (kept alive), or None


def _nms_defined(torch) -> bool:
    try:
        torch.ops.torchvision.nms  # noqa: B018  (the attribute lookup is the test)
    except (AttributeError, RuntimeError):
        return False
    return True


def ensure_torchvision_ops() -> None:
    """Define torchvision's ``nms``/``qnms`` schemas iff its own ``_C`` library cannot load."""
    global LIBRARY
    if LIBRARY is not None or "torchvision" in sys.modules:
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    if _nms_defined(torch):
        return
    for path in (
        p for d in spec.submodule_search_locations for p in glob.glob(os.path.join(d, "_C*.so"))
    ):
        try:
            torch.ops.load_library(path)
        except OSError:
            continue
        if _nms_defined(torch):
            return
    lib = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        lib.define(schema)
    LIBRARY = lib


try:
    ensure_torchvision_ops()
except Exception:  # noqa: BLE001, S110  (torchvision's own import then says what is wrong)
    pass
