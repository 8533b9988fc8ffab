"""Section ``throughput``: steady-state img/s, peak memory and data-wait share through the real loop
with its instruments on, and the same loop with none attached, in alternating epochs, so the
instruments' cost on a GPU is measured side by side on the loop that trains."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from detscale.config import TrainConfig
from detscale.engine.build import build_loaders, build_parts
from detscale.engine.loop import Hook, Hooks, LoopState, standard_hooks, train_one_epoch
from detscale.engine.semantics import TrainSemantics, derive_semantics
from detscale.engine.state import Parts, Progress
from detscale.engine.stopflag import StopFlag
from detscale.engine.timing import RankTiming
from gpukit.kit import Kit, Sizes, experiment, one_card, sync


class SteadyWindow(Hook):
    """The bare measurement's one observer: no clock read and no synchronisation per step.

    Counts the images after ``warmup_steps`` batches, starting the clock there after one
    synchronisation; stops the epoch after ``max_steps`` batches when given.
    """

    def __init__(self, warmup_steps: int, max_steps: int | None = None) -> None:
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.t_epoch = time.perf_counter()
        self.t0: float | None = None
        self.images = self.done = 0

    def epoch_start(self, epoch: int, step: int, batches: int) -> None:
        self.t_epoch = time.perf_counter()
        self.t0 = self.t_epoch if self.warmup_steps == 0 else None

    def step_end(self, step: int, images: int, loss_sum: torch.Tensor) -> None:
        self.done = step + 1
        if step >= self.warmup_steps:
            self.images += images
        elif self.done == self.warmup_steps:  # where the loop requests batch warmup_steps
            sync()
            self.t0 = time.perf_counter()

    def should_stop(self) -> bool:
        return self.max_steps is not None and self.done >= self.max_steps


def bare_epoch(parts: Parts, loader: Any, epoch: int, sem: TrainSemantics, tcfg: TrainConfig, dev: torch.device,
               warmup_steps: int, max_steps: int | None = None, extra: tuple[Hook, ...] = ()) -> dict:
    """The trainer's own loop (``train_one_epoch``) with none of its instruments attached: only
    :class:`SteadyWindow`, which synchronises where the steady-state window starts and ends (and
    ``extra`` hooks, such as the compile watch's :class:`~detscale.engine.loop.FirstStep`)."""
    window = SteadyWindow(warmup_steps, max_steps)
    result = train_one_epoch(LoopState(parts, loader, sem, tcfg, dev, Progress()), epoch,
                             Hooks([window, *extra]) if extra else window)
    sync()
    end = time.perf_counter()
    return {"epoch_s": end - window.t_epoch,
            "steady_images_per_s": window.images / (end - window.t0) if window.t0 is not None else 0.0,
            "loss_finite": all(v == v and abs(v) != float("inf") for v in result.losses)}


def instrumented_epoch(parts: Parts, loader: Any, epoch: int, sem: TrainSemantics, tcfg: TrainConfig,
                       dev: torch.device, warmup_steps: int) -> dict:
    """One epoch of the real loop (``train_one_epoch``) with the hooks ``detscale train`` attaches."""
    timing = RankTiming(warmup_steps)
    loop = LoopState(parts, loader, sem, tcfg, dev, Progress())
    sync()
    t0 = time.perf_counter()
    result = train_one_epoch(loop, epoch, standard_hooks(loop, timing, StopFlag()))
    sync()
    busy = timing.data_wait_seconds + timing.compute_seconds
    return {"epoch_s": time.perf_counter() - t0, "steady_images_per_s": timing.images_per_s,
            "data_wait_share": timing.data_wait_seconds / busy if busy else 0.0,
            "loss_finite": all(v == v and abs(v) != float("inf") for v in result.losses)}


def section_throughput(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    card = one_card(kit.work)
    dev, paths, precision, info, nc = card.dev, card.paths, card.precision, card.info, card.nc
    rows = []
    for model, batch in sizes.throughput_points():
        if kit.left() < 25:
            rows.append({"model": model, "batch": batch, "skipped": "budget"})
            continue
        cfg = experiment(paths.data_yaml, model, sizes.imgsz, batch, precision=precision, workers=sizes.workers,
                         warmup_epochs=0, nominal=batch, epochs=100, warmup_steps=sizes.tp_warmup_steps)
        point = cfg.runs()[0]
        sem = derive_semantics(cfg, point, 1, dev.type)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        parts = build_parts(point, nc, sem, cfg.train, info)
        loader, _ = build_loaders(point, cfg, paths.data_yaml, paths.cache_dir, sem, info, with_val=False)
        # workers started, cuDNN autotuned for this shape, allocator grown: a few steps suffice
        warm = bare_epoch(parts, loader, 0, sem, cfg.train, dev, sizes.tp_warmup_steps, sizes.tp_warmup_steps + 5)
        on, off = [], []
        for r in range(sizes.tp_rounds):
            order = ("on", "off") if (r + len(rows)) % 2 == 0 else ("off", "on")
            for mode in order:
                epoch = 1 + len(on) + len(off)
                if mode == "on":
                    on.append(instrumented_epoch(parts, loader, epoch, sem, cfg.train, dev,
                                                 sizes.tp_warmup_steps))
                else:
                    off.append(bare_epoch(parts, loader, epoch, sem, cfg.train, dev, sizes.tp_warmup_steps))
        row: dict[str, Any] = {
            "model": model, "batch": batch, "precision": precision, "channels_last": True,
            "steps_per_epoch": len(loader), "warmup_steps_excluded": sizes.tp_warmup_steps, "rounds": len(on),
            "warm_epoch_s": round(warm["epoch_s"], 2),
            "instrumented_images_per_s": statistics.median(e["steady_images_per_s"] for e in on),
            "bare_images_per_s": statistics.median(e["steady_images_per_s"] for e in off),
            "instrumented_epoch_s": statistics.median(e["epoch_s"] for e in on),
            "bare_epoch_s": statistics.median(e["epoch_s"] for e in off),
            "data_wait_share": statistics.median(e["data_wait_share"] for e in on),
            "loss_finite": all(e["loss_finite"] for e in on + off + [warm]),
        }
        # the instrument's cost: wall time of the same epoch with and without it
        row["instrument_cost"] = row["instrumented_epoch_s"] / row["bare_epoch_s"] - 1
        if dev.type == "cuda":
            row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
            row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(dev) / 2**30, 2)
        rows.append(row)
        print(f"  {model} b{batch}: {row['instrumented_images_per_s']:.0f} img/s instrumented, "
              f"{row['bare_images_per_s']:.0f} bare, data wait {100 * row['data_wait_share']:.0f}%", flush=True)
        del parts, loader
    failed = any(not r.get("loss_finite", True) for r in rows)
    return {"imgsz": sizes.imgsz, "workers": sizes.workers, "rows": rows, "failed": failed}
