"""Sections ``nccl`` and ``ddp``: the real loop in a process group on the one card.

``nccl``: one rank in an NCCL group (the DDP wrapper, its bucketed all-reduce and the loop's
collectives over NCCL). ``ddp``: two ranks on the one card (gloo over CUDA tensors: NCCL refuses
two ranks on one device) train a few steps; weights, buffers and EMA must be equal on both ranks.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from detscale import config, dist
from detscale.data.formats import load_spec
from detscale.engine.build import build_loaders, build_parts
from detscale.engine.compiled import forward_loss
from detscale.engine.loop import LoopState, optimizer_step, standard_hooks, to_input, train_one_epoch, train_step
from detscale.engine.semantics import derive_semantics
from detscale.engine.state import Progress
from detscale.engine.stopflag import StopFlag
from detscale.engine.timing import RankTiming
from gpukit.kit import Kit, Sizes, data_paths, device, experiment


def _group_worker(rank: int, world: int, backend: str, store: str, cfg: config.ExperimentConfig, data_yaml: str,
                  cache_dir: str, result: str) -> None:
    """One rank: join a FileStore group, train one epoch through the real loop, compare states over ranks."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", 0)
    tdist.init_process_group(backend, store=tdist.FileStore(store, world), rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=120), **kwargs)
    try:
        info = dist.init_from_env(120, cpu_threads=1)
        point = cfg.runs()[0]
        sem = derive_semantics(cfg, point, world, info.device.type)
        parts = build_parts(point, load_spec(Path(data_yaml), splits=()).nc, sem, cfg.train, info)
        loader, _ = build_loaders(point, cfg, Path(data_yaml), Path(cache_dir), sem, info, with_val=False)
        timing = RankTiming(1)
        t0 = time.perf_counter()
        loop = LoopState(parts, loader, sem, cfg.train, info.device, Progress())
        epoch = train_one_epoch(loop, 0, standard_hooks(loop, timing, StopFlag()))
        seconds = time.perf_counter() - t0
        wrapped_step, ema_updates = None, parts.ema.updates
        if world == 1:  # the trainer wraps the model in DDP only for N > 1: exercise the wrapper here
            parts.model = DDP(parts.raw, device_ids=[0] if info.device.type == "cuda" else None,
                              gradient_as_bucket_view=True)
            imgs, targets, _ = next(iter(loader))
            items = train_step(forward_loss(parts.model, parts.loss_fn), parts.scaler,
                               to_input(imgs, info.device, True), targets, 1, parts.amp_dtype)
            optimizer_step(parts, cfg.train.clip_grad_norm)
            wrapped_step = bool(torch.isfinite(items).all())
        state = {f"model.{k}": v.detach().cpu() for k, v in parts.raw.state_dict().items()}
        state |= {f"ema.{k}": v.detach().cpu() for k, v in parts.ema.state_dict().items()}
        states = dist.all_gather_object(state)
        probe = torch.arange(4.0, device=info.device) + rank
        dist.all_reduce_sum(probe)
        if rank == 0:
            differ = [k for k in state if any(not torch.equal(state[k], s[k]) for s in states[1:])]
            expect = sum(torch.arange(4.0) + r for r in range(world))
            Path(result).write_text(json.dumps({
                "backend": tdist.get_backend(), "device": str(info.device), "world_size": world,
                "steps": epoch.step, "ema_updates": ema_updates, "losses": epoch.losses,
                "epoch_seconds": round(seconds, 2), "tensors_compared": len(state), "tensors_differing": differ[:20],
                "all_reduce_ok": bool(torch.equal(probe.cpu(), expect)), "ddp_wrapper_step_finite": wrapped_step,
                "precision": sem.precision, "channels_last": sem.channels_last,
                "finite_losses": all(v == v and abs(v) != float("inf") for v in epoch.losses),
            }))
    finally:
        dist.cleanup()


def run_group(kit: Kit, sizes: Sizes, name: str, world: int, backend: str) -> dict[str, Any]:
    dev = device()
    paths = data_paths(kit.work)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    folder = kit.work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # nominal batch = the global batch: one optimiser step (and gradient all-reduce) per batch
    cfg = experiment(paths.ddp_yaml, "gelan-t", sizes.imgsz, sizes.ddp_batch, gpus=world, precision=precision,
                     workers=min(sizes.workers, 2), epochs=1, warmup_epochs=0, nominal=sizes.ddp_batch * world,
                     warmup_steps=1)
    result = folder / "result.json"
    mp.spawn(_group_worker, args=(world, backend, str(folder / "store"), cfg, str(paths.ddp_yaml),
                                  str(paths.ddp_yaml.parent / "cache"), str(result)), nprocs=world, join=True)
    record = json.loads(result.read_text())
    problems = []
    if record["tensors_differing"]:
        problems.append(f"states differ between ranks: {record['tensors_differing']}")
    if not record["all_reduce_ok"]:
        problems.append("all_reduce_sum gave a wrong sum")
    if not record["finite_losses"]:
        problems.append("loss not finite")
    if record["ddp_wrapper_step_finite"] is False:
        problems.append("the step through the DDP wrapper gave a non-finite loss")
    if record["ema_updates"] != record["steps"] or record["steps"] == 0:
        problems.append(f"{record['ema_updates']} EMA updates after {record['steps']} steps")
    if dev.type == "cuda" and not record["device"].startswith("cuda"):
        problems.append(f"ranks ran on {record['device']}, not the GPU")
    record.update(problems=problems, failed=bool(problems))
    return record
