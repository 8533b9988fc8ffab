"""Two gloo ranks on the CPU against one: the distributed semantics of the trainer.

(a) Equivalence, SyncBatchNorm on: with the same data order and global batch, 2 ranks x batch b
    and 1 rank x batch 2b reach the same weights after 5 optimiser steps (loss normalised by the
    global target count, gradient accumulation and warm-up included).
(a') Equivalence, SyncBatchNorm off (the scaling comparison): 2 ranks x batch b and 1 rank x
    batch b accumulating 2 end with the same weights, EMA and BatchNorm buffers (float64, 5
    optimiser steps, augmentation on): rank r trains the r-th slice of every global batch, each
    rank normalises its loss by its own targets, and BatchNorm statistics are merged as one
    process updates them batch after batch.
(b) After a full run every rank holds identical weights, buffers and EMA (SyncBatchNorm off).
(c) Only rank 0 writes into the run folder (rank 1 writes its own log file and nothing else).

Ranks are started with ``torch.multiprocessing.spawn`` and joined through a ``FileStore``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import yaml

from helpers import tiny_dataset

EQUIV_CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [1, 2]
  batch: [4]
  scaling: strong
  cache: [none]
  epochs: 1
train:
  # A small learning rate: the task-aligned assigner makes the loss piecewise (an anchor enters or
  # leaves the top-k), so larger steps turn rounding-level differences into different assignments.
  # (A one-epoch run has no warm-up: the last epoch never is.)
  lr0: 0.0005
  warmup_bias_lr: 0.0005
  nominal_batch: 8
  warmup_epochs: 1
  sync_bn: true
  workers: 0
  close_mosaic: 0
augment: {{hsv_h: 0, hsv_s: 0, hsv_v: 0, translate: 0, scale: 0, fliplr: 0, mosaic: 0, mixup: 0}}
"""

# 2 ranks x 4 images vs 1 rank x 4 images accumulating 2 (nominal 8): 40 images = 5 optimiser steps.
EQUIV_LOCAL_CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [1, 2]
  batch: [4]
  scaling: weak
  cache: [none]
  epochs: 1
train:
  lr0: 0.0005
  warmup_bias_lr: 0.0005
  nominal_batch: 8
  workers: 0
  close_mosaic: 0
  channels_last: true
"""

RUN_CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [2]
  batch: [2]
  cache: [none]
  epochs: 2
train:
  nominal_batch: 8
  warmup_epochs: 1
  workers: 1
  close_mosaic: 1
  val_interval: 1
  timing_warmup_steps: 1
  channels_last: true  # the layout the default config trains in: DDP buckets must follow it
"""


@pytest.fixture(scope="module")
def data_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp_data")
    return tiny_dataset(root, train=40, val=4)


