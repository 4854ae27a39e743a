"""The installed environment (docs/design.md §5): declared dependencies, the pins, the wheel's
contents (the library alone: no start-up hook), ``import timm`` after ``pycore.deep`` in an
interpreter that processed no ``.pth`` file, nothing outside pip's record; the experiments, not
installed, run from the checkout.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "model-immunization"
# Top-level names in site-packages that belong to this project (the import packages, the
# distribution's
# metadata, its editable-install hooks, the torchvision hook and its .pth, an old install's hook).
OURS = (
    "pycore",
    "pycore-*",
    "pycore.*",
    "_pycore*",
    "experiments",
    "model_immunization*",
    "_model_immunization*",
    "__editable__*model_immunization*",
    "__editable__*pycore*",
)
RUNTIME = {"numpy", "scipy", "threadpoolctl", "pandas", "matplotlib", "tqdm"}
DEEP = {"torch", "torchvision", "timm", "safetensors"}
# A copy of the checkout: what is neither source nor needed to build.
NOT_SOURCE = (
    ".venv",
    ".git",
    "build",
    "results",
    "*.so",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
)
BARE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()


def _recorded(site: Path) -> tuple[set[Path], dict[str, set[Path]]]:
    """Every file that a distribution installed in ``site`` lists in its RECORD, and the same per
    distribution; the ``__pycache__`` files pip removes with a recorded top-level module count
    too."""
    per_dist: dict[str, set[Path]] = {}
    for dist in md.distributions(path=[str(site)]):
        files = {Path(os.path.normpath(site / f)) for f in dist.files or ()}
        files |= {
            c
            for p in files
            if p.suffix == ".py" and p.parent == site
            for c in (site / "__pycache__").glob(p.stem + ".*.pyc")
        }
        per_dist[_name(dist.metadata["Name"] or "").replace("_", "-")] = files
    return set().union(*per_dist.values()) if per_dist else set(), per_dist


def unrecorded(site: Path) -> list[str]:
    """What lies in ``site`` outside pip's record: a top-level .pth or module no distribution
    lists, or any file of this project's names not listed by this project's distribution."""
    everything, per_dist = _recorded(site)
    ours_recorded = per_dist.get(DIST, set())
    problems = []
    for entry in sorted(site.iterdir()):
        if entry.is_file() and entry.suffix in (".pth", ".py") and entry not in everything:
            problems.append(f"{entry.name}: in no distribution's RECORD")
        if any(fnmatch.fnmatch(entry.name, pat) for pat in OURS):
            files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
            problems += [
                f"{p.relative_to(site)}: not in {DIST}'s RECORD"
                for p in files
                if p not in ours_recorded
            ]
    pycache = site / "__pycache__"
    if pycache.is_dir():
        problems += [
            f"__pycache__/{p.name}: cache of an unrecorded module"
            for p in pycache.iterdir()
            if any(fnmatch.fnmatch(p.name, pat) for pat in OURS) and p not in everything
        ]
    return problems


def _installed():
    try:
        return md.distribution(DIST)
    except md.PackageNotFoundError:
        pytest.skip(f"{DIST} is not installed here (a checkout run with PYTHONPATH=.)")


# ---------------------------------------------------------------- metadata and pins


def test_installed_metadata_lists_the_dependencies():
    # What `pip show model-immunization` prints as Requires comes from this metadata.
    requires = md.requires(_installed().metadata["Name"]) or []
    core = {_name(r) for r in requires if "extra ==" not in r}
    deep = {_name(r) for r in requires if re.search(r"extra\s*==\s*['\"]deep['\"]", r)}
    assert RUNTIME <= core, f"runtime dependencies missing from the metadata: {RUNTIME - core}"
    assert DEEP <= deep, f"the deep extra lacks {DEEP - deep}"
    assert _installed().metadata["Requires-Python"] == ">=3.10"


# ---------------------------------------------------------------- the wheel


def test_the_wheel_holds_the_library_alone(tmp_path):
    """The wheel of a checkout (``experiments/`` in it) holds ``pycore`` and its metadata: no
    ``experiments``, no ``.pth`` file, no other top-level module, nothing that runs at interpreter
    start."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE, "tests", "docs"))
    env = {**os.environ, "PYCORE_NO_EXTENSION": "1"}  # the op's build is not what this checks
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--no-index", str(src), "-w", str(tmp_path / "wheel")],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top - {n for n in top if n.endswith(".dist-info")} == {"pycore"}
    assert not [n for n in names if n.endswith(".pth")]


