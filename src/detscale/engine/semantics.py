"""The derived training semantics of one run, stated once and written into its config.yaml.

Everything a reader needs to compare a 1-GPU and an N-GPU run: how the grid's ``batch`` turns
into a per-rank and a global batch, how many batches accumulate into one optimiser step
(nominal batch), how the learning rate and weight decay follow, and which precision actually ran.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from detscale import config
from detscale.config import ConfigError, ExperimentConfig, RunPoint


@dataclass(frozen=True)
class TrainSemantics:
    world_size: int
    scaling: str  # weak: batch is per rank; strong: batch is global
    batch_per_rank: int
    global_batch: int
    nominal_batch: int
    accumulate: int  # batches per optimiser step
    warmup_accumulate: str  # fixed | ramp (from 1 batch to accumulate during warm-up)
    images_per_optimizer_step: int
    optimizer: str  # sgd | adamw
    lr_scaling: str  # none | linear | sqrt, relative to the nominal batch
    lr_scale: float
    lr0: float  # after scaling
    lr0_config: float
    weight_decay: float  # after the nominal-batch scaling
    weight_decay_config: float
    precision_requested: str
    precision: str  # what ran: fp32 on the CPU whatever was asked
    precision_note: str
    channels_last: bool
    sync_bn: bool
    epochs: int
    seed: int
    lr_schedule: str
    close_mosaic: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def batchnorm_batches(self) -> int:
        """BatchNorm batches in one global batch: one per rank, or one in all with SyncBN."""
        return 1 if self.sync_bn else self.world_size


def lr_scale_factor(mode: str, images_per_step: int, nominal: int) -> float:
    """Learning-rate multiplier for ``images_per_step`` images per optimiser step vs the nominal batch."""
    ratio = images_per_step / nominal
    if mode == "none":
        return 1.0
    if mode == "linear":
        return ratio
    if mode == "sqrt":
        return math.sqrt(ratio)
    raise ConfigError(f"'train.lr_scaling': got {mode!r}; must be one of none, linear, sqrt")


def accumulate_steps(nominal_batch: int, global_batch: int) -> int:
    """Batches accumulated per optimiser step: about ``nominal_batch`` images per step, at least one batch."""
    return max(round(nominal_batch / global_batch), 1)


def derive_semantics(cfg: ExperimentConfig, point: RunPoint, world_size: int, device_type: str,
                     elastic: bool = False) -> TrainSemantics:
    """The run's training semantics on ``world_size`` ranks of ``device_type`` (``cuda`` or ``cpu``).

    ``elastic``: the run continues on ``world_size`` ranks although its grid point asks for
    ``point.gpus`` (:func:`continue_on`): the semantics of ``point.gpus`` ranks, carried over.
    """
    from detscale.engine.compiled import check_compile

    t = cfg.train
    if elastic and world_size != point.gpus:
        check_compile(t.compile, t.compile_mode, t.sync_bn, world_size)
        return continue_on(derive_semantics(cfg, point, point.gpus, device_type), world_size, point.run_id)
    check_world_size(point, world_size)
    check_compile(t.compile, t.compile_mode, t.sync_bn, world_size)
    global_batch = point.global_batch
    accumulate = accumulate_steps(t.nominal_batch, global_batch)
    per_step = global_batch * accumulate
    scale = lr_scale_factor(t.lr_scaling, per_step, t.nominal_batch)
    if device_type == "cpu" and point.precision != "fp32":
        precision, note = "fp32", f"precision {point.precision} requested; forced to fp32 on the CPU"
    else:
        precision, note = point.precision, "as requested"
    return TrainSemantics(
        world_size=world_size,
        scaling=point.scaling,
        batch_per_rank=point.batch_per_rank,
        global_batch=global_batch,
        nominal_batch=t.nominal_batch,
        accumulate=accumulate,
        warmup_accumulate=t.warmup_accumulate,
        images_per_optimizer_step=per_step,
        optimizer=t.optimizer,
        lr_scaling=t.lr_scaling,
        lr_scale=scale,
        lr0=t.lr0 * scale,
        lr0_config=t.lr0,
        # YOLO convention: decay is given for the nominal batch and grows with the images per step.
        weight_decay=t.weight_decay * per_step / t.nominal_batch,
        weight_decay_config=t.weight_decay,
        precision_requested=point.precision,
        precision=precision,
        precision_note=note,
        channels_last=t.channels_last,
        sync_bn=t.sync_bn,
        epochs=cfg.grid.epochs,
        seed=point.seed,
        lr_schedule=t.lr_schedule,
        close_mosaic=t.close_mosaic,
    )


class ElasticError(ConfigError):
    """A run that cannot continue on the rank count it was started with."""


def continue_on(sem: TrainSemantics, world_size: int, run_id: str = "run") -> TrainSemantics:
    """The semantics of a run written by ``sem.world_size`` ranks, continued on ``world_size`` ranks.

    What stays: the images per optimiser step (so the optimiser steps, learning rates, weight decay
    and schedule), the data order (the sampler cuts one permutation into the same optimiser steps)
    and what each BatchNorm normalises over. Without SyncBN that is one rank's batch: the batch per
    rank is kept and the accumulation recomputed (N ranks x batch b train as 1 rank accumulating N
    batches of b). With SyncBN it is the global batch: the global batch is kept and split over the
    new ranks. A rank count that cannot keep them is refused with the numbers.
    """
    if world_size < 1:
        raise ElasticError(f"run {run_id}: cannot continue on {world_size} ranks")
    per_step = sem.images_per_optimizer_step
    if sem.sync_bn:
        if sem.global_batch % world_size:
            options = [m for m in range(1, sem.global_batch + 1) if sem.global_batch % m == 0]
            raise ElasticError(
                f"run {run_id}: SyncBN normalises over the global batch of {sem.global_batch} images, which does "
                f"not split over {world_size} ranks; continue it on {_listed(options)} rank(s)")
        batch, global_batch = sem.global_batch // world_size, sem.global_batch
    else:
        batch, global_batch = sem.batch_per_rank, sem.batch_per_rank * world_size
        if per_step % global_batch:
            options = [m for m in range(1, per_step // batch + 1) if per_step % (batch * m) == 0]
            raise ElasticError(
                f"run {run_id}: each optimiser step holds {per_step} images ({sem.batch_per_rank} per rank x "
                f"{sem.world_size} ranks x {sem.accumulate} accumulated); on {world_size} ranks of "
                f"{batch} images that is {per_step / global_batch:g} batches per rank, not a whole number. "
                f"Continue it on {_listed(options)} rank(s) (the batch per rank stays {batch}: it is what each "
                "BatchNorm normalises over)")
    return replace(sem, world_size=world_size, batch_per_rank=batch, global_batch=global_batch,
                   accumulate=per_step // global_batch)


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + (" or " if len(values) > 1 else "") + str(values[-1])


def check_world_size(point: RunPoint, world_size: int) -> None:
    """The ranks actually started must be the run's GPU count, and the global batch must divide."""
    if world_size != point.gpus:
        raise ConfigError(
            f"run {point.run_id} is a {point.gpus}-rank run but {world_size} rank(s) were started; "
            f"launch it with --gpus {point.gpus} (the run id encodes the GPU count); to continue a run already "
            f"trained on {point.gpus} on {world_size}, resume it with `train --resume --elastic`"
        )
    if point.scaling == "strong" and point.batch % world_size:
        raise ConfigError(
            f"run {point.run_id}: global batch {point.batch} does not divide by {world_size} ranks "
            f"(scaling 'strong'); pick a batch that is a multiple of {world_size}"
        )


