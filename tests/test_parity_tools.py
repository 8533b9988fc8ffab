"""The tools that check detscale against the reference trainer beyond the component oracles:
the data families (benchmarks/families.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name in sys.modules:  # bench_lockstep imports bench_parity and families by name: one copy each
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def families():
    return _load("families")


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(f.relative_to(folder).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# ---- data families ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["shapes", "dense", "gray"])
def test_a_family_is_a_function_of_its_seed_and_validates_clean(families, family, tmp_path):
    from detscale.data.formats import load_spec
    from detscale.data.validate import check_dataset

    a = families.generate(family, tmp_path / "a", seed=3, train=6, val=2, imgsz=96)
    b = families.generate(family, tmp_path / "b", seed=3, train=6, val=2, imgsz=96)
    c = families.generate(family, tmp_path / "c", seed=4, train=6, val=2, imgsz=96)
    assert _digest(a.parent) == _digest(b.parent)
    assert _digest(a.parent) != _digest(c.parent)
    spec = load_spec(a)
    assert spec.nc == len(families.FAMILY_SPECS[family].names)
    images, orphans = check_dataset(spec, workers=1)
    findings = [f for split in images.values() for r in split for f in r.findings if f.severity == "error"]
    assert findings == [] and orphans == []
    assert sum(r.boxes for r in images["train"]) > 0


def test_the_families_differ_in_what_makes_detection_hard(families, tmp_path):
    sizes = {}
    for family in ("shapes", "dense", "gray"):
        data = families.generate(family, tmp_path / family, seed=0, train=12, val=1, imgsz=128).parent
        labels = [np.loadtxt(f, ndmin=2) for f in sorted((data / "labels" / "train").glob("*.txt"))]
        images = [cv2.imread(str(f), cv2.IMREAD_UNCHANGED) for f in sorted((data / "images" / "train").glob("*.png"))]
        per_image = [len(x) for x in labels]
        sides = np.concatenate([np.maximum(x[:, 3], x[:, 4]) for x in labels if len(x)])
        sizes[family] = (np.mean(per_image), np.median(sides), images)
    assert sizes["dense"][0] >= 8 > sizes["shapes"][0]  # many objects per image
    assert sizes["dense"][1] < 0.08 < sizes["shapes"][1]  # small ones (2-6 % of the side)
    gray = sizes["gray"][2]
    assert all(img.ndim == 2 for img in gray)  # single-channel files
    assert len({img.shape for img in gray}) > 1 and any(img.shape[0] != img.shape[1] for img in gray)
