"""Detections from eval-mode outputs: threshold, class-aware NMS, cap, and letterbox undone.

The whole batch goes through one ``torchvision.ops.batched_nms`` call: boxes of different images
(and of different classes) never suppress each other because each (image, class) pair gets its
own NMS group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torchvision


def postprocess(preds: torch.Tensor, conf: float = 0.25, iou: float = 0.7, max_det: int = 300,
                multi_label: bool = False, max_nms: int = 30000) -> list[torch.Tensor]:
    """Per-image detections ``[n, 6]`` (x1, y1, x2, y2, score, cls) from ``preds`` ``[B, 4 + nc, A]``.

    ``preds`` is the eval-mode output of a detector (xyxy boxes in input pixels, class
    probabilities). A candidate is kept when its score exceeds ``conf``; with ``multi_label``
    every class above ``conf`` of an anchor is a candidate (better recall for mAP), otherwise only
    its best class. At most ``max_nms`` candidates per image enter NMS (highest scores first), and
    at most ``max_det`` detections per image are returned, sorted by decreasing score.
    """
    if preds.dim() != 3 or preds.shape[1] < 5:
        raise ValueError(f"expected predictions [B, 4 + nc, A], got shape {tuple(preds.shape)}")
    bsz = preds.shape[0]
    p = preds.detach().transpose(1, 2).float()  # [B, A, 4 + nc]
    boxes, scores = p[..., :4], p[..., 4:]
    if multi_label:
        img, anchor, cls = (scores > conf).nonzero(as_tuple=True)
        score = scores[img, anchor, cls]
    else:
        best, best_cls = scores.max(-1)
        img, anchor = (best > conf).nonzero(as_tuple=True)
        score, cls = best[img, anchor], best_cls[img, anchor]
    img, anchor, cls, score = _top_per_image(img, anchor, cls, score, bsz, max_nms)
    box = boxes[img, anchor]
    nc = scores.shape[-1]
    keep = torchvision.ops.batched_nms(box, score, img * nc + cls, iou)  # sorted by decreasing score
    img, anchor, cls, score = _top_per_image(img[keep], anchor[keep], cls[keep], score[keep], bsz, max_det)
    dets = torch.cat((boxes[img, anchor], score[:, None], cls[:, None].float()), 1)
    counts = torch.bincount(img, minlength=bsz).tolist()
    return list(dets.split(counts))


def _top_per_image(img: torch.Tensor, anchor: torch.Tensor, cls: torch.Tensor, score: torch.Tensor,
                   bsz: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the ``k`` highest-scoring entries of every image; result grouped by image, scores descending."""
    order = torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(img[order], stable=True)]  # by image, then by score
    img_sorted = img[order]
    counts = torch.bincount(img_sorted, minlength=bsz)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(order), device=img.device) - starts[img_sorted]
    order = order[rank < k]
    return img[order], anchor[order], cls[order], score[order]


def scale_boxes(boxes: torch.Tensor, ratio: float, pad: Sequence[float], orig_shape: Sequence[int]) -> torch.Tensor:
    """Map xyxy boxes from the letterboxed input back to the original image, clipped to it.

    ``ratio`` is the resize factor applied to the original image, ``pad`` = (pad_w, pad_h) the
    offset of the image inside the letterbox and ``orig_shape`` = (h, w) of the original image.
    Only the first four columns are changed (so ``[n, 6]`` detections can be passed directly);
    a new tensor is returned.
    """
    out = boxes.clone()
    pad_w, pad_h = float(pad[0]), float(pad[1])
    h, w = orig_shape[0], orig_shape[1]
    out[..., [0, 2]] = ((out[..., [0, 2]] - pad_w) / ratio).clamp(0, w)
    out[..., [1, 3]] = ((out[..., [1, 3]] - pad_h) / ratio).clamp(0, h)
    return out
