"""timm backbones as immunizable feature extractors (docs/theory.md §8-9, paper §5.2 and App. C.3).

A model here is a timm classifier split into three parts:

* ``trunk``  -- the layers kept frozen at θ₀ (ResNet18: stem, layer1, layer2; ViT: patch
  embedding and every transformer block but the last);
* ``tail``   -- the immunized layers (ResNet18: ``layer3`` + ``layer4``, "the last two residual
  stages"; ViT: the last block and the final norm), ending in the pooled pre-logit features;
* the *immunization layer* -- the paper's identity-initialised dummy linear layer (App. C.3),
  a :class:`pycore.ops.ImmunizationHead` whose weight gradient is preconditioned as
  ``grad_W (XᵀX + λI)⁻¹`` (docs/theory.md §4, right side). Its output ``Z`` is the feature matrix whose
  Hessian ``H = ZᵀZ`` the regularizers shape. Because it starts at the identity, θ₀'s function
  is unchanged when it is installed.

The layer lives *inside* the timm module (ResNet: ``global_pool`` becomes
``Sequential(pool, layer)``; ViT: ``fc_norm`` becomes ``Sequential(fc_norm, layer)``), so the
exported extractor is an ordinary timm model: ``model(x)``, ``forward_features`` and
``forward_head(..., pre_logits=True)`` (which returns the immunized features) all work.
Do not call ``reset_classifier`` on an exported ResNet: timm rebuilds ``global_pool`` there.

Checkpoints are read from safetensors or ``torch.load(weights_only=True)`` only; arbitrary
pickles are refused (docs/design.md §4).
"""
from __future__ import annotations

import copy
import os
import pickle
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from pycore.deep._ops import ops
from pycore.deep.timm_compat import import_timm
from pycore.report import dumps_json
from pycore.validation import check_regular_file

__all__ = [
    "BackboneSpec", "BACKBONES", "ImmunizableModel", "build_model", "read_weights",
    "load_weights", "export_timm_model", "save_immunized", "load_immunized", "load_extractor",
    "CheckpointError", "CheckpointMismatchError", "PretrainedUnavailableError",
]

EXPORT_FORMAT = "pycore.deep.immunized/1"


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or not a weights-only file."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's tensors do not match the architecture they are loaded into."""


class PretrainedUnavailableError(RuntimeError):
    """``pretrained=True`` could not fetch weights (offline, hub unreachable, no cache)."""


@dataclass(frozen=True)
class BackboneSpec:
    """A timm architecture and which of its modules immunization trains."""

    key: str
    timm_name: str
    family: str                      # "resnet" | "vit"
    immunized: tuple[str, ...]       # module paths trained during immunization
    timm_kwargs: Mapping[str, object] = field(default_factory=dict)
    note: str = ""
    input_size: "int | None" = None  # square input side when it differs from timm's pretrained cfg


BACKBONES: dict[str, BackboneSpec] = {
    # Paper configurations (docs/theory.md §9): 512-dim / 768-dim features.
    "resnet18": BackboneSpec("resnet18", "resnet18", "resnet", ("layer3", "layer4"),
                             note="last two residual stages immunized"),
    "vit_base_clip": BackboneSpec("vit_base_clip", "vit_base_patch16_clip_224", "vit",
                                  ("blocks.-1", "norm"),
                                  note="last transformer block and final norm immunized"),
    # CPU demo sizes (32 px images). ResNet18 is resolution-agnostic; the ViT is timm's
    # vit_tiny (192-dim) re-shaped for 32 px inputs and shortened so θ₀ trains in seconds.
    "resnet18_32px": BackboneSpec("resnet18_32px", "resnet18", "resnet", ("layer3", "layer4"),
                                  note="ResNet18 on 32 px inputs", input_size=32),
    "vit_tiny_32px": BackboneSpec("vit_tiny_32px", "vit_tiny_patch16_224", "vit",
                                  ("blocks.-1", "norm"),
                                  {"img_size": 32, "patch_size": 8, "depth": 4},
                                  note="vit_tiny, 32 px, patch 8 (16 tokens), 4 blocks", input_size=32),
    # The demo's ViT: the same at half the width (96, 3 heads of 32). Trained from scratch on the
    # demo's 1000 digits, it reaches a higher D_P top-1 in fewer CPU-seconds than the 192-wide one
    # (docs/deep.md "A stronger ViT θ₀").
    "vit_mini_32px": BackboneSpec("vit_mini_32px", "vit_tiny_patch16_224", "vit", ("blocks.-1", "norm"),
                                  {"img_size": 32, "patch_size": 8, "depth": 4, "embed_dim": 96,
                                   "num_heads": 3},
                                  note="vit_tiny, 32 px, patch 8 (16 tokens), 4 blocks, width 96",
                                  input_size=32),
}

