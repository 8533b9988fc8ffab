"""COCO mAP of a trained run.

Loads the EMA weights of a checkpoint, fuses the model and runs batched inference on the
validation split; under ``torchrun`` every rank predicts its own shard and rank 0 gathers the
detections. Rank 0 writes ``predictions.json`` (COCO results, original image pixels) and
``eval.json`` into ``--out`` and prints a short table. The COCO ground truth is built once per
dataset and split, beside the clean data.yaml (``results/data/DATASET/coco_SPLIT.json``).

    detscale evaluate --weights results/runs/R/weights/last.pt --config config.yaml --run R --out results/runs/R
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m -- detscale evaluate ...

(The ``--`` keeps torchrun from reading ``--run`` as an abbreviation of its ``--run-path``.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from detscale import layout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the usage lines of the docstring
    parser.add_argument("--weights", required=True, type=Path, help="checkpoint (results/runs/RUN/weights/last.pt)")
    parser.add_argument("--config", required=True, type=Path, help="the experiment config YAML")
    parser.add_argument("--run", required=True, help="run id of the config's grid (model, image size)")
    parser.add_argument("--out", required=True, type=Path, help="folder for eval.json and predictions.json")
    parser.add_argument(
        "--data", type=Path, default=None,
        help="clean data.yaml written by `detscale validate` (default: RESULTS/data/DATASET/data.yaml)",
    )
    parser.add_argument("--results", type=Path, default=layout.RESULTS, help="results root (default: %(default)s)")
    parser.add_argument("--split", default="val", choices=("val", "train"), help="split to evaluate (default: val)")
    parser.add_argument(
        "--gt", type=Path, default=None,
        help="COCO ground truth JSON, built when missing or stale (default: coco_SPLIT.json beside the data.yaml)",
    )
    parser.add_argument("--workers", type=int, default=None, help="loader workers per rank (default: train.workers)")


def run(args: argparse.Namespace) -> int:
    from detscale import config, dist
    from detscale.data.formats import DatasetError, load_spec
    from detscale.metrics.coco import format_table
    from detscale.metrics.evaluate import evaluate_model, load_checkpoint_model

    cfg = config.load(args.config)
    point = cfg.run(args.run)
    data_yaml = args.data or layout.clean_data_yaml(cfg.dataset.name, args.results)
    if not data_yaml.is_file():
        raise DatasetError(
            f"clean data.yaml {data_yaml} does not exist; run `detscale validate` for dataset "
            f"'{cfg.dataset.name}' first, or pass --data"
        )
    spec = load_spec(data_yaml, splits=(args.split,))
    gt_json = args.gt or data_yaml.parent / f"coco_{args.split}.json"
    workers = cfg.train.workers if args.workers is None else args.workers

    with dist.process_group(cfg.train.timeout_s, cfg.train.cpu_threads_per_rank) as info:
        model = load_checkpoint_model(args.weights, point.model, spec.nc, point.imgsz, info.device)
        metrics = evaluate_model(
            model, data_yaml, args.split, point.imgsz, cfg.eval, gt_json, args.out, workers=workers
        )
        if info.is_main:
            print(f"{args.run} ({info.world_size} rank{'s' if info.world_size > 1 else ''}, {info.device.type})")
            print(format_table(metrics))
    return 0
