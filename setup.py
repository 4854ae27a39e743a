"""The fused C++/CUDA op `pycore._C` (docs/design.md §5); the package metadata is in
pyproject.toml.

    python -m pip install --no-build-isolation -e ".[deep,dev]"  # what scripts/install.sh runs
    python setup.py build_ext --inplace                           # rebuild the op only

Without build isolation the op compiles against the torch already installed, so a CPU-only
machine never downloads CUDA packages.  CUDA sources are compiled only when torch itself was
built with CUDA and a toolkit is found (`CUDA_HOME`); override with the environment variables
PYCORE_NO_CUDA=1 (CPU op only) or PYCORE_FORCE_CUDA=1 (fail loudly if CUDA cannot be built).
PYCORE_NO_EXTENSION=1 installs the pure-Python package (pycore.ops then falls back to PyTorch).

With PYCORE_TORCHVISION_HOOK=1 the wheel (editable or not) also carries, top-level,
``_model_immunization_torchvision.py`` and the ``.pth`` line that imports it at interpreter start,
so pip records both and ``pip uninstall`` removes them. scripts/install.sh sets it only where
torchvision's own import fails beside the installed torch (docs/design.md §5); without it the
wheel holds the package alone.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK = "_model_immunization_torchvision"


class build_py_with_hook(build_py):
    """build_py that also puts the torchvision hook and its ``.pth`` at the root of the wheel when
    PYCORE_TORCHVISION_HOOK=1.

    In an editable build setuptools keeps only the wheel's root folder (``install_lib``) from
    what the build writes, so the two files go there; otherwise into ``build_lib`` as usual."""

    def run(self):
        super().run()
        if not _flag("PYCORE_TORCHVISION_HOOK"):
            return
        root = (
            self.get_finalized_command("install").install_lib
            if getattr(self, "editable_mode", False)
            else self.build_lib
        )
        os.makedirs(root, exist_ok=True)
        self.copy_file(
            os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{HOOK}.py"),
            os.path.join(root, f"{HOOK}.py"),
        )
        with open(os.path.join(root, "model_immunization_torchvision.pth"), "w") as f:
            f.write(f"import {HOOK}\n")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _extensions():
    if _flag("PYCORE_NO_EXTENSION"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import (
            CUDA_HOME,
            BuildExtension,
            CppExtension,
            CUDAExtension,
        )
    except ImportError:
        print(
            "pycore: torch is not importable at build time (pip without --no-build-isolation?); "
            "installing without the C++ op, pycore.ops will use its PyTorch fallback",
            file=sys.stderr,
        )
        return [], {}
    use_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if torch.version.cuda is not None and CUDA_HOME is None and not _flag("PYCORE_NO_CUDA"):
        print(
            f"pycore: torch {torch.__version__} has CUDA {torch.version.cuda} but no "
            "CUDA toolkit was "
            "found (set CUDA_HOME): building the CPU op only; on CUDA tensors "
            "pycore.ops will use its "
            "PyTorch implementation",
            file=sys.stderr,
        )
    if _flag("PYCORE_NO_CUDA"):
        use_cuda = False
    if _flag("PYCORE_FORCE_CUDA"):
        if torch.version.cuda is None or CUDA_HOME is None:
            raise SystemExit(
                f"PYCORE_FORCE_CUDA=1 but torch.version.cuda={torch.version.cuda!r} "
                f"and CUDA_HOME={CUDA_HOME!r}: cannot build the CUDA op"
            )
        use_cuda = True
    sources = ["csrc/cond_reg.cpp"]
    extra = {"cxx": ["-O3", "-g0"]}
    macros = []
    if use_cuda:
        sources += ["csrc/cuda/cond_reg_cuda.cpp", "csrc/cuda/cond_reg_kernels.cu"]
        extra["nvcc"] = ["-O3"]
        macros.append(("WITH_CUDA", None))
        ext_cls = CUDAExtension
    else:
        ext_cls = CppExtension
    ext = ext_cls("pycore._C", sources, extra_compile_args=extra, define_macros=macros)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()

setup(ext_modules=ext_modules, cmdclass={**cmdclass, "build_py": build_py_with_hook})
