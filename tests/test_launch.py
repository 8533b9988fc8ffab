"""detscale launch: GPU slot locks, device planning, the rendezvous port, argument checks, signals.

Everything here runs without a GPU: the device count is passed in explicitly, and the CLI
checks that must fail do so before torchrun starts (no run folder is created).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from detscale import launch as launch_mod
from detscale import slurm
from detscale.config import RunPoint
from detscale.engine.semantics import check_world_size
from detscale.launch import (
    EXIT_PREEMPTED,
    GpuLocks,
    LaunchError,
    LaunchRequest,
    pick_port,
    plan_devices,
    port_is_free,
    torchrun_command,
)


def test_locks_give_disjoint_cards_to_concurrent_launchers(tmp_path: Path) -> None:
    first, second = GpuLocks(tmp_path), GpuLocks(tmp_path)
    assert first.claim(2, available=4, timeout_s=0) == [0, 1]
    assert second.claim(2, available=4, timeout_s=0) == [2, 3]
    third = GpuLocks(tmp_path)
    with pytest.raises(LaunchError, match="could not claim 1 free GPU"):
        third.claim(1, available=4, timeout_s=0)
    first.release()
    assert third.claim(1, available=4, timeout_s=0) == [0]
    assert (tmp_path / "gpu0.lock").read_text().startswith(str(os.getpid()))


def test_partial_claims_are_given_back(tmp_path: Path) -> None:
    holder = GpuLocks(tmp_path)
    holder.claim(1, available=2, timeout_s=0)
    waiting = GpuLocks(tmp_path)
    with pytest.raises(LaunchError):
        waiting.claim(2, available=2, timeout_s=0)
    assert waiting.indices == []  # card 1 was not kept while waiting for card 0
    assert GpuLocks(tmp_path).claim(1, available=2, timeout_s=0) == [1]


def test_more_gpus_than_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="asked for 3 GPU.*has 2"):
        plan_devices(3, GpuLocks(tmp_path), visible=None, device_count=2, lock_timeout_s=0)
    with pytest.raises(LaunchError, match="CUDA_VISIBLE_DEVICES=4,5 gives 2"):
        plan_devices(3, GpuLocks(tmp_path), visible="4,5", device_count=2, lock_timeout_s=0)


def test_visible_devices_from_slurm_are_kept_and_not_locked(tmp_path: Path) -> None:
    plan = plan_devices(2, GpuLocks(tmp_path), visible="4,5,6", device_count=3, lock_timeout_s=0)
    assert (plan.kind, plan.visible, plan.claimed_by_us) == ("cuda", "4,5", False)
    assert not list(tmp_path.glob("*.lock"))


def test_claimed_cards_are_exported(tmp_path: Path) -> None:
    other_job = GpuLocks(tmp_path)
    other_job.claim(1, available=4, timeout_s=0)
    plan = plan_devices(2, GpuLocks(tmp_path), visible=None, device_count=4, lock_timeout_s=0)
    assert (plan.kind, plan.visible, plan.claimed_by_us) == ("cuda", "1,2", True)
    other_job.release()


def test_without_cuda_ranks_run_on_the_cpu(tmp_path: Path) -> None:
    plan = plan_devices(2, GpuLocks(tmp_path), visible=None, device_count=0, lock_timeout_s=0)
    assert (plan.kind, plan.nproc, plan.visible) == ("cpu", 2, None)


def test_busy_port_is_an_error_and_a_free_one_is_picked() -> None:
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert not port_is_free(busy)
        with pytest.raises(LaunchError, match=f"port {busy} is already in use"):
            pick_port(busy)
    port = pick_port(None)
    assert 0 < port < 65536 and port_is_free(port)


def test_torchrun_command_separates_our_arguments() -> None:
    cmd = torchrun_command(2, ["train", "--run", "r"], port=1234, max_restarts=1)
    i = cmd.index("--nproc-per-node")
    assert cmd[i + 1] == "2"
    assert "localhost:1234" in cmd
    # without "--", torchrun's argparse takes "--run" for its own "--run-path" and refuses to start
    assert cmd[cmd.index("-m", 3):] == ["-m", "--", "detscale", "train", "--run", "r"]
    assert "--standalone" in torchrun_command(1, ["train"], port=None, max_restarts=0)


def test_strong_scaling_batch_must_divide() -> None:
    point = RunPoint("gelan-t", 64, 2, 1, 5, "strong", "none", "fp32", 0)
    with pytest.raises(Exception, match="does not divide by 2 ranks"):
        check_world_size(point, 2)


CONFIG = """\
dataset:
  name: tiny
  synthetic: {{imgsz: 64, train: 4, val: 2}}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [2]
  batch: [{batch}]
  scaling: {scaling}
  cache: [none]
  epochs: 1
