"""The scaling report from hand-made run folders: exact relative numbers, valid PNGs, self-contained HTML."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from detscale import cli
from detscale import config as dsconfig
from detscale.report import tables
from detscale.report.build import build_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_config(tmp_path: Path, gpus: list[int], repeats: int = 1, overlap: bool = False) -> Path:
    raw = {
        "dataset": {"name": "shapes", "synthetic": {"imgsz": 64, "train": 8, "val": 4}},
        "grid": {"model": ["gelan-t"], "imgsz": [64], "gpus": gpus, "batch": [8], "cache": ["disk"],
                 "precision": ["fp32"], "repeats": repeats, "epochs": 3},
        "train": {"timing_warmup_steps": 2},
        "placement": {"allow_overlap": overlap},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def write_run(root: Path, cfg: dsconfig.ExperimentConfig, run_id: str, ips: float, map50_95: float,
              map50: float = 0.7, device: str = "cpu", span: tuple[float, float] | None = None) -> Path:
    """A run folder with the artifact contract's files, as `detscale train` / `evaluate` write them."""
    point = cfg.run(run_id)
    run_dir = root / run_id
    run_dir.mkdir(parents=True)
    n = point.gpus
    timing = {
        "world_size": n, "device": device, "backend": "gloo" if device == "cpu" else "nccl",
        "batch_per_rank": point.batch_per_rank, "global_batch": point.global_batch, "warmup_steps": 2,
        "measured_steps": 10, "images_per_s": ips, "images_per_s_per_rank": [ips / n] * n,
        "data_wait_share": 0.25, "compute_share": 0.75, "epoch_seconds": [9.0, 4.0, 6.0],
        "val_seconds": 0.0, "train_seconds": 19.0, "peak_mem_bytes_per_rank": [1.5e9] + [2.0e9] * (n - 1),
        "mem_kind": "rss" if device == "cpu" else "cuda_allocated",
    }
    if span:
        timing["started_at"], timing["finished_at"] = span
    evaluation = {"map50_95": map50_95, "map50": map50, "map75": 0.5, "map_small": 0.1, "map_medium": 0.4,
                  "map_large": 0.6, "ar100": 0.6, "per_class": {"circle": 0.5}, "num_images": 4,
                  "ground_truth": "gt.json", "predictions": "predictions.json"}
    (run_dir / "timing.json").write_text(json.dumps(timing))
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    (run_dir / "env.json").write_text(json.dumps({"host": "testhost", "torch": "2.x", "cpu": {"cores": 2}}))
    dsconfig.save(cfg, run_dir / "config.yaml", extra={"run": {"id": run_id, "global_batch": point.global_batch}})
    return run_dir


@pytest.fixture
def repeated(tmp_path: Path):
    """gpus [1, 2] x 2 repeats with chosen throughputs and mAPs."""
    config_path = write_config(tmp_path, [1, 2], repeats=2)
    cfg = dsconfig.load(config_path)
    runs = tmp_path / "runs"
    values = {"gelan-t_64_g1_b8_disk_fp32_r0": (100.0, 0.40), "gelan-t_64_g1_b8_disk_fp32_r1": (110.0, 0.42),
              "gelan-t_64_g2_b8_disk_fp32_r0": (189.0, 0.38), "gelan-t_64_g2_b8_disk_fp32_r1": (199.5, 0.44)}
    spans = {k: (1000.0 + 100 * i, 1090.0 + 100 * i) for i, k in enumerate(values)}
    dirs = [write_run(runs, cfg, k, ips, m, span=spans[k]) for k, (ips, m) in values.items()]
    return config_path, dirs


def test_relative_numbers_exact(repeated):
    config_path, dirs = repeated
    cfg = dsconfig.load(config_path)
    rows = {r["run"]: r for r in tables.scaling_rows([tables.load_run(d, cfg) for d in dirs])}
    g2 = rows["gelan-t_64_g2_b8_disk_fp32_r0"]
    # baseline: median of the two 1-GPU runs = 105 img/s and mAP 0.41
    assert g2["speedup"] == pytest.approx(189.0 / 105.0, rel=1e-12)
    assert g2["efficiency"] == pytest.approx(189.0 / 105.0 / 2, rel=1e-12)
    assert g2["delta_map50_95_vs_1gpu"] == pytest.approx(0.38 - 0.41, abs=1e-12)
    assert rows["gelan-t_64_g2_b8_disk_fp32_r1"]["speedup"] == pytest.approx(1.9, rel=1e-12)
    g1 = rows["gelan-t_64_g1_b8_disk_fp32_r0"]
    assert g1["speedup"] == pytest.approx(100 / 105) and g1["efficiency"] == pytest.approx(100 / 105)
    assert g2["images_per_s_per_gpu"] == pytest.approx(94.5)
    assert g2["global_batch"] == 16 and g2["batch_per_gpu"] == 8
    assert g2["peak_mem_gb_per_gpu"] == pytest.approx(2.0)  # the largest rank
    assert g2["epoch_seconds"] == pytest.approx(5.0)  # median of the epochs after the first
    assert g2["step_ms"] == pytest.approx(1000 * 16 / 189.0)
    assert g2["data_wait_ms"] == pytest.approx(0.25 * 1000 * 16 / 189.0)


def test_no_single_gpu_baseline(tmp_path: Path):
    config_path = write_config(tmp_path, [2, 4])
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_r0", 50.0, 0.5),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g4_b8_disk_fp32_r0", 80.0, 0.45)]
    files = build_report(dirs, config_path, tmp_path / "report")
    rows = {r["run"]: r for r in csv.DictReader(files.csv.open())}
    g4 = rows["gelan-t_64_g4_b8_disk_fp32_r0"]
    assert float(g4["speedup"]) == pytest.approx(1.6)
    assert float(g4["efficiency"]) == pytest.approx(0.8)  # relative to 2 GPUs: 1.6 / (4 / 2)
    assert float(g4["baseline_gpus"]) == 2
    assert float(g4["delta_map50_95_vs_1gpu"]) == pytest.approx(-0.05)
    assert "relative to 2 GPUs" in files.markdown.read_text()
    assert "relative to 2 GPUs" in files.html.read_text()


