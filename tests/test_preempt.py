"""Preemption: SIGTERM to a running 2-rank CPU training, as Slurm sends it before a time limit.

``detscale launch`` forwards the signal to torchrun's ranks; every rank stops at the same step,
rank 0 writes ``weights/last.pt`` and the launcher exits with the requeue status
(``EXIT_PREEMPTED``). Running the same command again resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from detscale.errors import EXIT_PREEMPTED
from helpers import tiny_dataset

EPOCHS = 4
CONFIG = f"""\
dataset:
  name: tiny
  data_yaml: {{data_yaml}}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [2]
  batch: [2]
  cache: [none]
  precision: [fp32]
  epochs: {EPOCHS}
train:
  warmup_epochs: 0
  close_mosaic: 0
  workers: 0
  cpu_threads_per_rank: 1
  nominal_batch: 4
  max_restarts: 0
augment:
  mosaic: 0.0
"""


def _detscale(*args: str) -> list[str]:
    return [sys.executable, "-m", "detscale", *args]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("preempt")
    tiny_dataset(root / "data", train=16, val=4, objects=(1, 2), object_size=(0.02, 0.6))
    config = root / "config.yaml"
    config.write_text(CONFIG.format(data_yaml=root / "data" / "data.yaml"))
    runs = subprocess.run(_detscale("runs", "--config", str(config)), check=True, capture_output=True, text=True,
                          timeout=60)
    return config, runs.stdout.split()[0]


def _launch(config: Path, run: str, out: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = _detscale("launch", "--gpus", "2", "--", "train", "--config", str(config), "--run", run, "--out", str(out),
                    "--data", str(config.parent / "data" / "data.yaml"), "--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=config.parent)


def _wait(proc: subprocess.Popen[bytes], log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"training did not finish within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_sigterm_saves_requeues_and_resumes(tiny_run: tuple[Path, str], tmp_path: Path) -> None:
    config, run = tiny_run
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"
    first_log = tmp_path / "first.log"
    proc = _launch(config, run, out, first_log)

    # Signal once the first epoch is done (its row is in metrics.jsonl), i.e. mid-training.
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None, f"training ended before it could be signalled:\n{first_log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no epoch finished within 240 s:\n{first_log.read_text()[-3000:]}"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    code = _wait(proc, first_log, 120)
    text = first_log.read_text()
    assert code == EXIT_PREEMPTED, f"exit {code}, expected the requeue status {EXIT_PREEMPTED}:\n{text[-3000:]}"
    assert "stopped by a signal" in text

    ckpt = torch.load(out / "weights" / "last.pt", map_location="cpu", weights_only=False)
    assert {"model", "optimizer", "epoch", "step"} <= set(ckpt)
    assert 1 <= ckpt["epoch"] < EPOCHS, f"stopped at epoch {ckpt['epoch']}: the signal came too late to test resume"
    assert not (out / "timing.json").exists(), "a preempted run must not look finished"

    # The same command again: resumes where the checkpoint says and finishes the run.
    second_log = tmp_path / "second.log"
    code = _wait(_launch(config, run, out, second_log), second_log, 300)
    text = second_log.read_text()
    assert code == 0, text[-3000:]
    resumed = f"resuming from {out / 'weights' / 'last.pt'} at epoch {ckpt['epoch'] + 1} step {ckpt['step']}"
    assert resumed in text, text[-3000:]
    assert (out / "timing.json").is_file()
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    epochs = [row["epoch"] for row in rows]
    assert epochs == list(range(EPOCHS)), f"metrics.jsonl epochs {epochs}: each epoch exactly once"
    assert not any(row["mosaic"] for row in rows)  # augment.mosaic 0: no epoch drew mosaics
    final = torch.load(out / "weights" / "last.pt", map_location="cpu", weights_only=False)
    assert final["epoch"] == EPOCHS
