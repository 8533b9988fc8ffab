"""Advice on the bottleneck: each rule on constructed timing records, firing and silent."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from detscale import config as dsconfig
from detscale.report import advice
from detscale.report.build import build_report
from test_report import write_config, write_run


def row(**over: object) -> dict[str, object]:
    """A balanced 1-GPU CPU run: no rule fires on it."""
    base: dict[str, object] = {
        "run": "r", "device": "cpu", "gpus": 1, "nodes": 1, "global_batch": 32, "batch_per_gpu": 32,
        "cache": "disk", "workers": 1, "cpu_cores": 2, "threads_per_rank": 1, "images_per_s_per_gpu": 200.0,
        "step_ms": 160.0, "data_wait_share": 0.02, "comm_ms": math.nan, "optimizer_ms": 8.0, "accumulate": 2,
        "cpu_ms_per_step": 150.0, "loader_cpu_ms_per_image": 0.25, "mfu": 0.4,
    }
    base.update(over)
    return base


def test_a_balanced_run_gets_no_advice() -> None:
    assert advice.advise([row()]) == []


def test_data_wait_names_the_cache_the_workers_it_needs_and_the_cpus() -> None:
    # 40 % waiting; the loader costs 20 ms of CPU per image: one worker delivers 50 img/s
    tip = advice.data_wait(row(data_wait_share=0.4, loader_cpu_ms_per_image=20.0, images_per_s_per_gpu=120.0))
    # demand without waiting 120 / 0.6 = 200 img/s; x1.2 headroom / 50 per worker = 5 workers
    assert tip is not None and "40% of the step waits for data" in tip and "grid.cache: ram (now disk)" in tip
    assert "train.workers: 5 (now 1)" in tip and "50 img/s" in tip and "demand of 200 img/s" in tip
    assert "more CPUs per GPU" in tip  # 5 workers + 1 thread on 2 cores
    assert advice.data_wait(row(data_wait_share=0.05)) is None
    unmeasured = advice.data_wait(row(data_wait_share=0.3, cache="ram", loader_cpu_ms_per_image=math.nan))
    assert unmeasured is not None and "grid.cache" not in unmeasured and "ceiling is unknown" in unmeasured


def test_exposed_communication_and_the_optimiser_share() -> None:
    tip = advice.comm(row(gpus=2, comm_ms=40.0))
    assert tip is not None and "25% of the step (40.0 of 160.0 ms)" in tip and "train.nominal_batch" in tip
    assert advice.comm(row(gpus=2, comm_ms=10.0)) is None and advice.comm(row()) is None  # nan: not measured
    tip = advice.optimizer(row(optimizer_ms=40.0, accumulate=1))
    assert tip is not None and "25% of the step (40.0 ms)" in tip and "once every 1 batch" in tip
    assert advice.optimizer(row()) is None


def test_launch_bound_only_on_cuda_with_low_mfu_and_a_busy_host() -> None:
    gpu = row(device="cuda", threads_per_rank=math.nan, mfu=0.02, cpu_ms_per_step=150.0, cpu_cores=16)
    tip = advice.launch_bound(gpu)
    assert tip is not None and "MFU 2.0%" in tip and "94%" in tip and "grid.batch (now 32 per GPU)" in tip
    assert advice.launch_bound(dict(gpu, mfu=0.3)) is None
    assert advice.launch_bound(dict(gpu, cpu_ms_per_step=40.0)) is None
    assert advice.launch_bound(dict(gpu, device="cpu")) is None


def test_contention_by_threads_asked_or_cpus_measured() -> None:
    threads = advice.contention(row(gpus=4, threads_per_rank=1))  # 4 threads on 2 cores
    assert threads is not None and "4 torch threads" in threads and "2 rank" not in threads
    # 2 ranks, each busy 150/160 of its step plus 0.25 ms x 200 img/s of loader: 1.98 CPUs of 2: fine
    assert advice.contention(row(gpus=2)) is None
    busy = advice.contention(row(gpus=2, loader_cpu_ms_per_image=2.0))  # + 0.4 each: 2.675 CPUs
    assert busy is not None and "2.67 CPUs busy (measured)" in busy
    assert advice.contention(row(cpu_cores=0)) is None


def test_the_report_carries_the_advice(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(config_path)
    dirs = [write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", 100.0, 0.4),
            write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", 180.0, 0.4)]
    files = build_report(dirs, config_path, tmp_path / "report")  # write_run's records wait 25 % for data
    rows = list(csv.DictReader(files.csv.open()))
    assert all(advice.data_wait(r) for r in rows)
    md, page = files.markdown.read_text(), files.html.read_text()
    assert "## Advice on the bottleneck" in md and "(data_wait): 25% of the step waits for data" in md
    assert "Advice on the bottleneck" in page and "25% of the step waits for data" in page
