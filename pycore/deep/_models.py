"""Any timm classifier with the paper's immunization layer.

docs/theory.md §8-9, paper §5.2, App. C.3; docs/design.md §3. :class:`ImmunizedNet` has timm's
interface itself, so an attacker who swaps the head keeps the layer and no per-family code is
needed.
"""

from __future__ import annotations

import copy
import os

import timm
import torch
from torch import nn

import pycore._ops as ops
from pycore._validation import ParameterError

# The timm keyword arguments a model may be created with here (and a checkpoint may name): the
# shape of the network only, never a path or a config that timm would act on.
MODEL_KWARGS = ("img_size", "patch_size", "depth", "embed_dim", "num_heads")


class PretrainedUnavailableError(RuntimeError):
    """``pretrained=True`` could not fetch weights (offline, hub unreachable, no cache)."""


class UnmergedAdaptersError(ParameterError):
    """A model carries peft (LoRA) adapter layers, so it has no one linear classifier.

    ``.modules`` names the adapted modules; merge them first.
    """

    def __init__(self, parameter: str, message: str, modules: tuple = ()):
        super().__init__(parameter, message)
        self.modules = tuple(modules)


# Floating dtype of every parameter and buffer a model given to the library may have: the op and
# the immunization layer run float32 (or float64), the data and the layer are float32.
MODEL_DTYPE = torch.float32


