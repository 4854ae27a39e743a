"""Checkpoints (:func:`pycore.deep.load_model`, :func:`pycore.deep.save_model`): what a file may
hold, its metadata checked against its tensors before a network is built, and the tensor and file
an error names."""

from __future__ import annotations

import pickle
import resource

import pytest
import torch
from safetensors.torch import save_file

from pycore import ParameterError
from pycore.deep import CheckpointError, ImmunizedNet, create_model, load_model, save_model
from pycore.deep._checkpoint import CheckpointMismatchError, read_weights
from pycore.deep._models import UnmergedAdaptersError
from tests.helpers import lying_checkpoint

torch.set_num_threads(1)


def test_a_weight_that_overflows_float32_is_refused_naming_tensor_and_file(tmp_path):
    sd = {
        k: v.double() if v.is_floating_point() else v
        for k, v in create_model("resnet10t", 2, seed=0).state_dict().items()
    }
    sd["fc.weight"][0, 0] = 1e300  # finite in the file, inf as float32
    path = tmp_path / "big.pt"
    torch.save(sd, path)
    with pytest.raises(CheckpointError) as e:
        load_model(path, "resnet10t")
    assert (e.value.tensor, e.value.path) == ("fc.weight", str(path))
    again = pickle.loads(pickle.dumps(e.value))  # from a worker process, as itself
    assert (type(again), again.tensor) == (CheckpointError, "fc.weight")
    sd["fc.weight"][0, 0] = 1e30  # within float32: loads
    torch.save(sd, path)
    assert load_model(path, "resnet10t")[0].net.fc.weight[0, 0] == pytest.approx(1e30, rel=1e-6)


def test_a_non_finite_weight_is_refused_naming_tensor_and_file(tmp_path):
    m = ImmunizedNet(create_model("resnet10t", 2, seed=0))
    with torch.no_grad():
        m.layer.weight[1, 2] = float("nan")
    path = save_model(m, tmp_path / "nan.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert (e.value.tensor, e.value.path) == ("layer.weight", path)


def _with_lora(m):
    from peft import LoraConfig, inject_adapter_in_model

    return inject_adapter_in_model(LoraConfig(r=4, target_modules=["fc"]), m)


def test_a_model_with_unmerged_lora_adapters_is_refused_naming_them(tmp_path):
    m = _with_lora(ImmunizedNet(create_model("resnet10t", 2, seed=0)))
    with pytest.raises(UnmergedAdaptersError) as e:
        save_model(m, tmp_path / "lora.safetensors")
    assert e.value.parameter == "model" and e.value.modules == ("fc",)
    assert not (tmp_path / "lora.safetensors").exists()


@pytest.mark.parametrize("kind", ["pycore", "timm"])
def test_a_file_of_unmerged_lora_adapters_is_refused_naming_one(tmp_path, kind):
    if kind == "pycore":
        plain = ImmunizedNet(create_model("resnet10t", 2, seed=0))
        meta = read_weights(save_model(plain, tmp_path / "plain.safetensors"))[1]
        m = _with_lora(plain)
    else:
        m, meta = _with_lora(create_model("resnet10t", 2, seed=0)), None
    path = tmp_path / "lora.safetensors"
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, path, metadata=meta)
    with pytest.raises(CheckpointMismatchError) as e:
        load_model(path, None if kind == "pycore" else "resnet10t")
    adapters = {k for k in m.state_dict() if ".lora_" in k or ".base_layer." in k}
    assert e.value.tensor in adapters and e.value.path == str(path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"depth": 100000},
        {"embed_dim": 99999, "num_heads": 3},
        {"img_size": 100000, "patch_size": 1},
    ],
)
def test_checkpoint_metadata_is_checked_against_its_tensors_before_building(
    tmp_path, monkeypatch, kwargs
):
    """Each of these asks for 5-120 GB: refused naming the file, with no network built off the
    meta device (shapes, no storage) and no memory to speak of."""
    import timm  # after pycore.deep, which lets it import beside a CPU torch (docs/design.md §5)

    path = lying_checkpoint(tmp_path / "evil.safetensors", **kwargs)
    devices, real = [], timm.create_model

    def spy(*args, **kw):
        net = real(*args, **kw)
        devices.append({p.device.type for p in net.parameters()})
        return net

    monkeypatch.setattr(timm, "create_model", spy)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointMismatchError, match="evil.safetensors"):
        load_model(path)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert all(d <= {"meta"} for d in devices) and grown < 200 << 20, devices


def test_save_model_names_a_folder_or_a_model_it_cannot_save(tmp_path):
    import timm  # after pycore.deep (docs/design.md §5)

    net = create_model("test_resnet", 2, seed=0, img_size=32)
    for path in (tmp_path, 3.5):
        with pytest.raises(ParameterError) as e:
            save_model(net, path)
        assert e.value.parameter == "path"
    for model in (timm.create_model("test_resnet", num_classes=2), "resnet18", None):
        with pytest.raises(ParameterError) as e:  # no record of how to rebuild it
            save_model(model, tmp_path / "m.safetensors")
        assert e.value.parameter == "model"
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError) as e:  # its folder would be a file
        save_model(net, tmp_path / "file" / "m.safetensors")
    assert e.value.path == str(tmp_path / "file" / "m.safetensors")


def test_a_plain_model_of_create_model_saves_and_loads_with_its_logits(tmp_path):
    net = create_model("test_resnet", 3, seed=0, img_size=32).eval()
    path = save_model(net, tmp_path / "plain.safetensors")
    back, _ = load_model(path)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(back(x), net(x), rtol=1e-5, atol=1e-6)
    assert back.classifier.out_features == 3 and not hasattr(net, "layer")
