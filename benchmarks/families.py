"""Data families for the parity benchmark: generators that differ from ``detscale synth`` in what
makes detection hard, so that "learns like the reference" is not a finding about one generator.

- ``shapes``: 5 flat shapes (circle, square, triangle, cross, ring) in random colours on a soft
  colour gradient with pixel noise, 1-8 objects of 8-50 % of the side, overlapping at most 25 %
  of the smaller box. Clean and fast to learn: the reference reaches mAP@0.5:0.95 of about 0.6
  in 20 epochs, so a slower learner shows.
- ``dense``: 10 classes, 10-30 small objects (2-6 % of the side) per image with occlusion
  (later objects drawn over earlier ones; a label is dropped when less than half of it stays
  visible, and its box is the visible part's), on cluttered backgrounds (lines and blobs in the
  objects' colours).
- ``gray``: grayscale images of mixed, non-square sizes (long side 192-384 px, aspect 0.5-2),
  6 textured shapes of 6-45 % of the long side, 2-10 per image; training resizes and letterboxes.

Every image has its own generator seeded with ``(family, seed, split, index)``, so a dataset is a
function of its seed. Images are PNG (lossless: both trainers decode the same pixels). The layout
is YOLO's: ``images/{train,val}``, ``labels/{train,val}``, ``data.yaml`` written last.

    python benchmarks/families.py --family dense --out /tmp/dense --seed 0 --train 448 --val 200
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import yaml

FAMILIES = ("shapes", "dense", "gray")
_FAMILY_IDS = {name: i + 101 for i, name in enumerate(FAMILIES)}
_SPLIT_IDS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Family:
    names: tuple[str, ...]
    render: Callable[[np.random.Generator, int], tuple[np.ndarray, list[tuple[int, float, float, float, float]]]]
    description: str


# ---- drawing ---------------------------------------------------------------------------------


def _shape_mask(name: str, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """A filled ``h x w`` uint8 mask (255 inside) of ``name``; rotation-free, so its box is the mask's."""
    m = np.zeros((h, w), np.uint8)
    cx, cy, rx, ry = (w - 1) / 2, (h - 1) / 2, (w - 1) / 2, (h - 1) / 2
    centre = (round(cx), round(cy))
    if name in ("circle", "ellipse", "disc"):
        cv2.ellipse(m, centre, (max(round(rx), 1), max(round(ry), 1)), 0, 0, 360, 255, -1)
    elif name in ("square", "rect"):
        m[:] = 255
    elif name == "triangle":
        cv2.fillPoly(m, [np.array([[cx, 0], [w - 1, h - 1], [0, h - 1]], np.int32)], 255)
    elif name == "cross":
        t = 0.32
        m[:, round(w * (0.5 - t / 2)):round(w * (0.5 + t / 2)) + 1] = 255
        m[round(h * (0.5 - t / 2)):round(h * (0.5 + t / 2)) + 1, :] = 255
    elif name in ("ring", "annulus"):
        cv2.ellipse(m, centre, (max(round(rx), 1), max(round(ry), 1)), 0, 0, 360, 255, -1)
        cv2.ellipse(m, centre, (max(round(rx * 0.55), 1), max(round(ry * 0.55), 1)), 0, 0, 360, 0, -1)
    elif name == "diamond":
        cv2.fillPoly(m, [np.array([[cx, 0], [w - 1, cy], [cx, h - 1], [0, cy]], np.int32)], 255)
    elif name == "hexagon":
        pts = [[cx + rx * math.cos(a), cy + ry * math.sin(a)] for a in np.linspace(0, 2 * math.pi, 7)[:-1]]
        cv2.fillPoly(m, [np.array(pts, np.int32)], 255)
    elif name == "star":
        pts = []
        for k in range(10):
            a = -math.pi / 2 + k * math.pi / 5
            r = 1.0 if k % 2 == 0 else 0.42
            pts.append([cx + r * rx * math.cos(a), cy + r * ry * math.sin(a)])
        cv2.fillPoly(m, [np.array(pts, np.int32)], 255)
    elif name == "arrow":
        shaft = [[0, cy - ry * 0.25], [w * 0.55, cy - ry * 0.25], [w * 0.55, cy + ry * 0.25], [0, cy + ry * 0.25]]
        head = [[w * 0.5, 0], [w - 1, cy], [w * 0.5, h - 1]]
        cv2.fillPoly(m, [np.array(shaft, np.int32), np.array(head, np.int32)], 255)
    elif name == "bar":
        m[round(h * 0.3):round(h * 0.7) + 1, :] = 255
    elif name == "semicircle":
        cv2.ellipse(m, (round(cx), h - 1), (max(round(rx), 1), max(h - 1, 1)), 0, 180, 360, 255, -1)
    elif name == "frame":
        m[:] = 255
        b = max(1, round(min(h, w) * 0.22))
        m[b:h - b, b:w - b] = 0
    else:
        raise ValueError(f"no shape {name!r}")
    return m


