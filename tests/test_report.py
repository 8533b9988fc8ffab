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


def write_config(tmp_path: Path, gpus: list[int], repeats: int = 1, overlap: bool = False,
                 seeds: tuple[int, ...] = (0,), val_interval: int = 0) -> Path:
    raw = {
        "dataset": {"name": "shapes", "synthetic": {"imgsz": 64, "train": 8, "val": 4}},
        "grid": {"model": ["gelan-t"], "imgsz": [64], "gpus": gpus, "batch": [8], "cache": ["disk"],
                 "precision": ["fp32"], "repeats": repeats, "epochs": 3, "seeds": list(seeds)},
        "train": {"timing_warmup_steps": 2, "val_interval": val_interval},
        "placement": {"allow_overlap": overlap},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def write_run(root: Path, cfg: dsconfig.ExperimentConfig, run_id: str, ips: float, map50_95: float,
              map50: float = 0.7, device: str = "cpu", span: tuple[float, float] | None = None,
              curve: dict[int, float] | None = None, peak_gflops: float | None = None) -> Path:
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
    if peak_gflops is not None:  # as detscale.engine.mfu.mfu_fields writes it, 0.5 GFLOPs per image
        timing.update(train_gflops_per_image=0.5, peak_gflops_per_rank=[peak_gflops] * n,
                      peak_method="float32 512x512 matmul, best of 9 rounds, 1 thread(s)",
                      mfu=0.5 * ips / (peak_gflops * n))
    evaluation = {"map50_95": map50_95, "map50": map50, "map75": 0.5, "map_small": 0.1, "map_medium": 0.4,
                  "map_large": 0.6, "ar100": 0.6, "per_class": {"circle": 0.5}, "num_images": 4,
                  "ground_truth": "gt.json", "predictions": "predictions.json"}
    (run_dir / "timing.json").write_text(json.dumps(timing))
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    (run_dir / "env.json").write_text(json.dumps({"host": "testhost", "torch": "2.x", "cpu": {"cores": 2}}))
    rows = [{"epoch": e, "epoch_seconds": s} for e, s in enumerate(timing["epoch_seconds"])]
    for epoch, value in (curve or {}).items():  # validation during training: epoch -> mAP@0.5:0.95
        rows[epoch]["map50_95"] = value
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dsconfig.save(cfg, run_dir / "config.yaml", extra={"run": {"id": run_id, "global_batch": point.global_batch}})
    return run_dir


@pytest.fixture
def repeated(tmp_path: Path):
    """gpus [1, 2] x 2 repeats with chosen throughputs and mAPs."""
    config_path = write_config(tmp_path, [1, 2], repeats=2)
    cfg = dsconfig.load(config_path)
    runs = tmp_path / "runs"
    values = {"gelan-t_64_g1_b8_disk_fp32_s0_r0": (100.0, 0.40), "gelan-t_64_g1_b8_disk_fp32_s0_r1": (110.0, 0.42),
              "gelan-t_64_g2_b8_disk_fp32_s0_r0": (189.0, 0.38), "gelan-t_64_g2_b8_disk_fp32_s0_r1": (199.5, 0.45)}
    spans = {k: (1000.0 + 100 * i, 1090.0 + 100 * i) for i, k in enumerate(values)}
    dirs = [write_run(runs, cfg, k, ips, m, span=spans[k]) for k, (ips, m) in values.items()]
    return config_path, dirs


def test_relative_numbers_exact(repeated):
    config_path, dirs = repeated
    cfg = dsconfig.load(config_path)
    rows = {r["run"]: r for r in tables.scaling_rows([tables.load_run(d, cfg) for d in dirs])}
    g2 = rows["gelan-t_64_g2_b8_disk_fp32_s0_r0"]
    # baseline: median of the two 1-GPU runs = 105 img/s and mAP 0.41
    assert g2["speedup"] == pytest.approx(189.0 / 105.0, rel=1e-12)
    assert g2["efficiency"] == pytest.approx(189.0 / 105.0 / 2, rel=1e-12)
    assert g2["delta_map50_95_vs_1gpu"] == pytest.approx(0.38 - 0.41, abs=1e-12)
    assert rows["gelan-t_64_g2_b8_disk_fp32_s0_r1"]["speedup"] == pytest.approx(1.9, rel=1e-12)
    g1 = rows["gelan-t_64_g1_b8_disk_fp32_s0_r0"]
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
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 50.0, 0.5),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g4_b8_disk_fp32_s0_r0", 80.0, 0.45)]
    files = build_report(dirs, config_path, tmp_path / "report")
    rows = {r["run"]: r for r in csv.DictReader(files.csv.open())}
    g4 = rows["gelan-t_64_g4_b8_disk_fp32_s0_r0"]
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

    assert set(files.plots) == {"throughput", "efficiency", "memory", "mfu", "map", "step_time", "accuracy_pairs",
                                "time_to_accuracy", "projection"}
    assert "MFU: not recorded by these runs" in files.html.read_text()
    for path in files.plots.values():
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.std() > 0  # something was drawn

    page = files.html.read_text()
    srcs = re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)""", page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<link" not in page and "<script" not in page and "@import" not in page
    assert page.count("data:image/png;base64,") == 9
    assert "No GPU was used" in page and "CPU rank" in page
    assert "warm-up steps are excluded" in page
    assert "Memory format: contiguous (NCHW)" in page  # the layout changes throughput: it is said
    # one seed: the report refuses to call the Δ mAP an accuracy cost (or the absence of one)
    assert "No statement about an accuracy cost is possible with one seed" in page
    assert "No statement about an accuracy cost is possible with one seed" in md
    assert "differ in the rank count alone" in page
    assert "Placement: exclusive" in page and "confirm that no two runs overlapped" in page
    assert "testhost" in page  # environment
    assert config_path.read_text().splitlines()[0] in page  # the exact config
    assert not list((tmp_path / "report").glob(".*"))  # no temporary files left behind


def test_overlap_recorded(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2], overlap=True)
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", 50.0, 0.5, span=(0.0, 10.0)),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 90.0, 0.5, span=(5.0, 20.0))]
    page = build_report(dirs, config_path, tmp_path / "report").html.read_text()
    assert "overlapping allowed" in page
    assert "gelan-t_64_g1_b8_disk_fp32_s0_r0 with gelan-t_64_g2_b8_disk_fp32_s0_r0" in page


def test_cuda_runs_are_called_gpus(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", 50.0, 0.5, device="cuda"),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 90.0, 0.5, device="cuda")]
    page = build_report(dirs, config_path, tmp_path / "report").html.read_text()
    assert "Device: CUDA GPUs" in page and "CPU rank" not in page


def test_point_from_run_config_when_not_in_grid(tmp_path: Path):
    """A run of another grid is still reported: its point comes from its own frozen config.yaml."""
    other = dsconfig.load(write_config(tmp_path, [1, 2]))
    run_dir = write_run(tmp_path / "runs", other, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 90.0, 0.5)
    (tmp_path / "new").mkdir()
    current = dsconfig.load(write_config(tmp_path / "new", [4]))
    run = tables.load_run(run_dir, current)
    assert run.point.gpus == 2 and run.point.run_id == run_dir.name


def test_errors_name_the_file(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    run_dir = write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 90.0, 0.5)
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
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", 50.0, 0.5),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 90.0, 0.5)]
    page = build_report(dirs, config_path, tmp_path / "report").html.read_text()
    assert "environments differ" not in page
    env = json.loads((dirs[1] / "env.json").read_text())
    env.update(torch="other", world_size=2)
    (dirs[1] / "env.json").write_text(json.dumps(env))
    md = build_report(dirs, config_path, tmp_path / "report").markdown.read_text()
    assert "environments differ in torch (" in md


def _seeded_runs(tmp_path: Path, deltas: list[float], curves: dict[str, dict[int, float]] | None = None,
                 val_interval: int = 0):
    seeds = tuple(range(len(deltas)))
    config_path = write_config(tmp_path, [1, 2], seeds=seeds, val_interval=val_interval)
    cfg = dsconfig.load(config_path)
    dirs = []
    for seed, delta in zip(seeds, deltas, strict=True):
        base = 0.40 + 0.03 * seed  # seed-to-seed spread larger than the effect
        for gpus, value in ((1, base), (2, base + delta)):
            run = f"gelan-t_64_g{gpus}_b8_disk_fp32_s{seed}_r0"
            dirs.append(write_run(tmp_path / "runs", cfg, run, 100.0 * gpus, value, map50=value + 0.2,
                                  curve=(curves or {}).get(run)))
    return config_path, cfg, dirs


def test_seed_pairs_give_mean_delta_and_t_interval(tmp_path: Path):
    from scipy import stats

    from detscale.report import accuracy

    deltas = [-0.01, 0.004, -0.006, 0.002, -0.003, 0.001, -0.004, 0.0]
    config_path, cfg, dirs = _seeded_runs(tmp_path, deltas)
    rows = tables.scaling_rows([tables.load_run(d, cfg) for d in dirs])
    found = {d.metric: d for d in accuracy.paired_deltas(rows)}
    d = found["map50_95"]
    assert d.seeds == tuple(range(8)) and d.gpus == 2 and d.baseline_gpus == 1
    assert d.deltas == pytest.approx(deltas, abs=1e-12)  # read as pairs: the seed spread (0.03) drops out
    assert d.mean == pytest.approx(sum(deltas) / 8)
    low, high = stats.t.interval(0.95, 7, loc=d.mean, scale=stats.sem(deltas))
    assert (d.low, d.high) == pytest.approx((low, high))
    assert d.low < 0 < d.high
    assert d.verdict().startswith("2 GPUs vs 1, mAP@0.5:0.95: no accuracy cost detected: Δ -0.002 (95 % CI")
    assert "8 seeds" in d.verdict()
    assert found["map50"].deltas == pytest.approx(deltas, abs=1e-12)

    files = build_report(dirs, config_path, tmp_path / "report")
    md, page = files.markdown.read_text(), files.html.read_text()
    assert "## Does DDP cost accuracy?" in md and "no accuracy cost detected" in md and "no accuracy cost" in page
    csv_rows = list(csv.DictReader(files.csv.open()))
    assert {r["seed"] for r in csv_rows} == {str(s) for s in range(8)}
    pair = next(r for r in csv_rows if r["run"] == "gelan-t_64_g2_b8_disk_fp32_s3_r0")
    assert float(pair["delta_map50_95_vs_1gpu"]) == pytest.approx(0.002)  # against seed 3's own baseline


def test_equal_results_are_called_the_same_trajectory():
    from detscale.report.accuracy import PairedDelta

    d = PairedDelta("g", 2, 1, "map50", "mAP@0.5", (0,), (0.526,), (0.526,), (0.0,), 0.0, math.nan, math.nan,
                    math.nan)
    assert d.verdict().startswith("2 GPUs vs 1, mAP@0.5: equal to the last digit on its seed (1): the 2-GPU run "
                                  "trained the 1-GPU trajectory")
    assert "No statement" not in d.verdict()


def test_a_consistent_loss_is_called_a_cost(tmp_path: Path):
    from detscale.report import accuracy

    config_path, cfg, dirs = _seeded_runs(tmp_path, [-0.085, -0.074, -0.052])
    rows = tables.scaling_rows([tables.load_run(d, cfg) for d in dirs])
    d = next(x for x in accuracy.paired_deltas(rows) if x.metric == "map50")
    assert d.high < 0
    assert d.verdict() == "2 GPUs vs 1, mAP@0.5: costs 0.070 (95 % CI -0.112..-0.029, 3 seeds, paired t, p = 0.018)."


def test_time_to_accuracy_from_validation_during_training(tmp_path: Path):
    # baseline seed 0 ends at mAP 0.40 -> target 0.36; validations at epochs 0, 1, 2 after 9, 13 and 19 s
    curves = {"gelan-t_64_g1_b8_disk_fp32_s0_r0": {0: 0.10, 1: 0.30, 2: 0.40},
              "gelan-t_64_g2_b8_disk_fp32_s0_r0": {0: 0.20, 1: 0.37, 2: 0.41}}
    config_path, cfg, dirs = _seeded_runs(tmp_path, [0.01], curves, val_interval=1)
    files = build_report(dirs, config_path, tmp_path / "report")
    rows = {r["run"]: r for r in csv.DictReader(files.csv.open())}
    one, two = rows["gelan-t_64_g1_b8_disk_fp32_s0_r0"], rows["gelan-t_64_g2_b8_disk_fp32_s0_r0"]
    assert float(one["tta_target_map50_95"]) == pytest.approx(0.36)
    assert float(one["time_to_target_s"]) == pytest.approx(19.0)  # 9 + 4 + 6: reached at the last validation
    assert float(two["time_to_target_s"]) == pytest.approx(13.0)  # 9 + 4
    assert float(two["time_to_target_speedup"]) == pytest.approx(19.0 / 13.0, rel=1e-5)  # 6 digits in the CSV
    assert float(one["time_to_target_speedup"]) == pytest.approx(1.0)
    assert "time_to_accuracy" in files.plots


def test_report_says_what_validation_dropped_from_training(tmp_path: Path):
    """Quarantined training images are images the runs never saw: a comparison with a trainer that
    takes them is not like for like, so the report names the count, the reasons and the report file."""
    config_path = write_config(tmp_path, [1])
    cfg = dsconfig.load(config_path)
    run = write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", 50.0, 0.5)
    clean = tmp_path / "data" / "shapes"
    clean.mkdir(parents=True)
    (clean / "data.yaml").write_text("path: .\ntrain: clean/train.txt\nval: clean/val.txt\nnames: [a]\n")
    doc = yaml.safe_load((run / "config.yaml").read_text())
    doc["data_yaml"] = str(clean / "data.yaml")
    (run / "config.yaml").write_text(yaml.safe_dump(doc))
    md = build_report([run], config_path, tmp_path / "report").markdown.read_text()
    assert "Data:" not in md  # no validation report beside the data.yaml: nothing to say
    (clean / "validation.json").write_text(json.dumps({
        "policy": "quarantine", "splits": {"train": {"images": 400, "kept": 300, "dropped": 100}},
        "counts": {"train_val_overlap": 100, "box_clipped": 7, "duplicate_box": 2, "coord_out_of_range": 0}}))
    md = build_report([run], config_path, tmp_path / "report").markdown.read_text()
    assert "validation (quarantine) kept 300 of 400 training images" in md
    assert "without the 100 dropped ones (train_val_overlap: 100;" in md and "duplicate_box" not in md
    assert "7 box(es) reaching beyond their image were clipped" in md


def test_mfu_in_the_table_the_methods_and_the_projection_input(tmp_path: Path):
    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", 100.0, 0.4, peak_gflops=200.0),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 180.0, 0.4, peak_gflops=200.0)]
    files = build_report(dirs, config_path, tmp_path / "report")
    rows = {r["run"]: r for r in csv.DictReader(files.csv.open())}
    assert float(rows["gelan-t_64_g1_b8_disk_fp32_s0_r0"]["mfu"]) == pytest.approx(0.25)  # 0.5 x 100 / 200
    assert float(rows["gelan-t_64_g2_b8_disk_fp32_s0_r0"]["mfu"]) == pytest.approx(0.225)  # 0.5 x 180 / 400
    assert float(rows["gelan-t_64_g2_b8_disk_fp32_s0_r0"]["peak_gflops_per_gpu"]) == pytest.approx(200.0)
    md, page = files.markdown.read_text(), files.html.read_text()
    assert "MFU %" in md and "25.0" in md and "22.5" in md
    assert "3 × one training-mode forward" in page and "512x512 matmul" in page and "200 GFLOP/s per GPU" in page
    from detscale.report.projection import Baseline

    one = rows["gelan-t_64_g1_b8_disk_fp32_s0_r0"]
    base = Baseline.from_rows([{"gpus": 1, "backward_ms": 1.0, "batch_per_gpu": 8, "step_ms": 80.0, "device": "cpu",
                                "scaling": "weak", "mfu": float(one["mfu"])}])
    assert base is not None and base.mfu == pytest.approx(0.25)


def test_published_reference_figures_are_listed_and_drawn_on_their_card(tmp_path: Path):
    from detscale.report import reference

    points = reference.load()
    yolov5l = {p.gpus: p for p in points if p.model == "yolov5l"}
    # the Ultralytics docs' table: one COCO epoch (118,287 images) in 20:39 on 1 A100 and 3:09 on 8
    assert yolov5l[1].epoch_seconds == 1239 and yolov5l[8].epoch_seconds == 189
    assert yolov5l[1].images_per_s == pytest.approx(118287 / 1239)
    assert yolov5l[8].speedup == pytest.approx(1239 / 189) and yolov5l[8].efficiency == pytest.approx(1239 / 189 / 8)
    assert all("docs.ultralytics.com" in p.source for p in yolov5l.values())
    assert reference.matching(points, ["NVIDIA A100-SXM4-80GB"]) and not reference.matching(points, ["NVIDIA H100"])

    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, f"gelan-t_64_g{g}_b8_disk_fp32_s0_r0", ips, 0.4, device="cuda")
            for g, ips in ((1, 100.0), (2, 180.0))]
    files = build_report(dirs, config_path, tmp_path / "report")
    md = files.markdown.read_text()
    assert "## Published reference figures" in md and "| 8 | 3:09 | 626 | 6.56 | 82% |" in md
    assert "None is on this report's card family" in md and "Published reference figures" in files.html.read_text()
    for d in dirs:  # the same runs on an A100: the published curve is drawn beside them
        env = json.loads((d / "env.json").read_text())
        (d / "env.json").write_text(json.dumps(dict(env, gpu_model="NVIDIA A100-SXM4-40GB")))
    files = build_report(dirs, config_path, tmp_path / "report2")
    assert "Drawn on the efficiency plot" in files.markdown.read_text()


def test_an_elastic_run_keeps_its_accuracy_and_no_throughput_figure(tmp_path: Path):
    """A 2-GPU run continued on 1 rank: its mAP is reported, its two throughputs only apart."""
    config_path = write_config(tmp_path, [1, 2], val_interval=1)
    cfg = dsconfig.load(config_path)
    one = write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", 100.0, 0.40, curve={1: 0.3, 2: 0.4})
    two = write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 90.0, 0.41, curve={1: 0.3, 2: 0.41})
    timing = json.loads((two / "timing.json").read_text())
    segments = [{"world_size": 2, "images_per_s": 180.0}, {"world_size": 1, "images_per_s": 90.0}]
    timing.update(world_size=1, images_per_s_per_rank=[90.0], elastic=True, segments=segments)
    (two / "timing.json").write_text(json.dumps(timing))
    files = build_report([one, two], config_path, tmp_path / "report")
    rows = {r["run"]: r for r in csv.DictReader(files.csv.open())}
    row = rows["gelan-t_64_g2_b8_disk_fp32_s0_r0"]
    assert row["elastic"] == "2→1 ranks (180.0, 90.0 img/s)"
    assert row["images_per_s"] == row["speedup"] == row["time_to_target_s"] == ""  # nan: not measured as such
    assert float(row["map50_95"]) == pytest.approx(0.41) and float(row["delta_map50_95_vs_1gpu"]) == pytest.approx(0.01)
    assert float(rows["gelan-t_64_g1_b8_disk_fp32_s0_r0"]["speedup"]) == pytest.approx(1.0)
    text = files.markdown.read_text()
    assert "changed its rank count on the way (elastic: 2→1 ranks (180.0, 90.0 img/s))" in text
