"""Read the measured artifacts of finished runs and turn them into the scaling tables.

Only JSON/YAML written by the code that measured the numbers is read (``timing.json``,
``eval.json``, ``env.json``, ``config.yaml``), never log text. Derived numbers follow the
design's measurement rules:

- speed-up(N) = throughput(N) / throughput(baseline) within one group (same experiment point
  except the GPU count); the baseline is the 1-GPU run (the median over its repeats), or the
  smallest GPU count of the group when it has no 1-GPU run;
- efficiency = speed-up / (N / baseline GPUs), which is speed-up / N for a 1-GPU baseline;
- delta mAP = mAP(run) - mAP of the baseline run(s) of the same seed (the pair that differs only
  in the rank count; median over repeats), or of all baseline runs when none has its seed.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from detscale import config as dsconfig
from detscale.errors import UserError

log = logging.getLogger(__name__)

TIMING_KEYS = (
    "world_size", "device", "backend", "batch_per_rank", "global_batch", "warmup_steps", "measured_steps",
    "images_per_s", "images_per_s_per_rank", "data_wait_share", "compute_share", "epoch_seconds",
    "val_seconds", "train_seconds", "peak_mem_bytes_per_rank", "mem_kind",
)
EVAL_KEYS = ("map50_95", "map50", "map75", "map_small", "map_medium", "map_large", "ar100", "num_images")

# The contract's columns of scaling.csv, first and in this order; more measured fields follow.
CONTRACT_COLUMNS = (
    "run", "model", "imgsz", "device", "gpus", "batch_per_gpu", "global_batch", "cache", "precision", "repeat",
    "images_per_s", "images_per_s_per_gpu", "speedup", "efficiency", "data_wait_share", "peak_mem_gb_per_gpu",
    "epoch_seconds", "map50", "map50_95", "delta_map50_95_vs_1gpu",
)
EXTRA_COLUMNS = (
    "seed", "group", "nodes", "scaling", "epochs", "backend", "baseline_gpus", "images_per_s_rank_min",
    "images_per_s_rank_max", "compute_share", "step_ms", "data_wait_ms", "compute_ms", "forward_ms", "backward_ms",
    "comm_ms", "optimizer_ms", "other_ms", "mem_kind", "mfu", "mfu_datasheet", "train_gflops_per_image",
    "peak_gflops_per_gpu", "peak_method",
    "epoch_seconds_first", "train_seconds", "val_seconds", "warmup_steps", "measured_steps", "map75",
    "map_small", "map_medium", "map_large", "ar100", "delta_map50_vs_1gpu", "num_images", "tta_target_map50_95",
    "time_to_target_s", "time_to_target_speedup", "elastic", "started_at", "finished_at", "run_dir",
)
COLUMNS = CONTRACT_COLUMNS + EXTRA_COLUMNS

GB = 1e9  # peak memory is reported in GB (10^9 bytes)


# env.json keys that differ between runs by design (a run's own rank count and config).
PER_RUN_ENV_KEYS = frozenset({"world_size", "rank_hosts", "config_hash", "config_digest", "cuda_visible_devices",
                              "slurm_job_id"})
# The env.json keys that change the arithmetic of a run (its float results), not only its speed: the
# libraries, and what detscale.engine.envinfo.numerics() records (kept here, torch-free, for the report).
NUMERIC_ENV_KEYS = frozenset({"torch", "numpy", "torchvision", "opencv", "cpu_capability", "cpu_isa", "blas", "mkl",
                              "onednn", "torch_threads", "mkldnn_enabled", "tf32_matmul", "tf32_cudnn",
                              "float32_matmul_precision", "deterministic_algorithms", "numeric_env", "gpu_model",
                              "cuda", "cudnn", "threads_per_rank"})


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class ReportError(UserError):
    """A run folder that cannot be reported; the message names the file and the fix."""


@dataclass(frozen=True)
class RunArtifacts:
    """Everything the report reads from one run folder."""

    run_dir: Path
    point: dsconfig.RunPoint
    timing: dict[str, Any]
    evaluation: dict[str, Any]
    env: dict[str, Any]
    run_config: dict[str, Any]
    metrics: list[dict[str, Any]]  # metrics.jsonl: one row per epoch (validation mAP where validated)
    preflight: dict[str, Any] | None = None  # preflight.json of a multi-node run (its network, measured)


def _read_json(path: Path, required: Iterable[str], what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ReportError(f"{path} does not exist; {what}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not valid JSON ({exc}); delete the run folder and re-run it") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} must hold a JSON object, got {type(data).__name__}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ReportError(
            f"{path} lacks the key(s) {', '.join(missing)} of the artifact contract; it was written by another "
            "version of detscale: re-run the run"
        )
    return data


def _point_from_run_config(run_id: str, run_config: Mapping[str, Any], path: Path) -> dsconfig.RunPoint:
    """The grid point of ``run_id`` from the run's own frozen config (sections outside the schema dropped)."""
    known = set(dsconfig.load_schema()["properties"])
    raw = {k: v for k, v in run_config.items() if k in known}
    try:
        return dsconfig.from_dict(raw, source=str(path)).run(run_id)
    except dsconfig.ConfigError as exc:
        raise ReportError(
            f"cannot tell the grid point of run '{run_id}' from {path}: {exc}\n"
            "Pass the experiment config that produced the run with --config"
        ) from None


