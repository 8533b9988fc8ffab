"""Image and box augmentation for detection training: pure functions on numpy arrays.

Images are ``uint8 [H, W, 3]`` RGB; boxes are ``float32 [n, 4]`` pixel ``x1, y1, x2, y2`` with
the class ids in a parallel ``float32 [n]`` array, so every geometric step moves the boxes with
the pixels and :func:`box_candidates` drops the ones that became too small, too thin or mostly
cut away (the reference's thresholds). Randomness comes only from the ``numpy.random.Generator``
passed in, so one seed gives one result whatever process runs it.

The orchestration (which images form a mosaic, when mosaic is on) lives in
:mod:`detscale.data.dataset`; parameters come from :class:`detscale.config.AugmentConfig`.
"""

from __future__ import annotations

import cv2
import numpy as np

PAD_VALUE = 114  # grey used by the reference for letterbox padding and affine borders

# OpenCV's own thread pool does not survive fork(): a DataLoader worker forked after the parent
# ran a parallel OpenCV call can deadlock in its first one. Parallelism comes from loader workers
# (and decoding processes) instead, so OpenCV runs single-threaded in every detscale process.
cv2.setNumThreads(0)


def letterbox(
    img: np.ndarray, imgsz: int, out: np.ndarray | None = None
) -> tuple[np.ndarray, float, tuple[int, int]]:
    """Resize so the long side is ``imgsz`` (aspect kept), pad with grey to ``imgsz x imgsz``, centred.

    Returns ``(image, ratio, (pad_w, pad_h))``: a source pixel ``(x, y)`` lands at
    ``(x * ratio + pad_w, y * ratio + pad_h)``. ``out`` (an ``[imgsz, imgsz, 3]`` uint8 array, e.g.
    a slot of the cache's memory map) is written in place when given.
    """
    h, w = img.shape[:2]
    ratio = imgsz / max(h, w)
    nw, nh = resized_shape(w, h, ratio)
    if (nw, nh) != (w, h):
        # INTER_AREA avoids aliasing when shrinking; linear is the usual choice when enlarging.
        interp = cv2.INTER_AREA if ratio < 1 else cv2.INTER_LINEAR
        img = cv2.resize(img, (nw, nh), interpolation=interp)
    pad_w, pad_h = (imgsz - nw) // 2, (imgsz - nh) // 2
    if out is None:
        out = np.empty((imgsz, imgsz, 3), np.uint8)
    # Fill only the borders: the centre is overwritten by the image anyway.
    out[:pad_h] = PAD_VALUE
    out[pad_h + nh:] = PAD_VALUE
    out[pad_h:pad_h + nh, :pad_w] = PAD_VALUE
    out[pad_h:pad_h + nh, pad_w + nw:] = PAD_VALUE
    out[pad_h:pad_h + nh, pad_w:pad_w + nw] = img
    return out, ratio, (pad_w, pad_h)


def resized_shape(w: int, h: int, ratio: float) -> tuple[int, int]:
    """``(new_w, new_h)`` of an image of ``w x h`` scaled by ``ratio`` (at least 1 pixel each)."""
    return max(1, round(w * ratio)), max(1, round(h * ratio))


def yolo_to_xyxy(labels: np.ndarray, w: float, h: float, ratio: float, pad: tuple[float, float]) -> np.ndarray:
    """Normalised ``cx, cy, w, h`` of an original ``w x h`` image -> pixel xyxy after a letterbox."""
    cx, cy, bw, bh = (labels[:, i] for i in range(4))
    x1 = (cx - bw / 2) * w * ratio + pad[0]
    y1 = (cy - bh / 2) * h * ratio + pad[1]
    x2 = (cx + bw / 2) * w * ratio + pad[0]
    y2 = (cy + bh / 2) * h * ratio + pad[1]
    return np.stack([x1, y1, x2, y2], axis=1).astype(np.float32)


