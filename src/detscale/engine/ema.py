"""Exponential moving average of a model's weights and buffers.

``decay(updates) = decay_max * (1 - exp(-updates / tau))`` ramps the average in, so early EMA
weights are not dominated by the random initialisation. Every rank holds an EMA and updates it
after every optimiser step from identical weights and buffers (the trainer keeps buffers in step
across ranks), so all ranks' EMAs are equal; rank 0 saves it.
"""

from __future__ import annotations

import copy
import itertools
import math
import weakref
from collections.abc import Callable
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
        self._averaged, self._counters = _split(self.module)
        self._source: Callable[[], nn.Module | None] = lambda: None  # the model the lists below are of
        self._values: list[torch.Tensor] = []
        self._counter_values: list[torch.Tensor] = []
        self._mixed_dtypes = False

    def decay(self, updates: int) -> float:
        return self.decay_max * (1 - math.exp(-updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step towards ``model`` (the unwrapped training model, of the EMA's structure).

        The floating-point tensors move in two multi-tensor (``_foreach``) kernels: a per-tensor
        loop would launch ~900 kernels a step on a GPU (57 ms of a 232 ms YOLOv9-S step on an
        H200, docs/gpu-results.md). Both models' tensor lists are built once, for the model last
        seen (its tensors are updated in place by the optimiser, DDP and ``load_state_dict``):
        walking ``parameters()`` and ``buffers()`` of two models costs more than the arithmetic,
        9-11 ms against 3.4 ms per update for gelan-t on one CPU thread (benchmarks/bench_step.py).
        Bit-identical to the per-tensor formula (tested).
        """
        if self._source() is not model:
            values, counters = _split(model)
            if len(values) != len(self._averaged) or len(counters) != len(self._counters):
                raise ValueError("the model does not have the EMA's structure")
            self._values, self._counter_values = values, counters
            self._mixed_dtypes = any(v.dtype != a.dtype for v, a in zip(values, self._averaged, strict=True))
            self._source = weakref.ref(model)
        self.updates += 1
        d = self.decay(self.updates)
        values = self._values
        if self._mixed_dtypes:
            values = [v if v.dtype == a.dtype else v.to(a.dtype) for v, a in zip(values, self._averaged, strict=True)]
        for avg, value in zip(self._counters, self._counter_values, strict=True):
            avg.copy_(value)  # counters such as BatchNorm's num_batches_tracked follow the model
        if self._averaged:
            torch._foreach_mul_(self._averaged, d)
            torch._foreach_add_(self._averaged, values, alpha=1 - d)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], updates: int) -> None:
        self.module.load_state_dict(state)
        self.updates = updates


def _split(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``model``'s parameters and buffers: (floating point, the others), in a fixed order."""
    floating, others = [], []
    for t in itertools.chain(model.parameters(), model.buffers()):
        (floating if t.dtype.is_floating_point else others).append(t)
    return floating, others