def load_run(run_dir: str | Path, cfg: dsconfig.ExperimentConfig | None = None) -> RunArtifacts:
    """Read one finished run folder (``results/runs/RUN_ID``; the folder name is the run id).

    The grid point comes from ``cfg`` when the run is in its grid, else from the run's ``config.yaml``.
    """
    run_dir = Path(run_dir)
    run_id = run_dir.name
    if not run_dir.is_dir():
        raise ReportError(f"run folder {run_dir} does not exist; pass folders written by `detscale train`")
    timing = _read_json(run_dir / "timing.json", TIMING_KEYS, "train the run first (`detscale train`)")
    evaluation = _read_json(run_dir / "eval.json", EVAL_KEYS, "evaluate the run first (`detscale evaluate`)")
    env = _read_json(run_dir / "env.json", (), "it is written by `detscale train`; re-run the run")
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ReportError(f"{cfg_path} does not exist; it is written by `detscale train`; re-run the run")
    run_config = yaml.safe_load(cfg_path.read_text()) or {}
    if cfg is not None and run_id in {p.run_id for p in cfg.runs()}:
        point = cfg.run(run_id)
    else:
        point = _point_from_run_config(run_id, run_config, cfg_path)
    if int(timing["world_size"]) != point.gpus and not timing.get("elastic"):
        raise ReportError(
            f"{run_dir / 'timing.json'} says world_size {timing['world_size']} but run '{run_id}' asks for "
            f"{point.gpus} GPUs; the folder holds another run's results: delete it and re-run"
        )
    preflight = _read_json(run_dir / "preflight.json", (), "") if (run_dir / "preflight.json").is_file() else None
    return RunArtifacts(run_dir, point, timing, evaluation, env, run_config, _read_metrics(run_dir / "metrics.jsonl"),
                        preflight)


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """The epoch rows of ``metrics.jsonl`` (empty when the file is missing)."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ReportError(f"{path} line {number} is not valid JSON ({exc}); delete the run folder and re-run it") \
                from None
    return rows


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def _as_float(value: Any) -> float:
    return math.nan if value is None else float(value)


def run_row(run: RunArtifacts) -> dict[str, Any]:
    """The measured (not yet relative) fields of one run, as one ``scaling.csv`` row."""
    p, t, e = run.point, run.timing, run.evaluation
    ips = float(t["images_per_s"])
    per_rank = [float(x) for x in t["images_per_s_per_rank"]] or [math.nan]
    epochs = [float(x) for x in t["epoch_seconds"]]
    peak = [float(x) for x in t["peak_mem_bytes_per_rank"]] or [math.nan]
    # One step moves one batch per rank; ranks step together, so a step lasts global batch / global rate.
    step_ms = 1000.0 * float(t["global_batch"]) / ips if ips > 0 else math.nan
    wait, compute = float(t["data_wait_share"]), float(t["compute_share"])
    epochs_cfg = (run.run_config.get("grid") or {}).get("epochs")
    row = {
        "run": p.run_id,
        "model": p.model,
        "imgsz": p.imgsz,
        "device": t["device"],
        "gpus": p.gpus,
        "batch_per_gpu": int(t["batch_per_rank"]),
        "global_batch": int(t["global_batch"]),
        "cache": p.cache,
        "precision": p.precision,
        "repeat": p.repeat,
        "seed": p.seed,
        "images_per_s": ips,
        "images_per_s_per_gpu": ips / p.gpus,
        "speedup": math.nan,
        "efficiency": math.nan,
        "data_wait_share": wait,
        "peak_mem_gb_per_gpu": max(peak) / GB,
        # The first epoch pays for start-up (workers, allocator); the median epoch is the typical one.
        "epoch_seconds": _median(epochs[1:] if len(epochs) > 1 else epochs),
        "map50": float(e["map50"]),
        "map50_95": float(e["map50_95"]),
        "delta_map50_95_vs_1gpu": math.nan,
        "group": p.group,
        "nodes": p.nodes,
        "scaling": p.scaling,
        "epochs": epochs_cfg if epochs_cfg is not None else len(epochs),
        "backend": t["backend"],
        "baseline_gpus": math.nan,
        "images_per_s_rank_min": min(per_rank),
        "images_per_s_rank_max": max(per_rank),
        "compute_share": compute,
        "step_ms": step_ms,
        "data_wait_ms": step_ms * wait,
        "compute_ms": step_ms * compute,
        # the step breakdown (mean over ranks, ms per step), when the run measured it
        **{f"{k}_ms": _as_float((t.get("step_breakdown_ms") or {}).get(k))
           for k in ("forward", "backward", "comm", "optimizer", "other")},
        "cpu_ms_per_step": _as_float(t.get("cpu_ms_per_step")),
        "accumulate": _as_float(t.get("accumulate")),
        "loader_cpu_ms_per_image": _as_float(t.get("loader_cpu_ms_per_image")),
        "cpu_cores": int(run.env.get("cpu_affinity") or run.env.get("cpu_cores_logical") or 0),
        "threads_per_rank": _as_float(t.get("threads_per_rank")),
        "workers": int((run.run_config.get("train") or {}).get("workers", 0)),
        "mem_kind": t["mem_kind"],
        # model FLOPs utilisation against the peak each rank measured (runs before MFU was recorded: nan)
        "mfu": _as_float(t.get("mfu")),
        "mfu_datasheet": _as_float(t.get("mfu_datasheet")),
        "train_gflops_per_image": _as_float(t.get("train_gflops_per_image")),
        "peak_method": t.get("peak_method") or "",
        "peak_gflops_per_gpu": _median([float(x) for x in t.get("peak_gflops_per_rank") or []] or [math.nan]),
        "epoch_seconds_first": epochs[0] if epochs else math.nan,
        "train_seconds": _as_float(t["train_seconds"]),
        "val_seconds": _as_float(t["val_seconds"]),
        "warmup_steps": int(t["warmup_steps"]),
        "measured_steps": int(t["measured_steps"]),
        "map75": _as_float(e["map75"]),
        "map_small": _as_float(e["map_small"]),
        "map_medium": _as_float(e["map_medium"]),
        "map_large": _as_float(e["map_large"]),
        "ar100": _as_float(e["ar100"]),
        "delta_map50_vs_1gpu": math.nan,
        "num_images": int(e["num_images"]),
        "tta_target_map50_95": math.nan,
        "time_to_target_s": math.nan,
        "time_to_target_speedup": math.nan,
        "started_at": _as_float(t.get("started_at")),
        "finished_at": _as_float(t.get("finished_at")),
        "run_dir": str(run.run_dir),
    }
    if t.get("elastic"):  # trained on several rank counts: their throughputs stay apart (the elastic column)
        row.update(dict.fromkeys(THROUGHPUT_FIELDS, math.nan))
        row["elastic"] = elastic_label(t)
    return row


def elastic_label(timing: Mapping[str, Any]) -> str:
    """How an elastic run's rank counts followed each other, with each one's own throughput."""
    segments = timing.get("segments") or []
    counts = "→".join(str(s["world_size"]) for s in segments)
    rates = ", ".join(f"{float(s['images_per_s']):.1f}" for s in segments)
    return f"{counts} ranks ({rates} img/s)" if segments else ""


# Fields that describe one rank count's speed: an elastic run has several, so none of them.
THROUGHPUT_FIELDS = ("images_per_s", "images_per_s_per_gpu", "images_per_s_rank_min", "images_per_s_rank_max",
                     "step_ms", "data_wait_ms", "compute_ms", "epoch_seconds", "epoch_seconds_first", "mfu",
                     "mfu_datasheet", "cpu_ms_per_step", "forward_ms", "backward_ms", "comm_ms", "optimizer_ms",
                     "other_ms")


def elastic_notes(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One note per run that changed its rank count on the way."""
    return [f"`{r['run']}` changed its rank count on the way (elastic: {r['elastic']}); its accuracy counts, its "
            "throughput is in no table, speed-up or projection" for r in rows if r.get("elastic")]


