"""Section ``env``: torch, CUDA, cuDNN, NCCL, the GPU, its driver, the CPU cores."""

from __future__ import annotations

from typing import Any

import torch

from detscale.engine.envinfo import environment
from gpukit.kit import device


def section_env() -> dict[str, Any]:
    env = environment("gpu-check", None)
    env["device"] = device().type
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["gpu_sm_count"] = props.multi_processor_count
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
    return env
