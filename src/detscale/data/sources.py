"""Datasets as users bring them: COCO JSON and Pascal VOC, converted to the YOLO view the validator reads.

A *source yaml* names the format (``format: coco | voc``; without it, a ``train`` entry with
``annotations`` is COCO and a root holding ``Annotations/`` and ``JPEGImages/`` is VOC)::

    format: coco
    path: /data/coco                        # root of the entries below (default: the yaml's folder)
    train: {annotations: annotations/instances_train2017.json, images: train2017}
    val: {annotations: annotations/instances_val2017.json, images: val2017}

    format: voc
    path: /data/VOCdevkit/VOC2012           # Annotations/, JPEGImages/, ImageSets/Main/
    train: train                            # image set names (ImageSets/Main/train.txt)
    val: val
    names: [aeroplane, bicycle, ...]        # optional: default, the object names found, sorted
    difficult: exclude                      # or include

:func:`convert` writes, into one folder, the YOLO layout the rest of detscale reads: ``images/SPLIT/``
(symbolic links to the user's files, which are never modified), ``labels/SPLIT/*.txt``, ``data.yaml``
and ``source.json``. The conversion is the reference's:

- COCO: category ids, sorted, become class ids 0..nc-1 (the map is kept); a box ``[x, y, w, h]``
  in pixels becomes ``cx = (x + w/2) / W`` etc. with ``W, H`` the image's JSON size; ``iscrowd``
  boxes are left out of training (as Ultralytics' converter does) and kept as crowd regions for
  evaluation, where COCO's matching ignores detections on them.
- VOC: Ultralytics' VOC conversion, ``cx = ((xmin + xmax) / 2 - 1) / W``, ``w = (xmax - xmin) / W``
  (1-based pixel indices); ``difficult`` objects are left out of training by default (as
  Ultralytics does) and kept for evaluation as crowd regions, so a detection of one is neither a
  hit nor a false positive, as in VOC's own evaluation; ``difficult: include`` trains on them.
- Each image's size in the annotations is checked against the image itself: annotated on the image
  as it decodes (EXIF orientation applied, as OpenCV and the reference decode it), the boxes are
  used as they are; annotated on the image as stored, with an EXIF orientation that swaps its sides
  (5-8), the boxes follow the rotation (:func:`exif_box`); an orientation that keeps the sides
  (2-4) cannot be told from the size, and its boxes are taken as drawn on the decoded image, as
  Ultralytics' converter takes them (noted); any other size leaves the image out, named in the
  notes.

``source.json`` keeps, per split and image (by its path under ``images/SPLIT``), the original
annotations in pixels with their areas and crowd flags, and the class map, so evaluation scores a
converted dataset against its own annotations (:func:`detscale.metrics.coco.coco_ground_truth`).
"""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detscale.data.formats import (
    SPLITS,
    DatasetError,
    decoded_size,
    image_geometry,
    read_yaml_mapping,
    write_data_yaml,
)

FORMATS = ("yolo", "coco", "voc")
SOURCE_FILE = "source.json"


@dataclass
class Converted:
    """What :func:`convert` did: the converted data.yaml and what it left out or changed, to report."""

    format: str
    data_yaml: Path
    notes: list[str] = field(default_factory=list)


def detect_format(raw: dict[str, Any], yaml_path: Path) -> str:
    """``format`` as the yaml states it, else by its structure (a COCO entry, a VOC root), else yolo."""
    stated = raw.get("format")
    if stated is not None:
        if stated not in FORMATS:
            raise DatasetError(f"{yaml_path}: format {stated!r}; use one of {', '.join(FORMATS)}")
        return str(stated)
    if isinstance(raw.get("train"), dict) and "annotations" in raw["train"]:
        return "coco"
    root, train = _root(raw, yaml_path), raw.get("train")
    voc_root = (root / "Annotations").is_dir() and (root / "JPEGImages").is_dir()
    if voc_root and isinstance(train, str) and (root / "ImageSets" / "Main" / f"{train}.txt").is_file():
        return "voc"
    return "yolo"


