"""Import hook that makes a bare ``import timm`` / ``import torchvision`` work (docs/design.md §5).

``scripts/install.sh`` copies this file into site-packages as ``_pycore_torchvision_hook.py``
and writes ``_pycore_torchvision_hook.pth`` (one line: ``import _pycore_torchvision_hook``), so
it runs at every interpreter start.  It must stay cheap there: it imports only ``sys`` and
``importlib`` and appends one finder to ``sys.meta_path``.  The first time ``torchvision`` is
imported, the finder removes itself, loads ``pycore/deep/timm_compat.py`` BY PATH (importing the
``pycore`` package would pull in NumPy/SciPy and, for ``pycore.deep``, timm itself) and calls its
``ensure_torchvision_ops()``, which defines the two missing schemas only when torchvision's own
``_C.so`` cannot be loaded.  It then returns None, so the normal finders import torchvision.
Any failure in the hook is swallowed: it must never break an import that would work without it.
"""
import importlib.util
import os
import sys


class _TorchvisionShimFinder:
    """Runs the torchvision shim just before torchvision is imported for the first time."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torchvision":
            return None
        try:
            sys.meta_path.remove(cls)
        except ValueError:
            pass
        try:
            pkg = importlib.util.find_spec("pycore")
            if pkg is None or not pkg.submodule_search_locations:
                return None
            for loc in pkg.submodule_search_locations:
                src = os.path.join(loc, "deep", "timm_compat.py")
                if os.path.isfile(src):
                    spec = importlib.util.spec_from_file_location("_pycore_timm_compat", src)
                    mod = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(mod)
                    sys.modules["_pycore_timm_compat"] = mod
                    mod.ensure_torchvision_ops()
                    break
        except Exception:  # noqa: BLE001 -- never break an import the hook was only meant to help
            pass
        return None


def install() -> None:
    """Add the finder unless torchvision is already imported or the finder is already there."""
    if "torchvision" not in sys.modules and _TorchvisionShimFinder not in sys.meta_path:
        sys.meta_path.insert(0, _TorchvisionShimFinder)


install()
