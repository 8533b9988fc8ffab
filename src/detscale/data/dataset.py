"""``DetectionDataset``: letterboxed (and, for training, augmented) images with YOLO labels.

An item is ``(img, labels, meta)``:

- ``img``: ``uint8 Tensor[3, imgsz, imgsz]`` RGB;
- ``labels``: ``float32 Tensor[n, 5]`` ``(cls, cx, cy, w, h)`` normalised to the output image;
- ``meta``: ``dict(image_id=index in the split, path=str, orig_shape=(h, w), ratio=float,
  pad=(pad_w, pad_h))`` describing the letterbox of the item's own image (for a mosaic, of its
  first tile); evaluation uses it to map predictions back to the original image.

Index it with an ``int`` (epoch 0, mosaic as configured, seed 0) or with a :class:`SampleKey`,
which the training sampler yields so that the epoch, the mosaic switch and the seed travel with
each index into the loader workers (attributes set on the dataset in the main process would not
reach persistent workers). The augmentation of one item is a function of ``(seed, epoch,
index)`` only: the same whatever the number of ranks or workers and whichever worker runs it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from detscale.config import CACHE_MODES, AugmentConfig
from detscale.data import augment as aug
from detscale.data.cache import CachedImages, CacheError, cache_paths, open_cache
from detscale.data.decode import load_letterboxed
from detscale.data.formats import DatasetError, label_path_for, load_spec, read_labels

log = logging.getLogger(__name__)

Sample = tuple[np.ndarray, np.ndarray, np.ndarray]  # image HWC RGB, boxes xyxy px [n, 4], cls [n]


class SampleKey(NamedTuple):
    """What the training sampler yields for one item."""

    index: int
    epoch: int = 0
    mosaic: bool = True
    seed: int = 0


class DetectionDataset(Dataset):
    """Images of one split, letterboxed to ``imgsz``; augmented when ``augment`` is given.

    Args:
        images: the split's image paths (``DatasetSpec.splits[split]``).
        imgsz: square output size.
        cache_mode: ``none`` (decode every time), ``disk`` or ``ram`` (see :mod:`detscale.data.cache`).
        cache_index: the cache's index json (required unless ``cache_mode == "none"``).
        augment: training augmentation parameters; ``None`` for validation (letterbox only).
    """

    def __init__(
        self,
        images: tuple[Path, ...] | list[Path],
        imgsz: int,
        cache_mode: str = "none",
        cache_index: str | Path | None = None,
        augment: AugmentConfig | None = None,
    ):
        if cache_mode not in CACHE_MODES:
            raise CacheError(f"cache mode must be one of {', '.join(CACHE_MODES)}, got {cache_mode!r}")
        if not images:
            raise DatasetError("the split has no images; check the data.yaml (or the validation report)")
        self.paths = [str(Path(p).absolute()) for p in images]
        self.imgsz = imgsz
        self.cache_mode = cache_mode
        self.augment = augment
        # Labels are small: read them all once, normalised to the original image.
        self.labels = [read_labels(label_path_for(Path(p))) for p in self.paths]
        self.cache: CachedImages | None = None
        if cache_mode != "none":
            if cache_index is None:
                raise CacheError(f"cache mode {cache_mode!r} needs the cache's index path")
            self.cache = open_cache(cache_index, cache_mode)
            cached = [e["path"] for e in self.cache.entries]
            if cached != self.paths or self.cache.imgsz != imgsz:
                raise CacheError(
                    f"cache {cache_index} holds {len(cached)} images at {self.cache.imgsz} but the split has "
                    f"{len(self.paths)} images at {imgsz} (or other files); re-run `detscale cache` for this "
                    "data.yaml and image size"
                )

    def __len__(self) -> int:
        return len(self.paths)

    # ---- loading ------------------------------------------------------------------------------

    def load(self, i: int) -> tuple[np.ndarray, dict[str, Any]]:
        """Image ``i`` letterboxed (a read-only view when cached) and its letterbox geometry."""
        if self.cache is None:
            return load_letterboxed(self.paths[i], self.imgsz)
        e = self.cache.entries[i]
        return self.cache.image(i), {"orig_shape": e["orig_shape"], "ratio": e["ratio"], "pad": e["pad"]}

    def _boxes(self, i: int, geometry: dict[str, Any], padded: bool) -> tuple[np.ndarray, np.ndarray]:
        """Pixel xyxy boxes and classes of image ``i`` in its letterboxed (or unpadded) frame."""
        labels = self.labels[i]
        h, w = geometry["orig_shape"]
        pad = geometry["pad"] if padded else (0, 0)
        return aug.yolo_to_xyxy(labels[:, 1:5], w, h, geometry["ratio"], pad), labels[:, 0].copy()

    def load_letterboxed_sample(self, i: int) -> tuple[Sample, dict[str, Any]]:
        img, geometry = self.load(i)
        boxes, cls = self._boxes(i, geometry, padded=True)
        return (img, boxes, cls), geometry

    def load_resized_sample(self, i: int) -> tuple[Sample, dict[str, Any]]:
        """Image ``i`` scaled to long side ``imgsz`` without padding (a mosaic tile), and its geometry."""
        img, geometry = self.load(i)
        h, w = geometry["orig_shape"]
        nw, nh = aug.resized_shape(w, h, geometry["ratio"])
        pw, ph = geometry["pad"]
        boxes, cls = self._boxes(i, geometry, padded=False)
        return (img[ph:ph + nh, pw:pw + nw], boxes, cls), geometry

    # ---- augmentation -------------------------------------------------------------------------

    def _mosaic(self, i: int, rng: np.random.Generator, cfg: AugmentConfig) -> tuple[Sample, dict[str, Any]]:
        """Mosaic of image ``i`` and three random others, cropped to ``imgsz`` by the random affine."""
        others = rng.integers(0, len(self), size=3).tolist()
        loaded = [self.load_resized_sample(j) for j in (i, *others)]
        canvas = aug.mosaic4([sample for sample, _ in loaded], self.imgsz, rng)
        return aug.random_affine(*canvas, self.imgsz, cfg.scale, cfg.translate, rng), loaded[0][1]

    def _train_sample(self, i: int, mosaic: bool, rng: np.random.Generator) -> tuple[Sample, dict[str, Any]]:
        cfg = self.augment
        assert cfg is not None
        if mosaic and cfg.mosaic > 0 and rng.random() < cfg.mosaic:
            sample, geometry = self._mosaic(i, rng, cfg)
            if cfg.mixup > 0 and rng.random() < cfg.mixup:
                other, _ = self._mosaic(int(rng.integers(0, len(self))), rng, cfg)
                sample = aug.mixup(sample, other, rng)
        else:
            letterboxed, geometry = self.load_letterboxed_sample(i)
            sample = aug.random_affine(*letterboxed, self.imgsz, cfg.scale, cfg.translate, rng)
        img, boxes, cls = sample
        img = aug.hsv_jitter(img, cfg.hsv_h, cfg.hsv_s, cfg.hsv_v, rng)
        if cfg.fliplr > 0 and rng.random() < cfg.fliplr:
            img, boxes = aug.fliplr(img, boxes)
        return (img, boxes, cls), geometry

    # ---- items --------------------------------------------------------------------------------

    def __getitem__(self, key: int | SampleKey) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        key = SampleKey(int(key)) if not isinstance(key, SampleKey) else key
        i = key.index
        if self.augment is None:
            (img, boxes, cls), geometry = self.load_letterboxed_sample(i)
        else:
            # One generator per (seed, epoch, index): reproducible whatever worker runs the item.
            rng = np.random.default_rng([key.seed, key.epoch, i])
            (img, boxes, cls), geometry = self._train_sample(i, key.mosaic, rng)
        h, w = img.shape[:2]
        labels = np.concatenate([cls[:, None], aug.xyxy_to_yolo(boxes, w, h)], axis=1).astype(np.float32)
        meta = {
            "image_id": i,
            "path": self.paths[i],
            "orig_shape": tuple(int(v) for v in geometry["orig_shape"]),
            "ratio": float(geometry["ratio"]),
            "pad": tuple(int(v) for v in geometry["pad"]),
        }
        chw = torch.from_numpy(aug.to_chw(np.asarray(img)))
        return chw, torch.from_numpy(labels.reshape(-1, 5)), meta


def build_dataset(
    data_yaml: str | Path,
    split: str,
    imgsz: int,
    cache_mode: str,
    cache_dir: str | Path | None,
    augment: AugmentConfig | None,
) -> DetectionDataset:
    """The dataset of ``split`` of ``data_yaml`` (the clean view written by validation).

    ``cache_dir`` holds ``{split}-{imgsz}.npy/.json`` built by ``detscale cache``; it is ignored
    with ``cache_mode == "none"``.
    """
    spec = load_spec(data_yaml, splits=(split,))
    index = None
    if cache_mode != "none":
        if cache_dir is None:
            raise CacheError(f"cache mode {cache_mode!r} needs a cache folder (built by `detscale cache`)")
        index = cache_paths(cache_dir, split, imgsz)[1]
    return DetectionDataset(spec.splits[split], imgsz, cache_mode, index, augment)
