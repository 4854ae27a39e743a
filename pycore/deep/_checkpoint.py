"""Checkpoints: one reader, one writer, one loader (docs/design.md §3).

:func:`read_weights` reads the file into memory ONCE (size-capped) and parses those bytes, so a
file rewritten while read is a :class:`CheckpointError`, never a signal (a memory-mapped read dies
of SIGBUS when the file shrinks). The format is told by the content: safetensors, or a torch file
through ``torch.load(weights_only=True)`` only. The metadata :func:`save_model` writes is a timm
name and
integer shape options only: the file is untrusted.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import struct

import torch

import pycore._ops as ops
from pycore import limits
from pycore._validation import ParameterError, PicklableError, check_regular_file
from pycore.deep._models import (
    ImmunizedNet,
    as_immunized,
    classifier_width,
    create_model,
    linear_classifier,
)

FORMAT = "pycore.deep.immunized/2"


class CheckpointError(PicklableError, ValueError):
    """A checkpoint file is missing, unreadable, changed while read, or not weights-only.

    Or it cannot be written (:func:`save_model`). ``.path`` the file and ``.tensor`` the tensor
    at fault, where one is.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None):
        super().__init__(message)
        self.path, self.tensor = path, tensor


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's tensors do not match the architecture they are loaded into."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _read_bytes(path: str) -> bytes:
    try:
        size = check_regular_file(
            path, "a checkpoint", max_bytes=limits.MAX_CHECKPOINT_BYTES, error=CheckpointError
        )
        with open(path, "rb") as f:
            data = f.read(size + 1)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file not found: {path}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {_first_line(exc)}") from None
    if len(data) != size:
        raise CheckpointError(
            f"checkpoint {path} changed while it was read ({size} bytes, then {len(data)})"
        )
    return data


def _safetensors(data: bytes, path: str) -> tuple[dict, dict]:
    from safetensors.torch import load  # noqa: PLC0415

    (n,) = struct.unpack("<Q", data[:8])
    try:
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        return dict(load(data)), {str(k): str(v) for k, v in meta.items()}
    except Exception as exc:  # noqa: BLE001  (SafetensorError, JSON, truncation: all one line)
        raise CheckpointError(
            f"cannot read safetensors checkpoint {path}: {_first_line(exc)}"
        ) from None


def _torch(data: bytes, path: str) -> dict:
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects other than tensors (refusing to unpickle them; save a "
            f"state_dict or convert to safetensors): {_first_line(exc)}"
        ) from None
    except Exception as exc:  # noqa: BLE001  (a truncated zip, a damaged pickle: one line)
        raise CheckpointError(
            f"cannot read torch checkpoint {path} (truncated or damaged?): {_first_line(exc)}"
        ) from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} does not hold a state_dict of tensors")
    return obj


