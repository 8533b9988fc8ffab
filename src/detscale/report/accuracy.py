"""Does DDP cost accuracy? Paired statistics over seeds, and time to accuracy.

Accuracy is compared as pairs: an N-GPU run and the baseline (1-GPU) run of the same experiment
point and the same seed, which see the same data and differ in the rank count alone (the
trainer's semantics make them train alike, see :mod:`detscale.engine.trainer`). For every
point with two or more seeds the per-seed differences get a mean and a 95 % confidence interval
from Student's t (scipy.stats), and one verdict sentence. With one seed no statement is possible,
and the report says so.

Time to accuracy (MLPerf's "time to train"): with validation during training
(``train.val_interval``), the training wall-clock (validation excluded) at the first validation
that reaches ``eval.tta_fraction`` of the final mAP@0.5:0.95 of the baseline run of the same
seed, and its speed-up over the baseline.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: (column of scaling.csv, name in text) of the accuracy metrics compared.
METRICS = (("map50", "mAP@0.5"), ("map50_95", "mAP@0.5:0.95"))


@dataclass(frozen=True)
class PairedDelta:
    """The N-GPU minus baseline difference of one metric over the seeds of one experiment point."""

    group: str
    gpus: int
    baseline_gpus: int
    metric: str  # column name
    label: str  # human name
    seeds: tuple[int, ...]
    baseline: tuple[float, ...]
    other: tuple[float, ...]
    deltas: tuple[float, ...]
    mean: float
    low: float  # 95 % confidence interval of the mean difference (paired t); nan with one seed
    high: float
    p_value: float

    @property
    def n(self) -> int:
        return len(self.deltas)

    def verdict(self) -> str:
        """One sentence a reader can act on."""
        who = f"{self.gpus} GPUs vs {self.baseline_gpus}"
        if self.n and all(d == 0.0 for d in self.deltas):
            runs = "runs" if self.n > 1 else "run"
            return (f"{who}, {self.label}: equal to the last digit on {'every' if self.n > 1 else 'its'} seed "
                    f"({self.n}): the {self.gpus}-GPU {runs} trained the {self.baseline_gpus}-GPU trajectory "
                    "(the same numbers added in the same order: 2 ranks without SyncBN add their gradients in one "
                    "addition, as one rank accumulating two batches does), so no accuracy cost on this arithmetic. "
                    "Runs that round "
                    "differently (GPUs, NCCL, mixed precision, more ranks, SyncBN) part from it: read those through "
                    "several seeds.")
        if self.n < 2:
            return (f"{who}, {self.label}: Δ {self.mean:+.3f} from one seed. No statement about an accuracy cost is "
                    "possible with one seed: the difference cannot be told from seed-to-seed variation; give "
                    "grid.seeds two or more values (8 seeds of the default grid resolved about ±0.06 here).")
        interval = f"95 % CI {self.low:+.3f}..{self.high:+.3f}, {self.n} seeds, paired t, p = {self.p_value:.2g}"
        if self.low > 0:
            return f"{who}, {self.label}: gains {self.mean:.3f} ({interval})."
        if self.high < 0:
            return f"{who}, {self.label}: costs {-self.mean:.3f} ({interval})."
        return (f"{who}, {self.label}: no accuracy cost detected: Δ {self.mean:+.3f} ({interval}); a cost larger "
                f"than {max(-self.low, 0.0):.3f} is unlikely.")


def _by_seed(rows: Sequence[Mapping[str, Any]], metric: str) -> dict[int, float]:
    """Mean of ``metric`` per seed (repeats of one seed are timing repeats of the same training)."""
    per: dict[int, list[float]] = {}
    for r in rows:
        value = float(r[metric])
        if not math.isnan(value):
            per.setdefault(int(r["seed"]), []).append(value)
    return {seed: statistics.fmean(v) for seed, v in per.items()}


def paired_deltas(rows: Sequence[Mapping[str, Any]]) -> list[PairedDelta]:
    """Per experiment point, GPU count above the baseline and metric: the seed-paired differences."""
    from scipy import stats

    out = []
    for group in sorted({r["group"] for r in rows}):
        members = [r for r in rows if r["group"] == group]
        base_gpus = int(members[0]["baseline_gpus"])
        base_rows = [r for r in members if r["gpus"] == base_gpus]
        for gpus in sorted({int(r["gpus"]) for r in members} - {base_gpus}):
            others = [r for r in members if r["gpus"] == gpus]
            for metric, label in METRICS:
                base, other = _by_seed(base_rows, metric), _by_seed(others, metric)
                seeds = tuple(sorted(set(base) & set(other)))
                if not seeds:
                    continue
                deltas = tuple(other[s] - base[s] for s in seeds)
                mean = statistics.fmean(deltas)
                low = high = p = math.nan
                if len(deltas) >= 2:
                    sem = stats.sem(deltas)
                    if sem > 0:
                        low, high = stats.t.interval(0.95, len(deltas) - 1, loc=mean, scale=sem)
                        p = float(stats.ttest_1samp(deltas, 0.0).pvalue)
                    else:  # every pair differs by the same amount
                        low = high = mean
                        p = 0.0 if mean != 0 else 1.0
                out.append(PairedDelta(group, gpus, base_gpus, metric, label, seeds,
                                       tuple(base[s] for s in seeds), tuple(other[s] for s in seeds), deltas,
                                       mean, float(low), float(high), p))
    return out


def markdown(deltas: Sequence[PairedDelta]) -> list[str]:
    """The accuracy section of scaling.md: verdicts, then the per-seed table."""
    lines = ["## Does DDP cost accuracy?", ""]
    if not deltas:
        return lines + ["No experiment point has both a baseline and a multi-GPU run: nothing to compare.", ""]
    lines += [f"- {d.verdict()}" for d in deltas]
    lines += ["", "| point | GPUs | metric | seeds | baseline | N GPUs | Δ per seed | mean Δ | 95 % CI |",
              "|---|---:|---|---|---|---|---|---:|---|"]
    for d in deltas:
        ci = "n/a (one seed)" if d.n < 2 else f"{d.low:+.3f}..{d.high:+.3f}"
        lines.append(f"| {d.group} | {d.gpus} vs {d.baseline_gpus} | {d.label} | {', '.join(map(str, d.seeds))} | "
                     f"{', '.join(f'{v:.3f}' for v in d.baseline)} | {', '.join(f'{v:.3f}' for v in d.other)} | "
                     f"{', '.join(f'{v:+.3f}' for v in d.deltas)} | {d.mean:+.3f} | {ci} |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------
# Time to accuracy
# ---------------------------------------------------------------------------------------------


def validation_curve(metrics_rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, float, float]]:
    """``(epoch, training seconds up to the end of that epoch, mAP@0.5:0.95)`` of every validated epoch.

    Training seconds sum the epochs' training times (``epoch_seconds``, validation excluded).
    """
    curve, elapsed = [], 0.0
    for row in sorted(metrics_rows, key=lambda r: r["epoch"]):
        elapsed += float(row.get("epoch_seconds") or 0.0)
        if row.get("map50_95") is not None:
            curve.append((int(row["epoch"]), elapsed, float(row["map50_95"])))
    return curve


def time_to_target(curve: Sequence[tuple[int, float, float]], target: float) -> float:
    """Training seconds at the first validation reaching ``target``; nan if none does (or no curve)."""
    for _epoch, seconds, value in curve:
        if value >= target:
            return seconds
    return math.nan


def add_time_to_target(rows: list[dict[str, Any]], curves: Mapping[str, Sequence[tuple[int, float, float]]],
                       fraction: float) -> None:
    """Fill ``tta_target_map50_95``, ``time_to_target_s`` and ``time_to_target_speedup`` (in place).

    The target of a run is ``fraction`` of the final mAP@0.5:0.95 of the baseline run of its
    point and seed; the speed-up is the baseline's time to that target over the run's.
    """
    base_of: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r["gpus"] == r["baseline_gpus"] and r["repeat"] == 0:
            base_of[(r["group"], int(r["seed"]))] = r
    for r in rows:
        base = base_of.get((r["group"], int(r["seed"])))
        target = fraction * float(base["map50_95"]) if base is not None else math.nan
        r["tta_target_map50_95"] = target
        # an elastic run's seconds add up epochs of several rank counts: no time of one rank count
        timed = not math.isnan(target) and not r.get("elastic")
        r["time_to_target_s"] = time_to_target(curves.get(r["run"], ()), target) if timed else math.nan
    for r in rows:
        base = base_of.get((r["group"], int(r["seed"])))
        mine, theirs = r["time_to_target_s"], base["time_to_target_s"] if base is not None else math.nan
        r["time_to_target_speedup"] = theirs / mine if mine and not math.isnan(mine) and not math.isnan(theirs) \
            else math.nan
