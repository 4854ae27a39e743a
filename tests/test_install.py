"""The installed environment (docs/design.md §5): declared dependencies, the pins, the wheel's
contents (the library; the torchvision hook only where torchvision's own import fails), ``import
timm`` with nothing imported first, nothing outside pip's record; the experiments, not installed,
run from the checkout.
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
HOOK = "_model_immunization_torchvision"
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


@pytest.mark.parametrize("hook", [False, True], ids=["without-hook", "with-hook"])
def test_the_wheel_holds_the_library_and_the_hook_only_when_asked(tmp_path, hook):
    """The wheel of a checkout (``experiments/`` in it) holds ``pycore`` alone: ``experiments`` is
    not installed; with PYCORE_TORCHVISION_HOOK=1 (what scripts/install.sh sets where
    torchvision's own import fails) also the hook and its ``.pth``."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE, "tests", "docs"))
    env = {
        **os.environ,
        "PYCORE_NO_EXTENSION": "1",  # the op's build is not what this checks
        "PYCORE_TORCHVISION_HOOK": str(int(hook)),
    }
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        + ["--no-index", str(src), "-w", str(tmp_path / "wheel")],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    hook_files = {f"{HOOK}.py", "model_immunization_torchvision.pth"}
    assert top - {n for n in top if n.endswith(".dist-info")} == {"pycore"} | (
        hook_files if hook else set()
    )


# ---------------------------------------------------------------- the torchvision hook


def _hook_needed(cwd: Path, path: Path | None = None) -> bool:
    """What scripts/install.sh asks: does torchvision fail to import here without the hook?
    ``path``: a folder put first on the import path."""
    env = {**BARE_ENV, **({"PYTHONPATH": str(path)} if path else {})}
    out = subprocess.run(
        [sys.executable, str(ROOT / f"{HOOK}.py"), "--needed"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return out.returncode == 0


def test_the_hook_is_needed_only_where_torchvision_fails_to_import(tmp_path):
    for failing in (False, True):
        stub = tmp_path / str(failing) / "torchvision"
        stub.mkdir(parents=True)
        body = "raise RuntimeError('operator torchvision::nms does not exist')" if failing else ""
        (stub / "__init__.py").write_text(body + "\n")
        assert _hook_needed(tmp_path, stub.parent) is failing


def test_import_timm_works_with_nothing_imported_first(tmp_path):
    """`import timm` works in a fresh interpreter whose start imported no torch; the hook is
    installed exactly where torchvision's own import fails, and there it defined the two
    schemas."""
    _installed()
    code = (
        "import importlib.util, sys\nstart = 'torch' in sys.modules\n"
        f"hook = importlib.util.find_spec({HOOK!r}) is not None\n"
        "import timm, torch\n"
        "m = timm.create_model('resnet10t', num_classes=2)\ntorch.ops.torchvision.nms\n"
        f"shim = hook and sys.modules[{HOOK!r}].LIBRARY is not None\n"
        "print(start, hook, shim)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=BARE_ENV
    )
    assert out.returncode == 0, out.stderr[-2000:]
    start, hook, shim = out.stdout.split()
    needed = str(_hook_needed(tmp_path))
    assert start == "False" and hook == needed and shim == needed


def test_the_hook_defines_nothing_where_the_schemas_exist():
    import importlib.util

    import torch
    import torchvision  # noqa: F401  (the schemas exist from here on: torchvision's own, or the hook's)

    spec = importlib.util.spec_from_file_location(
        "hook_copy", ROOT / "_model_immunization_torchvision.py"
    )
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # a fresh copy of the hook, after torchvision
    assert hook.TorchvisionFinder not in sys.meta_path  # torchvision imported already: no finder
    hook.ensure_torchvision_ops()
    assert hook.LIBRARY is None and torch.ops.torchvision.nms is not None
    assert hook.TorchvisionFinder.find_spec("numpy") is None  # any other import: nothing found


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
        ("import timm", ""),
        ("import pycore.ops as o; print(o.extension_available())", "True"),
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
    hook = subprocess.run(
        [str(py), "-c", f"import importlib.util as u; print(u.find_spec({HOOK!r}) is not None)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    needed = subprocess.run(
        [str(py), f"{HOOK}.py", "--needed"], cwd=src, env=env, capture_output=True
    ).returncode
    assert hook.stdout.strip() == str(needed == 0)  # installed exactly where needed
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
