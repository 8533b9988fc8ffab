"""Dataset validation: say precisely what is wrong before training, and write the clean view.

Every image is read and fully decoded, every label line parsed, in a pool of worker processes.
Findings have a kind (see :data:`KINDS`), a severity and the file and line they concern. The
outputs, in ``DIR``:

- ``validation.json``: counts per kind and every finding (split, file, line, kind, severity, message);
- ``validation.md``: the same for people;
- ``clean/train.txt``, ``clean/val.txt`` and ``data.yaml``: the *clean view* every later stage
  reads (absolute image paths; with ``quarantine``, defective images left out). ``data.yaml``
  is written last, so its presence means the rest is complete.

Policy ``fail`` raises :class:`ValidationFailed` (after writing the reports) when any finding
has severity ``error``; ``quarantine`` drops the images with an error, the later copies of
duplicate images, and the training copy of an image that is also in ``val``. The user's files
are only ever read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from detscale.data import formats, sources
from detscale.data.cache import LARGE_PIXELS
from detscale.data.formats import DatasetError, DatasetSpec
from detscale.files import write_text

log = logging.getLogger(__name__)

POLICIES = ("fail", "quarantine")
# A box edge may pass the image border by this much without a note (rounding in label tools).
TOLERANCE = 1e-3
# How far cx, cy, w and h may lie outside [0, 1]: the reference trainer's bounds (Ultralytics 8.4
# verify_image_label). A box within them whose edges pass the border is clipped to the image, as
# that trainer's augmentation does; refusing it would train on fewer images than the reference.
VALUE_BOUNDS = (-0.01, 1.01)
# Examples per kind in the error summary and in the report.
EXAMPLES = 3
REPORT_EXAMPLES = 10

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


class ValidationFailed(DatasetError):
    """The dataset has errors and the policy is ``fail``."""


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


@dataclass
class ValidationReport:
    """Everything validation found, and the images kept in each split."""

    data_yaml: str
    root: str
    out: str
    policy: str
    names: tuple[str, ...]
    images: dict[str, list[ImageResult]]
    orphans: list[Finding]
    seconds: float = 0.0
    path_notes: tuple[str, ...] = ()  # split paths found only on a retry (formats.DatasetSpec.path_notes)
    source_format: str = "yolo"  # the format the dataset came in (converted to YOLO when coco or voc)
    conversion_notes: tuple[str, ...] = ()  # what the conversion left out or mapped (sources.Converted.notes)

    def findings(self) -> list[Finding]:
        """Every finding: per image in split order, then the orphan label files."""
        out = [f for split in self.images.values() for r in split for f in r.findings]
        return out + self.orphans

    def counts(self) -> dict[str, int]:
        """Findings per kind (every kind, zeros included)."""
        c = Counter(f.kind for f in self.findings())
        return {kind: c.get(kind, 0) for kind in KINDS}

    def severity_counts(self) -> dict[str, int]:
        c = Counter(f.severity for f in self.findings())
        return {s: c.get(s, 0) for s in ("error", "warning", "info")}

    def kept(self, split: str) -> list[str]:
        """The images of ``split`` in the clean view (all of them unless quarantined)."""
        return [r.image for r in self.images[split] if self.policy == "fail" or not r.dropped]

    def split_stats(self) -> dict[str, dict[str, int]]:
        return {
            split: {
                "images": len(results),
                "kept": len(self.kept(split)),
                "dropped": len(results) - len(self.kept(split)),
                "background": sum(r.background for r in results),
                "boxes": sum(r.boxes for r in results),
            }
            for split, results in self.images.items()
        }

    def to_dict(self) -> dict:
        sev = self.severity_counts()
        return {
            "data_yaml": self.data_yaml,
            "root": self.root,
            "policy": self.policy,
            "passed": sev["error"] == 0,
            "names": list(self.names),
            "path_notes": list(self.path_notes),
            "source_format": self.source_format,
            "conversion_notes": list(self.conversion_notes),
            "tolerance": TOLERANCE,
            "seconds": round(self.seconds, 3),
            "splits": self.split_stats(),
            "severity_counts": sev,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings()],
        }


# ---------------------------------------------------------------------------------------------
# Checking one image and its labels (runs in the worker processes)
# ---------------------------------------------------------------------------------------------

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"IEND\xaeB`\x82"


def _is_truncated(data: bytes) -> bool:
    """JPEG and PNG end with a fixed marker; without it the file was cut short."""
    if data.startswith(b"\xff\xd8"):
        return not data.rstrip(b"\x00").endswith(b"\xff\xd9")  # some writers pad with zeros
    if data.startswith(_PNG_MAGIC):
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
            mode, orientation = im.mode, im.getexif().get(0x0112, 1)
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


def _init_worker() -> None:
    import cv2

    cv2.setNumThreads(1)  # one process per core already


# ---------------------------------------------------------------------------------------------
# Dataset-level checks
# ---------------------------------------------------------------------------------------------


def _mark_duplicates(images: dict[str, list[ImageResult]]) -> None:
    """Duplicate images within a split (later copies) and training images also in val."""
    val_first: dict[str, str] = {}
    for r in images.get("val", []):
        if r.digest is not None:
            val_first.setdefault(r.digest, r.image)
    for split, results in images.items():
        first: dict[str, str] = {}
        for r in results:
            if r.digest is None:
                continue
            if split == "train" and r.digest in val_first:
                same = "the same file" if val_first[r.digest] == r.image else f"{val_first[r.digest]}"
                r.findings.append(Finding(split, r.image, None, "train_val_overlap",
                                          f"also in val ({same}): evaluation would see training data"))
            if r.digest in first:
                r.findings.append(Finding(split, r.image, None, "duplicate_image",
                                          f"same content as {first[r.digest]}"))
            else:
                first[r.digest] = r.image


def _image_for_label(label: Path) -> Path | None:
    """The image a label file belongs to by the images/ -> labels/ convention, if one exists."""
    parts = list(label.parts)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "labels":
            parts[i] = "images"
            break
    else:
        return None
    stem = Path(*parts).with_suffix("")
    for suffix in formats.IMAGE_SUFFIXES:
        for candidate in (stem.with_suffix(suffix), stem.with_suffix(suffix.upper())):
            if candidate.is_file():
                return candidate
    return None


def find_orphans(images: dict[str, list[ImageResult]]) -> list[Finding]:
    """Label files, in the label folders the splits use, with no image beside them."""
    folders: dict[Path, str] = {}
    expected: set[Path] = set()
    for split, results in images.items():
        for r in results:
            label = formats.label_path_for(Path(r.image))
            expected.add(label)
            folders.setdefault(label.parent, split)
    out = []
    for folder, split in sorted(folders.items()):
        if not folder.is_dir():
            continue
        for label in sorted(folder.glob("*.txt")):
            if label not in expected and _image_for_label(label) is None:
                out.append(Finding(split, str(label), None, "label_orphan", "no image with this name in "
                                   f"{Path(*[('images' if p == 'labels' else p) for p in folder.parts])}"))
    return out


# ---------------------------------------------------------------------------------------------
# Running, reporting, writing
# ---------------------------------------------------------------------------------------------


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_dataset(
    spec: DatasetSpec,
    workers: int = 0,
    progress: Callable[[int], object] | None = None,
) -> tuple[dict[str, list[ImageResult]], list[Finding]]:
    """Check every image and label of ``spec``: per-image results by split, and orphan labels."""
    tasks = [(split, i, str(p), spec.nc) for split, paths in spec.splits.items() for i, p in enumerate(paths)]
    workers = max(1, min(workers or default_workers(), len(tasks)))
    results: list[ImageResult] = []
    if workers == 1:
        for r in map(check_one, tasks):
            results.append(r)
            if progress:
                progress(1)
    else:
        chunk = max(1, min(64, len(tasks) // (workers * 8)))
        with get_context("spawn").Pool(workers, initializer=_init_worker) as pool:
            for r in pool.imap(check_one, tasks, chunksize=chunk):
                results.append(r)
                if progress:
                    progress(1)
    images: dict[str, list[ImageResult]] = {split: [] for split in spec.splits}
    for r in results:
        images[r.split].append(r)
    _mark_duplicates(images)
    return images, find_orphans(images)


def _display(path: str, root: str) -> str:
    """A path relative to the dataset root when it is inside it (shorter in reports)."""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def _where(f: Finding, root: str) -> str:
    return _display(f.file, root) + (f":{f.line}" if f.line is not None else "")


def summary_text(report: ValidationReport, kinds: Iterable[str] | None = None, examples: int = EXAMPLES) -> str:
    """Findings grouped by kind with the first examples of each (errors and warnings only by default)."""
    by_kind: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings():
        by_kind[f.kind].append(f)
    wanted = list(kinds) if kinds is not None else [k for k in KINDS if KINDS[k][0] != "info"]
    lines = []
    for kind in wanted:
        found = by_kind.get(kind, [])
        if not found:
            continue
        lines.append(f"  {kind} ({KINDS[kind][0]}, {len(found)}): {KINDS[kind][1]}")
        for f in found[:examples]:
            lines.append(f"      {_where(f, report.root)}: {f.message}")
        if len(found) > examples:
            lines.append(f"      ... and {len(found) - examples} more")
    return "\n".join(lines)


def markdown(report: ValidationReport) -> str:
    """The human report, validation.md."""
    sev = report.severity_counts()
    verdict = "passed" if sev["error"] == 0 else ("FAILED" if report.policy == "fail" else "quarantined")
    out = [
        f"# Dataset validation: {verdict}",
        "",
        f"- dataset: `{report.data_yaml}` (root `{report.root}`)",
        f"- policy: `{report.policy}`; classes: {len(report.names)} ({', '.join(report.names[:20])}"
        f"{', ...' if len(report.names) > 20 else ''})",
        f"- findings: {sev['error']} errors, {sev['warning']} warnings, {sev['info']} notes",
        f"- format: `{report.source_format}`"
        + (" (converted to the YOLO layout in `source/`: images linked, labels written)"
           if report.source_format != "yolo" else ""),
        *(f"- conversion: {note}" for note in report.conversion_notes),
        *(f"- path: {note}" for note in report.path_notes),
        "",
        "| split | images | kept | dropped | background | boxes |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for split, s in report.split_stats().items():
        out.append(f"| {split} | {s['images']} | {s['kept']} | {s['dropped']} | {s['background']} | {s['boxes']} |")
    out += ["", "## Findings by kind", "", "| kind | severity | count | meaning |", "|---|---|---:|---|"]
    for kind, n in report.counts().items():
        out.append(f"| {kind} | {KINDS[kind][0]} | {n} | {KINDS[kind][1]} |")
    by_kind: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings():
        by_kind[f.kind].append(f)
    shown = [k for k in KINDS if by_kind.get(k)]
    if shown:
        out += ["", "## Examples", ""]
    for kind in shown:
        found = by_kind[kind]
        out += [f"### {kind} ({len(found)})", "", "| split | file | line | message |", "|---|---|---:|---|"]
        for f in found[:REPORT_EXAMPLES]:
            msg = f.message.replace("|", "\\|")
            out.append(f"| {f.split} | `{_display(f.file, report.root)}` | {f.line or ''} | {msg} |")
        if len(found) > REPORT_EXAMPLES:
            out.append(f"\n... and {len(found) - REPORT_EXAMPLES} more in validation.json.")
        out.append("")
    return "\n".join(out) + "\n"


def _check_out(out: Path, data_yaml: Path) -> None:
    if (out / "data.yaml").resolve() == data_yaml.resolve():
        raise DatasetError(
            f"--out {out} would overwrite the dataset's own {data_yaml}: validation never modifies the "
            "user's files; choose another output folder"
        )


def validate(
    data_yaml: str | Path,
    out: str | Path,
    policy: str = "fail",
    workers: int = 0,
    progress: Callable[[int], object] | None = None,
    failed_report: str | Path | None = None,
) -> ValidationReport:
    """Validate ``data_yaml`` and write the reports and the clean view to ``out``.

    Raises :class:`ValidationFailed` (after writing validation.json and validation.md, and a
    copy of validation.md to ``failed_report`` when given) when the policy is ``fail`` and an
    error was found, and :class:`DatasetError` when quarantine leaves a split without images.
    """
    if policy not in POLICIES:
        raise DatasetError(f"--on-error must be one of {', '.join(POLICIES)}, got {policy!r}")
    start = time.perf_counter()
    out = Path(out).resolve()
    _check_out(out, Path(data_yaml))
    converted = sources.convert(data_yaml, out / "source")
    for note in converted.notes:
        log.warning("%s", note)
    spec = formats.load_spec(converted.data_yaml)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.yaml").unlink(missing_ok=True)  # never leave a previous clean view over new findings
    images, orphans = check_dataset(spec, workers, progress)
    report = ValidationReport(str(spec.yaml_path), str(spec.root), str(out), policy, spec.names, images, orphans,
                              time.perf_counter() - start, spec.path_notes, converted.format, tuple(converted.notes))
    for note in spec.path_notes:
        log.warning("%s", note)
    write_text(json.dumps(report.to_dict(), indent=1) + "\n", out / "validation.json")
    write_text(markdown(report), out / "validation.md")
    errors = report.severity_counts()["error"]
    if errors and policy == "fail":
        where = out / "validation.md"
        if failed_report is not None:
            # Snakemake deletes a failed job's outputs but keeps its logs: a copy there survives.
            where = Path(failed_report).resolve()
            where.parent.mkdir(parents=True, exist_ok=True)
            write_text(markdown(report), where)
        raise ValidationFailed(
            f"{spec.yaml_path}: {errors} error(s) in the dataset (on_error: fail)\n{summary_text(report)}\n"
            f"Full report: {where}. Fix these files, or set dataset.on_error: quarantine "
            "(--on-error quarantine) to leave the defective images out."
        )
    empty = [split for split in images if not report.kept(split)]
    if empty:
        raise DatasetError(
            f"{spec.yaml_path}: no usable image left in {', '.join(empty)} after validation; "
            f"see {out / 'validation.md'}"
        )
    (out / "clean").mkdir(exist_ok=True)
    for split in images:
        write_text("".join(f"{p}\n" for p in report.kept(split)), out / "clean" / f"{split}.txt")
    tmp = out / ".data.yaml.tmp"
    formats.write_data_yaml(tmp, spec.names, "clean/train.txt", "clean/val.txt", out,
                            extra={"detscale_source": str(spec.source)} if spec.source else None)
    os.replace(tmp, out / "data.yaml")
    report.seconds = time.perf_counter() - start
    return report

