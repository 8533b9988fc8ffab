"""Slurm: host lists and allocation helpers (unit), and a real Slurm cluster on this machine (``slurm``).

The cluster tests bring up ``tests/slurm/cluster.sh`` (Debian's slurmctld, munge and two slurmd
on this machine, nodes dsnode1 and dsnode2 with the machine's real CPUs and memory and 4 fake
GPUs each; partition ``debug``, and ``maint`` set DOWN) and submit real jobs to it.
They are skipped, with the script's output as the reason, where the cluster cannot be started
(not root, no apt); set ``DETSCALE_REQUIRE_SLURM=1`` (as CI should) to make that a failure instead.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from detscale.cluster import slurm, slurmfit
from detscale.cluster.slurm import SlurmError, expand_hostlist
from detscale.errors import EXIT_PREEMPTED
from helpers import tiny_dataset

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
STATE = Path(os.environ.get("DETSCALE_SLURM_STATE", "/tmp/detscale-slurm"))


# ---------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "hosts"),
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1,3]-ib,b", ["a1-ib", "a3-ib", "b"]),
    ],
)
def test_expand_hostlist(expr: str, hosts: list[str]) -> None:
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr", ["", "n[1-2", "n1-2]", "n[a-b]", "n[5-3]"])
def test_expand_hostlist_rejects_malformed(expr: str) -> None:
    with pytest.raises(SlurmError):
        expand_hostlist(expr)


def test_job_id() -> None:
    assert slurm.job_id({"SLURM_JOB_ID": "7"}) == "7" and slurm.job_id({"SLURM_JOBID": "8"}) == "8"
    assert slurm.job_id({}) is None


def test_job_nodes_prefers_environment() -> None:
    assert slurm.job_nodes({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "c[1-2]"}) == ["c1", "c2"]
    assert slurm.job_nodes({"SLURM_JOB_ID": "1", "SLURM_NODELIST": "d5"}) == ["d5"]


_AGENT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # as torchrun's agent: dies with status 1\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
    "sys.exit(3)\n"
)


def test_run_agent_maps_sigterm_to_requeue_status() -> None:
    """Slurm signals the whole step: the wrapper turns the agent's death by SIGTERM into 75."""
    wrapper = [sys.executable, "-m", "detscale.cluster.slurm", sys.executable, "-c", _AGENT]
    proc = subprocess.Popen(wrapper, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    os.killpg(proc.pid, signal.SIGTERM)  # every process of the group, as slurmstepd does
    assert proc.wait(timeout=30) == EXIT_PREEMPTED
    # Without a signal the agent's own status passes through.
    quick = subprocess.run([sys.executable, "-m", "detscale.cluster.slurm", sys.executable, "-c",
                            "raise SystemExit(3)"], timeout=60)
    assert quick.returncode == 3


# ---------------------------------------------------------------------------------------------
# A real cluster
# ---------------------------------------------------------------------------------------------


def _run(cmd: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]


def _cluster_up() -> bool:
    """True when this script's daemons already run (then the fixture leaves them running)."""
    status = _run(["bash", str(CLUSTER), "status"], 30)
    return status.returncode == 0 and "not started" not in status.stdout


def _unavailable(reason: str) -> None:
    if os.environ.get("DETSCALE_REQUIRE_SLURM") == "1":
        pytest.fail(f"DETSCALE_REQUIRE_SLURM=1 but the Slurm cluster is unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    if os.geteuid() != 0:
        _unavailable("the Slurm test cluster needs root (apt-get, /etc/slurm/slurm.conf, daemons)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        _unavailable("no Slurm installed and no apt-get to install slurmctld, slurmd, slurm-client, munge")
    was_up = _cluster_up()
    try:
        start = _run(["bash", str(CLUSTER), "start"], 600)
    except subprocess.TimeoutExpired:
        _unavailable("tests/slurm/cluster.sh start did not finish within 600 s")
    if start.returncode != 0:
        _unavailable(f"tests/slurm/cluster.sh start failed:\n{start.stdout}{start.stderr}")
    try:
        yield
    finally:
        if not was_up:
            _run(["bash", str(CLUSTER), "stop"], 60)


def _sbatch_wait(args: list[str], out: Path, timeout: float = 120) -> str:
    """Submit, wait for the job and return its output; fails with it on a bad exit.

    Polled every 0.5 s: ``sbatch --wait`` backs off to tens of seconds between its own polls.
    """
    proc = _run(["sbatch", "--parsable", f"--output={out}", *args], 60, cwd=ROOT)
    assert proc.returncode == 0, f"sbatch {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
    job = _job_state(proc.stdout.strip(), timeout)
    text = out.read_text() if out.exists() else ""
    assert job["ExitCode"] == "0:0", f"sbatch {' '.join(args)}: {job['JobState']} {job['ExitCode']}\n{text}"
    return text


def _env_lines(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.mark.slurm
def test_sbatch_job_gets_its_gpus(cluster: None, tmp_path: Path) -> None:
    text = _sbatch_wait(["--gpus=2", "--cpus-per-gpu=1", "--wrap", "env"], tmp_path / "env.out")
    env = _env_lines(text)
    assert env.get("SLURM_GPUS_ON_NODE") == "2", text
    assert env.get("CUDA_VISIBLE_DEVICES") == "0,1", text


MULTINODE_CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [2]
  nodes: 2
  batch: [2]
  cache: [none]
  precision: [fp32]
  epochs: 4
train:
  warmup_epochs: 0
  nominal_batch: 4  # one global batch per optimiser step: 16 images make 4
  close_mosaic: 0
  workers: 0
  cpu_threads_per_rank: 1
  max_restarts: 0
augment:
  mosaic: 0.0
"""

# What Snakemake's job-step executor does before running a rule's command: it drops every
# SLURM_* variable but the job's identity, so the node list and CPUs must come from scontrol.
SCRUBBED_JOB = """\
import os, sys
keep = {"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_SUBMIT_DIR"}
env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_", "SBATCH_")) or k in keep}
os.execvpe(sys.argv[1], sys.argv[1:], env)
"""


def _job_state(jid: str, timeout: float) -> dict[str, str]:
    """``scontrol show job`` of ``jid`` once it has ended (fails the test after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        job = _jobs([jid])[0]
        if job.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            return job
        assert time.monotonic() < deadline, f"job {jid} still {job.get('JobState')} after {timeout:.0f} s"
        time.sleep(0.5)


@pytest.mark.slurm
@pytest.mark.slow
def test_multinode_launch_preempted_and_resumed(cluster: None, tmp_path: Path) -> None:
    """``detscale launch --nodes 2`` in a 2-node job, stopped by Slurm's SIGTERM and run again.

    srun starts one torchrun agent per node, they meet through c10d on the first node, and the
    trainer runs with 2 ranks. ``scancel --signal=TERM`` signals every process of the job step on
    both nodes, as ``--signal=TERM@300`` (the profile's) does before the time limit: the job ends
    with the requeue status and a checkpoint, and the same job submitted again resumes from it.
    """
    detscale = [sys.executable, "-m", "detscale"]
    tiny_dataset(tmp_path / "data", train=16, val=2, objects=(1, 2), object_size=(0.02, 0.6))
    config = tmp_path / "config.yaml"
    config.write_text(MULTINODE_CONFIG.format(data_yaml=tmp_path / "data" / "data.yaml"))
    run = _run([*detscale, "runs", "--config", str(config)], 60).stdout.split()[0]
    (tmp_path / "scrub.py").write_text(SCRUBBED_JOB)
    out = tmp_path / "run"
    launch = [sys.executable, str(tmp_path / "scrub.py"), *detscale, "launch", "--gpus", "2", "--nodes", "2", "--",
              "train", "--config", str(config), "--run", run, "--out", str(out),
              "--data", str(tmp_path / "data" / "data.yaml"), "--resume"]
    sbatch = ["sbatch", "--parsable", "--nodes=2", "--ntasks=2", "--gpus-per-node=1", "--cpus-per-gpu=1",
              "--export=ALL,OMP_NUM_THREADS=1", "--wrap", " ".join(launch)]

    first = _run([*sbatch, f"--output={tmp_path / 'first.out'}"], 60, cwd=ROOT).stdout.strip()
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 200
    while not (metrics.is_file() and metrics.read_text().strip()):  # signal after the first epoch
        assert _jobs([first])[0].get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), (
            (tmp_path / "first.out").read_text()[-3000:])
        assert time.monotonic() < deadline, "no epoch finished within 200 s"
        time.sleep(0.2)
    _run(["scancel", "--signal=TERM", first], 30)
    job = _job_state(first, 120)
    text = (tmp_path / "first.out").read_text()
    assert job["ExitCode"] == f"{EXIT_PREEMPTED}:0", f"{job['JobState']} {job['ExitCode']}:\n{text[-3000:]}"
    ckpt = torch.load(out / "weights" / "last.pt", map_location="cpu", weights_only=False)
    assert 1 <= ckpt["epoch"] < 4, ckpt["epoch"]
    # The srun step ran one task on each node: both slurmd logs launched step 0 of this job.
    for node in ("dsnode1", "dsnode2"):
        assert f"StepId={first}.0" in (STATE / f"slurmd-{node}.log").read_text(), f"no step {first}.0 on {node}"

    text = _sbatch_wait(sbatch[2:], tmp_path / "second.out", 300)
    assert f"at epoch {ckpt['epoch'] + 1} step {ckpt['step']}" in text and "resuming from" in text, text[-3000:]
    timing = json.loads((out / "timing.json").read_text())
    env_json = json.loads((out / "env.json").read_text())
    assert timing["world_size"] == 2 and env_json["world_size"] == 2
    # the network preflight ran before each start, one task per node (train.preflight_timeout_s)
    preflight = json.loads((out / "preflight.json").read_text())
    assert [n["host"] for n in preflight["nodes"]] == ["dsnode1", "dsnode2"] and preflight["passed"] is True
    assert "preflight: 2 nodes met at" in text


@pytest.mark.slurm
def test_preflight_names_the_node_that_cannot_connect(cluster: None, tmp_path: Path) -> None:
    """A 2-node job whose second node is pointed at a port nobody serves (``srun --multi-prog``: one
    command per task), as a node behind a firewall that rejects the rendezvous port would be."""
    from detscale.cluster.torchrun import pick_port

    head, port = slurm.node_address("dsnode1"), pick_port(None)
    common = f"{sys.executable} -m detscale.cluster.preflight --nodes=2 --hosts=dsnode1,dsnode2 --timeout=8"
    (tmp_path / "tasks.conf").write_text(f"0 {common} --endpoint={head}:{port}\n1 {common} --endpoint={head}:9\n")
    started = time.monotonic()
    sbatch = ["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", "--nodes=2", "--ntasks=2",
              "--cpus-per-task=1", "--wrap", f"srun --multi-prog {tmp_path / 'tasks.conf'}"]
    jid = _run(sbatch, 60, cwd=ROOT).stdout.strip()
    job = _job_state(jid, 120)  # polled every 0.5 s (sbatch --wait backs off to tens of seconds)
    text = (tmp_path / "job.out").read_text()
    assert job["JobState"] == "FAILED", text
    assert time.monotonic() - started < 60, text
    assert "node dsnode2 (node rank 1, interface" in text and "connection refused" in text, text
    assert "did not join the rendezvous" in text and "dsnode2 (node rank 1)" in text, text
    assert "Traceback" not in text and "frame #" not in text, text  # one line per node, no stack dumps


TINY = {
    "dataset": {"name": "tiny", "synthetic": {"seed": 0, "imgsz": 64, "train": 8, "val": 4, "objects": [1, 2],
                                              "object_size": [0.2, 0.5]}},
    "grid": {"model": ["gelan-t"], "imgsz": [64], "gpus": [1, 2], "batch": [2], "cache": ["disk"],
             "precision": ["fp32"], "repeats": 1, "epochs": 1, "seed": 0},
    "train": {"warmup_epochs": 0, "close_mosaic": 0, "workers": 0, "timing_warmup_steps": 1, "nominal_batch": 4},
    "augment": {"mosaic": 0.0},
    "eval": {"batch": 4},
    # The data jobs' CPU ask: the test nodes have the machine's real CPUs (2 here).
    "placement": {"data_threads": 1},
}


def _test_profile(path: Path) -> Path:
    """profiles/slurm with only its placeholders filled in for the test cluster (and faster polling)."""
    import yaml

    profile = yaml.safe_load((ROOT / "profiles" / "slurm" / "config.yaml").read_text())
    defaults = profile["default-resources"]
    defaults["slurm_partition"] = "debug"
    del defaults["slurm_account"]  # no accounts without an accounting database
    defaults["mem_mb"] = 1000  # the test node has little memory; the profile's sizes are for real nodes
    profile["set-resources"]["train"].update(cpus_per_gpu=1, mem_mb=2000)
    profile["set-resources"]["train_multinode"].update(cpus_per_gpu=1, mem_mb=2000)
    profile["set-resources"]["comm"].update(cpus_per_gpu=1, mem_mb=2000)
    profile["set-resources"]["evaluate"]["mem_mb"] = 2000
    profile["slurm-status-command"] = "squeue"  # no accounting database: sacct cannot answer
    # The plugin polls after this many seconds, then 10 s later each time nothing finished. Measured
    # on the two pipeline tests (idle 2-core host): 8 s 173 s, 3 s 165 s, 5 s 158 s.
    profile["slurm-init-seconds-before-status-checks"] = 5
    profile["latency-wait"] = 5
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    return path


def _jobs(ids: list[str]) -> list[dict[str, str]]:
    """``scontrol show job`` of finished jobs (kept for MinJobAge) as key -> value dicts."""
    jobs = []
    for jid in ids:
        out = _run(["scontrol", "show", "job", "--oneliner", jid], 30).stdout
        jobs.append(dict(item.split("=", 1) for item in out.split() if "=" in item))
    return jobs


def _snakemake_command(tmp_path: Path, config: dict, *args: str) -> tuple[list[str], dict[str, str], Path]:
    """The workflow with ``config`` through the test copy of profiles/slurm: (command, env, work folder)."""
    import yaml

    work = tmp_path / "work"
    work.mkdir()
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work),
           "--configfile", str(config_file), "--profile", str(_test_profile(tmp_path / "profile")), *args]
    return cmd, env, work


def _snakemake_on_cluster(tmp_path: Path, config: dict, *args: str) -> Path:
    """Run the workflow with ``config`` through the test copy of profiles/slurm; its work folder."""
    cmd, env, work = _snakemake_command(tmp_path, config, *args)
    proc = _run(cmd, 600, env=env)
    log = proc.stdout[-4000:] + proc.stderr[-8000:]
    assert proc.returncode == 0, log
    return work


def _requeue_after_first_epoch(proc: subprocess.Popen[str], run: Path) -> str:
    """``scontrol requeue`` the Slurm job training ``run`` once its first epoch is written; its job id.

    ``scontrol requeue`` SIGTERMs the running job and queues it again under the same id, as
    preemption does. Slurm holds a requeued job back for about two minutes once it is pending
    again; it is let start at once (an update while it is still completing does not stick).
    """
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "no epoch finished"
        time.sleep(0.2)
    jid = json.loads((run / "env.json").read_text())["slurm_job_id"]
    assert _run(["scontrol", "requeue", jid], 30).returncode == 0
    deadline = time.monotonic() + 120
    while _jobs([jid])[0].get("JobState") != "PENDING":
        assert time.monotonic() < deadline, f"requeued job {jid} did not become pending"
        time.sleep(0.5)
    assert _run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], 30).returncode == 0
    return jid


