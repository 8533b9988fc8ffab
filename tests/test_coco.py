"""COCO ground truth conversion and metrics: equal to pycocotools, and the edge cases."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from detscale.data.formats import load_spec, write_data_yaml
from detscale.metrics.coco import (
    SUMMARY_KEYS,
    compute_metrics,
    ensure_coco_gt,
    evaluate_files,
    format_table,
    yolo_to_coco,
)

NAMES = ("circle", "square", "triangle", "ghost")  # "ghost" never appears in the ground truth


def pycocotools_metrics(gt_json: Path, pred_json: Path) -> dict:
    """The reference: pycocotools' summary and per-class AP (same averaging as summarize())."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(gt_json))
        dt = gt.loadRes(str(pred_json))
        ev = COCOeval(gt, dt, iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    out = {k: (None if ev.stats[i] < 0 else float(ev.stats[i])) for k, i in SUMMARY_KEYS.items()}
    names = {c["id"]: c["name"] for c in gt.loadCats(gt.getCatIds())}
    out["per_class"] = {}
    for k, cat in enumerate(ev.params.catIds):
        p = ev.eval["precision"][:, :, k, 0, -1]
        out["per_class"][names[cat]] = float(np.mean(p[p > -1])) if (p > -1).any() else None
    return out


def assert_same(ours: dict, ref: dict, tol: float = 1e-6) -> None:
    for key in SUMMARY_KEYS:
        if ref[key] is None:
            assert ours[key] is None, key
        else:
            assert ours[key] == pytest.approx(ref[key], abs=tol), key
    assert list(ours["per_class"]) == list(ref["per_class"])
    for name, ap in ref["per_class"].items():
        if ap is None:
            assert ours["per_class"][name] is None, name
        else:
            assert ours["per_class"][name] == pytest.approx(ap, abs=tol), name


# ---------------------------------------------------------------------------------------------
# A hand-made ground truth and varied detections
# ---------------------------------------------------------------------------------------------


def make_gt(n_images: int = 12, seed: int = 0) -> dict:
    """Images of different sizes with boxes of every COCO area range; some images are empty."""
    rng = np.random.default_rng(seed)
    images, anns = [], []
    for i in range(n_images):
        w, h = int(rng.integers(200, 900)), int(rng.integers(200, 700))
        images.append({"id": i, "file_name": f"im{i}.jpg", "width": w, "height": h})
        if i % 4 == 3:
            continue  # an image without objects
        for _ in range(int(rng.integers(1, 7))):
            # side lengths that fall into small (<32^2), medium and large (>96^2) areas
            side = float(rng.choice([12.0, 25.0, 50.0, 80.0, 130.0, 180.0])) * float(rng.uniform(0.8, 1.2))
            bw, bh = min(side, w - 2), min(side * float(rng.uniform(0.6, 1.4)), h - 2)
            x, y = float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh))
            anns.append({
                "id": len(anns) + 1, "image_id": i, "category_id": int(rng.integers(0, 3)),
                "bbox": [x, y, bw, bh], "area": bw * bh, "iscrowd": 0,
            })
    cats = [{"id": i, "name": n} for i, n in enumerate(NAMES)]
    return {"images": images, "annotations": anns, "categories": cats}


def make_detections(gt: dict, seed: int = 1) -> list[dict]:
    """Matches of varied IoU and class, duplicates, false positives, tied scores."""
    rng = np.random.default_rng(seed)
    dets = []
    for a in gt["annotations"]:
        x, y, w, h = a["bbox"]
        for _ in range(int(rng.integers(0, 4))):
            j = rng.normal(0, 0.15, 4)  # jitter relative to the box size: IoU from ~1 down to ~0.3
            cat = a["category_id"] if rng.random() < 0.85 else int(rng.integers(0, 4))
            dets.append({
                "image_id": a["image_id"], "category_id": cat,
                "bbox": [x + j[0] * w, y + j[1] * h, w * float(np.exp(j[2])), h * float(np.exp(j[3]))],
                "score": round(float(rng.uniform(0.05, 1.0)), 2),  # two decimals: many ties
            })
    for img in gt["images"]:
        for _ in range(int(rng.integers(0, 5))):  # background false positives, "ghost" included
            w, h = float(rng.uniform(5, 150)), float(rng.uniform(5, 150))
            dets.append({
                "image_id": img["id"], "category_id": int(rng.integers(0, 4)),
                "bbox": [float(rng.uniform(0, img["width"] - w)), float(rng.uniform(0, img["height"] - h)), w, h],
                "score": round(float(rng.uniform(0.001, 0.6)), 2),
            })
    return dets


def write(obj, path: Path) -> Path:
    path.write_text(json.dumps(obj))
    return path


