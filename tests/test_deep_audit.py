"""The audit command (experiments/audit.py, docs/deep.md "Auditing a model") at CI size."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub (via timm)

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import pycore.deep  # noqa: E402,F401  (installs the torchvision shim before timm)
from pycore.deep import build_model, save_immunized  # noqa: E402
from pycore.deep.models import CheckpointError, load_extractor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(1)

FAST = ["--per-digit", "30", "--epochs", "5", "--threads", "1", "--quiet"]


@pytest.fixture(scope="module")
def extractors(tmp_path_factory):
    """θ₀ and an immunized, hardened extractor exported by the demo pipeline at CI size."""
    from experiments import deepnet
    out = tmp_path_factory.mktemp("deep")
    assert deepnet.main(["--config", "ci", "--methods", "ours", "--out", str(out), "--quiet",
                         "--threads", "1"]) == 0
    folder = out / "ci"
    return {"init": folder / "extractor_init.safetensors",
            "ours": folder / "extractor_ours+label_subspace.safetensors",
            "results": json.loads((folder / "results.json").read_text())}


def _audit(argv, capsys=None):
    from experiments import audit
    rc = audit.main(argv)
    err = capsys.readouterr().err if capsys is not None else ""
    return rc, err


def test_audit_of_theta0_against_itself_is_exactly_neutral(extractors, tmp_path):
    rc, _ = _audit(["--model", str(extractors["init"]), "--reference", str(extractors["init"]),
                    "--out", str(tmp_path / "a"), *FAST])
    assert rc == 0
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    m, r = res["rows"]["model"], res["rows"]["init"]
    assert m["rir_theta0"]["per_seed"] == [1.0] and m["harmful_ratio"]["per_seed"] == [1.0]
    assert m["immunized_count"] == 0
    for attacker in ("gd", "adam", "adam_whitened", "finetune"):               # no slow-down at all
        assert m["attacks"][attacker]["curve"]["mean"] == r["attacks"][attacker]["curve"]["mean"], attacker
    assert m["dp_top1"] == r["dp_top1"]
    assert (tmp_path / "a" / "audit.png").stat().st_size > 1000
    assert "| model − θ₀ | | +0 | +0 | +0 | +0 |" in (tmp_path / "a" / "table.md").read_text()


def test_audit_of_the_exported_extractor_reproduces_the_pipeline(extractors, tmp_path):
    """Same seed, same digits, same extractor: the audit's RIR_θ₀ and D_P top-1 are the demo's."""
    rc, _ = _audit(["--model", str(extractors["ours"]), "--reference", str(extractors["init"]),
                    "--out", str(tmp_path / "b"), "--per-digit", "40", "--epochs", "5", "--threads", "1",
                    "--rir-groups", "4", "--rir-group-size", "40", "--quiet"])
    assert rc == 0
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    pipe = extractors["results"]["per_seed"][0]["rows"]["ours+label_subspace"]
    got = res["per_seed"][0]["rows"]["model"]
    # The pipeline measured cached trunk outputs, the audit runs each model end to end: equal up to
    # float32 rounding of the features (κ ratios of up to ~1e4: 1e-4 relative).
    assert got["dp_top1"] == pytest.approx(pipe["dp_top1"], abs=1e-9)
    for k in ("value", "harmful_ratio", "pretrain_ratio"):
        assert got["rir"][k]["per_group"] == pytest.approx(pipe["rir"][k]["per_group"], rel=1e-4), k
    assert res["rows"]["model"]["rir_theta0"]["mean"] != pytest.approx(1.0, abs=1e-6)
    assert {"adam_probe_acc_epoch1", "finetune_acc_epoch5", "immunized_count"} <= set(res["rows"]["model"])


def test_audit_errors_name_the_flag(extractors, tmp_path, capsys):
    vit = build_model("vit_tiny_32px", 5, seed=0)
    vit_path = save_immunized(vit, tmp_path / "vit.safetensors", 5)
    three = save_immunized(build_model("resnet18_32px", 3, seed=0), tmp_path / "three.safetensors", 3)
    from safetensors.torch import save_file
    plain = build_model("resnet18_32px", 5, seed=0).net
    sd = {k: v.contiguous() for k, v in plain.state_dict().items() if not k.startswith("global_pool.1")}
    save_file(sd, str(tmp_path / "plain.safetensors"))
    out = ["--out", str(tmp_path / "o"), *FAST]
    cases = [
        (["--model", vit_path, "--reference", str(extractors["init"])], "--reference", "vit_tiny_32px"),
        (["--model", three, "--reference", three], "--model", "3 outputs"),
        (["--model", str(tmp_path / "plain.safetensors"), "--reference", str(extractors["init"])], "--model",
         "no pycore metadata"),
        (["--model", str(extractors["init"]), "--reference", str(extractors["init"]), "--dp-root",
          str(tmp_path / "missing"), "--dh-root", str(tmp_path)], "--dp-root", "no such folder"),
        (["--model", str(extractors["init"]), "--reference", str(extractors["init"]),
          "--dh-root", str(tmp_path)], "--dp-root", "both"),
    ]
    for argv, flag, text in cases:
        rc, err = _audit([*argv, *out], capsys)
        assert rc == 2 and f"error: {flag}:" in err and text in err and "Traceback" not in err, err
    # a plain timm state dict is audited once its architecture is named (identity layer inserted)
    rc, err = _audit(["--model", str(tmp_path / "plain.safetensors"), "--reference", str(extractors["init"]),
                      "--backbone", "resnet18_32px", *out], capsys)
    assert rc == 0, err


def test_load_extractor_reads_exports_and_plain_timm_weights(tmp_path):
    m = build_model("resnet18_32px", 4, seed=0).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        m.layer.weight.copy_(torch.eye(512) + 0.05 * torch.randn(512, 512, generator=g))
    path = save_immunized(m, tmp_path / "e.safetensors", 4)
    got, meta = load_extractor(path)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(got(x), m(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.features(x), m.features(x), rtol=1e-5, atol=1e-5)
    assert meta["backbone"] == "resnet18_32px" and got.classifier.out_features == 4
    with pytest.raises(CheckpointError, match="not 'vit_tiny_32px'"):
        load_extractor(path, "vit_tiny_32px")
    torch.save(m.net.state_dict(), tmp_path / "layout.pt")        # the exported layout, no metadata
    got2, _ = load_extractor(tmp_path / "layout.pt", "resnet18_32px")
    with torch.no_grad():
        torch.testing.assert_close(got2.features(x), m.features(x), rtol=1e-5, atol=1e-5)
    assert np.isfinite(float(got2.layer.weight.sum()))
