"""Component oracles: detscale's pieces against the reference trainer's (Ultralytics 8.4) on identical inputs.

Ultralytics (AGPL-3.0) is a test-only dependency here (the package never imports it); the
version is pinned in pyproject.toml because these tests compare against its exact behaviour.
Where detscale deliberately differs, the test says so and docs/parity.md gives the measured
effect.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_VERBOSE", "False")

# Importing Ultralytics monkey-patches PIL.Image.open and torch.save for the whole process; put
# them back, so that the other tests of this session run against the libraries, not the patches.
import PIL.Image  # noqa: E402

_UNPATCHED = (PIL.Image.open, torch.save)
from ultralytics.utils import loss as uloss  # noqa: E402
from ultralytics.utils import metrics as umetrics  # noqa: E402
from ultralytics.utils import tal  # noqa: E402

PIL.Image.open, torch.save = _UNPATCHED

from detscale.loss import DetectionLoss, TaskAlignedAssigner, pad_targets  # noqa: E402
from detscale.model.boxes import bbox2dist, bbox_ciou, dist2bbox, make_anchors  # noqa: E402

NC, REG_MAX, STRIDES, IMGSZ = 6, 16, (8.0, 16.0, 32.0), 128


def _levels(batch: int, seed: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Per-level raw head maps [B, 4*reg_max + nc, H, W]: random logits, as an untrained head gives."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 4 * REG_MAX + NC, IMGSZ // int(s), IMGSZ // int(s), generator=g, dtype=dtype) * 2
            for s in STRIDES]


def _targets(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(batch_idx, cls, cx, cy, w, h) normalised: large, small (< 16 px), overlapping and edge boxes; image 2 empty."""
    rows = [
        [0, 1, 0.50, 0.50, 0.60, 0.40],
        [0, 2, 0.55, 0.45, 0.30, 0.50],  # overlaps the first: anchors claimed twice
        [0, 3, 0.10, 0.12, 0.06, 0.05],  # 8 x 6 px: smaller than the middle stride
        [0, 0, 0.90, 0.85, 0.18, 0.25],
        [1, 5, 0.30, 0.70, 0.08, 0.30],  # thin
        [1, 4, 0.70, 0.30, 0.45, 0.45],
    ]
    return torch.tensor(rows, dtype=dtype)


def _decode(levels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    bsz = levels[0].shape[0]
    flat = torch.cat([x.view(bsz, 4 * REG_MAX + NC, -1) for x in levels], 2)
    dist, logits = flat.split((4 * REG_MAX, NC), 1)
    points, stride = make_anchors([tuple(x.shape[2:]) for x in levels], list(STRIDES), flat.device, flat.dtype)
    bins = torch.arange(REG_MAX, dtype=flat.dtype)
    ltrb = dist.transpose(1, 2).reshape(bsz, -1, 4, REG_MAX).softmax(-1) @ bins
    return dist2bbox(ltrb, points) * stride, logits.transpose(1, 2).sigmoid(), points, stride


def _ultralytics_assign(pd_scores, pd_boxes, points, stride, targets, bsz):
    assigner = tal.TaskAlignedAssigner(topk=10, num_classes=NC, alpha=0.5, beta=6.0, stride=list(STRIDES))
    labels, boxes, mask = pad_targets(targets, bsz, (IMGSZ, IMGSZ))
    gt_labels = labels[..., None].to(pd_scores.dtype)
    gt_boxes = boxes * mask[..., None]
    return assigner(pd_scores, pd_boxes, points * stride, gt_labels, gt_boxes, mask[..., None].to(pd_scores.dtype))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_assigner_matches_ultralytics(seed: int) -> None:
    levels = _levels(3, seed)
    pd_boxes, pd_scores, points, stride = _decode(levels)
    targets = _targets()
    _, u_boxes, u_scores, u_fg, _ = _ultralytics_assign(pd_scores, pd_boxes, points, stride, targets, 3)
    labels, boxes, mask = pad_targets(targets, 3, (IMGSZ, IMGSZ))
    ours = TaskAlignedAssigner(NC, topk=10, alpha=0.5, beta=6.0, min_side=STRIDES[1])(
        pd_scores, pd_boxes, points * stride, labels, boxes, mask)
    assert torch.equal(ours.fg_mask, u_fg)
    assert ours.fg_mask.sum() > 20  # a real assignment, with anchors claimed by two boxes
    assert torch.allclose(ours.boxes[ours.fg_mask], u_boxes[u_fg].to(ours.boxes.dtype))
    assert torch.allclose(ours.scores, u_scores.to(ours.scores.dtype), atol=1e-12)
    assert not ours.fg_mask[2].any()  # the image without objects has no positives


def test_small_boxes_get_candidates_like_the_reference() -> None:
    """A box smaller than the middle stride is enlarged to it for the centre test (Ultralytics 8.4)."""
    levels = _levels(1, 3)
    _, pd_scores, points, stride = _decode(levels)
    tiny = torch.tensor([[0, 2, 0.328, 0.41, 0.03, 0.03]], dtype=torch.float64)  # 4 x 4 px, between anchor centres
    labels, boxes, mask = pad_targets(tiny, 1, (IMGSZ, IMGSZ))
    pd_boxes = (boxes[:, :1] + torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64)).expand(1, len(points), 4)
    with_floor = TaskAlignedAssigner(NC, min_side=16.0)(pd_scores, pd_boxes, points * stride, labels, boxes, mask)
    without = TaskAlignedAssigner(NC, min_side=0.0)(pd_scores, pd_boxes, points * stride, labels, boxes, mask)
    assert without.fg_mask.sum() == 0 and with_floor.fg_mask.sum() > 0


