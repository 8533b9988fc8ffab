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
    "map": "mAP vs GPUs (median, min–max over repeats)",
    "step_time": "Step time split into data wait and compute",
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


def plot_efficiency(frame, path: Path, gpu_label: str) -> Path:
    import matplotlib.pyplot as plt
    import seaborn as sns

    data = frame.assign(efficiency_pct=frame["efficiency"] * 100)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sns.lineplot(data=data, x="gpus", y="efficiency_pct", hue="point", estimator="median",
                 errorbar=("pi", 100), marker="o", ax=ax)
    ax.axhline(100, linestyle="--", color="grey", label="ideal (100 %)")
    _gpu_ticks(ax, frame["gpus"])
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
    import matplotlib.pyplot as plt
    import seaborn as sns

    data = frame.sort_values(["point", "gpus", "repeat"]).reset_index(drop=True)
    labels = [f"{r.point}\n{r.gpus} GPU r{r.repeat}" if data["point"].nunique() > 1 else f"{r.gpus} GPU r{r.repeat}"
              for r in data.itertuples()]
    palette = sns.color_palette(n_colors=2)
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(data) + 2), 4.2))
    xs = range(len(data))
    ax.bar(xs, data["compute_ms"], color=palette[0], label="compute (forward, backward, all-reduce, optimizer)")
    ax.bar(xs, data["data_wait_ms"], bottom=data["compute_ms"], color=palette[1], label="data wait (loader)")
    ax.set_xticks(list(xs), labels, fontsize="small")
    ax.set_ylim(0, float((data["compute_ms"] + data["data_wait_ms"]).max()) * 1.35)  # room for the legend
    ax.legend(fontsize="small", loc="upper left")
    xlabel = "run (CPU ranks, repeat)" if gpu_label != "GPUs" else "run (GPUs, repeat)"
    return _finish(fig, ax, path, PLOTS["step_time"], xlabel, "time per training step (ms)")


def make_plots(rows: Sequence[Mapping[str, Any]], out_dir: str | Path) -> dict[str, Path]:
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
        "map": plot_map,
        "step_time": plot_step_time,
    }
    paths = {}
    for name, maker in makers.items():
        paths[name] = maker(frame, out / f"{name}.png", gpu_label)
        log.debug("wrote %s", paths[name])
    return paths
