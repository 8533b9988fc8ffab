"""What one rank trains with and where its run stands: the state the loop, the checkpoint and the
hooks share, instead of long parameter lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from detscale.engine.buffers import SequentialBufferMerge
from detscale.engine.compiled import ForwardLoss, forward_loss
from detscale.engine.ema import ModelEMA

if TYPE_CHECKING:
    from detscale.config import ExperimentConfig, RunPoint
    from detscale.dist import DistInfo
    from detscale.engine.ddp import CommProbe
    from detscale.engine.semantics import TrainSemantics
    from detscale.engine.stopflag import StopFlag
    from detscale.engine.timing import RankTiming


@dataclass(frozen=True)
class RunPaths:
    out: Path

    @property
    def weights(self) -> Path:
        return self.out / "weights"

    @property
    def last(self) -> Path:
        return self.weights / "last.pt"

    @property
    def best(self) -> Path:
        return self.weights / "best.pt"

    @property
    def metrics(self) -> Path:
        return self.out / "metrics.jsonl"

    def log_file(self, rank: int) -> Path:
        return self.out / "logs" / f"rank{rank}.log"


@dataclass
class Parts:
    """The objects one rank trains with (``model`` is the DDP wrapper, ``raw`` the module inside)."""

    model: nn.Module
    raw: nn.Module
    ema: ModelEMA
    optimizer: torch.optim.SGD
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    loss_fn: Any
    amp_dtype: torch.dtype | None
    buffers: SequentialBufferMerge | None  # N ranks without SyncBN: BatchNorm statistics merged per batch
    comm_probe: CommProbe | None = None  # N ranks with the step breakdown: tells the timer when buckets go
    forward_loss: ForwardLoss | None = None  # (x, targets) -> (loss, items), eager or compiled (train.compile)

    def __post_init__(self) -> None:
        if self.forward_loss is None:
            self.forward_loss = forward_loss(self.model, self.loss_fn)


@dataclass
class Progress:
    """Where the run is: completed epochs, batches done in the current epoch, best mAP so far."""

    epoch: int = 0
    step: int = 0
    best_map: float | None = None
    epoch_seconds_done: float = 0.0  # of the current, unfinished epoch (mid-epoch resume)
    loss_sum: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    # An elastic run (continued on another rank count): the finished segments' timings, and the
    # (epoch, batch) where the current rank count took over.
    segments: list[dict[str, Any]] = field(default_factory=list)
    segment_start: list[int] = field(default_factory=lambda: [0, 0])


@dataclass
class RunState:
    """One rank's run as the epoch loop sees it: what it is (config, grid point, semantics, digest),
    what it trains with (parts, loaders), where it stands (progress, timing, the stop flag) and where
    its files go (paths)."""

    cfg: ExperimentConfig
    point: RunPoint
    sem: TrainSemantics
    info: DistInfo
    digest: str
    nc: int
    paths: RunPaths
    parts: Parts
    progress: Progress
    timing: RankTiming
    stop: StopFlag
    train_loader: Any
    val_loader: Any | None
    gt_json: Path
