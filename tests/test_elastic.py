"""Elastic continuation: a run written by N ranks continues on M ranks and ends where a run that
never changed its rank count does.

Without SyncBN the batch per rank (what each BatchNorm normalises over) stays and the accumulation
is recomputed, so the images per optimiser step, the learning rates (the warm-up counts BatchNorm
batches), the data order and the BatchNorm statistics are those of one rank accumulating N
batches. In float64, with augmentation and warm-up on:

- 2 epochs on 2 ranks, then 2 epochs on 1 rank (resumed at an epoch boundary) and
- 1.5 epochs on 1 rank, then the rest on 2 ranks (resumed in the middle of an epoch)

end with the weights, EMA, BatchNorm buffers and optimiser state of 4 epochs on 1 rank (1e-6).
Each rank count's throughput is kept apart in timing.json. A rank count that cannot keep the
images per optimiser step is refused with the numbers; a checkpoint of another rank count is
refused without ``--elastic``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from detscale.engine.checkpoint import CheckpointError, find_resume_checkpoint
from detscale.engine.semantics import ElasticError, TrainSemantics, continue_on
from detscale.engine.state import RunPaths
from detscale.files import save_torch
from helpers import tiny_dataset

CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [1, 2]
  batch: [2]
  scaling: weak
  cache: [none]
  epochs: 4
train:
  # 16 images: 1 rank x batch 2 accumulates 4 (8 batches per epoch), 2 ranks x batch 2 accumulate 2
  # (4 batches per epoch); 8 images per optimiser step either way, 2 steps per epoch.
  # A small learning rate: two runs that differ only in summation order part exponentially (at
  # lr 5e-4 a BatchNorm variance from 5e-14 after 2 steps to 3e-6 after 8, 2 ranks throughout
  # against 1 rank; at 1e-4 to 3e-9), and the comparison is of the semantics, not of that chaos.
  lr0: 0.0001
  warmup_bias_lr: 0.0001
  nominal_batch: 8
  warmup_epochs: 1
  workers: 0
  close_mosaic: 1
  timing_warmup_steps: 1
"""
ONE, TWO = "gelan-t_64_g1_b2_none_fp32_s0_r0", "gelan-t_64_g2_b2_none_fp32_s0_r0"


@pytest.fixture(scope="module")
def data_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp("elastic_data"), train=16, val=2)


def _worker(rank: int, world: int, store: str, cfg: str, data_yaml: str, run: str, out: str, resume: bool,
            stop_after: int) -> None:
    """``train()`` on this rank in float64; stops (as SIGTERM does) after ``stop_after`` optimiser steps."""
    import detscale.engine.loop as loop
    import detscale.engine.trainer as trainer
    from test_ddp import _join

    _join(rank, world, store)
    torch.set_default_dtype(torch.float64)  # rounding far below the 1e-6 compared
    loop.to_input = lambda imgs, device, channels_last: imgs.to(device).double().div_(255)
    if stop_after:
        calls = {"n": 0}

        def agreed(self: Any, device: torch.device) -> bool:
            calls["n"] += 1
            return calls["n"] >= stop_after

        trainer.StopFlag.agreed = agreed
    code = trainer.train(trainer.TrainRequest(Path(cfg), run, Path(out), resume=resume, data_yaml=Path(data_yaml),
                                              elastic=resume))
    if code not in (0, 75):
        raise SystemExit(code)


def _train(tmp: Path, world: int, run: str, out: Path, resume: bool = False, stop_after: int = 0) -> None:
    store = tmp / f"store-{out.name}-{world}-{int(resume)}"
    data_yaml = (tmp / "data_yaml.txt").read_text()
    mp.spawn(_worker, args=(world, str(store), str(tmp / "cfg.yaml"), data_yaml, run, str(out), resume, stop_after),
             nprocs=world, join=True)


def _assert_same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["epoch"] == b["epoch"] == 4 and a["ema_updates"] == b["ema_updates"] == 8
    for key in ("model", "ema"):
        for name, value in a[key].items():
            if value.is_floating_point():  # weights and BatchNorm statistics (variances of order 100)
                scale = max(1.0, float(value.abs().max()))
                assert float((value - b[key][name]).abs().max()) <= 1e-6 * scale, f"{key}.{name}"
            else:  # num_batches_tracked: the same 32 BatchNorm batches either way
                assert torch.equal(value, b[key][name]), f"{key}.{name}"
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point():
                other = b["optimizer"]["state"][index][name]
                assert float((value - other).abs().max()) <= 1e-6 * max(1.0, float(value.abs().max()))
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