def _ultralytics_loss_fn(box: float, cls: float, dfl: float) -> uloss.v8DetectionLoss:
    detect = SimpleNamespace(stride=torch.tensor(STRIDES), nc=NC, reg_max=REG_MAX)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.anchor = nn.Parameter(torch.zeros(1, dtype=torch.float64))
            self.args = SimpleNamespace(box=box, cls=cls, dfl=dfl)
            self.model = [detect]

    return uloss.v8DetectionLoss(Model())


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_value_and_gradient_match_ultralytics(seed: int) -> None:
    targets = _targets()
    ours_levels = [x.clone().requires_grad_(True) for x in _levels(3, seed)]
    ref_levels = [x.clone().requires_grad_(True) for x in _levels(3, seed)]

    model = SimpleNamespace(nc=NC, reg_max=REG_MAX, stride=torch.tensor(STRIDES))
    loss, items = DetectionLoss(model, 7.5, 0.5, 1.5)(ours_levels, targets)
    loss.backward()

    bsz = 3
    flat = torch.cat([x.view(bsz, 4 * REG_MAX + NC, -1) for x in ref_levels], 2)
    preds = {"boxes": flat[:, : 4 * REG_MAX], "scores": flat[:, 4 * REG_MAX:], "feats": ref_levels}
    ref_targets = targets.float()  # the reference pads targets into float32 (its preprocess)
    batch = {"batch_idx": ref_targets[:, 0], "cls": ref_targets[:, 1:2], "bboxes": ref_targets[:, 2:]}
    ref_loss, _ = _ultralytics_loss_fn(7.5, 0.5, 1.5)(preds, batch)
    ref_loss.sum().backward()

    assert items.tolist() == pytest.approx((ref_loss / bsz).tolist(), rel=1e-5)
    assert float(loss) == pytest.approx(float(ref_loss.sum()), rel=1e-5)
    for ours_grad, ref_grad in zip((x.grad for x in ours_levels), (x.grad for x in ref_levels), strict=True):
        scale = ref_grad.abs().max()
        assert (ours_grad - ref_grad).abs().max() <= 1e-5 * scale


