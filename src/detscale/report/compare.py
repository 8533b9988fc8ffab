"""Line up two results folders run by run: did a second run of the workflow reproduce the first?

Runs are matched by run id (the folder name under ``runs/``). For every matched pair the module
compares the frozen configs (a changed config makes it another experiment), the environments
(``env.json``: host, CPU features, library builds, thread counts), and the measured quantities
of the scaling table. Each quantity has a stated spread, the difference two reproductions of a
run may show (:data:`SPREADS`, overridable); a difference beyond it is reported as such, one
inside it as reproduced. The spreads are statements about this benchmark's default on one kind
of machine; a user comparing other grids or machines passes their own with ``--spread``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from detscale import layout
from detscale.errors import UserError
from detscale.report import tables


@dataclass(frozen=True)
class Spread:
    """How far two reproductions of one run may differ in a quantity, and why that much."""

    column: str  # the scaling.csv column
    label: str
    tolerance: float
    relative: bool  # True: |b / a - 1| <= tolerance; False: |b - a| <= tolerance
    why: str


SPREADS: tuple[Spread, ...] = (
    Spread("images_per_s", "throughput (img/s)", 0.10, True,
           "the projection's stated error on an idle host of the same kind"),
    Spread("speedup", "speed-up", 0.05, True,
           "speed-up is a ratio of two runs on one host, so host-wide speed cancels"),
    Spread("efficiency", "scaling efficiency", 0.05, True, "as speed-up"),
    Spread("map50_95", "mAP@0.5:0.95", 0.02, False,
           "what a run trained to convergence reproduces to; the CPU default is not converged and moves by "
           "more between machines (docs/default-config.md)"),
    Spread("map50", "mAP@0.5", 0.03, False, "as mAP@0.5:0.95, on the looser metric"),
    Spread("delta_map50_95_vs_1gpu", "Δ mAP@0.5:0.95 vs 1 GPU", 0.03, False,
           "the difference of two mAPs, each within 0.02"),
    Spread("data_wait_share", "data wait share", 0.05, False, "a share of step time, noisy on a loaded host"),
    Spread("forward_ms", "forward + loss (ms/step)", 0.15, True, "step-breakdown components, host noise"),
    Spread("backward_ms", "backward (ms/step)", 0.15, True, "as forward"),
    Spread("comm_ms", "exposed communication (ms/step)", 0.30, True,
           "the all-reduce's exposed part is short and varies most"),
    Spread("optimizer_ms", "optimiser (ms/step)", 0.15, True, "as forward"),
    Spread("peak_mem_gb_per_gpu", "peak memory per GPU (GB)", 0.10, True,
           "allocator and resident-set noise"),
)

# env.json keys that differ between any two runs and say nothing about the numbers: the report's per-run
# keys, and whether the source tree had uncommitted changes.
IGNORED_ENV_KEYS = tables.PER_RUN_ENV_KEYS | {"git_dirty"}
# config.yaml keys that name where a run's inputs lay, not what it computed.
IGNORED_CONFIG_KEYS = frozenset({"data_yaml", "cache_dir"})


class CompareError(UserError):
    """A results folder that cannot be compared; the message names it and the fix."""


@dataclass
class PairResult:
    """One run id present in both folders."""

    run_id: str
    config_changes: list[tuple[str, Any, Any]]
    env_changes: list[tuple[str, Any, Any]]
    quantities: list[dict[str, Any]] = field(default_factory=list)

    @property
    def exceeded(self) -> list[dict[str, Any]]:
        return [q for q in self.quantities if q["verdict"] == "exceeds"]


@dataclass
class Comparison:
    a: Path
    b: Path
    pairs: list[PairResult]
    only_a: list[str]
    only_b: list[str]
    incomplete: list[str]
    spreads: tuple[Spread, ...]


def run_folders(results: str | Path) -> dict[str, Path]:
    """The run folders of a results folder (``results``, ``results/runs`` or one run), by run id."""
    root = Path(results)
    if not root.is_dir():
        raise CompareError(f"{root} is not a folder; pass a results folder written by the workflow "
                           "(e.g. results, holding runs/RUN_ID)")
    if (root / "timing.json").is_file():
        return {root.name: root}
    base = layout.runs_dir(root) if layout.runs_dir(root).is_dir() else root
    found = {d.name: d for d in sorted(base.iterdir()) if d.is_dir() and (d / "timing.json").is_file()}
    if not found:
        raise CompareError(f"{root} holds no trained run (no runs/*/timing.json); pass the folder the workflow "
                           "wrote its results to")
    return found


def parse_spread(text: str, spreads: Sequence[Spread] = SPREADS) -> tuple[str, float]:
    """``COLUMN=VALUE`` of ``--spread``, checked against the known quantities."""
    column, sep, value = text.partition("=")
    known = {s.column for s in spreads}
    if not sep or column not in known:
        raise CompareError(f"--spread {text!r}: expected QUANTITY=VALUE with QUANTITY one of "
                           f"{', '.join(sorted(known))}")
    try:
        tolerance = float(value)
    except ValueError:
        raise CompareError(f"--spread {text!r}: {value!r} is not a number") from None
    if not tolerance >= 0:
        raise CompareError(f"--spread {text!r}: the spread must be >= 0")
    return column, tolerance


def _changes(a: Mapping[str, Any], b: Mapping[str, Any], ignore: frozenset[str]) -> list[tuple[str, Any, Any]]:
    """The flattened keys whose values differ, leaving out those under an ``ignore``d top-level key."""
    fa, fb = tables.flatten(a), tables.flatten(b)
    keys = sorted(k for k in set(fa) | set(fb) if k.split(".")[0] not in ignore)
    return [(k, fa.get(k), fb.get(k)) for k in keys if fa.get(k) != fb.get(k)]


def judge(value_a: float, value_b: float, spread: Spread) -> dict[str, Any]:
    """One quantity of one pair: both values, the difference and whether it is inside the spread."""
    row = {"column": spread.column, "label": spread.label, "a": value_a, "b": value_b,
           "tolerance": spread.tolerance, "relative": spread.relative}
    if math.isnan(value_a) and math.isnan(value_b):
        return {**row, "difference": math.nan, "verdict": "not measured"}
    if math.isnan(value_a) or math.isnan(value_b):
        return {**row, "difference": math.nan, "verdict": "measured on one side only"}
    if spread.relative:
        diff = value_b / value_a - 1 if value_a else (0.0 if value_b == 0 else math.inf)
    else:
        diff = value_b - value_a
    # A hair of float slack, so a difference equal to the spread counts as inside it.
    verdict = "within" if abs(diff) <= spread.tolerance + 1e-12 else "exceeds"
    return {**row, "difference": diff, "verdict": verdict}


def _rows(folders: Mapping[str, Path]) -> tuple[dict[str, dict[str, Any]], dict[str, tables.RunArtifacts], list[str]]:
    runs, incomplete = [], []
    for run_id, folder in folders.items():
        try:
            runs.append(tables.load_run(folder))
        except tables.ReportError as exc:
            incomplete.append(f"{run_id}: {exc}")
    rows = {r["run"]: r for r in tables.scaling_rows(runs)} if runs else {}
    return rows, {r.point.run_id: r for r in runs}, incomplete


def compare(results_a: str | Path, results_b: str | Path,
            overrides: Mapping[str, float] | None = None) -> Comparison:
    """Compare the runs two results folders have in common (see the module's docstring)."""
    spreads = tuple(replace(s, tolerance=overrides[s.column]) if overrides and s.column in overrides else s
                    for s in SPREADS)
    folders_a, folders_b = run_folders(results_a), run_folders(results_b)
    rows_a, runs_a, bad_a = _rows(folders_a)
    rows_b, runs_b, bad_b = _rows(folders_b)
    common = sorted(set(rows_a) & set(rows_b))
    pairs = []
    for run_id in common:
        ra, rb = runs_a[run_id], runs_b[run_id]
        pair = PairResult(
            run_id,
            config_changes=_changes(ra.run_config, rb.run_config, IGNORED_CONFIG_KEYS),
            env_changes=_changes(ra.env, rb.env, IGNORED_ENV_KEYS),
        )
        for spread in spreads:
            pair.quantities.append(judge(float(rows_a[run_id][spread.column]), float(rows_b[run_id][spread.column]),
                                         spread))
        pairs.append(pair)
    return Comparison(Path(results_a), Path(results_b), pairs,
                      only_a=sorted(set(rows_a) - set(rows_b)), only_b=sorted(set(rows_b) - set(rows_a)),
                      incomplete=[f"A {m}" for m in bad_a] + [f"B {m}" for m in bad_b], spreads=spreads)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _difference(q: Mapping[str, Any]) -> str:
    if math.isnan(q["difference"]):
        return "n/a"
    return f"{q['difference']:+.1%}" if q["relative"] else f"{q['difference']:+.3f}"


def _tolerance(tolerance: float, relative: bool) -> str:
    return f"±{tolerance:.0%}" if relative else f"±{tolerance:.3f}"


def summary(result: Comparison) -> str:
    """The human-readable verdict printed at the end of ``detscale compare``."""
    lines = [f"compared {len(result.pairs)} run(s) present in both {result.a} and {result.b}"]
    exceeded = [(p.run_id, q) for p in result.pairs for q in p.exceeded]
    changed = [p.run_id for p in result.pairs if p.config_changes]
    if changed:
        lines.append(f"  {len(changed)} run(s) trained with a different config (not a reproduction): "
                     + ", ".join(changed))
    env_keys = sorted({k for p in result.pairs for k, _, _ in p.env_changes})
    if env_keys:
        lines.append("  environments differ in: " + ", ".join(env_keys))
    if not result.pairs:
        lines.append("  no finished run is in both folders: nothing was compared")
    elif exceeded:
        lines.append(f"  {len(exceeded)} difference(s) beyond the stated spread:")
        lines += [f"    {run}: {q['label']} {_fmt(q['a'])} -> {_fmt(q['b'])} ({_difference(q)}, spread "
                  f"{_tolerance(q['tolerance'], q['relative'])})" for run, q in exceeded]
    else:
        lines.append("  every measured quantity is within its stated spread: reproduced")
    for name, ids in (("only in A", result.only_a), ("only in B", result.only_b)):
        if ids:
            lines.append(f"  {name}: {', '.join(ids)}")
    if result.incomplete:
        lines.append(f"  not compared (incomplete): {len(result.incomplete)} run(s); see the report")
    return "\n".join(lines)


def markdown(result: Comparison) -> str:
    """The whole comparison: spreads, and per run its config, environment and quantity tables."""
    out = [f"# Comparison of {result.a} (A) and {result.b} (B)", "",
           "Runs matched by run id. A quantity 'exceeds' when |B/A − 1| (relative) or |B − A| (absolute) is larger "
           "than the spread stated for it below; 'within' means the run was reproduced in that quantity.", "",
           "| quantity | spread | why this spread |", "|---|---|---|"]
    out += [f"| {s.label} | {_tolerance(s.tolerance, s.relative)} | {s.why} |" for s in result.spreads]
    for pair in result.pairs:
        out += ["", f"## {pair.run_id}", ""]
        if pair.config_changes:
            out += ["Config differs (another experiment, not a reproduction):", ""]
            out += [f"- `{k}`: {_fmt(a)} → {_fmt(b)}" for k, a, b in pair.config_changes] + [""]
        if pair.env_changes:
            out += ["Environment differs:", ""]
            out += [f"- `{k}`: {_fmt(a)} → {_fmt(b)}" for k, a, b in pair.env_changes] + [""]
        out += ["| quantity | A | B | difference | spread | verdict |", "|---|---:|---:|---:|---:|---|"]
        for q in pair.quantities:
            verdict = "**exceeds**" if q["verdict"] == "exceeds" else q["verdict"]
            out.append(f"| {q['label']} | {_fmt(q['a'])} | {_fmt(q['b'])} | {_difference(q)} | "
                       f"{_tolerance(q['tolerance'], q['relative'])} | {verdict} |")
    for name, ids in (("Only in A", result.only_a), ("Only in B", result.only_b)):
        if ids:
            out += ["", f"## {name}", "", *(f"- {i}" for i in ids)]
    if result.incomplete:
        out += ["", "## Not compared", "", *(f"- {m}" for m in result.incomplete)]
    return "\n".join(out) + "\n"