@pytest.mark.slow
def test_continuing_on_another_rank_count_ends_like_one_rank_throughout(tmp_path: Path, data_yaml: Path) -> None:
    (tmp_path / "cfg.yaml").write_text(CONFIG.format(data_yaml=data_yaml))
    (tmp_path / "data_yaml.txt").write_text(str(data_yaml))
    _train(tmp_path, 1, ONE, tmp_path / "ref")
    # 2 ranks for 2 epochs (4 optimiser steps, warm-up included), then 1 rank to the end
    _train(tmp_path, 2, TWO, tmp_path / "down", stop_after=4)
    assert torch.load(tmp_path / "down/weights/last.pt", weights_only=False)["world_size"] == 2
    _train(tmp_path, 1, TWO, tmp_path / "down", resume=True)
    # 1 rank for 3 optimiser steps (half of epoch 2: batch 4 of 8), then 2 ranks from batch 2 of 4
    _train(tmp_path, 1, ONE, tmp_path / "up", stop_after=3)
    saved = torch.load(tmp_path / "up/weights/last.pt", weights_only=False)
    assert (saved["epoch"], saved["step"]) == (1, 4)
    _train(tmp_path, 2, ONE, tmp_path / "up", resume=True)

    ref = torch.load(tmp_path / "ref/weights/last.pt", weights_only=False)
    for name in ("down", "up"):
        _assert_same_run(ref, torch.load(tmp_path / name / "weights/last.pt", weights_only=False))
    # the weights moved: the runs are not equal for being untouched
    from detscale.engine.build import initial_model

    start = initial_model("gelan-t", 6, 0).double().state_dict()
    assert max(float((start[k] - ref["model"][k]).abs().max()) for k in start if start[k].is_floating_point()) > 1e-3

    # each rank count's throughput apart; the top-level figures are the last rank count's
    down = json.loads((tmp_path / "down/timing.json").read_text())
    assert down["elastic"] is True and down["world_size"] == 1
    first, last = down["segments"]
    assert (first["world_size"], first["global_batch"], first["accumulate"]) == (2, 4, 2)
    assert (last["world_size"], last["global_batch"], last["accumulate"]) == (1, 2, 4)
    assert first["end"] == last["start"] == {"epoch": 2, "step": 0} and last["end"] == {"epoch": 4, "step": 0}
    assert first["images_per_s"] > 0 and last["images_per_s"] == pytest.approx(down["images_per_s"])
    up = json.loads((tmp_path / "up/timing.json").read_text())
    assert [s["world_size"] for s in up["segments"]] == [1, 2]
    assert up["segments"][0]["end"] == {"epoch": 1, "step": 4} and up["segments"][1]["start"] == {"epoch": 1, "step": 2}
    rows = [json.loads(line) for line in (tmp_path / "down/metrics.jsonl").read_text().splitlines()]
    assert [r["world_size"] for r in rows] == [2, 2, 1, 1]
    ref_timing = json.loads((tmp_path / "ref/timing.json").read_text())
    assert "segments" not in ref_timing and "elastic" not in ref_timing


def _sem(**kw: Any) -> TrainSemantics:
    base = dict(world_size=2, scaling="weak", batch_per_rank=16, global_batch=32, nominal_batch=64, accumulate=2,
                warmup_accumulate="fixed", images_per_optimizer_step=64, optimizer="sgd", lr_scaling="none",
                lr_scale=1.0, lr0=0.01, lr0_config=0.01, weight_decay=5e-4, weight_decay_config=5e-4,
                precision_requested="fp32", precision="fp32", precision_note="", channels_last=False, sync_bn=False,
                epochs=3, seed=0, lr_schedule="linear", close_mosaic=1)
    return TrainSemantics(**(base | kw))


def test_continue_on_keeps_the_batch_per_rank_or_with_syncbn_the_global_batch() -> None:
    four = continue_on(_sem(), 4)
    assert (four.batch_per_rank, four.global_batch, four.accumulate, four.images_per_optimizer_step) == (16, 64, 1, 64)
    one = continue_on(_sem(), 1)
    assert (one.batch_per_rank, one.global_batch, one.accumulate, one.lr0) == (16, 16, 4, 0.01)
    with pytest.raises(ElasticError, match=r"64 images .* on 3 ranks of 16 images .* Continue it on 1, 2 or 4"):
        continue_on(_sem(), 3, "r")
    with pytest.raises(ElasticError, match=r"Continue it on 1, 2 or 4"):
        continue_on(_sem(), 8, "r")
    synced = continue_on(_sem(sync_bn=True), 4)
    assert (synced.batch_per_rank, synced.global_batch, synced.accumulate) == (8, 32, 2)
    with pytest.raises(ElasticError, match=r"global batch of 32 images, which does not split over 3 ranks"):
        continue_on(_sem(sync_bn=True), 3)


def test_a_checkpoint_of_another_rank_count_needs_elastic(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.weights.mkdir()
    save_torch({"model": {}, "config_digest": "d", "world_size": 2, "epoch": 1, "step": 0}, paths.last)
    with pytest.raises(CheckpointError, match=r"by 2 ranks, not 1; to continue it on 1 rank\(s\) add --elastic"):
        find_resume_checkpoint(paths, True, "d", 1)
    assert find_resume_checkpoint(paths, True, "d", 1, elastic=True)["world_size"] == 2
