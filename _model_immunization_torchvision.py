"""Lets ``import torchvision`` (hence ``import timm``) work beside a CPU-only torch (docs/design.md
§5).

Installed only where it is needed: ``scripts/install.sh`` runs this file (``python
_model_immunization_torchvision.py --needed``: exit status 0 when torchvision is installed and its
own import fails) and only then builds the model-immunization wheel with it
(``PYCORE_TORCHVISION_HOOK=1``, setup.py), top-level, with ``model_immunization_torchvision.pth``,
whose one line imports this module at interpreter start. All it does then is put a finder at the
front of ``sys.meta_path``; it imports nothing else. On the first ``import torchvision`` the finder
removes itself and checks whether torchvision's own ``_C`` library loads: PyPI's torchvision 0.28
ships a CUDA build of it that cannot load beside the CPU torch 2.13 wheel, and torchvision then
fails on its meta registrations ("operator torchvision::nms does not exist"). Only in that case
are the two schemas it needs (``nms``, ``qnms``) defined; timm never calls them. Where the library
loads, or the schemas exist already, nothing is defined. Any failure here is swallowed: the
finder never makes an import fail that would have worked without it.
"""

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
    import glob
    import importlib.util
    import os

    spec = importlib.util.find_spec("torchvision")
    if LIBRARY is not None or spec is None or not spec.submodule_search_locations:
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


class TorchvisionFinder:
    """Runs :func:`ensure_torchvision_ops` once, when ``torchvision`` is first imported; finds
    nothing."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "torchvision":
            try:
                sys.meta_path.remove(cls)
                ensure_torchvision_ops()
            except Exception:  # noqa: BLE001  (torchvision's own import then reports what is wrong)
                pass
        return None


def needed() -> bool:
    """Whether this environment needs the hook: torchvision is installed and ``import
    torchvision`` fails without the hook (an installed copy of it is taken off first)."""
    import importlib.util

    sys.meta_path[:] = [
        f for f in sys.meta_path if getattr(f, "__name__", None) != TorchvisionFinder.__name__
    ]
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001  (any failure of its own import)
        return True
    return False


if __name__ == "__main__":
    if sys.argv[1:] != ["--needed"]:
        print(f"usage: python {sys.argv[0]} --needed", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if needed() else 1)
elif TorchvisionFinder not in sys.meta_path and "torchvision" not in sys.modules:
    sys.meta_path.insert(0, TorchvisionFinder)
