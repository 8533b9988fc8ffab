"""Scaling projection: step time and efficiency for more GPUs and nodes than were measured.

From the measured 1-GPU run of a point (its step breakdown and CPU demand) and the gradient's
all-reduce (DDP's buckets, an alpha-beta model per fabric), the step of ``g`` GPUs per node on
``m`` nodes is predicted as

    step(g, m) = max(T * c + exposed(g * m), g * (cpu * c + loader * b + comm_cpu) / cores)

- ``T``: the measured 1-GPU step (data wait included), scaled by ``f = b / b1`` to the batch per
  GPU of the projected point (1 for weak scaling), with its optimiser share re-counted for the
  accumulation of ``g * m`` GPUs: with a nominal batch, 1 GPU accumulating ``a1`` batches steps
  the optimiser once per ``a1`` batches, N GPUs once per ``aN = max(round(a1 b1 / (N b)), 1)``,
  so the optimiser's time per batch grows by ``a1 / aN`` (the breakdown is per batch);
- ``c``: the slowdown of a rank's own work when ``g`` ranks of a node compute at the same time
  (shared caches, memory bandwidth, the host side of the cards), measured by the communication
  benchmark's contention probe on that many ranks (1 for one rank; the largest measured count
  beyond it);
- the second term is a roofline on the node's CPU cores: every rank's process needs ``cpu`` CPU
  milliseconds per step (re-counted for the accumulation as ``T``, and slowed by ``c`` less the
  part of it that is waiting for a core when CPU ranks outnumber the cores) and its loader workers
  ``loader`` per image (both measured in the 1-GPU run, ``/proc`` and ``process_time``);
  ``cores`` is what the measured host gave the run. On a GPU host it is the data loader's
  ceiling; on the CPU analogue here it is also the contention of the ranks themselves for cores,
  and there the all-reduce itself is CPU work (``comm_cpu``, its modelled time; 0 on GPUs);
- ``exposed``: the all-reduce time the backward does not hide. DDP hands its buckets to the
  all-reduce as their gradients are ready, one after another on one stream; bucket ``k`` is taken
  to be ready when the backward has produced its share of the gradient bytes, and what is still
  running when the backward ends is exposed. One bucket (a small model) is exposed whole.
  An all-reduce of ``S`` bytes on ``n`` ranks takes ``latency + S * 2 (n - 1) / n / busbw``
  (nccl-tests' bus bandwidth); across nodes the slower of the two fabrics sets latency and
  bandwidth.

What it leaves out: the all-reduce slowing the backward it overlaps (shared memory bandwidth or
SMs), stragglers, and the loader's own memory bandwidth. Its error on every measured point is
reported beside it, with an interval: the projection recomputed with each measured input at the
end of its spread (the 1-GPU step over its runs, the contention probe over its rounds, the
all-reduce over its rounds). A point outside its interval is explained by the step term whose
projected and measured milliseconds differ most (:meth:`Check.off_term`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from detscale.engine.semantics import accumulate_steps


@dataclass(frozen=True)
class Fabric:
    name: str
    latency_s: float
    busbw_Bps: float
    source: str

    def allreduce_s(self, nbytes: float, ranks: int) -> float:
        if ranks < 2:
            return 0.0
        return self.latency_s + nbytes * 2 * (ranks - 1) / ranks / self.busbw_Bps


def fabric_from_config(name: str, fabrics: Mapping[str, Mapping[str, Any]]) -> Fabric:
    f = fabrics[name]
    return Fabric(name, float(f["latency_us"]) * 1e-6, float(f["busbw_GBps"]) * 1e9, str(f["source"]))


def fabric_from_comm(comm: Mapping[str, Any]) -> Fabric:
    """The alpha-beta fit of a communication benchmark (``detscale comm``)."""
    fit = comm["fit"]
    return Fabric(f"measured ({comm['backend']}, {comm['world_size']} {comm['device']} ranks)",
                  float(fit["latency_us"]) * 1e-6, float(fit["busbw_GBps"]) * 1e9,
                  f"detscale comm: all-reduce sweep 4 KiB..64 MiB on {comm['world_size']} {comm['device']} ranks "
                  f"({comm['backend']}), least-squares fit")


def fabric_from_preflight(record: Mapping[str, Any]) -> Fabric:
    """The alpha-beta fit of a multi-node run's network preflight (``preflight.json``: an all-reduce
    sweep with one rank per node, :mod:`detscale.cluster.preflight`)."""
    import numpy as np

    nodes = len(record["nodes"])
    rows = record["allreduce"]
    sizes = np.asarray([float(r["bytes"]) * 2 * (nodes - 1) / nodes for r in rows])
    seconds = np.asarray([float(r["seconds"]) for r in rows])
    slope, intercept = np.polyfit(sizes, seconds, 1) if len(rows) > 1 else (seconds[0] / sizes[0], 0.0)
    busbw = 1.0 / slope if slope > 0 else max(float(r["bus_gbps"]) for r in rows) * 1e9
    hosts = ", ".join(n["host"] for n in record["nodes"])
    interfaces = ", ".join(sorted({n["interface"] for n in record["nodes"]}))
    return Fabric(f"measured (preflight, {nodes} nodes)", max(float(intercept), 0.0), float(busbw),
                  f"network preflight of {hosts} over {interfaces}: gloo all-reduce sweep "
                  f"{int(rows[0]['bytes']) // 1024} KiB..{int(rows[-1]['bytes']) // 2**20} MiB, one rank per node, "
                  "least-squares fit (gloo on the hosts: NCCL over the same links is usually faster)")


def exposed_comm_s(buckets: Sequence[int], backward_s: float, ranks: int, fabric: Fabric) -> float:
    """All-reduce time left after the backward ends (buckets ready in proportion to their bytes)."""
    if ranks < 2 or not buckets:
        return 0.0
    total = float(sum(buckets))
    end = ready = 0.0
    for size in buckets:
        ready += backward_s * size / total
        end = max(end, ready) + fabric.allreduce_s(size, ranks)
    return max(end - backward_s, 0.0)


@dataclass(frozen=True)
class Baseline:
    """What the projection needs of a point's measured 1-GPU run (medians over its seeds and repeats)."""

    step_s: float
    backward_s: float
    batch: int
    cpu_s: float | None  # CPU seconds of the rank's process per step
    loader_s_per_image: float  # CPU seconds of its loader workers per image (0 without workers)
    cores: int
    device: str
    scaling: str  # weak: the batch per GPU stays; strong: the global batch stays
    optimizer_s: float = 0.0  # optimiser + EMA per batch (one optimiser step per `accumulate` batches)
    accumulate: int = 1
    forward_s: float = math.nan  # forward and loss per batch
    threads: int = 1  # torch threads of a CPU rank
    #: the spread of the 1-GPU step over the baseline's runs (seeds, repeats): min / median, max / median
    step_spread: tuple[float, float] = (1.0, 1.0)
    mfu: float = math.nan  # the 1-GPU run's model FLOPs utilisation (nan: not recorded)

    def scaled(self, factor: float) -> Baseline:
        """The same baseline with its own work ``factor`` times as long (the ends of its measured spread)."""
        return replace(self, step_s=self.step_s * factor, backward_s=self.backward_s * factor,
                       forward_s=self.forward_s * factor, optimizer_s=self.optimizer_s * factor,
                       cpu_s=None if self.cpu_s is None else self.cpu_s * factor)

    def accumulate_for(self, gpus: int, batch: int) -> int:
        """The trainer's accumulation for ``gpus`` GPUs of ``batch`` images, for the images of one measured
        optimiser step (``accumulate x batch``, the nominal batch rounded to whole batches)."""
        return accumulate_steps(self.accumulate * self.batch, gpus * batch)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> Baseline | None:
        """From the group's 1-GPU rows; ``None`` without a 1-GPU run that measured its breakdown."""
        ones = [r for r in rows if r["gpus"] == 1 and not math.isnan(r.get("backward_ms", math.nan))]
        if not ones:
            return None

        def med(key: str) -> float:
            values = [float(r[key]) for r in ones if r.get(key) is not None and not math.isnan(float(r[key]))]
            return statistics.median(values) if values else math.nan

        cpu = med("cpu_ms_per_step")
        loader = med("loader_cpu_ms_per_image")
        optimizer = med("optimizer_ms")
        accumulate = med("accumulate")
        steps = [float(r["step_ms"]) for r in ones if not math.isnan(float(r["step_ms"]))]
        step = med("step_ms")
        spread = (min(steps) / step, max(steps) / step) if steps and step > 0 else (1.0, 1.0)
        threads = med("threads_per_rank")
        return cls(step_s=step / 1000, backward_s=med("backward_ms") / 1000, forward_s=med("forward_ms") / 1000,
                   step_spread=spread, threads=1 if math.isnan(threads) else int(threads),
                   batch=int(ones[0]["batch_per_gpu"]),
                   cpu_s=None if math.isnan(cpu) else cpu / 1000,
                   loader_s_per_image=0.0 if math.isnan(loader) else loader / 1000,
                   cores=int(ones[0].get("cpu_cores") or 1), device=str(ones[0]["device"]),
                   scaling=str(ones[0]["scaling"]),
                   optimizer_s=0.0 if math.isnan(optimizer) else optimizer / 1000,
                   accumulate=1 if math.isnan(accumulate) else int(accumulate), mfu=med("mfu"))


