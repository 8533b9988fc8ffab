"""List the run ids of a config's grid, one per line (with --json, every run's point)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from detscale import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="experiment config YAML")
    parser.add_argument("--json", action="store_true", help="print each run's grid point as JSON")


def run(args: argparse.Namespace) -> int:
    cfg = config.load(args.config)
    for point in cfg.runs():
        line = json.dumps({"run": point.run_id, **asdict(point)}) if args.json else point.run_id
        sys.stdout.write(line + "\n")
    return 0
