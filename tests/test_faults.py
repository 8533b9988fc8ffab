"""The fault matrix: hostile or damaged input and failing resources lose nothing and say what to do.

Each test is one row of the README's "Reliability" table. Training runs in-process on one CPU
rank (the trainer's checkpoint path is the same for every rank count: rank 0 writes).
"""

from __future__ import annotations

import copy
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detscale import config as dsconfig
from detscale.engine import trainer
from detscale.errors import EXIT_PREEMPTED, UserError
from detscale.files import UnsafeFileError, WriteError, load_torch, save_torch, write_text
from helpers import tiny_dataset

CONFIG = """\
dataset:
  name: tiny
  data_yaml: {data_yaml}
grid:
  model: [gelan-t]
  imgsz: [64]
  gpus: [1]
  batch: [4]
  cache: [none]
  epochs: 2
train:
  nominal_batch: 8
  warmup_epochs: 1
  workers: 0
  close_mosaic: 0
"""
RUN = "gelan-t_64_g1_b4_none_fp32_s0_r0"


@pytest.fixture(scope="module")
def data_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dataset(tmp_path_factory.mktemp("fault_data"), train=8, val=2)


@pytest.fixture
def cfg(tmp_path: Path, data_yaml: Path) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(CONFIG.format(data_yaml=data_yaml))
    return path


def _train(cfg: Path, out: Path, data_yaml: Path, resume: bool = False) -> int:
    return trainer.train(trainer.TrainRequest(cfg, RUN, out, resume=resume, data_yaml=data_yaml))


