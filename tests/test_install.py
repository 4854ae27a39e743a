"""The installed environment: a bare ``import timm`` works through the .pth import hook
(pycore/deep/_torchvision_hook.py, docs/design.md §5), without importing torch at start-up."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "pycore" / "deep" / "_torchvision_hook.py"


def _site_with_hook(tmp_path: Path) -> Path:
    # What scripts/install.sh writes into site-packages, in a throw-away site directory.
    site = tmp_path / "site"
    site.mkdir()
    (site / "_pycore_torchvision_hook.py").write_text(HOOK.read_text())
    (site / "_pycore_torchvision_hook.pth").write_text("import _pycore_torchvision_hook\n")
    return site


def _run(code: str, tmp_path: Path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)


def test_install_script_writes_the_hook():
    script = (ROOT / "scripts" / "install.sh").read_text()
    assert "pycore/deep/_torchvision_hook.py" in script
    assert 'echo "import _pycore_torchvision_hook" > "$site/_pycore_torchvision_hook.pth"' in script


def test_bare_import_timm_works_with_the_hook_and_startup_stays_torch_free(tmp_path):
    site = _site_with_hook(tmp_path)
    code = (f"import site, sys\nsite.addsitedir({str(site)!r})\n"
            "assert 'torch' not in sys.modules and 'torchvision' not in sys.modules, 'hook imported torch'\n"
            "import timm\nimport torch\n"
            "torch.ops.torchvision.nms\n"          # the schema exists (real library or shim)
            "m = timm.create_model('resnet18', pretrained=False, num_classes=2)\n"
            "print('ok', type(m).__name__)\n")
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok ResNet"


def test_hook_then_pycore_deep_agree_on_the_shim(tmp_path):
    # pycore.deep imported AFTER the hook ran must not raise "torchvision was imported before ...".
    site = _site_with_hook(tmp_path)
    code = (f"import site\nsite.addsitedir({str(site)!r})\nimport torchvision\n"
            "import pycore.deep\nfrom pycore.deep import timm_compat\n"
            "import sys\nhooked = sys.modules['_pycore_timm_compat']\n"
            "print(hooked.shim_installed() == timm_compat.shim_installed())\n")
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


def test_pycore_deep_first_with_the_hook_installed(tmp_path):
    # The order every script and test uses: pycore.deep before torchvision, the hook in place.
    # ensure_torchvision_ops() asks importlib where torchvision is, which fires the hook, which
    # defines the schemas; the shim must then see them instead of defining them a second time
    # ("Only a single TORCH_LIBRARY can be used to register the namespace torchvision").
    site = _site_with_hook(tmp_path)
    code = (f"import site\nsite.addsitedir({str(site)!r})\n"
            "import pycore.deep\nimport timm\nimport torch\ntorch.ops.torchvision.nms\nprint('ok')\n")
    out = _run(code, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
