"""Make ``import timm`` work with a CPU-only torch and PyPI's torchvision 0.28 (docs/design.md §5).

PyPI's torchvision 0.28 wheel ships a CUDA-built ``_C.so``. On a CPU-only torch that library
cannot be loaded, so the ``torchvision::nms`` / ``torchvision::qnms`` schemas that
``torchvision/_meta_registrations.py`` registers fake kernels for are never defined and
``import torchvision`` (hence ``import timm``) dies with ``operator torchvision::nms does not
exist``. Defining the two schemas ourselves -- only when the real library cannot be loaded --
is enough: timm never calls them, and torchvision's detection ops stay unavailable (unused here).

Call :func:`import_timm` (or :func:`ensure_torchvision_ops`) before anything imports
torchvision or timm. ``import pycore.deep`` does it, and every module of this project that needs
timm or torchvision gets them through :func:`import_timm`; nothing is installed into
site-packages to do it at interpreter start (docs/design.md §5). This module imports torch
lazily, inside the functions.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

__all__ = ["ensure_torchvision_ops", "import_timm", "shim_installed"]

# The Library object must outlive the call: dropping it would deregister the schemas.
_LIB = None

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


def _nms_registered() -> bool:
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018  (attribute lookup is the test)
    except (AttributeError, RuntimeError):
        return False
    return True


def shim_installed() -> bool:
    """True when the torchvision schemas had to be defined by this shim."""
    return _LIB is not None


def ensure_torchvision_ops() -> bool:
    """Define ``torchvision::nms``/``qnms`` schemas iff torchvision's own ``_C`` cannot load.

    Returns True when the shim was installed, False when it was not needed (the real library
    loaded, torchvision is absent, or the schemas already exist).
    """
    global _LIB
    import torch

    if _LIB is not None or _nms_registered():
        return _LIB is not None
    if "torchvision" in sys.modules:
        # torchvision got imported before us and is missing its ops: too late to fix cleanly.
        raise ImportError(
            "torchvision was imported before pycore.deep.timm_compat could register the "
            "torchvision::nms schema; import pycore.deep (or call ensure_torchvision_ops()) first"
        )
    spec = importlib.util.find_spec("torchvision")
    # Asking importlib where torchvision is runs every meta-path finder, and one may define the
    # schemas (the import hook of an environment set up by an older scripts/install.sh did): look
    # again before defining them twice ("Only a single TORCH_LIBRARY ...").
    if _nms_registered():
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    libs = [p for loc in spec.submodule_search_locations for p in glob.glob(os.path.join(loc, "_C*.so"))]
    for path in libs:
        try:
            torch.ops.load_library(path)
        except OSError:
            continue
        if _nms_registered():
            return False
    _LIB = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _LIB.define(schema)
    return True


def import_timm():
    """Import and return :mod:`timm` after :func:`ensure_torchvision_ops`."""
    ensure_torchvision_ops()
    import timm  # noqa: PLC0415  (deliberately late: the shim must come first)

    return timm
