"""The one YOLO-format reader every stage uses.

A ``data.yaml`` as Ultralytics and YOLOv9 users have it::

    path: ../datasets/coco      # optional root; relative to the yaml's folder
    train: images/train2017     # a folder of images, a .txt list of image paths, or a list of either
    val: val2017.txt
    names: {0: person, 1: bicycle}   # or a list; `nc` optional and checked when present

Labels are found by the ``images/`` -> ``labels/`` convention (last ``images`` path component
replaced, suffix ``.txt``). Each label line is ``class cx cy w h`` normalised to [0, 1], or a
polygon ``class x1 y1 x2 y2 x3 y3 ...`` (3 or more points, as segmentation exports write them),
which detection uses as its bounding box, as Ultralytics' detection trainer does.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from detscale.errors import UserError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")


class DatasetError(UserError):
    """A dataset that cannot be read as described."""


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed data.yaml: class names and the image files of each split."""

    yaml_path: Path
    root: Path
    names: tuple[str, ...]
    splits: dict[str, tuple[Path, ...]]
    #: how a split path that did not resolve as written was found (Roboflow exports), one line each
    path_notes: tuple[str, ...] = ()
    #: a converted COCO or VOC dataset's source.json (its original annotations), else None
    source: Path | None = None

    @property
    def nc(self) -> int:
        return len(self.names)


def label_path_for(image: Path) -> Path:
    """``.../images/x/a.jpg`` -> ``.../labels/x/a.txt`` (the last ``images`` component)."""
    parts = list(image.parts)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "images":
            parts[i] = "labels"
            return Path(*parts).with_suffix(".txt")
    return image.with_suffix(".txt")


def _parse_names(raw: object, where: Path) -> tuple[str, ...]:
    if isinstance(raw, dict):
        try:
            ids = sorted(int(k) for k in raw)
        except (TypeError, ValueError):
            raise DatasetError(f"{where}: 'names' keys must be class ids 0..nc-1, got {list(raw)[:5]}") from None
        if ids != list(range(len(ids))):
            raise DatasetError(f"{where}: 'names' must number classes 0..{len(ids) - 1} without gaps, got {ids[:10]}")
        return tuple(str(raw[k] if k in raw else raw[str(k)]) for k in ids)
    if isinstance(raw, list) and raw:
        return tuple(str(n) for n in raw)
    raise DatasetError(f"{where}: 'names' must be a non-empty list or a mapping id -> name")


