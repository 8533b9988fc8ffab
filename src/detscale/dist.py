"""Distributed state behind one small module.

``init_from_env()`` reads torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``),
picks the device and backend from what is present (CUDA + NCCL, else CPU + gloo) and creates
the process group with an explicit timeout; ``cleanup()`` always destroys it. Every helper is
safe to call with one process and without a process group, so world size 1 is no special branch.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init_from_env(timeout_s: float = 1800, cpu_threads: int | None = None) -> DistInfo:
    """Join the process group described by torchrun's environment (or run alone without it).

    On CUDA each rank takes ``cuda:LOCAL_RANK`` and NCCL; otherwise the rank runs on the CPU
    with gloo and ``cpu_threads`` torch threads (so CPU scaling is a fair analogue of cards).
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
    if world > 1 and not tdist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": _dt.timedelta(seconds=timeout_s)}
        if backend == "nccl":
            kwargs["device_id"] = device
        tdist.init_process_group(**kwargs)
    return DistInfo(rank, local_rank, world, local_world, device, backend)


def cleanup() -> None:
    """Destroy the process group if one exists (always call it, from a ``finally``)."""
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


@contextmanager
def process_group(timeout_s: float = 1800, cpu_threads: int | None = None) -> Iterator[DistInfo]:
    """``with process_group() as info:`` pairs :func:`init_from_env` with :func:`cleanup`."""
    info = init_from_env(timeout_s, cpu_threads)
    try:
        yield info
    finally:
        cleanup()


def is_dist() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def get_rank() -> int:
    return tdist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return tdist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_dist():
        tdist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place, returned for chaining); identity with one process."""
    if is_dist():
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (in place); identity with one process."""
    if is_dist():
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
        tensor /= tdist.get_world_size()
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if is_dist():
        tdist.all_reduce(tensor, op=tdist.ReduceOp.MAX)
    return tensor


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order, ``[world, *shape]``; ``tensor[None]`` with one process."""
    if not is_dist():
        return tensor[None]
    out = [torch.empty_like(tensor) for _ in range(tdist.get_world_size())]
    tdist.all_gather(out, tensor.contiguous())
    return torch.stack(out)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order; ``[obj]`` with one process."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_dist():
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]