def _root(raw: dict[str, Any], yaml_path: Path) -> Path:
    root = Path(str(raw.get("path") or "."))
    return root if root.is_absolute() else (yaml_path.parent / root).resolve()


def read_source(data_yaml: str | Path) -> tuple[str, dict[str, Any]]:
    path = Path(data_yaml)
    raw = read_yaml_mapping(path)
    return detect_format(raw, path), raw


def convert(data_yaml: str | Path, out: str | Path) -> Converted:
    """Convert a COCO or VOC source yaml into the YOLO view in ``out`` (a yolo yaml is returned as is)."""
    path = Path(data_yaml)
    fmt, raw = read_source(path)
    if fmt == "yolo":
        return Converted("yolo", path)
    out = Path(out).resolve()
    if out in path.resolve().parents:
        raise DatasetError(f"{path} lies inside {out}, the folder its conversion is written to; keep the dataset "
                           "outside the results folder")
    if out.exists():
        shutil.rmtree(out)  # ours alone: a fresh conversion every time, never a mix of two
    out.mkdir(parents=True)
    root = _root(raw, path)
    names, splits, notes, extra = (_coco if fmt == "coco" else _voc)(raw, root, path)
    for split, images in splits.items():
        for rel, record in images.items():
            link = out / "images" / split / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(record.pop("file"), link)
            label = (out / "labels" / split / rel).with_suffix(".txt")
            label.parent.mkdir(parents=True, exist_ok=True)
            label.write_text("".join(f"{c} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}\n"
                                     for c, cx, cy, w, h in record.pop("train")))
    (out / SOURCE_FILE).write_text(json.dumps({"format": fmt, "data_yaml": str(path.resolve()), "names": names,
                                               **extra, "splits": splits}, indent=1))
    write_data_yaml(out / "data.yaml", names, "images/train", "images/val", out.resolve(),
                    extra={"detscale_source": SOURCE_FILE})
    return Converted(fmt, out / "data.yaml", notes)


def _entry(raw: dict[str, Any], split: str, yaml_path: Path) -> Any:
    if split not in raw or raw[split] in (None, ""):
        raise DatasetError(f"{yaml_path}: the '{split}' split is missing")
    return raw[split]


def exif_box(bbox: list[float], orientation: int, width: int, height: int) -> list[float]:
    """A box ``[x, y, w, h]`` on the image as stored (``width`` x ``height``) moved onto the image as
    decoded with EXIF ``orientation`` applied (2-8: mirrored, rotated, or both; TIFF/EXIF 2.3)."""
    x, y, w, h = bbox
    right, bottom = width - x - w, height - y - h
    return {
        2: [right, y, w, h],  # mirrored left-right
        3: [right, bottom, w, h],  # rotated 180
        4: [x, bottom, w, h],  # mirrored top-bottom
        5: [y, x, h, w],  # transposed
        6: [bottom, x, h, w],  # rotated 90 clockwise
        7: [bottom, right, h, w],  # transversed
        8: [y, right, h, w],  # rotated 90 counter-clockwise
    }.get(orientation, [x, y, w, h])


def _fit(image: Path, width: int, height: int, notes: list[str], split: str) -> tuple[int, int, int] | None:
    """How an image's annotations fit it: ``(decoded width, decoded height, orientation to apply to the
    boxes)``, or None (left out, with a note) when the annotated size is neither the image as decoded nor
    the image as stored."""
    if not image.is_file():
        notes.append(f"{split}: {image} is listed in the annotations but does not exist: left out")
        return None
    try:
        stored_w, stored_h, orientation = image_geometry(image)  # one header read per image
    except DatasetError as exc:
        notes.append(f"{split}: {image}: {exc}: left out")
        return None
    decoded = decoded_size(stored_w, stored_h, orientation)
    if decoded == (width, height):
        if orientation != 1:  # 2-4 keep the sides: the size cannot tell which image the boxes were drawn on
            notes.append(f"{split}: {image} has EXIF orientation {orientation}, which keeps its sides; its boxes are "
                         "taken as drawn on the image as decoded, as Ultralytics' converter takes them")
        return width, height, 1
    if orientation != 1 and (stored_w, stored_h) == (width, height):
        notes.append(f"{split}: {image} has EXIF orientation {orientation}; its boxes, annotated on the image as "
                     "stored, follow it onto the image as decoded")
        return decoded[0], decoded[1], orientation
    notes.append(f"{split}: {image} is {decoded[0]}x{decoded[1]} as it decodes (EXIF orientation applied), its "
                 f"annotations say {width}x{height}: left out (its boxes would not fit the image)")
    return None


