"""The optimiser (SGD or AdamW) with YOLO parameter groups, the warm-up, and the per-epoch schedule.

Three groups: convolution/linear weights (with weight decay), normalisation weights (no decay)
and biases (no decay; during warm-up their learning rate falls from ``warmup_bias_lr`` while the
others rise from 0). SGD is the YOLO reference; AdamW converges in far fewer optimiser steps and is
what short runs (the CPU default) use, as Ultralytics' ``optimizer=auto`` does for runs under
10,000 iterations. Its beta1 plays the role of SGD's momentum (without the warm-up, as there). The schedule
multiplies every group's ``initial_lr`` by ``lr_factor(epoch)`` and is stepped once per epoch;
warm-up overrides lr and momentum per iteration on top of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

GROUP_NAMES = ("weight", "norm_weight", "bias")
_NORM_TYPES = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)


def split_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Trainable parameters by group: ``weight`` (decayed), ``norm_weight`` and ``bias`` (not decayed)."""
    groups: dict[str, list[nn.Parameter]] = {name: [] for name in GROUP_NAMES}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            if name == "bias":
                groups["bias"].append(param)
            elif isinstance(module, _NORM_TYPES):
                groups["norm_weight"].append(param)
            else:
                groups["weight"].append(param)
    return groups


OPTIMIZERS = ("sgd", "adamw")


def build_optimizer(model: nn.Module, name: str, lr: float, momentum: float, weight_decay: float
                    ) -> torch.optim.Optimizer:
    """Nesterov SGD or AdamW (beta1 = ``momentum``) over the three groups; each group carries its ``name``."""
    groups = split_parameters(model)
    param_groups = [
        {"params": groups["weight"], "weight_decay": weight_decay, "name": "weight"},
        {"params": groups["norm_weight"], "weight_decay": 0.0, "name": "norm_weight"},
        {"params": groups["bias"], "weight_decay": 0.0, "name": "bias"},
    ]
    if name == "sgd":
        return _fused_if_supported(torch.optim.SGD, param_groups, lr=lr, momentum=momentum, nesterov=True)
    if name == "adamw":
        return _fused_if_supported(torch.optim.AdamW, param_groups, lr=lr, betas=(momentum, 0.999))
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")


def _fused_if_supported(cls: type[torch.optim.Optimizer], param_groups: list[dict[str, Any]], **kwargs: Any
                        ) -> torch.optim.Optimizer:
    """``cls`` with ``fused=True`` where this torch has fused kernels for the parameters' device.

    A step of these models updates ~700 small tensors. The fused kernels do it in a few launches on
    CUDA, where the default (foreach) needs several per op, and on the CPU, where the default is a
    Python loop over the tensors: AdamW on gelan-t's 675 tensors, one thread, 18 ms per step
    unfused, 3.5 ms fused (benchmarks/bench_step.py). Results agree to rounding (tested). A torch
    without CPU kernels (before 2.4) refuses ``fused`` at construction: then the default.
    """
    try:
        return cls(param_groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return cls(param_groups, **kwargs)


def lr_factor(schedule: str, epochs: int, lrf: float) -> Callable[[int], float]:
    """Multiplier of lr0 at an epoch: ``linear`` or ``cosine`` from 1 down to ``lrf`` at the last epoch."""
    if schedule == "linear":
        return lambda e: (1 - e / epochs) * (1.0 - lrf) + lrf
    if schedule == "cosine":
        return lambda e: ((1 - math.cos(e * math.pi / epochs)) / 2) * (lrf - 1) + 1
    raise ValueError(f"unknown lr schedule {schedule!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: str, epochs: int, lrf: float
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_factor(schedule, epochs, lrf))


def warmup_iterations(warmup_epochs: float, batches_per_epoch: int, epochs: int) -> int:
    """Warm-up length in iterations: ``warmup_epochs x nb``, leaving at least the last epoch out of it.

    The reference trainer's rule (Ultralytics 8.4). Counted in epochs, the warm-up covers the same
    share of a run whatever the number of ranks (an older floor of 100 iterations did not).
    """
    warmup_epochs = min(warmup_epochs, max(epochs - 1, 0))
    return round(warmup_epochs * batches_per_epoch) if warmup_epochs > 0 else 0


def warmup_accumulate(iteration: int, warmup_iters: int, accumulate: int) -> int:
    """Batches per optimiser step at ``iteration`` under ``warmup_accumulate: ramp``: 1 rising to ``accumulate``."""
    if iteration >= warmup_iters:
        return accumulate
    return max(1, int(np.interp(iteration, [0, warmup_iters], [1, accumulate]).round()))


def apply_warmup(
    optimizer: torch.optim.Optimizer,
    iteration: int,
    warmup_iters: int,
    epoch_factor: float,
    warmup_bias_lr: float,
    warmup_momentum: float,
    momentum: float,
) -> None:
    """Set lr (and SGD momentum) for ``iteration`` < ``warmup_iters``: linear ramps to the schedule.

    The biases' lr falls from ``warmup_bias_lr``, the others rise from 0. SGD's momentum rises from
    ``warmup_momentum``; AdamW's beta1 stays at its value, as in the reference trainer.
    """
    xp = [0, warmup_iters]
    for group in optimizer.param_groups:
        start = warmup_bias_lr if group["name"] == "bias" else 0.0
        group["lr"] = float(np.interp(iteration, xp, [start, group["initial_lr"] * epoch_factor]))
        if "momentum" in group and "betas" not in group:
            group["momentum"] = float(np.interp(iteration, xp, [warmup_momentum, momentum]))