@pytest.mark.slurm
@pytest.mark.slow
def test_pipeline_through_slurm_profile(cluster: None, tmp_path: Path) -> None:
    """The tiny grid (1 and 2 GPUs) end to end with ``--profile profiles/slurm`` on the test cluster.

    On the way the 1-GPU training job is requeued after its first epoch (the profile submits with
    ``--requeue``, as a preempted job is): the launcher keeps the checkpoint in the resume stash,
    the second start of the batch script (whose Snakemake deletes the job's outputs first) puts it
    back, and ``train --resume`` continues. Snakemake, waiting on the job id, sees one job that
    finished. (One pipeline for both: each costs a minute of Slurm start-up and polling.)
    """
    # Epochs enough that the requeue lands while the 1-GPU run still trains.
    tiny = {**TINY, "grid": {**TINY["grid"], "epochs": 6},
            "dataset": {**TINY["dataset"], "synthetic": {**TINY["dataset"]["synthetic"], "train": 16}},
            "train": {**TINY["train"], "cpu_threads_per_rank": 1}}
    # Both trainings (and both evaluations) at once: the test is about placement, not timing.
    cmd, env, work = _snakemake_command(tmp_path, tiny, "--resources", "timed_run=2")
    requeued = work / "results" / "runs" / "gelan-t_64_g1_b2_disk_fp32_s0_r0"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        jid = _requeue_after_first_epoch(proc, requeued)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-6000:]

    # The requeued job ran twice under one id and resumed from its checkpoint.
    job = _jobs([jid])[0]
    assert job["Requeue"] == "1" and job["Restarts"] == "1", job
    log = (work / "results" / "logs" / "runs" / requeued.name / "train.log").read_text()
    assert "from the resume stash" in log and "resuming from" in log, log[-3000:]
    assert len((requeued / "metrics.jsonl").read_text().splitlines()) == 6

    # Every non-local job went through sbatch: the plugin's Slurm logs, one per job, and its job ids.
    log_dir = work / ".snakemake" / "slurm_logs"
    slurm_logs = sorted(log_dir.rglob("*.log"))  # <rule_R or group_G>/[<wildcards>/]<job id>.log
    ids = sorted({p.stem for p in slurm_logs}, key=int)
    rules = {p.relative_to(log_dir).parts[0] for p in slurm_logs}
    assert {"rule_train", "rule_evaluate", "rule_comm"} <= rules, rules
    # The profile's `data` group: synthetic data, validation and cache in one Slurm job.
    assert any(r.startswith("group_data") for r in rules), rules
    assert not {"rule_report", "rule_run_config"} & rules  # local rules stay local

    # The training jobs asked Slurm for their GPUs, and the ranks saw exactly the cards Slurm gave.
    runs = sorted((work / "results" / "runs").iterdir())
    assert len(runs) == 2
    cards = {}
    for run in runs:
        gpus = int(run.name.split("_g")[1].split("_")[0])
        env_json = json.loads((run / "env.json").read_text())
        job = _jobs([env_json["slurm_job_id"]])[0]
        assert job.get("TresPerJob") == f"gres:gpu:{gpus}", job
        visible = env_json["cuda_visible_devices"].split(",")
        assert len(set(visible)) == gpus and set(visible) <= {"0", "1", "2", "3"}, env_json
        assert env_json["world_size"] == gpus
        cards[run.name] = (set(visible), job["NodeList"], job["StartTime"], job["EndTime"])
    (a, node_a, start_a, end_a), (b, node_b, start_b, end_b) = cards.values()
    if node_a == node_b and start_a < end_b and start_b < end_a:  # shared a node at the same time
        assert not a & b, cards
    # Evaluation asked for CPUs only.
    evals = [j for j in _jobs(ids) if "rule_evaluate" in j.get("Comment", "")]
    assert len(evals) == 2 and all("gpu" not in j.get("TresPerJob", "") for j in evals), evals

    report = work / "results" / "report"
    assert (report / "index.html").is_file() and (report / "scaling.csv").is_file()


