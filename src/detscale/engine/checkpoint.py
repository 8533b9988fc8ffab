"""Checkpoints: building one from a rank's state, writing ``last.pt``, finding the one to resume
from, restoring it, and the RNG states that make resume exact.

Checkpoints are written by :func:`detscale.files.save_torch` (atomic: the old file or the new
one, never half of one) and read by :func:`detscale.files.load_torch` (``weights_only=True``: a
file that would run code when unpickled is refused). They hold tensors and plain Python values
only; the RNG states are stored as such (the previous format's numpy arrays still load).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from detscale import dist
from detscale.engine.state import Parts, Progress, RunPaths
from detscale.engine.timing import RankTiming
from detscale.errors import UserError
from detscale.files import UnsafeFileError, load_torch, refresh_resume_stash, save_torch

if TYPE_CHECKING:
    from detscale.config import RunPoint
    from detscale.engine.semantics import TrainSemantics

log = logging.getLogger(__name__)


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not belong to this run."""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU; a clear error when the file is missing or damaged."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; train the run first (or leave out --resume)")
    try:
        ckpt = load_torch(path)
    except UnsafeFileError:
        raise
    except Exception as exc:  # torch raises several types for a damaged zip
        raise CheckpointError(
            f"checkpoint {path} is damaged and cannot be read ({type(exc).__name__}: {exc}). A run cannot resume "
            f"from it: delete {path} (and the run folder's resume-stash/, which holds the same file, if there is "
            "one) and run the same command to train the run from the start; nothing else was deleted"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a detscale checkpoint (no 'model' key)")
    return ckpt


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: Python, NumPy, torch CPU and (when present) CUDA."""
    return {
        "python": random.getstate(),
        # plain values (weights_only=True reads no numpy arrays): (name, keys as a tensor, pos, gauss)
        "numpy": _numpy_state_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _numpy_state_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dict(parts: Parts, progress: Progress, point: RunPoint, nc: int, digest: str,
                    sem: TrainSemantics, timing: RankTiming) -> dict[str, Any] | None:
    """The checkpoint of the run now (collective: gathers every rank's RNG and timing; ``None`` off rank 0)."""
    rng = dist.all_gather_object(capture_rng())
    timings = dist.all_gather_object(timing.state_dict())
    if not dist.is_main():
        return None
    return {
        "model": parts.raw.state_dict(),
        "ema": parts.ema.state_dict(),
        "ema_updates": parts.ema.updates,
        "optimizer": parts.optimizer.state_dict(),
        "scaler": parts.scaler.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "epoch": progress.epoch,
        "step": progress.step,
        "progress": asdict(progress),
        "rng": rng,
        "timing": timings,
        "model_name": point.model,
        "nc": nc,
        "imgsz": point.imgsz,
        "config_digest": digest,
        "world_size": sem.world_size,
        "semantics": sem.to_dict(),
    }


def restore(parts: Parts, ckpt: dict[str, Any], rank: int, timing: RankTiming, sem: TrainSemantics) -> Progress:
    """Load a checkpoint into this rank's parts and RNG; returns where to continue.

    A checkpoint of another rank count (an elastic continuation, :func:`continue_on`) continues at
    the same image of the same epoch; the RNG states are derived afresh for each new rank (the data
    order and augmentation do not draw from them), and the finished segment's timings are kept
    apart in ``progress.segments``: a new segment's throughput starts from zero.
    """
    parts.raw.load_state_dict(ckpt["model"])
    parts.ema.load_state_dict(ckpt["ema"], ckpt["ema_updates"])
    parts.optimizer.load_state_dict(ckpt["optimizer"])
    parts.scaler.load_state_dict(ckpt["scaler"])
    parts.scheduler.load_state_dict(ckpt["scheduler"])
    progress = Progress(**ckpt["progress"])
    if ckpt["world_size"] != sem.world_size:
        return _continue_elsewhere(ckpt, progress, rank, sem)
    restore_rng(ckpt["rng"][rank])
    saved = RankTiming.from_state(ckpt["timing"][rank])
    for name, value in asdict(saved).items():
        setattr(timing, name, value)
    return progress


def _continue_elsewhere(ckpt: dict[str, Any], progress: Progress, rank: int, sem: TrainSemantics) -> Progress:
    from detscale.engine.build import seed_everything
    from detscale.engine.timing import segment_summary

    before = ckpt["semantics"]
    images = progress.step * before["global_batch"]  # trained in the current epoch
    if images % sem.global_batch:
        raise CheckpointError(
            f"the checkpoint stopped {progress.step} batches of {before['global_batch']} images into epoch "
            f"{progress.epoch + 1} ({images} images), which is not a whole number of batches of "
            f"{sem.global_batch} on {sem.world_size} ranks; resume it on {before['world_size']} ranks to the end "
            "of the epoch first, then continue elsewhere")
    step = images // sem.global_batch
    if progress.step:  # this rank's share of the epoch's loss so far: rank 0's, per batch (an estimate)
        progress.loss_sum = [v * step / progress.step for v in progress.loss_sum]
    progress.segments = [*progress.segments, segment_summary(ckpt["timing"], before, progress.segment_start,
                                                             [progress.epoch, progress.step])]
    progress.step, progress.segment_start = step, [progress.epoch, step]
    seed_everything(int(np.random.SeedSequence([sem.seed, rank, progress.epoch, step, 0xE1A5]).generate_state(1)[0]))
    log.info("continuing a run of %d rank(s) on %d: batch %d/rank, global %d, accumulate %d (%d images per "
             "optimiser step, as before)", before["world_size"], sem.world_size, sem.batch_per_rank,
             sem.global_batch, sem.accumulate, sem.images_per_optimizer_step)
    return progress


def find_resume_checkpoint(paths: RunPaths, resume: bool, digest: str, world_size: int,
                           elastic: bool = False) -> dict[str, Any] | None:
    """``last.pt`` to continue from, when resuming (asked, or a torchrun restart) and it exists.

    ``elastic``: a checkpoint of another rank count may continue on ``world_size`` ranks.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if not (resume or restart) or not paths.last.is_file():
        if resume and not paths.last.is_file():
            log.info("--resume: no %s yet, starting the run from the beginning", paths.last)
        return None
    ckpt = load_checkpoint(paths.last)
    if ckpt.get("config_digest") != digest:
        raise CheckpointError(
            f"{paths.last} was written for another configuration (digest {ckpt.get('config_digest')}, now "
            f"{digest}); delete {paths.out} to start this run again, or restore the original config"
        )
    if ckpt.get("world_size") != world_size and not elastic:
        raise CheckpointError(
            f"{paths.last} was written by {ckpt.get('world_size')} ranks, not {world_size}; to continue it on "
            f"{world_size} rank(s) add --elastic to `train` (the images per optimiser step, the schedule and the "
            "data order stay; the throughput of each rank count is reported apart)")
    # 1-based, as the "stopped by a signal at epoch E step S" warning that precedes a resume prints it.
    log.info("resuming from %s at epoch %d step %d%s", paths.last, ckpt["epoch"] + 1, ckpt["step"],
             " (torchrun restart)" if restart else "")
    return ckpt


def save_last(save: dict[str, Any], paths: RunPaths, digest: str) -> None:
    """Write ``last.pt`` atomically and bring the launcher's resume stash up to it (when there is one)."""
    save_torch(save, paths.last)
    refresh_resume_stash(paths.out, digest)
