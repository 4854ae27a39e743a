"""A network's tail run from the stored input of its first stage (docs/design.md §6).

Training only a network's last stages (the paper's tail scope, fine-tuning the upper stage, a
retrain of the changed stages) leaves every earlier stage frozen; in eval mode those stages map
each image to the same tensor at every step. :class:`TailRunner` computes that tensor once per
image (the input of the first tail stage, caught by a forward pre-hook) and then runs the tail
from it: the earlier stages of the network it is given are replaced by ``nn.Identity`` and the
stored tensor is fed to the first tail stage by the same hook, so the network's own
``forward_features``/``forward_head`` do the rest. On ResNet18 at 32 px the stem and the first two
stages are most of a forward pass.

The stem before the first stage still runs, on zeros shaped like one input image, and its output
is discarded; :meth:`TailRunner.check` compares the tail's output from the stored inputs with
the whole network's on a batch, so a network whose tail reads anything but its first stage's
input (a skip across stages) is refused rather than trained on the wrong function.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from pycore._validation import ParameterError
from pycore.deep._data import dataset_labels, fetch


def stage_names(net: nn.Module) -> list[str]:
    """The stage modules of timm's ``feature_info``, first to last.

    Parameters
    ----------
    net : torch.nn.Module
        A timm model.

    Returns
    -------
    list of str
        The stages' module names; empty without a ``feature_info``.
    """
    info = getattr(net, "feature_info", None)
    return [f["module"] for f in info] if info else []


class _Stop(Exception):
    """Raised by the capturing hook: the rest of the forward pass is not needed."""


class TailRunner:
    """The last ``stages`` stages of ``net`` run from the stored inputs of the first of them.

    The last ``stages`` stages of ``net`` (timm's ``feature_info``) run from the stored inputs
    of the first of them (module docstring).
    """

    def __init__(self, net: nn.Module, stages: int):
        names = stage_names(net)
        if not 1 <= stages <= len(names):
            raise ParameterError(
                "stages",
                f"{type(net).__name__} lists {len(names)} stages in timm's feature_info; "
                f"cannot run its last {stages} from stored inputs",
            )
        self.prefix, self.first = names[: len(names) - stages], names[len(names) - stages]

    @torch.no_grad()
    def inputs(self, net: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The input of the first tail stage for the images ``x`` (``net`` in eval mode)."""
        caught = {}

        def hook(_, args):
            caught["h"] = args[0]
            raise _Stop

        handle = net.get_submodule(self.first).register_forward_pre_hook(hook)
        try:
            net.forward_features(x)
        except _Stop:
            pass
        finally:
            handle.remove()
        return caught["h"]

    def dataset(self, net: nn.Module, data: Dataset, batch_size: int = 256) -> TensorDataset:
        """``TensorDataset(h, y)``: the stored tail inputs of every image of ``data``."""
        was = net.training
        net.eval()
        dev = next(net.parameters()).device
        try:
            hs = [
                self.inputs(
                    net, fetch(data, torch.arange(s, min(s + batch_size, len(data))))[0].to(dev)
                ).cpu()
                for s in range(0, len(data), batch_size)
            ]
        finally:
            net.train(was)
        return TensorDataset(torch.cat(hs), torch.as_tensor(dataset_labels(data)))

    def attach(self, net: nn.Module, image_shape: tuple) -> _FromTail:
        """Make ``net`` take stored tail inputs (in place, until :meth:`_FromTail.detach`).

        Its earlier stages become ``nn.Identity``, and the returned module's
        ``forward_features(h)`` runs the stem on zeros shaped ``image_shape`` and the tail from the
        batch ``h``; ``forward_head`` is the network's.
        """
        removed = {}
        for name in self.prefix:
            parent, _, leaf = name.rpartition(".")
            owner = net.get_submodule(parent) if parent else net
            removed[name] = getattr(owner, leaf)
            setattr(owner, leaf, nn.Identity())
        return _FromTail(net, self.first, tuple(image_shape), removed)

    def check(self, full: nn.Module, tail: nn.Module, x: torch.Tensor, rtol=1e-4) -> None:
        """Check that ``tail`` gives ``full``'s pre-logits on ``x`` to float round-off.

        ``tail`` (from :meth:`attach` on a copy of ``full``) gives ``full``'s pre-logits on
        ``x`` to float round-off; otherwise a ParameterError naming ``model``.
        """
        x = x.to(next(full.parameters()).device)
        with torch.no_grad():
            want = full.forward_head(full.forward_features(x), pre_logits=True)
            got = tail.forward_head(tail.forward_features(self.inputs(full, x)), pre_logits=True)
        err = float((want - got).abs().max()) / max(float(want.abs().max()), 1e-30)
        if not err <= rtol:
            raise ParameterError(
                "model",
                f"{type(full).__name__}'s tail from stage {self.first!r} does not read only that "
                f"stage's input (relative difference {err:.2g}): it cannot be trained from "
                "stored inputs",
            )


class _FromTail(nn.Module):
    """A network whose earlier stages were removed.

    ``forward_features(h)`` runs the stem on zeros and feeds ``h`` to the first tail stage.
    """

    def __init__(self, net: nn.Module, first: str, image_shape: tuple, removed: dict):
        super().__init__()
        self.net, self.image_shape = net, image_shape
        self._h, self._removed = None, removed
        self._hook = net.get_submodule(first).register_forward_pre_hook(self._feed)

    def detach(self) -> nn.Module:
        """The network as it was: its earlier stages back, the feeding hook removed."""
        self._hook.remove()
        for name, mod in self._removed.items():
            parent, _, leaf = name.rpartition(".")
            setattr(self.net.get_submodule(parent) if parent else self.net, leaf, mod)
        return self.net

    def _feed(self, _, args):
        return (self._h, *args[1:])

    def forward_features(self, h: torch.Tensor) -> torch.Tensor:
        self._h = h
        try:
            zeros = h.new_zeros((len(h), *self.image_shape))
            return self.net.forward_features(zeros)
        finally:
            self._h = None

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.net.forward_head(x, pre_logits=pre_logits)

    def get_classifier(self) -> nn.Module:
        return self.net.get_classifier()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(h))
