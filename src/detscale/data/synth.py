"""The built-in synthetic shapes dataset, so that nothing has to be downloaded.

Every image is a textured background (colour gradient, low-frequency blotches, random lines,
pixel noise) with a few flat-coloured shapes on it. Shapes are drawn one after the other, so
later shapes occlude earlier ones; a placement that would leave an earlier shape less than
:data:`MIN_VISIBLE` visible is rejected and tried elsewhere, so every labelled object is clearly
visible and every drawn object is labelled. Labels are the tight box of the *visible* pixels.

Output is a function of the seed alone: each image has its own generator seeded with
``(seed, split, index)``, so the files are byte-identical whatever the number of worker
processes (OpenCV's JPEG encoder is deterministic for identical input).

Layout (Ultralytics / YOLOv9)::

    DIR/images/{train,val}/000000.jpg
    DIR/labels/{train,val}/000000.txt     # class cx cy w h, normalised
    DIR/data.yaml                          # written last: its presence means the data is complete
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import cv2
import numpy as np

from detscale.data.formats import write_data_yaml
from detscale.errors import UserError

log = logging.getLogger(__name__)

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "ring", "star")
SPLIT_IDS = {"train": 0, "val": 1}
# An earlier object must stay at least this visible when a later one is drawn over it.
MIN_VISIBLE = 0.4
# Smallest object side in pixels: below this a ring or a star is no longer recognisable.
MIN_SIDE_PX = 6
# Placement attempts per object before it is given up.
PLACEMENT_TRIES = 40
# Minimum distance (Euclidean, 0..255 per channel) between an object's colour and what it covers.
MIN_CONTRAST = 70.0
_OUR_FILE = re.compile(r"^\d{6}\.(jpg|txt)$")


class SynthError(UserError):
    """Bad arguments for the synthetic generator or an output folder it must not overwrite."""


@dataclass(frozen=True)
class SynthParams:
    """What one image looks like; the same for every image of a dataset."""

    imgsz: int = 640
    objects: tuple[int, int] = (1, 10)
    object_size: tuple[float, float] = (0.02, 0.6)

    def check(self) -> None:
        """Raise :class:`SynthError` for impossible values."""
        lo, hi = self.objects
        slo, shi = self.object_size
        if self.imgsz < 32:
            raise SynthError(f"--imgsz must be at least 32 pixels, got {self.imgsz}")
        if not 0 <= lo <= hi:
            raise SynthError(f"--objects must be two integers 0 <= MIN <= MAX, got {lo} {hi}")
        if not 0 < slo <= shi <= 1:
            raise SynthError(f"--object-size must be two fractions 0 < MIN <= MAX <= 1, got {slo} {shi}")


@dataclass(frozen=True)
class SynthObject:
    """One labelled object: class id, its colour (BGR) and the tight box of its visible pixels."""

    cls: int
    colour: tuple[int, int, int]
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels, x1/y1 exclusive
    visible: float  # visible fraction of the drawn shape


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------

_SHIFT = 4  # sub-pixel bits for cv2 polygon vertices
_SCALE = 1 << _SHIFT


def _polygon(side: int, radii: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Mask ``side x side`` of the polygon with vertices at ``radii`` and ``angles`` around the centre."""
    c = (side - 1) / 2.0
    pts = np.stack([c + radii * np.cos(angles), c + radii * np.sin(angles)], axis=1)
    mask = np.zeros((side, side), np.uint8)
    cv2.fillPoly(mask, [np.round(pts * _SCALE).astype(np.int32)], 1, lineType=cv2.LINE_8, shift=_SHIFT)
    return mask


def _disc(side: int, radius: float) -> np.ndarray:
    c = (side - 1) / 2.0
    yy, xx = np.mgrid[0:side, 0:side]
    return (((xx - c) ** 2 + (yy - c) ** 2) <= radius**2).astype(np.uint8)


def shape_mask(name: str, side: int, rng: np.random.Generator) -> np.ndarray:
    """A binary uint8 mask ``[side, side]`` of one shape, randomly rotated, touching the frame."""
    r = side / 2.0
    theta = rng.uniform(0, 2 * math.pi)
    if name == "circle":
        return _disc(side, r)
    if name == "ring":
        mask = _disc(side, r)
        mask[_disc(side, r * rng.uniform(0.45, 0.65)) > 0] = 0
        return mask
    if name == "square":
        return _polygon(side, np.full(4, r), theta + np.arange(4) * math.pi / 2)
    if name == "triangle":
        return _polygon(side, np.full(3, r), theta + np.arange(3) * 2 * math.pi / 3)
    if name == "star":
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.42)
        return _polygon(side, radii, theta + np.arange(10) * math.pi / 5)
    if name == "cross":
        # A plus sign: 12 vertices, arms of half-width a, reaching r from the centre.
        a = r * 0.3
        ex = math.sqrt(max(r * r - a * a, 0.0))
        local = np.array([(a, ex), (a, a), (ex, a), (ex, -a), (a, -a), (a, -ex),
                          (-a, -ex), (-a, -a), (-ex, -a), (-ex, a), (-a, a), (-a, ex)])
        radii = np.hypot(local[:, 0], local[:, 1])
        return _polygon(side, radii, theta + np.arctan2(local[:, 1], local[:, 0]))
    raise ValueError(f"unknown shape {name!r}")