def test_box_decoding_anchors_ciou_and_dfl_targets_match() -> None:
    levels = _levels(2, 4)
    points, stride = make_anchors([tuple(x.shape[2:]) for x in levels], list(STRIDES), torch.device("cpu"),
                                  torch.float64)
    u_points, u_stride = tal.make_anchors(levels, torch.tensor(STRIDES), 0.5)
    assert torch.equal(points, u_points) and torch.equal(stride, u_stride)

    g = torch.Generator().manual_seed(5)
    ltrb = torch.rand(2, len(points), 4, generator=g, dtype=torch.float64) * 10
    assert torch.allclose(dist2bbox(ltrb, points), tal.dist2bbox(ltrb, points, xywh=False))

    a = torch.rand(500, 4, generator=g, dtype=torch.float64) * 50
    b = torch.rand(500, 4, generator=g, dtype=torch.float64) * 50
    a[:, 2:] += a[:, :2]
    b[:, 2:] += b[:, :2]
    assert torch.allclose(bbox_ciou(a, b), umetrics.bbox_iou(a, b, xywh=False, CIoU=True), atol=1e-6)

    boxes = dist2bbox(ltrb, points)
    assert torch.allclose(bbox2dist(points, boxes, REG_MAX - 1), tal.bbox2dist(points, boxes, REG_MAX - 1))


def test_dfl_matches_ultralytics() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(40, REG_MAX, generator=g, dtype=torch.float64)
    target = torch.rand(10, 4, generator=g, dtype=torch.float64) * (REG_MAX - 1.01)
    ours = DetectionLoss._dfl(logits, target.view(-1)).view(-1, 4).mean(-1, keepdim=True)
    ref = uloss.DFLoss(REG_MAX)(logits, target.clone())
    assert torch.allclose(ours, ref)


def test_batchnorm_and_head_bias_initialisation_match_yolov9() -> None:
    from ultralytics.nn.tasks import DetectionModel

    from detscale.model import build_model

    ours = build_model("gelan-t", NC)
    ref = DetectionModel("yolov9t.yaml", nc=NC, verbose=False)
    for model in (ours, ref):
        bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        assert bns and all(m.eps == 1e-3 and m.momentum == 0.03 for m in bns)
    ref_head = ref.model[-1]
    for level, s in enumerate(STRIDES):
        prior = math.log(5 / NC / (640 / s) ** 2)
        assert torch.allclose(ours.head.cls[level][-1].bias, torch.full((NC,), prior))
        assert torch.allclose(ref_head.cv3[level][-1].bias, torch.full((NC,), prior))
        # YOLOv9 starts the box logits at 1.0, Ultralytics 8.4 at 2.0: a constant over the bins of every side,
        # which the DFL softmax does not see (the initial distributions are the same).
        assert torch.all(ours.head.box[level][-1].bias == 1.0) and torch.all(ref_head.cv2[level][-1].bias == 2.0)
        logits = torch.randn(4, REG_MAX)
        assert torch.allclose((logits + 1.0).softmax(-1), (logits + 2.0).softmax(-1))


def test_ema_decay_per_update_matches() -> None:
    from ultralytics.utils.torch_utils import ModelEMA as RefEMA

    from detscale.engine.ema import ModelEMA

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ours, ref = ModelEMA(net, 0.9999, 2000), RefEMA(net, decay=0.9999, tau=2000)
    for updates in (1, 10, 100, 2000, 20000):
        assert ours.decay(updates) == pytest.approx(ref.decay(updates), rel=1e-12)
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        ours.update(net)
        ref.update(net)
    for name, value in ours.state_dict().items():
        assert torch.allclose(value.float(), ref.ema.state_dict()[name].float(), atol=1e-6), name


def test_parameter_groups_match() -> None:
    from ultralytics.nn.tasks import DetectionModel

    from detscale.engine.optim import split_parameters

    model = DetectionModel("yolov9t.yaml", nc=NC, verbose=False)
    groups = split_parameters(model)
    # Ultralytics also lists frozen parameters (the DFL's fixed projection); an optimiser skips them (no gradient)
    # Ultralytics' build_optimizer rule: 'bias' in the name -> g[2]; a norm layer's weight -> g[1]; else g[0]
    ref: dict[str, list] = {"weight": [], "norm_weight": [], "bias": []}
    norms = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            full = f"{module_name}.{param_name}" if module_name else param_name
            key = "bias" if "bias" in full else "norm_weight" if isinstance(module, norms) else "weight"
            ref[key].append(param)
    for key in ref:
        assert [id(p) for p in groups[key]] == [id(p) for p in ref[key]], key


