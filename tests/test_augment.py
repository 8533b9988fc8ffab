"""Augmentation: geometry of each step, and boxes that stay on their objects through the pipeline."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from detscale.config import AugmentConfig
from detscale.data import augment as aug
from detscale.data.dataset import DetectionDataset, SampleKey
from detscale.data.formats import load_spec

IMGSZ = 128
BACKGROUND = (90, 90, 90)
# One colour per class, far apart from each other, the background and the grey padding (114).
COLOURS = [(230, 30, 30), (30, 230, 30), (30, 30, 230), (230, 230, 30), (230, 30, 230), (30, 230, 230)]


def test_letterbox_geometry() -> None:
    img = np.zeros((50, 100, 3), np.uint8)
    img[:, :50] = 255  # left half white
    out, ratio, pad = aug.letterbox(img, 64)
    assert out.shape == (64, 64, 3) and ratio == pytest.approx(0.64) and pad == (0, 16)
    assert (out[:16] == aug.PAD_VALUE).all() and (out[16 + 32:] == aug.PAD_VALUE).all()
    assert (out[16:48, :30] == 255).all() and (out[16:48, 34:] == 0).all()
    boxes = aug.yolo_to_xyxy(np.array([[0.25, 0.5, 0.5, 1.0]], np.float32), 100, 50, ratio, pad)
    np.testing.assert_allclose(boxes, [[0, 16, 32, 48]], atol=1e-5)
    np.testing.assert_allclose(aug.xyxy_to_yolo(boxes, 64, 64), [[0.25, 0.5, 0.5, 0.5]], atol=1e-6)


def test_box_candidates_thresholds() -> None:
    before = np.array([[0, 0, 100, 100]] * 4, np.float32)
    after = np.array([
        [0, 0, 100, 100],  # untouched
        [0, 0, 100, 5],    # 5 % of its area left
        [0, 0, 1.5, 100],  # 1.5 px wide
        [0, 0, 60, 2.5],   # aspect 24 (and only 1.5 % left)
    ], np.float32)
    assert aug.box_candidates(before, after).tolist() == [True, False, False, False]
    assert aug.box_candidates(before[:1], np.array([[0, 0, 90, 30]], np.float32)).tolist() == [True]


def test_fliplr_hsv_and_mixup() -> None:
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)
    flipped, boxes = aug.fliplr(img, np.array([[2, 3, 10, 8]], np.float32))
    np.testing.assert_array_equal(flipped, img[:, ::-1])
    np.testing.assert_allclose(boxes, [[20, 3, 28, 8]])
    assert aug.hsv_jitter(img, 0, 0, 0, rng) is img
    jittered = aug.hsv_jitter(img, 0.015, 0.7, 0.4, np.random.default_rng(1))
    assert jittered.shape == img.shape and jittered.dtype == np.uint8 and not np.array_equal(jittered, img)
    a = (img, np.array([[0, 0, 5, 5]], np.float32), np.array([1], np.float32))
    b = (img[::-1].copy(), np.array([[5, 5, 9, 9]], np.float32), np.array([2], np.float32))
    mixed, mboxes, mcls = aug.mixup(a, b, rng)
    assert mixed.shape == img.shape and len(mboxes) == 2 and mcls.tolist() == [1, 2]


def test_random_affine_moves_boxes_with_pixels() -> None:
    img = np.full((100, 100, 3), 0, np.uint8)
    img[20:40, 50:90] = 255
    boxes = np.array([[50, 20, 90, 40]], np.float32)
    out, moved, cls = aug.random_affine(img, boxes, np.array([3.0], np.float32), 64, 0.3, 0.1,
                                        np.random.default_rng(4))
    assert out.shape == (64, 64, 3) and cls.tolist() == [3.0]
    x1, y1, x2, y2 = moved[0]
    inner = out[int(np.ceil(y1)) + 1:int(y2) - 1, int(np.ceil(x1)) + 1:int(x2) - 1]
    assert inner.size and (inner == 255).all()
    outside = out.copy()
    outside[max(int(y1) - 1, 0):int(np.ceil(y2)) + 1, max(int(x1) - 1, 0):int(np.ceil(x2)) + 1] = 0
    assert (outside != 255).all()


def _coloured_dataset(root: Path, n: int = 8, seed: int = 0) -> Path:
    """PNG images (lossless) of non-overlapping filled rectangles, class = colour index."""
    rng = np.random.default_rng(seed)
    (root / "images" / "train").mkdir(parents=True)
    (root / "labels" / "train").mkdir(parents=True)
    for i in range(n):
        h, w = int(rng.integers(80, 140)), int(rng.integers(80, 140))
        img = np.full((h, w, 3), BACKGROUND, np.uint8)
        lines = []
        # A 2 x 2 grid of cells, one rectangle in each: they never overlap.
        for k, (gy, gx) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            cls = int((i + k) % len(COLOURS))
            cw, ch = w // 2, h // 2
            bw, bh = int(rng.integers(cw // 3, cw - 4)), int(rng.integers(ch // 3, ch - 4))
            x = gx * cw + int(rng.integers(2, cw - bw - 1))
            y = gy * ch + int(rng.integers(2, ch - bh - 1))
            img[y:y + bh, x:x + bw] = COLOURS[cls]
            lines.append(f"{cls} {(x + bw / 2) / w} {(y + bh / 2) / h} {bw / w} {bh / h}")
        cv2.imwrite(str(root / "images" / "train" / f"{i}.png"), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
        (root / "labels" / "train" / f"{i}.txt").write_text("\n".join(lines) + "\n")
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(root), "train": "images/train", "val": "images/train",
                                    "names": [f"c{k}" for k in range(len(COLOURS))]}))
    return data


def _is_colour(img: np.ndarray, colour: tuple[int, int, int], tol: int) -> np.ndarray:
    return (np.abs(img.astype(np.int16) - np.array(colour, np.int16)) <= tol).all(axis=-1)


def _check_boxes_on_objects(img: np.ndarray, labels: np.ndarray) -> int:
    """Each box covers its class's colour; each sizeable blob of a colour is inside a box of it.

    Returns the number of boxes checked, so a test can make sure it checked something.
    """
    h, w = img.shape[:2]
    px = labels[:, 1:].copy()
    px[:, [0, 2]] *= w
    px[:, [1, 3]] *= h
    xyxy = np.stack([px[:, 0] - px[:, 2] / 2, px[:, 1] - px[:, 3] / 2,
                     px[:, 0] + px[:, 2] / 2, px[:, 1] + px[:, 3] / 2], axis=1)
    for (cls, *_), (x1, y1, x2, y2) in zip(labels, xyxy, strict=True):
        colour = COLOURS[int(cls)]
        # Inside the box, away from the edges blurred by interpolation.
        inner = img[int(np.ceil(y1)) + 1:int(y2) - 1, int(np.ceil(x1)) + 1:int(x2) - 1]
        if inner.size == 0:
            inner = img[int((y1 + y2) / 2), int((x1 + x2) / 2)][None, None]
        share = _is_colour(inner, colour, 60).mean()
        assert share > 0.9, f"box {cls=} at {(x1, y1, x2, y2)} holds {share:.0%} of its colour"
    for cls, colour in enumerate(COLOURS):
        mask = _is_colour(img, colour, 30).astype(np.uint8)
        count, comp, stats, _ = cv2.connectedComponentsWithStats(mask, connectivity=4)
        covered = np.zeros((h, w), bool)
        for (c, *_), (x1, y1, x2, y2) in zip(labels, xyxy, strict=True):
            if int(c) == cls:
                covered[max(int(y1) - 1, 0):int(np.ceil(y2)) + 1, max(int(x1) - 1, 0):int(np.ceil(x2)) + 1] = True
        for k in range(1, count):
            x, y, bw, bh, area = stats[k]
            touches_border = x == 0 or y == 0 or x + bw == w or y + bh == h
            # Slivers cut by the crop at the image border are dropped on purpose (box_candidates).
            if area >= 50 and not touches_border:
                inside = covered[comp == k].mean()
                assert inside > 0.5, f"a blob of class {cls} at {(x, y, bw, bh)} has no box"
    return len(labels)


@pytest.mark.parametrize("mosaic", [True, False])
def test_boxes_stay_on_their_objects(tmp_path: Path, mosaic: bool) -> None:
    spec = load_spec(_coloured_dataset(tmp_path / "ds"), splits=("train",))
    cfg = AugmentConfig(hsv_h=0, hsv_s=0, hsv_v=0, translate=0.1, scale=0.5, fliplr=0.5, mosaic=1.0, mixup=0.0)
    ds = DetectionDataset(spec.splits["train"], IMGSZ, "none", None, cfg)
    checked = 0
    for epoch in range(3):
        for i in range(len(ds)):
            img, labels, meta = ds[SampleKey(i, epoch, mosaic, seed=7)]
            assert img.shape == (3, IMGSZ, IMGSZ) and labels.shape[1] == 5
            assert ((labels[:, 1:] >= 0) & (labels[:, 1:] <= 1)).all()
            checked += _check_boxes_on_objects(img.permute(1, 2, 0).numpy(), labels.numpy())
            assert meta["image_id"] == i
    assert checked > 40


def test_mosaic_mixes_four_images_and_can_be_switched_off(tmp_path: Path) -> None:
    spec = load_spec(_coloured_dataset(tmp_path / "ds", n=6), splits=("train",))
    cfg = AugmentConfig(hsv_h=0, hsv_s=0, hsv_v=0, translate=0.0, scale=0.0, fliplr=0.0, mosaic=1.0)
    ds = DetectionDataset(spec.splits["train"], IMGSZ, "none", None, cfg)
    with_mosaic = [len(ds[SampleKey(i, 0, True)][1]) for i in range(len(ds))]
    without = [len(ds[SampleKey(i, 0, False)][1]) for i in range(len(ds))]
    # Without mosaic (and no scaling or translation) every image keeps its own four objects.
    assert without == [4] * len(ds)
    # A mosaic crop at scale 1 shows parts of several images: more objects than one image has.
    assert max(with_mosaic) > 4
    # Validation items (augment=None) are the plain letterbox.
    val = DetectionDataset(spec.splits["train"], IMGSZ, "none", None, None)
    img, labels, _ = val[0]
    assert len(labels) == 4
    _check_boxes_on_objects(img.permute(1, 2, 0).numpy(), labels.numpy())
