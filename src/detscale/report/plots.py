"""The report's plots (seaborn, PNG): throughput, efficiency, memory, accuracy and step-time split.

Every plot takes the rows of ``scaling.csv`` (see :mod:`detscale.report.tables`), colours the
experiment points (groups) apart, and labels its axes with units. Repeats show as separate
points plus the median with its min–max range.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PLOTS = {
    "throughput": "Throughput vs GPUs, with the ideal (linear) line",
    "efficiency": "Scaling efficiency vs GPUs",
    "memory": "Peak memory per GPU",
    "mfu": "Model FLOPs utilisation per GPU: training FLOPs per second against the peak each rank measured",
    "map": "mAP vs GPUs (median, min–max over repeats)",
    "step_time": "Step time split into data wait, forward, backward, exposed communication, optimiser and other",
    "accuracy_pairs": "mAP@0.5:0.95 per seed, baseline vs N GPUs, and the mean difference with its 95 % CI",
    "time_to_accuracy": "Validation mAP@0.5:0.95 against training time, per GPU count",
    "projection": "Measured throughput and the scaling projection (lines) for more GPUs and nodes",
}


def _frame(rows: Sequence[Mapping[str, Any]]):
    import pandas as pd

    frame = pd.DataFrame(list(rows))
    frame["point"] = frame["group"]
    return frame


def _gpu_label(device: str) -> str:
    return "GPUs (CPU ranks)" if device == "cpu" else "GPUs"


def _finish(fig, ax, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _gpu_ticks(ax, gpus: Sequence[int]) -> None:
    ax.set_xticks(sorted(set(int(g) for g in gpus)))


def plot_throughput(frame, path: Path, gpu_label: str) -> Path:
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sns.lineplot(data=frame, x="gpus", y="images_per_s", hue="point", estimator="median",
                 errorbar=("pi", 100), marker="o", ax=ax)
    sns.scatterplot(data=frame, x="gpus", y="images_per_s", hue="point", legend=False, alpha=0.5, ax=ax)
    for i, (_, members) in enumerate(frame.groupby("point", sort=True)):
        base_gpus = float(members["baseline_gpus"].iloc[0])
        base = members.loc[members["gpus"] == base_gpus, "images_per_s"].median()
        xs = sorted(members["gpus"].unique())
        ax.plot(xs, [base * x / base_gpus for x in xs], linestyle="--", color="grey",
                label="ideal (linear)" if i == 0 else None)
    _gpu_ticks(ax, frame["gpus"])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return _finish(fig, ax, path, PLOTS["throughput"], gpu_label, "throughput (images/s, all ranks)")


def plot_efficiency(frame, path: Path, gpu_label: str, references: Sequence[Any] = ()) -> Path:
    import matplotlib.pyplot as plt
    import seaborn as sns

    data = frame.assign(efficiency_pct=frame["efficiency"] * 100)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sns.lineplot(data=data, x="gpus", y="efficiency_pct", hue="point", estimator="median",
                 errorbar=("pi", 100), marker="o", ax=ax)
    ax.axhline(100, linestyle="--", color="grey", label="ideal (100 %)")
    by_entry: dict[str, list[Any]] = {}
    for p in references:  # published points on this report's card family
        by_entry.setdefault(f"{p.model} ({p.trainer.split(' (')[0]}), published", []).append(p)
    for label, points in by_entry.items():
        ax.plot([p.gpus for p in points], [100 * p.efficiency for p in points], linestyle=":", marker="s",
                color="black", alpha=0.6, label=label)
    _gpu_ticks(ax, list(frame["gpus"]) + [p.gpus for p in references])
    ax.set_ylim(0, max(110.0, float(data["efficiency_pct"].max()) * 1.1))
    ax.legend(fontsize="small")
    return _finish(fig, ax, path, PLOTS["efficiency"], gpu_label, "efficiency (speed-up / GPUs, %)")


def plot_memory(frame, path: Path, gpu_label: str) -> Path:
    import matplotlib.pyplot as plt
    import seaborn as sns

    kinds = set(frame["mem_kind"])
    what = "peak resident memory per rank (RSS, GB)" if kinds == {"rss"} else (
        "peak allocated CUDA memory per GPU (GB)" if kinds == {"cuda_allocated"} else "peak memory per GPU (GB)")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sns.barplot(data=frame, x="gpus", y="peak_mem_gb_per_gpu", hue="point", estimator="median",
                errorbar=("pi", 100), ax=ax)
    ax.set_ylim(0, float(frame["peak_mem_gb_per_gpu"].max()) * 1.3)  # room for the legend
    ax.legend(fontsize="small", loc="upper left")
    return _finish(fig, ax, path, PLOTS["memory"], gpu_label, what)


def plot_mfu(frame, path: Path, gpu_label: str) -> Path:
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    data = frame.assign(mfu_pct=frame["mfu"] * 100).dropna(subset=["mfu_pct"])
    if data.empty:
        ax.text(0.5, 0.5, "MFU not recorded by these runs", ha="center", va="center", transform=ax.transAxes)
    else:
        sns.barplot(data=data, x="gpus", y="mfu_pct", hue="point", estimator="median", errorbar=("pi", 100), ax=ax)
        ax.set_ylim(0, float(data["mfu_pct"].max()) * 1.3)  # room for the legend
        ax.legend(fontsize="small", loc="upper left")
    return _finish(fig, ax, path, PLOTS["mfu"].split(":")[0], gpu_label,
                   "MFU (% of the measured matmul peak per GPU)")


def plot_map(frame, path: Path, gpu_label: str) -> Path:
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    long = pd.concat([
        frame.assign(metric="mAP@0.5", value=frame["map50"]),
        frame.assign(metric="mAP@0.5:0.95", value=frame["map50_95"]),
    ])
    long["series"] = long["point"] + " " + long["metric"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sns.lineplot(data=long, x="gpus", y="value", hue="series", estimator="median", errorbar=("pi", 100),
                 err_style="bars", marker="o", ax=ax)
    sns.scatterplot(data=long, x="gpus", y="value", hue="series", legend=False, alpha=0.5, ax=ax)
    _gpu_ticks(ax, frame["gpus"])
    ax.set_ylim(0, 1)
    ax.legend(fontsize="small")
    return _finish(fig, ax, path, PLOTS["map"], gpu_label, "COCO mAP (0–1)")


def plot_step_time(frame, path: Path, gpu_label: str) -> Path:
    """A stacked bar per run: data wait, forward, backward, exposed communication, optimiser, other."""
    import math

    import matplotlib.pyplot as plt
    import seaborn as sns

    from detscale.engine.timing import PHASE_HELP, PHASES

    data = frame.sort_values(["point", "gpus", "seed", "repeat"]).reset_index(drop=True)
    labels = [(f"{r.point}\n" if data["point"].nunique() > 1 else "") + f"{r.gpus} GPU s{r.seed} r{r.repeat}"
              for r in data.itertuples()]
    palette = sns.color_palette(n_colors=len(PHASES))
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(data) + 2), 4.6))
    xs = list(range(len(data)))
    bottom = [0.0] * len(data)
    has_breakdown = [not math.isnan(float(v)) for v in data["forward_ms"]]
    for k, phase in enumerate(PHASES):
        if phase == "data_wait":
            values = list(data["data_wait_ms"])
        else:
            # runs without a breakdown show their compute as one block, under "other"
            values = [float(r[f"{phase}_ms"]) if ok else (float(r["compute_ms"]) if phase == "other" else 0.0)
                      for ok, (_, r) in zip(has_breakdown, data.iterrows(), strict=True)]
        ax.bar(xs, values, bottom=bottom, color=palette[k], label=f"{phase.replace('_', ' ')}: {PHASE_HELP[phase]}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(xs, labels, fontsize="small")
    ax.set_ylim(0, max(bottom) * 1.9)  # room for the legend
    ax.legend(fontsize="x-small", loc="upper left")
    xlabel = "run (CPU ranks, seed, repeat)" if gpu_label != "GPUs" else "run (GPUs, seed, repeat)"
    return _finish(fig, ax, path, PLOTS["step_time"], xlabel, "time per training step (ms, mean over ranks)")


def plot_accuracy_pairs(deltas: Sequence[Any], path: Path, gpu_label: str) -> Path:
    """Left: each seed's baseline and N-GPU mAP@0.5:0.95 joined by a line; right: mean Δ and its 95 % CI."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    pairs = [d for d in deltas if d.metric == "map50_95"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    palette = sns.color_palette(n_colors=max(len(pairs), 1))
    labels = []
    for i, d in enumerate(pairs):
        label = f"{d.group}: {d.gpus} vs {d.baseline_gpus}"
        labels.append(label)
        for seed, a, b in zip(d.seeds, d.baseline, d.other, strict=True):
            left.plot([d.baseline_gpus, d.gpus], [a, b], marker="o", color=palette[i], alpha=0.7,
                      label=label if seed == d.seeds[0] else None)
        mean = d.mean
        err = [[mean - d.low], [d.high - mean]] if d.n >= 2 else None
        right.errorbar([mean], [i], xerr=err, fmt="o", color=palette[i], capsize=4)
        right.plot(d.deltas, [i] * d.n, "|", color=palette[i], markersize=12, alpha=0.6)
    right.axvline(0, color="grey", linestyle="--")
    right.set_yticks(range(len(pairs)), [f"{d.gpus} vs {d.baseline_gpus}" for d in pairs])
    right.set_ylim(-0.5, max(len(pairs), 1) - 0.5)
    right.set_title("mean Δ ± 95 % CI (| one seed)", fontsize="medium")
    right.set_xlabel("Δ mAP@0.5:0.95 (N GPUs − baseline)")
    left.set_ylabel("mAP@0.5:0.95 (one line per seed)")
    if pairs:
        left.legend(fontsize="small")
        _gpu_ticks(left, [g for d in pairs for g in (d.gpus, d.baseline_gpus)])
    return _finish(fig, left, path, "mAP per seed: baseline vs N GPUs", gpu_label, left.get_ylabel())