def background(imgsz: int, rng: np.random.Generator) -> np.ndarray:
    """A textured BGR uint8 background: gradient + low-frequency blotches + lines + noise."""
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    angle = rng.uniform(0, 2 * math.pi)
    # Gradient and blotches are built on a coarse grid and upsampled once: cubic interpolation
    # keeps a linear gradient linear, and one full-size pass is much cheaper than several.
    grid = int(rng.integers(3, 9))
    ramp = np.linspace(0.0, 1.0, grid, dtype=np.float32)
    t = np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None]
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    coarse = rng.normal(0.0, rng.uniform(5, 30), (grid, grid, 3)).astype(np.float32)
    coarse += (c0 + t[..., None] * (c1 - c0)).astype(np.float32)
    img = cv2.resize(coarse, (imgsz, imgsz), interpolation=cv2.INTER_CUBIC)
    img = np.clip(img, 0, 255, out=img).astype(np.uint8)
    for _ in range(int(rng.integers(0, 9))):
        p0 = tuple(int(v) for v in rng.integers(0, imgsz, 2))
        p1 = tuple(int(v) for v in rng.integers(0, imgsz, 2))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        cv2.line(img, p0, p1, colour, int(rng.integers(1, 4)), lineType=cv2.LINE_8)
    return add_noise(img, int(rng.integers(3, 13)), rng)


def add_noise(img: np.ndarray, amplitude: int, rng: np.random.Generator) -> np.ndarray:
    """``img`` plus uniform integer pixel noise in [-amplitude, amplitude] (fast: no float pass)."""
    noise = rng.integers(-amplitude, amplitude + 1, img.shape, dtype=np.int16)
    return np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def _pick_colour(rng: np.random.Generator, covered: np.ndarray) -> np.ndarray:
    """A random colour that stands out from the mean of the pixels it will cover."""
    mean = covered.reshape(-1, 3).mean(axis=0)
    candidates = rng.integers(0, 256, (10, 3)).astype(np.float32)
    distance = np.linalg.norm(candidates - mean, axis=1)
    good = np.flatnonzero(distance >= MIN_CONTRAST)
    return candidates[good[0] if good.size else int(distance.argmax())]


@dataclass
class _Placed:
    """An object drawn so far; ``visible`` (pixels) shrinks as later objects cover it."""

    cls: int
    colour: np.ndarray
    x0: int
    y0: int
    side: int
    area: int
    visible: int


def render(params: SynthParams, rng: np.random.Generator) -> tuple[np.ndarray, list[SynthObject]]:
    """One image (BGR uint8 ``[imgsz, imgsz, 3]``) and its labelled objects."""
    size = params.imgsz
    img = background(size, rng)
    owner = np.full((size, size), -1, np.int16)  # which object each pixel shows; -1 = background
    n_target = int(rng.integers(params.objects[0], params.objects[1] + 1))
    log_lo, log_hi = math.log(params.object_size[0]), math.log(params.object_size[1])
    placed: list[_Placed] = []
    for _ in range(n_target):
        shape = int(rng.integers(0, len(SHAPES)))
        for attempt in range(PLACEMENT_TRIES):
            # Log-uniform sizes (many small objects, as in real data); when a place is hard to
            # find, later attempts draw from a range narrowed towards the smallest size.
            hi = log_hi - (log_hi - log_lo) * attempt / PLACEMENT_TRIES
            frac = math.exp(rng.uniform(log_lo, hi))
            side = int(min(size, max(MIN_SIDE_PX, round(frac * size))))
            x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, 2))
            mask = shape_mask(SHAPES[shape], side, rng).astype(bool)
            region = owner[y0:y0 + side, x0:x0 + side]
            hidden = np.bincount(region[mask][region[mask] >= 0], minlength=len(placed))
            if all(p.visible - hidden[j] >= MIN_VISIBLE * p.area for j, p in enumerate(placed)):
                break
        else:
            log.debug("object %d could not be placed without hiding another; skipped", len(placed))
            continue
        for j, p in enumerate(placed):
            p.visible -= int(hidden[j])
        k = len(placed)
        roi = img[y0:y0 + side, x0:x0 + side]
        colour = _pick_colour(rng, roi[mask])
        # A gentle shading ramp across the object, so it is not perfectly flat.
        shade = np.linspace(-1.0, 1.0, side, dtype=np.float32) * rng.uniform(0, 15)
        ramp = shade[None, :] if rng.random() < 0.5 else shade[:, None]
        painted = np.clip(colour[None, None, :] + ramp[..., None], 0, 255).astype(np.uint8)
        roi[mask] = np.broadcast_to(painted, roi.shape)[mask]
        region[mask] = k
        area = int(mask.sum())
        placed.append(_Placed(shape, colour, x0, y0, side, area, area))
    img = add_noise(img, int(rng.integers(1, 6)), rng)
    objects = []
    for k, p in enumerate(placed):
        ys, xs = np.nonzero(owner[p.y0:p.y0 + p.side, p.x0:p.x0 + p.side] == k)
        box = (p.x0 + int(xs.min()), p.y0 + int(ys.min()), p.x0 + int(xs.max()) + 1, p.y0 + int(ys.max()) + 1)
        b, g, r = (int(v) for v in p.colour)
        objects.append(SynthObject(p.cls, (b, g, r), box, p.visible / p.area))
    return img, objects


