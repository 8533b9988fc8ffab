"""detscale launch: GPU slot locks, device planning, the rendezvous port, argument checks, signals.

Everything here runs without a GPU: the device count is passed in explicitly, and the CLI
checks that must fail do so before torchrun starts (no run folder is created).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from detscale import files as files_mod
from detscale.cluster import slurm
from detscale.cluster import torchrun as launch_mod
from detscale.cluster.torchrun import (
    GpuLocks,
    LaunchError,
    LaunchRequest,
    pick_port,
    plan_devices,
    port_is_free,
    torchrun_command,
)
from detscale.config import RunPoint
from detscale.engine.semantics import check_world_size
from detscale.errors import EXIT_PREEMPTED
from detscale.files import restore_resume_files, stash_resume_files


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
    point = RunPoint("gelan-t", 64, 2, 1, 5, "strong", "none", "fp32", 0, 0)
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
            run: str = "gelan-t_64_g2_b2_none_fp32_s0_r0", train_args: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(batch=batch, scaling=scaling))
    cmd = [sys.executable, "-m", "detscale", "launch", *launch_args, "--", "train", "--config", str(cfg),
           "--run", run, "--out", str(tmp_path / "run"), *train_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_cli_wrong_gpu_count_fails_before_start(tmp_path: Path) -> None:
    out = _launch(tmp_path, "--gpus", "3")
    assert out.returncode == 2, out.stderr
    assert "is a 2-rank run but 3 rank(s)" in out.stderr and "--gpus 2" in out.stderr
    assert "train --resume --elastic" in out.stderr  # the way to continue a trained run elsewhere
    assert not (tmp_path / "run").exists()
    # continuing it elastically on 3 ranks cannot keep its 64 images per optimiser step in batches of 2
    out = _launch(tmp_path, "--gpus", "3", train_args=("--resume", "--elastic"))
    assert out.returncode == 2, out.stderr
    assert "each optimiser step holds 64 images (2 per rank x 2 ranks x 16 accumulated)" in out.stderr
    assert "Continue it on 1, 2, 4, 8, 16 or 32 rank(s)" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_cli_indivisible_global_batch_fails_before_start(tmp_path: Path) -> None:
    out = _launch(tmp_path, "--gpus", "2", batch=5, scaling="strong", run="gelan-t_64_g2_b5s_none_fp32_s0_r0")
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
    assert out.returncode == 2 and "expected `-- train ARGS` or `-- comm ARGS`" in out.stderr


def test_comm_benchmark_on_two_cpu_ranks(tmp_path: Path) -> None:
    """`launch -- comm`: DDP's buckets of the model's whole gradient, timed on 2 gloo ranks, figures as nccl-tests."""
    from detscale.model import build_model
    from helpers import tiny_dataset

    data = tiny_dataset(tmp_path / "data", train=2, val=1)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(batch=2, scaling="weak"))
    out_json = tmp_path / "comm" / "gelan-t_64_g2.json"
    args = ["--config", str(cfg), "--model", "gelan-t", "--imgsz", "64", "--data", str(data), "--out", str(out_json),
            "--iters", "3", "--batch", "2"]
    refused = subprocess.run([sys.executable, "-m", "detscale", "launch", "--gpus", "2", "--resume-stash",
                              str(tmp_path / "stash"), "--", "comm", *args], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "nothing to resume" in refused.stderr
    out = subprocess.run([sys.executable, "-m", "detscale", "launch", "--gpus", "2", "--threads", "1", "--", "comm",
                          *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out_json.read_text())
    nc = 6  # the synthetic dataset's classes
    grads = sum(p.numel() * 4 for p in build_model("gelan-t", nc).parameters() if p.requires_grad)
    assert result["world_size"] == 2 and result["backend"] == "gloo" and result["device"] == "cpu"
    assert sum(result["bucket_bytes"]) == result["gradient_bytes"] == grads
    assert result["time_ms"] > 0 and len(result["sweep"]) == 8
    # nccl-tests: busbw = algbw x 2 (n - 1) / n, which is 1 for 2 ranks
    assert result["busbw_GBps"] == pytest.approx(result["algbw_GBps"])
    assert result["algbw_GBps"] == pytest.approx(grads / (result["time_ms"] / 1000) / 1e9)
    assert result["fit"]["busbw_GBps"] > 0
    # the contention probe: rank 0 alone vs both ranks at once, at the given batch, in interleaved rounds;
    # its factor is the median round's, its spread the lowest and highest round
    probe = result["contention"]
    assert probe["batch"] == 2 and probe["alone_ms"] > 0 and probe["together_ms"] > 0
    assert len(probe["factor_rounds"]) == probe["rounds"] == 5
    assert probe["factor"] == pytest.approx(statistics.median(probe["factor_rounds"]))
    assert probe["factor_min"] == min(probe["factor_rounds"]) <= probe["factor"] <= probe["factor_max"]
    assert "all-reduce of" in out.stdout and "GB/s" in out.stdout and "contention: a rank's forward+backward x" in \
        out.stdout


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
        "import os, sys; from detscale.cluster.torchrun import run_child; "
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
                          "--config", str(cfg), "--run", "gelan-t_64_g2n2_b2_none_fp32_s0_r0", "--out",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr
    assert "needs a Slurm allocation" in out.stderr and "grid.nodes: 1" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def _run_folder(out: Path, checkpoint: bytes = b"ckpt-epoch-3") -> None:
    (out / "weights").mkdir(parents=True, exist_ok=True)
    (out / "weights" / "last.pt").write_bytes(checkpoint)
    (out / "metrics.jsonl").write_text('{"epoch": 0}\n')
    (out / "timing.json").write_text("{}")


def _delete_outputs(out: Path) -> None:
    """What Snakemake does to a job's outputs before running it again."""
    for name in ("weights/last.pt", "metrics.jsonl", "timing.json"):
        (out / name).unlink(missing_ok=True)