def xyxy_to_yolo(boxes: np.ndarray, w: int, h: int) -> np.ndarray:
    """Pixel xyxy -> normalised ``cx, cy, w, h`` of a ``w x h`` image."""
    out = np.empty_like(boxes, dtype=np.float32)
    out[:, 0] = (boxes[:, 0] + boxes[:, 2]) / 2 / w
    out[:, 1] = (boxes[:, 1] + boxes[:, 3]) / 2 / h
    out[:, 2] = (boxes[:, 2] - boxes[:, 0]) / w
    out[:, 3] = (boxes[:, 3] - boxes[:, 1]) / h
    return out


def clip_boxes(boxes: np.ndarray, w: float, h: float) -> np.ndarray:
    """Boxes clipped to the image ``[0, w] x [0, h]`` (a new array)."""
    out = boxes.copy()
    out[:, [0, 2]] = out[:, [0, 2]].clip(0, w)
    out[:, [1, 3]] = out[:, [1, 3]].clip(0, h)
    return out


def box_candidates(
    before: np.ndarray, after: np.ndarray, wh_thr: float = 2.0, ar_thr: float = 100.0, area_thr: float = 0.1
) -> np.ndarray:
    """Which boxes survive a transform: wider and taller than ``wh_thr`` pixels, aspect ratio below
    ``ar_thr``, and keeping more than ``area_thr`` of their area (``before`` is the transformed box
    before clipping, ``after`` the clipped one)."""
    w1, h1 = before[:, 2] - before[:, 0], before[:, 3] - before[:, 1]
    w2, h2 = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    eps = 1e-16
    aspect = np.maximum(w2 / (h2 + eps), h2 / (w2 + eps))
    return (w2 > wh_thr) & (h2 > wh_thr) & (w2 * h2 / (w1 * h1 + eps) > area_thr) & (aspect < ar_thr)


