"""Start the ranks of one training run: GPU slots, a rendezvous port, and ``torchrun``.

``detscale launch --gpus N -- train ARGS`` is what a Snakemake rule calls. In order:

1. The train arguments are parsed and the run's config loaded, so that a wrong run id, a GPU
   count that does not match the run, or a global batch that does not divide by the ranks is
   a clear error before anything starts.
2. Devices. With ``CUDA_VISIBLE_DEVICES`` already set (by Slurm or the user) those cards are
   used as given and no others are claimed. Otherwise N free local cards are claimed with file
   locks (``fcntl.flock`` on ``$DETSCALE_GPU_LOCK_DIR/gpu{i}.lock``, default
   ``/tmp/detscale-gpu-locks``) held by this process for the run's lifetime, so concurrent
   Snakemake jobs never share a card, and exported as ``CUDA_VISIBLE_DEVICES``. Asking for more
   cards than exist is an error. Without CUDA, N ranks run on the CPU with gloo and
   ``OMP_NUM_THREADS`` threads each (``--threads``, default ``train.cpu_threads_per_rank``).
3. A free rendezvous port (the OS picks one; ``--port`` must be free or it is an error;
   ``--standalone`` lets torchrun pick).
4. ``torchrun`` runs as a child process (not ``exec``: this process must keep holding the
   locks). SIGINT and SIGTERM are forwarded to it; the exit code is the child's, except after a
   forwarded SIGTERM, which returns :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``): the ranks
   wrote ``weights/last.pt`` at a step boundary and rerunning the same command resumes.

Multi-node runs (``--nodes M`` inside a Slurm allocation) take their command line from
:func:`detscale.cluster.slurm.multinode_command`.

Resuming under a workflow (``--resume-stash DIR``): Snakemake deletes a job's outputs before it
runs the job again, and ``weights/last.pt`` is one of them, so a rerun after a preemption would
start from scratch. The files a resume needs (:data:`RESUME_FILES`) are hard-linked into ``DIR``
with the run's config digest: by rank 0 after every checkpoint it writes (the launcher passes
``DIR`` as :data:`STASH_ENV`), so that a job killed outright (SIGKILL, a lost node) still
resumes from its last epoch, and by the launcher when the run ends with a non-zero status. The
next start moves them back when the run folder lacks them and the digest still matches (a stash
of another config is deleted, never resumed from); a run that succeeds deletes the stash.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from detscale.cluster.signals import caught_signals, exit_status
from detscale.cluster.slurm import multinode_command, preflight_step
from detscale.errors import EXIT_PREEMPTED, UserError
from detscale.files import RESUME_FILES, STASH_ENV, restore_resume_files, stash_resume_files

log = logging.getLogger(__name__)

DEFAULT_LOCK_DIR = "/tmp/detscale-gpu-locks"
#: How torchrun starts a rank. The ``--`` matters: torchrun's argparse would otherwise read our
#: ``--run RUN_ID`` as an ambiguous abbreviation of its own ``--run-path`` and refuse to start.
TORCHRUN_ENTRY = ("-m", "--", "detscale")


class LaunchError(UserError):
    """The ranks cannot be started as asked (devices, port, arguments)."""


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------


@dataclass
class DevicePlan:
    """Where the ranks run: ``kind`` is ``cuda`` or ``cpu``; ``visible`` the CUDA_VISIBLE_DEVICES value."""

    kind: str
    nproc: int
    visible: str | None = None
    claimed_by_us: bool = False


class GpuLocks:
    """File locks on GPU slots, held until :meth:`release` (or process exit, which the kernel handles)."""

    def __init__(self, lock_dir: str | Path) -> None:
        self.lock_dir = Path(lock_dir)
        self._held: dict[int, int] = {}

    @property
    def indices(self) -> list[int]:
        return sorted(self._held)

    def _try_one(self, index: int) -> bool:
        fd = os.open(self.lock_dir / f"gpu{index}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        self._held[index] = fd
        return True

    def claim(self, count: int, available: int, timeout_s: float, poll_s: float = 2.0) -> list[int]:
        """Claim ``count`` of the cards ``0..available-1``; wait up to ``timeout_s`` for them to be free."""
        if count > available:
            raise LaunchError(
                f"asked for {count} GPU(s) but this host has {available}; use --gpus {available} or fewer, "
                "or run on a host with more cards"
            )
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        announced = False
        while True:
            for index in range(available):
                if len(self._held) == count:
                    return self.indices
                if index not in self._held:
                    self._try_one(index)
            if len(self._held) == count:
                return self.indices
            # All or nothing: give back partial claims so two waiting launchers cannot deadlock.
            self.release()
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"could not claim {count} free GPU(s) of {available} within {timeout_s:.0f} s: other "
                    f"runs hold the locks in {self.lock_dir}; wait for them, or raise --lock-timeout"
                )
            if not announced:
                log.info("waiting for %d free GPU(s) (locks in %s)", count, self.lock_dir)
                announced = True
            time.sleep(poll_s)

    def release(self) -> None:
        for fd in self._held.values():
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self._held.clear()


def cuda_device_count() -> int:
    """Number of CUDA devices torch sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_devices(
    nproc: int,
    locks: GpuLocks,
    visible: str | None,
    device_count: int,
    lock_timeout_s: float,
) -> DevicePlan:
    """Decide where ``nproc`` local ranks run and claim the cards (see the module docstring)."""
    if visible is not None and visible.strip() != "":
        given = [v for v in visible.split(",") if v.strip()]
        if device_count == 0:
            log.warning("CUDA_VISIBLE_DEVICES=%s is set but CUDA is unavailable: %d CPU rank(s)", visible, nproc)
            return DevicePlan("cpu", nproc, visible)
        if nproc > len(given):
            raise LaunchError(
                f"asked for {nproc} GPU(s) but CUDA_VISIBLE_DEVICES={visible} gives {len(given)}; "
                f"use --gpus {len(given)} or fewer, or ask Slurm/your environment for more cards"
            )
        return DevicePlan("cuda", nproc, ",".join(given[:nproc]))
    if device_count == 0:
        return DevicePlan("cpu", nproc)
    claimed = locks.claim(nproc, device_count, lock_timeout_s)
    return DevicePlan("cuda", nproc, ",".join(map(str, claimed)), claimed_by_us=True)