@pytest.mark.slurm
@pytest.mark.slow
def test_multinode_point_through_slurm_profile(cluster: None, tmp_path: Path) -> None:
    """A 2-GPU point on 2 nodes through the profile: one sbatch job over both nodes, an agent on each."""
    tiny = {**TINY, "grid": {**TINY["grid"], "gpus": [2], "nodes": 2},
            "train": {**TINY["train"], "cpu_threads_per_rank": 1}}
    work = _snakemake_on_cluster(tmp_path, tiny)

    (run,) = sorted((work / "results" / "runs").iterdir())
    assert run.name.startswith("gelan-t_64_g2n2_"), run.name
    # The training went through sbatch as rule train_multinode: one job holding both nodes, one
    # task and one GPU on each (sbatch --nodes=2 --ntasks=2 --gpus=2 --gpus-per-node=1).
    log_dir = work / ".snakemake" / "slurm_logs"
    train_logs = sorted((log_dir / "rule_train_multinode").rglob("*.log"))
    assert len(train_logs) == 1, sorted(log_dir.rglob("*.log"))
    env_json = json.loads((run / "env.json").read_text())
    jid = env_json["slurm_job_id"]
    assert train_logs[0].stem == jid
    job = _jobs([jid])[0]
    assert (job["NumNodes"], job["NumTasks"], job["NodeList"]) == ("2", "2", "dsnode[1-2]"), job
    assert job.get("TresPerNode") == "gres:gpu:1" and job.get("TresPerJob") == "gres:gpu:2", job
    assert not (log_dir / "rule_train").exists()  # the single-node rule got no job
    # The job's srun step (step 0, started by `detscale launch --nodes 2` in the batch script)
    # ran a task on each node, and each task's torchrun agent saw that node's GPU and threads.
    for node in ("dsnode1", "dsnode2"):
        assert f"StepId={jid}.0" in (STATE / f"slurmd-{node}.log").read_text(), f"no step {jid}.0 on {node}"
    train_log = (work / "results" / "logs" / "runs" / run.name / "train.log").read_text()
    for rank, node in enumerate(("dsnode1", "dsnode2")):
        line = (f"agent on node {node} (node rank {rank} of 2): CUDA_VISIBLE_DEVICES=0 SLURM_GPUS_ON_NODE=1 "
                "OMP_NUM_THREADS=1")
        assert line in train_log, train_log[-3000:]
    # Two agents of one rank each (--nproc-per-node=1) made one world of 2 ranks.
    assert "--nnodes=2" in train_log and "--nproc-per-node=1" in train_log, train_log[-3000:]
    timing = json.loads((run / "timing.json").read_text())
    assert timing["world_size"] == 2 and env_json["world_size"] == 2
    assert env_json["threads_per_rank"] == 1 and env_json["cuda_visible_devices"] == "0"
    report = work / "results" / "report"
    assert (report / "index.html").is_file() and (report / "scaling.csv").is_file()


