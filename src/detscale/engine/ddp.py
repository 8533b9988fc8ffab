"""The model in DDP as the trainer runs it, and the communication hook that tells the step timer when
gradient buckets go to the all-reduce."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """The model in DDP as the trainer runs it (the all-reduce benchmark wraps it the same way).

    Buffers are merged after every batch (SequentialBufferMerge), not broadcast per forward
    (torch >= 2.12 renames ``broadcast_buffers`` to ``forward_sync_buffers``).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    params = inspect.signature(DDP.__init__).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
               **no_sync)


class CommProbe:
    """DDP communication hook state: the default all-reduce, and a call to ``on_ready`` per bucket.

    The hook runs when a gradient bucket is complete and handed to the all-reduce; the last call
    of a backward marks the end of its gradient computation (:class:`~detscale.engine.timing.StepTimer`).
    """

    def __init__(self) -> None:
        self.on_ready: Any = None

    @staticmethod
    def hook(probe, bucket):  # no annotations: DDP checks them, and this module's are strings
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if probe.on_ready is not None:
            probe.on_ready()
        return allreduce_hook(None, bucket)  # what DDP does without a hook: divide by the ranks, all-reduce