_LAYER_SITE = {"resnet": "global_pool", "vit": "fc_norm"}


def _get_module(root: nn.Module, path: str) -> nn.Module:
    mod = root
    for part in path.split("."):
        mod = mod[int(part)] if part.lstrip("-").isdigit() else getattr(mod, part)
    return mod


def _spec(backbone: "str | BackboneSpec") -> BackboneSpec:
    if isinstance(backbone, BackboneSpec):
        return backbone
    try:
        return BACKBONES[backbone]
    except KeyError:
        raise ValueError(f"unknown backbone {backbone!r}; choose one of {sorted(BACKBONES)}") from None


class ImmunizableModel(nn.Module):
    """timm classifier with an immunization layer installed, split into trunk / tail.

    ``forward(x)`` is exactly the wrapped timm model's forward. The training loop uses the
    pieces: ``trunk`` (frozen, may be cached), ``pooled`` (tail up to the pre-layer features
    ``X``), ``layer`` (``Z = X Wᵀ + b``) and ``classifier``.
    """

    def __init__(self, net: nn.Module, spec: BackboneSpec, layer: nn.Module):
        super().__init__()
        if spec.family not in _LAYER_SITE:
            raise ValueError(f"unsupported backbone family {spec.family!r}")
        self.spec = spec
        self.net = net
        site = _LAYER_SITE[spec.family]
        setattr(net, site, nn.Sequential(getattr(net, site), layer))
        self.feature_dim = int(net.num_features)
        self.scope = "tail"

    def set_scope(self, scope: str) -> "ImmunizableModel":
        """Which part immunization trains (besides the classifier):

        * ``"tail"`` -- the backbone's immunized modules (``spec.immunized``: ResNet18's last two
          residual stages, ViT's last block) and the immunization layer, as in the paper (§5.2);
        * ``"layer"`` -- the immunization layer alone: Algorithm 1 on the frozen backbone's
          pooled features ``X`` (the linear problem of docs/theory.md §6 with ``θ = Wᵀ`` and
          ``K = XᵀX``). :meth:`trunk` then returns ``X`` itself, so a cached trunk makes every
          step a handful of D×D products.
        """
        if scope not in ("tail", "layer"):
            raise ValueError(f"scope must be 'tail' or 'layer', got {scope!r}")
        self.scope = scope
        return self

    # -- pieces ---------------------------------------------------------------------------
    @property
    def layer(self) -> nn.Module:
        return getattr(self.net, _LAYER_SITE[self.spec.family])[1]

    @property
    def classifier(self) -> nn.Module:
        return self.net.get_classifier()

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        """Frozen part: images -> input of the first immunized module (scope ``"layer"``: ``X``)."""
        h = self._stem(x)
        return self._tail(h) if self.scope == "layer" else h

    def pooled(self, h: torch.Tensor) -> torch.Tensor:
        """Immunized part up to the pooled pre-layer features ``X`` (N x D) from :meth:`trunk`'s output."""
        return h if self.scope == "layer" else self._tail(h)

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        n = self.net
        if self.spec.family == "resnet":
            x = n.maxpool(n.act1(n.bn1(n.conv1(x))))
            return n.layer2(n.layer1(x))
        x = n.norm_pre(n.patch_drop(n._pos_embed(n.patch_embed(x))))
        for blk in n.blocks[:-1]:
            x = blk(x)
        return x

    def _tail(self, h: torch.Tensor) -> torch.Tensor:
        return self.last_stage(self.before_last_stage(h))

    def before_last_stage(self, h: torch.Tensor) -> torch.Tensor:
        """Stem output -> input of the backbone's last stage (ResNet: ``layer3``; ViT: identity)."""
        return self.net.layer3(h) if self.spec.family == "resnet" else h

    def last_stage_modules(self) -> list[nn.Module]:
        """The backbone's last stage: ResNet18's ``layer4``; ViT's last block and final norm."""
        n = self.net
        return [n.layer4] if self.spec.family == "resnet" else [n.blocks[-1], n.norm]

    def last_stage(self, h: torch.Tensor) -> torch.Tensor:
        """Input of the last stage -> pooled pre-layer features ``X``."""
        n = self.net
        if self.spec.family == "resnet":
            x = getattr(n, "global_pool")[0](n.layer4(h))
            if n.drop_rate:
                x = nn.functional.dropout(x, p=float(n.drop_rate), training=n.training)
            return x
        x = n.norm(n.blocks[-1](h))
        return n.head_drop(n.fc_norm[0](n.pool(x)))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Immunized features ``Z`` of images ``x`` (what linear probing sees)."""
        return self.layer(self.pooled(self.trunk(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    # -- parameter groups -----------------------------------------------------------------
    def immunized_modules(self) -> list[nn.Module]:
        tail = [] if self.scope == "layer" else [_get_module(self.net, p) for p in self.spec.immunized]
        return tail + [self.layer]

    def set_trainable(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """Freeze everything but the immunized tail, the layer and the classifier.

        Returns ``(extractor_params, classifier_params)`` (disjoint) for the two optimizer
        groups (weight decay 0 on the extractor, 2e-5 on the classifier; docs/theory.md §9).
        """
        for p in self.parameters():
            p.requires_grad_(False)
        ext: dict[int, nn.Parameter] = {}
        for m in self.immunized_modules():
            for p in m.parameters():
                ext[id(p)] = p
        cls = {id(p): p for p in self.classifier.parameters()}
        for p in list(ext.values()) + list(cls.values()):
            p.requires_grad_(True)
        return [p for k, p in ext.items() if k not in cls], list(cls.values())

    def trunk_is_frozen(self) -> bool:
        trunk_ids = {id(p) for p in self.parameters()} - {
            id(p) for m in self.immunized_modules() for p in m.parameters()
        } - {id(p) for p in self.classifier.parameters()}
        return not any(p.requires_grad for p in self.parameters() if id(p) in trunk_ids)


# --- weights --------------------------------------------------------------------------------

# A checkpoint is read whole into memory: refuse anything larger (ViT-g in float32 is ~4 GB).
MAX_CHECKPOINT_BYTES = 8 << 30  # 8 GiB
# Bounds on what load_immunized accepts from a file's metadata.
MAX_NUM_CLASSES = 100_000


def read_weights(path: "str | os.PathLike") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a state dict from safetensors or a weights-only torch file; never unpickle.

    Returns ``(state_dict, metadata)``; metadata is only present for safetensors files.
    Nested ``{"state_dict": ...}`` / ``{"model": ...}`` dicts and DDP ``module.`` prefixes are
    unwrapped.  Every failure is a one-line :class:`CheckpointError`: a path that is not a
    regular file (a FIFO or ``/dev/zero`` is refused before it is opened), a file over
    :data:`MAX_CHECKPOINT_BYTES`, an unreadable or truncated file, a pickle of arbitrary objects,
    and a floating-point tensor holding NaN/inf (named).
    """
    path = os.fspath(path)
    try:
        check_regular_file(path, "a checkpoint", max_bytes=MAX_CHECKPOINT_BYTES, error=CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file not found: {path}") from None
    meta: dict[str, str] = {}
    if path.endswith(".safetensors"):
        from safetensors import safe_open  # noqa: PLC0415

        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                meta = dict(f.metadata() or {})
                sd = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as exc:  # noqa: BLE001  (SafetensorError, OSError, header errors: all one line)
            raise CheckpointError(f"cannot read safetensors checkpoint {path}: {_first_line(exc)}") from None
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
            raise CheckpointError(
                f"{path} is not a weights-only torch checkpoint (refusing to unpickle arbitrary "
                f"objects; save a state_dict or convert to safetensors): {_first_line(exc)}"
            ) from None
        except Exception as exc:  # noqa: BLE001  (zipfile / OS / decoding errors of a damaged file)
            raise CheckpointError(f"cannot read torch checkpoint {path}: {_first_line(exc)}") from None
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
                obj = obj[key]
                break
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(f"{path} does not hold a state_dict of tensors")
        sd = obj
    for k, v in sd.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"checkpoint {path}: tensor {k!r} contains NaN or inf")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd, meta


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _dtype_kind(t: torch.Tensor) -> str:
    if t.is_complex():
        return "complex"
    if t.is_floating_point():
        return "float"
    return "bool" if t.dtype == torch.bool else "int"