def test_resume_stash_survives_the_workflow_deleting_outputs(tmp_path: Path) -> None:
    out, stash = tmp_path / "run", tmp_path / "run" / "resume-stash"
    _run_folder(out)
    assert stash_resume_files(out, stash, "d1")
    _delete_outputs(out)
    assert restore_resume_files(out, stash, "d1")
    assert (out / "weights" / "last.pt").read_bytes() == b"ckpt-epoch-3"
    assert (out / "metrics.jsonl").read_text() == '{"epoch": 0}\n'
    assert not (out / "timing.json").exists()  # only what resuming reads comes back
    assert not stash.exists()


def test_resume_stash_of_another_config_is_dropped(tmp_path: Path) -> None:
    out, stash = tmp_path / "run", tmp_path / "stash"
    _run_folder(out)
    stash_resume_files(out, stash, "old-digest")
    _delete_outputs(out)
    assert not restore_resume_files(out, stash, "new-digest")
    assert not (out / "weights" / "last.pt").exists() and not stash.exists()
    # Without a checkpoint there is nothing to keep.
    assert not stash_resume_files(out, stash, "new-digest") and not stash.exists()


def test_resume_stash_keeps_newer_files_of_the_run_folder(tmp_path: Path) -> None:
    out, stash = tmp_path / "run", tmp_path / "stash"
    _run_folder(out, b"old")
    stash_resume_files(out, stash, "d")
    (out / "weights" / "last.pt").unlink()
    (out / "weights" / "last.pt").write_bytes(b"newer")  # e.g. the run was resumed by hand meanwhile
    assert not restore_resume_files(out, stash, "d")
    assert (out / "weights" / "last.pt").read_bytes() == b"newer"


def test_resume_stash_follows_each_new_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's refresh after every save: the stash holds the newest checkpoint, not the first."""
    out, stash = tmp_path / "run", tmp_path / "run" / "resume-stash"
    monkeypatch.setenv(files_mod.STASH_ENV, str(stash))
    _run_folder(out, b"epoch-1")
    files_mod.refresh_resume_stash(out, "d")
    # the trainer saves atomically: a new file renamed over last.pt (a new inode, not a write into it)
    (out / "weights" / "new.pt").write_bytes(b"epoch-2")
    os.replace(out / "weights" / "new.pt", out / "weights" / "last.pt")
    files_mod.refresh_resume_stash(out, "d")
    assert sorted(p.name for p in stash.iterdir()) == ["config_digest", "metrics.jsonl", "weights__last.pt"]
    _delete_outputs(out)  # the job died; Snakemake deletes its outputs
    assert restore_resume_files(out, stash, "d")
    assert (out / "weights" / "last.pt").read_bytes() == b"epoch-2"


@pytest.mark.parametrize(("code", "kept"), [(EXIT_PREEMPTED, True), (1, True), (0, False)])
def test_launch_stashes_after_a_failed_run_and_restores_before_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, kept: bool) -> None:
    out, stash = tmp_path / "run", tmp_path / "run" / "resume-stash"
    seen: list[bytes | None] = []

    monkeypatch.delenv(files_mod.STASH_ENV, raising=False)

    def ranks(_req: LaunchRequest) -> int:
        assert os.environ[files_mod.STASH_ENV] == str(stash.resolve())  # for rank 0's refreshes
        last = out / "weights" / "last.pt"
        seen.append(last.read_bytes() if last.exists() else None)
        if not last.exists():  # the run writes its checkpoint
            _run_folder(out, b"ckpt-%d" % len(seen))
        return code

    monkeypatch.setattr(launch_mod, "run_ranks", ranks)
    req = LaunchRequest(gpus=1, nodes=1, threads=1, max_restarts=0, port=None, standalone=True, lock_timeout_s=1.0,
                        train_argv=("train",), stash=(out, stash, "digest"))
    assert launch_mod.launch(req) == code
    assert stash.is_dir() == kept
    assert files_mod.STASH_ENV not in os.environ
    _delete_outputs(out)
    launch_mod.launch(req)
    # The second start found the first run's checkpoint only when the first one failed.
    assert seen == [None, b"ckpt-1" if kept else None]


