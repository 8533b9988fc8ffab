"""Train one run of the grid; every rank runs this (started by ``detscale launch`` / torchrun).

Writes into ``--out``: ``config.yaml`` (frozen, with the derived training semantics),
``env.json``, ``metrics.jsonl``, ``timing.json``, ``weights/last.pt`` (+ ``best.pt`` when
validating during training) and ``logs/rank{R}.log``. ``--resume`` continues from
``weights/last.pt`` when it exists (a torchrun restart does so by itself). Exit code 75 means
the run was stopped by SIGTERM after saving ``last.pt``: rerun the same command to continue.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="experiment config YAML")
    parser.add_argument("--run", required=True, help="run id of the config's grid (see `detscale runs`)")
    parser.add_argument("--out", required=True, type=Path, help="run folder, e.g. results/runs/RUN_ID")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/weights/last.pt when it exists")
    parser.add_argument("--elastic", action="store_true",
                        help="with --resume: continue OUT/weights/last.pt on another number of ranks than it was "
                             "written by (the images per optimiser step, the schedule and the data order stay)")
    parser.add_argument("--data", type=Path, default=None,
                        help="clean data.yaml written by validation (default: results/data/NAME/data.yaml)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="folder of the dataset cache (default: results/cache/NAME)")


def run(args: argparse.Namespace) -> int:
    from detscale import config, dist
    from detscale.engine.trainer import TrainRequest, train

    try:
        return train(TrainRequest(args.config, args.run, args.out, args.resume, args.data, args.cache_dir,
                                 args.elastic))
    except RuntimeError as exc:  # a collective timeout: say which rank stopped, not a traceback
        stalled = dist.stall_error(exc, config.load(args.config).train.timeout_s)
        if stalled is None:
            raise
        raise stalled from None
