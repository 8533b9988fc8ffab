"""Resume: a run stopped and resumed ends exactly where an uninterrupted one does.

- Stopped mid-epoch (at an optimiser-step boundary, as SIGTERM does) or at an epoch boundary,
  then resumed with ``--resume``: the final weights, EMA and optimiser state equal those of a run
  that never stopped (max abs difference <= 1e-6), augmentation on.
- A rank killed with SIGKILL in the middle of an epoch under ``torchrun --max-restarts 1``: the
  restarted group resumes from ``last.pt`` by itself and finishes with a valid checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import detscale.engine.trainer as trainer
from detscale.cluster.torchrun import pick_port, torchrun_command
from detscale.engine.checkpoint import CheckpointError, load_checkpoint
from detscale.errors import EXIT_PREEMPTED
from helpers import tiny_dataset

CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [{gpus}]
  batch: [{batch}]
  cache: [none]
  epochs: 3
train:
  nominal_batch: 8
  warmup_epochs: 1
  workers: {workers}
  close_mosaic: 1
"""


@pytest.fixture(scope="module")
def data_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resume_data")
    return tiny_dataset(root, train=16, val=2)


def _train(cfg: Path, out: Path, data_yaml: Path, resume: bool = False) -> int:
    run = "gelan-t_64_g1_b4_none_fp32_s0_r0"
    return trainer.train(trainer.TrainRequest(cfg, run, out, resume=resume, data_yaml=data_yaml))


def _stop_after(monkeypatch: pytest.MonkeyPatch, optimizer_steps: int) -> None:
    """Act as if SIGTERM arrived during the given optimiser step (the flag is checked after each)."""
    calls = {"n": 0}

    def agreed(self: trainer.StopFlag, device: torch.device) -> bool:
        calls["n"] += 1
        return calls["n"] >= optimizer_steps

    monkeypatch.setattr(trainer.StopFlag, "agreed", agreed)


def _max_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        return max((_max_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    return 0.0 if a == b else float("inf")


# 16 images / batch 4 = 4 batches per epoch; accumulate 8/4 = 2: 2 optimiser steps per epoch.
@pytest.mark.parametrize(("stop_at_step", "epoch", "step"), [(3, 1, 2), (2, 1, 0)], ids=["mid-epoch", "epoch-end"])
def test_stopped_and_resumed_equals_uninterrupted(tmp_path: Path, data_yaml: Path, monkeypatch: pytest.MonkeyPatch,
                                                  stop_at_step: int, epoch: int, step: int) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(data_yaml=data_yaml, gpus=1, batch=4, workers=0))
    assert _train(cfg, tmp_path / "straight", data_yaml) == 0

    with monkeypatch.context() as m:
        _stop_after(m, stop_at_step)
        assert _train(cfg, tmp_path / "stopped", data_yaml) == EXIT_PREEMPTED
    saved = torch.load(tmp_path / "stopped" / "weights" / "last.pt", weights_only=False)
    assert (saved["epoch"], saved["step"]) == (epoch, step)
    assert not (tmp_path / "stopped" / "timing.json").exists()
    assert _train(cfg, tmp_path / "stopped", data_yaml, resume=True) == 0

    a = torch.load(tmp_path / "straight" / "weights" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "stopped" / "weights" / "last.pt", weights_only=False)
    assert a["epoch"] == b["epoch"] == 3
    for key in ("model", "ema", "optimizer", "scheduler"):
        assert _max_diff(a[key], b[key]) <= 1e-6, key
    assert a["ema_updates"] == b["ema_updates"] == 6
    rows = [json.loads(line) for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    timing = json.loads((tmp_path / "stopped" / "timing.json").read_text())
    assert len(timing["epoch_seconds"]) == 3  # the whole run, across the stop


def test_accumulation_ramp_steps_more_often_in_warmup_and_resumes_exactly(
        tmp_path: Path, data_yaml: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """warmup_accumulate: ramp: epoch 0 (the warm-up) steps after batches 1, 2 and 4 (accumulate 1, 1, 2),
    then 2 steps per epoch; stopped after the second step, inside the ramp, the resumed run ends the same."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(data_yaml=data_yaml, gpus=1, batch=4, workers=0) + "  warmup_accumulate: ramp\n")
    assert _train(cfg, tmp_path / "straight", data_yaml) == 0
    with monkeypatch.context() as m:
        _stop_after(m, 2)
        assert _train(cfg, tmp_path / "stopped", data_yaml) == EXIT_PREEMPTED
    saved = torch.load(tmp_path / "stopped" / "weights" / "last.pt", weights_only=False)
    assert (saved["epoch"], saved["step"], saved["ema_updates"]) == (0, 2, 2)
    assert _train(cfg, tmp_path / "stopped", data_yaml, resume=True) == 0
    a = torch.load(tmp_path / "straight" / "weights" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "stopped" / "weights" / "last.pt", weights_only=False)
    assert a["ema_updates"] == b["ema_updates"] == 3 + 2 + 2
    for key in ("model", "ema", "optimizer"):
        assert _max_diff(a[key], b[key]) <= 1e-6, key
    assert a["semantics"]["warmup_accumulate"] == "ramp"


def test_resume_refuses_another_config(tmp_path: Path, data_yaml: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(data_yaml=data_yaml, gpus=1, batch=4, workers=0).replace("epochs: 3", "epochs: 1"))
    assert _train(cfg, tmp_path / "run", data_yaml) == 0
    cfg.write_text(cfg.read_text().replace("warmup_epochs: 1", "warmup_epochs: 2"))
    with pytest.raises(CheckpointError, match="another configuration"):
        _train(cfg, tmp_path / "run", data_yaml, resume=True)


KILLER = """\
import os, signal, sys
import detscale.engine.loop as loop
from detscale.engine.checkpoint import CheckpointError, load_checkpoint

# Rank 1 of the first attempt dies with SIGKILL in its {kill_at}th batch (the middle of epoch 2).
if os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    original, calls = loop.train_step, [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    loop.train_step = train_step

from detscale.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_rank_killed_mid_epoch_restarts_and_finishes(tmp_path: Path, data_yaml: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(data_yaml=data_yaml, gpus=2, batch=2, workers=1))
    script = tmp_path / "killer.py"
    script.write_text(textwrap.dedent(KILLER.format(kill_at=4 + 2)))  # 4 batches per epoch per rank
    out = tmp_path / "run"
    argv = ["train", "--config", str(cfg), "--run", "gelan-t_64_g2_b2_none_fp32_s0_r0", "--out", str(out),
            "--data", str(data_yaml)]
    cmd = torchrun_command(2, argv, port=pick_port(None), max_restarts=1, entry=("--", str(script)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (out / "logs" / "rank0.log").read_text()
    assert "resuming from" in log and "torchrun restart" in log and "at epoch 2 step 0" in log
    ckpt = load_checkpoint(out / "weights" / "last.pt")
    assert ckpt["epoch"] == 3 and ckpt["step"] == 0 and len(ckpt["rng"]) == 2
    assert not [p.name for p in (out / "weights").iterdir() if p.name != "last.pt"]  # no temporary files left
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert json.loads((out / "timing.json").read_text())["world_size"] == 2
