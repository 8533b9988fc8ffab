"""The training loop every rank runs: one code path for 1 to N processes, CPU or GPU.

Reading order: :func:`train` (set up, loop over epochs, finish) ->
:func:`~detscale.engine.loop.train_one_epoch` (loop over batches, watched by hooks: timing, the
progress bar, the stop vote) -> :func:`validate` (optional, every ``val_interval`` epochs, on the
EMA model).

Semantics (stated in every run's ``config.yaml``, see :mod:`detscale.engine.semantics`):

- The loss is multiplied by ``world_size`` before ``backward()`` to undo DDP's gradient
  averaging: the step's gradient is the sum of the ranks' (see :mod:`detscale.loss` for the
  normaliser: each rank's own, or with SyncBN the global one, so that N ranks x batch b then
  compute the gradient of 1 rank x batch N*b).
- ``accumulate`` batches make one optimiser step; accumulation restarts every epoch (the last
  batches of an epoch make a step of their own), so epoch boundaries are clean resume points.
- Without SyncBN, rank ``r`` trains the ``r``-th slice of every global batch, normalises its loss
  by its own targets, and the ranks' BatchNorm running statistics are merged after every batch
  as one process would have updated them batch after batch (:mod:`detscale.engine.buffers`; DDP's
  per-forward buffer broadcast is off). So N ranks x batch b train exactly as 1 rank that
  accumulates N batches of b (tested in float64), and every rank's weights, buffers and EMA are equal.

Checkpoints and resume: rank 0 writes ``weights/last.pt`` atomically after every epoch (and
``best.pt`` on the best validation mAP@0.5:0.95), holding every rank's RNG states and timings.
``--resume`` (or a torchrun restart, ``TORCHELASTIC_RESTART_COUNT > 0``) continues from
``last.pt`` when it exists and was written for the same config digest: the run ends with the
same weights as one that never stopped (the data order and augmentation are functions of
(seed, epoch, index), and a mid-epoch resume re-reads and skips the batches already trained).

Preemption: SIGTERM (or SIGINT) sets a flag; at the next optimiser-step boundary the ranks agree
on it with an all-reduce (so they all stop at the same step), rank 0 writes ``last.pt`` with the
step reached in the epoch, and every rank exits with :data:`~detscale.errors.EXIT_PREEMPTED` (75).
Rerunning the same command resumes mid-epoch exactly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detscale import config, dist, layout
from detscale.config import ExperimentConfig, RunPoint
from detscale.engine.build import build_loaders, build_parts
from detscale.engine.checkpoint import CheckpointError, checkpoint_dict, find_resume_checkpoint, restore, save_last
from detscale.engine.compiled import CompileWatch
from detscale.engine.loop import FirstStep, LoopState, standard_hooks, train_one_epoch
from detscale.engine.mfu import measure_peak, mfu_fields, train_gflops_per_image
from detscale.engine.semantics import TrainSemantics, config_digest, derive_semantics
from detscale.engine.state import Progress, RunPaths, RunState
from detscale.engine.stopflag import StopFlag
from detscale.engine.timing import RankTiming, peak_memory, segment_summary, timing_report
from detscale.errors import EXIT_PREEMPTED
from detscale.files import save_torch, write_json

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Inputs and the pieces of one run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainRequest:
    """What ``detscale train`` was asked to do."""

    config_path: Path
    run_id: str
    out_dir: Path
    resume: bool = False
    data_yaml: Path | None = None
    cache_dir: Path | None = None
    elastic: bool = False  # continue last.pt on another rank count (engine.semantics.continue_on)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def validate(
    eval_model: nn.Module, val_loader: Any, device: torch.device, eval_cfg: Any, gt_json: Path
) -> dict[str, Any]:
    """COCO metrics of ``eval_model`` on the validation split; every rank predicts its shard.

    A collective (every rank must call it); every rank gets the metrics.
    """
    from detscale.metrics.coco import compute_metrics
    from detscale.metrics.predict import gather_predictions, predict
    from detscale.model import fuse_for_inference

    local = predict(fuse_for_inference(eval_model).to(device), val_loader, device, eval_cfg)
    merged = gather_predictions(local)
    metrics = compute_metrics(gt_json, merged) if merged is not None else None
    return dist.broadcast_object(metrics)


# ---------------------------------------------------------------------------------------------
# Run files and logging
# ---------------------------------------------------------------------------------------------


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def trim_metrics(path: Path, completed_epochs: int) -> None:
    """Keep the rows of epochs a resumed run will not redo (a crash may have left a row past last.pt)."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if json.loads(r).get("epoch", 0) < completed_epochs]
    path.write_text("".join(r + "\n" for r in kept))


