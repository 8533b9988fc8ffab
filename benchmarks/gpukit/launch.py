"""Section ``launch``: ``detscale launch --gpus 1 -- train`` (torchrun, 2 epochs, bf16 on a GPU,
channels_last, disk cache) and ``detscale evaluate``; the run folder's artifact contract checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from gpukit.kit import Kit, Sizes, data_paths, detscale_cmd, device, experiment, write_config


def check_contract(run: Path, want_device: str) -> list[str]:
    """What is missing or wrong in a trained + evaluated run folder (the design's artifact contract)."""
    problems: list[str] = []
    for name in ("config.yaml", "env.json", "metrics.jsonl", "timing.json", "weights/last.pt", "logs/rank0.log",
                 "eval.json", "predictions.json"):
        if not (run / name).is_file():
            problems.append(f"missing {name}")
    if problems:
        return problems
    timing = json.loads((run / "timing.json").read_text())
    keys = {"world_size", "device", "backend", "batch_per_rank", "global_batch", "warmup_steps", "measured_steps",
            "images_per_s", "images_per_s_per_rank", "data_wait_share", "compute_share", "epoch_seconds",
            "val_seconds", "train_seconds", "peak_mem_bytes_per_rank", "mem_kind", "mfu", "peak_gflops_per_rank",
            "train_gflops_per_image"}
    problems += [f"timing.json lacks {k}" for k in sorted(keys - timing.keys())]
    if timing.get("device") != want_device:
        problems.append(f"timing.json device {timing.get('device')!r}, expected {want_device!r}")
    want_mem = "cuda_allocated" if want_device == "cuda" else "rss"
    if timing.get("mem_kind") != want_mem:
        problems.append(f"timing.json mem_kind {timing.get('mem_kind')!r}, expected {want_mem!r}")
    if not timing.get("images_per_s", 0) > 0:
        problems.append("timing.json images_per_s is not positive")
    if len(timing.get("epoch_seconds", [])) != 2:
        problems.append(f"timing.json epoch_seconds has {len(timing.get('epoch_seconds', []))} entries, expected 2")
    env = json.loads((run / "env.json").read_text())
    if want_device == "cuda" and not (env.get("gpu_count") and env.get("gpu_model") and env.get("cuda")):
        problems.append("env.json lacks the GPU model, count or CUDA version")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if [r.get("epoch") for r in rows] != [0, 1]:
        problems.append(f"metrics.jsonl epochs {[r.get('epoch') for r in rows]}, expected [0, 1]")
    if any(not all(isinstance(r.get(k), float) for k in ("loss_box", "loss_cls", "loss_dfl")) for r in rows):
        problems.append("metrics.jsonl losses are not all numbers")
    ckpt = torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=False)
    if ckpt.get("epoch") != 2:
        problems.append(f"last.pt epoch {ckpt.get('epoch')}, expected 2")
    ev = json.loads((run / "eval.json").read_text())
    eval_keys = {"map50_95", "map50", "map75", "map_small", "map_medium", "map_large", "ar100", "per_class",
                 "num_images", "ground_truth", "predictions"}
    problems += [f"eval.json lacks {k}" for k in sorted(eval_keys - ev.keys())]
    preds = json.loads((run / "predictions.json").read_text())
    if not isinstance(preds, list) or (preds and not {"image_id", "category_id", "bbox", "score"} <= preds[0].keys()):
        problems.append("predictions.json is not a list of COCO detections")
    return problems


def section_launch(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    dev = device()
    paths = data_paths(kit.work)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    # two batches per optimiser step: accumulation on the GPU path too (64 images at full size)
    exp = experiment(paths.data_yaml, sizes.launch_model, sizes.imgsz, sizes.launch_batch, precision=precision,
                     workers=sizes.workers, nominal=2 * sizes.launch_batch)
    cfg = write_config(exp, kit.work / "launch" / "config.yaml")
    rid = exp.runs()[0].run_id
    run = kit.work / "launch" / rid
    shutil.rmtree(run, ignore_errors=True)
    logs = kit.work / "logs"
    train_s = detscale_cmd("launch", "--gpus", "1", "--", "train", "--config", str(cfg), "--run", rid, "--out",
                           str(run), "--data", str(paths.data_yaml), "--cache-dir", str(paths.cache_dir),
                           cwd=kit.work, log=logs / "launch-train.log", timeout=300)
    eval_s = detscale_cmd("evaluate", "--weights", str(run / "weights" / "last.pt"), "--config", str(cfg), "--run",
                          rid, "--out", str(run), "--data", str(paths.data_yaml), "--gt",
                          str(kit.work / "launch" / "coco_val.json"), cwd=kit.work, log=logs / "launch-eval.log",
                          timeout=180)
    problems = check_contract(run, dev.type)
    timing = json.loads((run / "timing.json").read_text())
    ev = json.loads((run / "eval.json").read_text())
    eval_log = (logs / "launch-eval.log").read_text()
    frozen = (run / "config.yaml").read_text()
    if "channels_last: true" not in frozen:
        problems.append("config.yaml does not record channels_last: true")
    if dev.type == "cuda" and "(1 rank, cuda)" not in eval_log:
        problems.append("detscale evaluate did not run on the GPU")
    return {
        "run": rid, "precision": precision, "train_wall_s": round(train_s, 1), "eval_wall_s": round(eval_s, 1),
        "images_per_s": timing["images_per_s"], "data_wait_share": timing["data_wait_share"],
        "epoch_seconds": timing["epoch_seconds"], "peak_mem_bytes": timing["peak_mem_bytes_per_rank"],
        "peak_mem_reserved_bytes": timing.get("peak_mem_reserved_bytes_per_rank"), "backend": timing["backend"],
        "map50": ev["map50"], "map50_95": ev["map50_95"], "mfu": timing.get("mfu"),
        "mfu_datasheet": timing.get("mfu_datasheet"), "peak_gflops_per_rank": timing.get("peak_gflops_per_rank"),
        "problems": problems, "failed": bool(problems),
    }
