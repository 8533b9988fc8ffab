"""The synthetic dataset: byte-identical from its seed, and labels that match the pixels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

from detscale.data import formats
from detscale.data.synth import MIN_VISIBLE, SHAPES, SynthError, SynthParams, generate, image_rng, render

PARAMS = SynthParams(imgsz=96, objects=(2, 6), object_size=(0.06, 0.5))


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "a"
    generate(out, seed=3, train=8, val=4, params=PARAMS, workers=2)
    return out


def test_same_seed_gives_byte_identical_files_whatever_the_workers(dataset, tmp_path):
    generate(tmp_path / "b", seed=3, train=8, val=4, params=PARAMS, workers=1)
    a, b = tree_bytes(dataset), tree_bytes(tmp_path / "b")
    assert len(a) == 2 * 12 + 1 and a == b
    generate(tmp_path / "c", seed=4, train=8, val=4, params=PARAMS, workers=1)
    c = tree_bytes(tmp_path / "c")
    assert all(a[k] != c[k] for k in a if k.endswith(".jpg"))


def test_layout_and_data_yaml_are_read_by_the_common_reader(dataset):
    spec = formats.load_spec(dataset / "data.yaml")
    assert spec.names == SHAPES and len(SHAPES) >= 5
    assert [p.name for p in spec.splits["train"]] == [f"{i:06d}.jpg" for i in range(8)]
    assert len(spec.splits["val"]) == 4
    for image in spec.splits["train"] + spec.splits["val"]:
        img = cv2.imread(str(image))
        assert img.shape == (96, 96, 3)
        assert formats.label_path_for(image).is_file()


def test_labels_are_in_range(dataset):
    seen = set()
    for label in sorted((dataset / "labels").rglob("*.txt")):
        arr = formats.read_labels(label)
        assert PARAMS.objects[0] <= len(arr) <= PARAMS.objects[1], label
        cls, cx, cy, w, h = arr.T
        assert np.all(cls == np.round(cls)) and np.all((cls >= 0) & (cls < len(SHAPES)))
        assert np.all((w > 0) & (h > 0))
        assert np.all(cx - w / 2 >= -1e-6) and np.all(cx + w / 2 <= 1 + 1e-6)
        assert np.all(cy - h / 2 >= -1e-6) and np.all(cy + h / 2 <= 1 + 1e-6)
        # The tight box of a visible part is never larger than the drawn object's frame.
        assert np.all(np.maximum(w, h) <= PARAMS.object_size[1] + 1.5 / PARAMS.imgsz)
        seen.update(cls.astype(int).tolist())
    assert len(seen) >= 4  # several classes occur even in 12 images


def test_every_box_is_tight_around_pixels_of_its_object_colour():
    params = SynthParams(imgsz=128, objects=(3, 8), object_size=(0.05, 0.5))
    n_objects = 0
    for index in range(10):
        img, objects = render(params, image_rng(0, "train", index))
        assert params.objects[0] <= len(objects) <= params.objects[1]
        for o in objects:
            x0, y0, x1, y1 = o.box
            crop = img[y0:y1, x0:x1].astype(np.float32)
            near = np.linalg.norm(crop - np.array(o.colour, np.float32), axis=2) < 45
            # Pixels of the object's colour fill a good part of the box and touch all four edges.
            assert near.mean() > 0.1, (index, o)
            assert near[0].any() and near[-1].any() and near[:, 0].any() and near[:, -1].any(), (index, o)
            assert o.visible >= MIN_VISIBLE
            n_objects += 1
    assert n_objects >= 30


def test_labels_match_the_rendered_objects(dataset):
    img, objects = render(PARAMS, image_rng(3, "val", 2))
    arr = formats.read_labels(dataset / "labels" / "val" / "000002.txt")
    assert arr[:, 0].astype(int).tolist() == [o.cls for o in objects]
    decoded = cv2.imread(str(dataset / "images" / "val" / "000002.jpg")).astype(np.float32)
    assert np.abs(decoded - img).mean() < 8  # the JPEG is that image


def test_occlusion_happens():
    params = SynthParams(imgsz=128, objects=(6, 10), object_size=(0.2, 0.6))
    visible = [o.visible for i in range(10) for o in render(params, image_rng(1, "train", i))[1]]
    assert min(visible) < 0.9 and min(visible) >= MIN_VISIBLE


def test_rerun_replaces_the_previous_generation(tmp_path):
    generate(tmp_path, seed=0, train=5, val=2, params=PARAMS, workers=1)
    generate(tmp_path, seed=0, train=3, val=2, params=PARAMS, workers=1)
    assert len(formats.load_spec(tmp_path / "data.yaml").splits["train"]) == 3


def test_refuses_to_overwrite_foreign_files_and_bad_arguments(tmp_path):
    (tmp_path / "images" / "train").mkdir(parents=True)
    (tmp_path / "images" / "train" / "holiday.jpg").write_bytes(b"mine")
    with pytest.raises(SynthError, match="did not write"):
        generate(tmp_path, train=2, val=1, params=PARAMS)
    assert (tmp_path / "images" / "train" / "holiday.jpg").read_bytes() == b"mine"
    with pytest.raises(SynthError, match="--object-size"):
        generate(tmp_path / "x", params=SynthParams(imgsz=64, object_size=(0.5, 0.2)))


def test_cli(tmp_path):
    cmd = [sys.executable, "-m", "detscale", "synth", "--out", str(tmp_path / "d"), "--imgsz", "64",
           "--train", "3", "--val", "2", "--objects", "1", "3", "--object-size", "0.1", "0.4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "3 train + 2 val images" in done.stdout
    assert (tmp_path / "d" / "data.yaml").is_file()
    bad = subprocess.run(cmd[:-2] + ["0.7", "0.4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--object-size" in bad.stderr
