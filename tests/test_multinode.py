"""Multi-node DDP: the srun + torchrun command line, and the c10d rendezvous path without Slurm.

The rendezvous test starts two ``torchrun`` agents on this machine, each with ``--nnodes 2
--nproc-per-node 1`` and the same c10d endpoint and id, exactly as the ``srun`` step of
:func:`detscale.cluster.slurm.multinode_command` starts one agent per node. The two ranks (gloo) train
a few DDP steps and must end with identical weights.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from detscale.cluster import slurm
from detscale.cluster.slurm import SlurmError, multinode_command
from helpers import tiny_dataset

HERE = Path(__file__).resolve().parent


def _env(**values: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", **values}


def test_multinode_command_argv() -> None:
    argv = ["train", "--config", "c.yaml", "--run", "r1", "--out", "results/runs/r1"]
    cmd = multinode_command(2, 4, argv, max_restarts=3, port=29511,
                            env=_env(SLURM_JOB_NODELIST="gpu[07-08]", SLURM_CPUS_ON_NODE="32"),
                            python="/venv/bin/python",
                            resolve=lambda name: f"{name}.ib")
    srun, agent = cmd[: cmd.index("/venv/bin/python")], cmd[cmd.index("/venv/bin/python"):]
    assert srun[0] == "srun"
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--cpus-per-task=32",
            "--overlap", "--kill-on-bad-exit=0"} <= set(srun)
    assert agent[:3] == ["/venv/bin/python", "-m", "detscale.cluster.slurm"]  # maps Slurm's SIGTERM to exit 75
    assert agent[3:] == [
        "/venv/bin/python", "-m", "torch.distributed.run",
        "--nnodes=2", "--nproc-per-node=4",
        "--rdzv-backend=c10d", "--rdzv-endpoint=gpu07.ib:29511", "--rdzv-id=4242", "--max-restarts=3",
        "-m", "--", "detscale", *argv,
    ]


def test_multinode_command_exports_cpu_threads() -> None:
    # CPU ranks: every node's ranks get OMP_NUM_THREADS=T through srun (torchrun would set 1 for
    # several ranks per node); GPU ranks (threads=None) leave the variable alone.
    env = _env(SLURM_JOB_NODELIST="c[1-2]", SLURM_CPUS_ON_NODE="8")
    cpu = multinode_command(2, 2, ["train"], 0, 1234, env=env, python="py", resolve=str, threads=3)
    srun = cpu[: cpu.index("py")]
    assert "--export=ALL,OMP_NUM_THREADS=3" in srun
    gpu = multinode_command(2, 2, ["train"], 0, 1234, env=env, python="py", resolve=str)
    assert not any(a.startswith("--export") for a in gpu)
    with pytest.raises(SlurmError, match="threads per rank"):
        multinode_command(2, 2, ["train"], 0, 1234, env=env, threads=0)


def test_describe_task_names_node_gpus_and_threads() -> None:
    line = slurm.describe_task({"SLURMD_NODENAME": "dsnode2", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
                                "CUDA_VISIBLE_DEVICES": "0", "SLURM_GPUS_ON_NODE": "1", "OMP_NUM_THREADS": "2"})
    assert line == ("agent on node dsnode2 (node rank 1 of 2): CUDA_VISIBLE_DEVICES=0 SLURM_GPUS_ON_NODE=1 "
                    "OMP_NUM_THREADS=2")
    assert "CUDA_VISIBLE_DEVICES=<unset>" in slurm.describe_task({})


def test_multinode_command_falls_back_to_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    # Snakemake's job-step executor drops SLURM_JOB_NODELIST; the node list then comes from scontrol.
    calls = []

    def fake_scontrol(jid: str) -> dict[str, str]:
        calls.append(jid)
        return {"JobId": jid, "NodeList": "a[3-4],b1", "NumNodes": "3", "NumCPUs": "48"}

    monkeypatch.setattr(slurm, "_scontrol_job", fake_scontrol)
    cmd = multinode_command(3, 1, ["train"], 0, 1234, env=_env(), python="py", resolve=str)
    assert calls == ["4242", "4242"]
    assert "--rdzv-endpoint=a3:1234" in cmd
    assert "--cpus-per-task=16" in cmd


def test_multinode_command_needs_slurm_and_enough_nodes() -> None:
    with pytest.raises(SlurmError, match="SLURM_JOB_ID is not set.*grid.nodes: 1"):
        multinode_command(2, 1, ["train"], 0, 1234, env={})
    with pytest.raises(SlurmError, match="holds 1 node"):
        multinode_command(2, 1, ["train"], 0, 1234, env=_env(SLURM_JOB_NODELIST="n1"))
    with pytest.raises(SlurmError, match="port"):
        multinode_command(1, 1, ["train"], 0, 0, env=_env(SLURM_JOB_NODELIST="n1"))
    with pytest.raises(SlurmError, match=">= 1"):
        multinode_command(1, 0, ["train"], 0, 1234, env=_env(SLURM_JOB_NODELIST="n1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_agents_rendezvous_and_agree_on_weights(tmp_path: Path) -> None:
    """Two torchrun agents, one rank each, meet through c10d and train to identical weights."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    agents = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=detscale-test",
            "--max-restarts=0", "--monitor-interval=0.5",
            str(HERE / "multinode_probe.py"), "--out", str(tmp_path), "--steps", "3",
        ]
        log = open(tmp_path / f"agent{node}.log", "w")  # noqa: SIM115 - closed below
        agents.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in agents:
        try:
            codes.append(proc.wait(timeout=120))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    logs = "\n".join((tmp_path / f"agent{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" for r in results)
    # The ranks saw different data (each its own shard) ...
    assert results[0]["data_digest"] != results[1]["data_digest"]
    # ... yet the all-reduced gradients left every rank with the same weights, which changed.
    assert results[0]["weights_digest"] == results[1]["weights_digest"], logs
    assert results[0]["weights_digest"] != results[0]["initial_digest"]


TRAIN_CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [2]
  batch: [2]
  cache: [none]
  precision: [fp32]
  epochs: 1
train:
  warmup_epochs: 0
  nominal_batch: 4  # one global batch per step: the 8 images make 2 steps
  close_mosaic: 0
  workers: 0
  cpu_threads_per_rank: 1
  max_restarts: 0
augment:
  mosaic: 0.0
"""


@pytest.mark.slow
def test_two_agents_run_detscale_train(tmp_path: Path) -> None:
    """The real trainer across two torchrun agents (two 'nodes' of one rank each) through c10d."""
    detscale = [sys.executable, "-m", "detscale"]
    tiny_dataset(tmp_path / "data", train=8, val=2, objects=(1, 2), object_size=(0.02, 0.6))
    config = tmp_path / "config.yaml"
    config.write_text(TRAIN_CONFIG.format(data_yaml=tmp_path / "data" / "data.yaml"))
    run = subprocess.run([*detscale, "runs", "--config", str(config)], check=True, capture_output=True, text=True,
                         timeout=60).stdout.split()[0]
    out = tmp_path / "run"
    # The torchrun part of multinode_command, with this machine standing in for both nodes.
    cmd = multinode_command(2, 1, ["train", "--config", str(config), "--run", run, "--out", str(out),
                                   "--data", str(tmp_path / "data" / "data.yaml")], 0, _free_port(),
                            env=_env(SLURM_JOB_NODELIST="here[1-2]", SLURM_CPUS_ON_NODE="1"),
                            resolve=lambda _: "127.0.0.1")
    agent_cmd = cmd[cmd.index(sys.executable):]  # what srun would start on each node
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(2)]  # noqa: SIM115 - closed below
    agents = [subprocess.Popen(agent_cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path) for f in logs]
    codes = []
    for proc in agents:
        try:
            codes.append(proc.wait(timeout=300))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    for f in logs:
        f.close()
    text = "\n".join((tmp_path / f"agent{i}.log").read_text()[-2000:] for i in range(2))
    assert codes == [0, 0], text
    env_json = json.loads((out / "env.json").read_text())
    timing = json.loads((out / "timing.json").read_text())
    assert env_json["world_size"] == 2 and len(env_json["rank_hosts"]) == 2, env_json
    assert timing["world_size"] == 2 and timing["global_batch"] == 4
    assert (out / "weights" / "last.pt").is_file()
