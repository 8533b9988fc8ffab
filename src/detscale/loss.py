"""The YOLOv9 training loss: task-aligned assignment, BCE classification, CIoU + DFL box terms.

Everything is vectorised over the batch: ground truth comes padded to ``[B, M]`` (by the loader,
to a bucketed M) and the assigner works on ``[B, M, A]`` tensors, so no Python loop runs over
images or boxes, and every shape in the step is fixed by the batch and the bucket, not by the
data: nothing in the loss reads a value back from the device (``torch.compile`` traces it as one
graph).

Distributed contract (``docs/internals.md``): the trainer backpropagates ``loss * world_size``
and DDP averages the gradients over ranks, so the step's gradient is the *sum* of the ranks'.

- Local normaliser (the default, ``global_normaliser=False``): each rank's loss is normalised by
  its own sum of target scores and scaled by its own batch, as one process normalises each
  accumulated micro-batch. N ranks x batch b then give exactly the gradient of one process
  accumulating N batches of b, the comparison a 1-vs-N-GPU benchmark makes (and what the
  reference trainers do).
- Global normaliser (with SyncBatchNorm): the normaliser is all-reduced over ranks and the loss
  scaled by the global batch, so N ranks x b give the gradient of one process on one batch of
  N x b, whose BatchNorm statistics SyncBatchNorm reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from detscale import dist
from detscale.model.boxes import bbox2dist, bbox_ciou, dist2bbox, make_anchors, xywh2xyxy


@dataclass(frozen=True)
class Assignment:
    """Targets of every anchor: ``fg_mask`` [B, A] bool, ``labels`` [B, A], ``boxes`` [B, A, 4]
    (xyxy, same units as the inputs), ``scores`` [B, A, nc] (IoU-weighted one-hot; zero for background)."""

    fg_mask: torch.Tensor
    labels: torch.Tensor
    boxes: torch.Tensor
    scores: torch.Tensor


class TaskAlignedAssigner:
    """Task-aligned one-to-many assignment (TOOD): for every ground-truth box, the ``topk`` anchors
    whose centre lies inside it with the highest ``score^alpha * CIoU^beta`` become positives; an
    anchor claimed by several boxes goes to the one it overlaps most. Target scores are the
    one-hot class scaled, per box, so that its best-aligned anchor gets that anchor's IoU.

    ``min_side``: for the centre test only, a box side shorter than this (in the boxes' units) is
    widened to it about the box centre, so that a box smaller than the grid still gets candidate
    anchors. The reference trainer (Ultralytics 8.4) uses the middle stride (16 px); the YOLOv9
    paper's assigner has no floor (``min_side=0``), and boxes between anchor centres then get no
    positive at all (tests/test_oracles.py).
    """

    def __init__(self, nc: int, topk: int = 10, alpha: float = 0.5, beta: float = 6.0, eps: float = 1e-9,
                 min_side: float = 0.0) -> None:
        self.nc, self.topk, self.alpha, self.beta, self.eps, self.min_side = nc, topk, alpha, beta, eps, min_side

    @torch.no_grad()
    def __call__(self, pd_scores: torch.Tensor, pd_boxes: torch.Tensor, points: torch.Tensor,
                 gt_labels: torch.Tensor, gt_boxes: torch.Tensor, gt_mask: torch.Tensor) -> Assignment:
        """Assign anchors to ground truth.

        ``pd_scores`` [B, A, nc] probabilities; ``pd_boxes`` [B, A, 4] xyxy; ``points`` [A, 2]
        anchor centres (same units as the boxes); ``gt_labels`` [B, M] long; ``gt_boxes``
        [B, M, 4] xyxy; ``gt_mask`` [B, M] bool (False for padding).
        """
        bsz, n_anchors, _ = pd_scores.shape
        m = gt_boxes.shape[1]
        device = pd_scores.device
        if m == 0:
            return Assignment(torch.zeros(bsz, n_anchors, dtype=torch.bool, device=device),
                              torch.zeros(bsz, n_anchors, dtype=torch.long, device=device),
                              torch.zeros(bsz, n_anchors, 4, device=device),
                              torch.zeros_like(pd_scores))

        # Anchor centres strictly inside each box (sides widened to min_side), for real boxes only: [B, M, A].
        centre, half = (gt_boxes[..., :2] + gt_boxes[..., 2:]) / 2, (gt_boxes[..., 2:] - gt_boxes[..., :2]) / 2
        half = half.clamp(min=self.min_side / 2)
        x1y1, x2y2 = (centre - half)[:, :, None], (centre + half)[:, :, None]
        margin = torch.cat((points[None, None] - x1y1, x2y2 - points[None, None]), -1).amin(-1)
        candidates = (margin > self.eps) & gt_mask[:, :, None]

        overlaps = bbox_ciou(gt_boxes[:, :, None], pd_boxes[:, None]).squeeze(-1).clamp(0)
        overlaps = overlaps * candidates
        # Predicted probability of each box's own class at every anchor: [B, M, A].
        cls_scores = pd_scores.transpose(1, 2).gather(1, gt_labels[:, :, None].expand(-1, -1, n_anchors))
        align = cls_scores.pow(self.alpha) * overlaps.pow(self.beta) * candidates

        k = min(self.topk, n_anchors)
        top_idx = align.topk(k, dim=-1).indices
        in_topk = torch.zeros_like(candidates).scatter_(-1, top_idx, True)
        pos = in_topk & candidates  # [B, M, A]

        # An anchor claimed by several boxes goes to the box it overlaps most (of those it is a candidate of).
        multi = pos.sum(1, keepdim=True) > 1
        best_box = F.one_hot(overlaps.argmax(1), m).transpose(1, 2).bool()
        pos = torch.where(multi, best_box, pos)
        fg_mask = pos.any(1)
        gt_idx = pos.to(torch.uint8).argmax(1)  # [B, A]

        labels = gt_labels.gather(1, gt_idx)
        boxes = gt_boxes.gather(1, gt_idx[..., None].expand(-1, -1, 4))
        scores = F.one_hot(labels, self.nc).to(pd_scores.dtype) * fg_mask[..., None]

        # Scale each box's positives so the best-aligned one gets its IoU: soft, quality-aware targets.
        align = align * pos
        overlaps = overlaps * pos
        norm = align * overlaps.amax(-1, keepdim=True) / (align.amax(-1, keepdim=True) + self.eps)
        scores = scores * norm.amax(1)[..., None]
        return Assignment(fg_mask, labels, boxes, scores)


def pad_flat_targets(targets: torch.Tensor, bsz: int) -> torch.Tensor:
    """``targets`` [N, 6] (batch_idx, cls, cx, cy, w, h) -> padded [B, M, 5] (cls, cx, cy, w, h),
    ``cls = -1`` in the padding, M the largest number of objects in one image.

    The flat form's M is data-dependent: reading it synchronises with the device and gives every
    batch its own shape. The training loader pads on the CPU instead, to a bucketed M
    (:func:`detscale.data.loader.collate`); this is for callers that hold the flat form.
    """
    device = targets.device
    img = targets[:, 0].long()
    counts = torch.bincount(img, minlength=bsz)
    m = int(counts.max()) if len(img) else 0
    order = torch.argsort(img, stable=True)
    img_sorted = img[order]
    slot = torch.arange(len(order), device=device) - (torch.cumsum(counts, 0) - counts)[img_sorted]
    padded = torch.zeros(bsz, m, 5, device=device, dtype=torch.float32)
    padded[..., 0] = -1.0
    padded[img_sorted, slot] = targets[order, 1:].float()
    return padded


def unpack_targets(padded: torch.Tensor,
                   img_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded [B, M, 5] targets (normalised, ``cls = -1`` in the padding) -> ``labels`` [B, M] long,
    ``boxes`` [B, M, 4] xyxy in input pixels, ``mask`` [B, M] bool. Shape-static: no synchronisation."""
    h, w = img_hw
    scale = torch.tensor([w, h, w, h], device=padded.device, dtype=torch.float32)
    mask = padded[..., 0] >= 0
    return padded[..., 0].clamp(min=0).long(), xywh2xyxy(padded[..., 1:].float() * scale), mask


def pad_targets(targets: torch.Tensor, bsz: int,
                img_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``targets`` [N, 6] (batch_idx, cls, cx, cy, w, h normalised) -> per-image padded tensors.

    Returns ``labels`` [B, M] long, ``boxes`` [B, M, 4] xyxy in input pixels and ``mask`` [B, M]
    bool, where M is the largest number of objects in one image (0 when there are none).
    """
    return unpack_targets(pad_flat_targets(targets, bsz), img_hw)


def flat_targets(padded: torch.Tensor) -> torch.Tensor:
    """Padded [B, M, 5] -> flat [N, 6] (batch_idx, cls, cx, cy, w, h), the padding left out."""
    b, m = torch.nonzero(padded[..., 0] >= 0, as_tuple=True)
    return torch.cat((b[:, None].to(padded.dtype), padded[b, m]), 1)


class DetectionLoss:
    """``loss, items = DetectionLoss(model)(preds, targets)``.

    ``preds`` is the training-mode output of the model (per-level maps, or ``(main, aux)`` for
    the dual-head models); ``targets`` normalised to the input image, either padded [B, M, 5]
    (cls, cx, cy, w, h; ``cls = -1`` in the padding: the training loader's form, whose shapes are
    static) or flat [N, 6] (batch_idx, cls, cx, cy, w, h). ``loss`` = (box_gain * CIoU + cls_gain *
    BCE + dfl_gain * DFL), plus
    ``aux_weight`` times the same for the auxiliary head, multiplied by the batch size (this
    rank's, or the global one with ``global_normaliser``); ``items`` = detached (box, cls, dfl)
    with gains applied (auxiliary included), for logging: this rank's batch loss, or with
    ``global_normaliser`` its share of the global-batch loss (the sum over ranks).
    """

    def __init__(self, model: nn.Module, box_gain: float = 7.5, cls_gain: float = 0.5, dfl_gain: float = 1.5,
                 aux_weight: float = 0.25, topk: int = 10, alpha: float = 0.5, beta: float = 6.0,
                 global_normaliser: bool = False) -> None:
        raw = getattr(model, "module", model)
        self.nc: int = raw.nc
        self.reg_max: int = raw.reg_max
        self.strides: list[float] = [float(s) for s in raw.stride]
        self.gains = (box_gain, cls_gain, dfl_gain)
        self.aux_weight = aux_weight
        self.global_normaliser = global_normaliser
        # The reference's floor for small boxes: the middle stride (16 px for strides 8, 16, 32).
        self.assigner = TaskAlignedAssigner(self.nc, topk, alpha, beta, min_side=self.strides[len(self.strides) // 2])

    def __call__(self, preds, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dual = isinstance(preds, (tuple, list)) and isinstance(preds[0], (tuple, list))
        heads = [(preds[0], 1.0), (preds[1], self.aux_weight)] if dual else [(preds, 1.0)]
        first = heads[0][0][0]
        bsz = first.shape[0]
        img_hw = (int(first.shape[2] * self.strides[0]), int(first.shape[3] * self.strides[0]))
        targets = targets.to(first.device)
        padded = targets if targets.dim() == 3 else pad_flat_targets(targets, bsz)
        gt_labels, gt_boxes, gt_mask = unpack_targets(padded, img_hw)

        parts = torch.zeros(3, device=first.device)
        for levels, weight in heads:
            parts = parts + weight * self._head_terms(levels, gt_labels, gt_boxes, gt_mask)
        parts = parts * torch.tensor(self.gains, device=parts.device)
        batch = bsz * dist.get_world_size() if self.global_normaliser else bsz
        return parts.sum() * batch, parts.detach()

    def _head_terms(self, levels: list[torch.Tensor], gt_labels: torch.Tensor, gt_boxes: torch.Tensor,
                    gt_mask: torch.Tensor) -> torch.Tensor:
        """Un-gained (CIoU, BCE, DFL) of one head, each normalised by the sum of target scores."""
        bsz = levels[0].shape[0]
        # half precision (autocast) is computed in float32; float64 (the equivalence tests) stays
        flat = torch.cat([x.view(bsz, self.nc + 4 * self.reg_max, -1) for x in levels], 2)
        flat = flat if flat.dtype == torch.float64 else flat.float()
        pred_dist, pred_logits = flat.split((4 * self.reg_max, self.nc), 1)
        pred_dist = pred_dist.transpose(1, 2).contiguous()  # [B, A, 4 * reg_max]
        pred_logits = pred_logits.transpose(1, 2).contiguous()  # [B, A, nc]
        points, stride = make_anchors([tuple(x.shape[2:]) for x in levels], self.strides, flat.device, flat.dtype)

        # Boxes in grid units of their level, from the expectation over the distance bins.
        bins = torch.arange(self.reg_max, device=flat.device, dtype=flat.dtype)
        pred_ltrb = pred_dist.view(bsz, -1, 4, self.reg_max).softmax(-1) @ bins
        pred_boxes = dist2bbox(pred_ltrb, points)

        target = self.assigner(pred_logits.detach().sigmoid(), pred_boxes.detach() * stride,
                               points * stride, gt_labels, gt_boxes, gt_mask)
        score_sum = target.scores.sum().detach().clone()
        if self.global_normaliser:
            score_sum = dist.all_reduce_sum(score_sum)
        score_sum = score_sum.clamp(min=1.0)

        bce = F.binary_cross_entropy_with_logits(pred_logits, target.scores, reduction="none").sum() / score_sum

        # Box terms over every anchor, weighted by its target score (zero for background): no
        # boolean indexing, so the shapes do not depend on the data and nothing waits for the device.
        fg = target.fg_mask[..., None]
        weight = target.scores.sum(-1)  # [B, A], zero for background
        # background anchors get a harmless target (a unit box at the anchor) so every term stays finite
        unit = torch.cat((points - 0.5, points + 0.5), -1).expand(bsz, -1, -1)
        target_boxes = torch.where(fg, target.boxes / stride, unit)  # grid units
        ciou = bbox_ciou(pred_boxes, target_boxes).squeeze(-1)
        box = ((1.0 - ciou) * weight).sum() / score_sum

        target_ltrb = bbox2dist(points.expand(bsz, -1, -1), target_boxes, self.reg_max - 1)
        dfl = self._dfl(pred_dist.view(-1, self.reg_max), target_ltrb.reshape(-1)).view(bsz, -1, 4).mean(-1)
        dfl = (dfl * weight).sum() / score_sum
        return torch.stack((box, bce, dfl))

    @staticmethod
    def _dfl(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Distribution focal loss: cross-entropy to the two bins around the continuous target,
        weighted by proximity (so the expectation of the ideal distribution equals the target)."""
        left = target.long()
        w_left = left + 1 - target
        # one log-softmax for both bins (two cross_entropy calls would compute it twice)
        logp = F.log_softmax(logits, -1)
        pair = logp.gather(-1, torch.stack((left, left + 1), -1))
        return -(pair[:, 0] * w_left + pair[:, 1] * (1 - w_left))
