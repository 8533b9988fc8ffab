"""The loss: padding of targets, the task-aligned assigner on known cases, finiteness and gradients,
and the distributed contract (two gloo ranks give the gradient of one process on the whole batch)."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from detscale.loss import DetectionLoss, TaskAlignedAssigner, pad_targets
from detscale.model import build_model
from detscale.model.boxes import bbox_ciou


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)
    torch.manual_seed(0)


def test_pad_targets_groups_boxes_by_image():
    targets = torch.tensor([
        [2, 1, 0.5, 0.5, 0.5, 0.5],
        [0, 0, 0.25, 0.25, 0.5, 0.5],
        [2, 2, 0.5, 0.5, 1.0, 1.0],
    ])
    labels, boxes, mask = pad_targets(targets, bsz=3, img_hw=(100, 200))
    assert labels.shape == (3, 2) and boxes.shape == (3, 2, 4)
    assert mask.tolist() == [[True, False], [False, False], [True, True]]
    assert labels[2].tolist() == [1, 2] and labels[0, 0].item() == 0
    assert boxes[0, 0].tolist() == pytest.approx([0.0, 0.0, 100.0, 50.0])
    assert boxes[2, 1].tolist() == pytest.approx([0.0, 0.0, 200.0, 100.0])


def test_pad_targets_without_objects():
    labels, boxes, mask = pad_targets(torch.zeros(0, 6), bsz=2, img_hw=(64, 64))
    assert labels.shape == (2, 0) and boxes.shape == (2, 0, 4) and mask.shape == (2, 0)


def test_ciou_of_identical_boxes_is_one_and_decreases_with_offset():
    box = torch.tensor([[10.0, 10.0, 30.0, 40.0]])
    assert bbox_ciou(box, box).item() == pytest.approx(1.0, abs=1e-5)
    shifted = box + torch.tensor([5.0, 0.0, 5.0, 0.0])
    far = box + torch.tensor([50.0, 0.0, 50.0, 0.0])
    assert 0 < bbox_ciou(box, shifted).item() < 1
    assert bbox_ciou(box, far).item() < 0  # no overlap: the centre-distance penalty makes it negative


def grid_points(n: int, stride: float = 8.0) -> torch.Tensor:
    """Centres of an n x n grid of cells (pixels), row-major like the flattened feature maps."""
    c = (torch.arange(n, dtype=torch.float32) + 0.5) * stride
    yy, xx = torch.meshgrid(c, c, indexing="ij")
    return torch.stack((xx, yy), -1).view(-1, 2)


def test_assigner_picks_the_anchor_with_the_accurate_prediction():
    points = grid_points(4)  # 16 anchors at 4, 12, 20, 28 px
    nc = 2
    gt = torch.tensor([[[0.0, 0.0, 32.0, 16.0]]])  # covers the 8 anchors of the first two rows
    pd_boxes = torch.tensor([0.0, 0.0, 2.0, 2.0]).repeat(1, 16, 1)  # poor boxes everywhere...
    pd_boxes[0, 5] = gt[0, 0]  # ...except anchor 5, which predicts the box exactly
    pd_scores = torch.full((1, 16, nc), 0.5)
    assigner = TaskAlignedAssigner(nc, topk=1)
    out = assigner(pd_scores, pd_boxes, points, torch.tensor([[1]]), gt, torch.tensor([[True]]))
    assert out.fg_mask[0].nonzero().flatten().tolist() == [5]
    assert out.labels[0, 5].item() == 1
    assert torch.equal(out.boxes[0, 5], gt[0, 0])
    # the best-aligned anchor's target score is its IoU (1 here), only in the box's own class
    assert out.scores[0, 5].tolist() == pytest.approx([0.0, 1.0], abs=1e-5)
    assert out.scores[0].sum().item() == pytest.approx(1.0, abs=1e-5)


def test_assigner_takes_topk_inside_the_box_and_ignores_padding():
    points = grid_points(8)  # 64 anchors, a 64 x 64 image
    gt = torch.tensor([[[0.0, 0.0, 64.0, 32.0], [0.0, 0.0, 0.0, 0.0]]])  # 32 anchors inside; 2nd is padding
    pd_boxes = gt[:, :1].expand(1, 64, 4).clone()  # every anchor predicts the box
    pd_scores = torch.rand(1, 64, 3)
    out = TaskAlignedAssigner(3, topk=10)(pd_scores, pd_boxes, points, torch.tensor([[2, 0]]), gt,
                                          torch.tensor([[True, False]]))
    fg = out.fg_mask[0]
    assert fg.sum().item() == 10
    assert (points[fg, 1] < 32).all()  # positives only where the centre lies inside the box
    # with equal IoUs the ten highest class-2 scores inside the box win
    inside = (points[:, 1] < 32).nonzero().flatten()
    best = inside[pd_scores[0, inside, 2].topk(10).indices]
    assert set(fg.nonzero().flatten().tolist()) == set(best.tolist())
    assert (out.labels[0, fg] == 2).all()


def test_assigner_gives_a_shared_anchor_to_the_box_it_overlaps_most():
    points = torch.tensor([[16.0, 16.0]])  # one anchor inside both boxes
    gt = torch.tensor([[[0.0, 0.0, 32.0, 32.0], [8.0, 8.0, 48.0, 48.0]]])
    pd_boxes = torch.tensor([[[9.0, 9.0, 47.0, 47.0]]])  # much closer to the second box
    out = TaskAlignedAssigner(2, topk=10)(torch.full((1, 1, 2), 0.5), pd_boxes, points,
                                          torch.tensor([[0, 1]]), gt, torch.tensor([[True, True]]))
    assert out.fg_mask.tolist() == [[True]]
    assert out.labels.item() == 1
    assert torch.equal(out.boxes[0, 0], gt[0, 1])


def test_assigner_without_ground_truth_assigns_nothing():
    out = TaskAlignedAssigner(3)(torch.rand(2, 16, 3), torch.rand(2, 16, 4), grid_points(4),
                                 torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, 4),
                                 torch.zeros(2, 0, dtype=torch.bool))
    assert not out.fg_mask.any() and out.scores.sum().item() == 0


MANY = torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.2], [0, 2, 0.2, 0.3, 0.1, 0.1], [1, 0, 0.7, 0.7, 0.4, 0.5],
                     [1, 1, 0.3, 0.6, 0.2, 0.3], [1, 2, 0.8, 0.2, 0.3, 0.3]])


@pytest.mark.parametrize("name", ["gelan-t", "yolov9-t"])
@pytest.mark.parametrize("targets", [torch.zeros(0, 6), MANY[:1], MANY], ids=["zero", "one", "many"])
def test_loss_is_finite_with_gradients(name: str, targets: torch.Tensor):
    model = build_model(name, nc=3).train()
    loss, items = DetectionLoss(model)(model(torch.rand(2, 3, 64, 64)), targets)
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.item() > 0
    assert items.shape == (3,) and not items.requires_grad and torch.isfinite(items).all()
    if len(targets) == 0:
        assert items[0].item() == 0 and items[2].item() == 0  # no box terms without objects
    else:
        assert (items > 0).all()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    if name.startswith("yolov9"):  # the auxiliary head is trained too
        assert model.aux_head.cls[0][-1].bias.grad.abs().sum() > 0


def test_returned_loss_is_the_gained_terms_times_the_batch():
    model = build_model("yolov9-t", nc=3).train()
    loss, items = DetectionLoss(model)(model(torch.rand(2, 3, 64, 64)), MANY)
    assert loss.item() == pytest.approx(2 * items.sum().item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Distributed contract: two gloo ranks, each half the batch, gradients averaged like DDP and the
# loss multiplied by world_size, equal the gradient of one process on the whole batch.
# ---------------------------------------------------------------------------------------------

def _frozen_bn_model() -> nn.Module:
    torch.manual_seed(0)
    model = build_model("gelan-t", nc=3).train()
    for m in model.modules():  # per-rank batch statistics would legitimately differ
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _rank_main(rank: int, world: int, port: int, x: torch.Tensor, targets: torch.Tensor, out: str,
               global_normaliser: bool) -> None:
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _frozen_bn_model()
        half = x.shape[0] // world
        local = targets[(targets[:, 0] >= rank * half) & (targets[:, 0] < (rank + 1) * half)].clone()
        local[:, 0] -= rank * half
        loss, _ = DetectionLoss(model, global_normaliser=global_normaliser)(model(x[rank * half:(rank + 1) * half]),
                                                                            local)
        (loss * world).backward()
        grads = _grads(model)
        for g in grads:  # what DDP does: average over ranks
            tdist.all_reduce(g)
            g /= world
        if rank == 0:
            torch.save(grads, out)
    finally:
        tdist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("global_normaliser", [True, False], ids=["global", "local"])
def test_two_ranks_give_the_single_process_gradient(tmp_path: Path, global_normaliser: bool):
    """Global normaliser: 2 ranks x 2 images = 1 process on the 4 images. Local (the default):
    2 ranks x 2 images = 1 process accumulating the gradients of the two halves, as a 1-GPU run does."""
    torch.manual_seed(1)
    x = torch.rand(4, 3, 64, 64)
    targets = MANY.clone()
    targets[2:, 0] += 2  # objects in images 0, 1 (rank 0), 3 (rank 1); image 2 has none
    model = _frozen_bn_model()
    if global_normaliser:
        loss, _ = DetectionLoss(model)(model(x), targets)
        loss.backward()
    else:
        for half in (0, 1):  # accumulate the two micro-batches
            local = targets[(targets[:, 0] >= 2 * half) & (targets[:, 0] < 2 * half + 2)].clone()
            local[:, 0] -= 2 * half
            loss, _ = DetectionLoss(model)(model(x[2 * half:2 * half + 2]), local)
            loss.backward()
    expected = _grads(model)

    out = tmp_path / "grads.pt"
    mp.spawn(_rank_main, args=(2, _free_port(), x, targets, str(out), global_normaliser), nprocs=2, join=True)
    got = torch.load(out)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, rtol=1e-3, atol=1e-6 * e.abs().max().item() + 1e-7)


def test_loss_does_not_modify_its_inputs():
    model = build_model("gelan-t", nc=3).train()
    preds = model(torch.rand(2, 3, 64, 64))
    before = [p.detach().clone() for p in preds]
    targets = MANY.clone()
    DetectionLoss(copy.deepcopy(model))(preds, targets)
    assert all(torch.equal(a, b) for a, b in zip(before, preds, strict=True))
    assert torch.equal(targets, MANY)
