"""Size and compute of a model: parameters and GFLOPs, for the training and the fused form.

FLOPs are counted with :class:`torch.utils.flop_counter.FlopCounterMode`, which reports
2 x multiply-accumulates for convolutions and matrix products (the convention of the published
GFLOPs). BatchNorm, activations, pooling, upsampling and concatenation are not counted, nor are
conv biases. The count runs on the ``meta`` device: shapes only, no arithmetic, so it is instant
even for the large models at 640 px.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from detscale.model.yolo import build_model, fuse_for_inference


def count_params(model: nn.Module) -> int:
    """Number of parameters (trainable or not; buffers such as BN statistics excluded)."""
    return sum(p.numel() for p in model.parameters())


def count_gflops(model: nn.Module, imgsz: int, train: bool) -> float:
    """GFLOPs (2 x MACs) of one forward pass on one ``imgsz`` x ``imgsz`` image.

    ``train`` selects the training-mode forward (which includes the auxiliary branch, if any)
    or the eval-mode forward (main head, with box decoding).
    """
    meta = copy.deepcopy(model).to("meta").train(train)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        meta(torch.empty(1, 3, imgsz, imgsz, device="meta"))
    return counter.get_total_flops() / 1e9


def model_info(name: str, imgsz: int = 640, nc: int = 80) -> dict[str, dict[str, float | int]]:
    """``{"train": {"params", "gflops"}, "fused": {"params", "gflops"}}`` of the named model."""
    model = build_model(name, nc)
    fused = fuse_for_inference(model)
    return {
        "train": {"params": count_params(model), "gflops": count_gflops(model, imgsz, train=True)},
        "fused": {"params": count_params(fused), "gflops": count_gflops(fused, imgsz, train=False)},
    }
