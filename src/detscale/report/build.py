"""Assemble the scaling report of a set of finished runs: CSV, Markdown, plots and index.html."""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detscale import config as dsconfig
from detscale.files import write_text
from detscale.report import accuracy, advice, html, plots, projection, reference, tables
from detscale.report.communication import comm_markdown, read_comm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportFiles:
    """Where the report's files were written."""

    csv: Path
    markdown: Path
    html: Path
    plots: dict[str, Path]


def _span(values: Sequence[Any]) -> str:
    vals = sorted(set(values))
    return str(vals[0]) if len(vals) == 1 else f"{vals[0]}–{vals[-1]}"


def overlapping_pairs(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]] | None:
    """Pairs of runs whose training intervals overlapped; None when the runs did not record them."""
    spans = [(r["run"], r["started_at"], r["finished_at"]) for r in rows]
    if any(math.isnan(s) or math.isnan(f) for _, s, f in spans):
        return None
    spans.sort(key=lambda x: x[1])
    return [(a, b) for i, (a, _, fa) in enumerate(spans) for b, sb, _ in spans[i + 1:] if sb < fa]


def placement_note(cfg: dsconfig.ExperimentConfig, rows: Sequence[Mapping[str, Any]]) -> str:
    """How the timed runs were placed on the machine(s), from the config and the recorded intervals."""
    if cfg.placement.allow_overlap:
        text = ("Placement: overlapping allowed (placement.allow_overlap: true): timed runs could train at the "
                "same time, each on its own GPUs (`detscale launch` claims cards with file locks), but sharing "
                "the host's CPUs, memory bandwidth and I/O.")
    else:
        text = ("Placement: exclusive (placement.allow_overlap: false): the workflow ran timed training runs one "
                "at a time (every train job holds the Snakemake resource timed_run=1, limit 1), so no two "
                "measured runs shared GPUs or CPUs.")
    pairs = overlapping_pairs(rows)
    if pairs is None:
        text += " The runs did not record their start and end times, so actual overlap was not checked."
    elif pairs:
        text += " Recorded overlaps: " + ", ".join(f"{a} with {b}" for a, b in pairs) + "."
    else:
        text += " The recorded start and end times confirm that no two runs overlapped."
    return text


def device_note(rows: Sequence[Mapping[str, Any]], cfg: dsconfig.ExperimentConfig,
                envs: Mapping[str, Mapping[str, Any]]) -> str:
    """What a "GPU" is in this report: a CUDA device, or a CPU rank on a host without one."""
    devices = {r["device"] for r in rows}
    if devices == {"cpu"}:
        hosts = sorted({str(e.get("host", e.get("hostname", "?"))) for e in envs.values()})
        return (f"Device: CPU. No GPU was used: every \"GPU\" in this report is one CPU rank (backend "
                f"{_span([r['backend'] for r in rows])}, {cfg.train.cpu_threads_per_rank} torch thread(s) per "
                f"rank) on host {', '.join(hosts)}. CPU scaling is an analogue of adding cards, not a GPU figure.")
    if devices == {"cuda"}:
        return f"Device: CUDA GPUs (backend {_span([r['backend'] for r in rows])}); one rank per GPU."
    return (f"Devices differ between runs ({', '.join(sorted(devices))}): compare only runs of one device; on CPU "
            "\"GPUs\" are CPU ranks.")


def environment_differences(envs: Mapping[str, Mapping[str, Any]],
                            ignore: frozenset[str] = tables.PER_RUN_ENV_KEYS) -> dict[str, dict[str, list[str]]]:
    """The env.json keys whose values differ between runs: key -> value -> the runs that had it."""
    keys = {k for env in envs.values() for k in env} - ignore
    out: dict[str, dict[str, list[str]]] = {}
    for key in sorted(keys):
        by_value: dict[str, list[str]] = {}
        for run, env in sorted(envs.items()):
            value = env.get(key)
            by_value.setdefault(value if isinstance(value, str) else json.dumps(value), []).append(run)
        if len(by_value) > 1:
            out[key] = by_value
    return out


