"""Network preflight: before a multi-node run starts its long work, every node joins one rendezvous
and times a short all-reduce sweep, so a node that cannot reach the others fails the job within
seconds, named with its interface, instead of a collective timing out hours later.

``python -m detscale.cluster.preflight --endpoint HOST:PORT --nodes M --out FILE`` runs once per
node (``detscale launch --nodes M`` starts it with one ``srun`` step, :func:`preflight_command`,
before the training step). In order, each node:

1. finds the interface and address it reaches the rendezvous host from (the route the kernel
   picks for HOST), and records its ``NCCL_*`` / ``GLOO_*`` / ``TORCH_*`` settings;
2. joins a ``TCPStore`` at ``HOST:PORT`` (the first node hosts it); the host waits for every node
   and names the ones missing when the time is up;
3. opens a gloo process group over it (gloo's own connections between the nodes, the path DDP
   on CPUs and NCCL's bootstrap take), and times an all-reduce sweep and a ping-pong between the
   first node and each other one;
4. the first node writes ``FILE`` (``preflight.json``): the nodes, their interfaces and
   settings, the sweep's bus bandwidth (nccl-tests' definition) and each node's link bandwidth.

Everything has one deadline (``--timeout``, 60 s by default). A node that cannot resolve or reach
the host, a node the host never hears from, a gloo connection that does not open, and a link
slower than ``--min-gbps`` each end the step with a non-zero status and one line naming the node
and its interface.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Message sizes of the all-reduce sweep (a few seconds on a slow link at most).
SWEEP_BYTES = (1 << 16, 1 << 20, 1 << 23)
#: One ping-pong between the first node and each other node.
PINGPONG_BYTES = 1 << 23
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL", "TORCH_DISTRIBUTED", "MASTER_", "FI_", "UCX_")
EXIT_PREFLIGHT = 3


class PreflightError(Exception):
    """A node cannot take part; the message names it and its interface."""


# ---------------------------------------------------------------------------------------------
# This node
# ---------------------------------------------------------------------------------------------


def interface_of(address: str) -> str:
    """The name of the local interface holding ``address`` (``"?"`` when none does, e.g. not Linux)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    finally:
        probe.close()
    return "?"


def route_to(host: str, port: int) -> tuple[str, str]:
    """(interface, local address) this node reaches ``host`` from; raises :class:`PreflightError`."""
    try:
        target = socket.gethostbyname(host)
    except OSError as exc:
        raise PreflightError(f"cannot resolve the rendezvous host {host!r} ({exc})") from None
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        udp.connect((target, port))  # no packet is sent: the kernel only picks the route
        local = udp.getsockname()[0]
    except OSError as exc:
        raise PreflightError(f"no route to the rendezvous host {host} ({target}): {exc}") from None
    finally:
        udp.close()
    return interface_of(local), local


def network_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings that choose the interface and transport of NCCL and gloo."""
    env = os.environ if env is None else env
    return {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)}


# ---------------------------------------------------------------------------------------------
# Together
# ---------------------------------------------------------------------------------------------


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1.0))


def wait_for_port(host: str, port: int, deadline: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; :class:`PreflightError` with the last reason at the deadline.

    Checked with a plain socket before torch's store connects, so the deadline holds (the store
    retries past its timeout) and the reason is the kernel's: refused or silent.
    """
    started, reason = time.monotonic(), "no attempt finished"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(5.0, left)):
                return
        except ConnectionRefusedError:
            reason = "connection refused (nothing listens there, or a firewall rejects the port)"
        except TimeoutError:
            reason = "no answer (a firewall drops the packets, or the host is down)"
        except OSError as exc:
            reason = str(exc)
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0.0)))
    raise PreflightError(f"cannot connect to the rendezvous at {host}:{port} in {time.monotonic() - started:.0f} s: "
                         f"{reason}; check that this interface routes to the first node and that the port is open "
                         "between the nodes")


