"""The same small dataset as YOLO, COCO JSON and Pascal VOC: one clean view, one cache, one ground
truth, one mAP; COCO's crowd boxes and VOC's difficult objects handled as documented."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from detscale.data import formats, sources
from detscale.data.validate import validate
from detscale.metrics.coco import coco_ground_truth, compute_metrics

NAMES = ["cat", "dog", "bird"]
COCO_IDS = [3, 7, 9]  # non-contiguous category ids, as COCO's own (1..90 with gaps)
W, H = 64, 48  # not square
# image -> boxes (class, x, y, w, h) in pixels; x, w multiples of 2 and y, h of 6, so that the
# normalised values are exact in 6 decimals and every format gives the same numbers
BOXES = {
    "train": {"a": [(0, 8, 6, 16, 12), (2, 30, 18, 20, 24)], "b": [(1, 4, 0, 40, 36)], "c": [],
              "d": [(0, 0, 12, 64, 24), (1, 50, 30, 10, 18)]},
    "val": {"e": [(2, 10, 6, 30, 30)], "f": [(0, 20, 12, 24, 18), (1, 2, 24, 14, 24)]},
}


def _image(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.random.default_rng(seed).integers(0, 256, (H, W, 3), dtype=np.uint8)
    cv2.imwrite(str(path), img)


def write_yolo(root: Path) -> Path:
    for seed, (split, images) in enumerate(BOXES.items()):
        for i, (name, boxes) in enumerate(images.items()):
            _image(root / "images" / split / f"{name}.jpg", 10 * seed + i)
            label = root / "labels" / split / f"{name}.txt"
            label.parent.mkdir(parents=True, exist_ok=True)
            label.write_text("".join(f"{c} {(x + w / 2) / W:.6f} {(y + h / 2) / H:.6f} {w / W:.6f} {h / H:.6f}\n"
                                     for c, x, y, w, h in boxes))
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"path": ".", "train": "images/train", "val": "images/val", "names": NAMES}))
    return data


def write_coco(root: Path, images_from: Path, crowd: dict[str, list[tuple]] | None = None) -> Path:
    doc_yaml: dict = {"format": "coco"}
    for split, images in BOXES.items():
        doc: dict = {"images": [], "annotations": [],
                     "categories": [{"id": cid, "name": n} for cid, n in zip(COCO_IDS, NAMES, strict=True)]}
        for k, (name, boxes) in enumerate(images.items()):
            image_id = 1000 + k  # ids of their own, not indices
            doc["images"].append({"id": image_id, "file_name": f"{name}.jpg", "width": W, "height": H})
            extra = [(*b, 1) for b in (crowd or {}).get(name, [])]
            for c, x, y, w, h, *is_crowd in [*boxes, *extra]:
                doc["annotations"].append({"id": len(doc["annotations"]) + 1, "image_id": image_id,
                                           "category_id": COCO_IDS[c], "bbox": [x, y, w, h], "area": w * h * 0.8,
                                           "iscrowd": is_crowd[0] if is_crowd else 0})
        (root / "annotations").mkdir(parents=True, exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(doc))
        doc_yaml[split] = {"annotations": f"annotations/instances_{split}.json",
                           "images": str(images_from / "images" / split)}
    data = root / "coco.yaml"
    data.write_text(yaml.safe_dump(doc_yaml))
    return data


def write_voc(root: Path, images_from: Path, difficult: dict[str, list[tuple]] | None = None) -> Path:
    (root / "Annotations").mkdir(parents=True)
    (root / "JPEGImages").mkdir()
    (root / "ImageSets" / "Main").mkdir(parents=True)
    for split, images in BOXES.items():
        for name, boxes in images.items():
            (root / "JPEGImages" / f"{name}.jpg").write_bytes((images_from / "images" / split / f"{name}.jpg")
                                                              .read_bytes())
            objects = "".join(
                f"<object><name>{NAMES[c]}</name><difficult>{d}</difficult><bndbox><xmin>{x + 1}</xmin>"
                f"<ymin>{y + 1}</ymin><xmax>{x + w + 1}</xmax><ymax>{y + h + 1}</ymax></bndbox></object>"
                for c, x, y, w, h, d in [*(b + (0,) for b in boxes),
                                         *(b + (1,) for b in (difficult or {}).get(name, []))])
            (root / "Annotations" / f"{name}.xml").write_text(
                f"<annotation><size><width>{W}</width><height>{H}</height><depth>3</depth></size>{objects}"
                "</annotation>")
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{n}\n" for n in images))
    data = root / "voc.yaml"
    data.write_text(yaml.safe_dump({"path": ".", "train": "train", "val": "val", "names": NAMES}))
    return data


PREDICTIONS = [  # image index in the val split, class, box, score: hits, a near miss, a false positive
    {"image_id": 0, "category_id": 2, "bbox": [10, 6, 30, 30], "score": 0.9},
    {"image_id": 1, "category_id": 0, "bbox": [22, 13, 22, 17], "score": 0.8},
    {"image_id": 1, "category_id": 1, "bbox": [40, 0, 10, 10], "score": 0.7},  # ranked above the hit below
    {"image_id": 1, "category_id": 1, "bbox": [2, 24, 14, 24], "score": 0.6},
]


def _labels(clean_yaml: Path, split: str) -> list[np.ndarray]:
    spec = formats.load_spec(clean_yaml)
    return [formats.read_labels(formats.label_path_for(p)) for p in spec.splits[split]]


@pytest.fixture
def three(tmp_path: Path) -> dict[str, Path]:
    yolo = write_yolo(tmp_path / "yolo")
    return {"yolo": yolo, "coco": write_coco(tmp_path / "coco", yolo.parent),
            "voc": write_voc(tmp_path / "voc", yolo.parent)}


def test_three_formats_give_one_clean_view_cache_ground_truth_and_map(three: dict[str, Path], tmp_path: Path):
    from detscale.data.cache import build_cache

    clean, gts, maps, caches = {}, {}, {}, {}
    for fmt, data_yaml in three.items():
        report = validate(data_yaml, tmp_path / f"out-{fmt}", policy="fail", workers=1)
        assert report.source_format == fmt
        clean[fmt] = tmp_path / f"out-{fmt}" / "data.yaml"
        gts[fmt] = coco_ground_truth(formats.load_spec(clean[fmt]), "val")
        gt_path = tmp_path / f"gt-{fmt}.json"
        gt_path.write_text(json.dumps(gts[fmt]))
        maps[fmt] = compute_metrics(gt_path, [dict(p) for p in PREDICTIONS])
        index = build_cache(formats.load_spec(clean[fmt]), "train", 64, tmp_path / f"cache-{fmt}", workers=1,
                            progress=False)
        caches[fmt] = index.with_suffix(".npy").read_bytes()
    assert formats.load_spec(clean["coco"]).names == tuple(NAMES) == formats.load_spec(clean["voc"]).names
    for fmt in ("coco", "voc"):
        for split in ("train", "val"):
            ours, theirs = _labels(clean[fmt], split), _labels(clean["yolo"], split)
            assert len(ours) == len(theirs) and all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
        assert caches[fmt] == caches["yolo"]  # the same pixels, read through the links
        assert [(i["width"], i["height"]) for i in gts[fmt]["images"]] == [(W, H), (W, H)]
        boxes = [(a["image_id"], a["category_id"], a["bbox"]) for a in gts[fmt]["annotations"]]
        expected = [(a["image_id"], a["category_id"], a["bbox"]) for a in gts["yolo"]["annotations"]]
        assert [b[:2] for b in boxes] == [e[:2] for e in expected]
        np.testing.assert_allclose([b[2] for b in boxes], [e[2] for e in expected], atol=1e-3)
        for key in ("map50_95", "map50", "map75"):
            assert maps[fmt][key] == pytest.approx(maps["yolo"][key], abs=1e-9), (fmt, key)
    # the view links the user's files, never copies or changes them
    view = tmp_path / "out-coco" / "source" / "images" / "train" / "a.jpg"
    assert view.is_symlink() and view.resolve() == (three["yolo"].parent / "images" / "train" / "a.jpg").resolve()
    assert "format: `coco` (converted" in (tmp_path / "out-coco" / "validation.md").read_text()


def test_coco_is_scored_against_its_own_json_crowd_boxes_ignored(tmp_path: Path):
    """Crowd boxes are not trained on; in evaluation a detection on one is neither hit nor false
    positive, and the figures equal COCOeval's on the original file with the predictions mapped back."""
    from faster_coco_eval import COCO, COCOeval_faster

    yolo = write_yolo(tmp_path / "yolo")
    data = write_coco(tmp_path / "coco", yolo.parent, crowd={"a": [(1, 40, 0, 20, 12)], "f": [(1, 40, 0, 20, 12)]})
    report = validate(data, tmp_path / "out", policy="fail", workers=1)
    assert any("1 iscrowd box(es) left out of training" in n for n in report.conversion_notes)
    assert any("3->0" in n for n in report.conversion_notes)  # the category map is stated
    clean = tmp_path / "out" / "data.yaml"
    assert all(np.array_equal(a, b) for a, b in zip(_labels(clean, "train"), _labels(yolo, "train"), strict=True))
    gt = coco_ground_truth(formats.load_spec(clean), "val")
    assert [a["iscrowd"] for a in gt["annotations"] if a["image_id"] == 1] == [0, 0, 1]
    gt_path = tmp_path / "gt.json"
    gt_path.write_text(json.dumps(gt))
    ours = compute_metrics(gt_path, [dict(p) for p in PREDICTIONS])  # the false positive lies on the crowd box

    original = tmp_path / "coco" / "annotations" / "instances_val.json"
    ids = [im["id"] for im in json.loads(original.read_text())["images"]]
    mapped = [dict(p, image_id=ids[p["image_id"]], category_id=COCO_IDS[p["category_id"]]) for p in PREDICTIONS]
    from detscale.metrics.coco import original_ids

    written, said = original_ids(formats.load_spec(clean), "val", [dict(p) for p in PREDICTIONS])
    assert written == mapped and "instances" not in (said or "") and "COCO annotations" in (said or "")
    coco_gt = COCO(str(original))
    evaluator = COCOeval_faster(coco_gt, coco_gt.loadRes(mapped), "bbox", print_function=lambda *a: None)
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    assert ours["map50_95"] == pytest.approx(float(evaluator.stats[0]), abs=1e-9)
    assert ours["map50"] == pytest.approx(float(evaluator.stats[1]), abs=1e-9)
    no_crowd = write_coco(tmp_path / "coco2", yolo.parent)
    validate(no_crowd, tmp_path / "out2", policy="fail", workers=1)
    gt_path.write_text(json.dumps(coco_ground_truth(formats.load_spec(tmp_path / "out2" / "data.yaml"), "val")))
    assert compute_metrics(gt_path, [dict(p) for p in PREDICTIONS])["map50"] < ours["map50"]  # there it is an FP