"""


def _launch(tmp_path: Path, *launch_args: str, batch: int = 2, scaling: str = "weak",
            run: str = "gelan-t_64_g2_b2_none_fp32_r0") -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(batch=batch, scaling=scaling))
    cmd = [sys.executable, "-m", "detscale", "launch", *launch_args, "--", "train", "--config", str(cfg),
           "--run", run, "--out", str(tmp_path / "run")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_cli_wrong_gpu_count_fails_before_start(tmp_path: Path) -> None:
    out = _launch(tmp_path, "--gpus", "3")
    assert out.returncode == 2, out.stderr
    assert "is a 2-rank run but 3 rank(s)" in out.stderr and "--gpus 2" in out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_indivisible_global_batch_fails_before_start(tmp_path: Path) -> None:
    out = _launch(tmp_path, "--gpus", "2", batch=5, scaling="strong", run="gelan-t_64_g2_b5s_none_fp32_r0")
    assert out.returncode == 2, out.stderr
    assert "global batch 5" in out.stderr and "divide" in out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_busy_port_fails_before_start(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        out = _launch(tmp_path, "--gpus", "2", "--port", str(s.getsockname()[1]))
    assert out.returncode == 2, out.stderr
    assert "already in use" in out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_needs_train_after_the_separator(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "detscale", "launch", "--gpus", "1", "--", "evaluate"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "expected `-- train ARGS`" in out.stderr


def test_sigterm_is_forwarded_and_gives_the_requeue_code(tmp_path: Path) -> None:
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def stop(signum, frame):
            pathlib.Path({str(tmp_path / 'got')!r}).write_text(str(signum))
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        pathlib.Path({str(tmp_path / 'ready')!r}).write_text("1")
        time.sleep(60)
    """))
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import os, sys; from detscale.launch import run_child; "
        f"sys.exit(run_child([sys.executable, {str(child)!r}], dict(os.environ)))")])
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == EXIT_PREEMPTED
    assert (tmp_path / "got").read_text() == str(int(signal.SIGTERM))


def _multinode_launch(monkeypatch: pytest.MonkeyPatch, cuda_devices: int, threads: int) -> tuple[list[str], dict]:
    """``launch()`` of a 2-node run inside a (faked) Slurm job: the command and env it would start."""
    started: list[tuple[list[str], dict]] = []
    monkeypatch.setattr(launch_mod, "run_child", lambda cmd, env: started.append((list(cmd), env)) or 0)
    monkeypatch.setattr(launch_mod, "cuda_device_count", lambda: cuda_devices)
    monkeypatch.setattr(slurm, "node_address", lambda name: f"{name}.addr")
    for key, value in {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_ON_NODE": "4"}.items():
        monkeypatch.setenv(key, value)
    req = LaunchRequest(gpus=4, nodes=2, threads=threads, max_restarts=0, port=None, standalone=False,
                        lock_timeout_s=1.0, train_argv=("train", "--run", "r"))
    assert launch_mod.launch(req) == 0
    assert len(started) == 1
    return started[0]


def test_multinode_cpu_ranks_get_their_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    cmd, _env = _multinode_launch(monkeypatch, cuda_devices=0, threads=3)
    srun = cmd[: cmd.index("-m")]
    assert srun[0] == "srun" and "--nodes=2" in srun and "--gpus-per-node=2" in srun
    assert "--export=ALL,OMP_NUM_THREADS=3" in srun  # every node's ranks, not only this process
    assert "--rdzv-endpoint=n1.addr:" in " ".join(cmd) and "--nproc-per-node=2" in cmd


def test_multinode_gpu_ranks_leave_threads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    cmd, _env = _multinode_launch(monkeypatch, cuda_devices=2, threads=3)
    assert not any(a.startswith("--export") for a in cmd)


def test_cli_multinode_outside_slurm_is_a_clear_error(tmp_path: Path) -> None:
    """Without a Slurm allocation a multi-node run says how to get one (or to use one node)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(batch=2, scaling="weak").replace("  gpus: [2]\n", "  gpus: [2]\n  nodes: 2\n"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "detscale", "launch", "--gpus", "2", "--nodes", "2", "--", "train",
                          "--config", str(cfg), "--run", "gelan-t_64_g2n2_b2_none_fp32_r0", "--out",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert "needs a Slurm allocation" in out.stderr and "grid.nodes: 1" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()