def check_run_request(config_path: str | Path, run_id: str, world_size: int,
                      elastic: bool = False) -> tuple[ExperimentConfig, RunPoint]:
    """Load the config and find the run; every mistake a clear error before any rank starts.

    ``elastic``: the run may continue on another rank count (checked against its semantics here;
    the trainer checks that a checkpoint to continue from exists).
    """
    cfg = config.load(config_path)
    point = cfg.run(run_id)
    if elastic and world_size != point.gpus:
        derive_semantics(cfg, point, world_size, "cpu", elastic=True)
    else:
        check_world_size(point, world_size)
    return cfg, point


#: Train settings that change how a run executes but not what it computes: changing them keeps resume.
RUNTIME_ONLY = frozenset({"workers", "cpu_threads_per_rank", "timing_warmup_steps", "timeout_s", "max_restarts",
                          "val_interval", "step_breakdown", "compile", "compile_mode", "target_bucket",
                          "preflight_timeout_s", "preflight_min_gbps"})


def config_digest(cfg: ExperimentConfig, point: RunPoint) -> str:
    """Hash of everything that determines a run's result; a checkpoint resumes only into the same digest."""
    data = cfg.to_dict()
    train = {k: v for k, v in data["train"].items() if k not in RUNTIME_ONLY}
    picked = {
        "point": asdict(point),
        "epochs": cfg.grid.epochs,
        "dataset": data["dataset"],
        "train": train,
        "augment": data["augment"],
    }
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]