def _check_and_load(module: nn.Module, sd: Mapping[str, torch.Tensor], what: str, source: str) -> None:
    own = module.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    # load_state_dict would cast silently (complex → real drops the imaginary part, float → int
    # truncates): the kind of number must match, the precision may differ.
    dtypes = [f"{k}: checkpoint {sd[k].dtype} vs model {own[k].dtype}" for k in own
              if k in sd and _dtype_kind(sd[k]) != _dtype_kind(own[k])]
    if missing or unexpected or shapes or dtypes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[0]})")
        if shapes:
            parts.append(f"{len(shapes)} shape mismatches (e.g. {shapes[0]})")
        if dtypes:
            parts.append(f"{len(dtypes)} dtype mismatches (e.g. {dtypes[0]})")
        raise CheckpointMismatchError(f"checkpoint {source} does not match {what}: " + "; ".join(parts))
    try:
        module.load_state_dict(sd, strict=True)
    except RuntimeError as exc:  # e.g. a complex or otherwise uncopyable tensor
        raise CheckpointMismatchError(f"checkpoint {source} does not load into {what}: "
                                      f"{_first_line(exc)}") from None


def load_weights(net: nn.Module, path: "str | os.PathLike", what: str = "the model") -> None:
    """Load a plain timm state dict into ``net`` with a one-line error on any mismatch."""
    sd, _ = read_weights(path)
    _check_and_load(net, sd, what, os.fspath(path))