def test_report_files(repeated, tmp_path: Path):
    import matplotlib.image

    config_path, dirs = repeated
    files = build_report(dirs, config_path, tmp_path / "report")

    with files.csv.open() as f:
        reader = csv.DictReader(f)
        assert list(reader.fieldnames)[: len(tables.CONTRACT_COLUMNS)] == list(tables.CONTRACT_COLUMNS)
        rows = list(reader)
    assert len(rows) == 4
    for r in rows:  # the contract's consistency: efficiency = speed-up / GPUs
        assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / int(r["gpus"]), rel=1e-5)
        assert r["device"] == "cpu"

    md = files.markdown.read_text()
    assert "## gelan-t_64_b8_disk_fp32" in md
    assert "mAP@0.5:0.95" in md and "Δ mAP" in md
    # with repeats: median and (min–max); 2-GPU img/s median of 189 and 199.5
    assert "194.2 (189.0–199.5)" in md
    assert "CPU rank" in md and "GPU was used" in md

    assert set(files.plots) == {"throughput", "efficiency", "memory", "map", "step_time"}
    for path in files.plots.values():
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.std() > 0  # something was drawn

    page = files.html.read_text()
    srcs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<link" not in page and "<script" not in page and "@import" not in page
    assert page.count("data:image/png;base64,") == 5
    assert "No GPU was used" in page and "CPU rank" in page
    assert "warm-up steps are excluded" in page
    assert "Memory format: contiguous (NCHW)" in page  # the layout changes throughput: it is said
    assert "not an accuracy cost of the GPUs" in page  # a Δ mAP is read against the spread between seeds
    assert "Placement: exclusive" in page and "confirm that no two runs overlapped" in page
    assert "testhost" in page  # environment
    assert config_path.read_text().splitlines()[0] in page  # the exact config
    assert not list((tmp_path / "report").glob(".*"))  # no temporary files left behind


def test_overlap_recorded(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2], overlap=True)
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_r0", 50.0, 0.5, span=(0.0, 10.0)),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_r0", 90.0, 0.5, span=(5.0, 20.0))]
    page = build_report(dirs, config_path, tmp_path / "report").html.read_text()
    assert "overlapping allowed" in page
    assert "gelan-t_64_g1_b8_disk_fp32_r0 with gelan-t_64_g2_b8_disk_fp32_r0" in page


def test_cuda_runs_are_called_gpus(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_r0", 50.0, 0.5, device="cuda"),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_r0", 90.0, 0.5, device="cuda")]
    page = build_report(dirs, config_path, tmp_path / "report").html.read_text()
    assert "Device: CUDA GPUs" in page and "CPU rank" not in page


def test_point_from_run_config_when_not_in_grid(tmp_path: Path):
    """A run of another grid is still reported: its point comes from its own frozen config.yaml."""
    other = dsconfig.load(write_config(tmp_path, [1, 2]))
    run_dir = write_run(tmp_path / "runs", other, "gelan-t_64_g2_b8_disk_fp32_r0", 90.0, 0.5)
    (tmp_path / "new").mkdir()
    current = dsconfig.load(write_config(tmp_path / "new", [4]))
    run = tables.load_run(run_dir, current)
    assert run.point.gpus == 2 and run.point.run_id == run_dir.name


def test_errors_name_the_file(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    run_dir = write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_r0", 90.0, 0.5)
    timing = json.loads((run_dir / "timing.json").read_text())
    timing["world_size"] = 1
    (run_dir / "timing.json").write_text(json.dumps(timing))
    with pytest.raises(tables.ReportError, match="world_size 1"):
        tables.load_run(run_dir, cfg)
    (run_dir / "eval.json").unlink()
    with pytest.raises(tables.ReportError, match="eval.json does not exist"):
        tables.load_run(run_dir, cfg)
    del timing["images_per_s"]
    (run_dir / "timing.json").write_text(json.dumps(timing))
    with pytest.raises(tables.ReportError, match="images_per_s"):
        tables.load_run(run_dir, cfg)


def test_command_line(repeated, tmp_path: Path, capsys):
    config_path, dirs = repeated
    out = tmp_path / "cli-report"
    code = cli.main(["report", "--runs", *map(str, dirs), "--config", str(config_path), "--out", str(out)])
    assert code == 0
    assert (out / "index.html").is_file() and (out / "scaling.csv").is_file()
    assert "index.html" in capsys.readouterr().out
    assert cli.main(["report", "--runs", str(tmp_path / "missing"), "--config", str(config_path),
                     "--out", str(out)]) == 2


def test_stat_format():
    assert tables.Stat.of([1.0, 3.0, 2.0]).format(".1f") == "2.0 (1.0–3.0)"
    assert tables.Stat.of([0.5]).format(".0%") == "50%"
    assert tables.Stat.of([math.nan]).format(".1f") == "n/a"


def test_environment_difference_is_flagged(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_r0", 50.0, 0.5),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_r0", 90.0, 0.5)]
    page = build_report(dirs, config_path, tmp_path / "report").html.read_text()
    assert "environments differ" not in page
    env = json.loads((dirs[1] / "env.json").read_text())
    env.update(torch="other", world_size=2)
    (dirs[1] / "env.json").write_text(json.dumps(env))
    md = build_report(dirs, config_path, tmp_path / "report").markdown.read_text()
    assert "environments differ in torch (" in md
