"""Section ``models``: every model's forward + loss + backward + optimiser step in every precision
and layout, then the fused eval forward and NMS: finite loss, finite gradients, dtypes."""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch

from detscale.engine.build import AMP_DTYPES
from detscale.loss import DetectionLoss
from detscale.model import build_model, fuse_for_inference, postprocess
from gpukit.kit import Sizes, device, sync


def fake_targets(batch: int, nc: int, device: Any) -> Any:
    """Three boxes per image, (batch_idx, cls, cx, cy, w, h) normalised, as the loader gives them."""
    rows = []
    for b in range(batch):
        for k in range(3):
            rows.append([b, (b + k) % nc, 0.25 + 0.25 * k, 0.5, 0.2 + 0.05 * k, 0.3])
    return torch.tensor(rows, dtype=torch.float32, device=device)


def one_model_check(name: str, precision: str, channels_last: bool, imgsz: int, batch: int) -> dict[str, Any]:
    dev = device()
    nc = 80
    torch.manual_seed(0)
    model = build_model(name, nc).to(dev)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    loss_fn = DetectionLoss(model, 7.5, 0.5, 1.5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler(dev.type, enabled=precision == "fp16")
    amp = AMP_DTYPES.get(precision)
    x = torch.rand(batch, 3, imgsz, imgsz, device=dev).contiguous(memory_format=fmt)
    targets = fake_targets(batch, nc, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    model.train()
    with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
        preds = model(x)
        loss, items = loss_fn(preds, targets)
    first = preds[0][0] if isinstance(preds, tuple) else preds[0]
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = all(torch.isfinite(g).all().item() for g in grads)
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    retried = False
    if scaler.is_enabled() and not finite:
        # GradScaler starts at 2**16, which may overflow the first fp16 backward: it skips that step and
        # lowers the scale (its job). Retry once at scale 1, where finite gradients are required.
        retried = True
        scaler.update(1.0)
        with torch.autocast(dev.type, dtype=amp, enabled=True):
            loss, items = loss_fn(model(x), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = all(torch.isfinite(g).all().item() for g in grads)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
    opt.zero_grad(set_to_none=True)
    model.eval()
    fused = fuse_for_inference(model)
    with torch.no_grad(), torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
        out = fused(x)
        dets = postprocess(out.float(), conf=0.001, iou=0.7, max_det=300)
    sync()
    seconds = time.perf_counter() - t0
    record = {
        "loss": float(loss.detach()), "loss_items": [float(v) for v in items], "grad_norm": grad_norm,
        "pred_dtype": str(first.dtype).replace("torch.", ""), "eval_out_shape": list(out.shape),
        "eval_dtype": str(out.dtype).replace("torch.", ""), "detections": sum(len(d) for d in dets),
        "seconds": round(seconds, 3),
    }
    if scale_before is not None:
        record["scaler_initial_scale"] = scale_before
        record["scaler_skipped_first_step"] = retried
    if dev.type == "cuda":
        record["peak_allocated_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20)
    problems = []
    if not torch.isfinite(loss).item():
        problems.append("loss not finite")
    if not finite:
        problems.append("gradient not finite" + (" (also at GradScaler scale 1)" if retried else ""))
    if out.shape[1] != 4 + nc:
        problems.append(f"eval output has {out.shape[1]} channels, expected {4 + nc}")
    if amp is not None and dev.type == "cuda" and first.dtype != amp:
        problems.append(f"head output dtype {first.dtype} under {precision} autocast")
    record["ok"] = not problems
    if problems:
        record["problems"] = problems
    return record


def section_models(sizes: Sizes) -> dict[str, Any]:
    torch.backends.cudnn.benchmark = False  # one step per shape: autotuning would cost more than it saves
    combos = []
    for name in sizes.models:
        for precision in sizes.precisions:
            for channels_last in (False, True):
                entry = {"model": name, "precision": precision, "channels_last": channels_last}
                try:
                    entry.update(one_model_check(name, precision, channels_last, sizes.imgsz, sizes.model_batch))
                except Exception as exc:
                    entry.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                                 traceback=traceback.format_exc()[-1500:])
                combos.append(entry)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    bad = [c for c in combos if not c["ok"]]
    return {"imgsz": sizes.imgsz, "batch": sizes.model_batch, "combos": combos, "passed": len(combos) - len(bad),
            "total": len(combos), "failed": bool(bad)}