# ---------------------------------------------------------------------------------------------
# Does a job fit its partition (unit: sinfo / scontrol / squeue answers given as text)
# ---------------------------------------------------------------------------------------------


def _fake_slurm(partitions: dict[str, tuple[str, str]], default: str = "debug",
                queue: str = "", calls: list[list[str]] | None = None):
    """A runner answering sinfo/scontrol/squeue/scancel as a cluster of ``partitions`` (name -> scontrol, sinfo -N)."""
    def run(cmd):
        if calls is not None:
            calls.append(list(cmd))
        if cmd[:3] == ["sinfo", "-h", "-o"]:
            return " ".join(p + ("*" if p == default else "") for p in partitions) + "\n"
        if cmd[:3] == ["scontrol", "show", "partition"]:
            if cmd[3] not in partitions:
                raise slurmfit.SlurmFitError(f"Partition {cmd[3]} not found")
            return partitions[cmd[3]][0]
        if cmd[:3] == ["sinfo", "-h", "-N"]:
            return partitions[cmd[4]][1]
        if cmd[0] == "squeue":
            return queue
        if cmd[0] == "scancel":
            return ""
        raise AssertionError(cmd)
    return run


SMALL = ("PartitionName=debug AllowGroups=ALL MaxNodes=UNLIMITED MaxTime=01:00:00 State=UP TotalNodes=2\n",
         "dsnode1|2|3900|gpu:4\ndsnode2|2|3900|gpu:4\n")


