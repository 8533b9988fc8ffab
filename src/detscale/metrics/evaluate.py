"""Evaluation of a model on a split: distributed inference, gathering, COCO metrics, files.

:func:`evaluate_model` is what ``detscale evaluate`` and the trainer's validation call, on every
rank; :func:`load_checkpoint_model` turns a run's ``last.pt`` into the fused EMA model and
refuses a checkpoint that does not belong to the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detscale import dist
from detscale.errors import UserError
from detscale.files import UnsafeFileError, load_torch, write_json
from detscale.metrics.coco import compute_metrics, ensure_coco_gt, original_ids
from detscale.metrics.predict import EvalSettings, gather_image_ids, gather_predictions, predict_with_ids

log = logging.getLogger(__name__)

REQUIRED_CHECKPOINT_KEYS = ("ema", "model_name", "nc")


class CheckpointError(UserError):
    """A weights file that cannot be evaluated as the run it is given for."""


def load_checkpoint(weights: str | Path) -> dict[str, Any]:
    """Read a training checkpoint (on the CPU) and check that it has what evaluation needs."""
    path = Path(weights)
    if not path.is_file():
        raise CheckpointError(
            f"weights file {path} does not exist; train the run first (results/runs/RUN/weights/last.pt)"
        )
    try:
        ckpt = load_torch(path)
    except UnsafeFileError:
        raise
    except Exception as exc:  # truncated file, not a torch file, ...
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc})") from None
    missing = [k for k in REQUIRED_CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(
            f"{path} is not a detscale training checkpoint: it lacks {', '.join(missing)}; pass the "
            "weights/last.pt (or best.pt) that `detscale train` wrote"
        )
    return ckpt


def check_checkpoint(ckpt: dict[str, Any], weights: str | Path, model: str, nc: int, imgsz: int | None) -> None:
    """Refuse a checkpoint of another model, number of classes or image size than expected."""
    problems = []
    if ckpt["model_name"] != model:
        problems.append(f"model '{ckpt['model_name']}' (expected '{model}')")
    if int(ckpt["nc"]) != nc:
        problems.append(f"{ckpt['nc']} classes (expected {nc}, the classes of the dataset)")
    if imgsz is not None and ckpt.get("imgsz") is not None and int(ckpt["imgsz"]) != imgsz:
        problems.append(f"image size {ckpt['imgsz']} (expected {imgsz})")
    if problems:
        raise CheckpointError(
            f"{weights} does not belong to this run: it holds {'; '.join(problems)}. Pass the weights of the "
            "run given by --run (results/runs/RUN/weights/last.pt), or the --config/--run/--data it was trained with"
        )


def load_checkpoint_model(
    weights: str | Path, model: str, nc: int, imgsz: int | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """The checkpoint's EMA weights in a freshly built ``model``, fused for inference, in eval mode."""
    from detscale.model import build_model, fuse_for_inference

    ckpt = load_checkpoint(weights)
    check_checkpoint(ckpt, weights, model, nc, imgsz)
    ema = ckpt["ema"]
    state = ema.state_dict() if isinstance(ema, nn.Module) else ema
    net = build_model(model, nc)
    try:
        net.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{weights}: the EMA weights do not fit a freshly built {model} with {nc} classes ({str(exc)[:300]}); "
            "was it written by another version of detscale? Retrain the run"
        ) from None
    net = fuse_for_inference(net)
    return net.to(device).eval()


def build_eval_loader(
    data_yaml: str | Path, split: str, imgsz: int, batch: int, workers: int,
    cache_mode: str = "none", cache_dir: str | Path | None = None,
) -> Iterable:
    """This rank's shard of ``split``, letterboxed to ``imgsz`` (no augmentation), in batches of ``batch``."""
    from detscale.data.dataset import build_dataset
    from detscale.data.loader import build_val_loader

    dataset = build_dataset(data_yaml, split, imgsz, cache_mode, cache_dir, None)
    return build_val_loader(dataset, batch, dist.get_rank(), dist.get_world_size(), workers)


