"""Loaders: collate, rank shards (train and val), reproducible augmentation, mosaic switch with
persistent workers."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

from detscale.config import AugmentConfig
from detscale.data.dataset import DetectionDataset, SampleKey, build_dataset
from detscale.data.loader import ShardSampler, build_train_loader, build_val_loader, collate, set_epoch

IMGSZ = 64


@pytest.fixture(scope="module")
def data_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 train and 7 val tiny JPEGs, each with 1-3 labelled rectangles."""
    root = tmp_path_factory.mktemp("loader-ds")
    rng = np.random.default_rng(0)
    for split, n in (("train", 8), ("val", 7)):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(n):
            h, w = int(rng.integers(40, 80)), int(rng.integers(40, 80))
            img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            lines = []
            for k in range(int(rng.integers(1, 4))):
                bw, bh = int(rng.integers(8, w // 2)), int(rng.integers(8, h // 2))
                x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
                img[y:y + bh, x:x + bw] = 255
                lines.append(f"{k} {(x + bw / 2) / w} {(y + bh / 2) / h} {bw / w} {bh / h}")
            cv2.imwrite(str(root / "images" / split / f"{i}.jpg"), img)
            (root / "labels" / split / f"{i}.txt").write_text("\n".join(lines) + "\n")
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(root), "train": "images/train", "val": "images/val",
                                    "names": ["a", "b", "c"]}))
    return data


def _train_set(data_yaml: Path, **overrides: float) -> DetectionDataset:
    return build_dataset(data_yaml, "train", IMGSZ, "none", None, AugmentConfig(**overrides))


def test_collate_builds_targets_with_batch_index() -> None:
    items = [
        (torch.zeros(3, 4, 4, dtype=torch.uint8), torch.tensor([[1, .5, .5, .2, .2]]), {"image_id": 0}),
        (torch.ones(3, 4, 4, dtype=torch.uint8), torch.zeros(0, 5), {"image_id": 1}),
        (torch.ones(3, 4, 4, dtype=torch.uint8), torch.tensor([[0, .1, .1, .1, .1], [2, .3, .3, .1, .1]]),
         {"image_id": 2}),
    ]
    imgs, targets, metas = collate(items)
    assert imgs.shape == (3, 3, 4, 4) and imgs.dtype == torch.uint8
    assert targets.shape == (3, 6) and targets[:, 0].tolist() == [0, 2, 2]
    assert targets[:, 1].tolist() == [1, 0, 2]
    assert [m["image_id"] for m in metas] == [0, 1, 2]


