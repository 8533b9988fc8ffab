"""Synchronised BatchNorm that also works on the CPU with gloo.

``torch.nn.SyncBatchNorm`` accepts only GPU tensors, yet the CPU analogue of a multi-GPU run
must be able to check that 2 ranks x batch b equal 1 rank x batch 2b. :class:`CpuSyncBatchNorm2d`
computes the batch mean and variance over every rank's images with autograd-aware all-reduces
(two passes, as numerically stable as the local kernel), so forward, backward and running
statistics equal those of one process holding the whole global batch. On CUDA the trainer uses
``torch.nn.SyncBatchNorm`` instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose gradient is again the sum over ranks (every rank's loss depends on it)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        tdist.all_reduce(out, op=tdist.ReduceOp.SUM)
        return out


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    return _AllReduceSum.apply(t)


class CpuSyncBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics cover the images of all ranks (state-dict compatible)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
        if not self.training or world == 1:
            return super().forward(x)
        # Statistics and normalisation in float64, as the CPU BatchNorm kernel accumulates them:
        # float32 sums would make 2 ranks differ from 1 rank by far more than reordering noise.
        dtype, x = x.dtype, x.double()
        dims = (0, 2, 3)
        count = torch.full((1,), float(x.numel() // x.shape[1]), dtype=x.dtype, device=x.device)
        # one all-reduce for the sums and the element count (ranks may hold different batch sizes)
        summed = _all_reduce_sum(torch.cat([x.sum(dims), count]))
        total = summed[-1].detach()
        mean = summed[:-1] / total
        centred = x - mean[None, :, None, None]
        var = _all_reduce_sum((centred * centred).sum(dims)) / total
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (total / (total - 1).clamp(min=1))
                self.running_mean.mul_(1 - m).add_(mean.detach().to(dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach().to(dtype), alpha=m)
        y = centred * torch.rsqrt(var + self.eps)[None, :, None, None]
        if self.affine:
            y = y * self.weight.double()[None, :, None, None] + self.bias.double()[None, :, None, None]
        return y.to(dtype)


def convert_sync_batchnorm(model: nn.Module, device_type: str) -> nn.Module:
    """Every BatchNorm2d of ``model`` made synchronised: torch's on CUDA, :class:`CpuSyncBatchNorm2d` on the CPU."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert_cpu(model)


def _convert_cpu(module: nn.Module) -> nn.Module:
    if type(module) is nn.BatchNorm2d:
        new = CpuSyncBatchNorm2d(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        converted = _convert_cpu(child)
        if converted is not child:
            setattr(module, name, converted)
    return module


__all__ = ["CpuSyncBatchNorm2d", "convert_sync_batchnorm"]