def test_voc_difficult_objects_are_not_trained_on_and_ignored_in_evaluation(tmp_path: Path):
    yolo = write_yolo(tmp_path / "yolo")
    data = write_voc(tmp_path / "voc", yolo.parent, difficult={"b": [(2, 40, 36, 20, 12)], "f": [(1, 40, 0, 20, 12)]})
    report = validate(data, tmp_path / "out", policy="fail", workers=1)
    assert any("1 difficult object(s) left out of training" in n for n in report.conversion_notes)
    clean = tmp_path / "out" / "data.yaml"
    assert all(np.array_equal(a, b) for a, b in zip(_labels(clean, "train"), _labels(yolo, "train"), strict=True))
    gt = coco_ground_truth(formats.load_spec(clean), "val")
    assert [a["iscrowd"] for a in gt["annotations"] if a["image_id"] == 1] == [0, 0, 1]
    data.write_text(yaml.safe_dump({"path": ".", "train": "train", "val": "val", "names": NAMES,
                                    "difficult": "include"}))
    validate(data, tmp_path / "out-inc", policy="fail", workers=1)
    trained = _labels(tmp_path / "out-inc" / "data.yaml", "train")
    assert sum(len(a) for a in trained) == sum(len(a) for a in _labels(yolo, "train")) + 1