def test_ask_from_resources_as_the_plugin_submits() -> None:
    data = slurmfit.ask_from_resources("group data", ["validate_dataset"], 8, {"mem_mb": 8000, "runtime": 60})
    assert (data.cpus_per_node, data.cpu_source, data.mem_mb_per_node, data.gpus_per_node) == (8, "threads", 8000, 0)
    train = slurmfit.ask_from_resources("rule train", ["train"], 2, {"gpu": 2, "cpus_per_gpu": 4, "mem_mb": 32000})
    assert (train.cpus_per_node, train.cpu_source, train.gpus_per_node) == (8, "cpus_per_gpu", 2)
    multi = slurmfit.ask_from_resources("rule train_multinode", ["train_multinode"], 1, {
        "gpu": 4, "nodes": 2, "tasks": 2, "cpus_per_gpu": 3, "slurm_extra": "--gpus-per-node=2 --signal=TERM@300"})
    assert (multi.nodes, multi.gpus_per_node, multi.cpus_per_node) == (2, 2, 6)
    per_cpu = slurmfit.ask_from_resources("rule evaluate", ["evaluate"], 2, {"mem_mb_per_cpu": 1000, "gpu": 0,
                                                                             "cpus_per_gpu": 4})
    assert (per_cpu.cpus_per_node, per_cpu.cpu_source, per_cpu.mem_mb_per_node) == (2, "threads", 2000)
    assert slurmfit.slurm_minutes("1-02:30:00") == 1590 and slurmfit.slurm_minutes("UNLIMITED") is None
    assert slurmfit.slurm_minutes("90") == 90 and slurmfit.slurm_minutes("01:00:00") == 60