def _create_timm(spec: BackboneSpec, num_classes: int, pretrained: bool) -> nn.Module:
    timm = import_timm()
    if not pretrained:
        return timm.create_model(spec.timm_name, pretrained=False, num_classes=num_classes,
                                 **dict(spec.timm_kwargs))
    try:
        return timm.create_model(spec.timm_name, pretrained=True, num_classes=num_classes,
                                 **dict(spec.timm_kwargs))
    except Exception as exc:  # hub errors come in many types (LocalEntryNotFoundError, OSError, HTTP)
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise PretrainedUnavailableError(
            f"pretrained weights for {spec.timm_name} are not available"
            f"{' (HF_HUB_OFFLINE is set)' if offline else ''}: {type(exc).__name__}; pass "
            f"--checkpoint FILE (safetensors or weights-only torch state_dict) or run where the "
            f"Hugging Face hub is reachable / its cache holds the weights"
        ) from exc


def build_model(backbone: "str | BackboneSpec", num_classes: int, *, pretrained: bool = False,
                checkpoint: "str | os.PathLike | None" = None, lambda_reg: float = 1e-3,
                precondition: bool = True, seed: "int | None" = None) -> ImmunizableModel:
    """Create θ₀: a timm model (random init, ``pretrained`` or ``checkpoint``) + identity layer.

    ``seed`` makes the random initialisation reproducible without touching the global RNG.
    """
    spec = _spec(backbone)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    devices = []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        net = _create_timm(spec, num_classes, pretrained)
    if checkpoint is not None:
        load_weights(net, checkpoint, what=f"{spec.timm_name} with {num_classes} classes")
    layer = ops().ImmunizationHead(int(net.num_features), lambda_reg=lambda_reg,
                                   precondition=precondition)
    return ImmunizableModel(net, spec, layer)


# --- export ---------------------------------------------------------------------------------

