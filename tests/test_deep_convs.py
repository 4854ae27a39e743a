"""A convolution whose output is one position, computed as a matrix product
(pycore/deep/_convs.py; docs/design.md §6): the same values and gradients as ``nn.Conv2d`` for
every geometry, the product taken exactly where the output is 1×1, nothing else about the
module changed."""

import copy
import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional

from pycore.deep import create_model
from pycore.deep._convs import OnePositionConv2d, one_position_convs

GEOMETRIES = [
    (k, p, s, h, w)
    for k, p, s, h, w in itertools.product((1, 3, 5), (0, 1, 2), (1, 2, 3), (1, 2, 4), (1, 2, 5))
    if h + 2 * p >= k and w + 2 * p >= k
]


@pytest.fixture
def products(monkeypatch):
    """The matrix products ``F.linear`` computed: one per convolution that took the product (and
    one per linear layer)."""
    calls, real = [], functional.linear

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(functional, "linear", spy)
    return calls


def _grads(conv, x, g):
    out = conv(x)
    return (out, *torch.autograd.grad(out, (x, *conv.parameters()), g))


@pytest.mark.parametrize("k, p, s, h, w", GEOMETRIES)
def test_values_and_gradients_are_the_convolutions(products, k, p, s, h, w):
    gen = torch.Generator().manual_seed(k * 1000 + p * 100 + s * 10 + h + w)
    conv = nn.Conv2d(4, 6, k, stride=s, padding=p).double()
    x = torch.randn(3, 4, h, w, dtype=torch.float64, generator=gen, requires_grad=True)
    plain = _grads(conv, x, g := torch.randn(conv(x).shape, dtype=torch.float64, generator=gen))
    fast = one_position_convs(copy.deepcopy(conv))
    fast_grads = _grads(fast, x, g)
    assert bool(products) == (plain[0].shape[-2:] == (1, 1))  # the product where one position
    for a, b in zip(fast_grads, plain):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_taps_that_read_padding_get_an_exact_zero_gradient(products):
    conv = one_position_convs(nn.Conv2d(8, 5, 3, padding=1))
    x = torch.randn(4, 8, 1, 1)
    conv(x).square().sum().backward()
    assert len(products) == 1
    grad = conv.weight.grad
    assert grad[:, :, 1, 1].abs().min() > 0
    grad[:, :, 1, 1] = 0
    assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(4, 4, 3, padding=1, stride=3, groups=2),
        nn.Conv2d(4, 4, 3, padding=2, stride=5, dilation=2),
        nn.Conv2d(4, 4, 3, padding=1, stride=3, padding_mode="reflect"),
        nn.Conv2d(4, 4, 3, padding="valid"),
    ],
    ids=["groups", "dilation", "reflect", "valid"],
)
def test_other_settings_take_the_plain_convolution(products, conv):
    fast = one_position_convs(copy.deepcopy(conv))
    x = torch.randn(2, 4, 3, 3)
    assert conv(x).shape[-2:] == (1, 1)
    assert torch.equal(fast(x), conv(x)) and not products


def test_a_network_keeps_its_parameters_and_outputs(products):
    net = create_model("resnet10t", 3, seed=0, img_size=32).double().eval()
    fast = one_position_convs(copy.deepcopy(net))
    assert fast.state_dict().keys() == net.state_dict().keys()
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in fast.state_dict().items())
    convs = [m for m in fast.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(type(m) is OnePositionConv2d for m in convs)
    # at 32 px the last stage's maps are 1×1: the product is taken there
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    expected = net(x)
    products.clear()  # the plain network's classifier
    torch.testing.assert_close(fast(x), expected, rtol=1e-10, atol=1e-12)
    assert len(products) == 3 + 1  # layer4: its block's two and the shortcut; the classifier


def test_subclasses_of_conv2d_are_left_alone():
    class Own(nn.Conv2d):
        pass

    own = Own(2, 2, 3, padding=1)
    one_position_convs(nn.Sequential(own))
    assert type(own) is Own