def check_model(model, name: str = "model") -> None:
    """A :class:`ParameterError` naming ``name`` unless ``model`` is a float32 module on a device.

    Float32 on a real device (CPU or CUDA), every floating parameter and buffer: half, bfloat16 and
    float64 models, and models on the meta device (shapes only), are refused before any work, with
    what is supported; so are a NaN or inf parameter or buffer (named) and parameters that are all
    zero.
    """
    if not isinstance(model, nn.Module):
        raise ParameterError(
            name,
            f"{name} must be a torch.nn.Module (a timm classifier), got {type(model).__name__}",
        )
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    meta = next((t for t in tensors if t.device.type == "meta"), None)
    if meta is not None:
        raise ParameterError(
            name,
            f"{name} is on the meta device (shapes, no weights): load its weights first "
            "(pycore.deep.load_model, or to_empty() and load_state_dict()); supported: float32 "
            "on a CPU or CUDA device",
        )
    dtypes = sorted(
        {str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype != MODEL_DTYPE}
    )
    if dtypes:
        raise ParameterError(
            name,
            f"{name} has {', '.join(dtypes)} parameters; supported: float32 on a CPU or CUDA "
            f"device (convert it with {name}.float())",
        )
    devices = {str(t.device) for t in tensors}
    if len(devices) > 1:
        raise ParameterError(
            name, f"{name} is spread over devices {sorted(devices)}; supported: one device"
        )
    # weights that cannot give features, named here: found later, they read as a broken input
    named = [(k, t) for k, t in model.state_dict().items() if t.is_floating_point()]
    bad = next((k for k, t in named if not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise ParameterError(name, f"{name}'s tensor {bad!r} contains NaN or inf")
    params = [p for p in model.parameters() if p.is_floating_point()]
    if params and not any(bool(p.any()) for p in params):
        raise ParameterError(name, f"every weight of {name} is zero: it gives no features")


def image_input(model) -> tuple[int | None, tuple[int, int] | None]:
    """The channels and, for a model that takes one size only, the size of its input images.

    The channels are the first ``nn.Conv2d``'s (timm's stem or patch embedding; None without
    one); the size ``(H, W)`` is that of a timm patch embedding that asserts it
    (``strict_img_size``: a ViT built for one ``img_size``), else None (any size).
    """
    channels = size = None
    for m in getattr(model, "net", model).modules():
        if channels is None and isinstance(m, nn.Conv2d):
            channels = int(m.in_channels)
        if size is None and getattr(m, "strict_img_size", False):
            img = getattr(m, "img_size", None)
            size = (int(img[0]), int(img[1])) if img is not None else None
        if channels is not None and size is not None:
            break
    return channels, size


def _bias_caches(model: nn.Module) -> list:
    """The modules of ``model`` that cache their attention biases.

    timm's LeViT, EfficientFormer, EfficientViT (MSRA), TinyViT: ``attention_bias_cache``, filled
    by an eval-mode forward.
    """
    return [
        m for m in model.modules() if isinstance(getattr(m, "attention_bias_cache", None), dict)
    ]


def _drop_bias_cache(module, args, output) -> None:
    # timm refills the cache at the next eval-mode forward from the biases as they are then
    module.attention_bias_cache = {}


def uncached_attention_biases(model: nn.Module) -> nn.Module:
    """``model`` with every attention-bias cache emptied after each forward.

    Each forward then reads the biases as they are (:func:`_bias_caches`): the library trains
    models in eval mode (θ₀'s normalisation statistics), where timm would keep the biases of the
    first forward (stale once they train, and a graph that a second backward cannot pass) and a
    cached tensor that is no graph leaf makes ``copy.deepcopy`` fail. Idempotent; returns
    ``model``.
    """
    for m in _bias_caches(model):
        m.attention_bias_cache = {}
        if _drop_bias_cache not in m._forward_hooks.values():
            m.register_forward_hook(_drop_bias_cache)
    return model


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` with its attention-bias caches left out.

    The copy's caches are empty and ``model`` is not changed: a cache filled by a forward with
    gradients holds a tensor that is no graph leaf, which ``deepcopy`` refuses.
    """
    return copy.deepcopy(model, {id(m.attention_bias_cache): {} for m in _bias_caches(model)})


def linear_classifier(net: nn.Module) -> nn.Linear:
    """The classifier of a timm network as the one ``nn.Linear`` the immunization layer feeds.

    An ``nn.Linear`` as it is. LeViT's heads (``NormLinear``: a BatchNorm1d before the Linear; in
    the distilled models a second such head on the same pre-logits, the logits their mean) are
    folded into one with timm's own ``NormLinear.fuse``, exact in eval mode, and installed in
    ``net`` (both heads become the one module, so its own forward gives the same logits).

    Parameters
    ----------
    net : torch.nn.Module
        A timm classifier (it has ``get_classifier``).

    Returns
    -------
    torch.nn.Linear
        The classifier on the pre-logits.

    Raises
    ------
    UnmergedAdaptersError
        The network carries peft adapters (``.modules`` names them).
    ParameterError
        Any other classifier, e.g. DeiT's and PiT's distilled pair (its heads read two different
        tokens, no one head on the pre-logits equals it), or none (``num_classes=0``);
        ``.parameter`` is ``"model"``.
    """
    head = net.get_classifier()
    heads = tuple(head) if isinstance(head, (tuple, list)) else (head,)
    if heads and isinstance(heads[0], nn.Linear) and all(h is heads[0] for h in heads):
        return heads[0]
    adapted = [n for n, m in net.named_modules() if type(m).__module__.startswith("peft.")]
    if adapted:
        raise UnmergedAdaptersError(
            "model",
            f"{type(net).__name__} carries peft adapters (on {', '.join(adapted[:3])}"
            f"{' …' * (len(adapted) > 3)}): merge them into the weights first "
            "(merge_and_unload() of the PeftModel, or of each adapted layer) and use the merged "
            "model, or keep them in peft and load them there",
            tuple(adapted),
        )
    from timm.models.levit import Levit, NormLinear  # noqa: PLC0415

    if isinstance(net, Levit) and heads and all(isinstance(h, NormLinear) for h in heads):
        fused = [h.fuse() for h in heads]
        w = heads[0].linear.weight
        merged = nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
        with torch.no_grad():
            merged.weight.copy_(torch.stack([f.weight for f in fused]).mean(0))
            merged.bias.copy_(torch.stack([f.bias for f in fused]).mean(0))
        net.head = merged
        if hasattr(net, "head_dist"):
            net.head_dist = merged
        return merged
    kind = " and ".join(type(h).__name__ for h in heads)
    raise ParameterError(
        "model",
        f"{type(net).__name__}'s classifier is {kind}, not one linear layer on the pre-logits "
        "(supported: nn.Linear, LeViT's NormLinear heads; a model made with num_classes=0 has "
        "none, a DeiT or PiT distilled pair reads two tokens)",
    )


def classifier_width(net: nn.Module) -> int:
    return int(linear_classifier(net).in_features)


class ImmunizedNet(nn.Module):
    """A timm classifier with the immunization layer before its classifier.

    A timm classifier ``net`` with the immunization layer (default: an identity
    ImmunizationHead) before its classifier: :meth:`features` gives the immunized features ``Z``,
    :meth:`prelogits` ``X``.
    """

    def __init__(
        self, net: nn.Module, layer: nn.Module | None = None, *, lambda_reg: float = 1e-7
    ):
        super().__init__()
        missing = [
            a
            for a in ("forward_features", "forward_head", "get_classifier")
            if not hasattr(net, a)
        ]
        if missing:
            raise ParameterError(
                "model",
                f"{type(net).__name__} lacks timm's {', '.join(missing)}: pass "
                "a timm classifier (timm.create_model) or a module like one",
            )
        self.net = net
        if layer is None:  # on the backbone's device, so that a CUDA model stays on CUDA
            dev = getattr(next(net.parameters(), None), "device", None)
            layer = ops.ImmunizationHead(classifier_width(net), lambda_reg=lambda_reg, device=dev)
        self.layer = layer
        uncached_attention_biases(net)  # trained in eval mode: no stale biases (LeViT)

    @property
    def pretrained_cfg(self) -> dict:
        """The timm data config of ``net`` (its input size and normalisation)."""
        return getattr(self.net, "pretrained_cfg", {})

    @property
    def num_features(self) -> int:
        """The width of the immunized features Z (the layer's outputs)."""
        return int(self.layer.weight.shape[0])

    def get_classifier(self) -> nn.Module:
        """The classifier on the immunized features (:func:`linear_classifier` of ``net``)."""
        return linear_classifier(self.net)

    classifier = property(get_classifier)

    def reset_classifier(self, num_classes: int, *args, **kwargs) -> None:
        """A new classifier of ``num_classes`` (timm's; LeViT's heads folded again)."""
        self.net.reset_classifier(num_classes, *args, **kwargs)
        linear_classifier(self.net)  # LeViT's new heads folded again

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's ``forward_features`` (before its pooling and head)."""
        return self.net.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The pre-logits through the layer, then the classifier (not with ``pre_logits``)."""
        z = self.layer(self.net.forward_head(x, pre_logits=True))
        return z if pre_logits else self.get_classifier()(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits: backbone, layer, classifier."""
        return self.forward_head(self.forward_features(x))

    def prelogits(self, x: torch.Tensor) -> torch.Tensor:
        """``X``: the backbone's pre-logits features, the layer's input."""
        return self.net.forward_head(self.net.forward_features(x), pre_logits=True)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``Z``: the immunized features (what a linear probe of D_H sees)."""
        return self.layer(self.prelogits(x))

    def set_trainable(self, scope: str = "layer", stages: int = 1) -> tuple[list, list]:
        """Freeze all but the layer, the classifier and, with ``scope="tail"``, the last stages.

        ``stages`` of the backbone's last stages with ``scope="tail"``; returns the disjoint
        ``(extractor, classifier)`` parameter lists.
        """
        if scope not in ("layer", "tail"):
            raise ParameterError("scope", f"scope must be 'layer' or 'tail', got {scope!r}")
        self.requires_grad_(False)
        mods = [self.layer] + (tail_modules(self.net, stages) if scope == "tail" else [])
        cls = list(self.classifier.parameters())
        ext = {id(p): p for m in mods for p in m.parameters()}
        for p in [*ext.values(), *cls]:
            p.requires_grad_(True)
        return [p for p in ext.values() if all(p is not q for q in cls)], cls


def tail_modules(net: nn.Module, stages: int = 1) -> list[nn.Module]:
    """The backbone's last stages and every top-level module after them but the classifier.

    Stages by timm's ``feature_info`` (ResNet18 ``stages=2``: layer3, layer4; a ViT's last block).

    Parameters
    ----------
    net : torch.nn.Module
        A timm classifier.
    stages : int, default 1
        How many last stages.

    Returns
    -------
    list of torch.nn.Module
        The modules, in order.

    Raises
    ------
    ParameterError
        ``stages`` outside [1, the stages ``feature_info`` lists] (``.parameter`` is ``"stages"``).
    """
    info = getattr(net, "feature_info", None)
    names = [f["module"] for f in info] if info else []
    if not names or not 1 <= stages <= len(names):
        raise ParameterError(
            "stages",
            f"{type(net).__name__} lists {len(names)} stages in timm's "
            f"feature_info; cannot train its last {stages}",
        )
    children, head = list(net.named_children()), net.get_classifier()
    heads = tuple(head) if isinstance(head, (tuple, list)) else (head,)
    start = [n for n, _ in children].index(names[-1].split(".")[0]) + 1
    # m itself included
    after = [m for _, m in children[start:] if not any(q is h for q in m.modules() for h in heads)]
    return [net.get_submodule(n) for n in names[-stages:]] + after


@torch.no_grad()
def fold_batchnorm(modules) -> int:
    """Fold every eval-mode ``BatchNorm2d`` that follows a bias-free ``Conv2d`` into it.

    Fold every eval-mode ``BatchNorm2d`` of ``modules`` that directly follows a bias-free
    ``Conv2d`` of its width (in module order, only identities or dropouts between them, as in a
    ResNet's conv → bn pairs) into that convolution; returns how many were folded. The function
    in eval mode is unchanged: the convolution's weight is scaled by ``γ/σ`` per output channel
    and the BatchNorm keeps only its shift (``γ = 1``, ``β − γμ/σ``, ``μ = 0``, ``σ² = 1 −
    eps``), so the modules and the state-dict keys stay.

    Why (docs/design.md §4): a trained network's BatchNorm whose running variance is tiny (the
    demo ResNet18's ``layer4.0.downsample.1`` at 32 px: gains γ/σ up to 209, median 82)
    multiplies every optimizer step on the convolution before it by its gain when the network is
    trained in eval mode; folded, a step moves the function by what it moves the weights.
    """
    folded = 0
    for mod in modules:
        conv = None
        for m in mod.modules():
            if isinstance(m, nn.Conv2d):
                conv = m
            elif (
                isinstance(m, nn.BatchNorm2d)
                and conv is not None
                and conv.bias is None
                and conv.out_channels == m.num_features
                and m.affine
                and m.track_running_stats
            ):
                gain = m.weight / (m.running_var + m.eps).sqrt()
                conv.weight.mul_(gain.view(-1, *([1] * (conv.weight.dim() - 1))))
                m.bias.sub_(gain * m.running_mean)
                m.weight.fill_(1.0)
                m.running_mean.zero_()
                m.running_var.fill_(1.0 - m.eps)
                conv, folded = None, folded + 1
            elif not list(m.children()) and not isinstance(m, (nn.Identity, nn.Dropout)):
                conv = None  # any other layer between them (an activation too): not a pair
    return folded


@torch.no_grad()
def fold_batchnorm_checked(model: nn.Module, modules, x: torch.Tensor, rtol=1e-4) -> int:
    """:func:`fold_batchnorm` of ``modules``, kept only if the model's output is unchanged.

    :func:`fold_batchnorm` of ``modules`` (parts of ``model``), kept only if ``model``'s
    eval-mode output on ``x`` is unchanged to ``rtol`` (relative to its largest entry): a pair the
    module order misreads (a BatchNorm that does not read the convolution before it) restores
    every tensor as it was. Returns how many were folded (0 when restored).
    """
    was = model.training
    model.eval()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    before = model(x)
    n = fold_batchnorm(modules)
    if n:
        after = model(x)
        if not float((after - before).abs().max()) <= rtol * float(before.abs().max()):
            model.load_state_dict(saved)
            n = 0
    model.train(was)
    return n


def create_model(
    name: str, num_classes: int, *, pretrained: bool = False, seed: int | None = None, **kwargs
) -> nn.Module:
    """``timm.create_model`` with one-line errors, initialised from a seed.

    The initialisation is drawn from ``seed`` without touching the global RNG. ``img_size`` goes to
    models that take it (ViTs); for size-agnostic ones (CNNs) it sets only the input size of their
    data config, which the image transforms read. The name and options are recorded for
    :func:`~pycore.deep.save_model`.

    Parameters
    ----------
    name : str
        A timm model name (``timm.list_models()``).
    num_classes : int
        The classifier's classes, in [1, 100000].
    pretrained : bool, default False
        timm's pretrained weights (from the hub or its cache).
    seed : int, optional
        Seeds the initialisation (None: the global RNG).
    **kwargs
        Integer architecture options in [1, 100000]: one of
        :data:`pycore.deep._models.MODEL_KWARGS` (``img_size``, ``patch_size``, ``depth``, ...).

    Returns
    -------
    torch.nn.Module
        The timm model.

    Raises
    ------
    ParameterError
        An unknown name (``"model"``), a bad ``num_classes``, an option that is not one of
        :data:`~pycore.deep._models.MODEL_KWARGS` or out of bounds (named), or options timm
        cannot build.
    PretrainedUnavailableError
        ``pretrained`` weights that cannot be had (offline, not cached).

    Examples
    --------
    >>> import torch
    >>> from pycore.deep import create_model
    >>> net = create_model("test_resnet", 10, seed=0, img_size=32)  # timm's tiny test ResNet
    >>> net.num_classes, net.pretrained_cfg["input_size"]
    (10, (3, 32, 32))
    >>> net.eval()(torch.zeros(4, 3, 32, 32)).shape
    torch.Size([4, 10])
    >>> again = create_model("test_resnet", 10, seed=0, img_size=32)  # the same seed, weights
    >>> all(torch.equal(a, b) for a, b in zip(net.parameters(), again.parameters()))
    True
    """
    if not isinstance(name, str) or not timm.is_model(name):
        raise ParameterError(
            "model", f"{name!r} is not a timm model name (timm.list_models() lists them)"
        )
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, int)
        or not 1 <= num_classes <= 100_000
    ):
        raise ParameterError(
            "num_classes", f"num_classes must be an integer in [1, 100000], got {num_classes!r}"
        )
    bad = [
        k
        for k, v in kwargs.items()
        if k not in MODEL_KWARGS
        or isinstance(v, bool)
        or not isinstance(v, int)
        or not 1 <= v <= 100_000
    ]
    if bad:
        raise ParameterError(
            bad[0],
            f"model option {bad[0]}={kwargs[bad[0]]!r}: expected one of "
            f"{MODEL_KWARGS} as an integer in [1, 100000]",
        )
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            try:
                net = timm.create_model(
                    name, pretrained=pretrained, num_classes=num_classes, **kwargs
                )
            except TypeError:
                if "img_size" not in kwargs:
                    raise
                rest = {k: v for k, v in kwargs.items() if k != "img_size"}
                net = timm.create_model(
                    name, pretrained=pretrained, num_classes=num_classes, **rest
                )
        except (TypeError, ValueError, AssertionError) as exc:
            raise ParameterError(
                "model", f"timm cannot build {name} with {kwargs}: {exc}"
            ) from None
        # hub errors come in many types (LocalEntryNotFoundError, OSError, HTTP)
        except Exception as exc:
            if not pretrained:
                raise
            offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
            raise PretrainedUnavailableError(
                f"pretrained weights for {name} are not "
                f"available{' (HF_HUB_OFFLINE is set)' * offline}: "
                f"{type(exc).__name__}; pass a local checkpoint, or run where the hub "
                "(or its cache) has them"
            ) from exc
    if "img_size" in kwargs:
        side = kwargs["img_size"]
        net.pretrained_cfg = {**net.pretrained_cfg, "input_size": (3, side, side), "crop_pct": 1.0}
    # what a checkpoint records to rebuild the architecture
    net.model_args = {"name": name, **kwargs}
    return net


def as_immunized(model: nn.Module, *, lambda_reg: float = 1e-7) -> ImmunizedNet:
    """A deep copy of ``model`` as an :class:`ImmunizedNet`.

    An identity layer is inserted unless it is one; made by :func:`copy_model`.
    """
    model = copy_model(model)
    return model if isinstance(model, ImmunizedNet) else ImmunizedNet(model, lambda_reg=lambda_reg)
