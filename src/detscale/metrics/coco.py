"""COCO-standard box metrics: YOLO ground truth as COCO JSON, and the numbers of ``eval.json``.

The metrics are computed with faster-coco-eval, which implements pycocotools' matching and
101-point interpolated precision in C++; on the same files the numbers equal pycocotools'
(tests/test_coco.py checks it to 1e-6).

Conventions of the converted ground truth:

- image ``id`` = index of the image in the split (the order of ``DatasetSpec.splits[split]``),
  the same ids the dataset puts into ``meta["image_id"]``;
- ``width`` / ``height`` = the image as the loader sees it (EXIF orientation applied, as
  ``cv2.imread`` does), read from the file header only;
- boxes ``[x, y, w, h]`` in original pixels, ``area = w * h`` (YOLO labels have no masks, so
  COCO's small/medium/large split uses the box area), ``iscrowd = 0``; read as training reads
  them (:func:`detscale.data.formats.read_labels`: clipped to the image, repeated lines once);
- category ``id`` = YOLO class index, ``name`` from ``names``.

Undefined metrics (COCOeval's ``-1``: an area range or class without ground truth) are written
as ``null``; a class without ground truth stays in ``per_class`` with ``null`` so that every
class of the dataset is listed.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from detscale.data.formats import DatasetError, DatasetSpec, image_size, label_path_for, read_labels
from detscale.files import write_json

log = logging.getLogger(__name__)

# eval.json summary keys -> index in COCOeval.stats (bbox, default area ranges and maxDets).
SUMMARY_KEYS: dict[str, int] = {
    "map50_95": 0,
    "map50": 1,
    "map75": 2,
    "map_small": 3,
    "map_medium": 4,
    "map_large": 5,
    "ar100": 8,
}

# Written into the ground truth's "info"; a file of another version is rebuilt (2: boxes clipped to
# the image and repeated label lines counted once, as training reads them).
GT_VERSION = 2

# ---------------------------------------------------------------------------------------------
# Ground truth
# ---------------------------------------------------------------------------------------------


def coco_ground_truth(spec: DatasetSpec, split: str) -> dict[str, Any]:
    """The ground truth of ``split`` as a COCO detection dict (see the module notes)."""
    if split not in spec.splits:
        raise DatasetError(f"{spec.yaml_path}: no '{split}' split; it has {', '.join(spec.splits)}")
    if spec.source is not None:
        return source_ground_truth(spec, split)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for image_id, path in enumerate(spec.splits[split]):
        width, height = image_size(path)
        images.append({"id": image_id, "file_name": str(path), "width": width, "height": height})
        labels = read_labels(label_path_for(path))
        for cls, cx, cy, w, h in labels.astype(np.float64):
            if not 0 <= int(cls) < spec.nc:
                raise DatasetError(
                    f"{label_path_for(path)}: class {int(cls)} is outside 0..{spec.nc - 1}; "
                    "run `detscale validate` and use the clean data.yaml"
                )
            bw, bh = w * width, h * height
            x, y = cx * width - bw / 2, cy * height - bh / 2
            annotations.append({
                "id": len(annotations) + 1,  # COCO ids start at 1 (0 is falsy in some tools)
                "image_id": image_id,
                "category_id": int(cls),
                "bbox": [round(x, 4), round(y, 4), round(bw, 4), round(bh, 4)],
                "area": round(bw * bh, 4),
                "iscrowd": 0,
            })
    categories = [{"id": i, "name": name, "supercategory": "object"} for i, name in enumerate(spec.names)]
    return {
        "info": {"description": f"{spec.yaml_path} split {split}, converted from YOLO labels by detscale",
                 "detscale_gt_version": GT_VERSION},
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }


def _source_records(spec: DatasetSpec, split: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A converted dataset's ``source.json`` and its record of every image of ``split``, in the split's order."""
    try:
        source = json.loads(spec.source.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{spec.source}: cannot read the converted dataset's source ({exc}); run "
                           "`detscale validate` again") from None
    by_name = source["splits"][split]
    base = spec.source.parent / "images" / split
    records = []
    for path in spec.splits[split]:
        try:
            records.append(by_name[str(Path(path).relative_to(base))])
        except (ValueError, KeyError):
            raise DatasetError(f"{path} is not an image of {spec.source}'s {split} split; run `detscale validate` "
                               "again") from None
    return source, records


