"""BatchNorm running statistics of N ranks, merged as one process accumulating N batches would have them.

Without SyncBatchNorm each rank updates its running statistics from its own batch. One process
that accumulates the same N batches (the 1-GPU run of a scaling comparison) updates them N times
in a row, rank 0's batch first. For an exponential average with momentum ``a`` every rank starts
from the same ``m0`` and ends at ``m_r = (1 - a) m0 + a mu_r``, so the sequential result is

    m = (1 - a)^N m0 + sum_r (1 - a)^(N-1-r) (m_r - (1 - a) m0)

(the same for ``running_var``, whose update has the same form) and ``num_batches_tracked``
grows by N. :class:`SequentialBufferMerge` applies it after every batch with one all-gather, so
the buffers (and the EMA built from them) of N ranks equal those of 1 rank accumulating N
batches; averaging the ranks' buffers instead, as before, differed from it at every step.
Other floating-point buffers (none in the detectors here) are averaged.
"""

from __future__ import annotations

import torch
from torch import nn

from detscale import dist


class SequentialBufferMerge:
    """Snapshot the buffers before a batch (:meth:`snapshot`), merge the ranks' updates after it (:meth:`merge`)."""

    def __init__(self, model: nn.Module) -> None:
        self.norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                      and m.track_running_stats and m.momentum is not None]
        tracked = {id(b) for m in self.norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)}
        persistent = model.state_dict(keep_vars=True)
        self.others = [b for name, b in model.named_buffers()
                       if name in persistent and b.dtype.is_floating_point and id(b) not in tracked]
        self.stats = [t for m in self.norms for t in (m.running_mean, m.running_var)]
        # the momentum of every element of the flattened statistics
        self.momentum = torch.cat([torch.full((m.running_mean.numel() * 2,), float(m.momentum)) for m in self.norms]) \
            if self.norms else torch.zeros(0)

    def snapshot(self) -> torch.Tensor | None:
        """The running statistics now (call before the batch's forward); ``None`` with one process."""
        if dist.get_world_size() == 1 or not self.stats:
            return None
        return torch.cat([t.detach().reshape(-1) for t in self.stats])

    def merge(self, before: torch.Tensor | None) -> None:
        """Replace every rank's statistics by the sequential update over all ranks (a collective)."""
        world = dist.get_world_size()
        if world == 1:
            return
        if before is not None:
            after = torch.cat([t.detach().reshape(-1) for t in self.stats])
            gathered = dist.all_gather(after)  # [world, n], rank order
            keep = 1 - self.momentum.to(device=after.device, dtype=after.dtype)
            merged = keep.pow(world) * before
            for r in range(world):
                merged = merged + keep.pow(world - 1 - r) * (gathered[r] - keep * before)
            offset = 0
            for t in self.stats:
                n = t.numel()
                t.copy_(merged[offset:offset + n].view_as(t))
                offset += n
            for m in self.norms:
                m.num_batches_tracked.add_(world - 1)  # each rank counted its own batch once
        if self.others:
            flat = torch.cat([b.detach().reshape(-1).float() for b in self.others])
            dist.all_reduce_mean(flat)
            offset = 0
            for b in self.others:
                n = b.numel()
                b.copy_(flat[offset:offset + n].view_as(b))
                offset += n