def test_sources_refuse_what_they_cannot_read(tmp_path: Path):
    yolo = write_yolo(tmp_path / "yolo")
    data = write_coco(tmp_path / "coco", yolo.parent)
    doc = json.loads((tmp_path / "coco" / "annotations" / "instances_val.json").read_text())
    doc["images"][0]["width"] = 99  # the image is 64 wide
    (tmp_path / "coco" / "annotations" / "instances_val.json").write_text(json.dumps(doc))
    report = validate(data, tmp_path / "out", policy="fail", workers=1)
    assert report.split_stats()["val"]["images"] == 1
    assert any("annotations say 99x48: left out" in n for n in report.conversion_notes)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"format": "coco", "train": "images/train", "val": "images/val"}))
    with pytest.raises(formats.DatasetError, match="'train' must be a mapping with 'annotations'"):
        sources.convert(bad, tmp_path / "x")
    bad.write_text(yaml.safe_dump({"format": "pascal", "train": "t", "val": "v"}))
    with pytest.raises(formats.DatasetError, match="use one of yolo, coco, voc"):
        sources.convert(bad, tmp_path / "x")


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_rotated_images_boxes_follow_the_rotation(tmp_path: Path, orientation: int):
    """A bright box on a dark image, stored unrotated with an EXIF orientation, annotated in COCO on the
    image as stored: where the orientation swaps the sides (6, 8), the converted YOLO box is where
    OpenCV's decoded image has the bright pixels; where it keeps them (3), the size cannot tell, and the
    box is taken as drawn on the decoded image, as Ultralytics' converter takes it, with a note."""
    from PIL import Image

    stored_w, stored_h, box = 64, 32, (40, 4, 16, 8)  # x, y, w, h on the image as stored
    pixels = np.zeros((stored_h, stored_w, 3), np.uint8)
    x, y, w, h = box
    pixels[y:y + h, x:x + w] = 255
    folder = tmp_path / "images"
    for split in ("train", "val"):
        (folder / split).mkdir(parents=True)
        exif = Image.Exif()
        exif[0x0112] = orientation
        pixels[0, 0] = 7 if split == "val" else 0  # not the same image in both splits
        Image.fromarray(pixels).save(folder / split / "a.png", exif=exif.tobytes())
    doc = {"images": [{"id": 1, "file_name": "a.png", "width": stored_w, "height": stored_h}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": list(box), "area": w * h,
                            "iscrowd": 0}], "categories": [{"id": 1, "name": "light"}]}
    (tmp_path / "ann.json").write_text(json.dumps(doc))
    data = tmp_path / "coco.yaml"
    data.write_text(yaml.safe_dump({"format": "coco", **{s: {"annotations": "ann.json", "images": f"images/{s}"}
                                                         for s in ("train", "val")}}))
    report = validate(data, tmp_path / "out", policy="fail", workers=1)
    assert report.split_stats()["train"]["images"] == 1
    decoded = cv2.imread(str(folder / "train" / "a.png"))  # OpenCV applies the orientation, as training does
    assert decoded.shape[:2] == ((stored_w, stored_h) if orientation in (6, 8) else (stored_h, stored_w))
    rows, cols = np.nonzero(decoded[:, :, 0] > 128)
    dh, dw = decoded.shape[:2]
    label = _labels(tmp_path / "out" / "data.yaml", "train")[0]
    expected = [0, (cols.min() + cols.max() + 1) / 2 / dw, (rows.min() + rows.max() + 1) / 2 / dh,
                (cols.max() + 1 - cols.min()) / dw, (rows.max() + 1 - rows.min()) / dh]
    if orientation == 3:
        expected = [0, (x + w / 2) / stored_w, (y + h / 2) / stored_h, w / stored_w, h / stored_h]
        assert any("keeps its sides" in n for n in report.conversion_notes)
    np.testing.assert_allclose(label[0], expected, atol=1e-6)
    if orientation != 1:
        assert any(f"EXIF orientation {orientation}" in n for n in report.conversion_notes)
        notes = json.loads((tmp_path / "out" / "validation.json").read_text())["findings"]
        assert any(f["kind"] == "image_exif_rotated" for f in notes)


