"""Do the workflow's Slurm jobs fit the partition? Checked before anything is submitted, and watched after.

A job that asks more CPUs, memory, GPUs, nodes or time than the partition can ever give is
accepted by ``sbatch`` and then pends forever (``Reason=PartitionConfig``), while Snakemake
waits without a word. Two guards, both started by the workflow's ``onstart`` handler when the
Slurm executor is in use (``workflow/rules/common.smk``):

- :func:`check_workflow` compares every job's ask, as the Snakemake Slurm plugin will pass it to
  ``sbatch`` (after the profile's ``default-resources``, ``set-resources`` and ``set-threads``),
  with the partition's nodes as ``sinfo`` and ``scontrol show partition`` report them, and stops
  the workflow before the first ``sbatch`` with a message naming the rule, the ask, the largest
  node and the key to change. ``detscale slurm check`` runs the same check by hand.
- :class:`PendingWatch` polls ``squeue`` for this workflow's jobs; one pending with a reason that
  means it can never start (:data:`NEVER_STARTS`) is cancelled with that reason and the fix, so
  the workflow fails within a minute instead of waiting.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from detscale.cluster.slurm import SlurmError, parse_oneliner

#: Environment variable of ``detscale slurm check``: the workflow checks, writes the verdict to
#: this file and stops before submitting anything.
CHECK_ONLY_ENV = "DETSCALE_SLURM_CHECK_ONLY"
#: Seconds between two ``squeue`` polls of :class:`PendingWatch` (environment override for tests).
WATCH_INTERVAL_ENV = "DETSCALE_SLURM_WATCH_S"

#: Pending reasons that mean a job can never start as submitted, with what they mean.
NEVER_STARTS: dict[str, str] = {
    "PartitionConfig": "it asks more CPUs, memory or GPUs per node than any node of the partition has",
    "PartitionNodeLimit": "it asks more nodes than the partition has or allows (MaxNodes)",
    "PartitionTimeLimit": "its runtime is longer than the partition allows (MaxTime)",
    "PartitionDown": "the partition is DOWN",
    "PartitionInactive": "the partition is INACTIVE",
    "ReqNodeNotAvail": "the nodes it needs are down, drained or reserved",
    "BadConstraints": "no node of the partition satisfies its constraints",
    "InvalidAccount": "the account does not exist",
    "InvalidQOS": "the QOS does not exist or is not allowed",
    "AccountNotAllowed": "the account may not use the partition",
    "QOSNotAllowed": "the QOS may not be used on the partition",
}


class SlurmFitError(SlurmError):
    """A job of the workflow cannot fit the partition it is submitted to."""


# ---------------------------------------------------------------------------------------------
# What a job asks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One Slurm job as the plugin submits it, reduced to what a partition must hold."""

    label: str  # "rule validate_dataset" or "group data (synth_dataset, validate_dataset, ...)"
    rules: tuple[str, ...]
    partition: str | None
    nodes: int
    cpus_per_node: int
    mem_mb_per_node: int | None
    gpus_per_node: int
    runtime_min: int | None
    cpu_source: str  # "threads", "cpus_per_task" or "cpus_per_gpu": where the CPU ask came from


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def ask_from_resources(label: str, rules: Sequence[str], threads: int, resources: Mapping[str, Any]) -> Ask:
    """The ask of a job with ``threads`` and Snakemake ``resources``, as the Slurm plugin turns them into sbatch flags.

    CPUs: ``cpus_per_task`` when set; for a GPU job ``cpus_per_gpu`` x its GPUs per node when set;
    otherwise the job's threads (``--cpus-per-task``). Memory: ``mem_mb`` per node, or
    ``mem_mb_per_cpu`` x CPUs. GPUs: the ``gpu`` resource spread over ``nodes``, or
    ``--gpus-per-node`` in ``slurm_extra``. Runtime in minutes.
    """
    nodes = max(1, _int(resources.get("nodes"), 1))
    gpus = _int(resources.get("gpu"))
    extra = str(resources.get("slurm_extra") or "")
    per_node = re.search(r"--gpus-per-node[= ](?:[A-Za-z0-9_]+:)?(\d+)", extra)
    gpus_per_node = int(per_node.group(1)) if per_node else -(-gpus // nodes)
    tasks = max(1, _int(resources.get("tasks"), 1))
    tasks_per_node = -(-tasks // nodes)
    if resources.get("cpus_per_task") is not None:
        cpus, source = max(1, _int(resources["cpus_per_task"])) * tasks_per_node, "cpus_per_task"
    elif gpus_per_node and resources.get("cpus_per_gpu") is not None:
        # cpus_per_gpu <= 0: the plugin passes no CPU flag, and Slurm gives one CPU per task
        per_gpu = _int(resources["cpus_per_gpu"])
        cpus, source = (per_gpu * gpus_per_node, "cpus_per_gpu") if per_gpu > 0 else (tasks_per_node, "Slurm's default")
    else:
        cpus, source = max(1, _int(threads, 1)), "threads"
    if resources.get("mem_mb_per_cpu"):
        mem: int | None = _int(resources["mem_mb_per_cpu"]) * cpus
    elif resources.get("mem_mb"):
        mem = _int(resources["mem_mb"])
    else:
        mem = None
    runtime = resources.get("runtime")
    partition = resources.get("slurm_partition")
    return Ask(label=label, rules=tuple(rules), partition=str(partition) if partition else None, nodes=nodes,
               cpus_per_node=cpus, mem_mb_per_node=mem, gpus_per_node=gpus_per_node,
               runtime_min=_int(runtime) if runtime not in (None, "") else None, cpu_source=source)


# ---------------------------------------------------------------------------------------------
# What a partition has
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    mem_mb: int
    gpus: int


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[Node, ...]
    state: str = "UP"
    max_nodes: int | None = None  # None: unlimited
    max_time_min: int | None = None
    max_cpus_per_node: int | None = None
    max_mem_per_node: int | None = None


def _gres_gpus(gres: str) -> int:
    """GPUs in a ``sinfo %G`` field: ``gpu:4``, ``gpu:a100:8(S:0-1)``, ``gpu:2,shard:4`` -> 4, 8, 2."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def slurm_minutes(text: str) -> int | None:
    """A Slurm time limit (``UNLIMITED``, ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in minutes."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days = 0
    if "-" in text:  # D-HH, D-HH:MM, D-HH:MM:SS
        d, text = text.split("-", 1)
        days = int(d)
        h, m, s = ([int(p) for p in text.split(":")] + [0, 0])[:3]
    else:  # MM, MM:SS, HH:MM:SS
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 3:
            h, m, s = parts
        else:
            h, m, s = 0, parts[0], (parts[1] if len(parts) > 1 else 0)
    return days * 1440 + h * 60 + m + (1 if s else 0)


def _limit(value: str | None) -> int | None:
    return None if value is None or value.upper() in ("UNLIMITED", "INFINITE") or not value.isdigit() else int(value)


Runner = Callable[[Sequence[str]], str]


def _run(cmd: Sequence[str]) -> str:
    if shutil.which(cmd[0]) is None:
        raise SlurmFitError(f"`{cmd[0]}` is not on PATH: the Slurm check runs where Slurm's commands do "
                            "(a login node of the cluster)")
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SlurmFitError(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def default_partition(run: Runner = _run) -> str:
    for name in run(["sinfo", "-h", "-o", "%P"]).split():
        if name.endswith("*"):
            return name[:-1]
    raise SlurmFitError("no partition was given (default-resources: slurm_partition) and Slurm has no default "
                        "partition; set slurm_partition in the profile (`sinfo -s` lists the partitions)")


def read_partition(name: str, run: Runner = _run) -> Partition:
    """The partition ``name`` from ``scontrol show partition`` and its nodes from ``sinfo``."""
    try:
        text = run(["scontrol", "show", "partition", name, "--oneliner"])
    except SlurmFitError as exc:
        known = " ".join(p.rstrip("*") for p in run(["sinfo", "-h", "-o", "%P"]).split())
        raise SlurmFitError(f"partition '{name}' does not exist ({exc}); partitions: {known}. "
                            "Set slurm_partition in the profile's default-resources") from None
    fields = parse_oneliner(text)
    nodes: dict[str, Node] = {}  # sinfo -N lists a node once per partition it is in
    for line in run(["sinfo", "-h", "-N", "-p", name, "-o", "%N|%c|%m|%G"]).splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4:
            nodes.setdefault(parts[0], Node(parts[0], _int(parts[1].rstrip("+")), _int(parts[2].rstrip("+")),
                                            _gres_gpus(parts[3])))
    return Partition(
        name=name, nodes=tuple(nodes.values()), state=fields.get("State", "UP"),
        max_nodes=_limit(fields.get("MaxNodes")), max_time_min=slurm_minutes(fields.get("MaxTime", "UNLIMITED")),
        max_cpus_per_node=_limit(fields.get("MaxCPUsPerNode")), max_mem_per_node=_limit(fields.get("MaxMemPerNode")),
    )


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------

#: The rules whose CPU ask is placement.data_threads (the fix a message names for them).
_DATA_RULES = ("synth_dataset", "validate_dataset", "cache_dataset")


def _fix(ask: Ask, what: str) -> str:
    rule = ask.rules[0]
    if what == "cpus":
        if ask.cpu_source == "cpus_per_gpu":
            return (f"lower set-resources: {rule}: cpus_per_gpu in the profile (CPUs per GPU of this cluster's "
                    "nodes), or the GPUs per node of the grid (grid.gpus / grid.nodes)")
        if ask.cpu_source == "cpus_per_task":
            return f"lower set-resources: {rule}: cpus_per_task in the profile"
        if set(ask.rules) <= set(_DATA_RULES):
            return ("lower placement.data_threads in the config, or cap it in the profile: set-threads: {"
                    + ", ".join(f"{r}: N" for r in ask.rules) + "}")
        if rule == "evaluate":
            return "lower placement.eval_threads in the config, or set-threads: evaluate: N in the profile"
        return (f"lower train.cpu_threads_per_rank or the GPUs per node of the grid, or set cpus_per_gpu for "
                f"{rule} in the profile's set-resources")
    if what == "mem":
        return f"lower set-resources: {rule}: mem_mb in the profile (or default-resources: mem_mb)"
    if what == "gpus":
        return "use fewer GPUs per node in the grid (grid.gpus, or spread them with grid.nodes), or another partition"
    if what == "nodes":
        return "use fewer nodes in the grid (grid.nodes), or another partition"
    if what == "runtime":
        return f"lower set-resources: {rule}: runtime in the profile (minutes)"
    return "change the profile's slurm_partition"


def problems(ask: Ask, part: Partition) -> list[str]:
    """What of ``ask`` the partition can never give, each as a message naming the ask, the limit and the fix."""
    out: list[str] = []
    where = f"partition '{part.name}'"
    if not part.nodes:
        return [f"{ask.label}: {where} has no nodes (`sinfo -p {part.name}`); {_fix(ask, 'partition')}"]

    def fits(node: Node) -> bool:
        return (node.cpus >= ask.cpus_per_node and node.gpus >= ask.gpus_per_node
                and (ask.mem_mb_per_node is None or node.mem_mb >= ask.mem_mb_per_node))

    big_cpu = max(part.nodes, key=lambda n: n.cpus)
    big_mem = max(part.nodes, key=lambda n: n.mem_mb)
    big_gpu = max(part.nodes, key=lambda n: n.gpus)
    cpu_cap = min(big_cpu.cpus, part.max_cpus_per_node or big_cpu.cpus)
    if ask.cpus_per_node > cpu_cap:
        out.append(f"{ask.label} asks {ask.cpus_per_node} CPUs per node ({ask.cpu_source}), but the largest node of "
                   f"{where} has {cpu_cap} ({big_cpu.name}); {_fix(ask, 'cpus')}")
    mem_cap = min(big_mem.mem_mb, part.max_mem_per_node or big_mem.mem_mb)
    if ask.mem_mb_per_node is not None and ask.mem_mb_per_node > mem_cap:
        out.append(f"{ask.label} asks {ask.mem_mb_per_node} MB of memory per node, but the largest node of {where} "
                   f"has {mem_cap} MB ({big_mem.name}); {_fix(ask, 'mem')}")
    if ask.gpus_per_node > big_gpu.gpus:
        out.append(f"{ask.label} asks {ask.gpus_per_node} GPUs per node, but the largest node of {where} has "
                   f"{big_gpu.gpus} ({big_gpu.name}); {_fix(ask, 'gpus')}")
    if not out:
        able = sum(fits(n) for n in part.nodes)
        if able < ask.nodes:
            out.append(f"{ask.label} asks {ask.nodes} nodes of {ask.cpus_per_node} CPUs, {ask.gpus_per_node} GPUs"
                       f"{'' if ask.mem_mb_per_node is None else f', {ask.mem_mb_per_node} MB'} each, but only "
                       f"{able} node(s) of {where} are that large; {_fix(ask, 'nodes')}")
    if part.max_nodes is not None and ask.nodes > part.max_nodes:
        out.append(f"{ask.label} asks {ask.nodes} nodes, but {where} allows at most {part.max_nodes} per job "
                   f"(MaxNodes); {_fix(ask, 'nodes')}")
    if ask.runtime_min is not None and part.max_time_min is not None and ask.runtime_min > part.max_time_min:
        out.append(f"{ask.label} asks {ask.runtime_min} min, but {where} allows at most {part.max_time_min} min "
                   f"(MaxTime); {_fix(ask, 'runtime')}")
    return out


@dataclass
class Verdict:
    checked: list[Ask]
    problems: list[str]
    warnings: list[str]

    def text(self) -> str:
        lines = [f"Slurm check: {len(self.checked)} job(s) compared with their partition"]
        lines += [f"warning: {w}" for w in self.warnings]
        if self.problems:
            lines.append(f"{len(self.problems)} ask(s) no node can ever satisfy; nothing was submitted:")
            lines += [f"  - {p}" for p in self.problems]
        else:
            lines.append("every job fits its partition")
        return "\n".join(lines)


def check(asks: Iterable[Ask], run: Runner = _run) -> Verdict:
    """Compare every ask with its partition (the cluster's default one where none is set)."""
    asks = list(asks)
    parts: dict[str, Partition] = {}
    found: list[str] = []
    warnings: list[str] = []
    default = None
    for ask in asks:
        if ask.partition is None and default is None:
            default = default_partition(run)
        name = ask.partition or default
        if name not in parts:
            parts[name] = read_partition(name, run)
            state = parts[name].state.upper()
            if state != "UP":
                warnings.append(f"partition '{name}' is {state}: its jobs cannot start until an administrator sets "
                                "it UP (a job pending on it is cancelled with the reason)")
        for msg in problems(ask, parts[name]):
            if msg not in found:
                found.append(msg)
    return Verdict(asks, found, warnings)


# ---------------------------------------------------------------------------------------------
# The workflow's side (called from the Snakefile's onstart handler)
# ---------------------------------------------------------------------------------------------


def workflow_asks(workflow: Any) -> list[Ask]:
    """The asks of every job the workflow will submit (group jobs as one), from its DAG."""
    dag = workflow.dag
    needed = set(dag.needrun_jobs())
    order = {rule.name: i for i, rule in enumerate(workflow.rules)}  # the workflow's own order of rules
    asks = []
    for item in dag.get_jobs_or_groups():
        if item.is_group():
            jobs = [j for j in item.jobs if j in needed]
            if not jobs:
                continue
            rules = tuple(sorted({j.rule.name for j in jobs}, key=lambda name: order.get(name, 0)))
            label = f"group {item.groupid} ({', '.join(rules)})"
            resources = dict(item.resources.items())
            threads = _int(resources.get("_cores"), 1)
        else:
            if item not in needed or item.is_local:
                continue
            rules = (item.rule.name,)
            wildcards = ", ".join(f"{k}={v}" for k, v in item.wildcards_dict.items())
            label = f"rule {item.rule.name}" + (f" ({wildcards})" if wildcards else "")
            resources = dict(item.resources.items())
            threads = item.threads
        asks.append(ask_from_resources(label, rules, threads, resources))
    return asks


def uses_slurm(workflow: Any) -> bool:
    plugin = getattr(workflow, "executor_plugin", None)
    return getattr(plugin, "name", None) == "slurm"


def on_start(workflow: Any) -> None:
    """The workflow's start on Slurm: check every ask, then watch for jobs that can never start."""
    if not uses_slurm(workflow):
        return
    verdict = check(workflow_asks(workflow))
    out = os.environ.get(CHECK_ONLY_ENV)
    if out:  # `detscale slurm check`: the verdict, and nothing submitted
        from detscale.files import write_text

        write_text(verdict.text() + "\n", out)
        raise SystemExit(2 if verdict.problems else 0)
    if verdict.problems:
        raise SlurmFitError(verdict.text())
    sys.stderr.write(verdict.text() + "\n")
    interval = float(os.environ.get(WATCH_INTERVAL_ENV, "10"))
    PendingWatch(os.getcwd(), interval=interval).start()


# ---------------------------------------------------------------------------------------------
# Jobs that pend forever
# ---------------------------------------------------------------------------------------------


def never_starts(reason: str) -> str | None:
    """What a pending reason means when the job can never start as submitted, else ``None``."""
    return NEVER_STARTS.get(reason.split(",")[0].strip())


def pending_message(jobid: str, comment: str, reason: str) -> str:
    what = never_starts(reason) or reason
    # the plugin's comment: rule_NAME or rule_NAME_wildcards_WILDCARDS (a group's NAME joins its rules)
    name = comment[len("rule_"):] if comment.startswith("rule_") else comment
    job = name.replace("_wildcards_", " (") + (")" if "_wildcards_" in name else "")
    return (f"error: Slurm job {jobid} ({job}) can never start: pending with Reason={reason}: {what}. "
            "It was cancelled so that the workflow fails now instead of waiting. "
            "`detscale slurm check --profile PROFILE --configfile CONFIG` compares every ask with the partition; "
            "change the ask (config or profile) or the partition (default-resources: slurm_partition).")


class PendingWatch(threading.Thread):
    """Cancel this workflow's jobs that pend with a reason meaning they can never start.

    Jobs of the current user whose working directory is the workflow's; a reason must be seen on
    two polls in a row (a job can carry a passing reason just after submission).
    """

    def __init__(self, workdir: str, interval: float = 10.0, run: Runner = _run,
                 emit: Callable[[str], None] | None = None) -> None:
        super().__init__(name="detscale-slurm-pending-watch", daemon=True)
        self.workdir = os.path.realpath(workdir)
        self.interval = interval
        self.run_cmd = run
        self.emit = emit or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.seen: dict[str, str] = {}
        self.cancelled: list[str] = []

    def poll(self) -> list[str]:
        """One look at the queue; returns the ids cancelled by this poll."""
        try:
            out = self.run_cmd(["squeue", "-h", "-u", getpass.getuser(), "-t", "PENDING", "-o", "%i|%r|%k|%Z"])
        except (SlurmFitError, subprocess.TimeoutExpired):
            return []
        now: dict[str, str] = {}
        done = []
        for line in out.splitlines():
            parts = line.strip().split("|")
            if len(parts) != 4 or os.path.realpath(parts[3]) != self.workdir:
                continue
            jobid, reason, comment = parts[0], parts[1], parts[2]
            if never_starts(reason) is None or jobid in self.cancelled:
                continue
            now[jobid] = reason
            if self.seen.get(jobid) == reason:
                self.emit(pending_message(jobid, comment, reason))
                try:
                    self.run_cmd(["scancel", jobid])
                except SlurmFitError as exc:
                    self.emit(f"warning: could not cancel Slurm job {jobid}: {exc}")
                self.cancelled.append(jobid)
                done.append(jobid)
        self.seen = now
        return done

    def run(self) -> None:  # until the workflow's process ends (a daemon thread)
        while True:
            time.sleep(self.interval)
            self.poll()
