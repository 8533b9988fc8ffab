"""All-reduce benchmark: the model's gradient, bucketed as DDP buckets it, on the run's backend.

Every rank builds the run's model, wraps it in DDP with the trainer's settings and trains one
batch, so DDP settles its buckets (it rebuilds them after the first backward, in the order the
gradients arrive); the bucket sizes it reports are then all-reduced as DDP would, all buckets
in flight together, ``iters`` times after ``warmup`` untimed rounds. A sweep over message sizes
gives the two constants of the alpha-beta model the scaling projection uses,
``t(S) = latency + S * 2 (n - 1) / n / busbw``, fitted by least squares.

A contention probe times the model's forward and backward on one rank alone (the others wait)
and on every rank at once, in interleaved rounds: the median ratio is how much a rank's own work
slows when all ranks of the node compute together (shared caches and memory bandwidth of CPU
ranks, the host side of the cards), the projection's ``contention`` factor; the lowest and
highest round are its spread.

Figures follow nccl-tests' definitions for all-reduce: algorithm bandwidth ``algbw = S / t``
and bus bandwidth ``busbw = algbw * 2 (n - 1) / n`` (what each link carries in a ring, so it is
comparable across rank counts).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from detscale import dist

SWEEP_BYTES = tuple(4096 * 4**k for k in range(8))  # 4 KiB .. 64 MiB


def bus_factor(world: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor ``2 (n - 1) / n``."""
    return 2 * (world - 1) / world


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_allreduce(buffers: list[torch.Tensor], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Seconds of each of ``iters`` rounds that all-reduce every buffer (all in flight together)."""
    import torch.distributed as tdist

    times = []
    for k in range(warmup + iters):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        works = [tdist.all_reduce(b, async_op=True) for b in buffers]
        for w in works:
            w.wait()
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    # every rank's round ends when the slowest rank's does: report the slowest
    return [max(ts) for ts in zip(*dist.all_gather_object(times), strict=True)]


def _model_and_batch(model_name: str, nc: int, imgsz: int, channels_last: bool, device: torch.device,
                     batch: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The run's model in its memory format, a random batch and one box per image (seeded)."""
    from detscale.model import build_model

    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = build_model(model_name, nc).to(device).to(memory_format=fmt).train()
    x = torch.rand(batch, 3, imgsz, imgsz, device=device).contiguous(memory_format=fmt)
    targets = torch.tensor([[i, i % nc, 0.5, 0.5, 0.4, 0.4] for i in range(batch)], device=device,
                           dtype=torch.float32)
    return model, x, targets


def ddp_bucket_bytes(model_name: str, nc: int, imgsz: int, channels_last: bool, device: torch.device) -> list[int]:
    """The sizes of the gradient buckets DDP settles on for the model, after one training batch."""
    from detscale.engine.ddp import wrap_ddp
    from detscale.loss import DetectionLoss

    model, x, targets = _model_and_batch(model_name, nc, imgsz, channels_last, device, 2)
    ddp = wrap_ddp(model, device)
    loss, _ = DetectionLoss(model)(ddp(x), targets)
    loss.backward()
    sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    buckets = [int(s) for s in sizes.split(",") if s.strip()]
    if not buckets:  # an older torch without the logging field: one bucket of the whole gradient
        buckets = [sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)]
    return buckets


def contention_probe(model_name: str, nc: int, imgsz: int, channels_last: bool, device: torch.device, batch: int,
                     steps: int = 3, warmup: int = 2, rounds: int = 5) -> dict[str, Any]:
    """How much a rank's forward+backward slows with every rank of the node busy, over ``rounds`` rounds.

    Each round times ``steps`` batches on rank 0 alone (the others wait: the idle baseline) and then
    on every rank at once; its factor is together / alone. Interleaving the two makes a burst of
    load from outside hit one round, not the whole baseline or the whole busy side: the median
    factor over the rounds is the projection's contention, and the lowest and highest round its
    spread, which the report carries into the projected img/s as an interval.
    """
    from detscale.loss import DetectionLoss

    model, x, targets = _model_and_batch(model_name, nc, imgsz, channels_last, device, batch)
    criterion = DetectionLoss(model)

    def timed(n: int) -> list[float]:
        times = []
        for _ in range(n):
            _sync(device)
            t0 = time.perf_counter()
            loss, _ = criterion(model(x), targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - t0)
        return times

    timed(warmup)  # every rank, untimed: allocator, kernels and caches warm
    alone_rounds, together_rounds, factors = [], [], []
    for _ in range(rounds):
        dist.barrier()
        alone = timed(steps) if dist.get_rank() == 0 else []
        dist.barrier()
        together = timed(steps)
        dist.barrier()
        alone_s = statistics.median(dist.all_gather_object(alone)[0])
        # every rank's median, then the slowest rank: a step waits for the slowest
        together_s = max(statistics.median(ts) for ts in dist.all_gather_object(together))
        alone_rounds.append(alone_s)
        together_rounds.append(together_s)
        factors.append(together_s / alone_s)
    return {"batch": batch, "steps": steps, "rounds": rounds,
            "alone_ms": 1000 * statistics.median(alone_rounds),
            "together_ms": 1000 * statistics.median(together_rounds),
            "factor": statistics.median(factors), "factor_min": min(factors), "factor_max": max(factors),
            "factor_rounds": factors}


def fit_alpha_beta(sizes: list[int], seconds: list[float], world: int) -> tuple[float, float]:
    """``(latency s, busbw bytes/s)`` of ``t = latency + S * bus_factor / busbw`` by least squares."""
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    busbw = bus_factor(world) / slope if slope > 0 else float("inf")
    return max(float(intercept), 0.0), float(busbw)


def benchmark(model_name: str, nc: int, imgsz: int, channels_last: bool, iters: int = 20,
              warmup: int = 5, sweep_iters: int = 10, batch: int = 16) -> dict[str, Any]:
    """Run on every rank of an initialised process group; every rank returns the same result."""
    import torch.distributed as tdist

    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    buckets = ddp_bucket_bytes(model_name, nc, imgsz, channels_last, device)
    buffers = [torch.ones(n // 4, device=device) for n in buckets]  # float32 gradients
    rounds = time_allreduce(buffers, device, iters, warmup)
    total = sum(buckets)
    median = statistics.median(rounds)
    sweep = []
    for size in SWEEP_BYTES:
        times = time_allreduce([torch.ones(size // 4, device=device)], device, sweep_iters, 2)
        t = statistics.median(times)
        sweep.append({"bytes": size, "time_ms": 1000 * t, "algbw_GBps": size / t / 1e9,
                      "busbw_GBps": size / t / 1e9 * bus_factor(world)})
    latency, busbw = fit_alpha_beta([s["bytes"] for s in sweep], [s["time_ms"] / 1000 for s in sweep], world)
    contention = contention_probe(model_name, nc, imgsz, channels_last, device, batch)
    return {
        "model": model_name, "imgsz": imgsz, "nc": nc, "world_size": world, "backend": tdist.get_backend(),
        "device": device.type, "bucket_bytes": buckets, "gradient_bytes": total, "iters": iters, "warmup": warmup,
        "time_ms": 1000 * median, "time_ms_p10": 1000 * float(np.percentile(rounds, 10)),
        "time_ms_p90": 1000 * float(np.percentile(rounds, 90)),
        "algbw_GBps": total / median / 1e9, "busbw_GBps": total / median / 1e9 * bus_factor(world),
        "sweep": sweep, "fit": {"latency_us": 1e6 * latency, "busbw_GBps": busbw / 1e9},
        "contention": contention,
    }
