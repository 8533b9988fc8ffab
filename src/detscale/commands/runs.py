"""List the run ids of a config's grid, one per line (with --json, every run's point).

With ``--run RUN_ID --out FILE`` it writes that run's own config instead: the experiment config
with the grid narrowed to the one point, the file `detscale train` and `detscale evaluate` read.
Its content changes only when something that affects the run changes, so a workflow that keys
on it re-runs only the runs a grid change touches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict
from typing import Any

import yaml

from detscale import config
from detscale.files import write_text

HEADER = "# Written by `detscale runs --run {run}`: the experiment config narrowed to run {run}.\n"


def run_config(cfg: config.ExperimentConfig, run_id: str, stage: str = "train") -> dict[str, Any]:
    """The config of one run: the grid narrowed to its point; ``stage`` picks the sections that matter.

    ``train``: everything that changes what or how the run trains. The evaluation settings are
    kept only when the run validates during training (``train.val_interval > 0``), so changing
    them does not re-train. ``evaluate``: everything else. Neither holds the report's own
    settings (``eval.tta_fraction``, ``projection``, ``cost``, ``machines``) nor the placement (where and on how many
    CPUs jobs run).
    ``repeats`` is the run's repeat index + 1, so the point stays in the narrowed grid and adding
    repeats leaves the earlier repeats' configs unchanged.
    """
    if stage not in ("train", "evaluate"):
        raise ValueError(f"stage must be 'train' or 'evaluate', got {stage!r}")
    point = cfg.run(run_id)
    data = cfg.to_dict()
    data["grid"].update(
        model=[point.model], imgsz=[point.imgsz], gpus=[point.gpus], batch=[point.batch],
        cache=[point.cache], precision=[point.precision], seeds=[point.seed], repeats=point.repeat + 1,
    )
    data["eval"].pop("tta_fraction")  # read by the report only
    for section in ("projection", "cost", "machines"):  # read by the report only
        data.pop(section)
    data.pop("continue_on")  # how many ranks run it this time, never what it computes
    data.pop("placement")  # where and on how many CPUs jobs run, never what they compute
    if stage == "train" and cfg.train.val_interval == 0:
        data.pop("eval")
    narrowed = config.from_dict(data, source=f"run config of {run_id}")
    assert narrowed.run(run_id) == point, "narrowing the grid must keep the run's point"
    return data


def run_config_text(cfg: config.ExperimentConfig, run_id: str, stage: str = "train") -> str:
    """The YAML text of :func:`run_config` (stable: same config, same bytes)."""
    return HEADER.format(run=run_id) + yaml.safe_dump(run_config(cfg, run_id, stage), sort_keys=False)


def run_config_digest(cfg: config.ExperimentConfig, run_id: str, stage: str = "train") -> str:
    """Short hash of the run config's text: a workflow parameter that changes exactly when the file would."""
    return hashlib.sha256(run_config_text(cfg, run_id, stage).encode()).hexdigest()[:16]


def experiment_config_text(cfg: config.ExperimentConfig) -> str:
    """The whole experiment config with every default filled in, as YAML."""
    return "# The experiment config with every default filled in (written by the workflow).\n" + yaml.safe_dump(
        cfg.to_dict(), sort_keys=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment config YAML")
    parser.add_argument("--json", action="store_true", help="print each run's grid point as JSON")
    parser.add_argument("--run", help="with --out: write this run's config")
    parser.add_argument("--stage", choices=("train", "evaluate"), default="train",
                        help="with --run: the sections of the run config (default: %(default)s)")
    parser.add_argument("--out", help="with --run: where to write the run's config YAML")


def run(args: argparse.Namespace) -> int:
    cfg = config.load(args.config)
    if (args.run is None) != (args.out is None):
        raise config.ConfigError("--run and --out go together: `detscale runs --config C --run RUN_ID --out FILE`")
    if args.run is not None:
        write_text(run_config_text(cfg, args.run, args.stage), args.out)
        return 0
    for point in cfg.runs():
        line = json.dumps({"run": point.run_id, **asdict(point)}) if args.json else point.run_id
        sys.stdout.write(line + "\n")
    return 0
