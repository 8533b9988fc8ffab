"""Advice on a run's bottleneck, from its own measurements: the phase that dominates the step and the
knob that moves it, with the numbers.

Each rule reads one ``scaling.csv`` row (:func:`detscale.report.tables.run_row`) and returns an
:class:`Advice` or None. The thresholds are named below; a rule that needs a measurement the run
did not make (the step breakdown, the loader's CPU time) stays silent rather than guess.

- **Data wait** above :data:`DATA_WAIT`: the loader does not keep up. Its ceiling per rank is
  measured (workers x 1000 / the loader's CPU ms per image); knobs: ``grid.cache: ram``, more
  ``train.workers`` (how many the demand needs), more CPUs per GPU when the workers would not fit.
- **Exposed communication** above :data:`COMM`: the all-reduce outlasts the backward it should hide
  behind; knobs: a larger ``train.nominal_batch`` (one all-reduce per optimiser step, so fewer per
  image), a faster fabric (the projection shows what one would give).
- **Optimiser** above :data:`OPTIMIZER`: a larger ``train.nominal_batch`` (fewer steps per image);
  the fused kernels are already used where torch has them.
- **Launch-bound** (CUDA): MFU below :data:`LAUNCH_MFU` and the host busy for most of the step:
  the GPU waits for the CPU to launch kernels; knobs: a larger ``grid.batch``, ``train.compile: step``.
- **CPU contention**: the ranks of a node ask for more torch threads than it has cores, or use more
  CPUs than it has (measured: each rank's process time per step, its workers' per image); knobs:
  fewer ``train.cpu_threads_per_rank`` or ``train.workers``, fewer ranks per node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DATA_WAIT = 0.10  # share of the step blocked on the loader
COMM = 0.15  # share of the step in exposed communication
OPTIMIZER = 0.15  # share of the step in the optimiser (BatchNorm merge, step, EMA)
LAUNCH_MFU = 0.05  # below this MFU on CUDA, with the host busy, the step is launch-bound
LAUNCH_CPU = 0.8  # host CPU time per step / step time above which the host is "busy"
HEADROOM = 1.2  # workers are sized for this much more than the measured demand


@dataclass(frozen=True)
class Advice:
    run: str
    rule: str  # data_wait | comm | optimizer | launch_bound | contention
    message: str


def _num(row: Mapping[str, Any], key: str) -> float:
    value = row.get(key)
    try:
        out = float(value) if value is not None and value != "" else math.nan
    except (TypeError, ValueError):
        return math.nan
    return out


def _share(row: Mapping[str, Any], key: str) -> float:
    step = _num(row, "step_ms")
    return _num(row, key) / step if step > 0 else math.nan


def ranks_per_node(row: Mapping[str, Any]) -> int:
    return max(1, int(_num(row, "gpus") or 1) // max(1, int(_num(row, "nodes") or 1)))


def data_wait(row: Mapping[str, Any]) -> str | None:
    share = _num(row, "data_wait_share")
    if not share > DATA_WAIT:
        return None
    knobs = []
    if row.get("cache") != "ram":
        knobs.append(f"grid.cache: ram (now {row.get('cache')}): images decoded once, shared by the node's ranks")
    demand = _num(row, "images_per_s_per_gpu") / (1 - share)  # what the rank would train without waiting
    per_worker = 1000.0 / _num(row, "loader_cpu_ms_per_image")
    workers = int(_num(row, "workers")) if not math.isnan(_num(row, "workers")) else 0
    if per_worker > 0 and not math.isnan(demand):
        ceiling = per_worker * max(workers, 1)
        need = math.ceil(HEADROOM * demand / per_worker)
        knobs.append(f"train.workers: {need} (now {workers}): one worker delivers {per_worker:.0f} img/s "
                     f"(measured loader CPU time), the rank's ceiling {ceiling:.0f} img/s against a demand of "
                     f"{demand:.0f} img/s without waiting")
        cores, threads = _num(row, "cpu_cores"), _num(row, "threads_per_rank")
        per_rank_cpus = cores / ranks_per_node(row) if cores > 0 else math.nan
        wanted = need + (threads if threads > 0 else 1)
        if wanted > per_rank_cpus:
            knobs.append(f"more CPUs per GPU: {need} workers and the rank's own thread need {wanted:.0f} CPUs, the "
                         f"node has {per_rank_cpus:.1f} per rank")
    else:
        knobs.append(f"more train.workers (now {workers}); the loader's CPU time was not measured, so its "
                     "ceiling is unknown")
    return f"{share:.0%} of the step waits for data. " + "; ".join(knobs) + "."


def comm(row: Mapping[str, Any]) -> str | None:
    share = _share(row, "comm_ms")
    if not share > COMM:
        return None
    return (f"{share:.0%} of the step ({_num(row, 'comm_ms'):.1f} of {_num(row, 'step_ms'):.1f} ms) is communication "
            f"the backward does not hide. train.nominal_batch larger than {_num(row, 'global_batch'):.0f} accumulates "
            "batches between all-reduces (one per optimiser step, so fewer per image); a faster fabric between "
            "the ranks shortens each one (the projection shows what one would give).")


def optimizer(row: Mapping[str, Any]) -> str | None:
    share = _share(row, "optimizer_ms")
    if not share > OPTIMIZER:
        return None
    accumulate = _num(row, "accumulate")
    return (f"{share:.0%} of the step ({_num(row, 'optimizer_ms'):.1f} ms) is the optimiser (BatchNorm merge, step, "
            f"EMA), once every {accumulate:.0f} batch(es). A larger train.nominal_batch takes fewer optimiser steps "
            "per image; the fused optimiser kernels are already used where torch has them.")


def launch_bound(row: Mapping[str, Any]) -> str | None:
    if row.get("device") != "cuda":
        return None
    mfu, host = _num(row, "mfu"), _share(row, "cpu_ms_per_step")
    if not (mfu < LAUNCH_MFU and host > LAUNCH_CPU):
        return None
    return (f"MFU {mfu:.1%} while the host is busy for {host:.0%} of each step: the GPU waits for the CPU to launch "
            f"kernels. A larger grid.batch (now {_num(row, 'batch_per_gpu'):.0f} per GPU) gives each launch more "
            "work; a compiled step (train.compile: step) fuses kernels and removes launches.")


def contention(row: Mapping[str, Any]) -> str | None:
    cores = _num(row, "cpu_cores")
    if not cores > 0:
        return None
    ranks = ranks_per_node(row)
    threads = _num(row, "threads_per_rank")
    asked = ranks * threads if threads > 0 else math.nan  # torch threads of CPU ranks
    # measured CPU demand in cores: each rank's process over its step, its loader workers per image
    own = _share(row, "cpu_ms_per_step")
    loader = _num(row, "loader_cpu_ms_per_image") * _num(row, "images_per_s_per_gpu") / 1000
    used = ranks * (own + (loader if loader >= 0 else 0.0))
    if not (asked > cores or used > cores):
        return None
    said = f"{asked:.0f} torch threads" if asked > cores else f"{used:.2f} CPUs busy (measured)"
    return (f"the node's {ranks} rank(s) want more CPUs than its {cores:.0f}: {said}. Ranks then wait for cores "
            "(and torch's threads spin while they wait): lower train.cpu_threads_per_rank or train.workers, or run "
            "fewer ranks per node.")


RULES: dict[str, Callable[[Mapping[str, Any]], str | None]] = {
    "data_wait": data_wait, "comm": comm, "optimizer": optimizer, "launch_bound": launch_bound,
    "contention": contention,
}


def advise(rows: Sequence[Mapping[str, Any]]) -> list[Advice]:
    """Every rule on every run, in run order, then rule order."""
    out = []
    for row in rows:
        for name, rule in RULES.items():
            message = rule(row)
            if message:
                out.append(Advice(str(row["run"]), name, message))
    return out


def markdown(advice: Sequence[Advice]) -> list[str]:
    lines = ["", "## Advice on the bottleneck", ""]
    if not advice:
        return lines + ["No run has a bottleneck above the thresholds (data wait, exposed communication, optimiser, "
                        "launch-bound step, CPU contention)."]
    return lines + [f"- `{a.run}` ({a.rule}): {a.message}" for a in advice]
