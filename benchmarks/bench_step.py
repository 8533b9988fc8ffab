"""Where one CPU training step's time goes, and what the optimiser and EMA implementations cost.

    .venv/bin/python benchmarks/bench_step.py [--model gelan-t-detect] [--imgsz 64] [--batch 16 32]
                                              [--rounds 7] [--steps 5] [--threads 1]

For each batch size it times the parts of an optimiser step as the trainer runs them (forward,
loss, backward, optimiser, EMA update), channels_last, with a fixed set of targets (two objects
per image), then times the optimiser and the EMA against their alternatives side by
side, in alternating rounds on the same weights and gradients:

* optimiser: ``fused=True`` (what :func:`detscale.engine.optim.build_optimizer` picks where torch
  has the kernels) against the default implementation (a Python loop over the tensors on the CPU);
* EMA: :class:`detscale.engine.ema.ModelEMA` (tensor lists built once) against walking both
  models' ``parameters()`` and ``buffers()`` every update with the same two ``_foreach`` kernels.

Each figure is the median over ``--rounds`` rounds of ``--steps`` steps after untimed warm-up
steps; the range over rounds follows it. The last line of each batch size is what the two
choices save per optimiser step, and the share of a step (one batch forward and backward plus
the update) that is.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
from collections.abc import Callable

import torch
from bench_model import random_targets

from detscale.engine.ema import ModelEMA
from detscale.engine.optim import build_optimizer
from detscale.loss import DetectionLoss
from detscale.model import build_model


def walking_update(ema: ModelEMA, model: torch.nn.Module) -> None:
    """The EMA update as it was before the tensor lists were kept: both models walked every time."""
    ema.updates += 1
    d = ema.decay(ema.updates)
    averaged, values = [], []
    with torch.no_grad():
        for avg, value in itertools.chain(zip(ema.module.parameters(), model.parameters(), strict=True),
                                          zip(ema.module.buffers(), model.buffers(), strict=True)):
            if avg.dtype.is_floating_point:
                averaged.append(avg)
                values.append(value)
            else:
                avg.copy_(value)
        torch._foreach_mul_(averaged, d)
        torch._foreach_add_(averaged, values, alpha=1 - d)


def median_ms(fn: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) * 1e3 / steps


def side_by_side(cases: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(median_ms(fn, steps))
    return times


def show(name: str, values: list[float]) -> str:
    return f"{name} {statistics.median(values):7.2f} ms ({min(values):.2f}-{max(values):.2f})"


def bench(model_name: str, imgsz: int, batch: int, rounds: int, steps: int) -> None:
    torch.manual_seed(0)
    model = build_model(model_name, nc=6).train().to(memory_format=torch.channels_last)
    criterion = DetectionLoss(model)
    x = torch.rand(batch, 3, imgsz, imgsz).contiguous(memory_format=torch.channels_last)
    t = random_targets(batch, per_image=2, nc=6)
    optimizer = build_optimizer(model, "adamw", 1e-3, 0.9, 5e-4)
    ema = ModelEMA(model, 0.9999, 2000)
    parts: dict[str, list[float]] = {k: [] for k in ("forward", "loss", "backward", "optimizer", "ema")}
    for i in range(2 + rounds * steps):
        t0 = time.perf_counter()
        preds = model(x)
        t1 = time.perf_counter()
        loss, _ = criterion(preds, t)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        ema.update(model)
        t5 = time.perf_counter()
        if i >= 2:
            for key, a, b in (("forward", t0, t1), ("loss", t1, t2), ("backward", t2, t3),
                              ("optimizer", t3, t4), ("ema", t4, t5)):
                parts[key].append((b - a) * 1e3)
    step_ms = sum(statistics.median(v) for v in parts.values())
    fused = bool(optimizer.defaults.get("fused"))
    print(f"\n{model_name} {imgsz} px, batch {batch}: {step_ms:.1f} ms per step ({batch * 1e3 / step_ms:.1f} img/s), "
          f"optimiser {'fused' if fused else 'default'}")
    for key, values in parts.items():
        print(f"  {show(f'{key:<10}', values)}")

    # the alternatives, on the same weights (gradients left in place so every step has work to do)
    loss, _ = criterion(model(x), t)
    loss.backward()
    default = torch.optim.AdamW([{k: v for k, v in g.items() if k not in ("fused", "foreach")}
                                 for g in optimizer.param_groups], lr=1e-3, betas=(0.9, 0.999))
    walking = copy.deepcopy(ema)
    times = side_by_side({"optimizer, fused": optimizer.step, "optimizer, default": default.step,
                          "ema, lists kept": lambda: ema.update(model),
                          "ema, walking": lambda: walking_update(walking, model)}, rounds, steps)
    for name, values in times.items():
        print(f"  {show(f'{name:<20}', values)}")
    saved = (statistics.median(times["optimizer, default"]) - statistics.median(times["optimizer, fused"])
             + statistics.median(times["ema, walking"]) - statistics.median(times["ema, lists kept"]))
    print(f"  saved per optimiser step: {saved:.1f} ms, {saved / (step_ms + saved):.0%} of a one-batch step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gelan-t-detect")
    parser.add_argument("--imgsz", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a CPU rank of the default config: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); medians of {args.rounds} rounds of {args.steps} steps")
    for batch in args.batch:
        bench(args.model, args.imgsz, batch, args.rounds, args.steps)


if __name__ == "__main__":
    main()
