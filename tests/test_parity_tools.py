"""The tools that check detscale against the reference trainer beyond the component oracles:
the data families (benchmarks/families.py), the lockstep runs (benchmarks/bench_lockstep.py) and
the data-pipeline distributions (benchmarks/bench_pipeline.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
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


@pytest.fixture(scope="module")
def lockstep():
    return _load("bench_lockstep")


@pytest.fixture(scope="module")
def pipeline():
    return _load("bench_pipeline")


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


# ---- lockstep ---------------------------------------------------------------------------------------


def _row(step: int, batches: list[str], loss: float, grad: float = 1.0) -> dict:
    return {"step": step, "epoch": 0, "batches": batches, "loss_total": loss, "grad_norm": grad,
            "lr": {"weight": 0.001}}


def test_lockstep_pairs_steps_by_the_batches_they_trained(lockstep):
    """A loop that splits one warm-up step in two shifts the step numbers; steps pair by their last batch."""
    w = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    a = {"rows": [_row(1, ["0:0"], 2.0), _row(2, ["0:1", "0:2", "0:3"], 1.0), _row(3, ["0:4"], 0.5)], "snaps": w}
    b = {"rows": [_row(1, ["0:0"], 2.0), _row(2, ["0:1"], 1.5), _row(3, ["0:2", "0:3"], 1.1),
                  _row(4, ["0:4"], 0.5)], "snaps": w + 1.0}
    rows = lockstep.compare(a, b)
    assert [(r["step"], r["step_b"], r["same_batches"]) for r in rows] == [(1, 1, True), (2, 3, False), (3, 4, True)]
    assert rows[1]["loss_rel"] == pytest.approx(0.1)
    moved = np.linalg.norm(w[2] - w[0])
    assert rows[1]["weight_dist"] == pytest.approx(np.linalg.norm(w[2] - (w[3] + 1.0)) / moved)
    assert lockstep.first_departure(rows, 0.05) == 2


@pytest.mark.slow
def test_detscale_and_ultralytics_loops_take_the_same_first_steps_on_the_same_batches(lockstep, families, tmp_path):
    """The mechanism behind "learns like the reference": both trainers' own loops, fed the batches
    detscale's loader recorded, from the same weights: the same batches per step and the same
    learning rates (warm-up, bias learning rate 0, accumulation ramp), and the loss, the gradient
    norm and the weights equal within float32 rounding over the first updates. Later steps part by
    chaos, as two runs of one trainer do (bench_lockstep.py measures that floor)."""
    from types import SimpleNamespace

    bench_parity = _load("bench_parity")
    data = families.generate("shapes", tmp_path / "data", seed=0, train=64, val=4, imgsz=64)  # one step: 64
    init = bench_parity.initial_weights(SimpleNamespace(model="gelan-t-detect"), 5, 0, tmp_path)
    common = ["--data", str(data), "--init", str(init), "--steps", "4", "--epochs", "3", "--imgsz", "64",
              "--batch", "8", "--threads", "1", "--close-mosaic", "1"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "YOLO_OFFLINE": "1"}
    script = str(BENCH / "bench_lockstep.py")
    for trainer, batches, record, workers in (("detscale", "native", tmp_path / "batches", "1"),
                                              ("ultralytics", str(tmp_path / "batches"), "", "0")):
        out = tmp_path / trainer
        out.mkdir()
        cmd = [sys.executable, script, "_run", "--trainer", trainer, "--out", str(out), "--batches", batches,
               "--workers", workers, *common] + (["--record", str(record)] if record else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d, u = (lockstep.read_run(tmp_path / name) for name in ("detscale", "ultralytics"))
    rows = lockstep.compare(d, u)
    assert len(rows) >= 4
    for r in rows[:4]:
        assert r["same_batches"], r
        assert r["lr_a"] == pytest.approx(r["lr_b"], rel=1e-12, abs=1e-15)
    for r in rows[:2]:  # the first update and the state it leaves: equal to float32 rounding
        assert abs(r["loss_rel"]) < 1e-6, r
        assert r["grad_b"] == pytest.approx(r["grad_a"], rel=1e-5)
    assert rows[1]["weight_dist"] < 1e-4  # after the first step with a learning rate (measured 7e-6)
    assert abs(rows[2]["loss_rel"]) < 1e-5  # measured 1.3e-6; from here on rounding grows chaotically
    recorded = json.loads((tmp_path / "batches" / "index.json").read_text())
    assert {b["epoch"] for b in recorded["batches"]} == {0, 1}  # whole epochs: the replay could go on


# ---- data-pipeline distributions -------------------------------------------------------------------


def _samples(rng: np.random.Generator, n: int, shift: float) -> list[dict]:
    """Fake training samples: boxes of one image share a scale draw, as the real augmentation's do."""
    out = []
    for _ in range(n):
        k, s = int(rng.integers(1, 25)), rng.uniform(0.5, 1.5) * (1 + shift)
        out.append({"n": k, "w": (rng.uniform(5, 12, k) * s).tolist(), "h": (rng.uniform(5, 12, k) * s).tolist(),
                    "aspect": rng.uniform(1, 3, k).tolist(), "cx": rng.uniform(0, 1, k).tolist(),
                    "cy": rng.uniform(0, 1, k).tolist(), "clipped": (rng.random(k) < 0.2).tolist(),
                    **{key: float(rng.normal(120, 20)) for key in ("mean", "std", "mean_c0", "mean_c1", "mean_c2")},
                    "pad": float(rng.uniform(0, 0.3))})
    return out