def test_metrics_equal_pycocotools(tmp_path):
    gt = make_gt()
    dets = make_detections(gt)
    gt_json, pred_json = write(gt, tmp_path / "gt.json"), write(dets, tmp_path / "pred.json")
    ours = evaluate_files(gt_json, pred_json)
    ref = pycocotools_metrics(gt_json, pred_json)
    assert_same(ours, ref)
    # the data exercise what they should: a class without GT, and every area range defined
    assert ours["per_class"]["ghost"] is None
    assert all(ours[k] is not None for k in ("map_small", "map_medium", "map_large"))
    assert 0.05 < ours["map50_95"] < 0.95 and ours["map50"] > ours["map75"]
    assert ours["num_images"] == len(gt["images"])
    assert ours["ground_truth"] == str(gt_json) and ours["predictions"] == str(pred_json)
    json.dumps(ours)  # eval.json must serialise


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_metrics_equal_pycocotools_more_seeds(tmp_path, seed):
    gt = make_gt(n_images=8, seed=seed)
    dets = make_detections(gt, seed=seed + 10)
    gt_json, pred_json = write(gt, tmp_path / "gt.json"), write(dets, tmp_path / "pred.json")
    assert_same(evaluate_files(gt_json, pred_json), pycocotools_metrics(gt_json, pred_json))


def test_perfect_detections_score_one(tmp_path):
    gt = make_gt()
    dets = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9}
            for a in gt["annotations"]]
    m = compute_metrics(write(gt, tmp_path / "gt.json"), dets)
    for key in SUMMARY_KEYS:
        assert m[key] == pytest.approx(1.0), key
    assert m["per_class"]["ghost"] is None
    assert all(m["per_class"][n] == pytest.approx(1.0) for n in NAMES[:3])


def test_no_detections_gives_zeros_not_a_crash(tmp_path):
    gt = make_gt()
    gt_json = write(gt, tmp_path / "gt.json")
    m = evaluate_files(gt_json, write([], tmp_path / "pred.json"))
    for key in SUMMARY_KEYS:
        assert m[key] == 0.0, key
    assert m["per_class"] == {"circle": 0.0, "square": 0.0, "triangle": 0.0, "ghost": None}


def test_area_range_without_ground_truth_is_null(tmp_path):
    gt = make_gt()
    gt["annotations"] = [a for a in gt["annotations"] if a["area"] > 96**2]  # large objects only
    dets = make_detections(gt)
    gt_json, pred_json = write(gt, tmp_path / "gt.json"), write(dets, tmp_path / "pred.json")
    m = evaluate_files(gt_json, pred_json)
    assert m["map_small"] is None and m["map_medium"] is None and m["map_large"] is not None
    assert_same(m, pycocotools_metrics(gt_json, pred_json))


def test_detections_on_unknown_images_are_refused(tmp_path):
    gt_json = write(make_gt(), tmp_path / "gt.json")
    with pytest.raises(ValueError, match="not in"):
        compute_metrics(gt_json, [{"image_id": 999, "category_id": 0, "bbox": [0, 0, 5, 5], "score": 0.5}])


def test_table_lists_metrics_and_classes(tmp_path):
    gt = make_gt()
    m = compute_metrics(write(gt, tmp_path / "gt.json"), make_detections(gt))
    table = format_table(m)
    assert "mAP@0.5:0.95" in table and "AR@100" in table
    assert "ghost" in table and f"{100 * m['map50']:5.1f}" in table


# ---------------------------------------------------------------------------------------------
# YOLO -> COCO ground truth
# ---------------------------------------------------------------------------------------------


def make_yolo_dataset(root: Path) -> Path:
    """Three val images: one with labels, one without a label file, one EXIF-rotated JPEG."""
    img_dir, lbl_dir = root / "images" / "val", root / "labels" / "val"
    img_dir.mkdir(parents=True)
    lbl_dir.mkdir(parents=True)
    Image.new("RGB", (200, 100), (10, 20, 30)).save(img_dir / "a.png")
    (lbl_dir / "a.txt").write_text("0 0.5 0.5 0.2 0.4\n2 0.25 0.75 0.5 0.5\n")
    Image.new("RGB", (64, 48)).save(img_dir / "b.png")  # no label file: an image without objects
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 120x80, displayed rotated by 90 degrees: 80x120
    Image.new("RGB", (120, 80), (200, 0, 0)).save(img_dir / "c.jpg", exif=exif.tobytes())
    (lbl_dir / "c.txt").write_text("1 0.5 0.5 0.5 0.25\n")
    yaml_path = root / "data.yaml"
    write_data_yaml(yaml_path, ["circle", "square", "triangle"], "images/val", "images/val", root)
    return yaml_path