# ---------------------------------------------------------------------------------------------
# Port
# ---------------------------------------------------------------------------------------------


def port_is_free(port: int, host: str = "") -> bool:
    """True when a TCP socket can bind ``port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(requested: int | None) -> int:
    """The requested port if free (else a clear error), or one the OS picks."""
    if requested is not None:
        if not port_is_free(requested):
            raise LaunchError(
                f"rendezvous port {requested} is already in use (another run or service holds it); "
                "leave out --port to let detscale pick a free one, or pass --standalone"
            )
        return requested
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def torchrun_command(
    nproc: int,
    train_argv: Sequence[str],
    port: int | None,
    max_restarts: int,
    entry: Sequence[str] = TORCHRUN_ENTRY,
) -> list[str]:
    """``python -m torch.distributed.run ...`` for one node; ``port=None`` means ``--standalone``.

    ``entry`` is what torchrun starts (tests put ``("--", "script.py")`` there).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    if port is None:
        cmd += ["--standalone"]
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}"]
    cmd += ["--max-restarts", str(max_restarts), *entry, *train_argv]
    return cmd


def run_child(cmd: Sequence[str], env: dict[str, str]) -> int:
    """Run ``cmd`` in its own session (so a terminal's Ctrl-C reaches it once, through us), forwarding
    SIGINT/SIGTERM to it; the status is :func:`~detscale.cluster.signals.exit_status`'s."""
    log.info("launch: %s", " ".join(cmd))
    child = subprocess.Popen(list(cmd), env=env, start_new_session=True)
    with caught_signals(forward_to=child) as received:
        code = child.wait()  # PEP 475: retried across the handled signals
    return exit_status(code, received)


@dataclass(frozen=True)
class LaunchRequest:
    gpus: int
    nodes: int
    threads: int
    max_restarts: int
    port: int | None
    standalone: bool
    lock_timeout_s: float
    train_argv: tuple[str, ...]
    #: ``(run folder, stash folder, config digest)`` for ``--resume-stash``; None without it.
    stash: tuple[Path, Path, str] | None = None
    #: Multi-node runs: ``(preflight.json path, timeout s, floor GB/s)`` of the network preflight.
    preflight: tuple[Path, float, float] | None = None


