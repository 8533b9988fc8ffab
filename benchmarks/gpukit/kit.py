"""What every section shares: the sizes of a run, the section runner, the device, the data paths,
the experiment configs the sections train with, and ``python -m detscale`` as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from detscale import config


@dataclass(frozen=True)
class Sizes:
    """What the kit runs: the real check (GPU) or the tiny CPU self-test."""

    imgsz: int
    model_batch: int
    models: tuple[str, ...]
    precisions: tuple[str, ...]
    train_images: int
    val_images: int
    launch_model: str
    launch_batch: int
    ddp_images: int
    ddp_batch: int
    loader_workers: tuple[int, ...]
    loader_batch: int
    loader_seconds: float
    tp_models: tuple[str, ...]
    tp_batches: tuple[int, ...]
    tp_rounds: int  # instrumented/bare pairs per (model, batch), order alternating
    tp_warmup_steps: int
    workers: int  # loader workers of the training runs
    tp_points: tuple[tuple[str, int], ...] = ()  # overrides tp_models x tp_batches when given
    # torch.compile's backend in the compile section: inductor on the card; the tiny self-test runs
    # eager (dynamo's graphs run by eager kernels: the capture, its breaks and guards are checked; inductor
    # takes minutes per model on a small CPU, and AOTAutograd's graphs are checked by tests/test_compile.py)
    compile_backend: str = "inductor"
    compile_modes: tuple[str, ...] = ("off", "model", "step")

    def throughput_points(self) -> list[tuple[str, int]]:
        return list(self.tp_points) or [(m, b) for m in self.tp_models for b in self.tp_batches]


def sizes_for(tiny: bool, cpus: int) -> Sizes:
    models = ("gelan-t", "gelan-s", "gelan-m", "gelan-c", "yolov9-t", "yolov9-s")
    if tiny:
        # one single-head and one dual-head model: the paths of all six, at a fraction of the time
        return Sizes(imgsz=64, model_batch=2, models=("gelan-t", "yolov9-t"), precisions=("fp32", "bf16", "fp16"),
                     train_images=48, val_images=8, launch_model="gelan-t", launch_batch=8, ddp_images=16, ddp_batch=4,
                     loader_workers=(0, 1), loader_batch=8, loader_seconds=0.5, tp_models=("gelan-t",),
                     tp_batches=(8, 16), tp_rounds=1, tp_warmup_steps=1, workers=0, compile_backend="eager",
                     compile_modes=("off", "step"))
    workers = max(1, min(12, cpus - 2))
    return Sizes(imgsz=640, model_batch=2, models=models, precisions=("fp32", "bf16", "fp16"), train_images=1024,
                 val_images=64, launch_model="gelan-s", launch_batch=32, ddp_images=64, ddp_batch=8,
                 loader_workers=(1, 4, 8, 16), loader_batch=16, loader_seconds=2.0,
                 tp_models=("yolov9-s", "gelan-s"), tp_batches=(16, 32, 64), tp_rounds=1, tp_warmup_steps=3,
                 workers=workers)


class Kit:
    """Runs sections under a deadline, records each one's status and figures, writes JSON + Markdown."""

    def __init__(self, out: Path, work: Path, budget_s: float, tiny: bool,
                 render: Callable[[dict[str, Any]], str]) -> None:
        self.out = out
        self.work = work
        self.render = render  # results -> the Markdown summary
        self.deadline = time.monotonic() + budget_s
        self.tiny = tiny
        self.results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tiny": tiny,
                                        "budget_s": budget_s, "sections": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def section(self, name: str, need_s: float, fn: Callable[[], dict[str, Any]]) -> None:
        record: dict[str, Any]
        if self.left() < need_s:
            record = {"status": "skipped", "reason": f"{self.left():.0f} s left of the budget, needs ~{need_s:.0f} s"}
        else:
            print(f"[gpu_check] {name} ...", flush=True)
            t0 = time.perf_counter()
            try:
                record = {"status": "ok", **fn()}
            except Exception as exc:  # guarded: one failure must not hide the other sections
                record = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-4000:]}
            record["seconds"] = round(time.perf_counter() - t0, 2)
            if record["status"] == "ok" and record.pop("failed", False):
                record["status"] = "failed"
        self.results["sections"][name] = record
        print(f"[gpu_check] {name}: {record['status']} ({record.get('seconds', 0):.1f} s)"
              + (f" {record.get('error', '')}" if record["status"] != "ok" else ""), flush=True)
        self.write()

    def write(self) -> None:
        self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(self.render(self.results))


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# Data paths, experiment configs and detscale commands
# ---------------------------------------------------------------------------------------------


def detscale_cmd(*args: str, cwd: Path, log: Path, timeout: float) -> float:
    """Run ``python -m detscale ARGS``; raise with the log's tail when it fails. Returns seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "detscale", *args], cwd=cwd, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"detscale {args[0]} exited {proc.returncode}: {log.read_text()[-3000:]}")
    return time.perf_counter() - t0


@dataclass(frozen=True)
class DataPaths:
    data_yaml: Path
    cache_dir: Path
    ddp_yaml: Path


def data_paths(work: Path) -> DataPaths:
    return DataPaths(work / "data" / "data.yaml", work / "cache", work / "ddp-data" / "data.yaml")


@dataclass(frozen=True)
class OneCard:
    """What a section training on this process's one device needs: the device, the precision the
    kit trains it in (bf16 on CUDA, fp32 on the CPU), the dataset paths, the (single-rank) group, nc."""

    dev: torch.device
    precision: str
    paths: DataPaths
    info: Any
    nc: int


def one_card(work: Path) -> OneCard:
    """Set up a section that trains on one device: cuDNN autotuning on CUDA, a one-rank group."""
    from detscale import dist
    from detscale.data.formats import load_spec

    dev = device()
    paths = data_paths(work)
    torch.backends.cudnn.benchmark = dev.type == "cuda"
    info = dist.init_from_env(600, cpu_threads=None)
    return OneCard(dev, "bf16" if dev.type == "cuda" else "fp32", paths, info,
                   load_spec(paths.data_yaml, splits=()).nc)


def experiment(data_yaml: Path, model: str, imgsz: int, batch: int, *, gpus: int = 1, cache: str = "disk",
               precision: str = "bf16", epochs: int = 2, warmup_epochs: int = 1, nominal: int = 64,
               warmup_steps: int = 3, workers: int = 0) -> config.ExperimentConfig:
    """The one-point experiment a section trains: AdamW, channels_last, mosaic closed for the last epoch."""
    return config.from_dict({
        "dataset": {"name": "gpucheck", "data_yaml": str(data_yaml)},
        "grid": {"model": [model], "imgsz": [imgsz], "gpus": [gpus], "batch": [batch], "cache": [cache],
                 "precision": [precision], "epochs": epochs},
        "train": {"optimizer": "adamw", "lr0": 0.002, "warmup_epochs": warmup_epochs, "nominal_batch": nominal,
                  "close_mosaic": 1, "channels_last": True, "workers": workers,
                  "timing_warmup_steps": warmup_steps},
        "eval": {"batch": 32},
    }, source="gpu_check")


def write_config(cfg: config.ExperimentConfig, path: Path) -> Path:
    """``cfg`` as a file, for the sections that run ``detscale`` commands."""
    path.parent.mkdir(parents=True, exist_ok=True)
    config.save(cfg, path)
    return path
