"""Evaluation cost per 1000 images at 640 on the CPU: inference and COCO metrics, separately.

Inference: ``gelan-t`` (random initialisation: the cost does not depend on the weights, except
NMS which sees the most candidates with random weights at conf 0.001, i.e. a pessimistic case),
fused, batch 8, letterboxed 640x640 uint8 inputs, through the same
:func:`detscale.metrics.predict.predict` the evaluation uses (postprocess + scale_boxes + COCO
dicts); a few batches are timed and scaled to 1000 images.

Metrics: a synthetic ground truth of 1000 images (≈7 boxes each, 80 classes) and 100 detections
per image, evaluated by faster-coco-eval (what ``eval.json`` uses) and by pycocotools.

    python benchmarks/bench_eval.py --images 64 --threads 2 [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def synthetic_coco(n_images: int, dets_per_image: int, nc: int = 80, seed: int = 0) -> tuple[dict, list[dict]]:
    """A ground truth with varied box sizes and detections around it (matches and false positives)."""
    rng = np.random.default_rng(seed)
    images, anns, dets = [], [], []
    for i in range(n_images):
        w, h = 640, 480
        images.append({"id": i, "file_name": f"{i}.jpg", "width": w, "height": h})
        boxes = []
        for _ in range(int(rng.integers(1, 14))):
            bw, bh = float(rng.uniform(8, 300)), float(rng.uniform(8, 300))
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            cat = int(rng.integers(0, nc))
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": cat, "bbox": [x, y, bw, bh],
                         "area": bw * bh, "iscrowd": 0})
            boxes.append((x, y, bw, bh, cat))
        for k in range(dets_per_image):
            if k < 2 * len(boxes):
                x, y, bw, bh, cat = boxes[k % len(boxes)]
                j = rng.normal(0, 0.1, 4)
                box = [x + j[0] * bw, y + j[1] * bh, bw * float(np.exp(j[2])), bh * float(np.exp(j[3]))]
            else:
                bw, bh = float(rng.uniform(8, 200)), float(rng.uniform(8, 200))
                box = [float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh)), bw, bh]
                cat = int(rng.integers(0, nc))
            dets.append({"image_id": i, "category_id": cat, "bbox": [round(v, 2) for v in box],
                         "score": round(float(rng.uniform(0.001, 1.0)), 5)})
    cats = [{"id": c, "name": f"c{c}"} for c in range(nc)]
    return {"images": images, "annotations": anns, "categories": cats}, dets


def time_metrics(n_images: int, dets_per_image: int) -> dict[str, float]:
    """Seconds for faster-coco-eval (our compute_metrics) and pycocotools on the same detections.

    Both include loading the ground truth file and the detections, evaluate, accumulate, summarize.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from detscale.metrics.coco import compute_metrics

    gt, dets = synthetic_coco(n_images, dets_per_image)
    with tempfile.TemporaryDirectory() as tmp:
        gt_json = Path(tmp) / "gt.json"
        gt_json.write_text(json.dumps(gt))
        t0 = time.perf_counter()
        ours = compute_metrics(gt_json, dets)
        t_fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            cg = COCO(str(gt_json))
            ev = COCOeval(cg, cg.loadRes([dict(d) for d in dets]), iouType="bbox")
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        t_ref = time.perf_counter() - t0
    assert abs(ours["map50_95"] - ev.stats[0]) < 1e-6, (ours["map50_95"], ev.stats[0])
    return {"faster_coco_eval_s": t_fast, "pycocotools_s": t_ref, "map50_95": ours["map50_95"]}


def time_inference(n_images: int, batch: int, imgsz: int, nc: int) -> dict[str, float]:
    """Seconds per 1000 images of predict() with a fused gelan-t (first batch excluded as warm-up)."""
    from detscale.metrics.predict import predict_with_ids
    from detscale.model import build_model, fuse_for_inference

    torch.manual_seed(0)
    model = fuse_for_inference(build_model("gelan-t", nc)).eval()
    g = torch.Generator().manual_seed(0)

    def batches(n: int):
        for start in range(0, n, batch):
            b = min(batch, n - start)
            imgs = torch.randint(0, 256, (b, 3, imgsz, imgsz), dtype=torch.uint8, generator=g)
            metas = [{"image_id": start + k, "orig_shape": (480, 640), "ratio": imgsz / 640,
                      "pad": (0, (imgsz - round(480 * imgsz / 640)) // 2)} for k in range(b)]
            yield imgs, torch.zeros(0, 6), metas

    cfg = SimpleNamespace(conf=0.001, iou=0.7, max_det=300)
    cpu = torch.device("cpu")
    predict_with_ids(model, batches(batch), cpu, cfg, progress=False)  # warm-up (allocator, oneDNN kernels)
    t0, c0 = time.perf_counter(), time.process_time()
    dets, _ = predict_with_ids(model, batches(n_images), cpu, cfg, progress=False)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    # CPU seconds as well: on a shared machine the wall time depends on the neighbours' load
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "images": n_images,
            "detections_per_image": len(dets) / n_images, "s_per_1000": seconds / n_images * 1000,
            "cpu_s_per_1000": cpu_seconds / n_images * 1000}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=64, help="images to run through the model (scaled to 1000)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--metric-images", type=int, default=1000)
    p.add_argument("--dets", type=int, default=100, help="detections per image for the metric timing")
    p.add_argument("--skip-inference", action="store_true")
    p.add_argument("--skip-metrics", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    out: dict[str, object] = {"threads": args.threads, "torch": torch.__version__}
    if not args.skip_metrics:
        m = time_metrics(args.metric_images, args.dets)
        scale = 1000 / args.metric_images
        out["metrics"] = {**m, "images": args.metric_images, "dets_per_image": args.dets}
        print(f"metrics, {args.metric_images} images x {args.dets} detections: faster-coco-eval "
              f"{m['faster_coco_eval_s']:.2f} s, pycocotools {m['pycocotools_s']:.2f} s "
              f"(x{m['pycocotools_s'] / m['faster_coco_eval_s']:.1f}); per 1000 images: "
              f"{m['faster_coco_eval_s'] * scale:.2f} s vs {m['pycocotools_s'] * scale:.2f} s")
    if not args.skip_inference:
        inf = time_inference(args.images, args.batch, args.imgsz, nc=80)
        out["inference"] = {**inf, "model": "gelan-t (random init, fused)", "batch": args.batch, "imgsz": args.imgsz}
        print(f"inference gelan-t fused, {args.imgsz}px, batch {args.batch}, {args.threads} threads: "
              f"{inf['seconds']:.1f} s for {args.images} images ({inf['detections_per_image']:.0f} dets/image) "
              f"-> {inf['s_per_1000']:.0f} s per 1000 images ({inf['cpu_s_per_1000']:.0f} CPU-s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
