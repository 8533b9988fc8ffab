"""One epoch of training, and the hooks that watch it.

:func:`train_one_epoch` does the work and nothing else: batches from the loader, the warm-up of
the learning rate and of the accumulation, forward and backward (:func:`train_step`), the merge of
the ranks' BatchNorm statistics, the optimiser step at accumulation boundaries
(:func:`optimizer_step`) and the loss sum, kept on the device. Whatever observes the loop is a
:class:`Hook`: the step timer (:class:`TimingHook`), the progress bar (:class:`ProgressBar`), the
vote on a stop signal (:class:`StopVote`) and the loader workers' CPU accounting
(:class:`LoaderCpu`). With no hooks it is the bare loop that ``benchmarks/gpu_check.py`` measures
the instruments against, so their cost is measured on the loop that trains, not on a copy.

Hooks are called in the order given. ``should_stop`` is asked of every hook at every optimiser-step
boundary (each is asked even when an earlier one said yes: a vote is a collective every rank must
join), and the loop stops when any says so.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from detscale import dist
from detscale.engine.optim import apply_warmup, lr_factor, warmup_accumulate, warmup_iterations
from detscale.engine.state import Parts, Progress
from detscale.engine.timing import RankTiming, StepTimer

if TYPE_CHECKING:
    from detscale.config import TrainConfig
    from detscale.engine.compiled import ForwardLoss
    from detscale.engine.semantics import TrainSemantics
    from detscale.engine.stopflag import StopFlag


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


def to_input(imgs: torch.Tensor, device: torch.device, channels_last: bool) -> torch.Tensor:
    """uint8 batch -> float [0, 1] on the device (uint8 over the bus: 4x less traffic)."""
    x = imgs.to(device, non_blocking=True).float().div_(255)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def train_step(
    forward_loss: ForwardLoss,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    targets: torch.Tensor,
    world_size: int,
    amp_dtype: torch.dtype | None,
    hook: Hook | None = None,
) -> torch.Tensor:
    """Forward and backward of one batch on this rank; returns the detached (box, cls, dfl) items.

    ``forward_loss(x, targets) -> (loss, items)``: the model and the loss, eager or compiled
    (:func:`detscale.engine.compiled.forward_loss`). Gradients accumulate in ``.grad``; the
    optimiser steps separately (:func:`optimizer_step`).
    ``hook`` (when given) hears the end of the forward (loss included) and of the backward.
    """
    with torch.autocast(x.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        loss, items = forward_loss(x, targets.to(x.device, non_blocking=True))
    if hook is not None:
        hook.forward_end()
    # DDP averages gradients over ranks: x world size makes the step's gradient the ranks' sum.
    scaler.scale(loss * world_size).backward()
    if hook is not None:
        hook.backward_end()
    return items.detach().float()


def optimizer_step(parts: Parts, clip_grad_norm: float) -> None:
    """Unscale, clip, step, zero the gradients; update the EMA."""
    parts.scaler.unscale_(parts.optimizer)
    if clip_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(parts.raw.parameters(), max_norm=clip_grad_norm)
    parts.scaler.step(parts.optimizer)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.ema.update(parts.raw)


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------


class Hook:
    """What a loop observer can hear; every method does nothing unless overridden."""

    def epoch_start(self, epoch: int, step: int, batches: int) -> None:
        """Before the first batch; ``step`` batches of the epoch are done already (a resume)."""

    def data_start(self) -> None:
        """Before the next batch is requested from the loader."""

    def data_end(self) -> None:
        """The batch has arrived."""

    def forward_end(self) -> None:
        """Forward and loss done."""

    def backward_end(self) -> None:
        """Backward done (gradients accumulated)."""

    def step_end(self, step: int, images: int, loss_sum: torch.Tensor) -> None:
        """Batch ``step`` (0-based) is trained, the optimiser stepped where it was a boundary.

        ``loss_sum``: the (box, cls, dfl) sums of this rank's batches so far, on the device.
        """

    def should_stop(self) -> bool:
        """Asked at each optimiser-step boundary; True stops the epoch there."""
        return False

    def epoch_end(self, step: int, images: int) -> None:
        """After the last batch trained (``step`` batches done, ``images`` of them in this call)."""


class Hooks(Hook):
    """Several hooks heard in order."""

    def __init__(self, hooks: Sequence[Hook]) -> None:
        self.hooks = tuple(hooks)

    def epoch_start(self, epoch: int, step: int, batches: int) -> None:
        for h in self.hooks:
            h.epoch_start(epoch, step, batches)

    def data_start(self) -> None:
        for h in self.hooks:
            h.data_start()

    def data_end(self) -> None:
        for h in self.hooks:
            h.data_end()

    def forward_end(self) -> None:
        for h in self.hooks:
            h.forward_end()

    def backward_end(self) -> None:
        for h in self.hooks:
            h.backward_end()

    def step_end(self, step: int, images: int, loss_sum: torch.Tensor) -> None:
        for h in self.hooks:
            h.step_end(step, images, loss_sum)

    def should_stop(self) -> bool:
        votes = [h.should_stop() for h in self.hooks]  # every hook asked: a vote is a collective
        return any(votes)

    def epoch_end(self, step: int, images: int) -> None:
        for h in self.hooks:
            h.epoch_end(step, images)


class TimingHook(Hook):
    """The step timer (:class:`~detscale.engine.timing.StepTimer`): data wait, step time, and with
    ``breakdown`` the phases, DDP's communication probe included."""

    def __init__(self, parts: Parts, device: torch.device, timing: RankTiming, breakdown: bool) -> None:
        self.parts, self.device, self.timing, self.breakdown = parts, device, timing, breakdown
        self.timer: StepTimer | None = None

    def epoch_start(self, epoch: int, step: int, batches: int) -> None:
        self.timer = StepTimer(self.device, self.timing, breakdown=self.breakdown)
        if self.parts.comm_probe is not None:
            self.parts.comm_probe.on_ready = self.timer.comm_ready
        self.timer.start_epoch()

    def data_start(self) -> None:
        self.timer.begin_data()

    def data_end(self) -> None:
        self.timer.end_data()

    def forward_end(self) -> None:
        self.timer.mark()

    def backward_end(self) -> None:
        self.timer.mark()

    def step_end(self, step: int, images: int, loss_sum: torch.Tensor) -> None:
        self.timer.end_step(images)

    def epoch_end(self, step: int, images: int) -> None:
        self.timer.flush()


