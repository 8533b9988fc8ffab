"""Data loader benchmark: images/s per cache mode, and the memory of processes sharing `cache: ram`.

Usage::

    .venv/bin/python benchmarks/bench_loader.py [--images 200] [--imgsz 640] [--work DIR]

1. Generates a synthetic set with `detscale synth` (``--images`` training images of ``--imgsz``)
   and builds its cache with `detscale cache`.
2. Throughput: the training loader (mosaic 1.0 and the other reference augmentations, batch
   ``--batch``) for each cache mode (none / disk / ram) with 0 and 2 workers. Each configuration
   runs one untimed epoch (workers start, page cache warm), then the timed epochs.
3. Memory: child processes that open the ``ram`` cache and read every image (as a loader does).
   Reported as the sum over processes of PSS (proportional set size: each shared page is divided
   among the processes that map it, so the sum counts a shared page once) - the honest total; the
   sum of RSS counts shared pages once per process and is shown for contrast, as is a baseline
   process with the same imports that does not open the cache, and the anchors' approach (each
   process loads its own copy into private memory).

Targets: ``disk`` and ``ram`` at least 2x ``none``; the second process adds at most 10% of the
cache's size to the total PSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_MODES = ("ram", "baseline", "private")


def child(mode: str, index_path: str) -> None:
    """Open the cache as ``mode``, read every image, say 'ready', wait for a line on stdin."""
    import numpy as np

    from detscale.data.cache import open_cache

    checksum = 0
    if mode == "ram":
        cache = open_cache(index_path, "ram")
        for i in range(len(cache)):
            checksum += int(np.asarray(cache.array[i], np.uint8)[::97, ::97].sum())  # touches the pages
            _ = cache.array[i].copy()  # what a loader does with an item
    elif mode == "private":
        # The anchors' way: every process holds its own copy of the decoded images.
        npy = Path(index_path).with_suffix(".npy")
        images = np.load(npy)
        checksum = int(images[:, ::97, ::97].sum())
    print(json.dumps({"ready": True, "checksum": checksum}), flush=True)
    sys.stdin.readline()


def _memory(pids: list[int]) -> dict[str, float]:
    import psutil

    infos = [psutil.Process(p).memory_full_info() for p in pids]
    return {k: sum(getattr(m, k) for m in infos) / 2**20 for k in ("pss", "uss", "rss")}


def _start(mode: str, index_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--child", mode, str(index_path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line or not json.loads(line).get("ready"):
        raise RuntimeError(f"child {mode} failed to start")
    return proc


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
    for p in procs:
        p.wait(timeout=60)


def memory_table(index_path: Path) -> list[dict[str, object]]:
    """Total PSS/USS/RSS (MiB) of one and of two processes for each child mode."""
    rows = []
    for mode in CHILD_MODES:
        first = _start(mode, index_path)
        one = _memory([first.pid])
        second = _start(mode, index_path)
        two = _memory([first.pid, second.pid])
        _stop([first, second])
        rows.append({"mode": mode, "one": one, "two": two})
    return rows


def throughput(data_yaml: Path, cache_dir: Path, imgsz: int, batch: int, epochs: int) -> list[dict[str, object]]:
    """Images/s of the training loader for each cache mode and worker count."""
    from detscale.config import AugmentConfig
    from detscale.data.dataset import build_dataset
    from detscale.data.loader import build_train_loader, set_epoch

    rows = []
    for mode in ("none", "disk", "ram"):
        dataset = build_dataset(data_yaml, "train", imgsz, mode, cache_dir, AugmentConfig())
        for workers in (0, 2):
            loader = build_train_loader(dataset, batch, rank=0, world_size=1, seed=0, workers=workers)
            set_epoch(loader, 0, mosaic=True)
            for _ in loader:  # untimed: workers start, pages come into memory
                pass
            images, start = 0, time.perf_counter()
            for epoch in range(1, 1 + epochs):
                set_epoch(loader, epoch, mosaic=True)
                for imgs, _, _ in loader:
                    images += len(imgs)
            seconds = time.perf_counter() - start
            rows.append({"cache": mode, "workers": workers, "images": images, "seconds": seconds,
                         "images_per_s": images / seconds})
            del loader
        del dataset
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per configuration")
    parser.add_argument("--work", type=Path, default=None, help="folder for the data and cache (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-loader-"))
    data_dir, cache_dir = work / "data", work / "cache"
    detscale = [sys.executable, "-m", "detscale"]
    if not (data_dir / "data.yaml").is_file():
        subprocess.run([*detscale, "synth", "--out", str(data_dir), "--imgsz", str(args.imgsz),
                        "--train", str(args.images), "--val", "10"], check=True)
    subprocess.run([*detscale, "cache", "--data", str(data_dir / "data.yaml"), "--split", "train",
                    "--imgsz", str(args.imgsz), "--out", str(cache_dir)], check=True)
    index_path = cache_dir / f"train-{args.imgsz}.json"
    cache_mib = (cache_dir / f"train-{args.imgsz}.npy").stat().st_size / 2**20

    speed = throughput(data_dir / "data.yaml", cache_dir, args.imgsz, args.batch, args.epochs)
    memory = memory_table(index_path)

    print(f"\nLoader throughput, {args.images} images at {args.imgsz}, mosaic 1.0, batch {args.batch}, "
          f"{args.epochs} timed epochs")
    print(f"{'cache':<6} {'workers':>7} {'img/s':>8} {'vs none':>8}")
    base = {r["workers"]: r["images_per_s"] for r in speed if r["cache"] == "none"}
    for r in speed:
        print(f"{r['cache']:<6} {r['workers']:>7} {r['images_per_s']:>8.1f} "
              f"{r['images_per_s'] / base[r['workers']]:>7.2f}x")

    print(f"\nMemory of processes reading the whole cache ({cache_mib:.0f} MiB), MiB summed over processes")
    print(f"{'process':<9} {'PSS 1':>8} {'PSS 2':>8} {'+2nd':>8} {'+2nd/cache':>10} {'RSS 1':>8} {'RSS 2':>8}")
    for r in memory:
        one, two = r["one"], r["two"]
        added = two["pss"] - one["pss"]
        print(f"{r['mode']:<9} {one['pss']:>8.1f} {two['pss']:>8.1f} {added:>8.1f} {added / cache_mib:>9.1%} "
              f"{one['rss']:>8.1f} {two['rss']:>8.1f}")
    ram = next(r for r in memory if r["mode"] == "ram")
    baseline = next(r for r in memory if r["mode"] == "baseline")
    added = ram["two"]["pss"] - ram["one"]["pss"]
    interpreter = baseline["two"]["pss"] - baseline["one"]["pss"]
    print(f"\nram: the 2nd process adds {added:.1f} MiB = {added / cache_mib:.1%} of the cache "
          f"({interpreter:.1f} MiB of it is what any 2nd Python process with these imports adds)")
    speedups = [r["images_per_s"] / base[r["workers"]] for r in speed if r["cache"] != "none"]
    print(f"targets: disk/ram >= 2x none: {'met' if min(speedups) >= 2 else 'NOT met'} "
          f"(min {min(speedups):.2f}x); 2nd process <= 10% of cache: "
          f"{'met' if added <= 0.1 * cache_mib else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"cache_mib": cache_mib, "throughput": speed, "memory": memory}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