def plot_time_to_accuracy(frame, curves: Mapping[str, Sequence[tuple[int, float, float]]], path: Path,
                          gpu_label: str) -> Path:
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    gpus_values = sorted(frame["gpus"].unique())
    palette = dict(zip(gpus_values, sns.color_palette(n_colors=len(gpus_values)), strict=True))
    seen: set[int] = set()
    for r in frame.itertuples():
        curve = curves.get(r.run, ())
        if not curve:
            continue
        ax.plot([c[1] for c in curve], [c[2] for c in curve], marker=".", color=palette[r.gpus], alpha=0.8,
                label=f"{r.gpus} GPU{'s' if r.gpus > 1 else ''}" if r.gpus not in seen else None)
        seen.add(r.gpus)
        if r.time_to_target_s == r.time_to_target_s:  # not nan
            ax.plot([r.time_to_target_s], [r.tta_target_map50_95], marker="x", color=palette[r.gpus], markersize=9)
    if not seen:
        ax.text(0.5, 0.5, "no validation during training\n(train.val_interval: 0)", ha="center", va="center",
                transform=ax.transAxes)
    else:
        ax.legend(fontsize="small")
    return _finish(fig, ax, path, "Time to accuracy (x: target reached)", "training time (s, validation excluded)",
                   "validation mAP@0.5:0.95 (EMA)")


