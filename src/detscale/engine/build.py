"""What one rank trains with, built from a grid point: the model (the same initial weights on every
rank), SyncBN, EMA, optimiser, schedule, scaler, loss and the DDP wrapper (:func:`build_parts`),
and the training and validation loaders (:func:`build_loaders`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from detscale import dist
from detscale.config import ExperimentConfig, RunPoint, TrainConfig
from detscale.engine.buffers import SequentialBufferMerge
from detscale.engine.compiled import forward_loss
from detscale.engine.ddp import CommProbe, wrap_ddp
from detscale.engine.ema import ModelEMA
from detscale.engine.optim import build_optimizer, build_scheduler
from detscale.engine.semantics import TrainSemantics
from detscale.engine.state import Parts
from detscale.errors import UserError

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rank_seed(seed: int, rank: int) -> int:
    """A 32-bit seed per rank derived from the run's one seed."""
    return int(np.random.SeedSequence([seed, rank, 0x5EED]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def initial_model(name: str, nc: int, seed: int) -> nn.Module:
    """The model a run of ``seed`` starts from: the same weights on every rank and for the parity benchmark."""
    from detscale.model import build_model

    seed_everything(seed)
    return build_model(name, nc)


def build_parts(point: RunPoint, nc: int, sem: TrainSemantics, tcfg: TrainConfig, info: dist.DistInfo) -> Parts:
    """Model (same initial weights on every rank), SyncBN, EMA, optimiser, scheduler, scaler, loss, DDP."""

    from detscale.engine.syncbn import convert_sync_batchnorm
    from detscale.loss import DetectionLoss

    comm_probe = None
    raw = initial_model(point.model, nc, sem.seed)  # identical on every rank (DDP also broadcasts rank 0's)
    if sem.sync_bn and sem.world_size > 1:
        raw = convert_sync_batchnorm(raw, info.device.type)
    raw = raw.to(info.device)
    if sem.channels_last:
        raw = raw.to(memory_format=torch.channels_last)
    ema = ModelEMA(raw, tcfg.ema_decay, tcfg.ema_tau)
    optimizer = build_optimizer(raw, sem.optimizer, sem.lr0, tcfg.momentum, sem.weight_decay)
    scheduler = build_scheduler(optimizer, sem.lr_schedule, sem.epochs, tcfg.lrf)
    amp_dtype = AMP_DTYPES.get(sem.precision)
    scaler = torch.amp.GradScaler(info.device.type, enabled=sem.precision == "fp16")
    loss_fn = DetectionLoss(raw, tcfg.box_gain, tcfg.cls_gain, tcfg.dfl_gain, global_normaliser=sem.sync_bn)
    if sem.world_size > 1:
        model: nn.Module = wrap_ddp(raw, info.device)
        if tcfg.step_breakdown:
            comm_probe = CommProbe()
            model.register_comm_hook(comm_probe, CommProbe.hook)
    else:
        model = raw
    buffers = SequentialBufferMerge(raw) if sem.world_size > 1 and not sem.sync_bn else None
    seed_everything(rank_seed(sem.seed, info.rank))
    step = forward_loss(model, loss_fn, tcfg.compile, tcfg.compile_mode)
    return Parts(model, raw, ema, optimizer, scheduler, scaler, loss_fn, amp_dtype, buffers, comm_probe, step)


def target_bucket(tcfg: TrainConfig) -> int:
    """``train.target_bucket``, with 0 resolved: buckets of 16 for a compiled step (a few graphs per
    run), the batch's own fullest image for an eager one (the least padding: no cost to pay for shapes)."""
    if tcfg.target_bucket > 0:
        return tcfg.target_bucket
    return 16 if tcfg.compile != "off" else 0


def build_loaders(point: RunPoint, cfg: ExperimentConfig, data_yaml: Path, cache_dir: Path | None,
                  sem: TrainSemantics, info: dist.DistInfo, with_val: bool) -> tuple[Any, Any | None]:
    from detscale.data.dataset import build_dataset
    from detscale.data.loader import build_train_loader, build_val_loader

    train_ds = build_dataset(data_yaml, "train", point.imgsz, point.cache, cache_dir, cfg.augment)
    if len(train_ds) < sem.images_per_optimizer_step:
        raise UserError(f"the training split of {data_yaml} has {len(train_ds)} images, fewer than one optimiser "
                        f"step ({sem.global_batch} x {sem.accumulate} accumulated = {sem.images_per_optimizer_step}); "
                        "use a smaller batch or nominal_batch, or more images")
    train = build_train_loader(train_ds, sem.batch_per_rank, info.rank, info.world_size, sem.seed,
                               cfg.train.workers, accumulate=sem.accumulate, target_bucket=target_bucket(cfg.train))
    left_out = len(train_ds) - len(train) * sem.global_batch
    if left_out > 0.1 * len(train_ds):
        log.warning("each epoch trains %d of the %d training images (whole optimiser steps of %d images; the "
                    "rest, a different one every epoch, waits for a later epoch): lower train.nominal_batch or the "
                    "batch to use more of them", len(train_ds) - left_out, len(train_ds), sem.images_per_optimizer_step)
    val = None
    if with_val:
        val_ds = build_dataset(data_yaml, "val", point.imgsz, point.cache, cache_dir, None)
        val = build_val_loader(val_ds, cfg.eval.batch, info.rank, info.world_size, cfg.train.workers)
    return train, val


# ---------------------------------------------------------------------------------------------
# Files of rank 0
# ---------------------------------------------------------------------------------------------