def _stats(rng: np.random.Generator, n: int, shift: float, pipeline) -> dict[str, list]:
    return pipeline.collect(iter(_samples(rng, n, shift)))


def test_pipeline_comparison_flags_a_shift_and_not_a_resample(pipeline):
    rng = np.random.default_rng(0)
    base, same, shifted = (_stats(rng, 800, shift, pipeline) for shift in (0.0, 0.0, 0.15))
    by = {r["statistic"]: r for r in pipeline.compare(base, same)}
    assert min(r["p"] for r in by.values()) > 0.001
    moved = {r["statistic"]: r for r in pipeline.compare(base, shifted)}
    assert moved["box width (px)"]["p"] < 1e-6 and moved["box height (px)"]["p"] < 1e-6
    assert moved["box width (px)"]["rel_diff"] == pytest.approx(-0.15 / 1.15, abs=0.03)
    assert moved["box centre x (fraction)"]["p"] > 0.001


def test_pipeline_tests_count_images_not_boxes(pipeline):
    """Boxes of one image share its scale draw: a 1 % shift over 3,000 images of 15 boxes is about one
    standard error of the images' draws. Pooled as 45,000 independent boxes a KS test would call it
    significant; the per-image test does not, and the table says how many images it rests on."""
    from scipy import stats

    hits = pooled_hits = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        a, b = _stats(rng, 3000, 0.0, pipeline), _stats(rng, 3000, 0.01, pipeline)
        row = next(r for r in pipeline.compare(a, b) if r["statistic"] == "box width (px)")
        assert row["n"] == (3000, 3000)
        hits += row["p"] < 0.01
        pooled_hits += stats.ks_2samp(a["w"], b["w"]).pvalue < 0.01
    assert hits <= 3 < pooled_hits


def test_both_pipelines_sample_boxes_inside_their_images(pipeline, families, tmp_path):
    data = families.generate("shapes", tmp_path / "data", seed=1, train=16, val=1, imgsz=64)
    for fn in (pipeline.detscale_samples, pipeline.ultralytics_samples):
        for mosaic in (True, False):
            got = pipeline.collect(fn(data, 64, range(1), mosaic, 0))
            assert len(got["n"]) == 16
            assert all(0 < w <= 64 for w in got["w"]) and all(0 <= c <= 1 for c in got["cx"] + got["cy"])
            assert min(got["pad"]) >= 0 and max(got["pad"]) < 1