def _join(rank: int, world: int, store: str) -> None:
    """Join a FileStore-backed gloo group as torchrun would, one thread per rank."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if world > 1:
        tdist.init_process_group("gloo", store=tdist.FileStore(store, world), rank=rank, world_size=world,
                                 timeout=datetime.timedelta(seconds=120))


def _equivalence_worker(rank: int, world: int, store: str, cfg_path: str, data_yaml: str, out: str,
                        step: tuple[int, int, int]) -> None:
    """One epoch of the real loop on this rank in float64; every rank saves its final state to ``out.rankR``.

    ``step`` = the expected (global batch, accumulate, batches per epoch) of this world size.
    """
    import detscale.engine.loop as loop
    from detscale import config, dist
    from detscale.engine.build import build_loaders, build_parts
    from detscale.engine.loop import LoopState, train_one_epoch
    from detscale.engine.semantics import derive_semantics
    from detscale.engine.state import Progress

    _join(rank, world, store)
    # float64 throughout: in float32 this deep network's gradients already differ by ~1e-4 relative
    # between two summation orders, which after 5 steps would hide (or fake) a semantic difference.
    torch.set_default_dtype(torch.float64)
    loop.to_input = lambda imgs, device, channels_last: imgs.to(device).double().div_(255)
    try:
        info = dist.init_from_env(120, cpu_threads=1)
        cfg = config.load(cfg_path)
        point = next(p for p in cfg.runs() if p.gpus == world)
        sem = derive_semantics(cfg, point, world, "cpu")
        parts = build_parts(point, 6, sem, cfg.train, info)
        loader, _ = build_loaders(point, cfg, Path(data_yaml), None, sem, info, with_val=False)
        assert (sem.global_batch, sem.accumulate, len(loader)) == step
        result = train_one_epoch(LoopState(parts, loader, sem, cfg.train, info.device, Progress()), 0)
        assert result.complete and parts.ema.updates == 5
        state = {"model": parts.raw.state_dict(), "ema": parts.ema.state_dict(), "losses": result.losses}
        torch.save(state, f"{out}.rank{rank}")
    finally:
        dist.cleanup()


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: set[str] | None = None) -> float:
    assert a.keys() == b.keys()
    names = [k for k in a if a[k].is_floating_point() and (keys is None or k in keys)]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in names)


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: set[str]) -> float:
    return max(((a[k].double() - b[k].double()).abs() / a[k].double().abs().clamp(min=1.0)).max().item()
               for k in keys)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_the_same_global_batch(tmp_path: Path, data_yaml: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(EQUIV_CONFIG.format(data_yaml=data_yaml))
    # global batch 4 either way, 2 batches per step: 40 images = 10 batches = 5 optimiser steps
    for world in (1, 2):
        mp.spawn(_equivalence_worker, args=(world, str(tmp_path / f"store{world}"), str(cfg), str(data_yaml),
                                            str(tmp_path / f"w{world}.pt"), (4, 2, 10)), nprocs=world, join=True)
    one, two = (torch.load(tmp_path / f"w{w}.pt.rank0", weights_only=False) for w in (1, 2))
    from detscale.model import build_model

    torch.manual_seed(0)
    model = build_model("gelan-t", 6)
    params = {name for name, _ in model.named_parameters()}
    buffers = {name for name in one["model"] if name not in params and one["model"][name].is_floating_point()}
    assert _max_abs_diff(one["model"], two["model"], params) <= 1e-5
    assert _max_abs_diff(one["ema"], two["ema"], params) <= 1e-5
    # BatchNorm running statistics (variances of order 100): the same values to float precision
    assert _max_rel_diff(one["model"], two["model"], buffers) <= 1e-5
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-4)
    # the weights did move: the comparison is not between two untouched initialisations
    torch.manual_seed(0)
    init = model.double().state_dict()
    assert _max_abs_diff(init, one["model"], params) > 1e-3


@pytest.mark.slow
def test_two_ranks_equal_one_rank_accumulating_two_batches(tmp_path: Path, data_yaml: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(EQUIV_LOCAL_CONFIG.format(data_yaml=data_yaml))
    # 1 rank: global batch 4, accumulating 2 (10 batches); 2 ranks: global batch 8, no accumulation (5 batches)
    for world, step in ((1, (4, 2, 10)), (2, (8, 1, 5))):
        mp.spawn(_equivalence_worker, args=(world, str(tmp_path / f"store{world}"), str(cfg), str(data_yaml),
                                            str(tmp_path / f"w{world}.pt"), step), nprocs=world, join=True)
    one = torch.load(tmp_path / "w1.pt.rank0", weights_only=False)
    two, two_b = (torch.load(tmp_path / f"w2.pt.rank{r}", weights_only=False) for r in (0, 1))
    for key in ("model", "ema"):
        assert two[key].keys() == one[key].keys()
        for name, value in two[key].items():
            assert torch.equal(value, two_b[key][name]), f"{key}.{name} differs between the ranks"
            if value.is_floating_point():
                scale = max(1.0, float(one[key][name].abs().max()))
                assert float((value - one[key][name]).abs().max()) <= 1e-6 * scale, f"{key}.{name}"
            else:  # BatchNorm's num_batches_tracked: 10 batches either way
                assert torch.equal(value, one[key][name]), f"{key}.{name}"
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-9)
    # the weights moved: not a comparison of two untouched initialisations
    torch.manual_seed(0)
    from detscale.model import build_model

    init = build_model("gelan-t", 6).double().state_dict()
    assert max(float((init[k] - one["model"][k]).abs().max()) for k in init if init[k].is_floating_point()) > 1e-3


def _is_write(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def _run_worker(rank: int, world: int, store: str, cfg_path: str, data_yaml: str, out: str, probe: str) -> None:
    """A full ``train()`` on this rank; records rank 1's writes and every rank's final state."""
    import detscale.engine.trainer as trainer

    _join(rank, world, store)
    writes: list[str] = []
    own_log = str(Path(out) / "logs" / f"rank{rank}.log")

    def audit(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if path.startswith(out) and path != own_log and _is_write(args[1], args[2] if len(args) > 2 else None):
                writes.append(path)

    if rank != 0:
        sys.addaudithook(audit)
    original = trainer.checkpoint_dict

    def spy(parts, progress, *args, **kwargs):  # keep each rank's final state for the comparison
        if progress.epoch == 2:
            state = {"model": parts.raw.state_dict(), "ema": parts.ema.state_dict(), "updates": parts.ema.updates}
            torch.save(state, f"{probe}/rank{rank}.pt")
        return original(parts, progress, *args, **kwargs)

    trainer.checkpoint_dict = spy
    code = trainer.train(trainer.TrainRequest(Path(cfg_path), "gelan-t_64_g2_b2_none_fp32_s0_r0", Path(out),
                                              data_yaml=Path(data_yaml)))
    Path(f"{probe}/writes{rank}.json").write_text(json.dumps({"code": code, "writes": writes}))


@pytest.mark.slow
def test_full_two_rank_run_identical_ranks_and_rank0_writes(tmp_path: Path, data_yaml: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(RUN_CONFIG.format(data_yaml=data_yaml))
    out, probe = tmp_path / "run", tmp_path / "probe"
    probe.mkdir()
    mp.spawn(_run_worker, args=(2, str(tmp_path / "store"), str(cfg), str(data_yaml), str(out), str(probe)),
             nprocs=2, join=True)
    r0, r1 = (json.loads((probe / f"writes{r}.json").read_text()) for r in (0, 1))
    assert r0["code"] == r1["code"] == 0
    assert r1["writes"] == [], f"rank 1 wrote into the run folder: {r1['writes']}"
    # (b) identical weights, buffers and EMA on every rank (bit for bit: same all-reduced updates)
    s0, s1 = (torch.load(probe / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert s0["updates"] == s1["updates"] > 0
    for key in ("model", "ema"):
        for name, tensor in s0[key].items():
            assert torch.equal(tensor, s1[key][name]), f"{key}.{name} differs between ranks"
    # the run folder rank 0 wrote
    for name in ("config.yaml", "env.json", "metrics.jsonl", "timing.json", "weights/last.pt", "weights/best.pt",
                 "logs/rank0.log", "logs/rank1.log"):
        assert (out / name).is_file(), name
    timing = json.loads((out / "timing.json").read_text())
    design = {"world_size", "device", "backend", "batch_per_rank", "global_batch", "warmup_steps", "measured_steps",
              "images_per_s", "images_per_s_per_rank", "data_wait_share", "compute_share", "epoch_seconds",
              "val_seconds", "train_seconds", "peak_mem_bytes_per_rank", "mem_kind"}
    assert design <= timing.keys()
    assert (timing["world_size"], timing["device"], timing["backend"], timing["mem_kind"]) == (2, "cpu", "gloo", "rss")
    assert timing["global_batch"] == 4 and len(timing["images_per_s_per_rank"]) == 2
    assert timing["images_per_s"] == pytest.approx(sum(timing["images_per_s_per_rank"]))
    assert timing["images_per_s"] > 0 and timing["measured_steps"] == 2 * (10 - 1)
    assert timing["data_wait_share"] + timing["compute_share"] == pytest.approx(1.0)
    # the step breakdown: the phases add up to the step, and the gradient all-reduce shows as exposed time
    from detscale.engine.timing import PHASES

    breakdown = timing["step_breakdown_ms"]
    assert list(breakdown) == list(PHASES) and len(timing["step_breakdown_ms_per_rank"]) == 2
    assert all(v >= 0 for v in breakdown.values()) and breakdown["comm"] > 0 and breakdown["backward"] > 0
    for rank, parts in enumerate(timing["step_breakdown_ms_per_rank"]):
        step_ms = 1000 * timing["global_batch"] / 2 / timing["images_per_s_per_rank"][rank]
        assert sum(parts.values()) == pytest.approx(step_ms, rel=1e-6)
    # the CPU demand the projection's roofline reads: the rank's process per step, its loader workers per image
    assert 0 < timing["cpu_ms_per_step"] < 10 * step_ms
    assert timing["loader_cpu_ms_per_image"] > 0  # 1 worker per rank
    assert len(timing["epoch_seconds"]) == 2 and timing["val_seconds"] > 0
    assert all(m > 0 for m in timing["peak_mem_bytes_per_rank"])
    # MFU: FLOPs per image from the model, a peak measured by each rank, their ratio to the throughput
    assert len(timing["peak_gflops_per_rank"]) == 2 and all(g > 0 for g in timing["peak_gflops_per_rank"])
    assert timing["mfu"] == pytest.approx(timing["train_gflops_per_image"] * timing["images_per_s"]
                                          / sum(timing["peak_gflops_per_rank"]))
    assert 0 < timing["mfu"] < 1 and "matmul" in timing["peak_method"]
    env = json.loads((out / "env.json").read_text())
    for key in ("host", "cpu_model", "cpu_cores_logical", "gpu_model", "gpu_count", "driver", "torch", "cuda", "nccl",
                "python", "detscale", "git_commit", "config_hash"):
        assert key in env, key
    frozen = yaml.safe_load((out / "config.yaml").read_text())
    assert frozen["semantics"]["world_size"] == 2 and frozen["semantics"]["accumulate"] == 2
    assert frozen["semantics"]["precision"] == "fp32"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1] and [r["mosaic"] for r in rows] == [True, False]
    assert all("map50_95" in r for r in rows)
    ckpt = torch.load(out / "weights" / "last.pt", weights_only=False)
    assert ckpt["epoch"] == 2 and len(ckpt["rng"]) == 2 and ckpt["model_name"] == "gelan-t"
    for name, tensor in ckpt["model"].items():
        assert torch.equal(tensor, s0["model"][name])
