"""``env.json``: the hardware and software a run measured on (design: measurement rules)."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch

import detscale


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _git_commit() -> dict[str, Any]:
    """Commit of the detscale source tree (and whether it had uncommitted changes)."""
    src = Path(detscale.__file__).resolve().parent
    commit = _run(["git", "rev-parse", "HEAD"], cwd=src)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src) if commit else None
    return {"git_commit": commit, "git_dirty": bool(dirty) if commit else None}


def _physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except Exception:  # psutil missing or unsupported platform
        return None


def _library_versions() -> dict[str, str | None]:
    """Versions of the libraries whose numerics a run depends on besides torch: training is
    deterministic on one machine, and these tell a reader why two machines still differ."""
    versions: dict[str, str | None] = {"numpy": np.__version__}
    for key, module in (("torchvision", "torchvision"), ("opencv", "cv2")):
        try:
            versions[key] = __import__(module).__version__
        except ImportError:
            versions[key] = None
    return versions


def environment(config_hash: str, threads_per_rank: int | None) -> dict[str, Any]:
    """Host, CPU, GPU, driver and library versions, detscale version and commit, config hash."""
    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # NCCL not built in
            nccl = None
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if cuda else None
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_physical": _physical_cores(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads_per_rank": threads_per_rank,
        "gpu_model": gpus[0] if gpus else None,
        "gpu_models": gpus,
        "gpu_count": len(gpus),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "driver": driver.splitlines()[0] if driver else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": nccl,
        "python": platform.python_version(),
        **_library_versions(),
        "detscale": detscale.__version__,
        **_git_commit(),
        "config_hash": config_hash,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
