"""Training-step throughput of the detectors on the CPU: NCHW vs channels_last, and ``torch.compile``.

    .venv/bin/python benchmarks/bench_model.py [--rounds 5] [--steps 3] [--threads 1] [--compile]

For each case (model, image size, batch) it times forward + loss + backward with random targets
in the default NCHW layout and in channels_last (the ``train.channels_last`` setting). The two
layouts run in alternating rounds of ``--steps`` steps, after untimed warm-up steps, and each
row gives the median img/s over the rounds; the ratio is of the medians, so slow drift of a
shared machine hits both alike. ``--compile`` adds a ``torch.compile`` row per case (compilation
happens in the warm-up; where it fails, the row says why instead of a number).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from detscale.loss import DetectionLoss
from detscale.model import build_model

# (model, image size, batch): the default config's point first, then the larger ones
CASES = (("gelan-t", 64, 32), ("gelan-t", 256, 8), ("gelan-s", 640, 4))


def random_targets(batch: int, per_image: int = 4, nc: int = 80) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n = batch * per_image
    img = torch.arange(batch).repeat_interleave(per_image).float()
    cls = torch.randint(0, nc, (n,), generator=g).float()
    cxcy = torch.rand(n, 2, generator=g) * 0.6 + 0.2
    wh = torch.rand(n, 2, generator=g) * 0.3 + 0.05
    return torch.cat((img[:, None], cls[:, None], cxcy, wh), 1)


def make_step(name: str, imgsz: int, batch: int, mode: str) -> Callable[[], None]:
    """One training step's work (no optimiser update: it is the same in every layout)."""
    torch.manual_seed(0)
    model = build_model(name, nc=80).train()
    criterion = DetectionLoss(model)
    x, targets = torch.rand(batch, 3, imgsz, imgsz), random_targets(batch)
    if mode == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    forward = torch.compile(model) if mode == "compile" else model

    def step() -> None:
        loss, _ = criterion(forward(x), targets)
        model.zero_grad(set_to_none=True)
        loss.backward()

    return step


def timed(step: Callable[[], None], steps: int, batch: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed rounds per layout")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a CPU rank of the default config: 1)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (slow to compile on 2 cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s); median of {args.rounds} alternating rounds of "
          f"{args.steps} steps after {args.warmup} warm-up steps")
    print(f"{'model':<10}{'imgsz':>6}{'batch':>6}  {'mode':<14}{'img/s':>10}")
    for name, imgsz, batch in CASES:
        layouts = {mode: make_step(name, imgsz, batch, mode) for mode in ("eager", "channels_last")}
        rates: dict[str, list[float]] = {mode: [] for mode in layouts}
        for step in layouts.values():
            for _ in range(args.warmup):
                step()
        for _ in range(args.rounds):
            for mode, step in layouts.items():
                rates[mode].append(timed(step, args.steps, batch))
        eager = statistics.median(rates["eager"])
        for mode in layouts:
            rate = statistics.median(rates[mode])
            ratio = f"  ({rate / eager:.2f}x eager; rounds {min(rates[mode]):.1f}-{max(rates[mode]):.1f})"
            print(f"{name:<10}{imgsz:>6}{batch:>6}  {mode:<14}{rate:10.2f}{ratio}", flush=True)
        if args.compile:
            try:
                step = make_step(name, imgsz, batch, "compile")
                for _ in range(args.warmup):
                    step()
                value = f"{statistics.median(timed(step, args.steps, batch) for _ in range(args.rounds)):10.2f}"
            except Exception as exc:  # torch.compile can fail for toolchain reasons; report, keep going
                value = f"  failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            print(f"{name:<10}{imgsz:>6}{batch:>6}  {'compile':<14}{value}", flush=True)


if __name__ == "__main__":
    main()
