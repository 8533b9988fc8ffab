"""Section ``data``: ``detscale synth`` and ``detscale cache`` of the kit's synthetic sets."""

from __future__ import annotations

from typing import Any

from gpukit.kit import Kit, Sizes, data_paths, detscale_cmd


def section_data(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    paths = data_paths(kit.work)
    logs = kit.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {}
    if not paths.data_yaml.is_file():
        record["synth_seconds"] = detscale_cmd(
            "synth", "--out", str(paths.data_yaml.parent), "--imgsz", str(sizes.imgsz), "--train",
            str(sizes.train_images), "--val", str(sizes.val_images), "--objects", "1", "8", cwd=kit.work,
            log=logs / "synth.log", timeout=300)
    if not paths.ddp_yaml.is_file():
        detscale_cmd("synth", "--out", str(paths.ddp_yaml.parent), "--imgsz", str(sizes.imgsz), "--train",
                     str(sizes.ddp_images), "--val", "4", "--seed", "1", cwd=kit.work, log=logs / "synth-ddp.log",
                     timeout=120)
    for split in ("train", "val"):
        record[f"cache_{split}_seconds"] = detscale_cmd(
            "cache", "--data", str(paths.data_yaml), "--split", split, "--imgsz", str(sizes.imgsz), "--out",
            str(paths.cache_dir), cwd=kit.work, log=logs / f"cache-{split}.log", timeout=300)
    detscale_cmd("cache", "--data", str(paths.ddp_yaml), "--split", "train", "--imgsz", str(sizes.imgsz), "--out",
                 str(paths.ddp_yaml.parent / "cache"), cwd=kit.work, log=logs / "cache-ddp.log", timeout=120)
    npy = paths.cache_dir / f"train-{sizes.imgsz}.npy"
    record.update(train_images=sizes.train_images, val_images=sizes.val_images, imgsz=sizes.imgsz,
                  cache_gib=round(npy.stat().st_size / 2**30, 3))
    return record
