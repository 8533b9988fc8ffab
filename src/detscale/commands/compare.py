"""Compare two results folders run by run: did the second run of the workflow reproduce the first?

Lines up the runs both folders hold (by run id) and compares their configs, environments
(env.json: host, CPU features, library builds, threads) and measured quantities (throughput,
speed-up, mAP, step breakdown, memory), each against the spread stated for it. Prints a
summary; ``--out`` writes the full tables as Markdown. With ``--strict`` the exit code is 1 when
a quantity exceeds its spread or a config differs.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from detscale.report.compare import SPREADS

    parser.add_argument("results_a", metavar="RESULTS_A", help="a results folder (results, results/runs or one run)")
    parser.add_argument("results_b", metavar="RESULTS_B", help="the results folder to compare with it")
    parser.add_argument("--spread", action="append", default=[], metavar="QUANTITY=VALUE",
                        help="override a stated spread (repeatable); quantities and defaults: "
                             + ", ".join(f"{s.column}={s.tolerance:g}{' (relative)' if s.relative else ''}"
                                         for s in SPREADS))
    parser.add_argument("--out", metavar="FILE.md", help="write the full comparison as Markdown")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when a quantity exceeds its spread or a run's config differs")


def run(args: argparse.Namespace) -> int:
    from detscale.files import write_text
    from detscale.report.compare import compare, markdown, parse_spread, summary

    overrides = dict(parse_spread(s) for s in args.spread)
    result = compare(args.results_a, args.results_b, overrides)
    if args.out:
        write_text(markdown(result), args.out)
    sys.stdout.write(summary(result) + "\n" + (f"table: {args.out}\n" if args.out else ""))
    failed = any(p.exceeded or p.config_changes for p in result.pairs)
    return 1 if args.strict and failed else 0
