"""Scaling report of finished runs: scaling.csv, scaling.md, plots/*.png and a self-contained index.html.

Reads each run folder's timing.json, eval.json, env.json and config.yaml (never log text).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", nargs="+", required=True, metavar="RUN_DIR",
                        help="run folders (results/runs/RUN_ID), each with timing.json and eval.json")
    parser.add_argument("--config", required=True, help="the experiment config the runs came from")
    parser.add_argument("--comm", nargs="*", default=[], metavar="JSON",
                        help="communication benchmarks (results/comm/*.json, `detscale comm`) for the report's "
                             "communication table and scaling projection")
    parser.add_argument("--out", default="results/report", help="output folder (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from detscale.report.build import build_report

    files = build_report(args.runs, args.config, args.out, args.comm)
    sys.stdout.write(f"report: {files.html}\ntable:  {files.markdown}\ncsv:    {files.csv}\n")
    return 0