def _images_in(entry: Path, where: Path, key: str) -> list[Path]:
    if entry.is_dir():
        return sorted(p for p in entry.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if entry.suffix == ".txt" and entry.is_file():
        out = []
        for line in entry.read_text().splitlines():
            line = line.strip()
            if line:
                p = Path(line)
                # Ultralytics resolves './images/..' entries against the list file's parent.
                out.append(p if p.is_absolute() else (entry.parent / p))
        return [Path(os.path.normpath(p)) for p in out]
    raise DatasetError(
        f"{where}: '{key}' points to {entry}, which is neither a folder of images nor a .txt list of image paths"
    )


def _resolve_root(raw_path: object, yaml_path: Path) -> Path:
    """The dataset root: ``path`` from the yaml, relative to the yaml's folder.

    YOLOv5 and YOLOv9 resolve a relative ``path`` against the repository they run from instead
    (their ``data/coco.yaml`` says ``path: ../datasets/coco``), so when nothing exists relative
    to the yaml but something does relative to the working directory, that is the root.
    """
    root = Path(str(raw_path)) if raw_path else Path(".")
    if root.is_absolute():
        return root
    by_yaml = (yaml_path.parent / root).resolve()
    if raw_path and not by_yaml.exists() and root.resolve().exists():
        return root.resolve()
    return by_yaml


def read_yaml_mapping(path: Path) -> dict:
    """A dataset yaml's mapping, or a :class:`DatasetError` saying why it is not one."""
    if not path.is_file():
        raise DatasetError(f"dataset file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise DatasetError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{path}: expected a mapping with 'train', 'val' and 'names'")
    return raw


def load_spec(data_yaml: str | Path, splits: Sequence[str] = SPLITS) -> DatasetSpec:
    """Parse ``data_yaml``; every requested split must exist."""
    path = Path(data_yaml)
    raw = read_yaml_mapping(path)
    root = _resolve_root(raw.get("path"), path)
    names = _parse_names(raw.get("names"), path)
    if "nc" in raw and (not isinstance(raw["nc"], int) or raw["nc"] != len(names)):
        raise DatasetError(f"{path}: 'nc' is {raw['nc']!r} but 'names' lists {len(names)} classes; "
                           "make them agree or remove 'nc'")
    found: dict[str, tuple[Path, ...]] = {}
    notes: list[str] = []
    for split in splits:
        if not raw.get(split):
            raise DatasetError(f"{path}: the '{split}' split is missing; add '{split}: <folder or list.txt>'")
        entries = raw[split] if isinstance(raw[split], list) else [raw[split]]
        images: list[Path] = []
        for e in entries:
            entry, note = _split_entry(str(e), root, split)
            if note:
                notes.append(note)
            images += _images_in(entry, path, split)
        found[split] = tuple(images)
    source = raw.get("detscale_source")
    source_path = None if not source else (Path(source) if Path(source).is_absolute() else path.parent / source)
    return DatasetSpec(path.resolve(), root, names, found, tuple(notes), source_path)


def _split_entry(written: str, root: Path, split: str) -> tuple[Path, str | None]:
    """Where a split's entry is: as written (relative to the root), else as Ultralytics retries it.

    Roboflow exports write ``train: ../train/images`` in a data.yaml that sits in the dataset's own
    folder, beside ``train/``; relative to that folder the path does not exist. Ultralytics then
    drops the leading ``../`` (``check_det_dataset``), and so does this, saying so.
    """
    entry = Path(written)
    if entry.is_absolute():
        return entry, None
    as_written = root / entry
    if as_written.exists() or not written.startswith("../"):
        return as_written, None
    retried = root / written[3:]
    if not retried.exists():
        return as_written, None
    return retried, (f"'{split}: {written}' does not exist relative to {root}; used {retried} (the leading '../' "
                     "dropped, as Ultralytics does for Roboflow exports)")


#: A polygon label line has a class and at least this many (x, y) points.
POLYGON_MIN_POINTS = 3


def is_polygon(values: Sequence[str]) -> bool:
    """Whether a label line's fields are a class and 3 or more (x, y) points."""
    return len(values) >= 1 + 2 * POLYGON_MIN_POINTS and len(values) % 2 == 1


def polygon_box(points: np.ndarray) -> np.ndarray:
    """(cx, cy, w, h) of the bounding box of ``[k, 2]`` float32 points, in float32 as Ultralytics'
    ``segments2boxes`` computes it (x, y min and max, then centre and size)."""
    x1, y1 = points.min(0)
    x2, y2 = points.max(0)
    return np.array([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], np.float32)


def _label_row(values: list[str], label_file: Path) -> np.ndarray:
    """One line's (class, cx, cy, w, h): a box as written, a polygon as its bounding box."""
    try:
        nums = np.array(values, dtype=np.float32)
    except ValueError:
        raise DatasetError(f"{label_file}: malformed label lines; run `detscale validate` for details") from None
    if len(nums) == 5:
        return nums
    if is_polygon(values):
        return np.concatenate([nums[:1], polygon_box(nums[1:].reshape(-1, 2))])
    raise DatasetError(f"{label_file}: malformed label lines; run `detscale validate` for details")


def read_labels(label_file: Path) -> np.ndarray:
    """Labels of one image as float32 ``[n, 5]`` (class, cx, cy, w, h) as training and evaluation use
    them; empty when there is no file.

    As the reference trainer takes them: a polygon line (a class and 3 or more points) becomes its
    bounding box, a line that repeats an earlier one is used once, and a box that reaches beyond
    the image (a border object labelled with its whole extent, or rounding) is clipped to it; a
    box wholly outside the image is left out. Boxes inside the image are returned bit for bit as
    written. Each line is read by its own length: Ultralytics converts every line of a file as a
    polygon once one line is, which would read a box line of such a file as a 2-point polygon;
    detscale reads it as the box it is. ``detscale validate`` reports each case. Assumes a
    validated dataset: malformed lines raise :class:`DatasetError` naming the file.
    """
    if not label_file.is_file():
        return np.zeros((0, 5), np.float32)
    rows = [ln.split() for ln in label_file.read_text().splitlines() if ln.strip()]
    if all(len(r) == 5 for r in rows):
        try:
            arr = np.array(rows, dtype=np.float32).reshape(-1, 5)
        except ValueError:
            raise DatasetError(f"{label_file}: malformed label lines; run `detscale validate` for details") from None
    else:
        arr = np.stack([_label_row(r, label_file) for r in rows])
    _, first = np.unique(arr, axis=0, return_index=True)
    if len(first) < len(arr):
        arr = arr[np.sort(first)]
    return clip_to_image(arr)


def clip_to_image(labels: np.ndarray) -> np.ndarray:
    """``[n, 5]`` (class, cx, cy, w, h) labels with every box clipped to the image ``[0, 1]^2``.

    Rows inside the image are kept bit for bit; rows left without area are dropped.
    """
    x1, y1 = labels[:, 1] - labels[:, 3] / 2, labels[:, 2] - labels[:, 4] / 2
    x2, y2 = labels[:, 1] + labels[:, 3] / 2, labels[:, 2] + labels[:, 4] / 2
    beyond = (x1 < 0) | (y1 < 0) | (x2 > 1) | (y2 > 1)
    if not beyond.any():
        return labels
    out = labels.copy()
    cx1, cy1, cx2, cy2 = (np.clip(v[beyond], 0, 1) for v in (x1, y1, x2, y2))
    out[beyond, 1:5] = np.stack([(cx1 + cx2) / 2, (cy1 + cy2) / 2, cx2 - cx1, cy2 - cy1], 1)
    return out[(out[:, 3] > 0) & (out[:, 4] > 0)]


def write_data_yaml(out: Path, names: Iterable[str], train: str | Path, val: str | Path, root: str | Path,
                    extra: dict[str, str] | None = None) -> None:
    """Write a data.yaml in the common layout (names as a mapping id -> name), with ``extra`` keys."""
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"path": str(root), "train": str(train), "val": str(val), "names": dict(enumerate(names)), **(extra or {})}
    out.write_text(yaml.safe_dump(doc, sort_keys=False))