def test_train_ranks_see_disjoint_shards_covering_the_data(data_yaml: Path) -> None:
    ds = _train_set(data_yaml, mosaic=0.0)
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            loader = build_train_loader(ds, 2, rank=rank, world_size=2, seed=3, workers=0)
            set_epoch(loader, epoch)
            ids = [m["image_id"] for _, _, metas in loader for m in metas]
            assert len(ids) == 4
            seen.append(ids)
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(8))
    # Plain DistributedSampler semantics for the caller: loader.sampler.set_epoch reshuffles.
    loader = build_train_loader(ds, 2, rank=0, world_size=1, seed=3, workers=0)
    orders = []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        orders.append([k.index for k in loader.sampler])
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(8)) and orders[0] != orders[1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_val_ranks_get_contiguous_disjoint_shards_without_padding(data_yaml: Path, world: int) -> None:
    ds = build_dataset(data_yaml, "val", IMGSZ, "none", None, None)
    shards = []
    for rank in range(world):
        loader = build_val_loader(ds, 2, rank=rank, world_size=world, workers=0)
        ids = [m["image_id"] for _, _, metas in loader for m in metas]
        assert ids == list(range(ids[0], ids[0] + len(ids)))  # contiguous, in order
        shards.append(ids)
    assert [i for s in shards for i in s] == list(range(7))  # exactly the split, no duplicates
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    with pytest.raises(ValueError):
        ShardSampler(7, rank=2, world_size=2)


def _epochs(loader: torch.utils.data.DataLoader, epochs: int, mosaic_until: int = 99) -> list:
    out = []
    for epoch in range(epochs):
        set_epoch(loader, epoch, mosaic=epoch < mosaic_until)
        out.append([(imgs.clone(), targets.clone(), [m["image_id"] for m in metas]) for imgs, targets, metas in loader])
    return out


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for ea, eb in zip(a, b, strict=True):
        assert len(ea) == len(eb)
        for (ia, ta, ma), (ib, tb, mb) in zip(ea, eb, strict=True):
            assert ma == mb
            torch.testing.assert_close(ia, ib, rtol=0, atol=0)
            torch.testing.assert_close(ta, tb, rtol=0, atol=0)


def test_same_seed_gives_same_augmented_batches_whatever_the_workers(data_yaml: Path) -> None:
    ds = _train_set(data_yaml, mixup=0.5)
    first = _epochs(build_train_loader(ds, 4, rank=0, world_size=1, seed=11, workers=0), 2)
    again = _epochs(build_train_loader(ds, 4, rank=0, world_size=1, seed=11, workers=0), 2)
    _assert_same(first, again)
    with_workers = _epochs(build_train_loader(ds, 4, rank=0, world_size=1, seed=11, workers=2), 2)
    _assert_same(first, with_workers)
    other_seed = _epochs(build_train_loader(ds, 4, rank=0, world_size=1, seed=12, workers=0), 1)
    assert not torch.equal(first[0][0][0], other_seed[0][0][0])
    # Epochs differ (new shuffle and new augmentation).
    assert not torch.equal(first[0][0][0], first[1][0][0])


def test_mosaic_switch_reaches_persistent_workers(data_yaml: Path) -> None:
    ds = _train_set(data_yaml)
    loader = build_train_loader(ds, 4, rank=0, world_size=1, seed=5, workers=2)
    assert loader.persistent_workers and not loader.pin_memory  # no CUDA here
    batches = _epochs(loader, 3, mosaic_until=1)  # epoch 0 with mosaic, epochs 1-2 without
    for epoch, batches_of_epoch in enumerate(batches):
        for imgs, _, ids in batches_of_epoch:
            for img, i in zip(imgs, ids, strict=True):
                expected = ds[SampleKey(i, epoch, epoch < 1, 5)][0]
                torch.testing.assert_close(img, expected, rtol=0, atol=0)
    # And the switch matters: the same item with mosaic on is a different image.
    i = batches[1][0][2][0]
    assert not torch.equal(ds[SampleKey(i, 1, True, 5)][0], ds[SampleKey(i, 1, False, 5)][0])


def test_opencv_is_single_threaded_so_forked_workers_cannot_deadlock() -> None:
    # A worker forked after the parent ran a parallel OpenCV call can hang in its first OpenCV
    # call (seen: the seeded-batches test hung after the augmentation tests ran in one session).
    import cv2

    import detscale.data.dataset  # noqa: F401

    assert cv2.getNumThreads() == 1


class _Busy(torch.utils.data.Dataset):
    """Items that cost CPU time to make."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.zeros(1)
        for _ in range(20):
            x = x + torch.rand(200, 200).sum()
        return x


def test_worker_cpu_seconds_counts_the_workers_not_the_rank():
    from detscale.data.loader import worker_cpu_seconds

    loader = torch.utils.data.DataLoader(_Busy(), batch_size=2, num_workers=1, persistent_workers=True)
    assert worker_cpu_seconds(loader) is None  # no workers yet
    list(loader)
    first = worker_cpu_seconds(loader)
    assert first is not None and first > 0
    list(loader)  # persistent workers: the count goes on
    assert worker_cpu_seconds(loader) >= first
    assert worker_cpu_seconds(torch.utils.data.DataLoader(_Busy(), batch_size=2)) is None  # no workers at all
