"""What the training loop's instruments cost: the loop with the hooks ``detscale train`` attaches
against the same loop with none, side by side, on 1 and 2 CPU ranks.

    .venv/bin/python benchmarks/bench_hooks.py [--ranks 1 2] [--rounds 5] [--work results/bench_hooks]

The default config's grid point (gelan-t-detect, 64 px, batch 32 per rank, accumulation to 64
images, disk cache, 1 thread per rank) trains on the default config's synthetic data (generated
into ``--work``). Each rank count builds its parts and loader once (in one process per rank, a
gloo group for 2), trains one warm-up epoch, then ``--rounds`` pairs of epochs in alternating
order: one with :func:`detscale.engine.loop.standard_hooks` (the step timer, the progress bar,
the stop vote's all-reduce at every optimiser step, the loader CPU accounting) and one bare
(only the steady-state window of ``benchmarks/gpukit/throughput.py``: no per-step clock, no
synchronisation, no vote). The figure is the median over the pairs of the ratio of their epoch
wall times, with the pairs' range: the instruments are within the noise when the range holds 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import yaml

ROOT = Path(__file__).resolve().parents[1]


def detscale(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "detscale", *args], check=True, cwd=cwd, stdout=subprocess.DEVNULL)


def prepare(work: Path) -> tuple[dict[str, Any], Path, Path]:
    """The default config's data (generated once into ``work``) and the config as a dict."""
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    syn = raw["dataset"]["synthetic"]
    data = work / "data"
    if not (data / "data.yaml").is_file():
        detscale("synth", "--out", str(data), "--seed", str(syn["seed"]), "--imgsz", str(syn["imgsz"]),
                 "--train", str(syn["train"]), "--val", "8", "--objects", *map(str, syn["objects"]),
                 "--object-size", *map(str, syn["object_size"]), cwd=work)
    cache = work / "cache"
    detscale("cache", "--data", str(data / "data.yaml"), "--split", "train", "--imgsz", str(raw["grid"]["imgsz"][0]),
             "--out", str(cache), cwd=work)
    raw["dataset"] = {"name": "bench", "data_yaml": str(data / "data.yaml")}
    raw["grid"].update(epochs=1000, seeds=[0])
    raw["train"].update(warmup_epochs=0, val_interval=0)
    return raw, data / "data.yaml", cache


def worker(rank: int, world: int, store: str, raw: dict[str, Any], data_yaml: str, cache_dir: str, rounds: int,
           result: str) -> None:
    # imported here: the spawned process sets the thread count before torch's pools start
    torch.set_num_threads(1)
    from gpukit.throughput import bare_epoch, instrumented_epoch

    from detscale import config, dist
    from detscale.data.formats import load_spec
    from detscale.engine.build import build_loaders, build_parts
    from detscale.engine.semantics import derive_semantics

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    tdist.init_process_group("gloo", store=tdist.FileStore(store, world), rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=300))
    try:
        info = dist.init_from_env(300, cpu_threads=1)
        cfg = config.from_dict(raw)
        point = next(p for p in cfg.runs() if p.gpus == world)
        sem = derive_semantics(cfg, point, world, "cpu")
        parts = build_parts(point, load_spec(Path(data_yaml), splits=()).nc, sem, cfg.train, info)
        loader, _ = build_loaders(point, cfg, Path(data_yaml), Path(cache_dir), sem, info, with_val=False)
        warm = cfg.train.timing_warmup_steps
        bare_epoch(parts, loader, 0, sem, cfg.train, info.device, warm)  # workers started, allocator grown
        on: list[dict[str, Any]] = []
        off: list[dict[str, Any]] = []
        for r in range(rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                epoch = 1 + len(on) + len(off)
                if mode == "on":
                    on.append(instrumented_epoch(parts, loader, epoch, sem, cfg.train, info.device, warm))
                else:
                    off.append(bare_epoch(parts, loader, epoch, sem, cfg.train, info.device, warm))
        if rank == 0:
            Path(result).write_text(json.dumps({"on": on, "off": off, "steps_per_epoch": len(loader),
                                                "accumulate": sem.accumulate, "global_batch": sem.global_batch}))
    finally:
        dist.cleanup()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5, help="pairs of epochs (hooks on, off) per rank count")
    p.add_argument("--work", type=Path, default=Path("results/bench_hooks"))
    args = p.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpukit, in the spawned ranks too
    raw, data_yaml, cache = prepare(work)
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; {args.rounds} alternating pairs of epochs per rank "
          f"count, after one warm-up epoch; the first {raw['train']['timing_warmup_steps']} steps of each epoch "
          "outside the steady-state figures")
    print(f"{'ranks':>5}  {'epoch s, hooks':>14}  {'epoch s, none':>13}  {'ratio (pairs)':<24}  "
          f"{'img/s hooks / none (steady)':<28}")
    for world in args.ranks:
        store = work / f"store{world}"
        store.unlink(missing_ok=True)
        result = work / f"result{world}.json"
        mp.spawn(worker, args=(world, str(store), raw, str(data_yaml), str(cache), args.rounds, str(result)),
                 nprocs=world, join=True)
        rec = json.loads(result.read_text())
        on_s = [e["epoch_s"] for e in rec["on"]]
        off_s = [e["epoch_s"] for e in rec["off"]]
        ratios = [a / b for a, b in zip(on_s, off_s, strict=True)]
        ips_on = statistics.median(e["steady_images_per_s"] for e in rec["on"]) * world
        ips_off = statistics.median(e["steady_images_per_s"] for e in rec["off"]) * world
        print(f"{world:>5}  {statistics.median(on_s):>14.2f}  {statistics.median(off_s):>13.2f}  "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})  "
              f"{ips_on:.1f} / {ips_off:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
