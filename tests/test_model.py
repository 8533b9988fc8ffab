"""The model family: block shapes, model outputs, published sizes, fusion, and an overfitting run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from detscale.loss import DetectionLoss
from detscale.model import MODEL_NAMES, ModelError, build_model, fuse_for_inference, postprocess
from detscale.model.blocks import (
    DFL,
    ELAN1,
    SPPELAN,
    AConv,
    ADown,
    Conv,
    RepConvN,
    RepNBottleneck,
    RepNCSP,
    RepNCSPELAN4,
)
from detscale.model.info import count_gflops, count_params, model_info

# Reference sizes of the facts sheet (nc=80, 640 px): (train params, train GFLOPs, fused params, fused GFLOPs)
REFERENCE = {
    "gelan-t": (2.44e6, 10.1, None, None),
    "gelan-s": (7.23e6, 27.0, 7.106e6, 26.4),
    "gelan-m": (20.1e6, 77.4, None, None),
    "gelan-c": (25.5e6, 103.5, 25.29e6, 102.1),
    "yolov9-t": (3.72e6, 16.5, None, None),
    "yolov9-s": (9.81e6, 39.9, None, None),
    # Ultralytics' own count (8.4.190, get_num_params / get_flops) of yolov9{t,s,c}.yaml, training and fused
    "gelan-t-detect": (2.1287e6, 8.48, 2.094e6, 8.23),
    "gelan-s-detect": (7.3184e6, 27.55, 7.198e6, 26.9),
    "gelan-c-detect": (25.591e6, 104.01, 25.381e6, 102.65),
}


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)
    torch.manual_seed(0)


@pytest.mark.parametrize(
    ("block", "c_in", "shape_out"),
    [
        (Conv(8, 16, 3, 2), 8, (2, 16, 8, 8)),
        (AConv(8, 16), 8, (2, 16, 8, 8)),
        (ADown(8, 16), 8, (2, 16, 8, 8)),
        (RepConvN(8, 12), 8, (2, 12, 16, 16)),
        (RepNBottleneck(8, 8), 8, (2, 8, 16, 16)),
        (RepNCSP(8, 12, 2), 8, (2, 12, 16, 16)),
        (ELAN1(8, 20, 16, 8), 8, (2, 20, 16, 16)),
        (RepNCSPELAN4(8, 24, 16, 8, 1), 8, (2, 24, 16, 16)),
        (SPPELAN(8, 20, 4), 8, (2, 20, 16, 16)),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else None,
)
def test_block_output_shapes(block: nn.Module, c_in: int, shape_out: tuple[int, ...]):
    assert block(torch.randn(2, c_in, 16, 16)).shape == shape_out


def test_dfl_is_the_expectation_over_bins():
    logits = torch.full((1, 64, 3), -1e4)
    for side, b in enumerate((0, 5, 15, 7)):
        logits[0, side * 16 + b] = 0.0  # one-hot distribution at bin b
    dist = DFL(16)(logits)
    assert torch.allclose(dist[0, :, 0], torch.tensor([0.0, 5.0, 15.0, 7.0]))
    assert not any(p.requires_grad for p in DFL(16).parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_output_shapes(name: str):
    model = build_model(name, nc=3)
    x = torch.randn(2, 3, 64, 96)
    out = model.train()(x)
    dual = name.startswith("yolov9")
    heads = out if dual else (out,)
    assert len(heads) == (2 if dual else 1)
    for levels in heads:
        assert [tuple(t.shape) for t in levels] == [(2, 64 + 3, 64 // s, 96 // s) for s in (8, 16, 32)]
    n_anchors = sum((64 // s) * (96 // s) for s in (8, 16, 32))
    with torch.no_grad():
        decoded = model.eval()(x)
    assert decoded.shape == (2, 4 + 3, n_anchors)
    assert ((decoded[:, 4:] >= 0) & (decoded[:, 4:] <= 1)).all()
    assert (decoded[:, 2] >= decoded[:, 0]).all() and (decoded[:, 3] >= decoded[:, 1]).all()
    assert model.stride.tolist() == [8, 16, 32] and model.nc == 3 and model.reg_max == 16


def test_unknown_model_name_is_a_user_error():
    with pytest.raises(ModelError, match="gelan-t"):
        build_model("gelan-x", 80)
    with pytest.raises(ModelError, match="classes"):
        build_model("gelan-t", 0)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_parameter_counts_match_reference(name: str):
    ref_train, _, ref_fused, _ = REFERENCE[name]
    model = build_model(name, nc=80)
    assert count_params(model) == pytest.approx(ref_train, rel=0.01)
    if ref_fused is not None:
        assert count_params(fuse_for_inference(model)) == pytest.approx(ref_fused, rel=0.01)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_gflops_match_reference(name: str):
    ref_train, ref_gflops, ref_fused, ref_fused_gflops = REFERENCE[name]
    info = model_info(name, imgsz=640, nc=80)
    assert info["train"]["gflops"] == pytest.approx(ref_gflops, rel=0.03)
    if ref_fused_gflops is not None:
        assert info["fused"]["gflops"] == pytest.approx(ref_fused_gflops, rel=0.03)
    # the inference form never costs more than the training form
    assert info["fused"]["gflops"] <= info["train"]["gflops"]
    assert info["fused"]["params"] < info["train"]["params"]


def test_gflops_scale_with_area():
    model = build_model("gelan-t", nc=80)
    assert count_gflops(model, 640, train=True) == pytest.approx(4 * count_gflops(model, 320, train=True), rel=1e-3)


def _randomise_batchnorm(model: nn.Module, gen: torch.Generator) -> None:
    """Non-trivial BN statistics and affine parameters, so fusion has something to fold."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(n, generator=gen) * 0.1)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fused_model_equals_unfused(name: str):
    gen = torch.Generator().manual_seed(1)
    model = build_model(name, nc=5)
    with torch.no_grad():
        _randomise_batchnorm(model, gen)
    model.eval()
    fused = fuse_for_inference(model)
    x = torch.rand(2, 3, 64, 64, generator=gen)
    with torch.no_grad():
        expected, got = model(x), fused(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4
    assert not any(isinstance(m, nn.BatchNorm2d) for m in fused.modules())
    assert all(m.fused is not None and not hasattr(m, "conv2") for m in fused.modules() if isinstance(m, RepConvN))
    assert fused.aux_branch is None and fused.aux_head is None
    # the original keeps its training form
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert model.has_aux == name.startswith("yolov9")


# ---------------------------------------------------------------------------------------------
# Overfitting: the model, the loss and post-processing learn together.
# ---------------------------------------------------------------------------------------------

COLOURS = ((230, 40, 40), (40, 200, 40), (40, 80, 230))


def synthetic_shapes(n: int = 8, size: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` grey images with 1-3 filled shapes (class = colour); targets [N, 6] normalised cxcywh."""
    import cv2

    rng = np.random.default_rng(seed)
    images, targets = [], []
    for i in range(n):
        img = np.full((size, size, 3), 110, np.uint8)
        for _ in range(int(rng.integers(1, 4))):
            cls = int(rng.integers(3))
            w, h = (int(v) for v in rng.integers(20, 50, 2))
            x1, y1 = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
            if cls == 1:
                cv2.ellipse(img, (x1 + w // 2, y1 + h // 2), (w // 2, h // 2), 0, 0, 360, COLOURS[cls], -1)
            else:
                cv2.rectangle(img, (x1, y1), (x1 + w - 1, y1 + h - 1), COLOURS[cls], -1)
            targets.append([i, cls, (x1 + w / 2) / size, (y1 + h / 2) / size, w / size, h / size])
        images.append(img)
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    return x, torch.tensor(targets, dtype=torch.float32)


def recall_at_50(dets: list[torch.Tensor], targets: torch.Tensor, size: int) -> float:
    """Share of ground-truth boxes matched by a detection of the same class with IoU >= 0.5."""
    hits = 0
    for i, d in enumerate(dets):
        gt = targets[targets[:, 0] == i]
        boxes = torchvision.ops.box_convert(gt[:, 2:] * size, "cxcywh", "xyxy")
        for box, cls in zip(boxes, gt[:, 1], strict=True):
            same = d[d[:, 5] == cls]
            hits += int(len(same) > 0 and torchvision.ops.box_iou(box[None], same[:, :4]).max() >= 0.5)
    return hits / len(targets)


@pytest.mark.slow
def test_gelan_t_overfits_eight_images():
    torch.manual_seed(0)
    x, targets = synthetic_shapes()
    model = build_model("gelan-t", nc=3).train()
    criterion = DetectionLoss(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=OVERFIT_LR, weight_decay=0.0)
    for _ in range(OVERFIT_STEPS):
        loss, _ = criterion(model(x), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss)
    model.eval()
    with torch.no_grad():
        dets = postprocess(model(x), conf=0.25, iou=0.7, max_det=100)
    assert recall_at_50(dets, targets, 128) >= 0.8


OVERFIT_LR = 5e-3
OVERFIT_STEPS = 240  # recall reaches 0.94 at 180 steps and 1.0 from 220 (seed 0)
