"""The Snakemake workflow: lint, the DAG of the default config, and one real end-to-end run on a tiny config.

Snakemake runs in a temporary working directory (``--directory``) with this checkout's Snakefile,
so nothing is written into the repository; the rules find `detscale` through PATH, which gets
the directory of the running interpreter (the venv's bin) first.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAKEFILE = ROOT / "Snakefile"
DEFAULT_CONFIG = ROOT / "config" / "config.yaml"

TINY = {
    "dataset": {"name": "tiny", "synthetic": {"seed": 0, "imgsz": 64, "train": 16, "val": 8, "objects": [1, 3],
                                              "object_size": [0.2, 0.5]}},
    "grid": {"model": ["gelan-t"], "imgsz": [64], "gpus": [1, 2], "batch": [4], "cache": ["disk"],
             "precision": ["fp32"], "repeats": 1, "epochs": 1, "seed": 0},
    "train": {"warmup_epochs": 0, "close_mosaic": 0, "workers": 0, "timing_warmup_steps": 1, "nominal_batch": 8},
    "eval": {"batch": 8},
}


def snakemake(workdir: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run snakemake on this checkout's Snakefile in ``workdir``; the venv's bin first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cmd = [sys.executable, "-m", "snakemake", "-s", str(SNAKEFILE), "--directory", str(workdir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, int]:
    """The 'Job stats' table of a dry run: rule -> count (empty when there is nothing to do)."""
    jobs: dict[str, int] = {}
    lines = (result.stdout + result.stderr).splitlines()
    if "Job stats:" not in lines:
        return jobs
    for line in lines[lines.index("Job stats:") + 3:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        jobs[parts[0]] = int(parts[1])
    return jobs


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_lint(tmp_path: Path):
    result = snakemake(tmp_path, "--configfile", str(DEFAULT_CONFIG), "--lint", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dry_run_default_config(tmp_path: Path):
    result = snakemake(tmp_path, "--configfile", str(DEFAULT_CONFIG), "-n", "--cores", "2", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    jobs = planned_jobs(result)
    assert jobs["train"] == 2 and jobs["evaluate"] == 2 and jobs["report"] == 1
    assert jobs["validate_dataset"] == 1 and jobs["all"] == 1
    # timed runs hold the timed_run resource so that they never overlap
    assert "timed_run=1" in result.stdout + result.stderr


def test_continue_on_moves_one_run_to_another_gpu_count_explicitly(tmp_path: Path):
    """`continue_on: {RUN: 1}`: that run's job asks for 1 GPU and continues its checkpoint elastically."""
    raw = copy.deepcopy(TINY) | {"continue_on": {"gelan-t_64_g2_b4_disk_fp32_s0_r0": 1}}
    result = snakemake(tmp_path, "--configfile", str(write_config(tmp_path / "c.yaml", raw)), "-n", "-p",
                       "--cores", "2", timeout=120)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-3000:]
    launches = [line for line in text.splitlines() if "detscale launch" in line and "-- train" in line]
    moved = [line for line in launches if "--run gelan-t_64_g2_b4_disk_fp32_s0_r0" in line]
    assert len(launches) == 2 and len(moved) == 1, launches
    assert "launch --gpus 1 " in moved[0] and "--resume --elastic" in moved[0], moved
    assert all("--elastic" not in line for line in launches if line not in moved)


