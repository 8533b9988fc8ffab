"""Section ``loader``: images/s the training loader delivers with mosaic, cache none vs disk, over
worker counts, without the model: can the CPU side feed the card at all?"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from detscale.data.dataset import build_dataset
from detscale.data.loader import build_train_loader, set_epoch
from gpukit.kit import Kit, Sizes, data_paths, experiment


def default_augment(work: Path, sizes: Sizes) -> Any:
    """The augmentation a training run gets by default (mosaic 1.0, HSV, flip, scale, translate)."""
    return experiment(data_paths(work).data_yaml, "gelan-t", sizes.imgsz, sizes.loader_batch).augment


def loader_rate(dataset: Any, batch: int, workers: int, seconds: float) -> dict[str, Any]:
    loader = build_train_loader(dataset, batch, 0, 1, seed=0, workers=workers)
    epoch = 0
    set_epoch(loader, epoch, mosaic=True)
    it = iter(loader)
    t_start = time.perf_counter()
    next(it)  # workers started, first batch (not counted)
    first_s = time.perf_counter() - t_start
    images, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            imgs, _targets, _metas = next(it)
        except StopIteration:
            epoch += 1
            set_epoch(loader, epoch, mosaic=True)
            it = iter(loader)
            continue
        images += len(imgs)
    elapsed = time.perf_counter() - t0
    del it, loader
    return {"images_per_s": images / elapsed, "images": images, "seconds": round(elapsed, 2),
            "first_batch_s": round(first_s, 2)}


def section_loader(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    paths = data_paths(kit.work)
    augment = default_augment(kit.work, sizes)
    rows = []
    for cache in ("none", "disk"):
        dataset = build_dataset(paths.data_yaml, "train", sizes.imgsz, cache, paths.cache_dir, augment)
        for workers in sizes.loader_workers:
            row = {"cache": cache, "workers": workers, "batch": sizes.loader_batch}
            row.update(loader_rate(dataset, sizes.loader_batch, workers, sizes.loader_seconds))
            rows.append(row)
            print(f"  loader cache={cache} workers={workers}: {row['images_per_s']:.0f} img/s", flush=True)
    return {"imgsz": sizes.imgsz, "mosaic": augment.mosaic, "cpus": os.cpu_count(), "rows": rows}