def source_ground_truth(spec: DatasetSpec, split: str) -> dict[str, Any]:
    """The ground truth of a converted COCO or VOC dataset: its own annotations, not the YOLO labels.

    The boxes (in pixels, unrounded), areas and crowd flags come from ``source.json``
    (:mod:`detscale.data.sources`): COCO's ``iscrowd`` regions and VOC's excluded ``difficult``
    objects stay in as crowd regions, on which COCO's matching ignores detections, and COCO's
    small/medium/large split uses the annotations' own areas. Ids are this module's (image = index
    in the split, category = class id); COCOeval's figures do not depend on the ids, so they are
    those of the original file scored with predictions mapped back to its ids (tested).
    """
    source, records = _source_records(spec, split)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for image_id, (path, record) in enumerate(zip(spec.splits[split], records, strict=True)):
        images.append({"id": image_id, "file_name": str(path), "width": record["width"], "height": record["height"]})
        for a in record["annotations"]:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": a["class"],
                                "bbox": a["bbox"], "area": a["area"], "iscrowd": a["iscrowd"]})
    return {
        "info": {"description": f"{spec.source} split {split}: the {source['format']} annotations of "
                                f"{source['data_yaml']}", "detscale_gt_version": GT_VERSION},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i, "name": name, "supercategory": "object"} for i, name in enumerate(spec.names)],
    }


def original_ids(spec: DatasetSpec, split: str, detections: list[dict[str, Any]]
                 ) -> tuple[list[dict[str, Any]], str | None]:
    """``detections`` with a converted COCO dataset's own image and category ids, and what those ids
    are; the detections unchanged (and None) for any other dataset.

    ``predictions.json`` of a COCO dataset is written this way, so any COCO tool scores it against
    the user's own instances JSON, with the figures ``eval.json`` has.
    """
    if spec.source is None:
        return detections, None
    source, records = _source_records(spec, split)
    if source["format"] != "coco":
        return detections, None
    image_ids = [r["image_id"] for r in records]
    categories = source["category_ids"]
    mapped = [dict(d, image_id=image_ids[d["image_id"]], category_id=categories[d["category_id"]])
              for d in detections]
    return mapped, f"the image and category ids of the COCO annotations of {source['data_yaml']}"


def yolo_to_coco(spec: DatasetSpec, split: str, out_json: str | Path) -> Path:
    """Write the COCO ground truth of ``split`` to ``out_json`` (atomically) and return the path."""
    gt = coco_ground_truth(spec, split)
    log.info("ground truth %s: %d images, %d boxes", out_json, len(gt["images"]), len(gt["annotations"]))
    return write_json(gt, out_json)


def ensure_coco_gt(spec: DatasetSpec, split: str, out_json: str | Path) -> Path:
    """Build the COCO ground truth once per dataset and split.

    Reuses ``out_json`` when it is newer than the data.yaml, was written by this version of the
    conversion (:data:`GT_VERSION`) and lists as many images as the split; otherwise (re)builds
    it. Concurrent builders are safe: each writes a temporary file and renames it, and all write
    the same content.
    """
    out_json = Path(out_json)
    if out_json.is_file() and out_json.stat().st_mtime >= spec.yaml_path.stat().st_mtime:
        try:
            with open(out_json) as f:
                gt = json.load(f)
            n_images = len(gt["images"]) if gt["info"].get("detscale_gt_version") == GT_VERSION else -1
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            n_images = -1
        if n_images == len(spec.splits[split]):
            return out_json
    return yolo_to_coco(spec, split, out_json)


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def _defined(value: float) -> float | None:
    """COCOeval marks undefined averages with -1; eval.json says ``null`` instead."""
    value = float(value)
    return None if value < 0 or math.isnan(value) else value


