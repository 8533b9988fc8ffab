"""Eager against compiled training steps (``train.compile: off | model | step``), side by side.

    .venv/bin/python benchmarks/bench_compile.py [--model gelan-t-detect] [--imgsz 64] [--batch 32]
                                                 [--modes off model step] [--rounds 7] [--steps 5]
                                                 [--threads 1] [--device cpu]

For each case every mode gets its own copy of one model (the same initial weights), its own fused
AdamW and EMA, and trains the same batches: a pool of 8 batches of random images whose targets
have different object counts per image (1-6, as mosaic batches do), padded by the loader's collate
into one bucket (16). A step is what the trainer does per batch at accumulate 1: forward, loss,
backward, optimiser, EMA update. The first call of each mode (its compilation) is timed apart and
reported; then rounds alternate between the modes (``off, model, step, off, ...``) so a noisy host
slows every mode alike, and each figure is the median over rounds of the mean over ``--steps``
steps, with the range over rounds. Beside img/s: the ratio to eager per round (median and range),
the graphs and graph breaks torch.compile reported, and the MFU against a matrix-multiply peak
measured on the same threads (:func:`detscale.engine.mfu.measure_peak`; training FLOPs = 3 x the
training-mode forward, :func:`detscale.engine.mfu.train_gflops_per_image`), and how far each
mode's weights end from eager's after the same steps (distance over distance moved) beside the
floor: an eager copy from weights one float32 ulp away, trained on the same batches (rounding alone;
AdamW's sign-like first steps make any rounding difference grow, as the lockstep runs show).

On CUDA (``--device cuda``) the steps are synchronised at the end of every round, not per step.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

from detscale.data.loader import collate
from detscale.engine.compiled import CompileWatch, forward_loss
from detscale.engine.ema import ModelEMA
from detscale.engine.mfu import measure_peak, train_gflops_per_image
from detscale.engine.optim import build_optimizer
from detscale.loss import DetectionLoss
from detscale.model import build_model

Batch = tuple[torch.Tensor, torch.Tensor]


def batches(batch: int, imgsz: int, nc: int, device: torch.device, n: int = 8) -> list[Batch]:
    """``n`` (images, padded targets) with 1-6 objects per image, all in the 16-object bucket."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        items = []
        for _ in range(batch):
            k = int(torch.randint(1, 7, (1,), generator=g))
            xy, wh = torch.rand(k, 2, generator=g) * 0.6 + 0.2, torch.rand(k, 2, generator=g) * 0.3 + 0.05
            cls = torch.randint(0, nc, (k, 1), generator=g).float()
            items.append((torch.zeros(3, 1, 1, dtype=torch.uint8), torch.cat((cls, xy, wh), 1), {}))
        _imgs, targets, _ = collate(items, bucket=16)
        x = torch.rand(batch, 3, imgsz, imgsz, generator=g).contiguous(memory_format=torch.channels_last)
        out.append((x.to(device), targets.to(device)))
    return out


def make_step(base: torch.nn.Module, mode: str, data: list[Batch]) -> tuple[Callable[[int], None], torch.nn.Module]:
    model = copy.deepcopy(base)
    optimizer = build_optimizer(model, "adamw", 1e-3, 0.9, 5e-4)
    ema = ModelEMA(model, 0.9999, 2000)
    fl = forward_loss(model, DetectionLoss(model), mode)

    def step(i: int) -> None:
        x, targets = data[i % len(data)]
        loss, _items = fl(x, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)

    return step, model


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([w.detach().double().flatten() for w in model.state_dict().values() if w.is_floating_point()])


def perturbed(base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with every weight multiplied by 1 + 1e-7 x N(0, 1): about one float32 ulp."""
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in model.parameters():
            w.mul_(1 + 1e-7 * torch.randn(w.shape, generator=g).to(w))
    return model


def apart(eager: torch.nn.Module | None, other: torch.nn.Module, start: torch.Tensor) -> float:
    if eager is None:
        return float("nan")
    w = flat_weights(eager)
    return ((flat_weights(other) - w).norm() / (w - start).norm()).item()


def bench(args: argparse.Namespace, batch: int, device: torch.device, peak: float) -> None:
    torch.manual_seed(0)
    base = build_model(args.model, nc=6).train().to(device).to(memory_format=torch.channels_last)
    gflops = train_gflops_per_image(base, args.imgsz)
    data = batches(batch, args.imgsz, 6, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    steps, stats, models = {}, {}, {}
    start = flat_weights(base)
    floor_step, floor_model = make_step(perturbed(base), "off", data)  # eager from one ulp away: the floor
    for mode in args.modes:
        watch = CompileWatch(mode, "default")
        watch.start()
        steps[mode], models[mode] = make_step(base, mode, data)
        steps[mode](0)
        sync()
        watch.first_step_done()
        for i in range(1, len(data)):  # every batch once: any recompilation happens here, untimed
            steps[mode](i)
        sync()
        stats[mode] = watch.report()
    for i in range(len(data)):
        floor_step(i)
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            t0 = time.perf_counter()
            for i in range(args.steps):
                steps[mode](r * args.steps + i)
            sync()
            times[mode].append((time.perf_counter() - t0) / args.steps)
        for i in range(args.steps):  # untimed: the floor trains the same batches
            floor_step(r * args.steps + i)
    print(f"\n{args.model} {args.imgsz} px, batch {batch}, {device.type}: {gflops:.3f} training GFLOPs per image")
    print(f"  {'mode':<6} {'first step s':>12} {'graphs':>6} {'breaks':>6} {'img/s (range)':>24} "
          f"{'x eager (range)':>20} {'MFU':>6} {'apart from eager':>17}")
    eager = times.get("off")
    for mode in args.modes:
        ips = [batch / t for t in times[mode]]
        s = stats[mode]
        first = s.get("first_step_seconds")
        ratio = ""
        if eager is not None:
            per_round = [e / t for e, t in zip(eager, times[mode], strict=True)]
            ratio = f"{statistics.median(per_round):.3f} ({min(per_round):.3f}-{max(per_round):.3f})"
        img_s = statistics.median(ips)
        drift = apart(models.get("off"), models[mode], start)
        print(f"  {mode:<6} {first if first is not None else float('nan'):12.1f} {s.get('graphs', 0):6d} "
              f"{s.get('graph_breaks', 0):6d} {f'{img_s:.1f} ({min(ips):.1f}-{max(ips):.1f})':>24} {ratio:>20} "
              f"{100 * img_s * gflops / peak:5.1f}% {drift:17.2e}")
    print(f"  {'floor':<6} {'':12} {'':6} {'':6} {'':>24} {'':>20} {'':>6} "
          f"{apart(models.get('off'), floor_model, start):17.2e}")
    print(f"  apart from eager: after the same {len(data) + args.rounds * args.steps} steps on the same batches, "
          "|w - w_eager| / |w_eager - w_start| over all weights; floor: the same for an eager run from weights one "
          "float32 ulp away (rounding alone)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gelan-t-detect")
    parser.add_argument("--imgsz", type=int, default=64)
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--modes", nargs="+", default=["off", "model", "step"], choices=["off", "model", "step"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a CPU rank of the default config: 1)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peak = measure_peak(device, "fp32")
    print(f"torch {torch.__version__}, {args.threads} thread(s), peak {peak['gflops']:.1f} GFLOP/s ({peak['method']}); "
          f"medians of {args.rounds} alternated rounds of {args.steps} steps, compilation excluded")
    for batch in args.batch:
        bench(args, batch, device, peak["gflops"])


if __name__ == "__main__":
    main()
