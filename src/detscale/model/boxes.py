"""Anchor points and box geometry shared by the head, the loss and post-processing."""

from __future__ import annotations

import math

import torch


def make_anchors(shapes: list[tuple[int, int]], strides: list[float], device: torch.device,
                 dtype: torch.dtype = torch.float32, offset: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Cell centres of every level, in grid units of their level, and the stride of each point.

    Returns ``points`` [A, 2] (x, y) and ``stride`` [A, 1], levels concatenated in order,
    each level row-major (y outer, x inner) like the flattened feature maps.
    """
    points, stride_col = [], []
    for (h, w), s in zip(shapes, strides, strict=True):
        sy = torch.arange(h, device=device, dtype=dtype) + offset
        sx = torch.arange(w, device=device, dtype=dtype) + offset
        yy, xx = torch.meshgrid(sy, sx, indexing="ij")
        points.append(torch.stack((xx, yy), -1).view(-1, 2))
        stride_col.append(torch.full((h * w, 1), float(s), device=device, dtype=dtype))
    return torch.cat(points), torch.cat(stride_col)


def dist2bbox(distance: torch.Tensor, points: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """(left, top, right, bottom) distances from ``points`` to xyxy boxes, along ``dim``."""
    lt, rb = distance.chunk(2, dim)
    return torch.cat((points - lt, points + rb), dim)


def bbox2dist(points: torch.Tensor, boxes: torch.Tensor, max_dist: float) -> torch.Tensor:
    """xyxy ``boxes`` to (l, t, r, b) distances from ``points``, clamped to [0, max_dist - 0.01]."""
    x1y1, x2y2 = boxes.chunk(2, -1)
    return torch.cat((points - x1y1, x2y2 - points), -1).clamp(0, max_dist - 0.01)


def xywh2xyxy(boxes: torch.Tensor) -> torch.Tensor:
    """(cx, cy, w, h) -> (x1, y1, x2, y2) on the last dimension."""
    xy, wh = boxes[..., :2], boxes[..., 2:4]
    return torch.cat((xy - wh / 2, xy + wh / 2), -1)


def bbox_ciou(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Complete IoU of xyxy boxes (broadcast over leading dimensions), shape ``[..., 1]``.

    CIoU = IoU - (centre distance^2 / enclosing diagonal^2) - alpha * v, where v measures the
    aspect-ratio mismatch and alpha = v / (v - IoU + 1) is treated as a constant.
    """
    b1x1, b1y1, b1x2, b1y2 = box1.chunk(4, -1)
    b2x1, b2y1, b2x2, b2y2 = box2.chunk(4, -1)
    w1, h1 = b1x2 - b1x1, (b1y2 - b1y1).clamp(min=eps)
    w2, h2 = b2x2 - b2x1, (b2y2 - b2y1).clamp(min=eps)
    inter = (torch.minimum(b1x2, b2x2) - torch.maximum(b1x1, b2x1)).clamp(min=0) * (
        torch.minimum(b1y2, b2y2) - torch.maximum(b1y1, b2y1)).clamp(min=0)
    union = w1 * h1 + w2 * h2 - inter + eps
    iou = inter / union
    cw = torch.maximum(b1x2, b2x2) - torch.minimum(b1x1, b2x1)
    ch = torch.maximum(b1y2, b2y2) - torch.minimum(b1y1, b2y1)
    diag2 = cw.pow(2) + ch.pow(2) + eps
    centre2 = ((b2x1 + b2x2 - b1x1 - b1x2).pow(2) + (b2y1 + b2y2 - b1y1 - b1y2).pow(2)) / 4
    v = (4 / math.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)).pow(2)
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (centre2 / diag2 + v * alpha)