def add_relative(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill speed-up, efficiency and delta mAP of every row against its group's baseline (in place)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    for group, members in groups.items():
        base_gpus = 1 if any(r["gpus"] == 1 for r in members) else min(r["gpus"] for r in members)
        if base_gpus != 1:
            log.warning("group %s has no 1-GPU run; speed-ups are relative to %d GPUs", group, base_gpus)
        base = [r for r in members if r["gpus"] == base_gpus]
        base_ips = _median([r["images_per_s"] for r in base if not math.isnan(r["images_per_s"])])
        for r in members:
            paired = [b for b in base if b["seed"] == r["seed"]] or base
            r["baseline_gpus"] = base_gpus
            r["speedup"] = r["images_per_s"] / base_ips if base_ips > 0 else math.nan
            r["efficiency"] = r["speedup"] / (r["gpus"] / base_gpus)
            r["delta_map50_95_vs_1gpu"] = r["map50_95"] - _median([b["map50_95"] for b in paired])
            r["delta_map50_vs_1gpu"] = r["map50"] - _median([b["map50"] for b in paired])
    return rows


def scaling_rows(runs: Sequence[RunArtifacts]) -> list[dict[str, Any]]:
    """One row per run, sorted by group, GPUs and repeat, with the relative fields filled in."""
    ids = [r.point.run_id for r in runs]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ReportError(f"run(s) {', '.join(dupes)} given more than once; pass each run folder once")
    rows = add_relative([run_row(r) for r in runs])
    return sorted(rows, key=lambda r: (r["group"], r["gpus"], r["seed"], r["repeat"]))


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """``scaling.csv`` (atomically): the contract's columns first, then every other measured field."""
    import pandas as pd

    from detscale.files import write_text

    frame = pd.DataFrame(list(rows), columns=list(COLUMNS))
    return write_text(frame.to_csv(index=False, float_format="%.6g"), path)


@dataclass(frozen=True)
class Stat:
    """Median and range of one quantity over the runs (seeds and repeats) of one point."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        vals = [v for v in values if not math.isnan(v)]
        if not vals:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(_median(vals), min(vals), max(vals), len(vals))

    def format(self, fmt: str) -> str:
        if self.n == 0:
            return "n/a"
        text = format(_clean(self.median), fmt)
        if self.n > 1:
            text += f" ({format(_clean(self.low), fmt)}–{format(_clean(self.high), fmt)})"
        return text


def _clean(value: float) -> float:
    """Rounding noise (0.40 - 0.41 + 0.01) shown as 0, not -0.000."""
    return 0.0 if abs(value) < 1e-9 else value


# (heading, column, format) of the human table; percentages are multiplied by 100 first.
SUMMARY_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("img/s", "images_per_s", ".1f"),
    ("img/s per GPU", "images_per_s_per_gpu", ".1f"),
    ("speed-up", "speedup", ".2f"),
    ("efficiency %", "efficiency", ".0%"),
    ("data wait %", "data_wait_share", ".0%"),
    ("MFU %", "mfu", ".1%"),
    ("peak mem GB/GPU", "peak_mem_gb_per_gpu", ".2f"),
    ("epoch s", "epoch_seconds", ".1f"),
    ("mAP@0.5", "map50", ".3f"),
    ("mAP@0.5:0.95", "map50_95", ".3f"),
    ("Δ mAP@0.5:0.95", "delta_map50_95_vs_1gpu", "+.3f"),
)


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per group, one entry per GPU count: the repeats' runs and a :class:`Stat` per summary field."""
    out: dict[str, list[dict[str, Any]]] = {}
    for group in sorted({r["group"] for r in rows}):
        members = [r for r in rows if r["group"] == group]
        entries = []
        for gpus in sorted({r["gpus"] for r in members}):
            runs = [r for r in members if r["gpus"] == gpus]
            entry: dict[str, Any] = {"gpus": gpus, "global_batch": runs[0]["global_batch"], "runs": runs}
            entry.update({col: Stat.of([float(r[col]) for r in runs]) for _, col, _ in SUMMARY_FIELDS})
            entries.append(entry)
        out[group] = entries
    return out


def summary_table(entries: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted cells of one group's human table."""
    header = ["GPUs", "global batch", "runs"] + [h for h, _, _ in SUMMARY_FIELDS]
    body = []
    for e in entries:
        cells = [str(e["gpus"]), str(e["global_batch"]), str(len(e["runs"]))]
        cells += [e[col].format(fmt) for _, col, fmt in SUMMARY_FIELDS]
        body.append(cells)
    return header, body


def markdown(rows: Sequence[Mapping[str, Any]], notes: Sequence[str] = ()) -> str:
    """``scaling.md``: one table per experiment point (group); several runs (seeds, repeats) as median (min–max)."""
    lines = ["# Scaling results", ""]
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    for group, entries in summary(rows).items():
        base = entries[0]["runs"][0]["baseline_gpus"]
        lines += [f"## {group}", ""]
        if base != 1:
            lines += [f"No 1-GPU run in this group: speed-up, efficiency and Δ mAP are relative to {base} GPUs.", ""]
        header, body = summary_table(entries)
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---:" for _ in header) + "|")
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        lines += ["", "Runs: " + ", ".join(f"`{r['run']}`" for e in entries for r in e["runs"]), ""]
    return "\n".join(lines)
