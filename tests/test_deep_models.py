"""Models (pycore/deep/models.py): copies and eval-mode training of models that cache attention
biases (timm's LeViT family), and the models the library accepts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pycore.deep import ImmunizedNet, create_model
from pycore.deep.models import as_immunized, check_model
from pycore.validation import ParameterError

torch.set_num_threads(1)


@pytest.fixture
def levit():
    return create_model("levit_128s", 2, seed=0, img_size=32).eval()


def test_a_levit_that_cached_its_biases_with_gradients_is_copied(levit):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    levit(x).sum().backward()  # eval mode with gradients: a cached bias that is no graph leaf
    copy = as_immunized(levit)
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_check_model_refuses_other_dtypes_naming_the_argument(dtype):
    with pytest.raises(ParameterError) as e:
        check_model(create_model("resnet10t", 2, seed=0).to(dtype), "reference")
    assert e.value.parameter == "reference"


def test_check_model_takes_a_float32_model():
    check_model(create_model("resnet10t", 2, seed=0), "model")