class ProgressBar(Hook):
    """tqdm on rank 0, with the running loss read from the device every ``every_s`` seconds."""

    def __init__(self, epochs: int, world_size: int, global_normaliser: bool, every_s: float = 2.0) -> None:
        self.epochs, self.every_s = epochs, every_s
        # an estimate of the global loss from this rank's batches: the mean over ranks of local
        # normalisers, or the sum of the shares of a global one
        self.scale = world_size if global_normaliser else 1
        self.main = dist.is_main()
        self.bar: Any = None
        self.shown = 0.0
        self.batches = 0

    def epoch_start(self, epoch: int, step: int, batches: int) -> None:
        from tqdm import tqdm

        self.batches = batches
        self.bar = tqdm(total=batches, initial=step, desc=f"epoch {epoch + 1}/{self.epochs}", unit="batch",
                        disable=not self.main, leave=False, mininterval=1.0, file=sys.stderr)
        self.shown = time.perf_counter()

    def step_end(self, step: int, images: int, loss_sum: torch.Tensor) -> None:
        self.bar.update(1)
        done = step + 1
        if self.main and (time.perf_counter() - self.shown > self.every_s or done == self.batches):
            box, cls, dfl = (loss_sum * self.scale / done).tolist()
            self.bar.set_postfix_str(f"box={box:.3f} cls={cls:.3f} dfl={dfl:.3f}")
            self.shown = time.perf_counter()

    def epoch_end(self, step: int, images: int) -> None:
        self.bar.close()


class StopVote(Hook):
    """A stop signal on any rank stops every rank at the same optimiser step (an all-reduce)."""

    def __init__(self, stop: StopFlag, device: torch.device) -> None:
        self.stop, self.device = stop, device

    def should_stop(self) -> bool:
        return self.stop.agreed(self.device)


class LoaderCpu(Hook):
    """The loader workers' CPU seconds per image (the projection's contention roofline reads it)."""

    def __init__(self, loader: Any, timing: RankTiming) -> None:
        self.loader, self.timing = loader, timing
        self.start: float | None = None

    def epoch_start(self, epoch: int, step: int, batches: int) -> None:
        from detscale.data.loader import worker_cpu_seconds

        self.start = worker_cpu_seconds(self.loader)  # persistent workers: their CPU time so far

    def epoch_end(self, step: int, images: int) -> None:
        from detscale.data.loader import worker_cpu_seconds

        if (cpu := worker_cpu_seconds(self.loader)) is not None:
            # new workers (first epoch, after a resume) start from 0
            self.timing.loader_cpu_seconds += cpu - (self.start if self.start is not None and cpu >= self.start
                                                     else 0.0)
            self.timing.loader_images += images


class FirstStep(Hook):
    """Calls ``callback`` once, when the first batch of this process is trained (the compile watch
    reads what compiling it cost)."""

    def __init__(self, callback: Any) -> None:
        self.callback, self.done = callback, False

    def step_end(self, step: int, images: int, loss_sum: torch.Tensor) -> None:
        if not self.done:
            self.done = True
            self.callback()


def standard_hooks(loop: LoopState, timing: RankTiming, stop: StopFlag, extra: Sequence[Hook] = ()) -> Hooks:
    """What ``detscale train`` attaches: timing, the progress bar, the stop vote, loader CPU (and ``extra``)."""
    return Hooks([
        TimingHook(loop.parts, loop.device, timing, loop.train.step_breakdown),
        ProgressBar(loop.sem.epochs, loop.sem.world_size, loop.parts.loss_fn.global_normaliser),
        StopVote(stop, loop.device),
        LoaderCpu(loop.loader, timing),
        *extra,
    ])


