"""``env.json``: the hardware and software a run measured on (design: measurement rules)."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch

import detscale


def _cpuinfo(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line whose key is one of ``keys`` (lower case)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip().lower() in keys:
                return value.strip()
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


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


# CPU features that change which kernels torch, oneDNN and MKL pick, and so the rounding of a run's
# float sums: two CPUs that differ in one of these train the same seed along different paths.
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2")
# Environment variables that override those choices. Not the thread-count variables: Snakemake
# exports OMP/MKL_NUM_THREADS as a job's `threads` (1 for a 1-rank job, 2 for a 2-rank one), and the
# trainer sets torch's threads itself, which env.json records as ``torch_threads``.
NUMERIC_ENV_VARS = ("ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR",
                    "MKL_ENABLE_INSTRUCTIONS", "CUBLAS_WORKSPACE_CONFIG")


def _cpu_isa() -> str | None:
    """The :data:`ISA_FLAGS` the CPU has (``flags`` on x86, ``Features`` on Arm in /proc/cpuinfo)."""
    flags = _cpuinfo("flags", "features")
    if flags is None:
        return None
    have = set(flags.split())
    return " ".join(f for f in ISA_FLAGS if f in have)


def _torch_build() -> dict[str, str | None]:
    """BLAS, MKL and oneDNN builds of this torch, from ``torch.__config__.show()``."""
    try:
        text = torch.__config__.show()
    except Exception:  # a torch built without the config report
        return {"blas": None, "mkl": None, "onednn": None}
    mkl = re.search(r"Math Kernel Library Version (\S+)", text)
    onednn = re.search(r"MKL-DNN (v[\d.]+)", text)
    blas = re.search(r"BLAS_INFO=([^,\s]+)", text)
    return {"blas": blas.group(1) if blas else None, "mkl": mkl.group(1) if mkl else None,
            "onednn": onednn.group(1) if onednn else None}


def numerics() -> dict[str, Any]:
    """What makes two machines compute the same run differently: the SIMD level torch dispatches to,
    the CPU's instruction-set flags, the BLAS/oneDNN builds, thread counts, precision switches and the
    environment variables that override them. Same seed and same torch still give different float
    sums when one of these differs; the report names the ones that do."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # torch < 2.1 has no dispatch report
        capability = None
    return {
        "cpu_capability": capability,
        "cpu_isa": _cpu_isa(),
        **_torch_build(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "numeric_env": {k: os.environ[k] for k in NUMERIC_ENV_VARS if k in os.environ},
    }


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
        **numerics(),
        "detscale": detscale.__version__,
        **_git_commit(),
        "config_hash": config_hash,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