def test_yolo_to_coco(tmp_path):
    spec = load_spec(make_yolo_dataset(tmp_path / "ds"))
    out = yolo_to_coco(spec, "val", tmp_path / "out" / "coco_val.json")
    gt = json.loads(out.read_text())
    assert [i["id"] for i in gt["images"]] == [0, 1, 2]
    assert [Path(i["file_name"]).name for i in gt["images"]] == ["a.png", "b.png", "c.jpg"]
    # sizes as the loader decodes them (cv2 applies the EXIF rotation)
    for im in gt["images"]:
        h, w = cv2.imread(im["file_name"]).shape[:2]
        assert (im["width"], im["height"]) == (w, h)
    assert (gt["images"][2]["width"], gt["images"][2]["height"]) == (80, 120)
    assert gt["categories"] == [{"id": i, "name": n, "supercategory": "object"}
                                for i, n in enumerate(["circle", "square", "triangle"])]
    anns = gt["annotations"]
    assert [a["id"] for a in anns] == [1, 2, 3]
    assert anns[0] == {"id": 1, "image_id": 0, "category_id": 0, "bbox": [80.0, 30.0, 40.0, 40.0],
                       "area": 1600.0, "iscrowd": 0}
    assert anns[1]["bbox"] == [0.0, 50.0, 100.0, 50.0] and anns[1]["category_id"] == 2
    assert anns[2]["image_id"] == 2 and anns[2]["bbox"] == [20.0, 45.0, 40.0, 30.0]
    assert not any(a["image_id"] == 1 for a in anns)


def test_converted_ground_truth_evaluates(tmp_path):
    """Exact detections of the converted boxes score 1; the empty image changes nothing."""
    spec = load_spec(make_yolo_dataset(tmp_path / "ds"))
    gt_json = yolo_to_coco(spec, "val", tmp_path / "coco_val.json")
    gt = json.loads(gt_json.read_text())
    dets = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.8}
            for a in gt["annotations"]]
    m = compute_metrics(gt_json, dets)
    assert m["map50_95"] == pytest.approx(1.0) and m["num_images"] == 3


def test_ensure_coco_gt_builds_once(tmp_path):
    spec = load_spec(make_yolo_dataset(tmp_path / "ds"))
    out = tmp_path / "coco_val.json"
    ensure_coco_gt(spec, "val", out)
    first = out.stat().st_mtime_ns
    ensure_coco_gt(spec, "val", out)
    assert out.stat().st_mtime_ns == first  # reused
    out.write_text('{"images": []}')  # a stale file (wrong number of images) is rebuilt
    ensure_coco_gt(spec, "val", out)
    assert len(json.loads(out.read_text())["images"]) == 3


def test_unreadable_image_is_a_user_error(tmp_path):
    from detscale.errors import UserError

    yaml_path = make_yolo_dataset(tmp_path / "ds")
    (tmp_path / "ds" / "images" / "val" / "b.png").write_bytes(b"not an image")
    with pytest.raises(UserError, match="b.png"):
        yolo_to_coco(load_spec(yaml_path), "val", tmp_path / "coco.json")


def test_ground_truth_holds_the_boxes_training_uses_and_is_rebuilt_from_an_older_version(tmp_path):
    """A border object labelled beyond the image is clipped in the ground truth as in training; a
    ground truth written before that (no version) is rebuilt, not reused."""
    from detscale.metrics.coco import GT_VERSION, ensure_coco_gt

    for split in ("train", "val"):
        (tmp_path / "images" / split).mkdir(parents=True)
        (tmp_path / "labels" / split).mkdir(parents=True)
        cv2.imwrite(str(tmp_path / "images" / split / "a.png"), np.zeros((50, 100, 3), np.uint8))
        (tmp_path / "labels" / split / "a.txt").write_text("0 0.95 0.5 0.2 0.4\n0 0.95 0.5 0.2 0.4\n")
    (tmp_path / "data.yaml").write_text("path: .\ntrain: images/train\nval: images/val\nnames: [thing]\n")
    spec = load_spec(tmp_path / "data.yaml")
    out = tmp_path / "gt.json"
    out.write_text(json.dumps({"info": {}, "images": [{"id": 0}], "annotations": [], "categories": []}))
    gt = json.loads(ensure_coco_gt(spec, "val", out).read_text())
    assert gt["info"]["detscale_gt_version"] == GT_VERSION
    (ann,) = gt["annotations"]  # the repeated line once
    assert ann["bbox"] == pytest.approx([85.0, 15.0, 15.0, 20.0], abs=1e-3)  # x from 85 to the border at 100
