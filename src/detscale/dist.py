"""Distributed state behind one small module.

``init_from_env()`` reads torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``),
picks the device and backend from what is present (CUDA + NCCL, else CPU + gloo) and creates
the process group with an explicit timeout; ``cleanup()`` always destroys it. Every helper is
safe to call with one process and without a process group, so world size 1 is no special branch.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from detscale.errors import UserError

log = logging.getLogger(__name__)


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
    if world > 1:
        Heartbeat.start(rank, world, timeout_s)
    return DistInfo(rank, local_rank, world, local_world, device, backend)


def cleanup() -> None:
    """Destroy the process group if one exists (always call it, from a ``finally``)."""
    Heartbeat.stop()
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


# ---------------------------------------------------------------------------------------------
# Heartbeats: which rank stopped responding
# ---------------------------------------------------------------------------------------------


class StalledRankError(UserError):
    """A collective timed out (``train.timeout_s``) because a rank stopped responding."""

    exit_code = 1


class Heartbeat:
    """Every rank writes its wall-clock time into the rendezvous store every few seconds, from a thread.

    When a collective times out, the ranks whose last beat is old are the ones that stopped (a
    SIGSTOPped, swapped-out or dead process stops beating; a rank merely waiting in a collective
    keeps beating). One store client per process, its own connection (the process group's store
    is not shared with a thread); keys are per torchrun attempt.
    """

    _instance: Heartbeat | None = None

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.interval = max(0.5, min(5.0, timeout_s / 6))
        self.prefix = f"detscale/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=_dt.timedelta(seconds=max(10.0, self.interval * 2)))
        self._done = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="detscale-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(f"{self.prefix}/{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self._beat()
            except Exception:  # the store went away (the group is ending): stop quietly
                return

    @classmethod
    def start(cls, rank: int, world: int, timeout_s: float) -> None:
        if cls._instance is None and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            try:
                cls._instance = cls(rank, world, timeout_s)
            except Exception as exc:  # no store to reach: the run works, a stall is just named less precisely
                log.debug("no heartbeat (%s)", exc)

    @classmethod
    def stop(cls) -> None:
        if cls._instance is not None:
            cls._instance._done.set()

    @classmethod
    def silent_ranks(cls) -> dict[int, float] | None:
        """Rank -> seconds since its last beat, for the ranks silent for more than 3 intervals; None unknown."""
        hb = cls._instance
        if hb is None:
            return None
        now, silent = time.time(), {}
        for rank in range(hb.world):
            key = f"{hb.prefix}/{rank}"
            try:
                if not hb.store.check([key]):
                    silent[rank] = float("inf")
                    continue
                age = now - float(hb.store.get(key).decode())
            except Exception as exc:
                log.debug("heartbeat of rank %d unreadable: %s", rank, exc)
                return None
            if age > 3 * hb.interval:
                silent[rank] = age
        return silent


#: how the backends word a collective that did not finish in time
_TIMEOUT = re.compile(r"timed out|timeout|watchdog caught collective operation", re.IGNORECASE)


def stall_error(exc: BaseException, timeout_s: float) -> StalledRankError | None:
    """A :class:`StalledRankError` naming the silent ranks when ``exc`` is a collective timeout; else None."""
    if not isinstance(exc, RuntimeError) or not _TIMEOUT.search(str(exc)):
        return None
    silent = Heartbeat.silent_ranks()
    rank = get_rank() if is_dist() else _env_int("RANK", 0)
    if silent:
        who = ", ".join(f"rank {r} (silent for {'ever' if a == float('inf') else f'{a:.0f} s'})"
                        for r, a in sorted(silent.items()))
    else:
        who = "no rank has stopped its heartbeat, so one is blocked inside a collective or much slower than the rest"
    return StalledRankError(
        f"rank {rank}: a collective did not finish within train.timeout_s = {timeout_s:.0f} s; stalled: {who}. "
        "torchrun stops every rank of the group (and restarts it from weights/last.pt while "
        "train.max_restarts allows). If it happens again, look at what stops that rank (a stopped or swapped-out "
        "process, a full disk, a dead node), or raise train.timeout_s for steps that are legitimately this slow"
    )


def join_attempt_group(timeout_s: float) -> None:
    """Under torchrun, join the process group through a store namespace of this restart attempt.

    torchrun keeps one rendezvous store across restarts, and the process group's keys (gloo
    peer addresses, the NCCL unique id) carry no attempt number: a restarted rank can read a
    dead peer's address from the failed attempt and fail with "Connection refused". Prefixing
    the store with ``TORCHELASTIC_RESTART_COUNT`` keeps the attempts apart. Outside torchrun (or
    with one rank) this does nothing and :func:`detscale.dist.init_from_env` creates the group.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if attempt is None or world == 1 or tdist.is_initialized():
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    timeout = _dt.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts it
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                           is_master=not agent_store and rank == 0, timeout=timeout, multi_tenant=True)
    kwargs: dict[str, Any] = {"backend": "gloo", "store": tdist.PrefixStore(f"detscale/attempt{attempt}", store),
                              "rank": rank, "world_size": world, "timeout": timeout}
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        kwargs.update(backend="nccl", device_id=device)
    tdist.init_process_group(**kwargs)
