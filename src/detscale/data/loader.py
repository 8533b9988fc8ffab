"""Data loaders for training (distributed, shuffled, augmented) and validation (sharded, exact).

Training: :class:`TrainSampler` shuffles with one seed, gives each rank a contiguous slice of
every global batch, and yields :class:`~detscale.data.dataset.SampleKey` ``(index, epoch, mosaic,
seed)`` instead of bare indices. The sampler is iterated in the main process, so switching mosaic off for the last
``close_mosaic`` epochs reaches the workers through the keys, even with persistent workers
(whose copy of the dataset never sees attribute changes made in the main process). Call
:func:`set_epoch` at the start of every epoch::

    loader = build_train_loader(dataset, batch, rank, world, seed, workers, accumulate=accumulate)
    for epoch in range(start, epochs):
        set_epoch(loader, epoch, mosaic=epoch < epochs - close_mosaic)
        for imgs, targets, metas in loader: ...

Validation: :class:`ShardSampler` gives each rank one contiguous, disjoint slice of the split;
together the ranks see every image exactly once (``DistributedSampler`` would pad with
duplicates, which would bias COCO metrics).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from detscale.data.dataset import SampleKey


def bucket_size(objects: int, smallest: int) -> int:
    """The padded object count of a batch whose fullest image has ``objects``: ``smallest``,
    doubled until it holds them (16, 32, 64, ... for ``smallest`` 16); ``objects`` itself for 0."""
    if smallest <= 0:
        return objects
    m = smallest
    while m < objects:
        m *= 2
    return m


def collate(
    batch: Sequence[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]], bucket: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    """``(imgs uint8 [B, 3, H, W], targets, metas)``.

    ``bucket = None``: targets flat, float32 [N, 6] (batch_idx, cls, cx, cy, w, h). Otherwise padded
    on the CPU to float32 [B, M, 5] (cls, cx, cy, w, h; ``cls = -1`` in the padding), M =
    :func:`bucket_size` of the fullest image: with ``bucket > 0`` the training step sees a handful of
    shapes over a whole run (one per bucket, what a compiled step needs); with 0, M is the fullest
    image's count (a shape per batch, and the least padding for an eager step). Either way the loss
    never reads M from the device.
    """
    # numpy's single-threaded copy: torch.stack would wake torch's intra-op thread pool, which
    # costs more than the copy itself when the loader runs in a busy main process (workers=0).
    imgs = torch.from_numpy(np.stack([item[0].numpy() for item in batch]))
    metas = [item[2] for item in batch]
    if bucket is not None:
        m = bucket_size(max((len(labels) for _, labels, _ in batch), default=0), bucket)
        padded = np.zeros((len(batch), m, 5), dtype=np.float32)
        padded[..., 0] = -1.0
        for b, (_, labels, _) in enumerate(batch):
            padded[b, :len(labels)] = labels.numpy()
        return imgs, torch.from_numpy(padded), metas
    targets = [
        torch.cat([torch.full((len(labels), 1), float(b)), labels], dim=1) for b, (_, labels, _) in enumerate(batch)
    ]
    return imgs, torch.cat(targets) if targets else torch.zeros((0, 6)), metas


class TrainSampler(Sampler[SampleKey]):
    """This rank's share of a seeded shuffle, as ``SampleKey(index, epoch, mosaic, seed)``.

    Every epoch is one permutation of the dataset (seeded with ``seed + epoch``, as
    ``DistributedSampler`` does) cut into global batches of ``num_replicas x batch_size`` images;
    rank ``r`` takes the ``r``-th contiguous slice of each. So the ``i``-th batch of a single rank
    that accumulates N batches is exactly rank ``i mod N``'s batch of an N-rank run: the same
    images share a BatchNorm batch and an optimiser step whatever the rank count. Only whole
    optimiser steps (``accumulate`` global batches) are kept; the rest of the epoch's permutation
    is left out (a different rest every epoch). ``rank`` and ``num_replicas`` are explicit, so no
    process group is needed to build it.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, batch_size: int = 1,
                 accumulate: int = 1, mosaic: bool = True):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside world size {num_replicas}")
        self.n = len(dataset)  # type: ignore[arg-type]
        self.num_replicas, self.rank, self.seed = num_replicas, rank, seed
        self.batch_size, self.accumulate = batch_size, accumulate
        self.epoch, self.mosaic = 0, mosaic
        images_per_step = num_replicas * batch_size * accumulate
        self.batches = self.n // images_per_step * accumulate  # this rank's batches per epoch

    def set_epoch(self, epoch: int, mosaic: bool | None = None) -> None:
        """Reshuffle for ``epoch``; ``mosaic`` (when given) switches mosaic on or off from now on."""
        self.epoch = epoch
        if mosaic is not None:
            self.mosaic = mosaic

    def __iter__(self) -> Iterator[SampleKey]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g).tolist()
        b, world = self.batch_size, self.num_replicas
        for i in range(self.batches):
            start = (i * world + self.rank) * b
            for index in order[start:start + b]:
                yield SampleKey(index, self.epoch, self.mosaic, self.seed)

    def __len__(self) -> int:
        return self.batches * self.batch_size


