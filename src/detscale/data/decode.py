"""Decoding an image as training reads it: OpenCV's decode (EXIF orientation applied, CMYK and
16-bit converted, alpha dropped, as the reference trainer reads images) to RGB, a very large JPEG
at a reduced size in bounded memory, and the letterbox geometry that maps back to the original."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from detscale.data.formats import DatasetError


def decode_image(path: str | Path, data: bytes | None = None) -> np.ndarray:
    """Decode an image file to ``uint8 [H, W, 3]`` RGB; :class:`DatasetError` when unreadable."""
    import cv2  # here, not at import: a process that only reads a built cache needs no OpenCV

    import detscale.data.augment  # noqa: F401  (sets OpenCV single-threaded before any fork)
    if data is None:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise DatasetError(f"cannot read image {path}: {exc.strerror}; run `detscale validate`") from None
    img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    if img is None or img.size == 0:
        raise DatasetError(f"cannot decode image {path}; run `detscale validate` to find broken images")
    return cv2.cvtColor(img, cv2.COLOR_BGR2RGB)


#: Above this many pixels an image is "very large": a JPEG is decoded at 1/2, 1/4 or 1/8 of its size
#: (libjpeg's own reduced decoding, never below the training size), so decoding one never takes
#: more memory than an image of about this size; the validator names such images.
LARGE_PIXELS = 40_000_000


def decode_for(path: str | Path, imgsz: int, data: bytes | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode an image for training at ``imgsz``: ``(RGB uint8 image, (height, width) of the original)``.

    A very large JPEG (:data:`LARGE_PIXELS`) is decoded reduced by the largest power of two (up to 8)
    that keeps its long side at least ``imgsz``; everything else at full size, as the reference
    trainer reads it.
    """
    import cv2

    data = Path(path).read_bytes() if data is None else data
    from detscale.data.formats import header_size

    size = header_size(data)
    if size is not None and size[0] * size[1] > LARGE_PIXELS and data[:2] == b"\xff\xd8":
        factor = 8
        while factor > 1 and max(size) // factor < imgsz:
            factor //= 2
        if factor > 1:
            flag = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}
            img = cv2.imdecode(np.frombuffer(data, np.uint8), flag[factor])
            if img is not None and img.size:
                # the frame header's size, with EXIF orientation applied as the decoder applied it
                h, w = img.shape[:2]
                full = (size[1], size[0]) if (h > w) == (size[1] > size[0]) else (size[0], size[1])
                return cv2.cvtColor(img, cv2.COLOR_BGR2RGB), full
    img = decode_image(path, data)
    return img, (int(img.shape[0]), int(img.shape[1]))


def letterboxed_meta(img: np.ndarray, original: tuple[int, int], ratio: float, pad: Any) -> dict[str, Any]:
    """The index entry's geometry of ``img`` letterboxed by ``ratio``: the original's shape, and the
    ratio from the original (the same unless it was decoded reduced), so predictions map back to
    the original's pixels."""
    return {"orig_shape": [int(original[0]), int(original[1])],
            "ratio": ratio * max(img.shape[:2]) / max(original), "pad": list(pad)}


def load_letterboxed(path: str | Path, imgsz: int) -> tuple[np.ndarray, dict[str, Any]]:
    """Decode and letterbox one image (what ``cache: none`` does for every item)."""
    from detscale.data.augment import letterbox

    img, original = decode_for(path, imgsz)
    out, ratio, pad = letterbox(img, imgsz)
    return out, letterboxed_meta(img, original, ratio, pad)