def test_warmup_schedule_per_iteration_matches() -> None:
    """lr and momentum per iteration against Ultralytics 8.4's formulas (trainer._do_train), accumulate included."""
    from detscale.engine.optim import (
        apply_warmup,
        build_optimizer,
        lr_factor,
        warmup_accumulate,
        warmup_iterations,
    )

    nb, epochs, warmup_epochs, lr0, lrf, nominal, batch = 25, 20, 3.0, 0.001, 0.01, 64, 16
    acc0 = max(round(nominal / batch), 1)
    nw = warmup_iterations(warmup_epochs, nb, epochs)
    assert nw == round(min(warmup_epochs, max(epochs - 1, 0)) * nb)  # Ultralytics _get_warmup_iterations
    lf = lr_factor("linear", epochs, lrf)
    for name, mom, wmom, wbias in (("sgd", 0.937, 0.8, 0.1), ("adamw", 0.9, 0.8, 0.0)):
        opt = build_optimizer(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), name, lr0, mom, 5e-4)
        for g in opt.param_groups:
            g["initial_lr"] = lr0
        for ni in (0, 1, 17, 40, nw - 1, nw):
            epoch = ni // nb
            apply_warmup(opt, ni, nw, lf(epoch), wbias, wmom, mom)
            for g in opt.param_groups:
                start = wbias if g["name"] == "bias" else 0.0
                assert g["lr"] == pytest.approx(float(np.interp(ni, [0, nw], [start, lr0 * lf(epoch)])))
                if name == "sgd":
                    assert g["momentum"] == pytest.approx(float(np.interp(ni, [0, nw], [wmom, mom])))
                else:  # Ultralytics warms only an SGD momentum: AdamW's beta1 stays
                    assert g["betas"][0] == mom
            assert warmup_accumulate(ni, nw, acc0) == max(1, int(np.interp(ni, [0, nw], [1, acc0]).round()))


