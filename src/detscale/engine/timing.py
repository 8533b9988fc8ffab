"""Step timing and peak memory of one rank, and the run's ``timing.json``.

Measurement rules (design): throughput is images per second of wall time over the steady state,
the first ``warmup_steps`` steps of every epoch excluded (loader start-up, allocator growth,
cudnn autotuning); on CUDA the device is synchronised before the clock is read. Each step is
split into *data wait* (blocked in ``next(loader)``) and *compute* (forward, backward,
all-reduce, optimiser, up to the next request for data). Global throughput sums the ranks.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


class Clock:
    """``time.perf_counter`` that first waits for queued CUDA work, so a reading means work done."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class RankTiming:
    """One rank's accumulated timings (kept in the checkpoint so a resumed run reports the whole run)."""

    warmup_steps: int
    measured_steps: int = 0
    measured_images: int = 0
    measured_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    epoch_seconds: list[float] = field(default_factory=list)
    val_seconds: float = 0.0
    train_seconds: float = 0.0
    _steps_this_epoch: int = 0

    def start_epoch(self) -> None:
        self._steps_this_epoch = 0

    def record_step(self, images: int, data_s: float, compute_s: float) -> None:
        """One step's split; counted in the steady state after the epoch's first ``warmup_steps``."""
        self._steps_this_epoch += 1
        if self._steps_this_epoch <= self.warmup_steps:
            return
        self.measured_steps += 1
        self.measured_images += images
        self.measured_seconds += data_s + compute_s
        self.data_wait_seconds += data_s
        self.compute_seconds += compute_s

    @property
    def images_per_s(self) -> float:
        return self.measured_images / self.measured_seconds if self.measured_seconds > 0 else 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RankTiming:
        return cls(**state)


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak memory of this process: CUDA allocated/reserved on a GPU, peak RSS on the CPU."""
    if device.type == "cuda":
        return {"kind": "cuda_allocated", "bytes": int(torch.cuda.max_memory_allocated(device)),
                "reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return {"kind": "rss", "bytes": int(rss if sys.platform == "darwin" else rss * 1024), "reserved_bytes": None}


def timing_report(
    per_rank: list[dict[str, Any]],
    memory: list[dict[str, Any]],
    device: str,
    backend: str,
    batch_per_rank: int,
    global_batch: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The ``timing.json`` contract from every rank's :class:`RankTiming` state and peak memory."""
    ranks = [RankTiming.from_state(s) for s in per_rank]
    main = ranks[0]
    data = sum(r.data_wait_seconds for r in ranks)
    compute = sum(r.compute_seconds for r in ranks)
    busy = data + compute
    report = {
        "world_size": len(ranks),
        "device": device,
        "backend": backend,
        "batch_per_rank": batch_per_rank,
        "global_batch": global_batch,
        "warmup_steps": main.warmup_steps,
        "measured_steps": main.measured_steps,
        "images_per_s": sum(r.images_per_s for r in ranks),
        "images_per_s_per_rank": [r.images_per_s for r in ranks],
        "data_wait_share": data / busy if busy > 0 else 0.0,
        "compute_share": compute / busy if busy > 0 else 0.0,
        "epoch_seconds": main.epoch_seconds,
        "val_seconds": main.val_seconds,
        "train_seconds": main.train_seconds,
        "peak_mem_bytes_per_rank": [m["bytes"] for m in memory],
        "mem_kind": memory[0]["kind"],
    }
    if memory[0].get("reserved_bytes") is not None:
        report["peak_mem_reserved_bytes_per_rank"] = [m["reserved_bytes"] for m in memory]
    report["data_wait_share_per_rank"] = [
        r.data_wait_seconds / (r.data_wait_seconds + r.compute_seconds)
        if r.data_wait_seconds + r.compute_seconds > 0 else 0.0 for r in ranks
    ]
    report.update(extra)
    return report
