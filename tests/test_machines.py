"""One report over two results folders (two machines that differ in device and software): runs lined
up by grid point with their origin, each machine's own speed-up, costs from prices per GPU-hour,
and the environment differences that can move mAP named beside it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from detscale import cli
from detscale import config as dsconfig
from test_report import write_config, write_run

G1, G2 = "gelan-t_64_g1_b8_disk_fp32_s0_r0", "gelan-t_64_g2_b8_disk_fp32_s0_r0"


def _machine(root: Path, cfg: dsconfig.ExperimentConfig, env: dict, ips: tuple[float, float],
             maps: tuple[float, float], device: str) -> Path:
    for run, rate, value in ((G1, ips[0], maps[0]), (G2, ips[1], maps[1])):
        run_dir = write_run(root / "runs", cfg, run, rate, value, device=device, curve={0: value / 2, 2: value})
        (run_dir / "env.json").write_text(json.dumps(env))
    return root


@pytest.fixture
def machines(tmp_path: Path) -> tuple[Path, Path]:
    cfg = dsconfig.load(write_config(tmp_path, [1, 2], val_interval=1))
    cpu = {"host": "alpha", "cpu_model": "AMD EPYC 9R14", "torch": "2.14.1", "cpu_isa": "avx512", "threads_per_rank": 1}
    gpu = {"host": "beta", "gpu_model": "NVIDIA H100 80GB HBM3", "driver": "560.35.03", "cuda": "12.6",
           "torch": "2.11.0", "cpu_model": "Intel Xeon 8480+", "cpu_isa": "amx", "threads_per_rank": None}
    a = _machine(tmp_path / "a", cfg, cpu, (10.0, 15.0), (0.40, 0.42), "cpu")
    b = _machine(tmp_path / "b", cfg, gpu, (400.0, 760.0), (0.45, 0.44), "cuda")
    return a, b


def test_two_machines_side_by_side_with_costs_and_environment(machines: tuple[Path, Path], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    a, b = machines
    out = tmp_path / "fleet"
    assert cli.main(["report", "--results", str(a), str(b), "--label", "workstation", "--label", "h100-node",
                     "--price", "H100=2.5", "--price", "cpu=0.04", "--out", str(out)]) == 0
    assert "h100-node: NVIDIA H100 80GB HBM3, nccl" in capsys.readouterr().out
    # machines.csv holds 6 significant digits
    rows = {(r["machine"], int(r["gpus"])): r for r in csv.DictReader((out / "machines.csv").open())}
    assert set(rows) == {("workstation", 1), ("workstation", 2), ("h100-node", 1), ("h100-node", 2)}
    h2, w2 = rows[("h100-node", 2)], rows[("workstation", 2)]
    # each machine's speed-up against its own 1-GPU run
    assert float(h2["speedup"]) == pytest.approx(1.9, rel=1e-5) and float(w2["speedup"]) == pytest.approx(1.5, rel=1e-5)
    assert float(h2["efficiency"]) == pytest.approx(0.95, rel=1e-5)
    # epochs of 9, 4 and 6 s: median 5 s after the first; 2 GPUs x 5 s = 1/360 GPU-hour
    assert float(h2["gpu_hours_per_epoch"]) == pytest.approx(2 * 5 / 3600, rel=1e-5)
    assert float(h2["cost_per_epoch"]) == pytest.approx(2.5 * 2 * 5 / 3600, rel=1e-5)
    assert float(w2["cost_per_epoch"]) == pytest.approx(0.04 * 2 * 5 / 3600, rel=1e-5)
    # target: 0.9 x the 1-GPU run's final mAP, reached at the epoch-2 validation (9 + 4 + 6 s of training)
    assert float(h2["time_to_target_s"]) == pytest.approx(19.0, rel=1e-5)
    assert float(h2["cost_to_target"]) == pytest.approx(2.5 * 2 * 19 / 3600, rel=1e-5)
    md = (out / "machines.md").read_text()
    assert "| h100-node | `" in md and "| beta | NVIDIA H100 80GB HBM3 | 560.35.03 | nccl |" in md
    assert "| alpha | cpu: AMD EPYC 9R14 | — | gloo |" in md
    assert "The machines differ in cpu_isa, cuda, gpu_model, threads_per_rank, torch" in md
    assert "| torch | `2.14.1` | `2.11.0` | yes |" in md and "| driver | `null` | `560.35.03` |  |" in md
    assert "| 2 | h100-node | 1 | 760.0 | 1.90 | 95% |" in md


def test_machines_report_refuses_one_folder_and_unfinished_ones(machines: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = machines
    assert cli.main(["report", "--results", str(a), "--out", str(tmp_path / "x")]) == 2
    empty = tmp_path / "empty"
    (empty / "runs").mkdir(parents=True)
    assert cli.main(["report", "--results", str(a), str(empty), "--out", str(tmp_path / "x")]) == 2
    assert cli.main(["report", "--results", str(a), str(a), "--label", "one", "--out", str(tmp_path / "x")]) == 2
    assert cli.main(["report", "--results", str(a), str(a), "--price", "H100", "--out", str(tmp_path / "x")]) == 2
