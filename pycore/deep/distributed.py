"""torchrun / DistributedDataParallel helpers for deep immunization (issue: multi-GPU/-node).

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

__all__ = ["DistContext", "init_from_env", "broadcast_module", "barrier", "shutdown"]


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


def init_from_env(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Initialise from torchrun's environment; single process when ``WORLD_SIZE`` is unset/1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch sees no CUDA device")
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
