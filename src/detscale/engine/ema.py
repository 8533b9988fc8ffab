"""Exponential moving average of a model's weights and buffers.

``decay(updates) = decay_max * (1 - exp(-updates / tau))`` ramps the average in, so early EMA
weights are not dominated by the random initialisation. Every rank holds an EMA and updates it
after every optimiser step from identical weights and buffers (the trainer keeps buffers in step
across ranks), so all ranks' EMAs are equal; rank 0 saves it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn


class ModelEMA:
    """EMA copy of an (unwrapped) model; ``module`` is the averaged model, always in eval mode."""

    def __init__(self, model: nn.Module, decay: float, tau: float, updates: int = 0) -> None:
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self.decay_max = decay
        self.tau = tau
        self.updates = updates

    def decay(self, updates: int) -> float:
        return self.decay_max * (1 - math.exp(-updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step towards ``model`` (the unwrapped training model)."""
        self.updates += 1
        d = self.decay(self.updates)
        current = model.state_dict()
        for name, averaged in self.module.state_dict().items():
            value = current[name].detach()
            if averaged.dtype.is_floating_point:
                averaged.mul_(d).add_(value.to(averaged.dtype), alpha=1 - d)
            else:  # counters such as BatchNorm's num_batches_tracked follow the model
                averaged.copy_(value)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], updates: int) -> None:
        self.module.load_state_dict(state)
        self.updates = updates