def _coco(raw: dict[str, Any], root: Path, yaml_path: Path
          ) -> tuple[list[str], dict[str, Any], list[str], dict[str, Any]]:
    notes: list[str] = []
    docs = {}
    for split in SPLITS:
        entry = _entry(raw, split, yaml_path)
        if not isinstance(entry, dict) or not {"annotations", "images"} <= entry.keys():
            raise DatasetError(f"{yaml_path}: '{split}' must be a mapping with 'annotations' (the instances JSON) "
                               "and 'images' (its image folder)")
        ann = root / entry["annotations"]
        try:
            docs[split] = (json.loads(ann.read_text()), root / entry["images"])
        except FileNotFoundError:
            raise DatasetError(f"{yaml_path}: '{split}.annotations' {ann} does not exist") from None
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{ann} is not valid JSON: {exc}") from None
    cats = sorted({c["id"]: c["name"] for doc, _ in docs.values() for c in doc.get("categories", [])}.items())
    if not cats:
        raise DatasetError(f"{yaml_path}: the annotations list no categories")
    cls_of = {cid: i for i, (cid, _) in enumerate(cats)}
    splits: dict[str, Any] = {}
    for split, (doc, image_dir) in docs.items():
        by_image: dict[int, list[dict[str, Any]]] = {}
        for a in doc.get("annotations", []):
            by_image.setdefault(a["image_id"], []).append(a)
        images: dict[str, Any] = {}
        crowd = 0
        for im in doc.get("images", []):
            file = image_dir / im["file_name"]
            fit = _fit(file, int(im["width"]), int(im["height"]), notes, split)
            if fit is None:
                continue
            width, height, orientation = fit
            anns, train = [], []
            for a in by_image.get(im["id"], []):
                if a["category_id"] not in cls_of:
                    raise DatasetError(f"{split}: annotation {a.get('id')} of {im['file_name']} has category "
                                       f"{a['category_id']}, which the categories do not list")
                x, y, w, h = exif_box([float(v) for v in a["bbox"]], orientation, int(im["width"]),
                                      int(im["height"]))
                c, is_crowd = cls_of[a["category_id"]], int(a.get("iscrowd", 0))
                anns.append({"class": c, "bbox": [x, y, w, h], "area": float(a.get("area", w * h)),
                             "iscrowd": is_crowd})
                if is_crowd:
                    crowd += 1
                else:
                    train.append((c, (x + w / 2) / width, (y + h / 2) / height, w / width, h / height))
            images[im["file_name"]] = {"file": str(file.resolve()), "image_id": im["id"], "width": width,
                                       "height": height, "annotations": anns, "train": train}
        if crowd:
            notes.append(f"{split}: {crowd} iscrowd box(es) left out of training, kept as crowd regions for "
                         "evaluation")
        splits[split] = images
    if any(cid != i for i, (cid, _) in enumerate(cats)):
        notes.append("COCO category ids " + ", ".join(f"{cid}->{i}" for i, (cid, _) in enumerate(cats[:8]))
                     + (", ..." if len(cats) > 8 else "") + " mapped to contiguous class ids (kept in source.json)")
    return [name for _, name in cats], splits, notes, {"category_ids": [cid for cid, _ in cats]}