class _Draws:
    """An ``rng`` whose ``uniform`` returns prepared values, to feed both implementations the same draws."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def uniform(self, *_args: object) -> float:
        return self.values.pop(0)


def _scene(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    img = g.integers(0, 255, (96, 128, 3), dtype=np.uint8)
    boxes = np.array([[10, 12, 60, 50], [70, 5, 126, 40], [0, 60, 20, 95], [40, 40, 44, 90]], np.float32)
    return img, boxes, np.array([0, 1, 2, 3], np.float32)


@pytest.mark.parametrize(("s", "tx", "ty"), [(1.3, 70.0, 60.0), (0.6, 40.0, 75.0), (1.0, 64.0, 64.0)])
def test_random_affine_moves_pixels_and_boxes_like_the_reference(s: float, tx: float, ty: float) -> None:
    from ultralytics.data.augment import RandomPerspective
    from ultralytics.utils.instance import Instances

    from detscale.data import augment as aug

    img, boxes, cls = _scene(0)
    out, out_boxes, out_cls = aug.random_affine(img, boxes, cls, 128, 0.5, 0.1, _Draws(s, tx / 128, ty / 128))

    h, w = img.shape[:2]
    centre, scale, shift = np.eye(3), np.eye(3), np.eye(3)
    centre[:2, 2] = -w / 2, -h / 2
    scale[:2, :2] *= s
    shift[:2, 2] = tx, ty
    m = shift @ scale @ centre  # the reference's T @ S @ R @ P @ C without shear, rotation, perspective
    rp = RandomPerspective(degrees=0, translate=0.1, scale=0.5, shear=0, perspective=0)
    params = {"M": m, "scale": s, "orig_shape": (h, w), "size": (128, 128)}
    labels = {"img": img.copy(), "cls": cls[:, None].copy(),
              "instances": Instances(boxes.copy(), np.zeros((0, 1000, 2), np.float32), bbox_format="xyxy",
                                     normalized=False)}
    labels = rp.apply_instances(rp.apply_image(labels, params), params)
    assert np.array_equal(out, labels["img"])
    assert np.allclose(out_boxes, labels["instances"].bboxes, atol=1e-4)
    assert np.array_equal(out_cls, labels["cls"][:, 0])


def test_box_filter_matches_the_reference() -> None:
    from ultralytics.data.augment import RandomPerspective

    from detscale.data import augment as aug

    g = np.random.default_rng(7)
    before = g.uniform(0, 100, (400, 4)).astype(np.float32)
    before[:, 2:] = before[:, :2] + g.uniform(0.5, 60, (400, 2))
    after = before.copy()
    after[:, 2:] -= g.uniform(0, 60, (400, 2)) * (g.random((400, 1)) < 0.5)  # clipped, some to slivers
    ours = aug.box_candidates(before, after)
    ref = RandomPerspective.box_candidates(before.T, after.T)
    assert np.array_equal(ours, ref) and 0 < ours.sum() < len(ours)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hsv_jitter_matches_the_reference(seed: int) -> None:
    from ultralytics.data.augment import RandomHSV

    from detscale.data import augment as aug

    img, _, _ = _scene(seed)
    img[:8, :8] = 128  # grey: saturation 0 stays 0
    np.random.seed(seed)
    ours = aug.hsv_jitter(img, 0.015, 0.7, 0.4, np.random)  # the module: the same global draws as the reference
    np.random.seed(seed)
    ref = RandomHSV(0.015, 0.7, 0.4).apply_image({"img": np.ascontiguousarray(img[..., ::-1])})["img"][..., ::-1]
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("size", ["t", "s"])
def test_detect_variants_compute_what_ultralytics_yolov9_computes(size: str) -> None:
    """gelan-{t,s}-detect with Ultralytics' yolov9{t,s}.yaml weights copied in, in order: the same outputs."""
    from ultralytics.nn.tasks import DetectionModel

    from detscale.model import build_model

    torch.manual_seed(0)
    ref = DetectionModel(f"yolov9{size}.yaml", nc=NC, verbose=False)
    ours = build_model(f"gelan-{size}-detect", NC)
    with torch.no_grad():
        for m in ref.modules():  # non-trivial statistics, so that no layer is an identity
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    ref_state = {k: v for k, v in ref.state_dict().items() if ".dfl." not in k}
    our_state = {k: v for k, v in ours.state_dict().items() if ".dfl." not in k}
    assert [tuple(v.shape) for v in ref_state.values()] == [tuple(v.shape) for v in our_state.values()]
    ours.load_state_dict(dict(zip(our_state, ref_state.values(), strict=True)), strict=False)
    x = torch.rand(2, 3, 128, 128)
    ref.eval()
    ours.eval()
    with torch.no_grad():
        ref_out = ref(x)[0]  # [B, 4 + nc, A]: boxes xywh, class probabilities
        our_out = ours(x)  # [B, 4 + nc, A]: boxes xyxy, class probabilities
        ref_xyxy = torch.cat((ref_out[:, :2] - ref_out[:, 2:4] / 2, ref_out[:, :2] + ref_out[:, 2:4] / 2), 1)
        assert torch.allclose(our_out[:, :4], ref_xyxy, atol=1e-3)
        assert torch.allclose(our_out[:, 4:], ref_out[:, 4:], atol=1e-5)
        ref.train()
        ours.train()
        for m in list(ref.modules()) + list(ours.modules()):
            if isinstance(m, nn.BatchNorm2d):
                m.eval()  # running statistics: a deterministic comparison of the training-mode maps
        ref_train, our_maps = ref(x), ours(x)
    flat = torch.cat([m.view(2, 4 * REG_MAX + NC, -1) for m in our_maps], 2)
    assert torch.allclose(flat[:, : 4 * REG_MAX], ref_train["boxes"], atol=1e-4)
    assert torch.allclose(flat[:, 4 * REG_MAX:], ref_train["scores"], atol=1e-4)