def export_timm_model(model: ImmunizableModel) -> nn.Module:
    """A plain timm model (deep copy) with the immunization layer as an ``nn.Linear``."""
    net = copy.deepcopy(model.net)
    site = _LAYER_SITE[model.spec.family]
    src = getattr(net, site)[1]
    lin = nn.Linear(model.feature_dim, model.feature_dim, bias=getattr(src, "bias", None) is not None)
    with torch.no_grad():
        lin.weight.copy_(src.weight)
        if lin.bias is not None:
            lin.bias.copy_(src.bias)
    getattr(net, site)[1] = lin
    return net.eval()


def save_immunized(model: ImmunizableModel, path: "str | os.PathLike", num_classes: int,
                   extra: "Mapping[str, object] | None" = None) -> str:
    """Write the immunized extractor (+ its D_P classifier) as safetensors with metadata.

    The backbone must be one of :data:`BACKBONES` (unchanged): :func:`load_immunized` rebuilds
    the architecture from that table, never from the file.
    """
    from safetensors.torch import save_file  # noqa: PLC0415

    if BACKBONES.get(model.spec.key) != model.spec:
        raise ValueError(f"save_immunized: backbone {model.spec.key!r} is not an entry of BACKBONES; "
                         "load_immunized rebuilds models from that table only")
    if (isinstance(num_classes, bool) or not isinstance(num_classes, int)
            or not 1 <= num_classes <= MAX_NUM_CLASSES):
        raise ValueError(f"save_immunized: num_classes must be an integer in [1, {MAX_NUM_CLASSES}], "
                         f"got {num_classes!r}")
    net = export_timm_model(model)
    sd = {k: v.detach().contiguous().clone() for k, v in net.state_dict().items()}
    meta = {
        "format": EXPORT_FORMAT,
        "backbone": model.spec.key,
        "timm_name": model.spec.timm_name,
        "timm_kwargs": dumps_json(dict(model.spec.timm_kwargs)),
        "family": model.spec.family,
        "num_classes": str(int(num_classes)),
        "feature_dim": str(model.feature_dim),
        "extra": dumps_json(dict(extra or {})),
    }
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(sd, path, metadata=meta)
    return path


def load_immunized(path: "str | os.PathLike") -> nn.Module:
    """Load an extractor written by :func:`save_immunized` as a ready (eval-mode) timm model.

    ``model.forward_head(model.forward_features(x), pre_logits=True)`` gives the immunized
    features; ``model(x)`` the D_P logits.

    The file is untrusted input: the architecture is rebuilt from :data:`BACKBONES` by the
    ``backbone`` key alone, and the metadata's ``timm_name`` / ``family`` / ``timm_kwargs`` must
    equal that entry's (nothing from the file is passed to timm); ``num_classes`` must be an
    integer in [1, :data:`MAX_NUM_CLASSES`] and ``feature_dim`` the backbone's own.  Every
    failure is a one-line :class:`CheckpointError`.
    """
    sd, meta = read_weights(path)
    path = os.fspath(path)
    if meta.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path} is not an immunized extractor written by pycore.deep "
                              f"(metadata format={_shown(meta.get('format'))})")
    key = meta.get("backbone")
    spec = BACKBONES.get(key) if isinstance(key, str) else None
    if spec is None:
        raise CheckpointError(f"{path}: metadata backbone={_shown(key)} is not one of {sorted(BACKBONES)}")
    expected = {"timm_name": spec.timm_name, "family": spec.family,
                "timm_kwargs": dumps_json(dict(spec.timm_kwargs))}
    for field_name, want in expected.items():
        if field_name in meta and meta[field_name] != want:
            raise CheckpointError(f"{path}: metadata {field_name}={_shown(meta[field_name])} disagrees with "
                                  f"backbone {key!r} ({want}); refusing to build a model from file metadata")
    num_classes = _meta_int(meta, "num_classes", path, 1, MAX_NUM_CLASSES)
    try:
        net = _create_timm(spec, num_classes, pretrained=False)
    except Exception as exc:  # noqa: BLE001  (a timm that cannot build the entry: still one line)
        raise CheckpointError(f"{path}: cannot build backbone {key!r}: {_first_line(exc)}") from None
    d = int(net.num_features)
    if _meta_int(meta, "feature_dim", path, 1, 1 << 20) != d:
        raise CheckpointError(f"{path}: metadata feature_dim={meta['feature_dim']} but backbone {key!r} has "
                              f"{d} features")
    site = _LAYER_SITE[spec.family]
    setattr(net, site, nn.Sequential(getattr(net, site), nn.Linear(d, d, bias=f"{site}.1.bias" in sd)))
    _check_and_load(net, sd, f"{spec.timm_name} (immunized export)", path)
    return net.eval()