def _voc_boxes(xml_path: Path) -> tuple[int, int, list[tuple[str, list[float], int]]]:
    try:
        tree = ET.parse(xml_path)
    except (ET.ParseError, OSError) as exc:
        raise DatasetError(f"{xml_path}: not a readable VOC annotation ({exc})") from None
    size = tree.find("size")
    if size is None:
        raise DatasetError(f"{xml_path}: no <size> element")
    width, height = int(float(size.findtext("width", "0"))), int(float(size.findtext("height", "0")))
    objects = []
    for obj in tree.iter("object"):
        box = obj.find("bndbox")
        if box is None:
            raise DatasetError(f"{xml_path}: an <object> without <bndbox>")
        coords = [float(box.findtext(k, "nan")) for k in ("xmin", "ymin", "xmax", "ymax")]
        objects.append((obj.findtext("name", "").strip(), coords, int(float(obj.findtext("difficult", "0") or 0))))
    return width, height, objects


def _voc(raw: dict[str, Any], root: Path, yaml_path: Path
         ) -> tuple[list[str], dict[str, Any], list[str], dict[str, Any]]:
    notes: list[str] = []
    difficult = raw.get("difficult", "exclude")
    if difficult not in ("exclude", "include"):
        raise DatasetError(f"{yaml_path}: difficult {difficult!r}; use exclude or include")
    ids: dict[str, list[str]] = {}
    for split in SPLITS:
        listing = root / "ImageSets" / "Main" / f"{_entry(raw, split, yaml_path)}.txt"
        if not listing.is_file():
            raise DatasetError(f"{yaml_path}: image set {listing} does not exist")
        ids[split] = [line.split()[0] for line in listing.read_text().splitlines() if line.strip()]
    parsed = {split: {i: _voc_boxes(root / "Annotations" / f"{i}.xml") for i in names} for split, names in ids.items()}
    found = sorted({name for split in parsed.values() for _, _, objs in split.values() for name, _, _ in objs})
    names = [str(n) for n in raw["names"]] if raw.get("names") else found
    cls_of = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(found) - set(cls_of))
    if unknown:
        raise DatasetError(f"{yaml_path}: object names {unknown[:5]} are not in names; add them or remove 'names'")
    splits: dict[str, Any] = {}
    for split, records in parsed.items():
        images: dict[str, Any] = {}
        hard = 0
        for image_id, (width, height, objects) in records.items():
            file = next((p for p in (root / "JPEGImages" / f"{image_id}{s}" for s in (".jpg", ".jpeg", ".png"))
                         if p.is_file()), root / "JPEGImages" / f"{image_id}.jpg")
            fit = _fit(file, width, height, notes, split)
            if fit is None:
                continue
            stored_w, stored_h = width, height
            width, height, orientation = fit
            anns, train = [], []
            for name, (x1, y1, x2, y2), diff in objects:
                c = cls_of[name]
                # Ultralytics' VOC conversion: 1-based pixel indices, centre shifted by one pixel
                cx, cy, w, h = (x1 + x2) / 2 - 1, (y1 + y2) / 2 - 1, x2 - x1, y2 - y1
                if orientation != 1:
                    x, y, w, h = exif_box([cx - w / 2, cy - h / 2, w, h], orientation, stored_w, stored_h)
                    cx, cy = x + w / 2, y + h / 2
                ignored = diff == 1 and difficult == "exclude"
                anns.append({"class": c, "bbox": [cx - w / 2, cy - h / 2, w, h], "area": w * h,
                             "iscrowd": int(ignored)})
                if ignored:
                    hard += 1
                else:
                    train.append((c, cx / width, cy / height, w / width, h / height))
            images[file.name] = {"file": str(file.resolve()), "image_id": image_id, "width": width,
                                 "height": height, "annotations": anns, "train": train}
        if hard:
            notes.append(f"{split}: {hard} difficult object(s) left out of training, kept as ignored regions for "
                         "evaluation (difficult: exclude)")
        splits[split] = images
    return names, splits, notes, {"difficult": difficult}
