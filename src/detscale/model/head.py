"""The anchor-free decoupled detection head (DDetect) and its decoding."""

from __future__ import annotations

import math

import torch
from torch import nn

from detscale.model.blocks import DFL, Conv
from detscale.model.boxes import dist2bbox, make_anchors


def _round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


class DDetect(nn.Module):
    """One head per pyramid level: a box branch (4 x reg_max distribution logits) and a class branch.

    Training-mode forward returns the raw per-level maps ``[B, 4*reg_max + nc, H, W]``;
    :meth:`decode` turns them into ``[B, 4 + nc, A]`` (xyxy in input pixels, sigmoid scores).

    ``box_groups=4`` is YOLOv9's DDetect: after the first 3x3 conv, each box side is predicted by
    its own quarter of the channels, and the class branch is ``max(c, min(2 nc, 128))`` wide.
    ``box_groups=1`` is Ultralytics' Detect head (its ``yolov9t.yaml`` etc.): full convolutions
    (~31k more parameters per level at T size, and in short runs a much faster-learning box
    branch, docs/parity.md) and a class branch ``max(c, min(nc, 100))`` wide.
    """

    def __init__(self, nc: int, channels: tuple[int, ...], strides: tuple[int, ...] = (8, 16, 32),
                 reg_max: int = 16, box_groups: int = 4) -> None:
        super().__init__()
        self.nc, self.reg_max = nc, reg_max
        self.no = nc + 4 * reg_max
        self.strides = tuple(strides)
        c2 = _round_up(max(channels[0] // 4, 4 * reg_max, 16), 4)
        c3 = max(channels[0], min(2 * nc, 128) if box_groups > 1 else min(nc, 100))
        g = box_groups
        self.box = nn.ModuleList(
            nn.Sequential(Conv(x, c2, 3), Conv(c2, c2, 3, g=g), nn.Conv2d(c2, 4 * reg_max, 1, groups=g))
            for x in channels)
        self.cls = nn.ModuleList(
            nn.Sequential(Conv(x, c3, 3), Conv(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for x in channels)
        self.dfl = DFL(reg_max)
        self.init_bias()

    def init_bias(self) -> None:
        """Box logits start at 1.0; class logits at the prior of ~5 objects per 640 px image."""
        for box, cls, s in zip(self.box, self.cls, self.strides, strict=True):
            nn.init.constant_(box[-1].bias, 1.0)
            nn.init.constant_(cls[-1].bias, math.log(5 / self.nc / (640 / s) ** 2))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.cat((b(x), c(x)), 1) for x, b, c in zip(xs, self.box, self.cls, strict=True)]

    def decode(self, levels: list[torch.Tensor]) -> torch.Tensor:
        """Per-level maps -> ``[B, 4 + nc, A]``: xyxy boxes in input pixels, then class probabilities."""
        b = levels[0].shape[0]
        flat = torch.cat([x.view(b, self.no, -1) for x in levels], 2)
        dist, logits = flat.split((4 * self.reg_max, self.nc), 1)
        points, stride = make_anchors([tuple(x.shape[2:]) for x in levels], list(self.strides),
                                      flat.device, flat.dtype)
        boxes = dist2bbox(self.dfl(dist), points.T.unsqueeze(0), dim=1) * stride.T
        return torch.cat((boxes, logits.sigmoid()), 1)
