"""Section ``profile``: where one training step's time goes, without the loader."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from detscale import dist
from detscale.engine.build import build_parts
from detscale.engine.loop import to_input
from detscale.engine.semantics import derive_semantics
from gpukit.kit import Kit, Sizes, data_paths, device, experiment, sync
from gpukit.models import fake_targets


def section_profile(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    """One model's step split into forward, loss, backward, optimiser (+ EMA), and the top operators.

    The input batch stays on the device (no loader): what is left is the step itself. Each part is
    timed with a synchronisation around it over ``repeats`` steps; then ``torch.profiler`` records
    three whole steps and lists the operators by self CPU time and by device time.
    """
    dev = device()
    paths = data_paths(kit.work)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    model = sizes.tp_models[0]
    batch = sizes.tp_batches[1]
    torch.backends.cudnn.benchmark = dev.type == "cuda"
    cfg = experiment(paths.data_yaml, model, sizes.imgsz, batch, precision=precision, warmup_epochs=0, nominal=batch)
    point = cfg.runs()[0]
    sem = derive_semantics(cfg, point, 1, dev.type)
    parts = build_parts(point, 80, sem, cfg.train, dist.init_from_env(600))
    x = to_input(torch.randint(0, 255, (batch, 3, sizes.imgsz, sizes.imgsz), dtype=torch.uint8), dev, True)
    targets = fake_targets(batch, 80, dev)

    def step(timed: dict[str, float] | None) -> None:
        marks = [time.perf_counter()]

        def mark() -> None:
            if timed is not None:
                sync()
                marks.append(time.perf_counter())

        with torch.autocast(dev.type, dtype=parts.amp_dtype or torch.float32, enabled=parts.amp_dtype is not None):
            preds = parts.model(x)
            mark()
            loss, _items = parts.loss_fn(preds, targets)
            mark()
        parts.scaler.scale(loss).backward()
        mark()
        parts.scaler.unscale_(parts.optimizer)
        torch.nn.utils.clip_grad_norm_(parts.raw.parameters(), max_norm=cfg.train.clip_grad_norm)
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
        parts.optimizer.zero_grad(set_to_none=True)
        mark()
        parts.ema.update(parts.raw)
        mark()
        if timed is not None:
            for name, a, b in zip(("forward", "loss", "backward", "optimizer", "ema"), marks, marks[1:], strict=False):
                timed[name] = timed.get(name, 0.0) + (b - a) * 1000

    parts.model.train()
    for _ in range(3):  # warm-up: cudnn autotuning, allocator growth
        step(None)
    sync()
    repeats = 5
    timed: dict[str, float] = {}
    for _ in range(repeats):
        step(timed)
    parts_ms = {k: round(v / repeats, 2) for k, v in timed.items()}
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(None)
    sync()
    unsynced_ms = (time.perf_counter() - t0) * 1000 / repeats
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step(None)
        sync()
    events = prof.key_averages()
    device_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"

    def top(key: str) -> list[dict[str, Any]]:
        rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:25]
        return [{"op": e.key, "calls_per_step": e.count / 3, "self_cpu_ms_per_step": e.self_cpu_time_total / 3000,
                 "self_device_ms_per_step": getattr(e, device_attr, 0) / 3000} for e in rows]

    kernels = sum(e.count for e in events if getattr(e, device_attr, 0) > 0) / 3
    return {"model": model, "batch": batch, "imgsz": sizes.imgsz, "precision": precision, "ms_per_part": parts_ms,
            "step_ms_unsynchronised": round(unsynced_ms, 2), "images_per_s": batch * 1000 / unsynced_ms,
            "ops_with_device_time_per_step": kernels, "top_self_cpu": top("self_cpu_time_total"),
            "top_self_device": top(device_attr)}