def launch(req: LaunchRequest) -> int:
    """Start the run (see :func:`run_ranks`), with the resume stash around it when asked for."""
    if req.stash is None:
        return run_ranks(req)
    out, stash, digest = req.stash
    restored = restore_resume_files(out, stash, digest)
    started = time.time()
    previous = os.environ.get(STASH_ENV)
    os.environ[STASH_ENV] = str(stash.resolve())  # rank 0 refreshes it after every checkpoint
    try:
        code = run_ranks(req)
    finally:
        if previous is None:
            os.environ.pop(STASH_ENV, None)
        else:
            os.environ[STASH_ENV] = previous
    last = out / RESUME_FILES[0]
    if code == 0:
        shutil.rmtree(stash, ignore_errors=True)
    elif restored or (last.is_file() and last.stat().st_mtime >= started - 1.0):
        # Only a checkpoint known to be of this config: restored from a stash of this digest, or
        # written by this attempt. A stale one (another config, left in the folder) would be
        # labelled with the wrong digest and fail every later start.
        stash_resume_files(out, stash, digest)
        log.info("resume files of %s kept in %s (config digest %s)", out, stash, digest)
    return code


def check_network(nodes: int, out: Path, timeout_s: float, min_gbps: float, env: dict[str, str]) -> int:
    """The network preflight (:mod:`detscale.cluster.preflight`) as one ``srun`` step: 0 when the nodes
    can train together, :data:`EXIT_PREEMPTED` after a SIGTERM, else a clear error."""
    code = run_child(preflight_step(nodes, out, timeout_s, min_gbps, pick_port(None)), env)
    if code not in (0, EXIT_PREEMPTED):
        raise LaunchError(
            f"the network preflight of the {nodes} nodes failed (status {code}); the line(s) 'detscale preflight "
            "failed: ...' above name the node, its interface and what went wrong. Training was not started; fix "
            "the network (or raise train.preflight_timeout_s / lower train.preflight_min_gbps) and run again")
    return code


def run_ranks(req: LaunchRequest) -> int:
    """Claim devices and a port, run torchrun, hold the locks until it ends; returns its exit code."""
    env = dict(os.environ)
    if req.nodes > 1:
        # The nodes of one allocation are alike: without CUDA on this (the first) node, every
        # node runs CPU ranks, which get --threads each as on one node.
        threads = req.threads if cuda_device_count() == 0 else None
        if req.preflight is not None and check_network(req.nodes, *req.preflight, env) == EXIT_PREEMPTED:
            return EXIT_PREEMPTED  # a SIGTERM during the preflight: nothing trained, nothing lost
        port = pick_port(req.port)
        cmd = multinode_command(nodes=req.nodes, gpus_per_node=req.gpus // req.nodes, train_argv=list(req.train_argv),
                                max_restarts=req.max_restarts, port=port, entry=TORCHRUN_ENTRY, threads=threads)
        return run_child(cmd, env)
    locks = GpuLocks(os.environ.get("DETSCALE_GPU_LOCK_DIR", DEFAULT_LOCK_DIR))
    try:
        plan = plan_devices(req.gpus, locks, os.environ.get("CUDA_VISIBLE_DEVICES"), cuda_device_count(),
                            req.lock_timeout_s)
        if plan.visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = plan.visible
        if plan.kind == "cpu":
            env["OMP_NUM_THREADS"] = str(req.threads)
            cores = os.cpu_count() or 1
            if req.gpus * req.threads > cores:
                log.warning("%d rank(s) x %d thread(s) > %d CPU core(s): ranks will compete for cores",
                            req.gpus, req.threads, cores)
        log.info("launch: %d %s rank(s)%s", req.gpus, plan.kind,
                 f" on CUDA_VISIBLE_DEVICES={plan.visible}" if plan.kind == "cuda" else
                 f", {req.threads} thread(s) each")
        port = None if req.standalone else pick_port(req.port)
        return run_child(torchrun_command(req.gpus, req.train_argv, port, req.max_restarts), env)
    finally:
        locks.release()