def random_affine(
    img: np.ndarray,
    boxes: np.ndarray,
    cls: np.ndarray,
    out_size: int,
    scale: float,
    translate: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random scale about the image centre and random translation, output ``out_size`` square.

    The centre of ``img`` goes to ``(0.5 +- translate) * out_size`` and the image is scaled by
    ``1 +- scale`` (as the reference, without rotation or shear, so boxes stay exact). A mosaic
    canvas of ``2 * imgsz`` with ``out_size = imgsz`` is thereby cropped around its centre.
    """
    h, w = img.shape[:2]
    s = rng.uniform(1 - scale, 1 + scale)
    tx = rng.uniform(0.5 - translate, 0.5 + translate) * out_size
    ty = rng.uniform(0.5 - translate, 0.5 + translate) * out_size
    # x' = s * (x - w/2) + tx
    matrix = np.array([[s, 0, tx - s * w / 2], [0, s, ty - s * h / 2]], np.float64)
    if (h, w) == (out_size, out_size) and np.allclose(matrix, [[1, 0, 0], [0, 1, 0]]):
        out = img.copy()
    else:
        out = cv2.warpAffine(
            img, matrix, dsize=(out_size, out_size), flags=cv2.INTER_LINEAR,
            borderMode=cv2.BORDER_CONSTANT, borderValue=(PAD_VALUE, PAD_VALUE, PAD_VALUE),
        )
    if len(boxes) == 0:
        return out, boxes, cls
    moved = boxes * s
    moved[:, [0, 2]] += matrix[0, 2]
    moved[:, [1, 3]] += matrix[1, 2]
    clipped = clip_boxes(moved, out_size, out_size)
    keep = box_candidates(moved, clipped)
    return out, clipped[keep].astype(np.float32), cls[keep]


def mosaic4(
    tiles: list[tuple[np.ndarray, np.ndarray, np.ndarray]], imgsz: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Four ``(image, boxes, cls)`` tiles (long side ``imgsz``, not padded) on a ``2*imgsz`` canvas.

    The tiles meet at a random centre in ``[imgsz/2, 3*imgsz/2]``: tile 0 ends there at its
    bottom-right corner, tile 1 at its bottom-left, tile 2 at its top-right, tile 3 starts there.
    Parts beyond the canvas are cut and the boxes clipped to it; the caller then applies
    :func:`random_affine` with ``out_size=imgsz`` to crop a training image out of it.
    """
    size = 2 * imgsz
    xc = int(rng.uniform(imgsz / 2, 3 * imgsz / 2))
    yc = int(rng.uniform(imgsz / 2, 3 * imgsz / 2))
    canvas = np.full((size, size, 3), PAD_VALUE, np.uint8)
    all_boxes, all_cls = [], []
    for k, (img, boxes, cls) in enumerate(tiles):
        h, w = img.shape[:2]
        # Canvas region (a) of the tile, then the matching region (b) of the source image.
        x1a = xc if k in (1, 3) else max(xc - w, 0)
        x2a = min(xc + w, size) if k in (1, 3) else xc
        y1a = yc if k in (2, 3) else max(yc - h, 0)
        y2a = min(yc + h, size) if k in (2, 3) else yc
        x1b = 0 if k in (1, 3) else w - (x2a - x1a)
        y1b = 0 if k in (2, 3) else h - (y2a - y1a)
        canvas[y1a:y2a, x1a:x2a] = img[y1b:y1b + (y2a - y1a), x1b:x1b + (x2a - x1a)]
        if len(boxes):
            shifted = boxes.copy()
            shifted[:, [0, 2]] += x1a - x1b
            shifted[:, [1, 3]] += y1a - y1b
            all_boxes.append(shifted)
            all_cls.append(cls)
    if not all_boxes:
        return canvas, np.zeros((0, 4), np.float32), np.zeros((0,), np.float32)
    boxes = clip_boxes(np.concatenate(all_boxes), size, size)
    cls = np.concatenate(all_cls)
    # Boxes of a tile that lies mostly outside the canvas are now slivers: drop empty ones.
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return canvas, boxes[keep].astype(np.float32), cls[keep]


def mixup(
    a: tuple[np.ndarray, np.ndarray, np.ndarray],
    b: tuple[np.ndarray, np.ndarray, np.ndarray],
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blend two same-size images with a Beta(32, 32) weight and keep the boxes of both."""
    r = rng.beta(32.0, 32.0)
    img = (a[0].astype(np.float32) * r + b[0].astype(np.float32) * (1 - r)).astype(np.uint8)
    return img, np.concatenate([a[1], b[1]]), np.concatenate([a[2], b[2]])


def hsv_jitter(img: np.ndarray, hgain: float, sgain: float, vgain: float, rng: np.random.Generator) -> np.ndarray:
    """Random hue shift and saturation and value gains, through one 256-entry lookup table (fast).

    As the reference trainer does it since Ultralytics 8.3.79: the hue is shifted by up to
    ``hgain`` of the hue circle (a gain would barely move red hues near 0), saturation and value
    are multiplied by ``1 +- sgain`` and ``1 +- vgain``, and grey pixels (saturation 0) stay grey.
    """
    if not (hgain or sgain or vgain):
        return img
    r = rng.uniform(-1, 1, 3) * np.array([hgain, sgain, vgain])
    x = np.arange(256, dtype=np.float64)
    lut_h = ((x + r[0] * 180) % 180).astype(np.uint8)  # OpenCV's 8-bit hue runs 0..179
    lut_s = np.clip(x * (r[1] + 1), 0, 255).astype(np.uint8)
    lut_v = np.clip(x * (r[2] + 1), 0, 255).astype(np.uint8)
    lut_s[0] = 0
    lut = np.stack((lut_h, lut_s, lut_v), -1).reshape(1, 256, 3)
    return cv2.cvtColor(cv2.LUT(cv2.cvtColor(img, cv2.COLOR_RGB2HSV), lut), cv2.COLOR_HSV2RGB)


def fliplr(img: np.ndarray, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mirror left-right; boxes follow."""
    w = img.shape[1]
    flipped = boxes.copy()
    flipped[:, 0] = w - boxes[:, 2]
    flipped[:, 2] = w - boxes[:, 0]
    return cv2.flip(img, 1), flipped  # OpenCV's SIMD flip: several times faster than a numpy copy


def to_chw(img: np.ndarray) -> np.ndarray:
    """``[H, W, 3]`` -> contiguous ``[3, H, W]`` (OpenCV's planar split: much faster than a strided copy)."""
    return np.stack(cv2.split(img))
