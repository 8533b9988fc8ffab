"""All-reduce benchmark of a grid point's model on this rank count (every rank runs this).

    detscale launch --gpus 2 -- comm --config C --model gelan-t --imgsz 64 --data D --out results/comm/X.json

Times the all-reduce of the model's gradient in DDP's own buckets and a sweep of message sizes
(:mod:`detscale.allreduce_bench`); rank 0 writes the JSON and prints a summary. On a host without CUDA the
ranks are CPU processes with gloo, as in training.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="experiment config YAML")
    parser.add_argument("--model", required=True, help="model of the grid point")
    parser.add_argument("--imgsz", required=True, type=int, help="image size of the grid point")
    parser.add_argument("--data", required=True, type=Path, help="data.yaml (for the number of classes)")
    parser.add_argument("--out", required=True, type=Path, help="JSON to write (results/comm/...json)")
    parser.add_argument("--iters", type=int, default=20, help="timed rounds of the whole gradient (default 20)")
    parser.add_argument("--batch", type=int, default=16,
                        help="batch per rank of the contention probe (the grid point's; default 16)")


def run(args: argparse.Namespace) -> int:
    from detscale import config, dist
    from detscale.allreduce_bench import benchmark
    from detscale.data.formats import load_spec
    from detscale.files import write_text
    from detscale.model import build_model

    cfg = config.load(args.config)
    build_model(args.model, 1)  # a clear error for an unknown model before any collective
    nc = load_spec(args.data, splits=()).nc
    with dist.process_group(cfg.train.timeout_s, cfg.train.cpu_threads_per_rank) as info:
        if info.world_size < 2:
            raise config.ConfigError("the all-reduce benchmark needs 2 or more ranks; launch it with --gpus 2 or more")
        result = benchmark(args.model, nc, args.imgsz, cfg.train.channels_last, iters=args.iters,
                           batch=args.batch)
        if info.is_main:
            write_text(json.dumps(result, indent=2) + "\n", args.out)
            mib = result["gradient_bytes"] / 2**20
            print(f"all-reduce of {mib:.1f} MiB ({len(result['bucket_bytes'])} DDP buckets) on {info.world_size} "
                  f"{result['device']} ranks ({result['backend']}): {result['time_ms']:.2f} ms median over "
                  f"{result['iters']} rounds, algbw {result['algbw_GBps']:.2f} GB/s, busbw {result['busbw_GBps']:.2f} "
                  f"GB/s; fit: latency {result['fit']['latency_us']:.0f} us, busbw {result['fit']['busbw_GBps']:.2f} "
                  f"GB/s; contention: a rank's forward+backward x{result['contention']['factor']:.3f} "
                  f"(x{result['contention']['factor_min']:.3f}-x{result['contention']['factor_max']:.3f} over "
                  f"{result['contention']['rounds']} rounds) with all {info.world_size} ranks busy -> {args.out}")
    return 0
