"""Models (pycore/deep/_models.py): copies and eval-mode training of models that cache attention
biases (timm's LeViT family), LeViT's distilled heads as one linear head. The models the library
accepts: tests/test_deep_api.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from pycore import ParameterError
from pycore.deep import ImmunizedNet, create_model, load_model, save_model
from pycore.deep._operators import attack_copy

torch.set_num_threads(1)


@pytest.fixture
def levit():
    return create_model("levit_128s", 2, seed=0, img_size=32).eval()


def test_a_levit_that_cached_its_biases_with_gradients_is_copied(levit):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    levit(x).sum().backward()  # eval mode with gradients: a cached bias that is no graph leaf
    copy = attack_copy(levit, 2, seed=0).net  # the attacker's copy of the network
    with torch.no_grad():
        assert torch.allclose(copy(x), levit(x), rtol=0, atol=1e-5)  # LeViT heads fused


def test_a_levit_trained_in_eval_mode_reads_its_biases_as_they_are(levit):
    """Two Adam steps in eval mode (the library's attackers and tail training): the second
    backward runs, and the trained model gives the logits of a fresh model with its weights."""
    m = ImmunizedNet(levit).eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.tensor([0, 1, 0, 1])
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    fresh = ImmunizedNet(create_model("levit_128s", 2, seed=1, img_size=32)).eval()
    fresh.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.allclose(m(x), fresh(x), rtol=0, atol=1e-6)


def test_levit_distilled_heads_are_one_linear_head_with_the_same_logits(tmp_path):
    """LeViT's classifier is a pair of BatchNorm + Linear heads on the same pre-logits: folded
    into the one linear head the layer feeds, its logits are the model's own; a DeiT distilled
    pair (two tokens) is refused naming the model."""
    net = create_model("levit_128s", 3, seed=0, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = net(x)
        wrapped = ImmunizedNet(copy.deepcopy(net)).eval()
        assert isinstance(wrapped.classifier, torch.nn.Linear)
        torch.testing.assert_close(wrapped(x), own, rtol=1e-5, atol=1e-5)
        path = save_model(wrapped, tmp_path / "levit.safetensors")
        torch.testing.assert_close(load_model(path)[0](x), own, rtol=1e-5, atol=1e-5)
        torch.save(net.state_dict(), tmp_path / "plain.pt")  # timm's own keys
        plain = load_model(tmp_path / "plain.pt", "levit_128s", img_size=64)[0]
        torch.testing.assert_close(plain(x), own, rtol=1e-5, atol=1e-5)
    with pytest.raises(ParameterError) as e:
        ImmunizedNet(create_model("deit_tiny_distilled_patch16_224", 2, seed=0))
    assert e.value.parameter == "model"
