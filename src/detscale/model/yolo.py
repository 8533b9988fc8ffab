"""GELAN and YOLOv9 detectors, selectable by name, and their inference form.

Layer widths follow the published configurations (``shared/docs/yolov9-architecture.md``):

* ``gelan-t`` / ``gelan-s``: ELAN1 at P2, AConv downsampling, 3 RepNBottlenecks per RepNCSP.
* ``gelan-m``: RepNCSPELAN4 at P2, AConv, widths 240/360/480, 1 bottleneck per RepNCSP.
* ``gelan-c``: RepNCSPELAN4 at P2, ADown, widths 256/512/512, 1 bottleneck per RepNCSP.
* ``yolov9-t`` / ``yolov9-s``: the GELAN of the same size plus the auxiliary (PGI) branch from the
  backbone and a second DDetect head on it (DualDDetect); the branch exists for training only.
* ``gelan-{t,s,c}-detect``: the same GELAN with Ultralytics' Detect head instead of YOLOv9's
  DDetect (ungrouped box branch, class branch ``max(c, min(nc, 100))`` wide): the architecture of
  Ultralytics' ``yolov9{t,s,c}.yaml``, layer for layer (tests/test_oracles.py). Its ``yolov9m.yaml``
  departs from the paper's widths (184 channels in layer 16), so there is no ``gelan-m-detect``.

The layer numbers in comments are those of the reference tables.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detscale.errors import UserError
from detscale.model.blocks import ELAN1, SPPELAN, AConv, ADown, Conv, RepConvN, RepNCSPELAN4
from detscale.model.head import DDetect

STRIDES = (8, 16, 32)

# (c2 out, c3 split width, c4 branch width, n bottlenecks) of one RepNCSPELAN4
Elan = tuple[int, int, int, int]


class ModelError(UserError):
    """An unknown model name or an impossible model argument."""


@dataclass(frozen=True)
class GelanSpec:
    """Widths of one GELAN size; the input width of each block follows from the graph."""

    stem: tuple[int, int]            # layers 0, 1 (Conv 3x3 s2)
    p2: tuple[str, Elan]             # layer 2: ("elan1", (c2, c3, c4, -)) or ("rep", (c2, c3, c4, n))
    down: str                        # "aconv" or "adown"
    downs: tuple[int, int, int]      # layers 3, 5, 7
    elans: tuple[Elan, Elan, Elan]   # layers 4, 6, 8
    spp: tuple[int, int]             # layer 9 SPPELAN (c2, c3)
    head_downs: tuple[int, int]      # layers 16, 19
    head: tuple[Elan, Elan, Elan, Elan]  # layers 12, 15, 18, 21


def _half(spec: GelanSpec) -> GelanSpec:
    """The T size: every width of S halved (bottleneck counts unchanged)."""
    def h(e: Elan) -> Elan:
        return (e[0] // 2, e[1] // 2, e[2] // 2, e[3])
    return GelanSpec(
        stem=(spec.stem[0] // 2, spec.stem[1] // 2), p2=(spec.p2[0], h(spec.p2[1])), down=spec.down,
        downs=tuple(d // 2 for d in spec.downs), elans=tuple(h(e) for e in spec.elans),
        spp=(spec.spp[0] // 2, spec.spp[1] // 2), head_downs=tuple(d // 2 for d in spec.head_downs),
        head=tuple(h(e) for e in spec.head),
    )


_S = GelanSpec(
    stem=(32, 64), p2=("elan1", (64, 64, 32, 0)), down="aconv", downs=(128, 192, 256),
    elans=((128, 128, 64, 3), (192, 192, 96, 3), (256, 256, 128, 3)), spp=(256, 128),
    head_downs=(96, 128), head=((192, 192, 96, 3), (128, 128, 64, 3), (192, 192, 96, 3), (256, 256, 128, 3)),
)
_M = GelanSpec(
    stem=(32, 64), p2=("rep", (128, 128, 64, 1)), down="aconv", downs=(240, 360, 480),
    elans=((240, 240, 120, 1), (360, 360, 180, 1), (480, 480, 240, 1)), spp=(480, 240),
    head_downs=(180, 240), head=((360, 360, 180, 1), (240, 240, 120, 1), (360, 360, 180, 1), (480, 480, 240, 1)),
)
_C = GelanSpec(
    stem=(64, 128), p2=("rep", (256, 128, 64, 1)), down="adown", downs=(256, 512, 512),
    elans=((512, 256, 128, 1), (512, 512, 256, 1), (512, 512, 256, 1)), spp=(512, 256),
    head_downs=(256, 512), head=((512, 512, 256, 1), (256, 256, 128, 1), (512, 512, 256, 1), (512, 512, 256, 1)),
)

# name -> (widths, auxiliary PGI branch, box-branch groups of the head: 4 DDetect, 1 Detect)
MODELS: dict[str, tuple[GelanSpec, bool, int]] = {
    "gelan-t": (_half(_S), False, 4),
    "gelan-s": (_S, False, 4),
    "gelan-m": (_M, False, 4),
    "gelan-c": (_C, False, 4),
    "yolov9-t": (_half(_S), True, 4),
    "yolov9-s": (_S, True, 4),
    "gelan-t-detect": (_half(_S), False, 1),
    "gelan-s-detect": (_S, False, 1),
    "gelan-c-detect": (_C, False, 1),
}
MODEL_NAMES: tuple[str, ...] = tuple(MODELS)


def _elan(c_in: int, e: Elan) -> RepNCSPELAN4:
    return RepNCSPELAN4(c_in, e[0], e[1], e[2], e[3])


def _upcat(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    return torch.cat((F.interpolate(x, scale_factor=2.0, mode="nearest"), skip), 1)


class Backbone(nn.Module):
    """Layers 0-8; returns the P3, P4, P5 features (layers 4, 6, 8)."""

    def __init__(self, spec: GelanSpec) -> None:
        super().__init__()
        down = AConv if spec.down == "aconv" else ADown
        c0, c1 = spec.stem
        kind, e2 = spec.p2
        self.stem = nn.Sequential(Conv(3, c0, 3, 2), Conv(c0, c1, 3, 2))
        self.p2 = ELAN1(c1, e2[0], e2[1], e2[2]) if kind == "elan1" else _elan(c1, e2)
        d3, d5, d7 = spec.downs
        e4, e6, e8 = spec.elans
        self.down3, self.elan4 = down(e2[0], d3), _elan(d3, e4)
        self.down5, self.elan6 = down(e4[0], d5), _elan(d5, e6)
        self.down7, self.elan8 = down(e6[0], d7), _elan(d7, e8)
        self.out_channels = (e4[0], e6[0], e8[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p3 = self.elan4(self.down3(self.p2(self.stem(x))))
        p4 = self.elan6(self.down5(p3))
        return p3, p4, self.elan8(self.down7(p4))


class TopDown(nn.Module):
    """SPPELAN on P5, then upsample-concat-ELAN twice (layers 9-15, or 22-28 for the PGI branch)."""

    def __init__(self, spec: GelanSpec, in_channels: tuple[int, int, int]) -> None:
        super().__init__()
        c3, c4, c5 = in_channels
        self.spp = SPPELAN(c5, spec.spp[0], spec.spp[1])
        e12, e15 = spec.head[0], spec.head[1]
        self.elan_p4 = _elan(spec.spp[0] + c4, e12)
        self.elan_p3 = _elan(e12[0] + c3, e15)
        self.out_channels = (e15[0], e12[0], spec.spp[0])

    def forward(self, feats: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p3, p4, p5 = feats
        t5 = self.spp(p5)
        t4 = self.elan_p4(_upcat(t5, p4))
        return self.elan_p3(_upcat(t4, p3)), t4, t5


class BottomUp(nn.Module):
    """Downsample-concat-ELAN twice from the P3 output (layers 16-21)."""

    def __init__(self, spec: GelanSpec, in_channels: tuple[int, int, int]) -> None:
        super().__init__()
        down = AConv if spec.down == "aconv" else ADown
        c3, c4, c5 = in_channels
        d16, d19 = spec.head_downs
        e18, e21 = spec.head[2], spec.head[3]
        self.down_p4, self.elan_p4 = down(c3, d16), _elan(d16 + c4, e18)
        self.down_p5, self.elan_p5 = down(e18[0], d19), _elan(d19 + c5, e21)
        self.out_channels = (c3, e18[0], e21[0])

    def forward(self, feats: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t3, t4, t5 = feats
        o4 = self.elan_p4(torch.cat((self.down_p4(t3), t4), 1))
        return t3, o4, self.elan_p5(torch.cat((self.down_p5(o4), t5), 1))


class Detector(nn.Module):
    """A GELAN detector, optionally with YOLOv9's auxiliary branch and second head (training only).

    ``forward`` in training mode returns the per-level maps ``[B, 4*reg_max + nc, H, W]`` of the
    main head, or ``(main_levels, aux_levels)`` when the auxiliary branch is present; in eval mode
    it returns ``[B, 4 + nc, A]`` (xyxy boxes in input pixels, class probabilities) of the main
    head only, and the auxiliary branch is not computed.
    """

    def __init__(self, name: str, spec: GelanSpec, nc: int, aux: bool, reg_max: int = 16,
                 box_groups: int = 4) -> None:
        super().__init__()
        self.name, self.nc, self.reg_max = name, nc, reg_max
        self.register_buffer("stride", torch.tensor(STRIDES, dtype=torch.float32), persistent=False)
        self.backbone = Backbone(spec)
        self.top_down = TopDown(spec, self.backbone.out_channels)
        self.bottom_up = BottomUp(spec, self.top_down.out_channels)
        self.head = DDetect(nc, self.bottom_up.out_channels, STRIDES, reg_max, box_groups)
        self.aux_branch: TopDown | None = None
        self.aux_head: DDetect | None = None
        if aux:
            self.aux_branch = TopDown(spec, self.backbone.out_channels)
            self.aux_head = DDetect(nc, self.aux_branch.out_channels, STRIDES, reg_max)

    @property
    def has_aux(self) -> bool:
        return self.aux_head is not None

    def forward(self, x: torch.Tensor):
        feats = self.backbone(x)
        main = self.head(list(self.bottom_up(self.top_down(feats))))
        if not self.training:
            return self.head.decode(main)
        if self.aux_branch is None or self.aux_head is None:
            return main
        return main, self.aux_head(list(self.aux_branch(feats)))


def build_model(name: str, nc: int) -> Detector:
    """The detector called ``name`` (one of :data:`MODEL_NAMES`) for ``nc`` classes, in training form."""
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    if not isinstance(nc, int) or nc < 1:
        raise ModelError(f"the number of classes must be a positive integer, got {nc!r} (model {name!r})")
    spec, aux, box_groups = MODELS[name]
    return Detector(name, spec, nc, aux, box_groups=box_groups)


def fuse_for_inference(model: nn.Module) -> nn.Module:
    """A fused copy of ``model`` for inference, in eval mode; ``model`` itself is left untouched.

    The auxiliary branch and head are removed, every RepConvN is re-parameterised into one 3x3
    conv, and every Conv+BatchNorm is folded into one biased conv (using the running statistics).
    """
    fused = copy.deepcopy(getattr(model, "module", model)).eval()
    if isinstance(fused, Detector):
        fused.aux_branch = None
        fused.aux_head = None
    with torch.no_grad():
        for m in list(fused.modules()):
            if isinstance(m, (RepConvN, Conv)):
                m.fuse()
    return fused
