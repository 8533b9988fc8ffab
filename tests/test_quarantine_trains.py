"""A dataset with every kind of defect, quarantined by `detscale validate`, trains and evaluates.

The anchors crash deep inside training on such data; ours drops the defective files before
training, and every later stage reads the clean view.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from test_validate import make_defective


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detscale", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_quarantined_dataset_trains_and_evaluates(tmp_path):
    data_yaml = make_defective(tmp_path / "dataset")
    out = tmp_path / "validated"
    proc = run("validate", str(data_yaml), "--out", str(out), "--on-error", "quarantine", "--workers", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    clean = out / "data.yaml"
    kept = (out / "clean" / "train.txt").read_text().split()
    assert kept and not any("corrupt" in k or "class_range" in k for k in kept)
    assert any(k.endswith("polygon.jpg") for k in kept)  # polygon labels train as their boxes

    cfg = {
        "dataset": {"name": "quarantined", "data_yaml": str(data_yaml)},
        "grid": {"model": ["gelan-t"], "imgsz": [64], "gpus": [1], "batch": [2], "cache": ["none"], "epochs": 1},
        "train": {"workers": 0, "cpu_threads_per_rank": 1, "warmup_epochs": 0, "close_mosaic": 0,
                  "timing_warmup_steps": 0, "timeout_s": 120, "nominal_batch": 2},
        "eval": {"batch": 2},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_id = "gelan-t_64_g1_b2_none_fp32_s0_r0"
    run_dir = tmp_path / "run"
    proc = run("train", "--config", str(config), "--run", run_id, "--out", str(run_dir), "--data", str(clean))
    assert proc.returncode == 0, proc.stderr[-3000:]
    timing = json.loads((run_dir / "timing.json").read_text())
    assert timing["world_size"] == 1 and timing["measured_steps"] > 0
    assert 0 < timing["started_at"] < timing["finished_at"]

    proc = run("evaluate", "--weights", str(run_dir / "weights" / "last.pt"), "--config", str(config),
               "--run", run_id, "--out", str(run_dir), "--data", str(clean))
    assert proc.returncode == 0, proc.stderr[-3000:]
    val_images = (out / "clean" / "val.txt").read_text().split()
    assert json.loads((run_dir / "eval.json").read_text())["num_images"] == len(val_images)