# ---------------------------------------------------------------- torchvision beside the CPU torch


def _bare(code: str, cwd: Path, *first: Path) -> subprocess.CompletedProcess:
    """``code`` in an interpreter that processed no ``.pth`` file (``python -S``): this checkout,
    then site-packages, on the import path (``first`` before them)."""
    site = Path(md.distribution("torch").locate_file("")).resolve()
    path = os.pathsep.join(map(str, (*first, ROOT, site)))
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=cwd,
        env={**BARE_ENV, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_import_timm_works_after_pycore_deep_with_no_start_up_hook(tmp_path):
    """No ``.pth`` ran: ``import pycore.deep`` imports no torch before it is needed and makes
    ``import timm`` work; the schemas are defined by pycore only where torchvision's own library
    could not load."""
    code = (
        "import sys\nimport pycore\nstart = 'torch' in sys.modules\n"
        "import pycore.deep, timm, torch\n"
        "m = timm.create_model('resnet10t', num_classes=2)\ntorch.ops.torchvision.nms\n"
        "print(start, pycore.deep._torchvision.LIBRARY is not None)"
    )
    out = _bare(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    start, defined = out.stdout.split()
    alone = _bare("import torchvision", tmp_path)  # torchvision's own import, no pycore
    assert start == "False" and defined == str(alone.returncode != 0)


def test_the_schemas_are_defined_only_where_torchvision_cannot_load_its_library(tmp_path):
    # a torchvision whose _C library is not loadable and that needs the schemas at import
    broken = tmp_path / "broken" / "torchvision"
    broken.mkdir(parents=True)
    (broken / "_C.so").write_bytes(b"not a shared library")
    (broken / "__init__.py").write_text("import torch\ntorch.ops.torchvision.nms\n")
    # the module alone (pycore.deep would import timm, which needs more of torchvision)
    load = (
        "import importlib.util as u\n"
        f"s = u.spec_from_file_location('t', {str(ROOT / 'pycore/deep/_torchvision.py')!r})\n"
        "t = u.module_from_spec(s)\ns.loader.exec_module(t)\n"
    )
    code = load + "import torchvision\nprint(t.LIBRARY is not None)"
    out = _bare(code, tmp_path, broken.parent)
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-2000:]
    # a torchvision with no library to load: nothing is defined, its own import says why
    code = load + "import torch\nprint(t.LIBRARY)\ntorch.ops.torchvision.nms"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "torchvision.py").write_text("raise ImportError('no torchvision here')\n")
    out = _bare(code, tmp_path, empty)
    assert out.stdout.split() == ["None"] and out.returncode != 0


def test_nothing_is_defined_once_torchvision_is_imported():
    import torch
    import torchvision  # noqa: F401  (the schemas exist from here on)

    from pycore.deep import _torchvision

    before = _torchvision.LIBRARY
    _torchvision.ensure_torchvision_ops()
    assert _torchvision.LIBRARY is before and torch.ops.torchvision.nms is not None


# ---------------------------------------------------------------- nothing outside pip's record


def test_install_wrote_nothing_outside_pips_record():
    dist = _installed()
    site = Path(dist.locate_file("")).resolve()
    if sys.prefix == sys.base_prefix:
        pytest.skip("not a virtual environment: site-packages is shared with system packages")
    problems = unrecorded(site)
    assert not problems, f"{site} holds files outside pip's record:\n" + "\n".join(problems)
    assert _recorded(site)[1].get(DIST), f"{DIST}'s RECORD is empty"


