"""Step timing and peak memory of one rank, and the run's ``timing.json``.

Measurement rules (design): throughput is images per second of wall time over the steady state,
the first ``warmup_steps`` steps of every epoch excluded (loader start-up, allocator growth,
cudnn autotuning); on CUDA the device is synchronised before the clock is read, once per window
of steps (:class:`StepTimer`), never per step. Each step is split into *data wait* (blocked in
``next(loader)``) and *compute*, and with the breakdown on the compute further into forward,
backward, exposed communication, optimiser and other (:data:`PHASES`). Global throughput sums
the ranks.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

#: The parts of a training step, in order; their mean times per step add up to the step time.
PHASES = ("data_wait", "forward", "backward", "comm", "optimizer", "other")
PHASE_HELP = {
    "data_wait": "blocked on the data loader",
    "forward": "input to the device, forward and loss",
    "backward": "backward (gradient computation)",
    "comm": "exposed communication: from the last gradient bucket handed to the all-reduce until it is done",
    "optimizer": "BatchNorm statistics merge, optimiser step and EMA",
    "other": "everything else (bookkeeping, the progress bar, the stop-flag check)",
}


@dataclass
class RankTiming:
    """One rank's accumulated timings (kept in the checkpoint so a resumed run reports the whole run)."""

    warmup_steps: int
    measured_steps: int = 0
    measured_images: int = 0
    measured_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    # the step breakdown (train.step_breakdown): seconds summed over the measured steps
    breakdown_steps: int = 0
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    comm_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    other_seconds: float = 0.0
    # CPU demand, for the scaling projection's contention roofline: CPU seconds of this rank's
    # process over the measured steps, and of its loader workers over every trained batch
    cpu_seconds: float = 0.0
    loader_cpu_seconds: float = 0.0
    loader_images: int = 0
    epoch_seconds: list[float] = field(default_factory=list)
    val_seconds: float = 0.0
    train_seconds: float = 0.0
    _steps_this_epoch: int = 0

    def start_epoch(self) -> None:
        self._steps_this_epoch = 0

    @property
    def warming_up(self) -> bool:
        """Whether the next recorded step is one of the epoch's warm-up steps."""
        return self._steps_this_epoch < self.warmup_steps

    def record_step(self, images: int, data_s: float, compute_s: float,
                    phases: dict[str, float] | None = None, cpu_s: float = 0.0) -> None:
        """One step's times; counted in the steady state after the epoch's first ``warmup_steps``.

        ``phases`` (seconds of forward, backward, comm, optimizer, other) when the breakdown is on;
        ``cpu_s`` the CPU seconds the rank's process used in the step.
        """
        self._steps_this_epoch += 1
        if self._steps_this_epoch <= self.warmup_steps:
            return
        self.cpu_seconds += cpu_s
        self.measured_steps += 1
        self.measured_images += images
        self.measured_seconds += data_s + compute_s
        self.data_wait_seconds += data_s
        self.compute_seconds += compute_s
        if phases is not None:
            self.breakdown_steps += 1
            for name in PHASES[1:]:
                setattr(self, f"{name}_seconds", getattr(self, f"{name}_seconds") + phases[name])

    @property
    def images_per_s(self) -> float:
        return self.measured_images / self.measured_seconds if self.measured_seconds > 0 else 0.0

    def breakdown_ms(self) -> dict[str, float] | None:
        """Mean milliseconds per step of every phase; ``None`` without a breakdown."""
        if self.breakdown_steps == 0:
            return None
        n = self.breakdown_steps
        out = {"data_wait": 1000 * self.data_wait_seconds / self.measured_steps}
        out.update({name: 1000 * getattr(self, f"{name}_seconds") / n for name in PHASES[1:]})
        return out

    def cpu_ms_per_step(self) -> float | None:
        """CPU milliseconds of the rank's process per measured step (all its threads)."""
        return 1000 * self.cpu_seconds / self.measured_steps if self.measured_steps and self.cpu_seconds > 0 else None

    def loader_cpu_ms_per_image(self) -> float | None:
        """CPU milliseconds the loader workers spent per image; ``None`` without workers."""
        return 1000 * self.loader_cpu_seconds / self.loader_images if self.loader_images and \
            self.loader_cpu_seconds > 0 else None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RankTiming:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in known})


