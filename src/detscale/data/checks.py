"""What is checked of one image and its label file (in the validator's worker processes): every
kind of finding (:data:`KINDS`), the image file (readable, complete, decodable, and how it decodes)
and every label line (a box, or a polygon read as its box). :mod:`detscale.data.validate` runs
these over a dataset and writes the reports."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from detscale.data import formats
from detscale.data.decode import LARGE_PIXELS

# A box edge may pass the image border by this much without a note (rounding in label tools).
TOLERANCE = 1e-3
# How far cx, cy, w and h may lie outside [0, 1]: the reference trainer's bounds (Ultralytics 8.4
# verify_image_label). A box within them whose edges pass the border is clipped to the image, as
# that trainer's augmentation does; refusing it would train on fewer images than the reference.
VALUE_BOUNDS = (-0.01, 1.01)

# kind -> (severity, what it means). The order is the order of reports.
KINDS: dict[str, tuple[str, str]] = {
    "image_missing": ("error", "image listed but not found"),
    "image_unreadable": ("error", "image file cannot be read"),
    "image_empty": ("error", "zero-size image (0 bytes, or 0 width or height)"),
    "image_truncated": ("error", "image data ends before the format's end marker"),
    "image_corrupt": ("error", "image cannot be decoded"),
    "label_unreadable": ("error", "label file cannot be read as text"),
    "label_columns": ("error", "label line that is neither 5 values (class cx cy w h) nor a class and 3 or more "
                               "x y points (a polygon)"),
    "label_not_numeric": ("error", "non-numeric or non-finite value in a label line"),
    "class_not_integer": ("error", "class id that is not an integer"),
    "class_negative": ("error", "negative class id"),
    "class_out_of_range": ("error", "class id >= the number of names in data.yaml"),
    "box_nonpositive": ("error", "box with zero or negative width or height"),
    "coord_out_of_range": ("error", f"cx, cy, w or h outside [{VALUE_BOUNDS[0]:g}, {VALUE_BOUNDS[1]:g}]"),
    "train_val_overlap": ("error", "training image with the same content as a validation image"),
    "duplicate_image": ("warning", "image with the same content as an earlier one of the split"),
    "box_clipped": ("warning", "box reaching beyond the image: training and evaluation use its part inside"),
    "box_outside": ("warning", "box wholly outside the image: left out of training and evaluation"),
    "duplicate_box": ("warning", "the same box twice in one label file: used once"),
    "label_orphan": ("warning", "label file without an image"),
    "polygon": ("info", "polygon label line (a segmentation export): detection uses its bounding box"),
    "image_exif_rotated": ("info", "EXIF orientation: the image is decoded rotated or mirrored, and its labels are "
                                   "read against that image, as OpenCV (and the reference trainer) decode it"),
    "image_cmyk": ("info", "CMYK JPEG: converted to RGB on decode"),
    "image_16bit": ("info", "16 bits per channel: reduced to 8 on decode (the high byte)"),
    "image_alpha": ("info", "alpha channel: dropped on decode (the colour channels as stored)"),
    "image_large": ("info", "very large image: decoded at a reduced size in the cache, never below the training "
                            "size, so its memory stays bounded"),
    "background": ("info", "image without labels (no label file, or an empty one): allowed"),
}
# Kinds that are not errors but still keep an image out of the clean view.
DROPPED_KINDS = frozenset({"duplicate_image"})



@dataclass(frozen=True)
class Finding:
    """One problem (or note) about one file, and line when it is about one line (1-based)."""

    split: str
    file: str
    line: int | None
    kind: str
    message: str

    @property
    def severity(self) -> str:
        return KINDS[self.kind][0]

    def to_dict(self) -> dict:
        return {"split": self.split, "file": self.file, "line": self.line, "kind": self.kind,
                "severity": self.severity, "message": self.message}


@dataclass
class ImageResult:
    """What checking one image and its label file found."""

    split: str
    index: int
    image: str
    digest: str | None = None
    boxes: int = 0
    background: bool = False
    findings: list[Finding] = field(default_factory=list)

    @property
    def dropped(self) -> bool:
        return any(f.severity == "error" or f.kind in DROPPED_KINDS for f in self.findings)


# ---------------------------------------------------------------------------------------------
# Checking one image and its labels (runs in the worker processes)
# ---------------------------------------------------------------------------------------------

_PNG_END = b"IEND\xaeB`\x82"


def _is_truncated(data: bytes) -> bool:
    """JPEG and PNG end with a fixed marker; without it the file was cut short."""
    if data.startswith(b"\xff\xd8"):
        return not data.rstrip(b"\x00").endswith(b"\xff\xd9")  # some writers pad with zeros
    if data.startswith(formats.PNG_MAGIC):
        return not data.endswith(_PNG_END)
    return False


def check_image_file(path: Path, split: str) -> tuple[str | None, list[Finding]]:
    """Content digest (None when unreadable) and the findings about the image file itself."""
    import cv2

    name = str(path)
    if not path.is_file():
        return None, [Finding(split, name, None, "image_missing", "listed in the split but not found on disk")]
    try:
        data = path.read_bytes()
    except OSError as exc:
        return None, [Finding(split, name, None, "image_unreadable", f"cannot be read: {exc.strerror or exc}")]
    if not data:
        return None, [Finding(split, name, None, "image_empty", "the file is empty (0 bytes)")]
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    size = formats.header_size(data)
    if size is not None and 0 in size:
        return digest, [Finding(split, name, None, "image_empty", f"the header says {size[0]}x{size[1]} pixels")]
    if _is_truncated(data):
        return digest, [Finding(split, name, None, "image_truncated",
                                f"the data ends early ({len(data)} bytes, no end-of-image marker)")]
    large = size is not None and size[0] * size[1] > LARGE_PIXELS
    # a very large JPEG is checked at 1/8 of its size: decodable all the same, in bounded memory
    flag = cv2.IMREAD_REDUCED_COLOR_8 if large and data.startswith(b"\xff\xd8") else cv2.IMREAD_UNCHANGED
    img = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    if img is None:
        return digest, [Finding(split, name, None, "image_corrupt",
                                "OpenCV cannot decode it (damaged data or not an image)")]
    if img.size == 0:
        return digest, [Finding(split, name, None, "image_empty", f"decodes to shape {img.shape}")]
    return digest, _image_notes(data, img, size, large, split, name)


def _image_notes(data: bytes, img: np.ndarray, size: tuple[int, int] | None, large: bool, split: str,
                 name: str) -> list[Finding]:
    """Info findings about how a decodable image is read: orientation, colour model, depth, alpha, size."""
    import io

    from PIL import Image, UnidentifiedImageError

    notes = []
    try:
        with Image.open(io.BytesIO(data)) as im:
            mode, orientation = im.mode, im.getexif().get(formats.EXIF_ORIENTATION_TAG, 1)
    except (UnidentifiedImageError, OSError):
        mode, orientation = "", 1
    if orientation not in (1, None):
        notes.append(Finding(split, name, None, "image_exif_rotated", f"EXIF orientation {orientation}"))
    if mode == "CMYK":
        notes.append(Finding(split, name, None, "image_cmyk", "CMYK colour model"))
    if img.dtype == np.uint16:
        notes.append(Finding(split, name, None, "image_16bit", f"{img.dtype} pixels"))
    if img.ndim == 3 and img.shape[2] in (2, 4):
        notes.append(Finding(split, name, None, "image_alpha", f"{img.shape[2]} channels, the last one alpha"))
    if large and size is not None:
        notes.append(Finding(split, name, None, "image_large", f"{size[0]}x{size[1]} pixels"))
    return notes


def _check_line(
    values: list[str], nc: int, split: str, name: str, line: int
) -> tuple[list[Finding], tuple | None]:
    """Findings about one label line (a box, or a polygon read as its box), and its numbers when usable."""
    polygon = formats.is_polygon(values)
    if len(values) != 5 and not polygon:
        points = "an odd number of point coordinates" if len(values) > 5 else "too few values"
        return [Finding(split, name, line, "label_columns",
                        f"{len(values)} values ({points}): expected 5 (class cx cy w h) or a class and 3 or more "
                        "x y points (a polygon)")], None
    try:
        nums = [float(v) for v in values]
    except ValueError:
        bad = next(v for v in values if not _is_float(v))
        return [Finding(split, name, line, "label_not_numeric", f"{bad!r} is not a number")], None
    if not all(math.isfinite(v) for v in nums):
        return [Finding(split, name, line, "label_not_numeric", f"non-finite value in {' '.join(values)}")], None
    out = []
    if polygon:
        lo, hi = VALUE_BOUNDS
        points = np.array(nums[1:], np.float32).reshape(-1, 2)
        outside = [f"point {i + 1} ({x:g}, {y:g})" for i, (x, y) in enumerate(points.tolist())
                   if not (lo <= x <= hi and lo <= y <= hi)]
        if outside:
            out.append(Finding(split, name, line, "coord_out_of_range",
                               f"{', '.join(outside[:3])}{' and more' if len(outside) > 3 else ''}: outside "
                               f"[{lo:g}, {hi:g}] (normalised coordinates)"))
            return out, None
        box = formats.polygon_box(points)
        out.append(Finding(split, name, line, "polygon",
                           f"{len(points)} points: box cx {box[0]:.4g} cy {box[1]:.4g} w {box[2]:.4g} h {box[3]:.4g}"))
        nums = [float(np.float32(nums[0])), *(float(v) for v in box)]
        values = [values[0], *(f"{v:g}" for v in nums[1:])]
    cls, cx, cy, w, h = nums
    if cls != int(cls):
        out.append(Finding(split, name, line, "class_not_integer", f"class id {values[0]} is not an integer"))
    elif cls < 0:
        out.append(Finding(split, name, line, "class_negative", f"class id {values[0]} is negative"))
    elif cls >= nc:
        out.append(Finding(split, name, line, "class_out_of_range",
                           f"class id {int(cls)} but data.yaml names {nc} classes (0..{nc - 1})"))
    if w <= 0 or h <= 0:
        what = "the polygon's box" if polygon else "the box"
        out.append(Finding(split, name, line, "box_nonpositive", f"width {values[3]} and height {values[4]} of "
                                                                 f"{what} must both be > 0"))
    else:
        lo, hi = VALUE_BOUNDS
        outside = [f"{label} = {v:g}" for label, v in (("cx", cx), ("cy", cy), ("w", w), ("h", h))
                   if not lo <= v <= hi]
        edges = (("left edge cx-w/2", cx - w / 2, "<"), ("top edge cy-h/2", cy - h / 2, "<"),
                 ("right edge cx+w/2", cx + w / 2, ">"), ("bottom edge cy+h/2", cy + h / 2, ">"))
        if outside:
            out.append(Finding(split, name, line, "coord_out_of_range",
                               f"{', '.join(outside)}: outside [{lo:g}, {hi:g}] (normalised coordinates)"))
        elif cx + w / 2 <= 0 or cx - w / 2 >= 1 or cy + h / 2 <= 0 or cy - h / 2 >= 1:
            out.append(Finding(split, name, line, "box_outside",
                               "the box lies wholly outside the image: left out (the image is kept)"))
        elif beyond := [f"{label} = {v:g}" for label, v, side in edges
                        if (v < -TOLERANCE if side == "<" else v > 1 + TOLERANCE)]:
            out.append(Finding(split, name, line, "box_clipped",
                               f"{', '.join(beyond)}: beyond the image; training and evaluation clip the box to it"))
    usable = not any(f.severity == "error" for f in out)
    return out, (tuple(nums) if usable else None)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_label_file(path: Path, nc: int, split: str) -> tuple[int, str | None, list[Finding]]:
    """(usable boxes, why the image is a background image or None, findings) for one label file."""
    name = str(path)
    if not path.exists():
        return 0, f"no label file ({path.name}): a background image", []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return 0, None, [Finding(split, name, None, "label_unreadable", f"cannot be read as UTF-8 text: {exc}")]
    findings: list[Finding] = []
    seen: dict[tuple, int] = {}
    boxes = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        values = raw.split()
        if not values:
            continue
        line_findings, nums = _check_line(values, nc, split, name, number)
        findings += line_findings
        if nums is None:
            continue
        if nums in seen:
            findings.append(Finding(split, name, number, "duplicate_box", f"the same box as line {seen[nums]}"))
            continue
        seen[nums] = number
        boxes += 1
    if not findings and boxes == 0:
        return 0, f"empty label file ({path.name}): a background image", []
    return boxes, None, findings


def check_one(task: tuple[str, int, str, int]) -> ImageResult:
    """Check image ``task = (split, index, image path, nc)`` and its label file."""
    split, index, image, nc = task
    path = Path(image)
    result = ImageResult(split, index, image)
    result.digest, result.findings = check_image_file(path, split)
    if result.findings and result.findings[0].kind == "image_missing":
        return result  # its label file, if any, belongs to no image: nothing more to say
    boxes, background, label_findings = check_label_file(formats.label_path_for(path), nc, split)
    result.boxes, result.background = boxes, background is not None
    result.findings += label_findings
    if background is not None:
        result.findings.append(Finding(split, image, None, "background", background))
    return result