def _per_class_ap(precision: np.ndarray, cat_ids: Sequence[int], names: Mapping[int, str]) -> dict[str, float | None]:
    """AP@0.5:0.95 of each category from COCOeval's ``precision[T, R, K, A, M]`` (area all, maxDets 100).

    The same average that ``summarize()`` takes over all classes, restricted to one class.
    """
    out: dict[str, float | None] = {}
    for k, cat_id in enumerate(cat_ids):
        p = precision[:, :, k, 0, -1]
        valid = p[p > -1]
        out[names[cat_id]] = float(np.mean(valid)) if valid.size else None
    return out


def compute_metrics(gt_json: str | Path, detections: list[dict[str, Any]]) -> dict[str, Any]:
    """COCO bbox metrics of ``detections`` (COCO results dicts) against the ground truth file.

    Returns the metric keys of ``eval.json`` (``map50_95`` ... ``ar100``, ``per_class``,
    ``num_images``); undefined values are ``None``.
    """
    from faster_coco_eval import COCO, COCOeval_faster

    # faster-coco-eval logs its progress through print_function; keep it at debug level.
    gt = COCO(str(gt_json), print_function=log.debug)
    cat_ids = sorted(gt.getCatIds())
    names = {c["id"]: c["name"] for c in gt.loadCats(cat_ids)}
    known_images = set(gt.getImgIds())
    unknown = {d["image_id"] for d in detections} - known_images
    if unknown:
        raise ValueError(
            f"detections refer to image ids {sorted(unknown)[:5]} that are not in {gt_json}; the ground truth "
            "and the predictions must come from the same split"
        )
    # An empty list is fine here (pycocotools' loadRes would fail on it): every class with
    # ground truth gets precision and recall 0, which is what no detections mean.
    dt = gt.loadRes([dict(d) for d in detections])  # loadRes adds keys to the dicts it gets
    ev = COCOeval_faster(gt, dt, iouType="bbox", print_function=log.debug)
    ev.evaluate()
    ev.accumulate()
    with contextlib.redirect_stdout(io.StringIO()):
        ev.summarize()
    metrics: dict[str, Any] = {key: _defined(ev.stats[i]) for key, i in SUMMARY_KEYS.items()}
    metrics["per_class"] = _per_class_ap(np.asarray(ev.eval["precision"]), ev.params.catIds, names)
    metrics["num_images"] = len(known_images)
    return metrics


def evaluate_files(gt_json: str | Path, predictions_json: str | Path) -> dict[str, Any]:
    """The ``eval.json`` dict of a ``predictions.json`` (COCO results) against ``gt_json``."""
    with open(predictions_json) as f:
        detections = json.load(f)
    if not isinstance(detections, list):
        raise ValueError(f"{predictions_json}: expected a JSON list of COCO detections")
    metrics = compute_metrics(gt_json, detections)
    metrics["ground_truth"] = str(gt_json)
    metrics["predictions"] = str(predictions_json)
    return metrics


def format_table(metrics: Mapping[str, Any]) -> str:
    """A short human table of an ``eval.json`` dict (for the console)."""

    def pct(v: float | None) -> str:
        return "   -" if v is None else f"{100 * v:5.1f}"

    rows = [
        ("mAP@0.5:0.95", metrics["map50_95"]),
        ("mAP@0.5", metrics["map50"]),
        ("mAP@0.75", metrics["map75"]),
        ("mAP small", metrics["map_small"]),
        ("mAP medium", metrics["map_medium"]),
        ("mAP large", metrics["map_large"]),
        ("AR@100", metrics["ar100"]),
    ]
    width = max([len(r[0]) for r in rows] + [len(str(n)) for n in metrics.get("per_class", {})])
    lines = [f"COCO bbox metrics on {metrics['num_images']} images (%)"]
    lines += [f"  {name:<{width}}  {pct(v)}" for name, v in rows]
    if metrics.get("per_class"):
        lines.append("  AP@0.5:0.95 per class:")
        lines += [f"  {name:<{width}}  {pct(v)}" for name, v in metrics["per_class"].items()]
    return "\n".join(lines)