def test_check_names_rule_ask_largest_node_and_key() -> None:
    run = _fake_slurm({"debug": SMALL})
    asks = [
        slurmfit.ask_from_resources("group data (synth_dataset, validate_dataset, cache_dataset)",
                                    ["synth_dataset", "validate_dataset", "cache_dataset"], 8,
                                    {"slurm_partition": "debug", "mem_mb": 1000, "runtime": 60}),
        slurmfit.ask_from_resources("rule train (run=x)", ["train"], 2,
                                    {"slurm_partition": "debug", "gpu": 2, "cpus_per_gpu": 1, "mem_mb": 2000,
                                     "runtime": 720}),
        slurmfit.ask_from_resources("rule evaluate (run=x)", ["evaluate"], 1, {"mem_mb": 16000}),
    ]
    verdict = slurmfit.check(asks, run)
    text = "\n".join(verdict.problems)
    assert len(verdict.problems) == 3, text
    assert ("group data (synth_dataset, validate_dataset, cache_dataset) asks 8 CPUs per node (threads), but the "
            "largest node of partition 'debug' has 2 (dsnode1); lower placement.data_threads") in text
    assert "rule train (run=x) asks 720 min, but partition 'debug' allows at most 60 min (MaxTime)" in text
    assert "set-resources: train: runtime" in text
    # No partition given: the cluster's default one.
    assert "rule evaluate (run=x) asks 16000 MB of memory per node, but the largest node of partition 'debug' " \
           "has 3900 MB" in text and "set-resources: evaluate: mem_mb" in text
    assert "nothing was submitted" in verdict.text()

    fits = slurmfit.ask_from_resources("rule train", ["train"], 2, {"gpu": 2, "cpus_per_gpu": 1, "mem_mb": 2000})
    assert slurmfit.check([fits], run).problems == []
    too_many_gpus = slurmfit.ask_from_resources("rule train", ["train"], 8, {"gpu": 8, "cpus_per_gpu": 0})
    assert "asks 8 GPUs per node, but the largest node of partition 'debug' has 4" in \
        slurmfit.check([too_many_gpus], run).problems[0]
    nodes = slurmfit.ask_from_resources("rule train_multinode", ["train_multinode"], 1,
                                        {"gpu": 6, "nodes": 3, "tasks": 3, "cpus_per_gpu": 1})
    assert "asks 3 nodes" in slurmfit.check([nodes], run).problems[0]


