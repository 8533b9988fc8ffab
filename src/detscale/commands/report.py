"""Scaling report of finished runs: scaling.csv, scaling.md, plots/*.png and a self-contained index.html.

Reads each run folder's timing.json, eval.json, env.json and config.yaml (never log text).
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--runs", nargs="+", metavar="RUN_DIR",
                       help="run folders (results/runs/RUN_ID), each with timing.json and eval.json")
    which.add_argument("--results", nargs="+", metavar="RESULTS_DIR",
                       help="two or more results folders (one per machine or cluster): one report lining their "
                            "runs up by grid point (machines.md, machines.csv)")
    parser.add_argument("--config", help="the experiment config the runs came from (with --results: optional, "
                                         "for its cost section)")
    parser.add_argument("--label", action="append", default=[], metavar="NAME",
                        help="with --results: a name per results folder, in order (default: host and device)")
    parser.add_argument("--price", action="append", default=[], metavar="DEVICE=PRICE",
                        help="with --results: price per GPU-hour of devices whose model contains DEVICE "
                             "(e.g. H100=2.5, cpu=0.04); added to the config's cost.gpu_hour")
    parser.add_argument("--comm", nargs="*", default=[], metavar="JSON",
                        help="communication benchmarks (results/comm/*.json, `detscale comm`) for the report's "
                             "communication table and scaling projection")
    parser.add_argument("--out", default="results/report", help="output folder (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from detscale.report.build import build_report

    if args.results:
        return _machines(args)
    if not args.config:
        from detscale.report.tables import ReportError

        raise ReportError("--runs needs --config (the experiment config the runs came from)")
    files = build_report(args.runs, args.config, args.out, args.comm)
    sys.stdout.write(f"report: {files.html}\ntable:  {files.markdown}\ncsv:    {files.csv}\n")
    return 0


def _machines(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from detscale import config
    from detscale.config import ConfigError, CostConfig
    from detscale.report.machines import build_machines_report

    cost = config.load(args.config).cost if args.config else CostConfig()
    prices = dict(cost.gpu_hour)
    for item in args.price:
        device, sep, value = item.partition("=")
        try:
            prices[device] = float(value)
        except ValueError:
            sep = ""
        if not sep or not device or prices[device] < 0:
            raise ConfigError(f"--price {item!r}: expected DEVICE=PRICE with a price >= 0, e.g. --price H100=2.5")
    report = build_machines_report(args.results, args.out, args.label, replace(cost, gpu_hour=prices))
    for origin in report.origins:
        sys.stdout.write(f"{origin.label}: {origin.device}, {origin.fabric} ({origin.folder})\n")
    sys.stdout.write(f"machines: {report.markdown}\ncsv:      {report.csv}\n")
    return 0