def test_bad_config_is_a_clear_error(tmp_path: Path):
    raw = copy.deepcopy(TINY)
    raw["grid"].update(gpus=[1, 3], batch=[4], scaling="strong")
    config = write_config(tmp_path / "bad.yaml", raw)
    result = snakemake(tmp_path, "--configfile", str(config), "-n", "--cores", "1", timeout=120)
    assert result.returncode != 0
    assert "divide evenly" in result.stdout + result.stderr


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path: Path):
    """Data to report on 16 images with 1 and 2 CPU ranks, then re-runs do only what a change touches."""
    # `machines`: another machine's results folder for `snakemake machines` (filled in below)
    config = write_config(tmp_path / "tiny.yaml", TINY | {"machines": {"results": [str(tmp_path / "other")],
                                                                       "labels": ["here", "there"]}})
    result = snakemake(tmp_path, "--configfile", str(config), "--cores", "2", timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]

    report = tmp_path / "results" / "report"
    for name in ("index.html", "scaling.csv", "scaling.md"):
        assert (report / name).is_file(), name
    for name in ("throughput", "efficiency", "memory", "map", "step_time"):
        assert (report / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (report / "scaling.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["gpus"]) for r in rows) == [1, 2]
    for r in rows:
        assert r["device"] == "cpu"
        assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / int(r["gpus"]), rel=1e-4)
        assert float(r["images_per_s"]) > 0 and 0 <= float(r["map50"]) <= 1
    g1 = next(r for r in rows if r["gpus"] == "1")
    assert float(g1["speedup"]) == pytest.approx(1.0) and float(g1["delta_map50_95_vs_1gpu"]) == 0
    page = (report / "index.html").read_text()
    assert "No GPU was used" in page and "Placement: exclusive" in page
    for run in (r["run"] for r in rows):
        timing = json.loads((tmp_path / "results" / "runs" / run / "timing.json").read_text())
        assert timing["world_size"] == int(run.split("_g")[1].split("_")[0])

    # Snakemake's own report holds the registered plots
    sm_report = tmp_path / "snakemake-report.html"
    made = snakemake(tmp_path, "--configfile", str(config), "--cores", "1", "--report", str(sm_report), timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    assert all(f"{name}.png" in sm_report.read_text() for name in ("throughput", "efficiency", "map"))

    # a second run does nothing
    again = snakemake(tmp_path, "--configfile", str(config), "-n", "--cores", "2", timeout=120)
    assert again.returncode == 0 and planned_jobs(again) == {}, again.stderr[-3000:]

    # `snakemake machines`: these results beside another machine's (here a copy), one report
    import shutil

    shutil.copytree(tmp_path / "results" / "runs", tmp_path / "other" / "runs")
    fleet = snakemake(tmp_path, "--configfile", str(config), "--cores", "1", "machines", timeout=300)
    assert fleet.returncode == 0, fleet.stderr[-3000:]
    assert planned_jobs(fleet) == {"machines": 1}, fleet.stderr[-3000:]  # nothing else re-ran
    md = (tmp_path / "results" / "machines" / "machines.md").read_text()
    assert "| here | `results` |" in md and "| 2 | there | 1 |" in md and "| 2 | here | 1 |" in md

    # evaluation settings re-evaluate every run and redo the report, but train nothing
    raw = copy.deepcopy(TINY)
    raw["eval"]["conf"] = 0.01
    jobs = planned_jobs(snakemake(tmp_path, "--configfile", str(write_config(tmp_path / "c1.yaml", raw)), "-n"))
    assert jobs.get("train", 0) == 0 and jobs["evaluate"] == 2 and jobs["report"] == 1

    # one more GPU count trains only the new run
    raw = copy.deepcopy(TINY)
    raw["grid"]["gpus"] = [1, 2, 4]
    jobs = planned_jobs(snakemake(tmp_path, "--configfile", str(write_config(tmp_path / "c2.yaml", raw)), "-n"))
    assert jobs["train"] == 1 and jobs["run_config"] == 1 and jobs["report"] == 1
    assert "cache_dataset" not in jobs and "validate_dataset" not in jobs

    # a training setting re-trains both runs, not the dataset
    raw = copy.deepcopy(TINY)
    raw["grid"]["epochs"] = 2
    jobs = planned_jobs(snakemake(tmp_path, "--configfile", str(write_config(tmp_path / "c3.yaml", raw)), "-n"))
    assert jobs["train"] == 2 and "cache_dataset" not in jobs and "synth_dataset" not in jobs
