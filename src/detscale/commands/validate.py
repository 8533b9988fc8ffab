"""Check a YOLO dataset and write the reports and the clean view every later stage reads.

Writes DIR/validation.json, DIR/validation.md, DIR/clean/{train,val}.txt and DIR/data.yaml.
With --on-error fail (the default) any error stops with exit code 2 after the reports are
written; with --on-error quarantine the defective images are left out of the clean view.
The dataset's own files are only read.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data_yaml", metavar="DATA_YAML", help="the dataset's data.yaml (Ultralytics / YOLOv9 layout)")
    parser.add_argument("--out", required=True, help="output folder for the reports and the clean view")
    parser.add_argument("--on-error", choices=("fail", "quarantine"), default="fail",
                        help="what defects do: stop (fail, default) or leave the images out (quarantine)")
    parser.add_argument("--workers", type=int, default=0, help="worker processes (default 0: every core)")
    parser.add_argument("--failed-report", metavar="PATH",
                        help="when validation fails, also write validation.md here (e.g. a Snakemake log file, "
                             "which survives a failed job)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from detscale.data.validate import summary_text, validate

    with tqdm(desc="validate", unit="img", disable=None) as bar:

        def start(total: int) -> None:  # known once a COCO or VOC dataset is converted
            bar.total = total
            bar.refresh()

        report = validate(args.data_yaml, args.out, policy=args.on_error, workers=args.workers,
                          progress=bar.update, failed_report=args.failed_report, on_total=start)
    sev = report.severity_counts()
    lines = [f"validate: {report.data_yaml} (on_error: {report.policy}, {report.seconds:.1f} s)"]
    if report.source_format != "yolo":
        lines.append(f"  format: {report.source_format}, converted to the YOLO layout in {Path(report.out) / 'source'}")
        lines += [f"  conversion: {note}" for note in report.conversion_notes]
    for split, s in report.split_stats().items():
        lines.append(f"  {split:<5} {s['images']} images ({s['background']} background), {s['boxes']} boxes; "
                     f"kept {s['kept']}, dropped {s['dropped']}")
    lines.append(f"  findings: {sev['error']} errors, {sev['warning']} warnings, {sev['info']} notes")
    details = summary_text(report, examples=1)
    if details:
        lines.append(details)
    out = Path(report.out)
    lines.append(f"  report: {out / 'validation.md'}; clean view: {out / 'data.yaml'}")
    print("\n".join(lines))
    return 0
