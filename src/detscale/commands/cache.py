"""Decode and letterbox one split once into ``{out}/{split}-{imgsz}.npy`` plus its index json.

Reuses the cache when the index still matches the sources; rebuilds it when the file list or a
source image changed (or with ``--force``). Training opens it with ``cache: disk`` or ``ram``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, type=Path, help="data.yaml (the clean view written by validate)")
    parser.add_argument("--split", required=True, choices=("train", "val"), help="which split to cache")
    parser.add_argument("--imgsz", required=True, type=int, help="square size the images are letterboxed to")
    parser.add_argument("--out", required=True, type=Path, help="output folder, e.g. results/cache/{dataset}")
    parser.add_argument("--workers", type=int, default=None, help="decoding processes (default: every core)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache is up to date")


def run(args: argparse.Namespace) -> int:
    import json

    from detscale.data.cache import CacheError, build_cache, cache_paths
    from detscale.data.formats import load_spec

    if args.imgsz < 32 or args.imgsz % 32:
        raise CacheError(f"--imgsz must be a positive multiple of 32 (the model's largest stride), got {args.imgsz}")
    spec = load_spec(args.data, splits=(args.split,))
    before = cache_paths(args.out, args.split, args.imgsz)[1]
    old_build = json.loads(before.read_text()).get("build_id") if before.is_file() else None
    index_path = build_cache(spec, args.split, args.imgsz, args.out, workers=args.workers, force=args.force)
    index = json.loads(index_path.read_text())
    npy = index_path.parent / index["npy"]
    how = "up to date, reused" if index["build_id"] == old_build else f"built in {index['build_seconds']:.1f} s"
    print(
        f"cache {args.split}-{args.imgsz}: {index['count']} images, {npy.stat().st_size / 2**30:.2f} GiB "
        f"-> {npy} (index {index_path.name}; {how})"
    )
    return 0