RESUME_CONFIG = {
    "dataset": {"name": "tiny", "synthetic": {"seed": 0, "imgsz": 64, "train": 16, "val": 4, "objects": [1, 2],
                                              "object_size": [0.2, 0.5]}},
    "grid": {"model": ["gelan-t"], "imgsz": [64], "gpus": [1], "batch": [2], "cache": ["disk"],
             "precision": ["fp32"], "repeats": 1, "epochs": 6, "seed": 0},
    "train": {"warmup_epochs": 0, "close_mosaic": 0, "workers": 0, "timing_warmup_steps": 1,
              "cpu_threads_per_rank": 1, "nominal_batch": 4},
    "augment": {"mosaic": 0.0},
    "eval": {"batch": 4},
}


def test_launch_does_not_stash_a_checkpoint_older_than_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, stash = tmp_path / "run", tmp_path / "stash"
    _run_folder(out, b"from another config")
    old = time.time() - 3600
    os.utime(out / "weights" / "last.pt", (old, old))
    monkeypatch.setattr(launch_mod, "run_ranks", lambda _req: 2)  # e.g. the trainer refused it
    req = LaunchRequest(gpus=1, nodes=1, threads=1, max_restarts=0, port=None, standalone=True, lock_timeout_s=1.0,
                        train_argv=("train",), stash=(out, stash, "digest"))
    assert launch_mod.launch(req) == 2
    assert not stash.exists()


@pytest.mark.slow
def test_workflow_rerun_resumes_after_a_kill_and_after_a_sigterm(tmp_path: Path) -> None:
    """Stop a training job of the workflow twice, rerunning it each time: it resumes, never starts over.

    Snakemake deletes the job's outputs, weights/last.pt included, before running it again; the
    rule's ``--resume-stash`` is what carries the checkpoint across. First the job's whole process
    tree is SIGKILLed, as on a lost node: the stash rank 0 refreshed after its last epoch is all
    that remains. Then the resumed job's launcher gets SIGTERM, as Slurm sends before a time limit:
    rank 0 writes a mid-epoch checkpoint and the launcher stashes it. The third start finishes.
    """
    import psutil
    import yaml

    root = Path(__file__).resolve().parents[1]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(RESUME_CONFIG))
    work = tmp_path / "work"
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "--directory", str(work),
           "--configfile", str(config), "--cores", "2", "--rerun-incomplete"]
    run = work / "results" / "runs" / "gelan-t_64_g1_b2_disk_fp32_s0_r0"
    stash, train_log = run / "resume-stash", work / "results" / "logs" / "runs" / run.name / "train.log"
    last = run.relative_to(work) / "weights" / "last.pt"

    def stop_when(ready: Callable[[], bool], stop: Callable[[psutil.Process], None]) -> int:
        """Start the workflow, wait for ``ready``, ``stop`` its launcher; the epoch the stash resumes."""
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 300
            while not ready():
                assert proc.poll() is None and time.monotonic() < deadline, "the training did not get there"
                time.sleep(0.05)
            (launcher,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                           if "--resume-stash" in p.cmdline() and "launch" in p.cmdline()]
            stop(launcher)
            assert proc.wait(timeout=300) != 0
        finally:
            if proc.poll() is None:
                proc.kill()
        return _torch_load(stash / "weights__last.pt")["epoch"]

    def kill_tree(launcher: psutil.Process) -> None:  # no warning: launcher, torchrun, rank, workers at once
        for p in [launcher, *launcher.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def epochs_done() -> int:
        metrics = run / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    # 1. Killed once the first epoch's checkpoint is stashed (the launcher never gets to stash).
    killed = stop_when(lambda: (stash / "config_digest").is_file(), kill_tree)
    assert 1 <= killed <= 2

    # 2. The rerun resumes at the next epoch; SIGTERM once it has trained one more.
    def resumed_and_trained() -> bool:
        log = train_log.read_text() if train_log.is_file() else ""
        return f"resuming from {last} at epoch {killed + 1} step 0" in log and epochs_done() > killed

    termed = stop_when(resumed_and_trained, lambda launcher: launcher.send_signal(signal.SIGTERM))
    assert killed < termed < 6

    # 3. The third start resumes where the SIGTERM stopped and finishes the run.
    third = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-4000:]
    log = train_log.read_text()
    assert f"resuming from {last} at epoch {termed + 1} step" in log, log[-3000:]
    assert _torch_load(run / "weights" / "last.pt")["epoch"] == 6
    rows = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(6))  # every attempt's rows kept, none twice
    assert not stash.exists()


def _torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)