def _shown(value, limit: int = 80) -> str:
    """repr of a metadata value, shortened (the file may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _meta_int(meta: Mapping[str, str], name: str, path: str, low: int, high: int) -> int:
    raw = meta.get(name)
    if not (isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 9
            and low <= int(raw) <= high):
        raise CheckpointError(f"{path}: metadata {name}={_shown(raw)} must be an integer in [{low}, {high}]")
    return int(raw)


def load_extractor(path: "str | os.PathLike", backbone: "str | BackboneSpec | None" = None
                   ) -> tuple[ImmunizableModel, dict[str, str]]:
    """Any checkpoint of a supported backbone as an :class:`ImmunizableModel` in eval mode (what
    an audit measures): an extractor written by :func:`save_immunized` (the architecture from its
    validated metadata, as :func:`load_immunized` does), the same layout without metadata, or a
    plain timm state dict of ``backbone`` (then an identity immunization layer is inserted, which
    leaves the function unchanged). The class count is read from the classifier's weight.

    Returns ``(model, metadata)``. Every failure is a one-line :class:`CheckpointError`: no
    metadata and no ``backbone``, a backbone that disagrees with the metadata, a state dict that
    does not match the architecture (:class:`CheckpointMismatchError`).
    """
    path = os.fspath(path)
    sd, meta = read_weights(path)
    if meta.get("format") == EXPORT_FORMAT:
        net = load_immunized(path)
        spec = BACKBONES[meta["backbone"]]
        if backbone is not None and _spec(backbone) != spec:
            raise CheckpointMismatchError(f"{path} is an extractor of backbone {spec.key!r}, "
                                          f"not {_spec(backbone).key!r}")
    else:
        if backbone is None:
            raise CheckpointError(f"{path} carries no pycore metadata: name its architecture (backbone, "
                                  f"one of {sorted(BACKBONES)})")
        spec = _spec(backbone)
        probe = _create_timm(spec, 1, pretrained=False)
        key = next((f"{name}.weight" for name, mod in probe.named_modules() if mod is probe.get_classifier()),
                   None)
        if key is None or key not in sd or sd[key].ndim != 2:
            raise CheckpointMismatchError(f"checkpoint {path} does not match {spec.timm_name}: no classifier "
                                          f"weight {key!r}")
        num_classes = int(sd[key].shape[0])
        if not 1 <= num_classes <= MAX_NUM_CLASSES:
            raise CheckpointError(f"checkpoint {path}: {num_classes} classes is out of range")
        net = _create_timm(spec, num_classes, pretrained=False)
        site = _LAYER_SITE[spec.family]
        if f"{site}.1.weight" in sd:  # the exported layout (pool, linear) without metadata
            d = int(net.num_features)
            lin = nn.Linear(d, d, bias=f"{site}.1.bias" in sd)
            setattr(net, site, nn.Sequential(getattr(net, site), lin))
        _check_and_load(net, sd, f"{spec.timm_name} with {num_classes} classes", path)
    site = _LAYER_SITE[spec.family]
    wrapped = getattr(net, site)
    d = int(net.num_features)
    if isinstance(wrapped, nn.Sequential) and len(wrapped) == 2 and isinstance(wrapped[1], nn.Linear):
        lin = wrapped[1]
        layer = ops().ImmunizationHead(d, bias=lin.bias is not None)
        with torch.no_grad():
            layer.weight.copy_(lin.weight)
            if lin.bias is not None:
                layer.bias.copy_(lin.bias)
        setattr(net, site, wrapped[0])
    else:
        layer = ops().ImmunizationHead(d)
    model = ImmunizableModel(net, spec, layer)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), meta
