"""Data-pipeline parity as distributions: detscale's and Ultralytics' training samples from the same images.

Both trainers' training datasets are built on the same ``data.yaml`` with the same augmentation
recipe (bench_parity's mapping) and sampled over many epochs in a shuffled order each, as a
trainer draws them; each sample's statistics are collected and the two sides compared with
two-sample tests from scipy.stats: Kolmogorov-Smirnov for continuous quantities, chi-square for
counts and proportions. With thousands of samples a test finds differences too small to matter,
so every row also gives both sides' means and the relative difference.

Statistics: objects per training image, box width and height (px), aspect ratio (long/short),
box centre x and y (fraction of the side), share of boxes touching the image border (clipped),
per-image pixel mean and standard deviation (after HSV) and per-channel means, and the share of
pixels that are padding grey (114, 114, 114). Mosaic epochs and the last ``close_mosaic``
(plain) epochs are sampled separately.

    .venv/bin/python benchmarks/bench_pipeline.py --family shapes --epochs 8 --work results/pipeline
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RECIPE = {"hsv_h": 0.015, "hsv_s": 0.7, "hsv_v": 0.4, "translate": 0.1, "scale": 0.5, "fliplr": 0.5, "mosaic": 1.0,
          "mixup": 0.0}
PAD = 114


def sample_stats(img: np.ndarray, boxes: np.ndarray) -> dict[str, Any]:
    """Statistics of one training sample: ``img`` uint8 [3, H, W], ``boxes`` pixel xyxy [n, 4]."""
    _, h, w = img.shape
    bw, bh = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    clipped = (boxes[:, 0] <= 0.5) | (boxes[:, 1] <= 0.5) | (boxes[:, 2] >= w - 0.5) | (boxes[:, 3] >= h - 0.5)
    pixels = img.reshape(3, -1).astype(np.float32)
    pad = np.all(img == PAD, axis=0).mean()
    return {"n": len(boxes), "w": bw.tolist(), "h": bh.tolist(),
            "aspect": (np.maximum(bw, bh) / np.maximum(np.minimum(bw, bh), 1e-6)).tolist(),
            "cx": ((boxes[:, 0] + boxes[:, 2]) / 2 / w).tolist(), "cy": ((boxes[:, 1] + boxes[:, 3]) / 2 / h).tolist(),
            "clipped": clipped.tolist(), "mean": float(pixels.mean()), "std": float(pixels.std()),
            "mean_c0": float(pixels[0].mean()), "mean_c1": float(pixels[1].mean()), "mean_c2": float(pixels[2].mean()),
            "pad": float(pad)}


def xywhn_to_xyxy(labels: np.ndarray, w: int, h: int) -> np.ndarray:
    cx, cy, bw, bh = (labels[:, i] for i in range(4))
    return np.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], 1)


def detscale_samples(data_yaml: Path, imgsz: int, epochs: range, mosaic: bool, seed: int) -> Iterator[dict]:
    from detscale.config import AugmentConfig
    from detscale.data.dataset import SampleKey, build_dataset

    ds = build_dataset(data_yaml, "train", imgsz, "none", None, AugmentConfig(**RECIPE))
    for epoch in epochs:
        order = np.random.default_rng([seed, epoch]).permutation(len(ds))
        for i in order:
            img, labels, _ = ds[SampleKey(int(i), epoch, mosaic, seed)]
            img = img.numpy()
            yield sample_stats(img, xywhn_to_xyxy(labels.numpy()[:, 1:5], img.shape[2], img.shape[1]))


def ultralytics_samples(data_yaml: Path, imgsz: int, epochs: range, mosaic: bool, seed: int,
                        work: Path | None = None) -> Iterator[dict]:
    os.environ.setdefault("YOLO_OFFLINE", "1")
    from bench_parity import absolute_data_yaml
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset
    from ultralytics.data.utils import check_det_dataset

    cfg = get_cfg(overrides={**RECIPE, "imgsz": imgsz, "cache": False, "task": "detect", "flipud": 0.0,
                             "degrees": 0.0, "shear": 0.0, "perspective": 0.0, "copy_paste": 0.0, "cutmix": 0.0})
    data = check_det_dataset(str(absolute_data_yaml(data_yaml, work)))
    ds = build_yolo_dataset(cfg, data["train"], 16, data, mode="train", stride=32)
    if not mosaic:
        ds.close_mosaic(hyp=cfg)
    for epoch in epochs:
        random.seed(seed * 1000 + epoch)
        np.random.seed(seed * 1000 + epoch)
        order = np.random.default_rng([seed, epoch, 1]).permutation(len(ds))
        for i in order:
            item = ds[int(i)]
            img = item["img"].numpy()
            yield sample_stats(img, xywhn_to_xyxy(item["bboxes"].numpy(), img.shape[2], img.shape[1]))


PER_BOX = ("w", "h", "aspect", "cx", "cy")
PER_IMAGE = ("mean", "std", "mean_c0", "mean_c1", "mean_c2", "pad")


def collect(samples: Iterator[dict]) -> dict[str, list]:
    """Every sample's statistics: per-image values, per-box values pooled, and per-box values averaged
    per image (``image_*``, for images with boxes): the unit of the tests, see :func:`compare`."""
    out: dict[str, list] = {k: [] for k in ("n", "clipped", *PER_BOX, *PER_IMAGE)}
    out.update({f"image_{k}": [] for k in (*PER_BOX, "clipped")})
    for s in samples:
        out["n"].append(s["n"])
        for k in PER_IMAGE:
            out[k].append(s[k])
        for k in (*PER_BOX, "clipped"):
            out[k].extend(s[k])
            if s[k]:
                out[f"image_{k}"].append(float(np.mean(s[k])))
    return out


def compare(a: dict[str, list], b: dict[str, list]) -> list[dict[str, Any]]:
    """One row per statistic: both sides' means, the relative difference, the test and its p-value.

    The unit of every test is the training image, the independent draw: the boxes of one image share
    its mosaic partners, scale and translation, so 25 boxes of one image are not 25 samples (tested
    as independent, 90,000 boxes made a 0.75 % difference in mean box width look like p = 0.001,
    where the images' own scale draws put it at about one standard error). Per-box quantities are
    therefore compared as per-image means (KS); objects per image by chi-square over count bins.
    The means shown are over all boxes (the effect size a trainer sees)."""
    from scipy import stats

    rows = []
    top = max(max(a["n"]), max(b["n"]))
    edges = [0, 1, 2, 3, 4, 6, 8, 10, 13, 16, 20, 25, 30, 40, top + 1]
    edges = sorted({e for e in edges if e <= top} | {top + 1})
    counts = np.array([np.histogram(a["n"], edges)[0], np.histogram(b["n"], edges)[0]])
    counts = counts[:, counts.sum(0) > 0]
    rows.append(_row("objects per image", a["n"], b["n"], len(a["n"]), len(b["n"]), "chi-square",
                     stats.chi2_contingency(counts).pvalue))
    for k, label in (("clipped", "share of boxes clipped at the border"), ("w", "box width (px)"),
                     ("h", "box height (px)"), ("aspect", "aspect ratio (long/short)"),
                     ("cx", "box centre x (fraction)"), ("cy", "box centre y (fraction)")):
        ia, ib = a[f"image_{k}"], b[f"image_{k}"]
        rows.append(_row(label, np.asarray(a[k], float), np.asarray(b[k], float), len(ia), len(ib),
                         "KS, per-image means", stats.ks_2samp(ia, ib).pvalue))
    for k, label in (("mean", "pixel mean per image"), ("std", "pixel spread (sd) per image"),
                     ("mean_c0", "channel 0 (R) mean per image"), ("mean_c1", "channel 1 (G) mean per image"),
                     ("mean_c2", "channel 2 (B) mean per image"), ("pad", "share of padding pixels per image")):
        rows.append(_row(label, a[k], b[k], len(a[k]), len(b[k]), "KS", stats.ks_2samp(a[k], b[k]).pvalue))
    return rows


def _row(label: str, a: Any, b: Any, na: int, nb: int, test: str, p: float) -> dict[str, Any]:
    ma, mb = float(np.mean(a)), float(np.mean(b))
    return {"statistic": label, "detscale": ma, "ultralytics": mb, "n": (na, nb),
            "rel_diff": (ma / mb - 1) if mb else math.nan, "test": test, "p": float(p)}


def table(rows: list[dict[str, Any]], alpha: float) -> list[str]:
    lines = ["| statistic | detscale | Ultralytics | detscale / Ultralytics - 1 | images | test | p |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        flag = " **" if r["p"] < alpha else ""
        lines.append(f"| {r['statistic']} | {r['detscale']:.4g} | {r['ultralytics']:.4g} | {r['rel_diff']:+.2%} | "
                     f"{r['n'][0]} / {r['n'][1]} | {r['test']} | {r['p']:.2g}{flag} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("results/pipeline"))
    p.add_argument("--family", default="shapes", help="synth or a family of benchmarks/families.py")
    p.add_argument("--data", default="", metavar="DATA_YAML", help="a YOLO dataset instead of a generated family")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--train", type=int, default=448)
    p.add_argument("--imgsz", type=int, default=256)
    p.add_argument("--epochs", type=int, default=8, help="epochs sampled per mode (each a pass over the split)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.01, help="p-values below are marked")
    args = p.parse_args()
    from bench_parity import make_dataset

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ns = SimpleNamespace(family=args.family, data_seed=args.data_seed, train=args.train, val=50, imgsz=args.imgsz,
                         objects=(1, 8), object_size=(0.05, 0.5), data=args.data)
    data_yaml = make_dataset(work, ns)
    data = args.data or f"family {args.family} (seed {args.data_seed}), {args.train} images"
    lines = [f"# Data-pipeline parity: {data} at {args.imgsz} px, {args.epochs} epochs sampled per mode", "",
             "Recipe: " + ", ".join(f"{k} {v}" for k, v in RECIPE.items()) + f". Marked (**): p < {args.alpha}.", ""]
    result: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    sides: dict[str, Callable] = {"detscale": detscale_samples,
                                  "ultralytics": partial(ultralytics_samples, work=work)}
    for mode, mosaic in (("mosaic", True), ("plain (close_mosaic)", False)):
        got = {name: collect(fn(data_yaml, args.imgsz, range(args.epochs), mosaic, args.seed))
               for name, fn in sides.items()}
        rows = compare(got["detscale"], got["ultralytics"])
        result[mode] = rows
        lines += [f"## {mode}", "", *table(rows, args.alpha), ""]
    from detscale.files import write_json, write_text

    write_json(result, work / "pipeline.json", indent=1)
    text = "\n".join(lines) + "\n"
    write_text(text, work / "pipeline.md")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
