"""Model FLOPs utilisation: the training FLOPs a run does per second against what its device can do.

``MFU = training FLOPs per image x images per second / (sum over ranks of each rank's peak)``.

* Training FLOPs per image: 3 x the FLOPs of one training-mode forward pass (the backward costs
  about twice the forward: one product for the input gradient, one for the weight gradient), as
  :func:`detscale.model.info.count_gflops` counts them (convolutions and matrix products, 2 x
  MACs; normalisation, activations and the loss are not counted). The forward runs on the meta
  device: nothing is computed, no random number is drawn, the run is not disturbed.
* The peak: measured on every rank at the start of the run, at the same time (so ranks that share
  cores or a memory bus measure what they share), by a short square matrix multiply in the run's
  precision: the best a dense kernel of this device, library and thread count reaches. On CUDA the
  datasheet's dense figure for known cards is recorded beside it, with its source; MFU against the
  datasheet is the figure comparable with published ones.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

#: Dense (no sparsity) tensor-core peaks in TFLOPS, by a substring of the device name and precision,
#: with the datasheet they come from. fp32 training on these cards uses TF32 only when enabled.
DATASHEET_TFLOPS: tuple[tuple[str, str, float, str], ...] = (
    ("H200", "bf16", 989.0, "NVIDIA H200 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, half dense"),
    ("H200", "fp16", 989.0, "NVIDIA H200 datasheet: FP16 Tensor Core 1,979 TFLOPS with sparsity, half dense"),
    ("H100 PCIe", "bf16", 756.0, "NVIDIA H100 datasheet (PCIe): BF16 Tensor Core 1,513 TFLOPS sparse, half dense"),
    ("H100 PCIe", "fp16", 756.0, "NVIDIA H100 datasheet (PCIe): FP16 Tensor Core 1,513 TFLOPS sparse, half dense"),
    ("H100 NVL", "bf16", 835.0, "NVIDIA H100 datasheet (NVL): BF16 Tensor Core 1,671 TFLOPS with sparsity, half dense"),
    ("H100 NVL", "fp16", 835.0, "NVIDIA H100 datasheet (NVL): FP16 Tensor Core 1,671 TFLOPS with sparsity, half dense"),
    ("H100", "bf16", 989.0, "NVIDIA H100 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity, half dense"),
    ("H100", "fp16", 989.0, "NVIDIA H100 datasheet (SXM): FP16 Tensor Core 1,979 TFLOPS with sparsity, half dense"),
    ("A100", "bf16", 312.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS dense"),
    ("A100", "fp16", 312.0, "NVIDIA A100 datasheet: FP16 Tensor Core 312 TFLOPS dense"),
    ("A100", "fp32", 19.5, "NVIDIA A100 datasheet: FP32 19.5 TFLOPS (TF32 off)"),
)

FLOPS_METHOD = ("3 x one training-mode forward pass (detscale.model.info.count_gflops: convolutions and "
                "matrix products, 2 x MACs, on the meta device)")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def train_gflops_per_image(model: nn.Module, imgsz: int) -> float:
    """Training GFLOPs of one ``imgsz`` image: 3 x the training-mode forward (see the module docstring)."""
    from detscale.model.info import count_gflops

    return 3.0 * count_gflops(model, imgsz, train=True)


def measure_peak(device: torch.device, precision: str, min_seconds: float = 0.15) -> dict[str, Any]:
    """GFLOP/s of a square matrix multiply in ``precision`` on ``device``, the best of several timed rounds.

    The size is large enough to be compute-bound and small enough to take milliseconds: 512 on the
    CPU (one rank usually has one or a few threads), 4096 on CUDA. Inputs come from a generator of
    their own, so the run's random streams are untouched.
    """
    cuda = device.type == "cuda"
    n = 4096 if cuda else 512
    dtype = _DTYPES.get(precision, torch.float32) if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for _ in range(3):
        torch.mm(a, b)
    sync()
    best = 0.0
    start = time.perf_counter()
    rounds = 0
    while rounds < 3 or time.perf_counter() - start < min_seconds:
        reps = 10 if cuda else 2
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        sync()
        best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
        rounds += 1
        if rounds >= 50:
            break
    return {"gflops": best, "method": f"{str(dtype).replace('torch.', '')} {n}x{n} matmul, best of {rounds} rounds, "
                                      f"{torch.get_num_threads() if not cuda else 'device'} thread(s)"}


def datasheet_peak(device_name: str | None, precision: str) -> tuple[float, str] | None:
    """(GFLOP/s, source) of the datasheet's dense peak for a known card in ``precision``, else None."""
    if not device_name:
        return None
    for key, prec, tflops, source in DATASHEET_TFLOPS:
        if key in device_name and prec == precision:
            return tflops * 1000.0, source
    return None


def mfu_fields(gflops_per_image: float, images_per_s: float, peaks: list[dict[str, Any]], precision: str,
               device_name: str | None) -> dict[str, Any]:
    """The timing.json fields of MFU: FLOPs per image, each rank's measured peak, MFU against their
    sum and, for known cards, against the datasheet."""
    measured = [p["gflops"] for p in peaks]
    fields: dict[str, Any] = {
        "train_gflops_per_image": gflops_per_image,
        "train_gflops_method": FLOPS_METHOD,
        "peak_gflops_per_rank": measured,
        "peak_method": peaks[0]["method"],
        "mfu": gflops_per_image * images_per_s / sum(measured) if sum(measured) > 0 else None,
    }
    sheet = datasheet_peak(device_name, precision)
    if sheet is not None:
        fields.update(datasheet_peak_gflops=sheet[0], datasheet_source=sheet[1],
                      mfu_datasheet=gflops_per_image * images_per_s / (sheet[0] * len(peaks)))
    return fields