@contextlib.contextmanager
def rank_logging(paths: RunPaths, rank: int) -> Iterator[None]:
    """A log file per rank; console output from rank 0 only (other ranks' console: warnings and up)."""
    paths.log_file(rank).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(paths.log_file(rank), mode="a")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    quieted = []
    if rank != 0:
        for h in root.handlers:
            if h is not handler and isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                quieted.append((h, h.level))
                h.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for h, level in quieted:
            h.setLevel(level)
        root.removeHandler(handler)
        handler.close()


def default_data_yaml(cfg: ExperimentConfig) -> Path:
    """The clean view written by validation (results/data/NAME/data.yaml), else the dataset's own."""
    clean = layout.clean_data_yaml(cfg.dataset.name)
    return clean if clean.is_file() else cfg.dataset.resolved_data_yaml()


def summary_text(point: RunPoint, sem: TrainSemantics, report: dict[str, Any], best_map: float | None) -> str:
    mem = max(report["peak_mem_bytes_per_rank"]) / 2**20
    per_rank = ", ".join(f"{v:.1f}" for v in report["images_per_s_per_rank"])
    lines = [
        f"run {point.run_id}: {sem.epochs} epochs on {sem.world_size} {report['device']} rank(s) ({report['backend']})",
        f"  batch {sem.batch_per_rank}/rank, global {sem.global_batch}, accumulate {sem.accumulate}, "
        f"{sem.optimizer} lr0 {sem.lr0:g} ({sem.lr_scaling}), precision {sem.precision}",
        f"  throughput {report['images_per_s']:.1f} img/s ({per_rank} per rank), "
        f"data wait {100 * report['data_wait_share']:.1f}% of step time",
        f"  train {report['train_seconds']:.1f} s, validation {report['val_seconds']:.1f} s, "
        f"peak memory {mem:.0f} MiB/rank ({report['mem_kind']})",
    ]
    compiled = (report.get("compile_per_rank") or [{}])[0]
    if compiled.get("compile", "off") != "off":
        first = compiled.get("first_step_seconds")
        lines.append(f"  compiled ({compiled['compile']}): {compiled['graphs']} graph(s), {compiled['graph_breaks']} "
                     f"graph break(s), {compiled['recompiles_after_first_step']} recompilation(s) after the first "
                     f"step" + (f", which took {first:.1f} s" if first is not None else ""))
    if best_map is not None:
        lines.append(f"  best validation mAP@0.5:0.95 {best_map:.4f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def train(req: TrainRequest) -> int:
    """Train one run on this rank (every rank calls it); returns the process exit code."""
    cfg = config.load(req.config_path)
    point = cfg.run(req.run_id)
    threads = int(os.environ.get("OMP_NUM_THREADS") or cfg.train.cpu_threads_per_rank)
    dist.join_attempt_group(cfg.train.timeout_s)
    with dist.process_group(cfg.train.timeout_s, cpu_threads=threads) as info:
        paths = RunPaths(Path(req.out_dir))
        with rank_logging(paths, info.rank):
            return _train(req, cfg, point, info, paths, threads)


def _train(req: TrainRequest, cfg: ExperimentConfig, point: RunPoint, info: dist.DistInfo,
           paths: RunPaths, threads: int) -> int:
    from detscale.data.formats import load_spec
    from detscale.engine.envinfo import environment

    digest = config_digest(cfg, point)
    ckpt = find_resume_checkpoint(paths, req.resume, digest, info.world_size, req.elastic)
    if req.elastic and ckpt is None and info.world_size != point.gpus:
        raise CheckpointError(
            f"--elastic continues a run on another rank count, but {paths.last} does not exist (add --resume, or "
            f"start run {point.run_id} on the {point.gpus} rank(s) of its grid point)")
    sem = derive_semantics(cfg, point, info.world_size, info.device.type, elastic=req.elastic)
    data_yaml = Path(req.data_yaml) if req.data_yaml else default_data_yaml(cfg)
    cache_dir = Path(req.cache_dir) if req.cache_dir else layout.cache_dir(cfg.dataset.name)
    spec = load_spec(data_yaml, splits=("val",) if cfg.train.val_interval > 0 else ())
    if info.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    log.info("run %s: %d rank(s) on %s (%s), batch %d/rank, global %d, accumulate %d, %s lr0 %g, "
             "precision %s", point.run_id, info.world_size, info.device.type, info.backend, sem.batch_per_rank,
             sem.global_batch, sem.accumulate, sem.optimizer, sem.lr0, sem.precision)

    parts = build_parts(point, spec.nc, sem, cfg.train, info)
    timing = RankTiming(warmup_steps=cfg.train.timing_warmup_steps)
    progress = restore(parts, ckpt, info.rank, timing, sem) if ckpt is not None else Progress()
    del ckpt
    train_loader, val_loader = build_loaders(point, cfg, data_yaml, cache_dir, sem, info, cfg.train.val_interval > 0)

    gt_json = paths.out / "val_gt.json"
    if info.is_main:
        paths.weights.mkdir(parents=True, exist_ok=True)
        extra = {"run": {"run_id": point.run_id, **asdict(point)}, "semantics": sem.to_dict(),
                 "data_yaml": str(data_yaml), "cache_dir": str(cache_dir), "config_digest": digest}
        config.save(cfg, paths.out / "config.yaml", extra=extra)
        env = environment(digest, threads if info.device.type == "cpu" else None)
        env["world_size"] = info.world_size
        env["rank_hosts"] = None  # filled below, after the gather
        if progress.epoch == 0 and progress.step == 0:
            paths.metrics.unlink(missing_ok=True)
        else:
            trim_metrics(paths.metrics, progress.epoch)
        if val_loader is not None:
            from detscale.metrics.coco import ensure_coco_gt

            ensure_coco_gt(spec, "val", gt_json)
    hosts = dist.all_gather_object(os.uname().nodename)
    if info.is_main:
        env["rank_hosts"] = hosts
        write_json(env, paths.out / "env.json", indent=2)

    # Every rank measures its device's peak at once (ranks sharing cores or a bus measure what they share).
    peak = measure_peak(info.device, sem.precision)
    gflops = train_gflops_per_image(parts.raw, point.imgsz) if info.is_main else 0.0
    # Wall-clock span of this attempt, so the report can check whether timed runs overlapped.
    started_at = time.time()
    stop = StopFlag()
    stop.install()
    watch = CompileWatch(cfg.train.compile, cfg.train.compile_mode)
    watch.start()
    try:
        stopped, buckets = _epochs(RunState(cfg, point, sem, info, digest, spec.nc, paths, parts, progress, timing,
                                            stop, train_loader, val_loader, gt_json), watch)
    finally:
        stop.uninstall()
    if stopped:
        log.warning("stopped by a signal at epoch %d step %d; last.pt saved, exit %d (rerun to resume)",
                    progress.epoch + 1, progress.step, EXIT_PREEMPTED)
        return EXIT_PREEMPTED

    memory = dist.all_gather_object(peak_memory(info.device))
    timings = dist.all_gather_object(timing.state_dict())
    peaks = dist.all_gather_object(peak)
    compiled = dist.all_gather_object({**watch.report(), "target_buckets": buckets})
    if info.is_main:
        extra = {"threads_per_rank": threads if info.device.type == "cpu" else None, "precision": sem.precision,
                 "accumulate": sem.accumulate, "steps_per_epoch": len(train_loader), "epochs": sem.epochs,
                 "workers_per_rank": cfg.train.workers, "cache": point.cache,
                 "started_at": started_at, "finished_at": time.time(),
                 # per rank: what torch.compile did, and batches per padded object count (this attempt)
                 "compile_per_rank": compiled}
        report = timing_report(timings, memory, info.device.type, info.backend, sem.batch_per_rank,
                               sem.global_batch, extra)
        report.update(mfu_fields(gflops, report["images_per_s"], peaks, sem.precision, env.get("gpu_model")))
        if progress.segments:  # an elastic run: each rank count's throughput apart, this one's last
            report["segments"] = [*progress.segments, segment_summary(
                timings, sem.to_dict(), progress.segment_start, [progress.epoch, progress.step])]
            report["elastic"] = True
        if report["measured_steps"] == 0:
            log.warning("no steady-state steps measured: every epoch has at most %d steps, all warm-up "
                        "(train.timing_warmup_steps); throughput is reported as 0", cfg.train.timing_warmup_steps)
        write_json(report, paths.out / "timing.json", indent=2)
        log.info("%s", summary_text(point, sem, report, progress.best_map))
    dist.barrier()
    return 0


def _epochs(run: RunState, watch: CompileWatch) -> tuple[bool, dict[int, int]]:
    """The epoch loop; (True when stopped early by a signal (last.pt written), batches per target bucket)."""
    parts, progress, sem, cfg, paths, timing = run.parts, run.progress, run.sem, run.cfg, run.paths, run.timing

    def checkpoint() -> dict[str, Any] | None:
        return checkpoint_dict(parts, progress, run.point, run.nc, run.digest, sem, timing)

    loop = LoopState(parts, run.train_loader, sem, cfg.train, run.info.device, progress)
    hooks = standard_hooks(loop, timing, run.stop, [FirstStep(watch.first_step_done)])
    while progress.epoch < sem.epochs:
        epoch = progress.epoch
        result = train_one_epoch(loop, epoch, hooks)
        if not result.complete:
            save = checkpoint()
            if save is not None:
                save_last(save, paths, run.digest)
            dist.barrier()
            return True, loop.target_buckets
        timing.epoch_seconds.append(result.seconds)
        timing.train_seconds += result.seconds
        lrs = [g["lr"] for g in parts.optimizer.param_groups]  # the rates this epoch ended with
        parts.scheduler.step()
        row: dict[str, Any] = {
            "epoch": epoch, "epochs": sem.epochs,
            "loss_box": result.losses[0], "loss_cls": result.losses[1], "loss_dfl": result.losses[2],
            "lr": lrs,
            "epoch_seconds": result.seconds,
            "world_size": sem.world_size,
            "images_per_s": sem.global_batch * result.step / result.seconds if result.seconds > 0 else None,
            # whether mosaics were drawn this epoch (probability > 0, before close_mosaic)
            "mosaic": cfg.augment.mosaic > 0 and epoch < sem.epochs - sem.close_mosaic,
        }
        improved = False
        if run.val_loader is not None and ((epoch + 1) % cfg.train.val_interval == 0 or epoch + 1 == sem.epochs):
            t0 = time.perf_counter()
            metrics = validate(parts.ema.module, run.val_loader, run.info.device, cfg.eval, run.gt_json)
            seconds = time.perf_counter() - t0
            timing.val_seconds += seconds
            row.update({"val_seconds": seconds, "map50_95": metrics["map50_95"], "map50": metrics["map50"]})
            improved = progress.best_map is None or (metrics["map50_95"] or 0.0) > progress.best_map
            if improved:
                progress.best_map = metrics["map50_95"] or 0.0
        progress.epoch, progress.step = epoch + 1, 0
        progress.epoch_seconds_done, progress.loss_sum = 0.0, [0.0, 0.0, 0.0]
        save = checkpoint()
        if save is not None:
            append_metrics(paths.metrics, row)
            save_last(save, paths, run.digest)
            if improved:
                save_torch(save, paths.best)
            log.info("epoch %d/%d: loss box %.4f cls %.4f dfl %.4f, %.1f s%s", epoch + 1, sem.epochs,
                     *result.losses, result.seconds,
                     f", mAP@0.5:0.95 {row['map50_95']:.4f}" if "map50_95" in row else "")
        if result.stopped:
            dist.barrier()
            return True, loop.target_buckets
    return False, loop.target_buckets
