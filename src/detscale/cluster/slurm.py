"""Running inside a Slurm allocation: what Slurm gave the job, and multi-node ``torchrun``.

``detscale launch --nodes M`` runs inside one Slurm job that holds ``M`` nodes. It does not start
the ranks itself: :func:`multinode_command` builds one ``srun`` step with one task per node, and
each task is a ``torchrun`` agent that starts this node's ranks. The agents meet through c10d
rendezvous on the first node of the allocation (the agent whose host matches the endpoint hosts
the store), keyed by the Slurm job id. A requeued job keeps its id but starts new agents, so
its rendezvous store is a new one too.

The Snakemake Slurm job-step executor removes most ``SLURM_*`` variables before running a rule's
command, so the node list is looked up from ``scontrol`` when the environment lacks it. The
tasks that ``srun`` starts get a complete Slurm environment again.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from detscale.cluster.signals import caught_signals, exit_status
from detscale.errors import UserError

log = logging.getLogger(__name__)


class SlurmError(UserError):
    """Slurm is needed but missing, or the allocation does not match what was asked for."""


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The Slurm job id of this process, or ``None`` outside a Slurm job."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None


# ---------------------------------------------------------------------------------------------
# Host lists
# ---------------------------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(expr: str) -> list[str]:
    """Split ``a[1-2],b,c[3,5]`` on the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SlurmError(f"malformed Slurm host list {expr!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise SlurmError(f"malformed Slurm host list {expr!r}: unbalanced '['")
    parts.append(expr[start:])
    return [p for p in parts if p]


def _expand_one(item: str, whole: str) -> list[str]:
    """Expand one host pattern with any number of bracket groups (``r[1-2]n[01-02]``)."""
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    names = []
    for piece in match.group(1).split(","):
        rng = _RANGE.match(piece.strip())
        if rng is None:
            raise SlurmError(f"malformed Slurm host list {whole!r}: cannot read range {piece!r}")
        lo, hi = rng.group(1), rng.group(2) or rng.group(1)
        if int(hi) < int(lo):
            raise SlurmError(f"malformed Slurm host list {whole!r}: range {piece!r} runs backwards")
        width = len(lo)  # zero padding is kept: n[08-10] -> n08, n09, n10
        for number in range(int(lo), int(hi) + 1):
            names.extend(_expand_one(f"{prefix}{number:0{width}d}{suffix}", whole))
    return names


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm host list expression the way ``scontrol show hostnames`` does.

    ``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "login1"]``.
    """
    expr = expr.strip()
    if not expr:
        raise SlurmError("empty Slurm host list")
    hosts: list[str] = []
    for item in _split_top_level(expr):
        hosts.extend(_expand_one(item, expr))
    return hosts


def parse_oneliner(text: str) -> dict[str, str]:
    """``scontrol show ... --oneliner`` output as key -> value."""
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def _scontrol_job(jid: str) -> dict[str, str]:
    """``scontrol show job`` of ``jid`` as key -> value (for environments that dropped ``SLURM_*``)."""
    if shutil.which("scontrol") is None:
        raise SlurmError(
            f"cannot look up Slurm job {jid}: SLURM_JOB_NODELIST is not set and `scontrol` is not on PATH; "
            "run `detscale launch --nodes M` inside the Slurm job (sbatch/salloc)"
        )
    proc = subprocess.run(["scontrol", "show", "job", "--oneliner", jid], capture_output=True, text=True, timeout=60)
    record = parse_oneliner(proc.stdout)
    if proc.returncode != 0 or record.get("NodeList", "(null)") == "(null)":
        raise SlurmError(
            f"cannot find the nodes of Slurm job {jid} with `scontrol show job`: "
            f"{(proc.stderr or proc.stdout).strip() or 'no NodeList in its answer'}"
        )
    return record


def job_nodes(env: Mapping[str, str] | None = None) -> list[str]:
    """The host names of this job's allocation, in Slurm's order (the first one hosts rendezvous)."""
    env = os.environ if env is None else env
    jid = job_id(env)
    if jid is None:
        raise SlurmError(
            "multi-node training needs a Slurm allocation (SLURM_JOB_ID is not set): submit it with "
            "`sbatch --nodes M`, run the workflow with `--profile profiles/slurm` (or inside `salloc --nodes M`), "
            "or train on one node (--nodes 1; in the workflow config: grid.nodes: 1)"
        )
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or _scontrol_job(jid)["NodeList"]
    return expand_hostlist(nodelist)


def cpus_per_node(env: Mapping[str, str] | None = None) -> int | None:
    """CPUs the job holds on each node (``SLURM_CPUS_ON_NODE``, else scontrol's NumCPUs / NumNodes).

    ``None`` when it cannot be known; the caller then leaves the CPU count to Slurm's default.
    """
    env = os.environ if env is None else env
    value = env.get("SLURM_CPUS_ON_NODE", "").strip()
    if value.isdigit():
        return int(value)
    jid = job_id(env)
    if jid is None:
        return None
    try:
        record = _scontrol_job(jid)
        return max(1, int(record["NumCPUs"]) // int(record["NumNodes"].split("-")[0]))
    except (SlurmError, KeyError, ValueError) as exc:
        log.warning("cannot tell the CPUs per node of Slurm job %s (%s); srun uses its default", jid, exc)
        return None


def node_address(name: str) -> str:
    """The address other nodes reach ``name`` at: its ``NodeAddr`` in Slurm, else the name itself.

    Slurm node names need not resolve (``NodeName=gpu1 NodeAddr=10.0.0.5``), and the rendezvous
    endpoint must be something every agent can connect to.
    """
    if shutil.which("scontrol") is None:
        return name
    try:
        proc = subprocess.run(
            ["scontrol", "show", "node", "--oneliner", name], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot ask scontrol for the address of node %s (%s); using its name", name, exc)
        return name
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", proc.stdout)
    return match.group(1) if proc.returncode == 0 and match else name


# ---------------------------------------------------------------------------------------------
# The multi-node command
# ---------------------------------------------------------------------------------------------


def multinode_command(
    nodes: int,
    gpus_per_node: int,
    train_argv: Sequence[str],
    max_restarts: int,
    port: int,
    *,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    entry: Sequence[str] = ("-m", "--", "detscale"),
    resolve: Callable[[str], str] | None = None,
    threads: int | None = None,
) -> list[str]:
    """The argv that runs ``detscale <train_argv>`` on ``nodes`` x ``gpus_per_node`` ranks.

    One ``srun`` step with one task per node; each task is a ``torchrun`` agent (started as
    ``python -m torch.distributed.run`` with the current interpreter, so the same environment
    runs everywhere) that joins the c10d rendezvous at ``FIRST_NODE:port`` under the job id.
    ``train_argv`` starts with the subcommand, e.g. ``["train", "--config", ...]``; ``entry``
    is what torchrun runs it with: ``-m -- detscale``, where ``--`` keeps torchrun's argparse
    from reading ``--run RUN_ID`` as an ambiguous abbreviation of its ``--run-path``. ``env`` (default
    ``os.environ``) and ``resolve`` (node name -> address, default :func:`node_address`, looked up
    at call time) are there for tests. ``threads`` (CPU ranks: torch threads per rank) is exported to every task
    as ``OMP_NUM_THREADS`` (``srun --export=ALL,OMP_NUM_THREADS=T``): torchrun would otherwise
    set 1 for several ranks per node, and the trainer reads it; ``None`` leaves it alone (GPU
    ranks).

    Each task asks for the node's GPUs and CPUs explicitly (``--gpus-per-node``,
    ``--cpus-per-task``): with a task/affinity or cgroup plugin a step task otherwise gets one
    CPU, and all ranks and data loaders of the node would share it. ``--overlap`` lets the step
    start even when the caller itself runs inside a job step that holds the node's CPUs
    (Snakemake's job-step executor wraps rules in ``srun``). ``--kill-on-bad-exit=0``
    (explicit, clusters may default to 1): after a SIGTERM the ranks of other nodes may exit
    before rank 0 has written its checkpoint, and killing it then would lose the checkpoint; a
    rank that really fails ends the others through the process group's timeout.

    Each agent runs under :func:`run_agent` (``python -m detscale.cluster.slurm``), which turns the
    SIGTERM Slurm sends before a time limit or on preemption into :data:`~detscale.errors.EXIT_PREEMPTED`.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise SlurmError(f"nodes and GPUs per node must be >= 1, got nodes={nodes}, gpus_per_node={gpus_per_node}")
    if max_restarts < 0:
        raise SlurmError(f"max_restarts must be >= 0, got {max_restarts}")
    if not 1 <= port <= 65535:
        raise SlurmError(f"rendezvous port must be in 1..65535, got {port}")
    if threads is not None and threads < 1:
        raise SlurmError(f"threads per rank must be >= 1, got {threads}")
    if not train_argv:
        raise SlurmError("multi-node launch needs the detscale command to run on every rank (e.g. `train ...`)")
    env = os.environ if env is None else env
    hosts = job_nodes(env)
    if len(hosts) < nodes:
        raise SlurmError(
            f"--nodes {nodes} asked for, but Slurm job {job_id(env)} holds {len(hosts)} node(s) "
            f"({', '.join(hosts)}); submit it with `--nodes {nodes}` (the rule's `nodes` resource)"
        )
    head = (resolve or node_address)(hosts[0])
    cpus = cpus_per_node(env)
    log.info("multi-node: %d node(s) x %d rank(s), rendezvous on %s:%d", nodes, gpus_per_node, head, port)
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        f"--gpus-per-node={gpus_per_node}",
        *([f"--cpus-per-task={cpus}"] if cpus else []),
        "--overlap",
        "--kill-on-bad-exit=0",
        *([f"--export=ALL,OMP_NUM_THREADS={threads}"] if threads is not None else []),
        python or sys.executable,
        "-m",
        "detscale.cluster.slurm",
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={gpus_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={head}:{port}",
        f"--rdzv-id={job_id(env)}",
        f"--max-restarts={max_restarts}",
        *entry,
        *train_argv,
    ]


def preflight_step(nodes: int, out: str | os.PathLike[str], timeout_s: float, min_gbps: float, port: int, *,
                   env: Mapping[str, str] | None = None, python: str | None = None,
                   resolve: Callable[[str], str] | None = None) -> list[str]:
    """The ``srun`` step of the network preflight on the job's first ``nodes`` nodes, meeting on the first."""
    from detscale.cluster.preflight import preflight_command

    env = os.environ if env is None else env
    hosts = job_nodes(env)[:nodes]
    if len(hosts) < nodes:
        raise SlurmError(f"--nodes {nodes} asked for, but Slurm job {job_id(env)} holds {len(hosts)} node(s)")
    head = (resolve or node_address)(hosts[0])
    return preflight_command(nodes, f"{head}:{port}", out, hosts, timeout_s, min_gbps, python=python)


# ---------------------------------------------------------------------------------------------
# One node's agent
# ---------------------------------------------------------------------------------------------

def describe_task(env: Mapping[str, str] | None = None) -> str:
    """One line on what this srun task got: its node, node rank, GPUs and threads (for the run's log)."""
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return (f"agent on node {node} (node rank {env.get('SLURM_NODEID', '?')} of {env.get('SLURM_NNODES', '?')}): "
            f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')} "
            f"SLURM_GPUS_ON_NODE={env.get('SLURM_GPUS_ON_NODE', '<unset>')} "
            f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', '<unset>')}")


def run_agent(argv: Sequence[str]) -> int:
    """Run one node's ``torchrun`` agent (``argv``) and return its status, 75 after a SIGTERM.

    Slurm signals every process of a job step, agent and ranks alike. The ranks stop at a step
    boundary and rank 0 writes ``last.pt``; torchrun's agent dies of the signal with status 1,
    which would read as a failure. So this records SIGTERM/SIGINT without forwarding them (the
    agent already got them; a second one while it shuts its workers down would make it abandon
    them), waits for the agent, and reports the requeue status.
    """
    log.info("%s", describe_task())
    with caught_signals() as received:  # recorded, not forwarded: the agent got them from Slurm itself
        code = subprocess.Popen(list(argv)).wait()  # PEP 475: retried across the handled signals
    return exit_status(code, received)


if __name__ == "__main__":
    # One line per node in the job's log (which node, which GPUs, how many threads).
    logging.basicConfig(level=logging.INFO, format="detscale.cluster.slurm: %(message)s")
    if len(sys.argv) < 2:
        sys.stderr.write("usage: python -m detscale.cluster.slurm TORCHRUN_COMMAND...\n")
        sys.exit(2)
    sys.exit(run_agent(sys.argv[1:]))
