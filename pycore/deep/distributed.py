"""torchrun / DistributedDataParallel helpers for deep immunization (multi-GPU, multi-node).

``torchrun --nproc_per_node=N experiments/deepnet.py ...`` sets ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK``; :func:`init_from_env` then starts the process group with ``nccl`` when the
rank has a CUDA device and ``gloo`` otherwise (CPU, as in the 2-process test). Conventions:

* every rank builds the same θ₀ (seeded); θ₀ training for the demo runs on rank 0 and is
  broadcast (:func:`broadcast_module`), so all ranks start bit-identical;
* each rank trains on its own shard of every global batch (see
  :class:`pycore.deep.data.ShardedBatches`) and DDP averages gradients; regularizer
  statistics are per rank (documented in :mod:`pycore.deep.train`);
* evaluation and all outputs are written by rank 0 only; the others wait at a barrier.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistContext", "DistributedEnvError", "check_env", "init_from_env", "broadcast_module", "barrier",
           "shutdown"]


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    backend: "str | None"
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


class DistributedEnvError(ValueError):
    """torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``) is inconsistent or incomplete; raised before any rendezvous, so a bad
    launch fails at once instead of waiting for peers that will never come."""


def _env_int(name: str, default: "int | None" = None) -> "int | None":
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise DistributedEnvError(f"environment variable {name}={raw!r} is not an integer") from None


def check_env() -> tuple[int, int, int]:
    """``(rank, world, local_rank)`` from the environment, validated (:class:`DistributedEnvError`).

    ``WORLD_SIZE ≥ 1``; ``0 ≤ RANK < WORLD_SIZE``; ``0 ≤ LOCAL_RANK < LOCAL_WORLD_SIZE`` (when
    set) and ``LOCAL_RANK < WORLD_SIZE``; with ``WORLD_SIZE > 1``, ``RANK``, ``MASTER_ADDR`` and an
    integer ``MASTER_PORT`` in [1, 65535] must be set (the ``env://`` rendezvous reads them).
    """
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise DistributedEnvError(f"WORLD_SIZE={world} must be ≥ 1")
    rank = _env_int("RANK", None if world > 1 else 0)
    if rank is None:
        raise DistributedEnvError(f"WORLD_SIZE={world} but RANK is not set (launch with torchrun)")
    if not 0 <= rank < world:
        raise DistributedEnvError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    local = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", None)
    if local < 0 or local >= world or (local_world is not None and not local < local_world):
        bound = (f"[0, LOCAL_WORLD_SIZE={local_world})" if local_world is not None
                 else f"[0, WORLD_SIZE={world})")
        raise DistributedEnvError(f"LOCAL_RANK={local} must be in {bound} (RANK={rank}, WORLD_SIZE={world})")
    if world > 1:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v, "").strip()]
        if missing:
            raise DistributedEnvError(f"WORLD_SIZE={world} but {' and '.join(missing)} "
                                      f"{'is' if len(missing) == 1 else 'are'} not set "
                                      "(launch with torchrun, or set MASTER_ADDR and MASTER_PORT)")
        port = _env_int("MASTER_PORT")
        if not 1 <= port <= 65535:
            raise DistributedEnvError(f"MASTER_PORT={port} must be in [1, 65535]")
    return rank, world, local


def init_from_env(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Initialise from torchrun's environment; single process when ``WORLD_SIZE`` is unset/1.

    The environment is validated first (:func:`check_env`, :class:`DistributedEnvError`), and so
    is ``LOCAL_RANK`` against the visible CUDA devices, before any rendezvous.
    """
    if device not in ("auto", "cuda", "cpu"):
        raise DistributedEnvError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise DistributedEnvError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    _, world, local = check_env()
    use_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch sees no CUDA device")
    if use_cuda and local >= torch.cuda.device_count():
        raise DistributedEnvError(f"LOCAL_RANK={local} but torch sees {torch.cuda.device_count()} "
                                  "CUDA device(s)")
    dev = torch.device(f"cuda:{local}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world <= 1:
        return DistContext(0, 1, 0, None, dev)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(dist.get_rank(), dist.get_world_size(), local, backend, dev)


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers to every rank (in place)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