def test_check_unknown_and_down_partition() -> None:
    down = (SMALL[0].replace("State=UP", "State=DOWN"), SMALL[1])
    run = _fake_slurm({"debug": SMALL, "maint": down})
    ask = slurmfit.ask_from_resources("rule evaluate", ["evaluate"], 1, {"slurm_partition": "gpu-big"})
    with pytest.raises(slurmfit.SlurmFitError, match="partition 'gpu-big' does not exist .*partitions: debug maint"):
        slurmfit.check([ask], run)
    verdict = slurmfit.check([slurmfit.ask_from_resources("rule evaluate", ["evaluate"], 1,
                                                          {"slurm_partition": "maint"})], run)
    assert verdict.problems == [] and "partition 'maint' is DOWN" in verdict.warnings[0]


def test_pending_watch_cancels_jobs_that_can_never_start(tmp_path: Path) -> None:
    queue = (f"11|PartitionConfig|rule_validate_dataset|{tmp_path}\n"
             f"12|Resources|rule_train_wildcards_run=a|{tmp_path}\n"
             f"13|PartitionConfig|rule_train|/elsewhere\n"
             f"14|ReqNodeNotAvail, UnavailableNodes:n[1-2]|rule_train_wildcards_run=b|{tmp_path}\n")
    calls: list[list[str]] = []
    messages: list[str] = []
    watch = slurmfit.PendingWatch(str(tmp_path), run=_fake_slurm({}, queue=queue, calls=calls),
                                  emit=messages.append)
    assert watch.poll() == []  # seen once: may be passing
    assert watch.poll() == ["11", "14"]
    assert ["scancel", "11"] in calls and ["scancel", "14"] in calls and ["scancel", "12"] not in calls
    assert "Slurm job 11 (validate_dataset) can never start: pending with Reason=PartitionConfig" in messages[0]
    assert "Slurm job 14 (train (run=b)) can never start" in messages[1]
    assert "nodes it needs are down" in messages[1]
    assert watch.poll() == []  # cancelled once only