def _gradient(h: int, w: int, rng: np.random.Generator, channels: int = 3) -> np.ndarray:
    """A soft linear colour gradient between two random colours, float32 [h, w, channels]."""
    a, b = rng.uniform(30, 225, channels), rng.uniform(30, 225, channels)
    angle = rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = (xx * math.cos(angle) + yy * math.sin(angle))
    t = (t - t.min()) / max(float(t.max() - t.min()), 1.0)
    return a[None, None, :] * (1 - t[..., None]) + b[None, None, :] * t[..., None]


def _box_of(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def _overlap_of_smaller(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    iw = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return iw * ih / max(smaller, 1)


def _place(rng: np.random.Generator, w: int, h: int, size: Callable[[], tuple[int, int]],
           boxes: list[tuple[int, int, int, int]], max_overlap: float) -> tuple[int, int, int, int] | None:
    """A box of ``size()`` inside ``w x h`` overlapping each of ``boxes`` by at most ``max_overlap`` of the
    smaller box; ``None`` after 30 tries."""
    for _try in range(30):
        ow, oh = size()
        x0, y0 = int(rng.integers(0, w - ow + 1)), int(rng.integers(0, h - oh + 1))
        box = (x0, y0, x0 + ow, y0 + oh)
        if all(_overlap_of_smaller(box, b) <= max_overlap for b in boxes):
            return box
    return None


def _label(cls: int, box: tuple[int, int, int, int], w: int, h: int) -> tuple[int, float, float, float, float]:
    x0, y0, x1, y1 = box
    return cls, (x0 + x1) / 2 / w, (y0 + y1) / 2 / h, (x1 - x0) / w, (y1 - y0) / h


# ---- the families -------------------------------------------------------------------------------

SHAPES5 = ("circle", "square", "triangle", "cross", "ring")


def render_shapes(rng: np.random.Generator, imgsz: int):
    """Flat shapes in random colours on a gradient with noise; boxes overlap <= 25 % of the smaller."""
    img = _gradient(imgsz, imgsz, rng)
    labels, boxes = [], []
    def size() -> tuple[int, int]:
        side = int(rng.uniform(0.08, 0.5) * imgsz)
        short = max(4, int(side * rng.uniform(0.6, 1.0)))
        return (side, short) if rng.random() < 0.5 else (short, side)

    for _ in range(int(rng.integers(1, 9))):
        placed = _place(rng, imgsz, imgsz, size, boxes, 0.25)
        if placed is None:
            continue
        x0, y0, x1, y1 = placed
        w, h = x1 - x0, y1 - y0
        cls = int(rng.integers(0, len(SHAPES5)))
        mask = _shape_mask(SHAPES5[cls], h, w, rng)
        colour = rng.uniform(0, 255, 3)
        region = img[y0:y0 + h, x0:x0 + w]
        region[mask > 0] = colour
        tight = _box_of(mask)
        box = (x0 + tight[0], y0 + tight[1], x0 + tight[2], y0 + tight[3])
        boxes.append(box)
        labels.append(_label(cls, box, imgsz, imgsz))
    img += rng.normal(0, 8, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8), labels


DENSE10 = ("disc", "rect", "triangle", "cross", "annulus", "diamond", "hexagon", "star", "arrow", "bar")


def render_dense(rng: np.random.Generator, imgsz: int):
    """10-30 small objects (2-6 % of the side) with occlusion on a cluttered background."""
    img = _gradient(imgsz, imgsz, rng)
    palette = rng.uniform(0, 255, (6, 3))
    for _ in range(int(rng.integers(8, 20))):  # clutter: lines and blobs in the objects' palette
        colour = palette[int(rng.integers(0, len(palette)))] * rng.uniform(0.7, 1.0)
        p0 = tuple(int(v) for v in rng.integers(0, imgsz, 2))
        if rng.random() < 0.5:
            p1 = tuple(int(v) for v in rng.integers(0, imgsz, 2))
            cv2.line(img, p0, p1, colour.tolist(), int(rng.integers(1, 3)))
        else:
            cv2.circle(img, p0, int(rng.integers(2, 8)), colour.tolist(), -1)
    owner = np.full((imgsz, imgsz), -1, np.int32)
    objects = []
    for k in range(int(rng.integers(10, 31))):
        side = max(5, int(rng.uniform(0.02, 0.06) * imgsz))
        w, h = side, max(4, int(side * rng.uniform(0.7, 1.3)))
        x0, y0 = int(rng.integers(0, imgsz - w + 1)), int(rng.integers(0, imgsz - h + 1))
        cls = int(rng.integers(0, len(DENSE10)))
        mask = _shape_mask(DENSE10[cls], h, w, rng) > 0
        colour = palette[int(rng.integers(0, len(palette)))]
        img[y0:y0 + h, x0:x0 + w][mask] = colour
        owner[y0:y0 + h, x0:x0 + w][mask] = k
        objects.append((k, cls, int(mask.sum())))
    labels = []
    for k, cls, area in objects:
        visible = owner == k
        if visible.sum() < 0.5 * area:
            continue  # mostly hidden: neither labelled nor a fair miss
        labels.append(_label(cls, _box_of(visible), imgsz, imgsz))
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8), labels


GRAY6 = ("circle", "square", "triangle", "star", "semicircle", "frame")


def render_gray(rng: np.random.Generator, imgsz: int):
    """Grayscale, non-square, mixed sizes; textured shapes (a stripe pattern over the fill)."""
    long_side = int(rng.integers(192, 385))
    aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    if aspect >= 1:
        w, h = long_side, max(32, int(long_side / aspect))
    else:
        w, h = max(32, int(long_side * aspect)), long_side
    img = _gradient(h, w, rng, channels=1)[..., 0]
    labels, boxes = [], []
    def size() -> tuple[int, int]:
        side = int(rng.uniform(0.06, 0.45) * long_side)
        ow, oh = min(side, w - 1), min(max(5, int(side * rng.uniform(0.6, 1.0))), h - 1)
        if rng.random() < 0.5:
            ow, oh = min(oh, w - 1), min(ow, h - 1)
        return max(ow, 5), max(oh, 5)

    for _ in range(int(rng.integers(2, 11))):
        placed = _place(rng, w, h, size, boxes, 0.2)
        if placed is None:
            continue
        x0, y0, x1, y1 = placed
        ow, oh = x1 - x0, y1 - y0
        cls = int(rng.integers(0, len(GRAY6)))
        mask = _shape_mask(GRAY6[cls], oh, ow, rng) > 0
        base = rng.uniform(0, 255)
        period = rng.uniform(3, 9)
        stripes = 25 * np.sin(np.arange(ow)[None, :] * 2 * math.pi / period + rng.uniform(0, 6.3))
        fill = np.clip(base + stripes + np.zeros((oh, 1)), 0, 255)
        img[y0:y0 + oh, x0:x0 + ow][mask] = fill[mask]
        tight = _box_of(mask)
        box = (x0 + tight[0], y0 + tight[1], x0 + tight[2], y0 + tight[3])
        boxes.append(box)
        labels.append(_label(cls, box, w, h))
    img += rng.normal(0, 7, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8), labels


FAMILY_SPECS: dict[str, Family] = {
    "shapes": Family(SHAPES5, render_shapes, "5 flat shapes in random colours, 1-8 per image, 8-50 % of the side"),
    "dense": Family(DENSE10, render_dense, "10 classes, 10-30 small (2-6 %) occluding objects, cluttered"),
    "gray": Family(GRAY6, render_gray, "grayscale, mixed non-square sizes, 6 textured shapes, 2-10 per image"),
}


def image_rng(family: str, seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([_FAMILY_IDS[family], seed, _SPLIT_IDS[split], index])


def generate(family: str, out: Path, seed: int = 0, train: int = 448, val: int = 200, imgsz: int = 256) -> Path:
    """Write ``family``'s dataset of ``seed`` to ``out``; returns its ``data.yaml`` (reused when present)."""
    spec = FAMILY_SPECS[family]
    data_yaml = out / "data.yaml"
    if data_yaml.is_file():
        return data_yaml
    for split, n in (("train", train), ("val", val)):
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
        (out / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            img, labels = spec.render(image_rng(family, seed, split, i), imgsz)
            if img.ndim == 3:
                img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
            cv2.imwrite(str(out / "images" / split / f"{i:06d}.png"), img)
            text = "".join(f"{c} {x:.6f} {y:.6f} {w:.6f} {h:.6f}\n" for c, x, y, w, h in labels)
            (out / "labels" / split / f"{i:06d}.txt").write_text(text)
    data_yaml.write_text(yaml.safe_dump({"path": ".", "train": "images/train", "val": "images/val",
                                         "names": dict(enumerate(spec.names))}, sort_keys=False))
    return data_yaml


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=448)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--imgsz", type=int, default=256)
    args = p.parse_args()
    print(generate(args.family, args.out, args.seed, args.train, args.val, args.imgsz))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