@pytest.mark.slow
def test_fresh_venv_install_then_uninstall_leaves_no_trace(tmp_path):
    """The README's set-up in a new venv: `python -c "import timm"` works, and after `pip
    uninstall` no file of ours remains. Minutes (the install, the C++ build), hence slow; the fast
    variant: this venv."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # A checkout of its own, so the editable install and the build do not touch this one.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    run = subprocess.run(
        ["bash", "scripts/install.sh"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for code, out in (
        ("import pycore.deep, timm", ""),
        ("import pycore._ops as o; print(o.extension_available())", "True"),
        ("import importlib.util as u; print(u.find_spec('experiments'))", "None"),
    ):
        ok = subprocess.run(
            [str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert ok.returncode == 0 and ok.stdout.strip() == out, ok.stderr[-2000:]
    # the scripts run from the checkout, as files and as modules
    for cmd in (["experiments/mnist.py"], ["-m", "experiments.mnist"]):
        usage = subprocess.run(
            [str(py), *cmd, "--seeds", "4-2"], cwd=src, env=env, capture_output=True, text=True
        )
        assert usage.returncode == 2 and "--seeds" in usage.stderr, usage.stderr[-2000:]
    pths = [p.name for p in site.glob("*.pth") if re.search(r"pycore|immuniz", p.read_text())]
    assert pths == [p for p in pths if p.startswith("__editable__")]  # pip's editable finder only
    check = (
        "import json, pathlib, tests.test_install as t; "
        f"print(json.dumps(t.unrecorded(pathlib.Path({str(site)!r}))))"
    )
    listed = subprocess.run(
        [str(py), "-c", check], cwd=src, env=env, capture_output=True, text=True
    )
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], (
        listed.stdout + listed.stderr[-2000:]
    )

    subprocess.run([str(py), "-m", "pip", "uninstall", "--quiet", "-y", DIST], env=env, check=True)
    left = [p.name for p in site.iterdir() if any(fnmatch.fnmatch(p.name, pat) for pat in OURS)]
    left += [
        p.name
        for p in site.glob("*.pth")
        if re.search(r"pycore|model_immunization", p.read_text())
    ]
    left += [
        p.name
        for p in (site / "__pycache__").glob("*")
        if re.search(r"pycore|immunization", p.name)
    ]
    assert not left, f"left in site-packages after pip uninstall: {left}"
    gone = subprocess.run(
        [str(py), "-c", "import pycore"], cwd=tmp_path, env=env, capture_output=True
    )
    assert gone.returncode != 0, "pycore still importable after pip uninstall"


def test_install_has_numpy_before_it_builds_the_op(tmp_path):
    """torch imports numpy while the op builds (without it: "Failed to initialize NumPy"): every
    pip call of scripts/install.sh, recorded by a stand-in ``python``, installs numpy no later
    than the call that builds the op (``--no-build-isolation``)."""
    log, bin_dir = tmp_path / "calls", tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], env=env, check=True)
    calls = [c.split() for c in log.read_text().splitlines() if " install " in f" {c} "]
    build = next(i for i, c in enumerate(calls) if "--no-build-isolation" in c)
    assert any("numpy" in c for c in calls[:build]), calls


def test_scripts_run_from_the_checkout_as_files_and_as_modules(tmp_path):
    """No PYTHONPATH and no installed ``experiments``: ``python -m experiments.X`` from the root
    and ``python experiments/X.py`` from any folder run this checkout's code (the traceback that
    --debug prints shows the file that raised)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cmd, cwd in (
        (["-m", "experiments.mnist"], ROOT),
        ([str(ROOT / "experiments" / "mnist.py")], tmp_path),
    ):
        proc = subprocess.run(
            [sys.executable, *cmd, "--seeds", "4-2", "--debug"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "--seeds" in proc.stderr.splitlines()[-1]
        assert str(ROOT / "experiments" / "flags.py") in proc.stderr
