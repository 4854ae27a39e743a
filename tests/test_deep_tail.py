"""A network's tail run from the stored input of its first stage (pycore/deep/_tail.py;
docs/design.md §6): the same pre-logits and the same gradients as the whole network, and the
network given back as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from pycore import ParameterError
from pycore.deep import create_model
from pycore.deep._tail import TailRunner, stage_names

torch.set_num_threads(1)

VIT = dict(img_size=32, patch_size=8, depth=3, embed_dim=48, num_heads=2)
NETS = {
    "resnet": lambda: create_model("test_resnet", 3, seed=0).eval(),
    "vit": lambda: create_model("vit_tiny_patch16_224", 3, seed=0, **VIT).eval(),
}
CASES = [("resnet", 1), ("resnet", 2), ("vit", 1), ("vit", 2)]


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 3, 32, 32, generator=g)


def _prelogits(net, x):
    return net.forward_head(net.forward_features(x), pre_logits=True)


@pytest.mark.parametrize("kind,stages", CASES)
def test_the_tail_from_stored_inputs_gives_the_networks_prelogits(kind, stages, images):
    net = NETS[kind]()
    runner = TailRunner(net, stages)
    h = runner.inputs(net, images)
    tail = runner.attach(copy.deepcopy(net), images.shape[1:])
    with torch.no_grad():
        want, got = _prelogits(net, images), _prelogits(tail, h)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        torch.testing.assert_close(tail(h), net(images), rtol=1e-5, atol=1e-5)
    runner.check(net, tail, images)  # the library's own check agrees
    # the earlier stages are gone from the tail: what it computes depends on h alone
    names = stage_names(net)[: len(stage_names(net)) - stages]
    assert names and all(isinstance(tail.net.get_submodule(n), nn.Identity) for n in names)
    with torch.no_grad():
        assert not torch.allclose(_prelogits(tail, torch.zeros_like(h)), got)


@pytest.mark.parametrize("kind,stages", [("resnet", 2), ("vit", 1)])
def test_detach_gives_the_network_back_exactly(kind, stages, images):
    net = NETS[kind]()
    before = dict(net.named_modules())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        want = net(images)
    runner = TailRunner(net, stages)
    h = runner.inputs(net, images)
    tail = runner.attach(net, images.shape[1:])
    assert dict(net.named_modules()) != before  # attached in place
    with torch.no_grad():
        tail(h)
    assert tail.detach() is net
    after = dict(net.named_modules())
    assert after.keys() == before.keys() and all(after[k] is m for k, m in before.items())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    with torch.no_grad():
        assert torch.equal(net(images), want)


@pytest.mark.parametrize("kind,stages", [("resnet", 2), ("vit", 1)])
def test_the_tails_gradients_are_the_whole_networks(kind, stages, images):
    """The loss of the tail from stored inputs and of the whole network from the images have the
    same gradient with respect to every tail parameter (eval mode, as the library trains)."""
    net = NETS[kind]()
    y = torch.arange(len(images)) % 3
    runner = TailRunner(net, stages)
    h = runner.inputs(net, images)
    tail = runner.attach(copy.deepcopy(net), images.shape[1:])
    first = stage_names(net)[len(stage_names(net)) - stages]
    prefix = first + "."
    F = torch.nn.functional
    F.cross_entropy(net(images), y).backward()
    F.cross_entropy(tail(h), y).backward()
    mine = dict(tail.net.named_parameters())
    moved = 0
    for n, p in net.named_parameters():
        if n.startswith(prefix):
            torch.testing.assert_close(mine[n].grad, p.grad, rtol=1e-4, atol=1e-6)
            moved += float(p.grad.abs().max()) > 0
    assert moved >= 4  # (timm zero-initialises some BatchNorm scales: their convs get none)


def test_dataset_holds_every_images_tail_input_and_its_label(images):
    net = NETS["resnet"]()
    runner = TailRunner(net, 1)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    ds = runner.dataset(net, TensorDataset(images, y), batch_size=4)  # two batches
    assert isinstance(ds, TensorDataset) and torch.equal(ds.tensors[1], y)
    torch.testing.assert_close(ds.tensors[0], runner.inputs(net, images), rtol=1e-6, atol=1e-6)
    assert not net.training


class _Skip(nn.Module):
    """Two stages and a skip from the input around both: the tail reads more than its first
    stage's input."""

    feature_info = [{"module": "s1"}, {"module": "s2"}]

    def __init__(self):
        super().__init__()
        self.s1, self.s2, self.fc = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward_features(self, x):
        return self.s2(self.s1(x)) + x

    def forward_head(self, x, pre_logits=False):
        return x if pre_logits else self.fc(x)

    def get_classifier(self):
        return self.fc


def test_a_tail_that_reads_more_than_its_first_stages_input_is_refused():
    net = _Skip().eval()
    runner = TailRunner(net, 1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ParameterError) as e:
        runner.check(net, runner.attach(copy.deepcopy(net), (4,)), x)
    assert e.value.parameter == "model"
    for stages in (0, 3):
        with pytest.raises(ParameterError) as e:
            TailRunner(net, stages)
        assert e.value.parameter == "stages"