def test_image_edge_cases_are_named_and_decoded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """CMYK, 16-bit, alpha and very large images: each named by the validator, each decoded to 8-bit
    RGB for training; a very large JPEG decoded reduced, its geometry still the original's."""
    from PIL import Image

    from detscale.data import checks as validation
    from detscale.data import decode as decoding

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    files = {"cmyk.jpg": lambda p: Image.fromarray(rgb).convert("CMYK").save(p, quality=95),
             "deep.png": lambda p: cv2.imwrite(str(p), rgb.astype(np.uint16) * 257),
             "alpha.png": lambda p: cv2.imwrite(str(p), np.dstack([rgb, np.full((48, 64), 128, np.uint8)])),
             "large.jpg": lambda p: cv2.imwrite(str(p), cv2.resize(rgb, (256, 192)))}
    monkeypatch.setattr(validation, "LARGE_PIXELS", 10_000)  # 256 x 192 = 49,152 pixels: "very large" here
    monkeypatch.setattr(decoding, "LARGE_PIXELS", 10_000)  # the decoder's own threshold
    kinds = {}
    for name, write in files.items():
        path = tmp_path / name
        write(path)
        digest, findings = validation.check_image_file(path, "train")
        assert digest is not None and all(f.severity == "info" for f in findings)
        kinds[name] = {f.kind for f in findings}
        img = decoding.decode_image(path)
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
    assert kinds == {"cmyk.jpg": {"image_cmyk"}, "deep.png": {"image_16bit"}, "alpha.png": {"image_alpha"},
                     "large.jpg": {"image_large"}}
    img, original = decoding.decode_for(tmp_path / "large.jpg", 64)
    assert original == (192, 256) and img.shape == (48, 64, 3)  # 1/4: 256 // 4 = 64, not below the training size
    out, meta = decoding.load_letterboxed(tmp_path / "large.jpg", 64)
    full = decoding.decode_image(tmp_path / "large.jpg")
    from detscale.data.augment import letterbox

    reference, ratio, pad = letterbox(full, 64)
    assert meta["orig_shape"] == [192, 256] and meta["ratio"] == pytest.approx(ratio) and meta["pad"] == list(pad)
    assert np.abs(out.astype(int) - reference.astype(int)).mean() < 12  # another resampling of the same image


def test_the_validate_command_converts_and_says_so(three: dict[str, Path], tmp_path: Path):
    """`detscale validate` on a COCO yaml, as the workflow's rule calls it: converted, validated, stated."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "detscale", "validate", str(three["coco"]), "--out",
                           str(tmp_path / "out"), "--workers", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"validate: {three['coco'].resolve()}" in proc.stdout and "format: coco, converted" in proc.stdout
    assert "train 4 images" in proc.stdout and "mapped to contiguous class ids" in proc.stdout