# EXIF orientations that swap width and height (rotations by 90 or 270 degrees).
EXIF_ORIENTATION_TAG = 0x0112
_SWAPPING_ORIENTATIONS = {5, 6, 7, 8}


def image_geometry(path: Path) -> tuple[int, int, int]:
    """``(width, height, EXIF orientation)`` of an image as stored, from the header only (1: none)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            width, height = im.size
            orientation = int(im.getexif().get(EXIF_ORIENTATION_TAG, 1) or 1)
    except (FileNotFoundError, UnidentifiedImageError, OSError) as exc:
        raise DatasetError(
            f"{path}: cannot read the image header ({exc}); run `detscale validate` on the dataset "
            "and use the clean data.yaml it writes"
        ) from None
    return int(width), int(height), orientation


def decoded_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    """``(width, height)`` of a stored image once its EXIF orientation is applied, as OpenCV decodes it."""
    return (height, width) if orientation in _SWAPPING_ORIENTATIONS else (width, height)


def image_size(path: Path) -> tuple[int, int]:
    """``(width, height)`` of an image as ``cv2.imread`` returns it, from the header only.

    Pillow reads the header lazily (no decoding); the EXIF orientation is applied because
    OpenCV applies it on decode, and the boxes are mapped back to that decoded image.
    """
    return decoded_size(*image_geometry(path))


# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic): they carry the size.
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header or a PNG's IHDR; None for other formats."""
    if data.startswith(PNG_MAGIC) and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return w, h
    if data.startswith(b"\xff\xd8"):
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                return None
            marker = data[i + 1]
            if marker == 0xFF:  # fill byte
                i += 1
                continue
            seg_len = struct.unpack(">H", data[i + 2:i + 4])[0]
            if marker in _JPEG_SOF:
                h, w = struct.unpack(">HH", data[i + 5:i + 9])
                return w, h
            i += 2 + seg_len
    return None