def label_lines(objects: list[SynthObject], imgsz: int) -> str:
    """YOLO label text: one ``class cx cy w h`` line per object, normalised to [0, 1]."""
    lines = []
    for o in objects:
        x0, y0, x1, y1 = o.box
        cx, cy, w, h = (x0 + x1) / 2 / imgsz, (y0 + y1) / 2 / imgsz, (x1 - x0) / imgsz, (y1 - y0) / imgsz
        lines.append(f"{o.cls} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}\n")
    return "".join(lines)


def image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of one image: a function of (seed, split, index) only."""
    return np.random.default_rng([seed, SPLIT_IDS[split], index])


# ---------------------------------------------------------------------------------------------
# Writing a dataset
# ---------------------------------------------------------------------------------------------


def _write_one(task: tuple[str, int, str, int, SynthParams]) -> list[int]:
    """Render and write image ``index`` of ``split``; returns the number of objects per class."""
    out, seed, split, index, params = task
    rng = image_rng(seed, split, index)
    img, objects = render(params, rng)
    quality = int(rng.integers(75, 96))
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"OpenCV could not encode image {split}/{index}")
    name = f"{index:06d}"
    Path(out, "images", split, name + ".jpg").write_bytes(buf.tobytes())
    Path(out, "labels", split, name + ".txt").write_text(label_lines(objects, params.imgsz))
    counts = [0] * len(SHAPES)
    for o in objects:
        counts[o.cls] += 1
    return counts


def _init_worker() -> None:
    cv2.setNumThreads(1)  # one process per core already; OpenCV threads would oversubscribe


def _prepare(out: Path) -> None:
    """Remove a previous generation's files; refuse to touch anything we did not write."""
    (out / "data.yaml").unlink(missing_ok=True)  # the data is incomplete until it is rewritten
    for top in ("images", "labels"):
        for split in SPLIT_IDS:
            folder = out / top / split
            if not folder.exists():
                continue
            foreign = [p.name for p in folder.iterdir() if not _OUR_FILE.match(p.name)]
            if foreign:
                raise SynthError(
                    f"{folder} holds files `detscale synth` did not write ({', '.join(sorted(foreign)[:3])}); "
                    "choose an empty or new --out folder"
                )
            shutil.rmtree(folder)


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def generate(
    out: str | Path,
    seed: int = 0,
    train: int = 400,
    val: int = 100,
    params: SynthParams | None = None,
    workers: int = 0,
    progress: Callable[[int], object] | None = None,
) -> dict:
    """Write the synthetic dataset to ``out`` and return a summary dict.

    ``workers`` processes render the images (0: every core); ``progress(n)`` is called as images
    are finished. ``data.yaml`` is written last, atomically.
    """
    params = params or SynthParams()
    params.check()
    if train < 1 or val < 1:
        raise SynthError(f"--train and --val must be at least 1, got {train} and {val}")
    out = Path(out).resolve()
    _prepare(out)
    for top in ("images", "labels"):
        for split in SPLIT_IDS:
            (out / top / split).mkdir(parents=True, exist_ok=True)
    tasks = [(str(out), seed, s, i, params) for s, n in (("train", train), ("val", val)) for i in range(n)]
    workers = min(workers or default_workers(), len(tasks))
    start = time.perf_counter()
    per_class = np.zeros(len(SHAPES), np.int64)
    if workers <= 1:
        _init_worker()
        results = map(_write_one, tasks)
        for counts in results:
            per_class += counts
            if progress:
                progress(1)
    else:
        with get_context("spawn").Pool(workers, initializer=_init_worker) as pool:
            for counts in pool.imap_unordered(_write_one, tasks, chunksize=max(1, len(tasks) // (workers * 8))):
                per_class += counts
                if progress:
                    progress(1)
    tmp = out / ".data.yaml.tmp"
    write_data_yaml(tmp, SHAPES, "images/train", "images/val", ".")
    os.replace(tmp, out / "data.yaml")
    return {
        "out": str(out),
        "train": train,
        "val": val,
        "objects": int(per_class.sum()),
        "per_class": dict(zip(SHAPES, per_class.tolist(), strict=True)),
        "seconds": time.perf_counter() - start,
        "workers": workers,
    }