def plot_projection(frame, projections: Sequence[Any], path: Path, gpu_label: str) -> Path:
    """Measured img/s per point (dots) and the projection's lines: one per node count, over GPUs in total."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(7.2, 4.8))
    palette = dict(zip(sorted(frame["point"].unique()), sns.color_palette(n_colors=frame["point"].nunique()),
                       strict=True))
    styles = ["-", "--", "-.", ":"]
    for p in projections:
        colour = palette.get(p.group, "grey")
        for k, nodes in enumerate(sorted({x.nodes for x in p.grid})):
            pts = sorted((x.gpus, x.images_per_s) for x in p.grid if x.nodes == nodes)
            ax.plot([g for g, _ in pts], [v for _, v in pts], styles[k % len(styles)], color=colour, alpha=0.8,
                    label=f"{p.group}: projected, {nodes} node(s)")
    sub = frame[frame["nodes"] == 1]
    for point, rows in sub.groupby("point"):
        ax.scatter(rows["gpus"], rows["images_per_s"], color=palette[point], zorder=3, label=f"{point}: measured")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend(fontsize="x-small")
    if not projections:
        ax.text(0.5, 0.5, "no projection (see the report)", transform=ax.transAxes, ha="center")
    return _finish(fig, ax, path, PLOTS["projection"], f"{gpu_label} in total (log scale)",
                   "images per second (log scale)")


def make_plots(rows: Sequence[Mapping[str, Any]], out_dir: str | Path, deltas: Sequence[Any] = (),
               curves: Mapping[str, Sequence[tuple[int, float, float]]] | None = None,
               projections: Sequence[Any] = (), references: Sequence[Any] = ()) -> dict[str, Path]:
    """Write every plot as ``out_dir/<name>.png``; returns name -> path in :data:`PLOTS` order."""
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = _frame(rows)
    gpu_label = _gpu_label(str(frame["device"].iloc[0]) if set(frame["device"]) == {"cpu"} else "cuda")
    makers = {
        "throughput": plot_throughput,
        "efficiency": plot_efficiency,
        "memory": plot_memory,
        "mfu": plot_mfu,
        "map": plot_map,
        "step_time": plot_step_time,
    }
    paths = {}
    for name, maker in makers.items():
        if name == "efficiency":
            paths[name] = plot_efficiency(frame, out / f"{name}.png", gpu_label, references)
            continue
        paths[name] = maker(frame, out / f"{name}.png", gpu_label)
        log.debug("wrote %s", paths[name])
    paths["accuracy_pairs"] = plot_accuracy_pairs(deltas, out / "accuracy_pairs.png", gpu_label)
    paths["time_to_accuracy"] = plot_time_to_accuracy(frame, curves or {}, out / "time_to_accuracy.png", gpu_label)
    paths["projection"] = plot_projection(frame, projections, out / "projection.png", gpu_label)
    return paths