class ShardSampler(Sampler[int]):
    """Indices ``[rank * n // world, (rank + 1) * n // world)``: disjoint, contiguous, complete."""

    def __init__(self, n: int, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.start = rank * n // world_size
        self.stop = (rank + 1) * n // world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def worker_seed(seed: int, rank: int, worker_id: int, base: int) -> int:
    """A 32-bit seed for one loader worker of one rank (``base`` is torch's per-epoch worker seed)."""
    return int(np.random.SeedSequence([seed, rank, worker_id, base % 2**32]).generate_state(1)[0])


def _init_worker(worker_id: int, seed: int, rank: int) -> None:
    """Seed numpy, random and torch in a worker and keep it to one thread (cores go to workers).

    The augmentation itself draws from a generator keyed on (seed, epoch, index) and does not
    depend on these global seeds; they make any other randomness in a worker reproducible too.
    """
    import cv2

    info = torch.utils.data.get_worker_info()
    s = worker_seed(seed, rank, worker_id, info.seed if info is not None else 0)
    np.random.seed(s)
    random.seed(s)
    torch.manual_seed(s)
    torch.set_num_threads(1)
    cv2.setNumThreads(1)


def set_epoch(loader: DataLoader, epoch: int, mosaic: bool = True) -> None:
    """Start ``epoch``: reshuffle and switch mosaic (``False`` for the ``close_mosaic`` epochs)."""
    sampler = loader.sampler
    if not isinstance(sampler, TrainSampler):
        raise TypeError("set_epoch expects a loader from build_train_loader")
    sampler.set_epoch(epoch, mosaic)


def build_train_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    workers: int,
    pin_memory: bool = True,
    accumulate: int = 1,
    target_bucket: int | None = None,
) -> DataLoader:
    """Shuffled, distributed, augmented batches of ``batch_size`` for this rank (:class:`TrainSampler`).

    Each epoch holds whole optimiser steps of ``accumulate`` batches on every rank. Workers are
    persistent (when ``workers > 0``); memory is pinned only when CUDA is present. The same
    ``seed`` gives the same batches, whatever ``workers`` is. ``target_bucket``: see :func:`collate`.
    """
    sampler = TrainSampler(dataset, num_replicas=world_size, rank=rank, seed=seed, batch_size=batch_size,
                           accumulate=accumulate)
    # Fixes torch's per-epoch worker base seeds, so worker_init_fn seeds repeat from run to run.
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, rank]).generate_state(1)[0]))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=partial(collate, bucket=target_bucket),
        pin_memory=pin_memory and torch.cuda.is_available(),
        drop_last=True,
        persistent_workers=workers > 0,
        worker_init_fn=partial(_init_worker, seed=seed, rank=rank),
        generator=generator,
        prefetch_factor=4 if workers > 0 else None,
    )


def build_val_loader(
    dataset: Dataset, batch_size: int, rank: int, world_size: int, workers: int, pin_memory: bool = True
) -> DataLoader:
    """This rank's contiguous shard of ``dataset`` in order, no duplicates, last batch kept."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardSampler(len(dataset), rank, world_size),
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin_memory and torch.cuda.is_available(),
        drop_last=False,
        worker_init_fn=partial(_init_worker, seed=0, rank=rank),
    )


def worker_cpu_seconds(loader: DataLoader) -> float | None:
    """CPU seconds (user + system) the loader's live worker processes have used; ``None`` without them.

    Read from ``/proc/PID/stat`` (Linux); elsewhere, or before the workers start, ``None``.
    Persistent workers keep their count from epoch to epoch.
    """
    workers = getattr(getattr(loader, "_iterator", None), "_workers", None)
    if not workers:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for worker in workers:
        try:
            fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError, ValueError):
            return None
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15)
    return total
