"""torchrun / DistributedDataParallel helpers.

:func:`init_from_env` checks torchrun's environment before any rendezvous and starts ``nccl`` on
CUDA, ``gloo`` otherwise; θ₀ trained here is trained on rank 0 and broadcast
(:func:`broadcast_module`); a rank trains on its shard of each global batch.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistContext:
    """The place of a process in a run of one or several (:func:`init_from_env`).

    Attributes
    ----------
    rank : int
        This process's rank (0 alone).
    world : int
        The number of processes.
    local_rank : int
        The rank on this machine (the CUDA device it takes).
    backend : str or None
        ``"nccl"`` or ``"gloo"``; None for one process.
    device : torch.device
        Where this process computes.
    """

    rank: int
    world: int
    local_rank: int
    backend: str | None
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class DistributedEnvError(ValueError):
    """torchrun's environment is inconsistent or incomplete.

    Raised before any rendezvous, so a bad launch fails at once instead of waiting for peers that
    will never come.
    """


def _env_int(name: str, default: int | None = None) -> int | None:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise DistributedEnvError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


def check_env() -> tuple[int, int, int]:
    """``(rank, world, local_rank)`` from torchrun's environment.

    With ``WORLD_SIZE > 1`` also ``MASTER_ADDR`` and ``MASTER_PORT``, which the ``env://``
    rendezvous reads.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world < 1:
        raise DistributedEnvError(f"WORLD_SIZE={world} must be ≥ 1")
    rank = _env_int("RANK", None if world > 1 else 0)
    if rank is None:
        raise DistributedEnvError(f"WORLD_SIZE={world} but RANK is not set (launch with torchrun)")
    if not 0 <= rank < world:
        raise DistributedEnvError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    local, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", None)
    bound = f"LOCAL_WORLD_SIZE={local_world}" if local_world is not None else f"WORLD_SIZE={world}"
    if not 0 <= local < min(world, local_world or world):
        raise DistributedEnvError(
            f"LOCAL_RANK={local} must be in [0, {bound}) (RANK={rank}, WORLD_SIZE={world})"
        )
    if world > 1:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v, "").strip()]
        if missing:
            raise DistributedEnvError(
                f"WORLD_SIZE={world} but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set "
                "(launch with torchrun, or set MASTER_ADDR and MASTER_PORT)"
            )
        if not 1 <= _env_int("MASTER_PORT") <= 65535:
            raise DistributedEnvError(
                f"MASTER_PORT={_env_int('MASTER_PORT')} must be in [1, 65535]"
            )
    return rank, world, local


def init_from_env(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Initialise from torchrun's environment (one process when ``WORLD_SIZE`` is unset or 1).

    With several processes the process group is initialised (NCCL on CUDA, Gloo on the CPU) and
    each process takes the CUDA device of its ``LOCAL_RANK``.

    Parameters
    ----------
    device : {"auto", "cuda", "cpu"}, default "auto"
        ``"auto"``: CUDA when torch sees a device.
    timeout_s : float, default 600.0
        The process group's timeout.

    Returns
    -------
    DistContext
        ``rank``, ``world``, ``local_rank``, ``backend`` (None for one process) and ``device``.

    Raises
    ------
    DistributedEnvError
        A malformed torchrun environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``), or a
        ``LOCAL_RANK`` beyond the CUDA devices.
    RuntimeError
        ``device="cuda"`` without a CUDA device.
    """
    _, world, local = check_env()
    use_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but torch sees no CUDA device")
    if use_cuda and local >= torch.cuda.device_count():
        raise DistributedEnvError(
            f"LOCAL_RANK={local} but torch sees {torch.cuda.device_count()} CUDA device(s)"
        )
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
    """Copy a rank's parameters and buffers to every rank, in place.

    Nothing happens in a single process.

    Parameters
    ----------
    module : torch.nn.Module
        The module, the same architecture on every rank.
    src : int, default 0
        The rank whose values are copied.

    Returns
    -------
    None
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src)


def barrier() -> None:
    """Wait for every rank (nothing in a single process).

    Returns
    -------
    None
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    """Destroy the process group, if one was initialised.

    Returns
    -------
    None
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
