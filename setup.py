"""The fused C++/CUDA op `pycore._C` (docs/design.md §5); the package metadata is in
pyproject.toml.

    python -m pip install --no-build-isolation -e ".[deep,dev]"  # what scripts/install.sh runs
    python setup.py build_ext --inplace                           # rebuild the op only

Without build isolation the op compiles against the torch already installed, so a CPU-only
machine never downloads CUDA packages.  CUDA sources are compiled only when torch itself was
built with CUDA and a toolkit is found (`CUDA_HOME`); override with the environment variables
PYCORE_NO_CUDA=1 (CPU op only) or PYCORE_FORCE_CUDA=1 (fail loudly if CUDA cannot be built).
PYCORE_NO_EXTENSION=1 installs the pure-Python package (pycore.ops then falls back to PyTorch).
The wheel holds the package ``pycore`` alone: nothing else is written to site-packages.
"""

import os
import sys

from setuptools import setup


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

setup(ext_modules=ext_modules, cmdclass=cmdclass)