def join_store(host: str, port: int, rank: int, nodes: int, hosts: Sequence[str], me: dict[str, Any],
               deadline: float) -> Any:
    """Join the rendezvous store; the host (rank 0) waits for every node and names the missing ones."""
    import torch.distributed as tdist

    if rank != 0:
        wait_for_port(host, port, deadline)
    try:
        store = tdist.TCPStore(host, port, nodes, rank == 0, timeout=_remaining(deadline), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, TimeoutError or DistNetworkError
        raise PreflightError(f"cannot reach the rendezvous at {host}:{port} ({_short(exc)}); check that this "
                             "interface routes to the first node and that the port is open between the nodes") from None
    store.set(f"node/{rank}", json.dumps(me))
    store.add("joined", 1)
    if rank == 0:
        while store.add("joined", 0) < nodes:
            if time.monotonic() > deadline:
                missing = [r for r in range(nodes) if not store.check([f"node/{r}"])]
                names = ", ".join(f"{hosts[r] if r < len(hosts) else '?'} (node rank {r})" for r in missing)
                raise PreflightError(f"{len(missing)} of {nodes} node(s) did not join the rendezvous at "
                                     f"{host}:{port} in time: {names}; each names its own problem in its output")
            time.sleep(0.05)
    return store


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def sweep(rank: int, nodes: int, repeats: int = 3) -> list[dict[str, float]]:
    """Best-of-``repeats`` all-reduce times per message size, with nccl-tests' bus bandwidth."""
    import torch
    import torch.distributed as tdist

    rows = []
    for size in SWEEP_BYTES:
        buf = torch.ones(size // 4)
        tdist.all_reduce(buf)  # warm-up: connections and buffers
        best = float("inf")
        for _ in range(repeats):
            tdist.barrier()
            t0 = time.perf_counter()
            tdist.all_reduce(buf)
            best = min(best, time.perf_counter() - t0)
        slowest = torch.tensor([best], dtype=torch.float64)
        tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)
        seconds = float(slowest)
        rows.append({"bytes": size, "seconds": seconds, "bus_gbps": 2 * (nodes - 1) / nodes * size / seconds / 1e9})
    return rows


def pingpong(rank: int, nodes: int) -> list[float]:
    """GB/s of a ping-pong between the first node and each other node (one at a time)."""
    import torch
    import torch.distributed as tdist

    buf = torch.ones(PINGPONG_BYTES // 4)
    rates = []
    for other in range(1, nodes):
        tdist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            tdist.send(buf, other)
            tdist.recv(buf, other)
        elif rank == other:
            tdist.recv(buf, 0)
            tdist.send(buf, 0)
        rate = torch.tensor([2 * PINGPONG_BYTES / (time.perf_counter() - t0) / 1e9], dtype=torch.float64)
        tdist.broadcast(rate, 0)
        rates.append(float(rate))
    return rates


def node_rank(args: argparse.Namespace) -> int:
    """``--node-rank``, else Slurm's node id of this task."""
    return args.node_rank if args.node_rank is not None else int(os.environ.get("SLURM_NODEID", "0"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """This node's part of the preflight; returns the record (complete on the first node)."""
    import torch.distributed as tdist

    started = time.monotonic()
    host, port = args.endpoint.rsplit(":", 1)
    rank = node_rank(args)
    # the other nodes give up first, so that a node that cannot connect says why before the first
    # node says that it is missing
    deadline = started + args.timeout * (1.0 if rank == 0 else 0.85)
    hosts = [h for h in args.hosts.split(",") if h] if args.hosts else []
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    where = f"node {name} (node rank {rank})"
    try:
        interface, address = route_to(host, int(port))
    except PreflightError as exc:
        raise PreflightError(f"{where}: {exc}") from None
    where = f"node {name} (node rank {rank}, interface {interface}, address {address})"
    me = {"rank": rank, "host": name, "interface": interface, "address": address, "env": network_env()}
    try:
        store = join_store(host, int(port), rank, args.nodes, hosts, me, deadline)
    except PreflightError as exc:
        raise PreflightError(f"{where}: {exc}") from None
    try:
        tdist.init_process_group("gloo", store=tdist.PrefixStore("pg", store), rank=rank, world_size=args.nodes,
                                 timeout=_remaining(deadline))
        record = {"nodes": [json.loads(store.get(f"node/{r}")) for r in range(args.nodes)],
                  "endpoint": args.endpoint, "allreduce": sweep(rank, args.nodes)}
        links = pingpong(rank, args.nodes)
        tdist.destroy_process_group()
    except PreflightError:
        raise
    except Exception as exc:  # noqa: BLE001 - a gloo connection or collective that failed or timed out
        raise PreflightError(f"{where}: the nodes met at {args.endpoint} but gloo could not connect them or "
                             f"a collective failed ({_short(exc)}); check GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME "
                             "and that the nodes accept connections from each other on any port") from None
    record["links"] = [{"from": record["nodes"][0]["host"], "to": record["nodes"][r]["host"],
                        "interface": record["nodes"][r]["interface"], "gbps": rate}
                       for r, rate in enumerate(links, start=1)]
    record.update(min_gbps=args.min_gbps, seconds=time.monotonic() - started)
    slow = [link for link in record["links"] if link["gbps"] < args.min_gbps]
    record["passed"] = not slow
    if rank == 0 and args.out:
        from detscale.files import write_json

        write_json(record, Path(args.out), indent=2)
    if slow:
        names = "; ".join(f"node {s['to']} (interface {s['interface']}): {s['gbps']:.3g} GB/s to {s['from']}"
                          for s in slow)
        raise PreflightError(f"link(s) below the floor of {args.min_gbps:g} GB/s (train.preflight_min_gbps): "
                             f"{names}")
    return record


def summary(record: Mapping[str, Any]) -> str:
    """One line for the job's log."""
    best = max(row["bus_gbps"] for row in record["allreduce"])
    links = ", ".join(f"{link['to']} {link['gbps']:.2f} GB/s" for link in record["links"])
    return (f"preflight: {len(record['nodes'])} nodes met at {record['endpoint']} in {record['seconds']:.1f} s; "
            f"all-reduce bus bandwidth up to {best:.2f} GB/s; links from the first node: {links}")


def preflight_command(nodes: int, endpoint: str, out: str | Path, hosts: Sequence[str], timeout_s: float,
                      min_gbps: float, python: str | None = None) -> list[str]:
    """The ``srun`` step that runs the preflight once on each of ``nodes`` nodes."""
    return [
        "srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--overlap",
        # the step ends as soon as one node fails: that node's line is the answer
        "--kill-on-bad-exit=1", "--cpus-per-task=1",
        python or sys.executable, "-m", "detscale.cluster.preflight",
        f"--endpoint={endpoint}", f"--nodes={nodes}", f"--hosts={','.join(hosts)}", f"--timeout={timeout_s:g}",
        f"--min-gbps={min_gbps:g}", f"--out={out}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m detscale.cluster.preflight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True, help="HOST:PORT of the rendezvous (the first node hosts it)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: SLURM_NODEID)")
    parser.add_argument("--hosts", default="", help="the nodes' names in rank order, to name a missing one")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the whole preflight")
    parser.add_argument("--min-gbps", type=float, default=0.0, help="fail when a link is slower (GB/s)")
    parser.add_argument("--out", default="", help="preflight.json, written by the first node")
    args = parser.parse_args(argv)
    # torch's C++ layer logs every failed connection attempt with a stack trace; the line this
    # command prints says what failed (read when torch loads, so before it is imported)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    try:
        record = run(args)
    except PreflightError as exc:
        print(f"detscale preflight failed: {exc}", file=sys.stderr, flush=True)
        return EXIT_PREFLIGHT
    if node_rank(args) == 0:
        print(summary(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
