"""The communication benchmarks (``detscale comm`` JSON) in the report: read, tabled, described."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detscale.report import tables


def comm_rows(comm: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The communication benchmarks as one table (header, body)."""
    header = ["model", "imgsz", "ranks", "backend", "gradient (MiB)", "buckets", "all-reduce (ms, median)",
              "p10–p90 (ms)", "algbw (GB/s)", "busbw (GB/s)", "fit: latency (us)", "fit: busbw (GB/s)"]
    body = [[c["model"], str(c["imgsz"]), f"{c['world_size']} {c['device']}", c["backend"],
             f"{c['gradient_bytes'] / 2**20:.1f}", str(len(c["bucket_bytes"])), f"{c['time_ms']:.2f}",
             f"{c['time_ms_p10']:.2f}–{c['time_ms_p90']:.2f}", f"{c['algbw_GBps']:.2f}", f"{c['busbw_GBps']:.2f}",
             f"{c['fit']['latency_us']:.0f}", f"{c['fit']['busbw_GBps']:.2f}"]
            for c in sorted(comm, key=lambda c: (c["model"], c["imgsz"], c["world_size"]))]
    return header, body


COMM_METHOD = ("All-reduce of the model's gradient (float32) in the buckets DDP settles on after one training "
               "batch, all buckets in flight together, median of the timed rounds after warm-up rounds; algbw = "
               "bytes / time, busbw = algbw x 2(n-1)/n (nccl-tests' definitions); the fit is t = latency + "
               "bytes x 2(n-1)/n / busbw over a sweep of 4 KiB..64 MiB messages.")


def comm_markdown(comm: Sequence[Mapping[str, Any]]) -> list[str]:
    if not comm:
        return ["", "## Communication", "", "No communication benchmark (no grid point of 2 or more GPUs on one node)."]
    header, body = comm_rows(comm)
    return ["", "## Communication", "", COMM_METHOD, "", "| " + " | ".join(header) + " |",
            "|---" * len(header) + "|", *("| " + " | ".join(row) + " |" for row in body)]


def read_comm(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The communication benchmarks (``detscale comm`` JSON) given to the report."""
    out = []
    for path in paths:
        try:
            out.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as exc:
            raise tables.ReportError(f"cannot read the communication benchmark {path}: {exc}; rerun the workflow "
                                     "(rule comm) to write it again") from None
    return out