def describe_differences(differ: Mapping[str, Mapping[str, Sequence[str]]], limit: int = 3) -> str:
    """``key (value in n runs, other in m runs)`` for each key; long values are cut."""
    def short(value: str) -> str:
        return value if len(value) <= 40 else value[:37] + "..."

    parts = []
    for key, by_value in differ.items():
        values = sorted(by_value.items(), key=lambda kv: -len(kv[1]))
        shown = ", ".join(f"{short(v)} in {len(r)} run{'s' if len(r) > 1 else ''}" for v, r in values[:limit])
        more = f", {len(values) - limit} more" if len(values) > limit else ""
        parts.append(f"{key} ({shown}{more})")
    return "; ".join(parts)


def environment_note(envs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """A warning when the runs were measured with different software or hardware; it names the keys and
    their values, and says when they are ones that change the arithmetic itself."""
    differ = environment_differences(envs)
    if not differ:
        return None
    text = ("The runs' environments differ in " + describe_differences(differ) + " (see Environment): numbers of "
            "different software or hardware are compared; re-run the grid in one environment for a clean comparison.")
    numeric = sorted(set(differ) & tables.NUMERIC_ENV_KEYS)
    if numeric:
        text += (" " + ", ".join(numeric) + " change which kernels compute the same operations and how they round: "
                 "runs of one seed then follow different trajectories, so their mAP differs by more than one "
                 "machine's run-to-run noise (none on CPU).")
    return text


def data_note(run_configs: Sequence[Mapping[str, Any]]) -> str | None:
    """What dataset validation kept for training, from the ``validation.json`` beside each run's data.yaml
    (the clean view): how many training images were dropped and why. A run trained on fewer images than
    its dataset holds learns less per epoch than one that trains on all of them, another trainer included."""
    from detscale.data.checks import DROPPED_KINDS, KINDS

    dropping = {kind for kind, (severity, _) in KINDS.items() if severity == "error"} | DROPPED_KINDS
    parts = []
    for data_yaml in sorted({str(c.get("data_yaml")) for c in run_configs if c.get("data_yaml")}):
        report = Path(data_yaml).parent / "validation.json"
        try:
            doc = json.loads(report.read_text())
            train = doc["splits"]["train"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        text = (f"{data_yaml}: validation ({doc.get('policy')}) kept {train['kept']} of {train['images']} training "
                "images")
        if train["dropped"]:
            errors = sorted((kind, n) for kind, n in doc.get("counts", {}).items() if n and kind in dropping)
            text += (f"; the runs trained without the {train['dropped']} dropped ones ("
                     + ", ".join(f"{kind}: {n}" for kind, n in errors) + f"; see {report}). A trainer that takes "
                     "them trains on more images per epoch, so compare with it on the clean view")
        clipped = doc.get("counts", {}).get("box_clipped", 0)
        if clipped:
            text += f"; {clipped} box(es) reaching beyond their image were clipped to it"
        parts.append(text + ".")
    return ("Data: " + " ".join(parts)) if parts else None


def methods(rows: Sequence[Mapping[str, Any]], cfg: dsconfig.ExperimentConfig) -> list[str]:
    """One sentence per reported quantity: what it is and how it was measured."""
    scaling = _span([r["scaling"] for r in rows])
    unit = "GPU" if {r["device"] for r in rows} == {"cuda"} else "GPU (CPU rank on a host without CUDA)"
    return [
        f"Ranks: {_span([r['gpus'] for r in rows])} per run over {_span([r['nodes'] for r in rows])} node(s), one "
        f"process per {unit} started by torchrun.",
        f"Batch: scaling mode {scaling}; 'weak' keeps the per-GPU batch fixed (global batch = per-GPU batch × GPUs), "
        f"'strong' divides a fixed global batch. Per-GPU batch {_span([r['batch_per_gpu'] for r in rows])}, global "
        f"batch {_span([r['global_batch'] for r in rows])}; gradients accumulate to the nominal batch "
        f"{cfg.train.nominal_batch}; learning-rate scaling rule: {cfg.train.lr_scaling}.",
        f"Throughput (img/s): images trained per second of wall time in the steady state, summed over ranks. The "
        f"first {_span([r['warmup_steps'] for r in rows])} warm-up steps are excluded "
        f"({_span([r['measured_steps'] for r in rows])} steps measured); on CUDA the clock is read after "
        "synchronising. img/s per GPU = throughput / GPUs. Memory format: "
        f"{'channels_last' if cfg.train.channels_last else 'contiguous (NCHW)'}; precision as in the tables.",
        "Speed-up(N) = throughput(N) / throughput of the 1-GPU run of the same experiment point (median over its "
        "repeats; the smallest GPU count when a point has no 1-GPU run). Efficiency = speed-up / N (relative to "
        "the baseline's GPU count). Δ mAP = mAP(N) − median mAP of the baseline runs.",
        "Data wait share: fraction of each step spent blocked on the data loader; the rest (compute share) is "
        "forward, backward, all-reduce and optimizer. Step time = global batch / throughput. With "
        "train.step_breakdown the compute is split further (mean over ranks, ms per step): forward and loss, "
        "backward, exposed communication (from the last gradient bucket handed to the all-reduce until it is "
        "done), optimiser (BatchNorm merge, step, EMA) and other; CPU: perf_counter marks; CUDA: CUDA events read "
        "every 25 steps, no per-step synchronisation.",
        "Peak memory per GPU: the largest rank's peak, in GB (10^9 bytes): allocated CUDA memory on GPUs, peak "
        f"resident set size (RSS) of the rank process on CPU (kinds here: {_span([r['mem_kind'] for r in rows])}).",
        mfu_method(rows),
        "Epoch time: median wall time of the epochs after the first (the first pays start-up); scaling.csv also "
        "has the first epoch and the total training time.",
        f"mAP: COCO mAP@0.5 and mAP@0.5:0.95 of the final EMA weights on {_span([r['num_images'] for r in rows])} "
        f"validation images (`detscale evaluate`, faster-coco-eval, the numbers pycocotools gives), confidence "
        f"≥ {cfg.eval.conf}, NMS IoU {cfg.eval.iou}, at most {cfg.eval.max_det} detections per image.",
        f"Seeds and repeats: every point trains once per seed (seeds {', '.join(map(str, cfg.grid.seeds))}) and "
        f"{cfg.grid.repeats} time(s) per seed; tables show the median and (min–max) over those runs. Repeats share "
        "the seed, so their spread is timing noise and non-determinism, not seed-to-seed variation (CPU training is "
        "deterministic: repeats there reach the same mAP).",
        "Accuracy pairs: an N-GPU run and the baseline run of the same point and seed see the same images in the "
        "same optimiser steps: rank r trains the r-th slice of every global batch that the baseline accumulates, "
        "each rank normalises its loss by its own targets as the baseline does per accumulated batch, and "
        "BatchNorm statistics are merged as the baseline updates them (without SyncBN), so they differ in the rank "
        "count alone (train.warmup_accumulate: ramp would add a difference during warm-up). Δ mAP = N-GPU − "
        "baseline of the same seed; with two or more seeds the mean Δ gets a 95 % confidence interval from "
        "Student's t on the per-seed differences (scipy.stats).",
        f"Time to accuracy: training wall-clock (validation excluded) until the first validation during training "
        f"(every {cfg.train.val_interval} epoch(s), EMA weights) reaches {cfg.eval.tta_fraction:.0%} of the final "
        "mAP@0.5:0.95 of the baseline run of the same seed; its speed-up is the baseline's time over the run's. "
        + ("Without validation during training (train.val_interval 0) it is not measured."
           if cfg.train.val_interval == 0 else ""),
        placement_note(cfg, rows),
    ]


def mfu_method(rows: Sequence[Mapping[str, Any]]) -> str:
    """How MFU was measured, with the FLOPs per image and the peaks these runs measured."""
    measured = [r for r in rows if r.get("mfu") == r.get("mfu")]  # not nan: the run recorded its peak
    if not measured:
        return "MFU: not recorded by these runs (their timing.json predates it)."
    flops = _span([f"{r['train_gflops_per_image']:.3g}" for r in measured])
    peaks = _span([f"{r['peak_gflops_per_gpu']:.0f}" for r in measured])
    return (f"MFU (model FLOPs utilisation) = training FLOPs per image × throughput / the sum of the ranks' peaks. "
            f"FLOPs per image: {flops} GFLOPs, 3 × one training-mode forward (convolutions and matrix products "
            "counted with torch's FlopCounterMode, 2 × MACs). Peak: measured by every rank at the start of its run, "
            f"all ranks at once ({_span([r['peak_method'] for r in measured])}): {peaks} GFLOP/s per GPU. On known "
            "GPUs scaling.csv also has MFU against the datasheet's dense peak (mfu_datasheet).")


def contention_note(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """On CPU ranks: a warning when the ranks and their loader workers want more cores than the host has."""
    crowded = []
    for r in rows:
        threads = r["threads_per_rank"]
        if r["device"] != "cpu" or math.isnan(threads) or not r["cpu_cores"]:
            continue
        want = r["gpus"] // r["nodes"] * (int(threads) + r["workers"])
        if want > r["cpu_cores"]:
            crowded.append((r["gpus"], int(threads), r["workers"], want, r["cpu_cores"]))
    if not crowded:
        return None
    cases = "; ".join(f"{g} rank(s) x ({t} thread(s) + {w} loader worker(s)) = {n} > {c} cores"
                      for g, t, w, n, c in sorted(set(crowded)))
    return (f"CPU contention: {cases}. The CPU analogue then also measures the ranks' contention for cores, not only "
            "what an added rank buys; the step breakdown and the projection's CPU roofline show how much.")


def build_report(run_dirs: Sequence[str | Path], config_path: str | Path, out_dir: str | Path,
                 comm_paths: Sequence[str | Path] = ()) -> ReportFiles:
    """Read the runs, write ``scaling.csv``, ``scaling.md``, ``plots/*.png`` and ``index.html`` under ``out_dir``.

    Every file is written beside its final name and renamed into place, so an interrupted report
    leaves no half-written file behind.
    """
    if not run_dirs:
        raise tables.ReportError("no run folders given; pass --runs results/runs/RUN_ID ...")
    config_path = Path(config_path)
    cfg = dsconfig.load(config_path)
    runs = [tables.load_run(d, cfg) for d in run_dirs]
    rows = tables.scaling_rows(runs)
    curves = {r.point.run_id: accuracy.validation_curve(r.metrics) for r in runs}
    accuracy.add_time_to_target(rows, curves, cfg.eval.tta_fraction)
    deltas = accuracy.paired_deltas(rows)
    envs = {r.point.run_id: r.env for r in runs}
    notes = [device_note(rows, cfg, envs)]
    env_note = environment_note(envs)
    if env_note:
        notes.append(env_note)
    crowded = contention_note(rows)
    if crowded:
        notes.append(crowded)
    data = data_note([r.run_config for r in runs])
    if data:
        notes.append(data)
    comm = read_comm(comm_paths)
    projections, no_projection = projection.project_groups(rows, comm, cfg.projection,
                                                           [r.preflight for r in runs if r.preflight])
    notes += tables.elastic_notes(rows)
    notes += [f"Experiment point {g}: no 1-GPU run; speed-ups are relative to {b} GPUs."
              for g, b in sorted({(r["group"], r["baseline_gpus"]) for r in rows if r["baseline_gpus"] != 1})]

    published = reference.load()
    beside = reference.matching(published, [str(e.get("gpu_model") or "") for e in envs.values()])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".plots-") as tmp:
        drawn = plots.make_plots(rows, tmp, deltas=deltas, curves=curves, projections=projections, references=beside)
        plot_dir = out / "plots"
        plot_dir.mkdir(exist_ok=True)
        plot_paths = {}
        for name, path in drawn.items():
            plot_paths[name] = plot_dir / path.name
            shutil.move(path, plot_paths[name])

    csv_path = out / "scaling.csv"
    tables.write_csv(rows, csv_path)
    md_path = out / "scaling.md"
    tips = advice.advise(rows)
    md = (tables.markdown(rows, notes + [methods(rows, cfg)[-1]]) + "\n" + "\n".join(accuracy.markdown(deltas))
          + "\n" + "\n".join(advice.markdown(tips))
          + "\n" + "\n".join(comm_markdown(comm) + projection.markdown(projections, no_projection))
          + "\n" + "\n".join(reference.markdown(published, beside)))
    write_text(md + "\n", md_path)
    run_configs = {r.point.run_id: (r.run_dir / "config.yaml").read_text() for r in runs}
    page = html.render(rows, plot_paths, notes, methods(rows, cfg), envs, config_path.read_text(),
                       str(config_path), run_configs, deltas, comm, projections, no_projection, tips,
                       published, beside)
    html_path = out / "index.html"
    write_text(page, html_path)
    log.info("report of %d run(s) written to %s", len(rows), out)
    return ReportFiles(csv_path, md_path, html_path, plot_paths)
