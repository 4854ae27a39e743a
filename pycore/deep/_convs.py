"""Convolutions with a single output position, computed as the matrix product they are.

At the demo's 32-pixel inputs a ResNet's last stage runs on 1×1 maps: each of its 3×3
convolutions reads one input position through the centre tap, the other eight taps reading the
zero padding. CPU convolution kernels do not notice; their backward pass costs about ten times a
matrix product of the same operands (docs/design.md §6). :func:`one_position_convs` makes the
convolutions of a network take the product when, for the input at hand, the output is one
position. The values are the convolution's up to float round-off (the sum runs in another
order), and so are the gradients: the taps that read padding get an exact zero gradient either
way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _window(size: int, kernel: int, padding: int) -> tuple[slice, slice]:
    """The input rows (or columns) the one output position reads, and the taps that read them.

    Tap ``t`` reads input row ``t - padding`` (stride and dilation 1 for the one position; rows
    outside ``[0, size)`` are padding, and padding is never negative).
    """
    last = min(size, kernel - padding)
    return slice(0, last), slice(padding, last + padding)


class OnePositionConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` that computes a 1×1 output map as a matrix product.

    When its output map is 1×1, computes it as ``x_window · W_tapsᵀ + b`` (a linear layer over the
    input window it reads).

    Any other input goes to ``nn.Conv2d``. The fast path needs zero padding, no dilation and one
    group, so other settings always take the plain convolution. A module becomes one in place
    (:func:`one_position_convs`); its parameters, state dict and ``isinstance(m, nn.Conv2d)`` are
    unchanged, the same way ``torch.nn.utils.parametrize`` gives a module a subclass.
    """

    def _one_position(self, x: torch.Tensor) -> bool:
        if (
            self.padding_mode != "zeros"
            or self.groups != 1
            or self.dilation != (1, 1)
            or isinstance(self.padding, str)
            or x.dim() != 4
        ):
            return False
        return all(
            (size + 2 * p - k) // s + 1 == 1
            for size, k, p, s in zip(x.shape[-2:], self.kernel_size, self.padding, self.stride)
        )

    def _conv_forward(self, x, weight, bias):
        if not self._one_position(x):
            return super()._conv_forward(x, weight, bias)
        (rows, taps_r), (cols, taps_c) = (
            _window(size, k, p) for size, k, p in zip(x.shape[-2:], self.kernel_size, self.padding)
        )
        window = x[:, :, rows, cols].flatten(1)
        out = F.linear(window, weight[:, :, taps_r, taps_c].flatten(1), bias)
        return out.view(*out.shape, 1, 1)


def one_position_convs(module: nn.Module) -> nn.Module:
    """Make every plain ``nn.Conv2d`` of a module a :class:`OnePositionConv2d`, in place.

    Subclasses of ``nn.Conv2d`` (timm's ``Conv2dSame``, for one) are left as they are: their
    forward is their own. The values and gradients are those of ``nn.Conv2d`` for every geometry;
    the product is taken exactly where the output map is 1×1.

    Parameters
    ----------
    module : torch.nn.Module
        The module whose convolutions change class.

    Returns
    -------
    torch.nn.Module
        ``module`` itself.
    """
    for mod in module.modules():
        if type(mod) is nn.Conv2d:
            mod.__class__ = OnePositionConv2d
    return module