def _stopped_run(cfg: Path, out: Path, data_yaml: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run stopped (as by SIGTERM) after its first epoch: ``last.pt`` of epoch 1 to resume from."""
    with monkeypatch.context() as m:
        m.setattr(trainer.StopFlag, "agreed", lambda self, device: True)  # stop at the first step boundary
        assert _train(cfg, out, data_yaml) == EXIT_PREEMPTED
    return out / "weights" / "last.pt"


class _Evil:
    """Unpickling this runs ``touch MARKER``: what a hostile checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_checkpoint(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": _Evil(marker), "ema": {}, "model_name": "gelan-t", "nc": 3, "epoch": 1}, path)
    return path


def test_a_checkpoint_that_carries_code_is_refused_by_evaluate_and_resume(tmp_path: Path, cfg: Path,
                                                                           data_yaml: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _evil_checkpoint(tmp_path / "run" / "weights" / "last.pt", marker)
    with pytest.raises(UnsafeFileError, match=r"was refused: loading it would run posix.system"):
        _train(cfg, tmp_path / "run", data_yaml, resume=True)
    out = subprocess.run([sys.executable, "-m", "detscale", "evaluate", "--weights", str(evil), "--config", str(cfg),
                          "--run", RUN, "--out", str(tmp_path / "eval"), "--data", str(data_yaml)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "was refused" in out.stderr and "Traceback" not in out.stderr
    assert not marker.exists()


def test_previous_checkpoint_format_still_loads(tmp_path: Path) -> None:
    """Checkpoints of the previous format held numpy RNG arrays: still readable with weights_only."""
    from detscale.engine.checkpoint import restore_rng

    old = {"model": {"w": torch.ones(2)}, "rng": [{"python": __import__("random").getstate(),
                                                   "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                                                   "cuda": None}]}
    path = tmp_path / "old.pt"
    torch.save(old, path)
    loaded = load_torch(path)
    expected = np.random.random()
    restore_rng(loaded["rng"][0])
    assert np.random.random() == expected


def test_disk_full_while_writing_last_pt_keeps_the_previous_one(tmp_path: Path, cfg: Path, data_yaml: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A file-size limit (as a full disk) stops the checkpoint write: the old last.pt stays, a rerun resumes."""
    last = _stopped_run(cfg, tmp_path / "run", data_yaml, monkeypatch)
    before = last.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # 1 MiB: a checkpoint is larger
    try:
        with pytest.raises(WriteError) as err:
            _train(cfg, tmp_path / "run", data_yaml, resume=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(err.value)
    assert str(last) in message and "MiB needed" in message and "previous file is intact" in message
    assert last.read_bytes() == before and load_torch(last)["epoch"] == 1
    assert os.listdir(last.parent) == ["last.pt"]  # no temporary file left behind
    assert _train(cfg, tmp_path / "run", data_yaml, resume=True) == 0
    assert load_torch(last)["epoch"] == 2


def test_every_writer_goes_through_one_function(tmp_path: Path) -> None:
    """JSON, text, checkpoints: a failed write names the file and leaves the old one."""
    target = tmp_path / "a.json"
    write_text("old", target)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
    try:
        with pytest.raises(WriteError, match="a.json"):
            write_text("x" * 4096, target)
        with pytest.raises(WriteError, match="b.pt"):
            save_torch({"w": torch.zeros(4096)}, tmp_path / "b.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert target.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["a.json"]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_last_pt_stops_resume_with_the_way_out(tmp_path: Path, cfg: Path, data_yaml: Path,
                                                       monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    last = _stopped_run(cfg, tmp_path / "run", data_yaml, monkeypatch)
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    files_before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(UserError) as err:
        _train(cfg, tmp_path / "run", data_yaml, resume=True)
    message = str(err.value)
    assert f"checkpoint {last} is damaged" in message and "delete" in message and "from the start" in message
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == files_before  # nothing deleted


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_damaged_cache_is_refused_not_trained_on(tmp_path: Path, data_yaml: Path, damage: str) -> None:
    from detscale.data.cache import CacheError, build_cache, open_cache
    from detscale.data.formats import load_spec

    index = build_cache(load_spec(data_yaml), "train", 64, tmp_path / "cache", workers=1, progress=False)
    npy = index.with_suffix(".npy")
    with open(npy, "r+b") as f:
        if damage == "truncated":
            f.truncate(npy.stat().st_size - 100)
        else:  # same size, other pixels in the last image
            f.seek(-1000, os.SEEK_END)
            f.write(os.urandom(1000))
    if damage == "truncated":  # seen when the cache is opened
        with pytest.raises(CacheError, match=r"cannot be trusted: it has \d+ bytes, its index says"):
            open_cache(index, "disk")
    else:  # seen when the image is read, before a batch holds it
        cache = open_cache(index, "disk")
        assert cache.image(0).shape == (64, 64, 3)  # untouched images read as usual
        with pytest.raises(CacheError, match=r"cannot be trusted: image 7 .* does not match the checksum"):
            cache.image(7)
        del cache
    build_cache(load_spec(data_yaml), "train", 64, tmp_path / "cache", workers=1, progress=False, force=True)
    cache = open_cache(index, "disk")
    assert all(cache.image(i).shape == (64, 64, 3) for i in range(len(cache)))


def test_damaged_cache_stops_training_with_the_message(tmp_path: Path, data_yaml: Path) -> None:
    """Through `detscale train` with a loader worker: the message, not the worker's traceback."""
    from detscale.data.cache import build_cache
    from detscale.data.formats import load_spec

    index = build_cache(load_spec(data_yaml), "train", 64, tmp_path / "cache", workers=1, progress=False)
    with open(index.with_suffix(".npy"), "r+b") as f:
        f.seek(-1000, os.SEEK_END)
        f.write(os.urandom(1000))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(data_yaml=data_yaml).replace("cache: [none]", "cache: [disk]")
                   .replace("workers: 0", "workers: 1"))
    out = subprocess.run([sys.executable, "-m", "detscale", "train", "--config", str(cfg), "--run",
                          RUN.replace("none", "disk"), "--out", str(tmp_path / "run"), "--data", str(data_yaml),
                          "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: cache " in out.stderr and "does not match the checksum" in out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------------
# Random configs: every mutation is accepted or refused with a message naming a key
# ---------------------------------------------------------------------------------------------

BASE = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))


PATHS = list(_paths(BASE))
VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10**12, max_value=10**12),
    # builds(list), not just([]): a fresh container per draw, so no draw mutates a later one's value
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.builds(list), st.builds(dict),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3), st.just("ünïcødé ✓"),
)


@st.composite
def mutated(draw):
    raw = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(PATHS + [("unknown_section",), ("train", "no_such_key")]))
        node = raw
        for key in path[:-1]:
            if not isinstance(node, dict):
                break
            node = node.setdefault(key, {})
        if isinstance(node, dict):
            if draw(st.booleans()) and path[-1] in node and len(path) > 1:
                del node[path[-1]]
            else:
                node[path[-1]] = draw(VALUES)
    return raw


# derandomize: the same 300 examples on every run (the suite is deterministic), none replayed from a database
@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_random_config_mutations_are_accepted_or_refused_by_key(raw):
    try:
        cfg = dsconfig.from_dict(raw, source="mutated.yaml")
    except dsconfig.ConfigError as exc:
        assert "'" in str(exc), str(exc)  # names the key ('section.key') or the value it refuses
    else:
        assert cfg.runs()  # a valid config has a grid


def test_mutated_configs_through_the_commands(tmp_path: Path) -> None:
    """A few refused configs through `detscale runs` and `snakemake -n`: exit non-zero, no traceback."""
    cases = {"negative": ("grid", "gpus", [-1]), "string": ("train", "lr0", "fast"), "unknown": ("train", "lr", 1),
             "unicode": ("dataset", "name", "dätä set/✓"), "empty": ("grid", "seeds", [])}
    snakefile = Path(__file__).resolve().parents[1] / "Snakefile"
    for name, (section, key, value) in cases.items():
        raw = copy.deepcopy(BASE)
        raw[section][key] = value
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, allow_unicode=True))
        out = subprocess.run([sys.executable, "-m", "detscale", "runs", "--config", str(path)], capture_output=True,
                             text=True, timeout=120)
        named = f"'{section}.{key}" in out.stderr or f"unknown key '{key}' in '{section}'" in out.stderr
        assert out.returncode == 2 and named and "Traceback" not in out.stderr, (name, out.stderr[-500:])
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    dry = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(snakefile), "--directory", str(tmp_path), "-n",
                          "--configfile", str(tmp_path / "string.yaml")], capture_output=True, text=True, timeout=300,
                         env=env)
    assert dry.returncode != 0 and "lr0" in dry.stderr + dry.stdout
    assert "Traceback" not in dry.stderr + dry.stdout