# ---------------------------------------------------------------------------------------------
# The epoch
# ---------------------------------------------------------------------------------------------


@dataclass
class LoopState:
    """What the epoch loop trains with: the parts, the loader, the semantics, where it stands."""

    parts: Parts
    loader: Any
    sem: TrainSemantics
    train: TrainConfig
    device: torch.device
    progress: Progress
    target_buckets: dict[int, int] = field(default_factory=dict)  # batches per padded object count


@dataclass
class EpochResult:
    losses: list[float]  # mean (box, cls, dfl) over the epoch's batches, summed over ranks
    seconds: float
    stopped: bool  # a hook stopped the epoch (every rank agreed to, for the stop vote)
    step: int  # batches done in this epoch
    complete: bool  # all the epoch's batches were trained


def train_one_epoch(loop: LoopState, epoch: int, hooks: Hook | None = None) -> EpochResult:
    """Train the batches of ``epoch`` from ``loop.progress.step`` on, until the end or a hook stops it."""
    from detscale.data.loader import set_epoch

    parts, sem, tcfg, progress, device = loop.parts, loop.sem, loop.train, loop.progress, loop.device
    hook = hooks if hooks is not None else Hook()
    set_epoch(loop.loader, epoch, mosaic=epoch < sem.epochs - sem.close_mosaic)
    parts.model.train()
    nb = len(loop.loader)
    # The warm-up counts BatchNorm batches (one rank's batch; with SyncBN the global batch): the
    # learning rate of every optimiser step is then that of one rank accumulating N batches, so
    # N ranks and 1 rank warm up alike and a run can change its rank count on the way.
    units = sem.batchnorm_batches
    warmup_iters = warmup_iterations(tcfg.warmup_epochs, nb * units, sem.epochs)
    factor = lr_factor(sem.lr_schedule, sem.epochs, tcfg.lrf)(epoch)
    batches = iter(loop.loader)
    for _ in range(progress.step):  # mid-epoch resume: the same batches, already trained on
        next(batches)
    # on the device: no copy to the host per step (hooks read it when they need to)
    loss_sum = torch.tensor(progress.loss_sum, dtype=torch.float64, device=device)
    hook.epoch_start(epoch, progress.step, nb)
    t_epoch = time.perf_counter() - progress.epoch_seconds_done
    i, stopped, images = progress.step, False, 0
    last_step = i - 1  # batch of the last optimiser step (a resumed epoch starts at a step boundary)
    while i < nb:
        hook.data_start()
        imgs, targets, _metas = next(batches)
        hook.data_end()
        if targets.dim() == 3:  # padded to a bucket: one compiled graph per bucket
            loop.target_buckets[targets.shape[1]] = loop.target_buckets.get(targets.shape[1], 0) + 1
        first = (epoch * nb + i) * units  # this batch holds BatchNorm batches first .. first + units - 1
        accumulate = sem.accumulate
        if first < warmup_iters:
            iteration = min(first + units - 1, warmup_iters - 1)
            apply_warmup(parts.optimizer, iteration, warmup_iters, factor, tcfg.warmup_bias_lr,
                         tcfg.warmup_momentum, tcfg.momentum)
            if sem.warmup_accumulate == "ramp":  # in whole batches of the ranks present
                accumulate = max(1, round(warmup_accumulate(iteration, warmup_iters, sem.accumulate * units) / units))
        boundary = i - last_step >= accumulate or i == nb - 1
        # Between optimiser steps the gradient all-reduce is skipped: DDP reduces the sum once.
        sync = contextlib.nullcontext() if boundary or sem.world_size == 1 else parts.model.no_sync()
        before = parts.buffers.snapshot() if parts.buffers is not None else None
        with sync:
            items = train_step(parts.forward_loss, parts.scaler, to_input(imgs, device, sem.channels_last),
                               targets, sem.world_size, parts.amp_dtype, hook)
        if parts.buffers is not None:
            parts.buffers.merge(before)
        if boundary:
            optimizer_step(parts, tcfg.clip_grad_norm)
            last_step = i
        images += len(imgs)
        loss_sum += items
        hook.step_end(i, len(imgs), loss_sum)
        i += 1
        if boundary and hook.should_stop():
            stopped = True
            break
    hook.epoch_end(i, images)
    seconds = time.perf_counter() - t_epoch
    progress.step, progress.loss_sum, progress.epoch_seconds_done = i, loss_sum.cpu().tolist(), seconds
    # Items are this rank's batch loss (local normaliser: the mean over ranks is the global value)
    # or its share of the global-batch loss (global normaliser: the sum is). The sum travels on
    # the device: NCCL has no CPU tensors (gloo takes either).
    shares = parts.loss_fn.global_normaliser
    mean = dist.all_reduce_sum(loss_sum.clone()).cpu() / (max(i, 1) * (1 if shares else sem.world_size))
    return EpochResult(mean.tolist(), seconds, stopped, i, complete=i == nb)
