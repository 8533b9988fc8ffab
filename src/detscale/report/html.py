"""The self-contained ``index.html``: tables, plots (base64 PNG), environment, config, methods.

Nothing is loaded from outside the file (no scripts, stylesheets, fonts or image links), so the
report can be mailed or archived as one file.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detscale.report import reference, tables
from detscale.report.communication import COMM_METHOD, comm_rows
from detscale.report.projection import INTERVAL_METHOD, checks_table

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 75em; padding: 0 1em; color: #222; }
h1, h2, h3 { font-weight: 600; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f2f2f2; }
td.l, th.l { text-align: left; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.note { background: #fff6d6; border-left: 4px solid #e0b000; padding: 0.5em 1em; }
figure { display: inline-block; margin: 0.5em; vertical-align: top; }
figure img { max-width: 36em; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #555; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def table(header: Sequence[str], body: Sequence[Sequence[Any]], left: int = 0) -> str:
    """An HTML table; the first ``left`` columns are left-aligned (text), the rest right-aligned."""
    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{_e(v)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    rows = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def image(path: Path, caption: str) -> str:
    """A figure with the PNG embedded as a data URI."""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def environment_table(envs: Mapping[str, Mapping[str, Any]]) -> str:
    """env.json of every run: one column per run, or one value column when all runs agree."""
    flat = {run: tables.flatten(env) for run, env in envs.items()}
    keys = sorted({k for env in flat.values() for k in env})
    runs = list(flat)
    same = all(len({repr(flat[r].get(k)) for r in runs}) == 1 for k in keys)
    if same and runs:
        return table(["key", "value (all runs)"], [[k, flat[runs[0]].get(k, "")] for k in keys], left=2)
    return table(["key", *runs], [[k, *(flat[r].get(k, "") for r in runs)] for k in keys], left=len(runs) + 1)


def render(
    rows: Sequence[Mapping[str, Any]],
    plots: Mapping[str, Path],
    notes: Sequence[str],
    methods: Sequence[str],
    envs: Mapping[str, Mapping[str, Any]],
    config_text: str,
    config_path: str,
    run_configs: Mapping[str, str],
    deltas: Sequence[Any] = (),
    comm: Sequence[Mapping[str, Any]] = (),
    projections: Sequence[Any] = (),
    no_projection: Sequence[str] = (),
    tips: Sequence[Any] = (),
    published: Sequence[Any] = (),
    drawn: Sequence[Any] = (),
) -> str:
    """The whole page as a string (``deltas``: :class:`~detscale.report.accuracy.PairedDelta` per point)."""
    from detscale.report.plots import PLOTS

    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>detscale scaling report</title>',
        f"<style>{CSS}</style></head><body>",
        "<h1>detscale scaling report</h1>",
        "<p>What do N GPUs buy, and does it cost accuracy?</p>",
    ]
    parts += [f'<p class="note">{_e(n)}</p>' for n in notes]
    parts.append("<h2>Results by experiment point</h2>")
    parts.append("<p>With several runs of a point (seeds, repeats), each cell is the median and (min–max) over them."
                 "</p>")
    for group, entries in tables.summary(rows).items():
        parts.append(f"<h3>{_e(group)}</h3>")
        base = entries[0]["runs"][0]["baseline_gpus"]
        if base != 1:
            parts.append(f'<p class="note">No 1-GPU run in this group: speed-up, efficiency and Δ mAP are '
                         f"relative to {_e(base)} GPUs.</p>")
        header, body = tables.summary_table(entries)
        parts.append(table(header, body))
    parts.append("<h2>Does DDP cost accuracy?</h2>")
    if deltas:
        parts.append("<ul>" + "".join(f"<li>{_e(d.verdict())}</li>" for d in deltas) + "</ul>")
        header = ["point", "GPUs", "metric", "seeds", "Δ per seed", "mean Δ", "95 % CI"]
        body = [[d.group, f"{d.gpus} vs {d.baseline_gpus}", d.label, ", ".join(map(str, d.seeds)),
                 ", ".join(f"{v:+.3f}" for v in d.deltas), f"{d.mean:+.3f}",
                 "n/a (one seed)" if d.n < 2 else f"{d.low:+.3f}..{d.high:+.3f}"] for d in deltas]
        parts.append(table(header, body, left=4))
    else:
        parts.append("<p>No experiment point has both a baseline and a multi-GPU run: nothing to compare.</p>")
    parts.append("<h2>Advice on the bottleneck</h2>")
    if tips:
        parts.append("<ul>" + "".join(f"<li><code>{_e(t.run)}</code> ({_e(t.rule)}): {_e(t.message)}</li>"
                                      for t in tips) + "</ul>")
    else:
        parts.append("<p>No run has a bottleneck above the thresholds (data wait, exposed communication, optimiser, "
                     "launch-bound step, CPU contention).</p>")
    parts += communication_section(comm, projections, no_projection)
    parts.append("<h2>Plots</h2>")
    parts += [image(path, PLOTS.get(name, name)) for name, path in plots.items()]
    parts += [f"<h2>{_e(reference.HEADING)}</h2>", f"<p>{_e(reference.intro(drawn))}</p>",
              table(reference.HEADER, reference.rows(published), left=3)]
    parts.append("<h2>Every run</h2>")
    cols = ["run", "gpus", "seed", "global_batch", "images_per_s", "speedup", "efficiency", "data_wait_share",
            "peak_mem_gb_per_gpu", "epoch_seconds", "map50", "map50_95", "delta_map50_95_vs_1gpu", "time_to_target_s",
            "time_to_target_speedup"]
    parts.append(table(cols, [[_fmt(r[c]) for c in cols] for r in rows], left=1))
    parts.append("<p>All measured fields: <code>scaling.csv</code> beside this page.</p>")
    parts.append("<h2>How every number was measured</h2><ul>")
    parts += [f"<li>{_e(m)}</li>" for m in methods]
    parts.append("</ul>")
    parts.append("<h2>Environment</h2>")
    parts.append(environment_table(envs))
    parts.append(f"<h2>Configuration</h2><p>The experiment config <code>{_e(config_path)}</code>, exactly:</p>")
    parts.append(f"<pre>{_e(config_text)}</pre>")
    for run, text in run_configs.items():
        parts.append(f"<details><summary>frozen config of run <code>{_e(run)}</code> (with the derived training "
                     f"semantics)</summary><pre>{_e(text)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def communication_section(comm: Sequence[Mapping[str, Any]], projections: Sequence[Any],
                          no_projection: Sequence[str]) -> list[str]:
    """The communication benchmark's table and the scaling projection (its error on the measured points)."""

    parts = ["<h2>Communication</h2>"]
    if comm:
        parts.append(f"<p>{_e(COMM_METHOD)}</p>")
        header, body = comm_rows(comm)
        parts.append(table(header, body, left=4))
    else:
        parts.append("<p>No communication benchmark: the grid has no point of 2 or more GPUs on one node.</p>")
    parts.append("<h2>Scaling projection</h2>")
    parts.append("<p>Step time predicted from the 1-GPU run's measured step and CPU demand, the gradient's "
                 "all-reduce (alpha-beta model, DDP's buckets overlapping the backward) and a roofline on the "
                 "node's CPU cores (detscale.report.projection). At 1 GPU it equals the measurement by "
                 "construction; the error column says how well it predicts the other measured points.</p>")
    for p in projections:
        parts.append(f"<h3>{_e(p.group)}</h3>")
        parts.append(f"<p>Gradient {p.gradient_bytes / 2**20:.1f} MiB in {p.buckets} DDP bucket(s). Within a node: "
                     f"{_e(p.intra.name)}, latency {p.intra.latency_s * 1e6:.0f} µs, busbw "
                     f"{p.intra.busbw_Bps / 1e9:.2f} GB/s ({_e(p.intra.source)}). Between nodes: {_e(p.inter.name)}, "
                     f"{p.inter.latency_s * 1e6:.0f} µs, {p.inter.busbw_Bps / 1e9:.1f} GB/s "
                     f"({_e(p.inter.source)}).</p>")
        header, body = checks_table(p.checks)
        parts.append(f"<p>{_e(INTERVAL_METHOD)}</p>")
        parts.append(table(header, body))
        gpn = sorted({x.gpus_per_node for x in p.grid})
        body = []
        for m in sorted({x.nodes for x in p.grid}):
            cells = {x.gpus_per_node: x for x in p.grid if x.nodes == m}
            body.append([m] + [f"{cells[g].images_per_s:.0f} ({cells[g].efficiency:.2f})"
                               f"{' *' if cells[g].cpu_bound else ''}" for g in gpn])
        parts.append("<p>Projected img/s (efficiency) by GPUs per node and nodes; * marks a step bound by the "
                     "node's CPU cores:</p>")
        parts.append(table(["nodes"] + [f"{g} / node" for g in gpn], body))
    parts += [f'<p class="note">No projection for {_e(s)}.</p>' for s in no_projection]
    return parts


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
