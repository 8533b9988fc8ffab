"""The one YOLO reader: datasets laid out as Ultralytics and YOLOv9 users have them, read unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from detscale.data import formats


def make_dataset(root: Path) -> dict[str, list[Path]]:
    """images/{train,val} + labels/{train,val} + a val.txt list with './images/val/..' entries."""
    files: dict[str, list[Path]] = {"train": [], "val": []}
    for split, stems in (("train", ["a", "b", "c"]), ("val", ["x", "y"])):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for stem in stems:
            image = root / "images" / split / f"{stem}.jpg"
            image.write_bytes(b"\xff\xd8 not decoded by the reader \xff\xd9")
            files[split].append(image)
            if stem != "c":  # c is a background image: no label file
                (root / "labels" / split / f"{stem}.txt").write_text("1 0.5 0.5 0.2 0.4\n0 0.25 0.25 0.1 0.1\n")
    (root / "images" / "train" / "notes.md").write_text("not an image")
    (root / "val.txt").write_text("./images/val/x.jpg\n./images/val/y.jpg\n")
    return files


def write_yaml(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("names", [["person", "car"], {0: "person", 1: "car"}])
def test_ultralytics_layout_with_relative_path_folder_and_list(tmp_path, names):
    files = make_dataset(tmp_path / "datasets" / "mini")
    # Ultralytics keeps dataset yamls apart from the data, with `path` relative to the yaml.
    yml = write_yaml(tmp_path / "cfg" / "mini.yaml",
                     {"path": "../datasets/mini", "train": "images/train", "val": "val.txt", "nc": 2, "names": names})
    spec = formats.load_spec(yml)
    assert spec.names == ("person", "car") and spec.nc == 2
    assert spec.root == (tmp_path / "datasets" / "mini").resolve()
    assert list(spec.splits["train"]) == files["train"]  # folders: every image, sorted, no other files
    assert list(spec.splits["val"]) == files["val"]  # './' entries resolved against the list's folder
    labels = formats.read_labels(formats.label_path_for(spec.splits["val"][0]))
    np.testing.assert_allclose(labels, [[1, 0.5, 0.5, 0.2, 0.4], [0, 0.25, 0.25, 0.1, 0.1]])
    assert labels.dtype == np.float32
    background = formats.read_labels(formats.label_path_for(files["train"][2]))
    assert background.shape == (0, 5)


def test_yaml_inside_the_dataset_without_path(tmp_path):
    files = make_dataset(tmp_path)
    yml = write_yaml(tmp_path / "data.yaml", {"train": ["images/train"], "val": "images/val", "names": ["a", "b"]})
    spec = formats.load_spec(yml)
    assert spec.root == tmp_path.resolve()
    assert list(spec.splits["train"]) == files["train"] and list(spec.splits["val"]) == files["val"]


def test_yolov9_layout_path_relative_to_the_working_directory(tmp_path, monkeypatch):
    # YOLOv9 (as YOLOv5) resolves `path: ../datasets/coco` against the repository it runs from,
    # with the yaml in <repo>/data/.
    files = make_dataset(tmp_path / "datasets" / "mini")
    repo = tmp_path / "yolov9"
    yml = write_yaml(repo / "data" / "mini.yaml",
                     {"path": "../datasets/mini", "train": "images/train", "val": "val.txt",
                      "names": {0: "person", 1: "car"}})
    monkeypatch.chdir(repo)
    spec = formats.load_spec(Path("data/mini.yaml"))
    assert spec.yaml_path == yml.resolve()
    assert list(spec.splits["train"]) == files["train"] and list(spec.splits["val"]) == files["val"]


def test_absolute_entries_and_nested_images_folder(tmp_path):
    files = make_dataset(tmp_path / "d")
    lst = tmp_path / "lists" / "train.txt"
    lst.parent.mkdir()
    lst.write_text("".join(f"{p}\n" for p in files["train"]) + "\n")
    yml = write_yaml(tmp_path / "d.yaml", {"path": str(tmp_path / "d"), "train": str(lst), "val": "images/val",
                                            "names": ["a", "b"]})
    spec = formats.load_spec(yml)
    assert list(spec.splits["train"]) == files["train"]
    # The last `images` component is the one replaced.
    assert formats.label_path_for(Path("/data/images/v1/images/train/a.png")) == Path(
        "/data/images/v1/labels/train/a.txt")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"train": "images/train", "names": ["a"]}, "'val' split is missing"),
        ({"train": "images/train", "val": "images/val", "names": {0: "a", 2: "b"}}, "without gaps"),
        ({"train": "images/train", "val": "images/val", "names": ["a"], "nc": 3}, "'nc' is 3"),
        ({"train": "images/train", "val": "images/val", "names": ["a"], "nc": "two"}, "'nc'"),
        ({"train": "nowhere", "val": "images/val", "names": ["a"]}, "neither a folder"),
        ({"train": "images/train", "val": "images/val"}, "'names'"),
    ],
)
def test_mistakes_are_named(tmp_path, doc, message):
    make_dataset(tmp_path)
    with pytest.raises(formats.DatasetError, match=message):
        formats.load_spec(write_yaml(tmp_path / "data.yaml", doc))


def test_missing_yaml_and_malformed_labels(tmp_path):
    with pytest.raises(formats.DatasetError, match="does not exist"):
        formats.load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.txt"
    bad.write_text("0 0.5 0.5 0.1\n")
    with pytest.raises(formats.DatasetError, match="detscale validate"):
        formats.read_labels(bad)


def test_labels_are_read_as_the_reference_trains_on_them(tmp_path):
    """Repeated lines once, boxes clipped to the image, a box wholly outside left out; boxes inside
    bit for bit as written (a dataset without such boxes trains exactly as before)."""
    label = tmp_path / "a.txt"
    label.write_text("0 0.3 0.3 0.2 0.2\n"      # inside
                     "1 0.95 0.5 0.2 0.4\n"     # right edge at 1.05: clipped to 0.85..1.0
                     "0 0.3 0.3 0.2 0.2\n"      # repeats line 1
                     "2 0.05 0.02 0.2 0.1\n"    # left and top edges beyond: clipped
                     "1 1.005 0.5 0.008 0.1\n"  # wholly outside the image
                     "2 0.123457 0.654321 0.111111 0.222222\n")
    got = formats.read_labels(label)
    assert got.dtype == np.float32 and got.shape == (4, 5)
    raw = np.array([[0, 0.3, 0.3, 0.2, 0.2], [2, 0.123457, 0.654321, 0.111111, 0.222222]], np.float32)
    assert np.array_equal(got[[0, 3]], raw)  # untouched rows: the float32 values written
    np.testing.assert_allclose(got[1], [1, 0.925, 0.5, 0.15, 0.4], atol=1e-6)
    np.testing.assert_allclose(got[2], [2, 0.075, 0.035, 0.15, 0.07], atol=1e-6)
    x1, y1 = got[:, 1] - got[:, 3] / 2, got[:, 2] - got[:, 4] / 2
    assert (x1 >= -1e-7).all() and (y1 >= -1e-7).all() and (got[:, 1] + got[:, 3] / 2 <= 1 + 1e-7).all()


def test_polygon_lines_become_their_bounding_boxes_as_the_reference_computes_them(tmp_path):
    """A segmentation export's line (class and 3 or more points) trains as its box: Ultralytics'
    segments2boxes (x, y min and max) then xyxy -> xywh, in float32; a box line beside it stays a box."""
    label = tmp_path / "a.txt"
    label.write_text("2 0.2 0.2 0.6 0.2 0.4 0.7\n"                    # triangle
                     "0 0.5 0.5 0.2 0.2\n"                            # a box in the same file
                     "1 0.5 0.1 0.9 0.4 0.7 0.9 0.3 0.9 0.1 0.4\n"    # pentagon
                     "1 0.9 0.5 1.01 0.5 1.01 0.7\n")                 # a point just past the edge: clipped
    got = formats.read_labels(label)
    points = np.array([0.2, 0.2, 0.6, 0.2, 0.4, 0.7], np.float32).reshape(-1, 2)
    x1, y1 = points.min(0)
    x2, y2 = points.max(0)
    expected = np.array([2, (x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], np.float32)
    assert got.dtype == np.float32 and got.shape == (4, 5)
    assert np.array_equal(got[0], expected)
    assert np.array_equal(got[1], np.array([0, 0.5, 0.5, 0.2, 0.2], np.float32))
    np.testing.assert_allclose(got[2], [1, 0.5, 0.5, 0.8, 0.8], atol=1e-7)
    assert got[3, 1] + got[3, 3] / 2 <= 1 + 1e-7  # clipped to the image like a box
    odd = tmp_path / "odd.txt"
    odd.write_text("0 0.1 0.1 0.5 0.1 0.3 0.6 0.2\n")  # 3.5 points
    with pytest.raises(formats.DatasetError, match="detscale validate"):
        formats.read_labels(odd)