class StepTimer:
    """Times the steps of one epoch on one rank without disturbing them.

    The loop calls :meth:`begin_data` / :meth:`end_data` around ``next(loader)``, :meth:`mark`
    after the forward (loss included) and after the backward, and :meth:`end_step` after the
    optimiser; the DDP communication hook calls :meth:`comm_ready` for every gradient bucket it
    hands to the all-reduce, so the time from the last one to the end of the backward is the
    communication the backward did not hide.

    On the CPU the marks are ``time.perf_counter`` readings. On CUDA they are CUDA events on the
    current stream, read in bulk every ``flush_every`` steps (one host synchronisation per
    window, none per step); the steady-state time is the host's wall-clock between two
    synchronisations, so nothing the GPU does goes unmeasured. The data wait is host time in
    both cases. With ``breakdown=False`` only the data wait and the step times are measured.
    """

    def __init__(self, device: torch.device, timing: RankTiming, breakdown: bool, flush_every: int = 25) -> None:
        self.cuda = device.type == "cuda"
        self.timing, self.breakdown, self.flush_every = timing, breakdown, flush_every
        self._pending: list[tuple[int, float, list[Any], Any]] = []
        self._marks: list[Any] = []
        self._comm: Any = None
        self._data_start = self._data = 0.0
        self._last = time.perf_counter()
        self._cpu_last = time.process_time()

    def _point(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_epoch(self) -> None:
        self.timing.start_epoch()
        self._pending.clear()
        self._sync_now()

    def _sync_now(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._last = time.perf_counter()
        self._cpu_last = time.process_time()

    def begin_data(self) -> None:
        self._data_start = time.perf_counter()

    def end_data(self) -> None:
        self._data = time.perf_counter() - self._data_start
        self._comm = None
        self._marks = [self._point()] if self.breakdown else []

    def mark(self) -> None:
        if self.breakdown:
            self._marks.append(self._point())

    def comm_ready(self) -> None:
        if self.breakdown:
            self._comm = self._point()

    def end_step(self, images: int) -> None:
        """Close the step (after the optimiser)."""
        if self.breakdown:
            self._marks.append(self._point())
        if self.timing.warming_up:
            self.timing.record_step(images, 0.0, 0.0)
            if not self.timing.warming_up:  # the steady state starts now: from a synchronised clock
                self._sync_now()
            return
        if not self.cuda:
            now, cpu = time.perf_counter(), time.process_time()
            step, self._last = now - self._last, now
            cpu_s, self._cpu_last = cpu - self._cpu_last, cpu
            self.timing.record_step(images, self._data, step - self._data,
                                    self._phases(self._marks, self._comm, step - self._data), cpu_s)
            return
        self._pending.append((images, self._data, self._marks, self._comm))
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Read the pending CUDA steps (one synchronisation) into the timing."""
        if not self._pending:
            return
        torch.cuda.synchronize()
        now, cpu = time.perf_counter(), time.process_time()
        window, self._last = now - self._last, now
        cpu_window, self._cpu_last = cpu - self._cpu_last, cpu
        step, cpu_s = window / len(self._pending), cpu_window / len(self._pending)
        for images, data, marks, comm in self._pending:
            self.timing.record_step(images, data, step - data, self._phases(marks, comm, step - data), cpu_s)
        self._pending.clear()

    def _phases(self, marks: list[Any], comm: Any, compute: float) -> dict[str, float] | None:
        """Seconds of forward, backward, comm, optimizer and the rest of ``compute`` from the marks."""
        if not self.breakdown or len(marks) != 4:
            return None
        if self.cuda:
            def span(a: Any, b: Any) -> float:
                return a.elapsed_time(b) / 1000.0
        else:
            def span(a: Any, b: Any) -> float:
                return b - a
        forward, backward, optimizer = (span(marks[k], marks[k + 1]) for k in range(3))
        # an all-reduce started during this backward: what came after its last bucket was exposed
        comm_s = min(max(span(comm, marks[2]), 0.0), backward) if comm is not None else 0.0
        other = max(compute - forward - backward - optimizer, 0.0)
        return {"forward": forward, "backward": backward - comm_s, "comm": comm_s, "optimizer": optimizer,
                "other": other}


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
    per_rank = [r.breakdown_ms() for r in ranks]
    if all(b is not None for b in per_rank):
        # ms per step of every phase: per rank, and their mean (the ranks step together)
        report["step_breakdown_ms_per_rank"] = per_rank
        report["step_breakdown_ms"] = {k: sum(b[k] for b in per_rank) / len(per_rank) for k in PHASES}
    cpu = [r.cpu_ms_per_step() for r in ranks]
    loader = [r.loader_cpu_ms_per_image() for r in ranks]
    # CPU demand (mean over ranks): what the projection's contention roofline needs
    report["cpu_ms_per_step"] = sum(cpu) / len(cpu) if all(c is not None for c in cpu) else None
    report["loader_cpu_ms_per_image"] = sum(loader) / len(loader) if all(x is not None for x in loader) else None
    report.update(extra)
    return report


def segment_summary(per_rank: list[dict[str, Any]], sem: dict[str, Any], start: list[int],
                    end: list[int]) -> dict[str, Any]:
    """One rank count's share of an elastic run: where it trained (epoch, batch of its own global
    batch), with what batches, and its own throughput, never merged with another rank count's."""
    ranks = [RankTiming.from_state(s) for s in per_rank]
    return {
        "world_size": len(ranks),
        "batch_per_rank": sem["batch_per_rank"],
        "global_batch": sem["global_batch"],
        "accumulate": sem["accumulate"],
        "start": {"epoch": start[0], "step": start[1]},
        "end": {"epoch": end[0], "step": end[1]},
        "images_per_s": sum(r.images_per_s for r in ranks),
        "images_per_s_per_rank": [r.images_per_s for r in ranks],
        "measured_steps": ranks[0].measured_steps,
        "epoch_seconds": ranks[0].epoch_seconds,
        "train_seconds": ranks[0].train_seconds,
    }
