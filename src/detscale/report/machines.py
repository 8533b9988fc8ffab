"""One report over several results folders: the same grid measured on several machines or clusters.

``detscale report --results A B [C ...] [--label NAME ...] [--config C] --out DIR`` reads every
finished run under each folder's ``runs/`` (its timing.json, eval.json, env.json, config.yaml and,
for multi-node runs, preflight.json), keeps where each came from (:class:`Origin`: host, device
model, driver, fabric) and lines the runs up by grid point: for every point (model, image size,
batch, cache, precision, scaling) and GPU count one row per machine with img/s, speed-up and
efficiency against that machine's own 1-GPU run, MFU where recorded, mAP, memory per GPU and time
to target, the medians over seeds and repeats. Costs: GPU-hours per epoch, and with prices per
GPU-hour (the config's ``cost`` section, or ``--price``) the cost of an epoch and of reaching the
target mAP. The machines' environments are compared key by key, and the keys that change the
arithmetic (libraries, ISA, thread counts) are marked beside the mAP they can move.

Writes ``machines.md`` and ``machines.csv`` under DIR.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detscale.config import CostConfig
from detscale.report import accuracy, tables

#: Columns of machines.csv, in order.
COLUMNS = ("group", "gpus", "machine", "device", "runs", "images_per_s", "speedup", "efficiency", "mfu",
           "map50_95", "map50", "peak_mem_gb_per_gpu", "epoch_seconds", "time_to_target_s", "gpu_hours_per_epoch",
           "price_per_gpu_hour", "cost_per_epoch", "cost_to_target")
#: What differs between machines and does not move a number (names, paths, ids).
IGNORED_ENV = tables.PER_RUN_ENV_KEYS | {"git_dirty", "git_commit", "host", "hostname", "detscale"}


@dataclass(frozen=True)
class Origin:
    """Where one results folder was measured."""

    label: str
    folder: Path
    host: str
    device: str  # the GPU model, or "cpu: <model>" for CPU ranks
    driver: str
    fabric: str  # how the ranks talked: backend, and the interfaces of a multi-node preflight
    env: dict[str, Any]  # env.json of its first run (software and hardware)


def _runs(folder: Path) -> list[tables.RunArtifacts]:
    runs_dir = folder / "runs"
    if not runs_dir.is_dir():
        raise tables.ReportError(f"{folder} has no runs/ folder: pass a results folder (the workflow's results/)")
    done = sorted(p for p in runs_dir.iterdir() if (p / "timing.json").is_file() and (p / "eval.json").is_file())
    if not done:
        raise tables.ReportError(f"{runs_dir} holds no finished run (timing.json and eval.json); run the workflow "
                                 "there first")
    return [tables.load_run(p) for p in done]


def origin_of(folder: Path, runs: Sequence[tables.RunArtifacts], label: str | None) -> Origin:
    env = dict(runs[0].env)
    gpu = env.get("gpu_model")
    device = str(gpu) if gpu else f"cpu: {env.get('cpu_model', '?')}"
    backends = sorted({str(r.timing.get("backend", "?")) for r in runs})
    interfaces = sorted({n["interface"] for r in runs if r.preflight for n in r.preflight["nodes"]})
    fabric = "/".join(backends) + (f" over {', '.join(interfaces)} between nodes" if interfaces else "")
    host = str(env.get("host", "?"))
    return Origin(label or f"{host} ({device})", folder, host, device, str(env.get("driver") or "—"), fabric, env)


def machine_rows(origin: Origin, runs: Sequence[tables.RunArtifacts], cost: CostConfig) -> list[dict[str, Any]]:
    """One row per (grid point, GPU count) of one machine: medians over its seeds and repeats, with costs."""
    rows = tables.scaling_rows(runs)
    fraction = float((runs[0].run_config.get("eval") or {}).get("tta_fraction", 0.9))
    accuracy.add_time_to_target(rows, {r.point.run_id: accuracy.validation_curve(r.metrics) for r in runs}, fraction)
    price = cost.price(origin.device)  # "cpu: <model>" for CPU ranks, so a "cpu" key prices them
    out = []
    for key in sorted({(r["group"], int(r["gpus"])) for r in rows}):
        members = [r for r in rows if (r["group"], int(r["gpus"])) == key]
        med = {col: tables.Stat.of([float(r[col]) for r in members]).median
               for col in ("images_per_s", "speedup", "efficiency", "mfu", "map50_95", "map50", "peak_mem_gb_per_gpu",
                           "epoch_seconds", "time_to_target_s")}
        gpu_hours = key[1] * med["epoch_seconds"] / 3600
        out.append({"group": key[0], "gpus": key[1], "machine": origin.label, "device": origin.device,
                    "runs": len(members), **med, "gpu_hours_per_epoch": gpu_hours,
                    "price_per_gpu_hour": math.nan if price is None else price,
                    "cost_per_epoch": math.nan if price is None else price * gpu_hours,
                    "cost_to_target": math.nan if price is None else price * key[1] * med["time_to_target_s"] / 3600})
    return out


def environment_table(origins: Sequence[Origin]) -> list[tuple[str, list[str], bool]]:
    """(key, value per machine, changes the arithmetic) of every env.json key that differs between machines."""
    from detscale.report.build import environment_differences

    differ = environment_differences({o.label: o.env for o in origins}, IGNORED_ENV)
    return [(key, [next(v for v, who in values.items() if o.label in who) for o in origins],
             key in tables.NUMERIC_ENV_KEYS) for key, values in differ.items()]


def _fmt(value: float, fmt: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def markdown(origins: Sequence[Origin], rows: Sequence[Mapping[str, Any]], env: Sequence[tuple[str, list[str], bool]],
             currency: str) -> str:
    lines = ["# Several machines", "", "| machine | folder | host | device | driver | fabric |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {o.label} | `{o.folder}` | {o.host} | {o.device} | {o.driver} | {o.fabric} |" for o in origins]
    numeric = [k for k, _, moves in env if moves]
    lines += ["", "Every figure is the median over a point's seeds and repeats on that machine; speed-up and "
              "efficiency are against the same machine's 1-GPU run, so they compare how each machine scales, "
              "img/s how fast it is. On CPU hosts a \"GPU\" is one CPU rank.", ""]
    if numeric:
        lines += [f"The machines differ in {', '.join(numeric)}: these change how the same operations round, so "
                  "runs of one seed follow different trajectories and their mAP (marked †) differs by more than "
                  "one machine's run-to-run noise; read mAP differences between machines as such.", ""]
    for group in sorted({r["group"] for r in rows}):
        lines += [f"## {group}", "", f"| GPUs | machine | runs | img/s | speed-up | efficiency | MFU | mAP@0.5:0.95 | "
                  f"peak mem GB/GPU | epoch s | time to target s | GPU-h/epoch | {currency}/epoch | "
                  f"{currency} to target |", "|" + "---:|" * 2 + "---:|" * 12]
        for r in (r for r in rows if r["group"] == group):
            mark = " †" if numeric else ""
            lines.append(
                f"| {r['gpus']} | {r['machine']} | {r['runs']} | {_fmt(r['images_per_s'], '.1f')} | "
                f"{_fmt(r['speedup'], '.2f')} | {_fmt(r['efficiency'], '.0%')} | {_fmt(r['mfu'], '.1%')} | "
                f"{_fmt(r['map50_95'], '.3f')}{mark} | {_fmt(r['peak_mem_gb_per_gpu'], '.2f')} | "
                f"{_fmt(r['epoch_seconds'], '.1f')} | {_fmt(r['time_to_target_s'], '.0f')} | "
                f"{_fmt(r['gpu_hours_per_epoch'], '.4f')} | {_fmt(r['cost_per_epoch'], '.4f')} | "
                f"{_fmt(r['cost_to_target'], '.4f')} |")
        lines.append("")
    if env:
        lines += ["## Environments", "", "| key | " + " | ".join(o.label for o in origins) + " | moves mAP |",
                  "|---|" + "---|" * len(origins) + "---|"]
        lines += [f"| {k} | " + " | ".join(f"`{v}`" for v in vals) + f" | {'yes' if moves else ''} |"
                  for k, vals, moves in env]
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class MachinesReport:
    markdown: Path
    csv: Path
    origins: list[Origin]
    rows: list[dict[str, Any]]


def build_machines_report(folders: Sequence[str | Path], out_dir: str | Path, labels: Sequence[str] = (),
                          cost: CostConfig | None = None) -> MachinesReport:
    """Read each results folder, line the runs up by grid point, write ``machines.md`` and ``machines.csv``."""
    import pandas as pd

    from detscale.files import write_text

    if len(folders) < 2:
        raise tables.ReportError("--results needs two or more results folders (one per machine)")
    if labels and len(labels) != len(folders):
        raise tables.ReportError(f"--label given {len(labels)} time(s) for {len(folders)} results folder(s); give "
                                 "one per folder, in the same order, or none")
    cost = cost or CostConfig()
    origins, rows = [], []
    for i, folder in enumerate(map(Path, folders)):
        runs = _runs(folder)
        origin = origin_of(folder, runs, labels[i] if labels else None)
        origins.append(origin)
        rows += machine_rows(origin, runs, cost)
    names = [o.label for o in origins]
    if len(set(names)) < len(names):
        raise tables.ReportError(f"two results folders have the same label ({', '.join(names)}); name them with "
                                 "--label")
    order = {name: i for i, name in enumerate(names)}
    rows.sort(key=lambda r: (r["group"], r["gpus"], order[r["machine"]]))
    out = Path(out_dir)
    md = write_text(markdown(origins, rows, environment_table(origins), cost.currency), out / "machines.md")
    csv = write_text(pd.DataFrame(rows, columns=list(COLUMNS)).to_csv(index=False, float_format="%.6g"),
                     out / "machines.csv")
    return MachinesReport(md, csv, origins, rows)