def _check(profile: Path, config_file: Path, work: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "detscale", "slurm", "check", "--profile", str(profile), "--configfile",
                 str(config_file), "--snakefile", str(ROOT / "Snakefile"), "--directory", str(work)], 300, env=env)


def _squeue_ids() -> set[str]:
    return set(_run(["squeue", "-h", "-o", "%i"], 30).stdout.split())


@pytest.mark.slurm
def test_over_ask_is_refused_before_any_sbatch(cluster: None, tmp_path: Path) -> None:
    """A data job asking more CPUs than the nodes have: refused at start, nothing submitted, the fix named."""
    import yaml

    greedy = {**TINY, "placement": {"data_threads": 64}}
    cmd, env, work = _snakemake_command(tmp_path, greedy)
    before = _squeue_ids()
    started = time.monotonic()
    proc = _run(cmd, 300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert time.monotonic() - started < 120
    assert "group data (synth_dataset, validate_dataset, cache_dataset) asks 64 CPUs per node (threads), but the " \
           "largest node of partition 'debug' has" in out, out[-4000:]
    assert "lower placement.data_threads in the config, or cap it in the profile: set-threads: {synth_dataset: N, " \
           "validate_dataset: N, cache_dataset: N}" in out
    assert "Traceback" not in out, out[-4000:]
    assert not (work / ".snakemake" / "slurm_logs").exists() and _squeue_ids() <= before

    # The same by hand, and the profile's way out: set-threads caps the three data rules.
    profile = tmp_path / "profile"
    check = _check(profile, tmp_path / "tiny.yaml", work, env)
    assert check.returncode == 2 and "asks 64 CPUs per node" in check.stdout, check.stdout + check.stderr
    capped = yaml.safe_load((profile / "config.yaml").read_text())
    capped["set-threads"] = {"synth_dataset": 1, "validate_dataset": 1, "cache_dataset": 1}
    (tmp_path / "capped").mkdir()
    (tmp_path / "capped" / "config.yaml").write_text(yaml.safe_dump(capped))
    check = _check(tmp_path / "capped", tmp_path / "tiny.yaml", work, env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "every job fits its partition" in check.stdout
    assert _squeue_ids() <= before and not (work / "results" / "data").exists()


@pytest.mark.slurm
@pytest.mark.slow
def test_job_that_can_never_start_fails_within_a_minute(cluster: None, tmp_path: Path) -> None:
    """A partition set DOWN: its jobs pend forever (Reason=PartitionDown); the workflow fails within a minute."""
    import yaml

    cmd, env, work = _snakemake_command(tmp_path, TINY)
    profile = tmp_path / "profile" / "config.yaml"
    data = yaml.safe_load(profile.read_text())
    data["default-resources"]["slurm_partition"] = "maint"  # State=DOWN in tests/slurm/cluster.sh
    profile.write_text(yaml.safe_dump(data, sort_keys=False))
    env = {**env, "DETSCALE_SLURM_WATCH_S": "5"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines, cancelled_at, failed_at = [], None, None
    try:
        for line in proc.stdout:
            lines.append(line)
            if cancelled_at is None and "can never start" in line:
                cancelled_at = time.monotonic() - started
            if "Error in group data" in line:
                # Snakemake has failed the job (nothing else can run: the rest depends on it). It exits after
                # joining its status thread, which sleeps until the next poll (about 30 s more here): only
                # the suite's time, so the test stops it (the Slurm job is already cancelled).
                failed_at = time.monotonic() - started
                proc.kill()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert "partition 'maint' is DOWN" in out, out[-4000:]
    assert "can never start: pending with Reason=PartitionDown: the partition is DOWN" in out, out[-4000:]
    # cancelled within a minute of the start (two polls 5 s apart), and Snakemake fails the job at its next poll
    assert cancelled_at is not None and cancelled_at < 60, f"{cancelled_at} s:\n{out[-4000:]}"
    assert failed_at is not None and failed_at < 90, f"{failed_at} s:\n{out[-4000:]}"
    pending = [j for j in _run(["squeue", "-h", "-p", "maint", "-o", "%i"], 30).stdout.split()]
    assert pending == [], pending
