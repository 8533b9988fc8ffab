"""Dataset validation on a crafted dataset with every kind of defect, under both policies."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from detscale.data import formats
from detscale.data.validate import KINDS, ValidationFailed, validate

NAMES = ["circle", "square", "triangle"]
GOOD = "0 0.5 0.5 0.2 0.2\n2 0.25 0.3 0.1 0.2\n"

# (kind, file name, line) of every error and warning the crafted dataset holds.
EXPECTED = {
    ("image_missing", "missing.jpg", None),
    ("image_corrupt", "corrupt.jpg", None),
    ("image_truncated", "truncated.jpg", None),
    ("image_empty", "zero_bytes.jpg", None),
    ("image_empty", "zero_width.png", None),
    ("label_unreadable", "bad_encoding.txt", None),
    ("label_columns", "columns.txt", 2),
    ("label_not_numeric", "not_numeric.txt", 1),
    ("class_not_integer", "class_float.txt", 1),
    ("class_negative", "class_negative.txt", 2),
    ("class_out_of_range", "class_range.txt", 1),
    ("box_clipped", "coords.txt", 3),
    ("coord_out_of_range", "coords.txt", 4),
    ("box_outside", "coords.txt", 5),
    ("box_clipped", "clipped.txt", 1),
    ("box_nonpositive", "box_zero.txt", 1),
    ("duplicate_box", "dup_box.txt", 3),
    ("duplicate_image", "good_copy.jpg", None),
    ("train_val_overlap", "leak.jpg", None),
    ("label_orphan", "orphan.txt", None),
    ("label_columns", "poly_odd.txt", 1),
    ("label_columns", "poly_odd.txt", 2),
    ("coord_out_of_range", "poly_out.txt", 1),
}
BAD_TRAIN = {"corrupt", "truncated", "zero_bytes", "zero_width", "bad_encoding", "columns", "not_numeric",
             "class_float", "class_negative", "class_range", "coords", "box_zero", "good_copy", "leak", "poly_odd",
             "poly_out"}
KEPT_TRAIN = {"good", "good_png", "background", "empty_label", "dup_box", "edge", "clipped", "polygon"}


def jpeg(seed: int, size: int = 24) -> bytes:
    img = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", img)[1].tobytes()


def png(seed: int) -> bytes:
    img = np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    return cv2.imencode(".png", img)[1].tobytes()


def make_defective(root: Path) -> Path:
    """A small dataset in the Ultralytics layout with one instance of every defect kind."""
    for sub in ("images/train", "images/val", "labels/train", "labels/val"):
        (root / sub).mkdir(parents=True)
    seed = iter(range(100))
    train: dict[str, tuple[bytes, bytes | None]] = {
        "good.jpg": (jpeg(next(seed)), GOOD.encode()),
        "good_copy.jpg": (b"", GOOD.encode()),  # filled below: same bytes as good.jpg
        "good_png.png": (png(next(seed)), GOOD.encode()),
        "background.jpg": (jpeg(next(seed)), None),
        "empty_label.jpg": (jpeg(next(seed)), b"\n  \n"),
        "corrupt.jpg": (b"this is not an image at all", GOOD.encode()),
        "truncated.jpg": (jpeg(next(seed), 64)[:400], GOOD.encode()),
        "zero_bytes.jpg": (b"", GOOD.encode()),
        "zero_width.png": (b"", GOOD.encode()),  # filled below
        "bad_encoding.jpg": (jpeg(next(seed)), b"0 0.5 0.5 \xff\xfe 0.1\n"),
        "columns.jpg": (jpeg(next(seed)), b"0 0.5 0.5 0.2 0.2\n1 0.5 0.5 0.2\n"),
        "not_numeric.jpg": (jpeg(next(seed)), b"0 0.5 abc 0.2 0.2\n"),
        "class_float.jpg": (jpeg(next(seed)), b"1.5 0.5 0.5 0.2 0.2\n"),
        "class_negative.jpg": (jpeg(next(seed)), b"0 0.5 0.5 0.2 0.2\n-1 0.5 0.5 0.2 0.2\n"),
        "class_range.jpg": (jpeg(next(seed)), b"3 0.5 0.5 0.2 0.2\n"),
        # line 2 is within the tolerance; line 3 has its right edge at 1.05 (clipped, as the reference
        # does); line 4 a cy below the reference's bounds (-0.01); line 5 lies wholly right of the image
        # (left out, a warning)
        "coords.jpg": (jpeg(next(seed)), b"0 0.5 0.5 0.2 0.2\n0 0.9004 0.5 0.2 0.2\n0 0.95 0.5 0.2 0.2\n"
                                         b"1 0.5 -0.1 0.1 0.1\n1 1.005 0.5 0.008 0.1\n"),
        "clipped.jpg": (jpeg(next(seed)), b"0 0.98 0.5 0.2 0.2\n"),  # a border object: kept, clipped
        "box_zero.jpg": (jpeg(next(seed)), b"0 0.5 0.5 0 0.2\n"),
        "dup_box.jpg": (jpeg(next(seed)), b"0 0.5 0.5 0.2 0.2\n1 0.3 0.3 0.1 0.1\n0 0.5 0.5 0.2 0.2\n"),
        "edge.jpg": (jpeg(next(seed)), b"0.0 0.1 0.1 0.2 0.2\n2 0.9 0.9 0.2 0.2\n"),  # touches the borders: fine
        # segmentation-export lines: a triangle and a pentagon (their boxes are used) beside a box line
        "polygon.jpg": (jpeg(next(seed)), b"2 0.2 0.2 0.6 0.2 0.4 0.7\n0 0.5 0.5 0.2 0.2\n"
                                          b"1 0.5 0.1 0.9 0.4 0.7 0.9 0.3 0.9 0.1 0.4\n"),
        # 6 values (two points and a half), then 8 (three points and a half): odd coordinate counts
        "poly_odd.jpg": (jpeg(next(seed)), b"0 0.1 0.1 0.5 0.1 0.3\n0 0.1 0.1 0.5 0.1 0.3 0.6 0.2\n"),
        "poly_out.jpg": (jpeg(next(seed)), b"1 0.2 0.2 1.2 0.2 0.5 0.8\n"),  # a point at x = 1.2
        "leak.jpg": (b"", GOOD.encode()),  # filled below: same bytes as val/v1.jpg
    }
    v1 = jpeg(next(seed))
    train["good_copy.jpg"] = (train["good.jpg"][0], GOOD.encode())
    train["leak.jpg"] = (v1, GOOD.encode())
    zero_width = bytearray(png(next(seed)))
    zero_width[16:20] = b"\x00\x00\x00\x00"  # IHDR width
    train["zero_width.png"] = (bytes(zero_width), GOOD.encode())
    for name, (image, label) in train.items():
        (root / "images" / "train" / name).write_bytes(image)
        if label is not None:
            (root / "labels" / "train" / Path(name).with_suffix(".txt")).write_bytes(label)
    (root / "labels" / "train" / "orphan.txt").write_text(GOOD)
    for name, data in (("v1.jpg", v1), ("v2.jpg", jpeg(next(seed)))):
        (root / "images" / "val" / name).write_bytes(data)
        (root / "labels" / "val" / Path(name).with_suffix(".txt")).write_text(GOOD)
    (root / "val.txt").write_text("./images/val/v1.jpg\n./images/val/v2.jpg\n./images/val/missing.jpg\n")
    data_yaml = root / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({"path": ".", "train": "images/train", "val": "val.txt", "names": NAMES}))
    return data_yaml


def make_clean(root: Path) -> Path:
    for split, n in (("train", 4), ("val", 2)):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(n):
            (root / "images" / split / f"{i}.jpg").write_bytes(jpeg(1000 + i + 10 * (split == "val")))
            (root / "labels" / split / f"{i}.txt").write_text(GOOD)
    data_yaml = root / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({"train": "images/train", "val": "images/val", "names": NAMES}))
    return data_yaml


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def defective(tmp_path) -> Path:
    return make_defective(tmp_path / "dataset")


def found(report_json: dict) -> set[tuple[str, str, int | None]]:
    return {(f["kind"], Path(f["file"]).name, f["line"]) for f in report_json["findings"] if f["severity"] != "info"}


def test_every_kind_is_found_with_its_file_and_line(defective, tmp_path):
    before = tree_digest(defective.parent)
    report = validate(defective, tmp_path / "out", policy="quarantine", workers=1)
    doc = json.loads((tmp_path / "out" / "validation.json").read_text())
    assert found(doc) == EXPECTED
    notes = {(f["kind"], Path(f["file"]).name) for f in doc["findings"] if f["severity"] == "info"}
    assert notes == {("background", "background.jpg"), ("background", "empty_label.jpg"), ("polygon", "polygon.txt")}
    assert doc["counts"]["coord_out_of_range"] == 2 and doc["counts"]["background"] == 2
    assert doc["counts"]["polygon"] == 2  # the triangle and the pentagon, one note each, with their boxes
    polygons = sorted(f["message"] for f in doc["findings"] if f["kind"] == "polygon")
    assert polygons == ["3 points: box cx 0.4 cy 0.45 w 0.4 h 0.5", "5 points: box cx 0.5 cy 0.5 w 0.8 h 0.8"]
    assert doc["counts"]["box_clipped"] == 2
    assert set(doc["counts"]) == set(KINDS) and not doc["passed"]
    assert all(set(f) == {"split", "file", "line", "kind", "severity", "message"} for f in doc["findings"])
    leak = next(f for f in doc["findings"] if f["kind"] == "train_val_overlap")
    assert leak["split"] == "train" and "v1.jpg" in leak["message"]
    assert report.split_stats()["train"]["background"] == 2
    assert tree_digest(defective.parent) == before  # the user's files are never modified


def test_quarantine_writes_the_clean_view_without_the_bad_files(defective, tmp_path):
    out = tmp_path / "out"
    validate(defective, out, policy="quarantine", workers=1)
    train = [Path(p) for p in (out / "clean" / "train.txt").read_text().split()]
    val = [Path(p) for p in (out / "clean" / "val.txt").read_text().split()]
    assert {p.stem for p in train} == KEPT_TRAIN and all(p.is_absolute() and p.is_file() for p in train)
    assert [p.name for p in val] == ["v1.jpg", "v2.jpg"]
    spec = formats.load_spec(out / "data.yaml")  # the clean view is a data.yaml like any other
    assert spec.names == tuple(NAMES) and list(spec.splits["train"]) == train
    assert formats.read_labels(formats.label_path_for(spec.splits["train"][0])).shape[1] == 5
    md = (out / "validation.md").read_text()
    assert "quarantined" in md and "class_out_of_range" in md and "class_range.txt" in md


def test_fail_raises_with_a_grouped_summary_after_writing_the_report(defective, tmp_path):
    out = tmp_path / "out"
    (out).mkdir()
    (out / "data.yaml").write_text("stale clean view of an earlier run")
    with pytest.raises(ValidationFailed) as info:
        validate(defective, out, policy="fail", workers=1)
    message = str(info.value)
    for kind, name, line in EXPECTED:  # every kind has a heading and its (at most 3) examples listed
        assert f"  {kind} (" in message
        assert name + (f":{line}: " if line else ": ") in message
    assert "class_out_of_range (error, 1)" in message
    assert "labels/train/class_range.txt:1: class id 3 but data.yaml names 3 classes" in message
    assert "--on-error quarantine" in message
    doc = json.loads((out / "validation.json").read_text())
    assert found(doc) == EXPECTED and doc["policy"] == "fail"
    assert not (out / "data.yaml").exists()  # no clean view over a failed validation


def test_a_clean_dataset_passes_and_keeps_every_image(tmp_path):
    data_yaml = make_clean(tmp_path / "d")
    report = validate(data_yaml, tmp_path / "out", policy="fail", workers=2)
    assert report.severity_counts() == {"error": 0, "warning": 0, "info": 0}
    spec = formats.load_spec(tmp_path / "out" / "data.yaml")
    assert [p.name for p in spec.splits["train"]] == ["0.jpg", "1.jpg", "2.jpg", "3.jpg"]
    assert json.loads((tmp_path / "out" / "validation.json").read_text())["splits"]["train"]["boxes"] == 8


def test_worker_processes_give_the_same_findings(defective, tmp_path):
    one = validate(defective, tmp_path / "a", policy="quarantine", workers=1)
    two = validate(defective, tmp_path / "b", policy="quarantine", workers=2)
    assert [f.to_dict() for f in one.findings()] == [f.to_dict() for f in two.findings()]


def test_refuses_to_write_over_the_datasets_own_yaml(tmp_path):
    data_yaml = make_clean(tmp_path / "d")
    with pytest.raises(formats.DatasetError, match="never modifies"):
        validate(data_yaml, tmp_path / "d", workers=1)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detscale", "validate", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_fail_exits_2_with_a_message_and_no_traceback(defective, tmp_path):
    before = tree_digest(defective.parent)
    done = run_cli(str(defective), "--out", str(tmp_path / "out"), "--workers", "1")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "error(s) in the dataset" in done.stderr and "truncated.jpg" in done.stderr
    assert (tmp_path / "out" / "validation.json").is_file()
    assert tree_digest(defective.parent) == before


def test_cli_quarantine_prints_a_summary(defective, tmp_path):
    done = run_cli(str(defective), "--out", str(tmp_path / "out"), "--on-error", "quarantine", "--workers", "1")
    assert done.returncode == 0, done.stderr
    assert f"kept {len(KEPT_TRAIN)}, dropped {len(BAD_TRAIN)}" in done.stdout
    assert "image_truncated" in done.stdout and "clean view" in done.stdout
    assert len(done.stdout.splitlines()) < 60  # one screen


def snakemake(workdir: Path, dataset: dict, target: str) -> subprocess.CompletedProcess:
    """Run the real workflow's data stages in ``workdir`` with the default config's other sections."""
    repo = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    cfg["dataset"] = dataset
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [str(Path(sys.executable).parent / "snakemake"), "-s", str(repo / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(workdir / "config.yaml"), "--cores", "2", target]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=workdir)


def test_workflow_generates_and_validates_the_synthetic_dataset(tmp_path):
    synthetic = {"seed": 1, "imgsz": 64, "train": 6, "val": 3, "objects": [1, 3], "object_size": [0.1, 0.5]}
    done = snakemake(tmp_path, {"name": "tiny", "synthetic": synthetic, "on_error": "fail"},
                     "results/data/tiny/validation.json")
    assert done.returncode == 0, done.stderr[-3000:]
    spec = formats.load_spec(tmp_path / "results" / "data" / "tiny" / "data.yaml")
    assert len(spec.splits["train"]) == 6 and len(spec.splits["val"]) == 3
    assert (tmp_path / "results" / "benchmarks" / "tiny" / "validate.tsv").is_file()
    again = snakemake(tmp_path, {"name": "tiny", "synthetic": synthetic, "on_error": "fail"},
                      "results/data/tiny/validation.json")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr


def test_workflow_stops_on_a_defective_dataset_with_the_summary_in_the_log(defective, tmp_path):
    before = tree_digest(defective.parent)
    done = snakemake(tmp_path, {"name": "bad", "data_yaml": str(defective), "on_error": "fail"},
                     "results/data/bad/validation.json")
    assert done.returncode != 0
    log = (tmp_path / "results" / "logs" / "bad" / "validate.log").read_text()
    assert "error(s) in the dataset" in log and "class_range.txt:1" in log and "Traceback" not in log
    kept = (tmp_path / "results" / "logs" / "bad" / "validation-failed.md").read_text()
    assert "# Dataset validation: FAILED" in kept and str(tmp_path / "results" / "logs") in log
    assert not (tmp_path / "results" / "data" / "bad" / "data.yaml").exists()
    assert tree_digest(defective.parent) == before


def test_roboflow_export_paths_resolve_and_the_report_says_how(tmp_path):
    """A Roboflow export: data.yaml beside train/ and valid/, with `train: ../train/images`."""
    root = tmp_path / "export"
    for split, n in (("train", 3), ("valid", 2)):
        (root / split / "images").mkdir(parents=True)
        (root / split / "labels").mkdir(parents=True)
        for i in range(n):
            (root / split / "images" / f"{i}.jpg").write_bytes(jpeg(500 + i + 10 * (split == "valid")))
            (root / split / "labels" / f"{i}.txt").write_text(GOOD)
    data_yaml = root / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({"train": "../train/images", "val": "../valid/images", "test": "../test/images",
                                         "nc": 3, "names": NAMES}))
    spec = formats.load_spec(data_yaml)
    assert {k: len(v) for k, v in spec.splits.items()} == {"train": 3, "val": 2}
    assert len(spec.path_notes) == 2 and "'train: ../train/images' does not exist" in spec.path_notes[0]
    report = validate(data_yaml, tmp_path / "out", policy="fail", workers=1)
    assert report.split_stats()["train"]["boxes"] == 6
    assert "leading '../' dropped" in (tmp_path / "out" / "validation.md").read_text()
    assert len(json.loads((tmp_path / "out" / "validation.json").read_text())["path_notes"]) == 2
    # a path that exists neither as written nor without its '../' is still refused, naming it
    data_yaml.write_text(yaml.safe_dump({"train": "../nowhere/images", "val": "../valid/images", "names": NAMES}))
    with pytest.raises(formats.DatasetError, match="nowhere"):
        formats.load_spec(data_yaml)