def test_initial_weights_are_drawn_from_the_reference_distribution() -> None:
    """Each trainer draws its own initial weights; the draws must come from one distribution, or "each
    trainer's own initialisation" would be a difference between the trainers, not a random draw.
    Per tensor (by position; the layers are equal) a two-sample KS test of detscale's draw against
    Ultralytics', Holm-corrected over the tensors; constant tensors (BatchNorm, head biases) equal
    up to the box-bias constant the DFL softmax does not see (test above)."""
    from scipy import stats
    from ultralytics.nn.tasks import DetectionModel

    from detscale.model import build_model

    torch.manual_seed(11)
    ours = build_model("gelan-t-detect", NC)
    torch.manual_seed(12)
    ref = DetectionModel("yolov9t.yaml", nc=NC, verbose=False)
    pairs = [(k, a.flatten().double().numpy(), b.flatten().double().numpy())
             for (k, a), b in zip(((k, v) for k, v in ours.state_dict().items() if ".dfl." not in k),
                                  (v for k, v in ref.state_dict().items() if ".dfl." not in k), strict=True)
             if a.dtype.is_floating_point]
    random_ones = [(k, a, b) for k, a, b in pairs if a.std() > 0 or b.std() > 0]
    box_bias = {f"head.box.{level}.2.bias" for level in range(3)}  # 1.0 vs 2.0, see the test above
    for k, a, b in pairs:
        if a.std() == 0 and b.std() == 0 and k not in box_bias:
            assert np.array_equal(a, b), k  # BatchNorm weights, biases, running statistics; class-bias priors
    p = sorted(stats.ks_2samp(a, b).pvalue for _, a, b in random_ones)
    m = len(p)
    assert m > 100
    assert all(pi > 0.05 / (m - i) for i, pi in enumerate(p)), p[:5]  # Holm at 5 %: no tensor differs
    assert sum(a.size for _, a, _ in random_ones) > 1_000_000


def test_validation_keeps_the_images_the_reference_trains_on(tmp_path) -> None:
    """The clean view ('quarantine') holds exactly the training images Ultralytics 8.4 accepts: a
    stricter validator trains on fewer images per epoch than the reference, a looser one on more.
    Border cases: edges beyond the image (kept, clipped), values within and beyond the reference's
    [-0.01, 1.01], a box wholly outside (kept, the box left out), repeated lines, bad classes."""
    from pathlib import Path

    import cv2
    import yaml
    from ultralytics.cfg import get_cfg
    from ultralytics.data.build import build_yolo_dataset
    from ultralytics.data.utils import check_det_dataset

    from detscale.data.validate import validate

    cases = {
        "inside": "0 0.5 0.5 0.2 0.2", "edge_beyond": "0 0.95 0.5 0.2 0.2", "centre_just_out": "1 1.005 0.5 0.2 0.2",
        "centre_out": "1 1.02 0.5 0.2 0.2", "top_just_out": "0 0.5 -0.005 0.1 0.1", "top_out": "0 0.5 -0.02 0.1 0.1",
        "too_wide": "0 0.5 0.5 1.02 0.2", "wholly_outside": "0 1.005 0.5 0.008 0.1",
        "repeated": "0 0.5 0.5 0.2 0.2\n" * 2,
        "class_out": "5 0.5 0.5 0.2 0.2", "class_float": "0.5 0.5 0.5 0.2 0.2", "six_columns": "0 0.5 0.5 0.2 0.2 0.1",
        "empty": "", "mixed": "0 0.3 0.3 0.1 0.1\n1 0.5 1.5 0.1 0.1",
    }
    root = tmp_path / "data"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
    for i, (name, text) in enumerate(cases.items()):
        img = np.random.default_rng(i).integers(0, 255, (40, 48, 3), dtype=np.uint8)
        cv2.imwrite(str(root / "images" / "train" / f"{name}.png"), img)
        (root / "labels" / "train" / f"{name}.txt").write_text(text + "\n" if text else "")
    cv2.imwrite(str(root / "images" / "val" / "v.png"), np.zeros((40, 48, 3), np.uint8))
    (root / "labels" / "val" / "v.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    spec = {"path": str(root), "train": "images/train", "val": "images/val", "names": ["a", "b", "c"]}
    (root / "data.yaml").write_text(yaml.safe_dump(spec))

    validate(root / "data.yaml", tmp_path / "out", policy="quarantine", workers=1)
    ours = {Path(p).stem for p in (tmp_path / "out" / "clean" / "train.txt").read_text().split()}
    data = check_det_dataset(str(root / "data.yaml"))
    ref = build_yolo_dataset(get_cfg(overrides={"imgsz": 64, "task": "detect"}), data["train"], 4, data,
                             mode="train", stride=32)
    theirs = {Path(p).stem for p in ref.im_files}
    assert ours == theirs
    assert {"inside", "edge_beyond", "wholly_outside", "repeated", "empty"} <= ours
    assert not {"centre_out", "top_out", "too_wide", "class_out", "six_columns", "mixed"} & ours