STOPPER = """\
import os, signal, sys
import detscale.engine.loop as loop

# Rank 1 of the first attempt stops (SIGSTOP: alive, silent) in its 6th batch, in epoch 2.
if os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    original, calls = loop.train_step, [0]

    def train_step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 6:
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    loop.train_step = train_step

from detscale.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_stopped_rank_fails_the_group_in_time_names_the_rank_and_the_rerun_resumes(tmp_path: Path,
                                                                                      data_yaml: Path) -> None:
    import time

    from detscale.cluster.torchrun import pick_port, torchrun_command

    cfg = tmp_path / "cfg.yaml"
    text = CONFIG.format(data_yaml=data_yaml).replace("gpus: [1]", "gpus: [2]").replace("batch: [4]", "batch: [2]")
    cfg.write_text(text.replace("epochs: 2", "epochs: 3") + "  timeout_s: 10\n")
    script = tmp_path / "stopper.py"
    script.write_text(STOPPER)
    out = tmp_path / "run"
    argv = ["train", "--config", str(cfg), "--run", "gelan-t_64_g2_b2_none_fp32_s0_r0", "--out", str(out),
            "--data", str(data_yaml)]
    cmd = torchrun_command(2, argv, port=pick_port(None), max_restarts=1, entry=("--", str(script)))
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=tmp_path)
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert "a collective did not finish within train.timeout_s = 10 s; stalled: rank 1 (silent for" in done.stderr
    assert "Traceback" not in done.stderr.split("stalled: rank 1")[0][-2000:]
    log = (out / "logs" / "rank0.log").read_text()
    assert "resuming from" in log and "torchrun restart" in log
    assert load_torch(out / "weights" / "last.pt")["epoch"] == 3
    assert took < 180, took  # timeout 10 s + torchrun's 30 s grace before SIGKILL + the rerun
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert left.stdout.strip() == "", "a rank process was left behind"
