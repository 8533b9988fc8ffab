"""Post-processing: threshold, class-aware NMS, per-image cap, and the letterbox undone."""

from __future__ import annotations

import pytest
import torch

from detscale.model import build_model, postprocess, scale_boxes


def make_preds(per_image: list[list[tuple[float, float, float, float, int, float]]], nc: int = 3) -> torch.Tensor:
    """``[B, 4 + nc, A]`` from lists of (x1, y1, x2, y2, cls, score); padded with empty anchors."""
    n_anchors = max(len(p) for p in per_image) + 2
    preds = torch.zeros(len(per_image), 4 + nc, n_anchors)
    for b, boxes in enumerate(per_image):
        for a, (x1, y1, x2, y2, cls, score) in enumerate(boxes):
            preds[b, :4, a] = torch.tensor([x1, y1, x2, y2])
            preds[b, 4 + cls, a] = score
    return preds


def test_overlapping_boxes_of_one_class_are_suppressed():
    preds = make_preds([[(10, 10, 50, 50, 0, 0.9), (12, 12, 52, 52, 0, 0.8), (100, 100, 120, 120, 0, 0.7)]])
    (dets,) = postprocess(preds, conf=0.25, iou=0.5, max_det=10)
    assert dets.shape == (2, 6)
    assert dets[:, 4].tolist() == pytest.approx([0.9, 0.7])
    assert dets[0, :4].tolist() == [10, 10, 50, 50]


def test_nms_is_class_aware_and_per_image():
    same_box_two_classes = [(10, 10, 50, 50, 0, 0.9), (10, 10, 50, 50, 1, 0.8)]
    preds = make_preds([same_box_two_classes, [(10, 10, 50, 50, 0, 0.6)]])
    first, second = postprocess(preds, conf=0.25, iou=0.5, max_det=10)
    assert sorted(first[:, 5].tolist()) == [0.0, 1.0]
    # the identical box in another image is not suppressed by the first image's boxes
    assert second.shape == (1, 6) and second[0, 4].item() == pytest.approx(0.6)


def test_confidence_threshold_and_empty_images():
    preds = make_preds([[(0, 0, 10, 10, 2, 0.2)], [(0, 0, 10, 10, 2, 0.3)]])
    first, second = postprocess(preds, conf=0.25, iou=0.5, max_det=10)
    assert first.shape == (0, 6)
    assert second.shape == (1, 6) and second[0, 5].item() == 2


def test_max_det_keeps_the_highest_scores_of_every_image():
    boxes = [(i * 20, 0, i * 20 + 10, 10, 0, 0.3 + 0.05 * i) for i in range(8)]
    preds = make_preds([boxes, boxes[:2]])
    first, second = postprocess(preds, conf=0.25, iou=0.5, max_det=3)
    assert first[:, 4].tolist() == pytest.approx([0.65, 0.6, 0.55])
    assert len(second) == 2


def test_multi_label_keeps_every_class_above_threshold():
    preds = make_preds([[(10, 10, 50, 50, 0, 0.9)]])
    preds[0, 4 + 1, 0] = 0.5
    (single,) = postprocess(preds, conf=0.25, iou=0.5, max_det=10)
    (multi,) = postprocess(preds, conf=0.25, iou=0.5, max_det=10, multi_label=True)
    assert single[:, 5].tolist() == [0.0]
    assert sorted(multi[:, 5].tolist()) == [0.0, 1.0]


def test_bad_prediction_shape_is_refused():
    with pytest.raises(ValueError, match="4 \\+ nc"):
        postprocess(torch.zeros(2, 100), conf=0.25, iou=0.5, max_det=10)


def test_scale_boxes_undoes_the_letterbox():
    # a 100x200 (h, w) image letterboxed into 128x128: ratio 0.64, 32 px padding on top and bottom
    orig_h, orig_w, ratio, pad = 100, 200, 0.64, (0.0, 32.0)
    original = torch.tensor([[20.0, 10.0, 120.0, 90.0, 0.8, 1.0]])
    letterboxed = original.clone()
    letterboxed[:, [0, 2]] = original[:, [0, 2]] * ratio + pad[0]
    letterboxed[:, [1, 3]] = original[:, [1, 3]] * ratio + pad[1]
    restored = scale_boxes(letterboxed, ratio, pad, (orig_h, orig_w))
    assert torch.allclose(restored, original, atol=1e-4)
    assert torch.equal(letterboxed[:, 4:], restored[:, 4:])


def test_scale_boxes_clips_to_the_original_image():
    boxes = torch.tensor([[-5.0, 20.0, 140.0, 130.0]])
    out = scale_boxes(boxes, 0.64, (0.0, 32.0), (100, 200))
    assert out[0].tolist() == pytest.approx([0.0, 0.0, 200.0, 100.0])


def test_model_outputs_go_through_postprocess():
    torch.manual_seed(0)
    model = build_model("gelan-t", nc=2).eval()
    with torch.no_grad():
        dets = postprocess(model(torch.rand(3, 3, 64, 64)), conf=0.001, iou=0.7, max_det=50)
    assert len(dets) == 3
    for d in dets:
        assert d.shape[1] == 6 and 0 < len(d) <= 50
        assert (d[:, 4] > 0.001).all() and set(d[:, 5].tolist()) <= {0.0, 1.0}
        assert torch.all(d[:-1, 4] >= d[1:, 4])
