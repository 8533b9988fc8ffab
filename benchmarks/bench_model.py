"""Forward+backward throughput of the detectors on the CPU, eager and with ``torch.compile``.

    .venv/bin/python benchmarks/bench_model.py [--steps 3] [--warmup 1] [--threads 2] [--no-compile]

Prints one table row per (model, image size, mode): images per second of forward + loss +
backward with batch 8 and random targets; the warm-up steps (and compilation) are not timed.
Where ``torch.compile`` fails, the row says why instead of a number.
"""

from __future__ import annotations

import argparse
import time

import torch

from detscale.loss import DetectionLoss
from detscale.model import build_model

CASES = (("gelan-t", 256), ("gelan-s", 640))


def random_targets(batch: int, per_image: int = 4, nc: int = 80) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n = batch * per_image
    img = torch.arange(batch).repeat_interleave(per_image).float()
    cls = torch.randint(0, nc, (n,), generator=g).float()
    cxcy = torch.rand(n, 2, generator=g) * 0.6 + 0.2
    wh = torch.rand(n, 2, generator=g) * 0.3 + 0.05
    return torch.cat((img[:, None], cls[:, None], cxcy, wh), 1)


def images_per_s(name: str, imgsz: int, batch: int, steps: int, warmup: int, compile_model: bool) -> float:
    torch.manual_seed(0)
    model = build_model(name, nc=80).train()
    criterion = DetectionLoss(model)
    forward = torch.compile(model) if compile_model else model
    x, targets = torch.rand(batch, 3, imgsz, imgsz), random_targets(batch)

    def step() -> None:
        loss, _ = criterion(forward(x), targets)
        model.zero_grad(set_to_none=True)
        loss.backward()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup} warm-up")
    print(f"{'model':<10}{'imgsz':>6}  {'mode':<8}{'img/s':>10}")
    for name, imgsz in CASES:
        for mode in ("eager",) if args.no_compile else ("eager", "compile"):
            try:
                value = f"{images_per_s(name, imgsz, args.batch, args.steps, args.warmup, mode == 'compile'):10.2f}"
            except Exception as exc:  # torch.compile can fail for toolchain reasons; report, keep going
                value = f"  failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
            print(f"{name:<10}{imgsz:>6}  {mode:<8}{value}", flush=True)


if __name__ == "__main__":
    main()