def evaluate_model(
    model: nn.Module,
    data_yaml: str | Path,
    split: str,
    imgsz: int,
    eval_cfg: EvalSettings,
    gt_json: str | Path,
    out_dir: str | Path | None = None,
    *,
    workers: int = 2,
    cache_mode: str = "none",
    cache_dir: str | Path | None = None,
) -> dict[str, Any]:
    """COCO metrics of ``model`` on ``split``; call it on every rank (it has collectives).

    Each rank predicts its shard with ``eval_cfg.batch`` images per batch; rank 0 gathers the
    detections, builds the COCO ground truth ``gt_json`` if it is missing or stale, computes
    the metrics and, when ``out_dir`` is given, writes ``predictions.json`` and ``eval.json``
    there atomically. The metrics dict (the ``eval.json`` keys; ``predictions`` is ``None``
    without ``out_dir``) is broadcast, so **every rank returns the same dict**.

    ``model`` is used as given (in eval mode; pass it fused for speed) on the device of its
    parameters. Images are decoded from the files (``cache_mode="none"``) unless a cache built
    by ``detscale cache`` for this split and ``imgsz`` is named with ``cache_mode``/``cache_dir``.
    If rank 0 fails (e.g. shards that do not cover the split), every rank raises.
    """
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    loader = build_eval_loader(data_yaml, split, imgsz, eval_cfg.batch, workers, cache_mode, cache_dir)
    local, seen = predict_with_ids(model, loader, device, eval_cfg)
    detections = gather_predictions(local)
    image_ids = gather_image_ids(seen)
    metrics: dict[str, Any] | None = None
    failure: BaseException | None = None
    if dist.is_main():
        assert detections is not None and image_ids is not None
        try:
            metrics = _metrics_on_main(detections, image_ids, data_yaml, split, gt_json, out_dir)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
            failure = exc
        log.info("evaluation took %.1f s", time.perf_counter() - t0)
    # Rank 0's result or its failure: the other ranks must not wait in a collective for a dead rank 0.
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    metrics, error = dist.broadcast_object((metrics, error))
    if failure is not None:
        raise failure
    if error is not None:
        raise RuntimeError(f"evaluation failed on rank 0: {error}")
    assert metrics is not None
    return metrics


def _metrics_on_main(
    detections: list[dict[str, Any]],
    image_ids: list[int],
    data_yaml: str | Path,
    split: str,
    gt_json: str | Path,
    out_dir: str | Path | None,
) -> dict[str, Any]:
    """Rank 0's part of :func:`evaluate_model`: check the shards, ground truth, metrics, files."""
    from detscale.data.formats import load_spec

    spec = load_spec(data_yaml, splits=(split,))
    n = len(spec.splits[split])
    if sorted(image_ids) != list(range(n)):
        # a loader that pads or drops images would bias the metrics silently
        raise RuntimeError(
            f"the evaluation shards covered {len(image_ids)} images ({len(set(image_ids))} distinct) "
            f"but the split has {n}; build_val_loader must give disjoint shards that cover the split"
        )
    gt_json = ensure_coco_gt(spec, split, gt_json)
    predictions_json = None
    written, ids = original_ids(spec, split, detections)
    if out_dir is not None:
        predictions_json = write_json(written, Path(out_dir) / "predictions.json")
    metrics = compute_metrics(gt_json, detections)
    metrics["ground_truth"] = str(gt_json)
    metrics["predictions"] = None if predictions_json is None else str(predictions_json)
    metrics["prediction_ids"] = ids or "the ground truth's (image = index in the split, category = class id)"
    if out_dir is not None:
        write_json(metrics, Path(out_dir) / "eval.json", indent=2)
    log.info("evaluated %d images: %d detections, mAP@0.5:0.95 %s", n, len(detections), metrics["map50_95"])
    return metrics