@dataclass(frozen=True)
class Projected:
    gpus_per_node: int
    nodes: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    cpu_bound: bool
    images_per_s: float
    efficiency: float
    #: a rank's own work per batch, split as the step breakdown measures it (s): forward + backward,
    #: optimiser, data wait and other; their sum is the own-work part of the step
    fwd_bwd_s: float = math.nan
    optimizer_s: float = math.nan
    rest_s: float = math.nan

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


def project(base: Baseline, buckets: Sequence[int], gpus_per_node: int, nodes: int, intra: Fabric,
            inter: Fabric, contention: float = 1.0) -> Projected:
    """The predicted step of ``gpus_per_node`` GPUs on each of ``nodes`` nodes (see the module docstring).

    ``contention``: the slowdown of a rank's work with ``gpus_per_node`` ranks busy on its node.
    """
    n = gpus_per_node * nodes
    batch = base.batch if base.scaling == "weak" else max(base.batch // n, 1)
    f = batch / base.batch
    c = contention if gpus_per_node > 1 else 1.0
    # the optimiser's time per batch for this accumulation (it steps once per `acc` batches)
    extra_optimizer = base.optimizer_s * (base.accumulate / base.accumulate_for(n, batch) - 1)
    own = (base.step_s + extra_optimizer) * f * c
    if nodes > 1:
        fabric = Fabric(f"{intra.name} + {inter.name}", max(intra.latency_s, inter.latency_s),
                        min(intra.busbw_Bps if gpus_per_node > 1 else math.inf, inter.busbw_Bps), "")
    else:
        fabric = intra
    exposed = exposed_comm_s(buckets, base.backward_s * f * c, n, fabric)
    cpu_bound = 0.0
    if base.cpu_s is not None:
        comm_cpu = sum(fabric.allreduce_s(b, n) for b in buckets) if base.device == "cpu" else 0.0
        # CPU ranks that outnumber the cores: the probe's slowdown then includes waiting for a core (wall
        # time, not CPU time), which the roofline counts itself; its CPU seconds grow by the rest only.
        share = gpus_per_node * base.threads / base.cores if base.device == "cpu" else 1.0
        cpu_c = max(c / share, 1.0) if share > 1 else c
        cpu_bound = gpus_per_node * ((base.cpu_s + extra_optimizer) * f * cpu_c + base.loader_s_per_image * batch
                                     + comm_cpu) / base.cores
    step = max(own + exposed, cpu_bound)
    ips = n * batch / step
    ips1 = base.batch / base.step_s
    fwd_bwd = base.forward_s + base.backward_s
    return Projected(gpus_per_node, nodes, step, max(own, cpu_bound), exposed, cpu_bound > own + exposed,
                     ips, ips / (n * ips1), fwd_bwd_s=fwd_bwd * f * c,
                     optimizer_s=(base.optimizer_s + extra_optimizer) * f * c,
                     rest_s=(base.step_s - fwd_bwd - base.optimizer_s) * f * c)


@dataclass(frozen=True)
class Check:
    """A measured point against its projection: the projected img/s with the interval that the spread of its
    inputs gives (the 1-GPU step over its runs, the contention probe over its rounds, the all-reduce over its
    rounds), and the step's terms, projected and measured (ms), to tell which one is off when it falls outside."""

    gpus: int
    measured: float
    projected: float
    low: float
    high: float
    #: (term, projected ms, measured ms) for the terms the step breakdown measures
    terms: tuple[tuple[str, float, float], ...] = ()
    cpu_bound: bool = False
    oversubscribed: bool = False  # more busy threads than the host's cores (CPU ranks)

    @property
    def error(self) -> float:
        return (self.projected - self.measured) / self.measured

    @property
    def inside(self) -> bool:
        slack = 1e-9 * self.measured  # the 1-GPU point equals its projection up to float rounding
        return self.low - slack <= self.measured <= self.high + slack

    def off_term(self) -> str:
        """Why a point outside its interval is off: the term with the largest miss, in words."""
        if self.inside:
            return ""
        known = [(name, p, m) for name, p, m in self.terms if not (math.isnan(p) or math.isnan(m))]
        if not known:
            return "no step breakdown of the measured run: run it with train.step_breakdown"
        name, projected, measured = max(known, key=lambda t: abs(t[2] - t[1]))
        text = f"{name}: {measured:.1f} ms measured, {projected:.1f} ms projected"
        if self.cpu_bound:
            text += " (the projection is bound by the CPU roofline here)"
        return text


@dataclass
class GroupProjection:
    group: str
    intra: Fabric
    inter: Fabric
    grid: list[Projected]
    #: every measured single-node GPU count against its projection
    checks: list[Check]
    gradient_bytes: int
    buckets: int
    #: ranks per node -> measured slowdown of a rank's work with that many busy (contention probe, median)
    contention: dict[int, float] = field(default_factory=dict)
    accumulate: int = 1
    #: ranks per node -> (lowest, highest) slowdown over the probe's rounds
    contention_range: dict[int, tuple[float, float]] = field(default_factory=dict)
    mfu: float = math.nan  # the 1-GPU run's MFU; a projected point's is this x its efficiency


def contention_by_ranks(comm: Sequence[Mapping[str, Any]]) -> dict[int, float]:
    """Ranks -> the contention probe's slowdown, from the communication benchmarks that ran it."""
    return {int(c["world_size"]): float(c["contention"]["factor"]) for c in comm if c.get("contention")}


def contention_range_by_ranks(comm: Sequence[Mapping[str, Any]]) -> dict[int, tuple[float, float]]:
    """Ranks -> (lowest, highest) slowdown over the probe's rounds (the median twice for a probe of one round)."""
    out = {}
    for c in comm:
        probe = c.get("contention")
        if probe:
            factor = float(probe["factor"])
            out[int(c["world_size"])] = (float(probe.get("factor_min", factor)), float(probe.get("factor_max", factor)))
    return out


def comm_spread(result: Mapping[str, Any]) -> tuple[float, float]:
    """The all-reduce's spread over its timed rounds: p10 / median and p90 / median of the bucket round."""
    median = float(result["time_ms"])
    if median <= 0:
        return 1.0, 1.0
    return float(result.get("time_ms_p10", median)) / median, float(result.get("time_ms_p90", median)) / median


def slower(fabric: Fabric, factor: float) -> Fabric:
    """``fabric`` with every all-reduce ``factor`` times as long."""
    return Fabric(fabric.name, fabric.latency_s * factor, fabric.busbw_Bps / factor, fabric.source)


def _measured_for(by_ranks: Mapping[int, Any], ranks: int, default: Any) -> Any:
    """The value measured for ``ranks``, else for the largest count measured below it; ``default`` for one
    rank or when nothing at or below ``ranks`` was measured."""
    below = [k for k in by_ranks if k <= ranks]
    return by_ranks[max(below)] if ranks >= 2 and below else default


def contention_for(slowdown: Mapping[int, float], ranks: int) -> float:
    """The slowdown of ``ranks`` busy ranks: measured for that count, else the largest count measured below it."""
    return _measured_for(slowdown, ranks, 1.0)


def contention_range_for(ranges: Mapping[int, tuple[float, float]], ranks: int) -> tuple[float, float]:
    """:func:`contention_for` of the probe's (lowest, highest) round."""
    return _measured_for(ranges, ranks, (1.0, 1.0))


def _comm_for(comm: Sequence[Mapping[str, Any]], model: str, imgsz: int) -> list[Mapping[str, Any]]:
    return sorted((c for c in comm if c["model"] == model and int(c["imgsz"]) == imgsz), key=lambda c: c["world_size"])


def project_groups(rows: Sequence[Mapping[str, Any]], comm: Sequence[Mapping[str, Any]],
                   pcfg: Any, preflights: Sequence[Mapping[str, Any]] = ()) -> tuple[list[GroupProjection], list[str]]:
    """A projection per group that has a 1-GPU run with a breakdown and a communication benchmark; and why
    the others have none. ``preflights``: the multi-node runs' network preflights (``inter_node: measured``
    takes the one of the most nodes)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    out, skipped = [], []
    if pcfg.inter_node == "measured" and not preflights:
        return [], [f"{group}: projection.inter_node is 'measured' but no run of these results went through a "
                    "multi-node network preflight (preflight.json); name a fabric instead" for group in groups]
    for group, members in groups.items():
        base = Baseline.from_rows(members)
        if base is None:
            skipped.append(f"{group}: no 1-GPU run with a step breakdown (train.step_breakdown)")
            continue
        results = _comm_for(comm, str(members[0]["model"]), int(members[0]["imgsz"]))
        if not results:
            skipped.append(f"{group}: no communication benchmark of its model (the grid has no run of 2 or more "
                           "GPUs on one node)")
            continue
        largest = results[-1]
        if pcfg.intra_node == "measured":
            intra = fabric_from_comm(largest)
        else:
            intra = fabric_from_config(pcfg.intra_node, pcfg.fabrics)
        if pcfg.inter_node == "measured":
            inter = fabric_from_preflight(max(preflights, key=lambda p: len(p["nodes"])))
        else:
            inter = fabric_from_config(pcfg.inter_node, pcfg.fabrics)
        buckets = [int(b) for b in largest["bucket_bytes"]]
        slowdown = contention_by_ranks(results)
        grid = [project(base, buckets, g, m, intra, inter, contention_for(slowdown, g))
                for m in pcfg.nodes for g in pcfg.gpus_per_node]
        ranges = contention_range_by_ranks(results)
        checks = [check_point(base, buckets, gpus, [r for r in members if int(r["gpus"]) == gpus],
                              next((c for c in results if int(c["world_size"]) == gpus), largest), inter,
                              contention_for(slowdown, gpus), contention_range_for(ranges, gpus))
                  for gpus in sorted({int(r["gpus"]) for r in members if int(r["nodes"]) == 1})]
        out.append(GroupProjection(group, intra, inter, grid, checks, int(largest["gradient_bytes"]), len(buckets),
                                   slowdown, base.accumulate, ranges, base.mfu))
    return out, skipped


def _median_of(rows: Sequence[Mapping[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None and not math.isnan(float(r[key]))]
    return statistics.median(values) if values else math.nan


def _oversubscribed(rows: Sequence[Mapping[str, Any]]) -> bool:
    """CPU ranks whose compute threads alone outnumber the cores the host gave the run (loader workers, which
    mostly wait on a cache, are left out: the report's contention note counts them)."""
    r = rows[0]
    threads = float(r.get("threads_per_rank", math.nan))
    if r.get("device") != "cpu" or math.isnan(threads) or not r.get("cpu_cores"):
        return False
    return int(r["gpus"]) // int(r.get("nodes", 1)) * int(threads) > int(r["cpu_cores"])


def check_point(base: Baseline, buckets: Sequence[int], gpus: int, rows: Sequence[Mapping[str, Any]],
                own_comm: Mapping[str, Any], inter: Fabric, contention: float,
                contention_range: tuple[float, float]) -> Check:
    """The measured ``gpus``-GPU point (its runs ``rows``) against its projection and interval.

    The point is predicted with the fabric it ran on (its own rank count's communication benchmark).
    The interval's ends combine the ends of every input's measured spread in the same direction: the
    1-GPU step (min and max over the baseline's runs), the contention probe (lowest and highest round)
    and the all-reduce (p10 and p90 of its rounds).
    """
    fabric = fabric_from_comm(own_comm)
    lo_comm, hi_comm = comm_spread(own_comm)
    lo_step, hi_step = base.step_spread
    lo_c, hi_c = contention_range
    point = project(base, buckets, gpus, 1, fabric, inter, contention)
    fast = project(base.scaled(lo_step), buckets, gpus, 1, slower(fabric, lo_comm), inter, min(lo_c, contention))
    slow = project(base.scaled(hi_step), buckets, gpus, 1, slower(fabric, hi_comm), inter, max(hi_c, contention))
    measured = statistics.median(float(r["images_per_s"]) for r in rows)

    # The step's terms (ms per batch): projected as `project` composed them, measured by the breakdown.
    m_fb = _median_of(rows, "forward_ms") + _median_of(rows, "backward_ms")
    m_comm, m_opt, m_step = (_median_of(rows, k) for k in ("comm_ms", "optimizer_ms", "step_ms"))
    terms = (
        ("compute under contention (forward + backward)", 1000 * point.fwd_bwd_s, m_fb),
        ("exposed communication", 1000 * point.exposed_comm_s, m_comm),
        ("optimiser share", 1000 * point.optimizer_s, m_opt),
        ("data wait and other", 1000 * point.rest_s, m_step - m_fb - m_comm - m_opt),
    )
    return Check(gpus, measured, point.images_per_s, min(slow.images_per_s, fast.images_per_s),
                 max(slow.images_per_s, fast.images_per_s), terms, point.cpu_bound, _oversubscribed(rows))


def checks_table(checks: Sequence[Check]) -> tuple[list[str], list[list[str]]]:
    """Every measured point against its projection (header, body), for the Markdown and HTML reports."""
    header = ["measured GPUs", "measured img/s", "projected img/s (interval)", "error", "inside the interval",
              "if not: the term that is off"]
    body = [[f"{k.gpus}{' (oversubscribed)' if k.oversubscribed else ''}", f"{k.measured:.1f}",
             f"{k.projected:.1f} ({k.low:.1f}–{k.high:.1f})", f"{k.error:+.1%}", "yes" if k.inside else "no",
             k.off_term() or "—"] for k in checks]
    return header, body


INTERVAL_METHOD = ("Interval: the projection recomputed with every input at the end of its measured spread, in the "
                   "same direction: the 1-GPU step (min and max over the baseline's runs), the contention probe "
                   "(lowest and highest of its rounds, each round a rank alone then all ranks together) and the "
                   "all-reduce (p10 and p90 of its timed rounds). A measured point outside it names the step term "
                   "(from its step breakdown) that misses most.")


def markdown(projections: Sequence[GroupProjection], skipped: Sequence[str]) -> list[str]:
    lines = ["", "## Scaling projection", ""]
    for p in projections:
        lines += [f"### {p.group}", "",
                  f"Gradient {p.gradient_bytes / 2**20:.1f} MiB in {p.buckets} DDP bucket(s); within a node: "
                  f"{p.intra.name} (latency {p.intra.latency_s * 1e6:.0f} us, busbw {p.intra.busbw_Bps / 1e9:.2f} "
                  f"GB/s); between nodes: {p.inter.name} ({p.inter.latency_s * 1e6:.0f} us, "
                  f"{p.inter.busbw_Bps / 1e9:.1f} GB/s; {p.inter.source}).",
                  "Contention (a rank's own work with all ranks of a node busy, measured by the communication "
                  "benchmark, median of its rounds, lowest–highest round): "
                  + (", ".join(f"x{v:.3f} (x{p.contention_range.get(k, (v, v))[0]:.3f}–"
                               f"x{p.contention_range.get(k, (v, v))[1]:.3f}) at {k} ranks"
                               for k, v in sorted(p.contention.items()))
                                    or "not measured (x1)") + "; beyond the largest measured count the same factor."
                  + (f" The 1-GPU run accumulated {p.accumulate} batches per optimiser step: fewer at more GPUs, "
                     "so the optimiser's share of a batch grows." if p.accumulate > 1 else ""), ""]
        header, body = checks_table(p.checks)
        body = [[f"**{cell}**" if cell == "no" else cell for cell in row] for row in body]  # a miss stands out
        lines += [INTERVAL_METHOD, "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|",
                  *("| " + " | ".join(row) + " |" for row in body)]
        gpn = sorted({x.gpus_per_node for x in p.grid})
        mfu = not math.isnan(p.mfu)
        lines += ["", f"Projected img/s (efficiency{'; MFU' if mfu else ''}) by GPUs per node (columns) and nodes "
                  "(rows); * marks a step bound by the node's CPU cores"
                  + (f". MFU = the 1-GPU run's ({p.mfu:.1%}) × efficiency: against the peak one GPU measured alone"
                     if mfu else "") + ":", "",
                  "| nodes | " + " | ".join(f"{g}/node" for g in gpn) + " |", "|---" * (len(gpn) + 1) + "|"]
        for m in sorted({x.nodes for x in p.grid}):
            cells = {x.gpus_per_node: x for x in p.grid if x.nodes == m}
            lines.append(f"| {m} | " + " | ".join(
                f"{cells[g].images_per_s:.0f} ({cells[g].efficiency:.2f}"
                f"{f'; {p.mfu * cells[g].efficiency:.1%}' if mfu else ''}){'*' if cells[g].cpu_bound else ''}"
                for g in gpn) + " |")
        lines.append("")
    lines += [f"No projection for {s}." for s in skipped]
    return lines