def read_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors or weights-only torch file.

    Read by content, not by name; DDP's ``module.`` prefix and ``{"state_dict": ...}`` nesting are
    unwrapped.

    Parameters
    ----------
    path : str or os.PathLike
        The file, at most :data:`pycore.limits.MAX_CHECKPOINT_BYTES`.

    Returns
    -------
    state_dict : dict of str to torch.Tensor
        The tensors.
    metadata : dict of str to str
        The safetensors metadata (empty for a torch file).

    Raises
    ------
    CheckpointError
        A missing, unreadable, oversized or unrecognised file, NaN/inf weights (``.tensor`` names
        the first) or all-zero weights; ``.path`` names the file.
    """
    path = os.fspath(path)
    data = _read_bytes(path)
    if len(data) > 9 and data[8:9] == b"{" and struct.unpack("<Q", data[:8])[0] <= len(data) - 8:
        sd, meta = _safetensors(data, path)
    elif data[:4] == b"PK\x03\x04" or (data[:1] == b"\x80" and data[1:2] in b"\x02\x03\x04\x05"):
        sd, meta = _torch(data, path), {}
    else:
        raise CheckpointError(
            f"{path} is neither a safetensors file nor a torch checkpoint (by its content)"
        )
    floats = {k: v for k, v in sd.items() if v.is_floating_point()}
    for k, v in floats.items():
        if not bool(torch.isfinite(v).all()):
            raise CheckpointError(
                f"checkpoint {path}: tensor {k!r} contains NaN or inf", path=path, tensor=k
            )
    if floats and not any(bool(v.any()) for v in floats.values()):
        raise CheckpointError(
            f"checkpoint {path}: every weight tensor is zero (an untrained or blank file)"
        )
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return sd, meta


def save_model(model, path: str | os.PathLike, extra: dict | None = None) -> str:
    """Write a model of :func:`~pycore.deep.create_model` as safetensors.

    The metadata carries what :func:`load_model` rebuilds the model from: the timm name, its
    options and the number of classes.

    Parameters
    ----------
    model : ImmunizedNet or torch.nn.Module
        An :class:`ImmunizedNet` whose backbone :func:`~pycore.deep.create_model` made (it records
        the timm name and options), or such a backbone itself: it is saved with an identity
        layer, so :func:`load_model` gives it back as an :class:`ImmunizedNet` with the same
        logits.
    path : str or os.PathLike
        The file to write (not a folder); its folder is created.
    extra : dict, optional
        More metadata, stored as JSON under ``"extra"``.

    Returns
    -------
    str
        ``path``.

    Raises
    ------
    ParameterError
        A model not made by :func:`~pycore.deep.create_model` (``.parameter`` is ``"model"``); a
        ``path`` that is a folder or not a path (``"path"``).
    CheckpointError
        The file cannot be written (``.path``).

    Examples
    --------
    >>> import os, tempfile
    >>> from pycore.deep import ImmunizedNet, create_model, load_model, save_model
    >>> net = ImmunizedNet(create_model("test_resnet", 2, seed=0, img_size=32))
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = save_model(net, os.path.join(folder, "net.safetensors"), extra={"seed": 0})
    ...     back, metadata = load_model(path)
    >>> metadata["model"], metadata["num_classes"], metadata["extra"]
    ('test_resnet', '2', '{"seed": 0}')
    """
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    net = model.net if isinstance(model, ImmunizedNet) else model
    args = getattr(net, "model_args", None)
    if not isinstance(model, torch.nn.Module) or not args:
        raise ParameterError(
            "model",
            "save_model needs a model made by pycore.deep.create_model (it records "
            f"the timm name and options a checkpoint must carry), got a {type(model).__name__}",
        )
    try:
        path = os.fspath(path)
    except TypeError:
        raise ParameterError(
            "path", f"path must be a file path, got {type(path).__name__}"
        ) from None
    if os.path.isdir(path):
        raise ParameterError(
            "path",
            f"{path}: is a folder; save_model writes one file (e.g. {path}/model.safetensors)",
        )
    if not isinstance(model, ImmunizedNet):  # the identity layer: the same logits
        model = as_immunized(model)
    sd = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    meta = {
        "format": FORMAT,
        "model": args["name"],
        "num_classes": str(model.classifier.out_features),
        "model_kwargs": json.dumps({k: v for k, v in args.items() if k != "name"}),
        "extra": json.dumps(extra or {}, default=str),
    }
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_file(sd, path, metadata=meta)
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(
            f"{path}: cannot be written ({_first_line(exc)})", path=path
        ) from None
    return path


def _check_metadata(path: str, name: str, kwargs: dict, num_classes: int, sd: dict) -> None:
    """The architecture a checkpoint's metadata asks for, checked against its tensors.

    Before any real weight exists: options that set a count (``depth``) may not exceed what the
    file's names hold (a 232-byte file asked for ``depth`` 100000: 5-24 GB), then the network is
    built on the meta device (shapes, no storage) and its names, count and shapes must be the
    file's.
    """
    indices = [int(part) for k in sd for part in k.split(".") if part.isdigit()]
    depth = kwargs.get("depth")
    if isinstance(depth, int) and depth > min(len(sd), 1 + max(indices, default=-1)):
        raise CheckpointMismatchError(
            f"checkpoint {path}: its metadata asks for depth {depth}, but its {len(sd)} tensors "
            f"name {1 + max(indices, default=-1)} numbered blocks at most"
        )
    try:
        with torch.device("meta"):
            net = create_model(name, num_classes, **kwargs)
            shell = ImmunizedNet(
                net,
                ops.ImmunizationHead(classifier_width(net), bias=True)
                if "layer.bias" in sd
                else None,
            )
    except ParameterError as exc:
        raise CheckpointError(f"{path}: cannot build {name!r} {kwargs}: {exc}") from None
    full = sd if "layer.weight" in sd else {**sd, **_layer_of(shell)}
    _check_fits(shell.state_dict(), full, f"{name} with {num_classes} classes", path)


def _layer_of(model) -> dict:
    return {f"layer.{k}": v for k, v in model.layer.state_dict().items()}


def _check_fits(own: dict, sd: dict, what: str, path: str) -> None:
    """A :class:`CheckpointMismatchError` unless ``sd`` matches ``own``'s names, shapes and dtypes.

    A :class:`CheckpointMismatchError` unless ``sd`` has exactly ``own``'s names, shapes and
    kinds of dtype (``own`` may hold meta tensors: only shapes and dtypes are read).
    """
    kind = lambda t: "complex" if t.is_complex() else "float" if t.is_floating_point() else "int"  # noqa: E731
    problems = [
        f"{len(v)} {name} (e.g. {v[0]})"
        for name, v in (
            ("missing keys", [k for k in own if k not in sd]),
            ("unexpected keys", [k for k in sd if k not in own]),
            (
                "shape mismatches",
                [
                    f"{k}: {tuple(sd[k].shape)} vs {tuple(own[k].shape)}"
                    for k in own
                    if k in sd and sd[k].shape != own[k].shape
                ],
            ),
            (
                "dtype mismatches",
                [
                    f"{k}: {sd[k].dtype} vs {own[k].dtype}"
                    for k in own  # load would cast
                    if k in sd and kind(sd[k]) != kind(own[k])
                ],
            ),
        )
        if v
    ]
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match {what}: " + "; ".join(problems), path=path
        )


def _load_into(module, sd: dict, what: str, path: str) -> None:
    """``sd`` into ``module`` (names, shapes and kinds checked first).

    A tensor that is finite in the file but not in the module's dtype (1e300 in a float64 file,
    float32 model) is refused.
    """
    _check_fits(module.state_dict(), sd, what, path)
    module.load_state_dict(sd, strict=True)
    for k, v in module.state_dict().items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(
                f"checkpoint {path}: tensor {k!r} is finite in the file ({sd[k].dtype}) but "
                f"overflows the model's {v.dtype} to inf",
                path=path,
                tensor=k,
            )


def load_model(
    path: str | os.PathLike, model: str | None = None, **model_kwargs
) -> tuple[ImmunizedNet, dict]:
    """Any checkpoint as an :class:`ImmunizedNet` in eval mode, and its metadata.

    A :func:`save_model` file carries its architecture (``model`` must agree or be None); a plain
    timm state dict needs ``model`` and its ``model_kwargs``, its classes are read from its
    classifier and an identity layer is inserted. The metadata's architecture is checked against
    the file's tensors before any real weight is allocated. The model's gradients are off.

    Parameters
    ----------
    path : str or os.PathLike
        A safetensors or weights-only torch file (:func:`pycore.deep._checkpoint.read_weights`).
    model : str, optional
        The timm architecture: required for a plain state dict, checked for a :func:`save_model`
        file.
    **model_kwargs
        timm options of a plain state dict's architecture (e.g. ``img_size``).

    Returns
    -------
    model : ImmunizedNet
        The model, in eval mode with gradients off.
    metadata : dict of str to str
        The file's metadata (empty for a torch file).

    Raises
    ------
    CheckpointError
        ``.path`` names the file; ``.tensor`` a tensor that is not finite in the file or overflows
        the model's float32: an unreadable file, no metadata and no ``model``, an architecture that
        cannot be built.
    pycore.deep._checkpoint.CheckpointMismatchError
        A :class:`CheckpointError`: tensors that do not fit the architecture, another
        architecture than ``model``, or peft adapter tensors of a model saved with unmerged LoRA
        adapters (``.tensor`` the first).

    Examples
    --------
    >>> import os, tempfile, torch
    >>> from pycore.deep import ImmunizedNet, create_model, load_model, save_model
    >>> net = ImmunizedNet(create_model("test_resnet", 2, seed=0, img_size=32)).eval()
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     back, metadata = load_model(save_model(net, os.path.join(folder, "net.safetensors")))
    >>> x = torch.randn(4, 3, 32, 32)
    >>> type(back).__name__, back.training, torch.equal(back(x), net(x))
    ('ImmunizedNet', False, True)
    """
    path = os.fspath(path)
    sd, meta = read_weights(path)
    adapters = [
        k for k in sd if any(p == "base_layer" or p.startswith("lora_") for p in k.split("."))
    ]
    if adapters:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds peft adapter tensors ({adapters[0]!r} and "
            f"{len(adapters) - 1} more): merge the adapters into the weights (merge_and_unload()) "
            "before saving, or load the model and its adapters with peft",
            path=path,
            tensor=adapters[0],
        )
    if meta.get("format") == FORMAT:
        name, kwargs, n = (
            meta.get("model"),
            meta.get("model_kwargs", "{}"),
            meta.get("num_classes", ""),
        )
        with contextlib.suppress(ValueError):
            kwargs = json.loads(kwargs)
        if not (isinstance(kwargs, dict) and n.isascii() and n.isdigit() and len(n) <= 6):
            raise CheckpointError(
                f"{path}: malformed metadata (model_kwargs; num_classes {n[:9]!r})"
            )
        num_classes = int(n)
        if model is not None and model != name:
            raise CheckpointMismatchError(f"{path} holds a {name}, not a {model}")
        if isinstance(name, str):  # a bad name or option is create_model's error, below
            _check_metadata(path, name, kwargs, num_classes, sd)
    elif model is None:
        raise CheckpointError(f"{path} carries no pycore metadata: name its timm architecture")
    else:
        name, kwargs = model, model_kwargs
        probe = create_model(model, 1, **kwargs)
        head = probe.get_classifier()
        head = head[0] if isinstance(head, (tuple, list)) and head else head
        head = getattr(head, "linear", head)  # LeViT's NormLinear: BatchNorm1d, then Linear
        key = next((f"{n}.weight" for n, m in probe.named_modules() if m is head), None)
        w = sd.get(key) if key else None
        if w is None or w.ndim != 2:
            raise CheckpointMismatchError(
                f"checkpoint {path} does not match {model}: no classifier {key!r}"
            )
        num_classes = int(w.shape[0])
        # timm's own keys load into timm's own model, before the layer is put in
        net = create_model(name, num_classes, **kwargs)
        _load_into(net, sd, f"{name} with {num_classes} classes", path)
        linear_classifier(net)  # LeViT's heads folded into the one the layer feeds
        sd = {f"net.{k}": v for k, v in net.state_dict().items()}
    try:
        net = create_model(name, num_classes, **kwargs) if meta.get("format") == FORMAT else net
    except ParameterError as exc:
        raise CheckpointError(f"{path}: cannot build {name!r} {kwargs}: {exc}") from None
    out = ImmunizedNet(
        net, ops.ImmunizationHead(classifier_width(net), bias=True) if "layer.bias" in sd else None
    )
    if "layer.weight" not in sd:
        sd = {**sd, **_layer_of(out)}
    _load_into(out, sd, f"{name} with {num_classes} classes", path)
    return out.eval().requires_grad_(False), meta
