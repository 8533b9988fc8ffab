"""GPU acceptance kit: exercise detscale's CUDA path on a bare machine in one command.

On a CUDA machine (tested on one H200 with torch 2.11 + CUDA 13, no network)::

    python3 benchmarks/gpu_check.py --out gpu-out --wheels .gpukit/wheels

writes ``gpu-out/gpu_check.json`` (every figure) and ``gpu-out/gpu_check.md`` (a summary),
rewritten after every section, so a run cut short still leaves what it measured. The sections,
each timed and guarded so that one failure does not hide the rest:

``env``         torch, CUDA, cuDNN, NCCL, GPU, driver, CPU cores.
``models``      every model (gelan-t/s/m/c, yolov9-t/s) forward + loss + backward + optimiser step
                at 640 px in fp32, bf16 and fp16 (GradScaler), NCHW and channels_last, then the
                fused eval forward and NMS: finite loss, finite gradients, dtypes.
``data``        ``detscale synth`` + ``detscale cache`` of a synthetic set at 640 px.
``launch``      ``detscale launch --gpus 1 -- train`` (torchrun, 2 epochs, bf16, channels_last,
                disk cache) and ``detscale evaluate`` on the GPU; the run folder's artifact
                contract checked (timing.json, env.json, metrics.jsonl, last.pt, eval.json,
                predictions.json).
``nccl``        one rank in an NCCL process group: the DDP wrapper, its bucketed all-reduce and
                the loop's collectives over NCCL (world size 1: one card).
``ddp``         two ranks on the one card (gloo over CUDA tensors: NCCL refuses two ranks on one
                device) train a few steps through the real loop; weights, buffers and EMA must be
                equal on both ranks.
``loader``      images/s the training loader delivers at 640 px with mosaic, cache none vs disk,
                1/4/8/16 workers, without the model: can the CPU side feed the card at all?
``throughput``  yolov9-s and gelan-s at 640, batch 16/32/64, bf16, channels_last, cached data:
                steady-state img/s, peak allocated/reserved memory and data-wait share through
                the real loop (``train_one_epoch``, per-step instrumentation on), and the same
                steps with the instrumentation off (no per-step synchronisation), alternating,
                so the instrument's cost on a GPU is measured side by side.

``--budget-s`` bounds the whole run: a section that would not fit in what is left is recorded
as skipped. ``--only a,b`` reruns chosen sections (``data`` is added when one needs it).

Wheels. The device image lacks jsonschema and faster-coco-eval (and what jsonschema needs).
Fetch them here once, for the machine's Python (3.12 on the H200 image)::

    python3 benchmarks/gpu_check.py --fetch-wheels .gpukit/wheels --python-version 3.12

then carry ``.gpukit`` with the call; ``--wheels DIR`` installs them with ``pip --no-index
--no-deps --target`` into ``DIR/site`` (nothing else on the machine changes) and puts that and
``src/`` on the path of this process and of every command it starts.

CPU self-test (``--tiny``: 64 px, a few images, 0-1 workers) runs in the test suite, so the kit
cannot rot between lent GPUs: ``python benchmarks/gpu_check.py --out DIR --tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("env", "models", "data", "launch", "nccl", "ddp", "loader", "throughput", "profile")
NEEDS_DATA = {"launch", "nccl", "ddp", "loader", "throughput", "profile"}
#: Wheels the device image lacks (jsonschema's own dependencies included; attrs is there).
WHEELS = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "faster-coco-eval")


@dataclass(frozen=True)
class Sizes:
    """What the kit runs: the real check (GPU) or the tiny CPU self-test."""

    imgsz: int
    model_batch: int
    models: tuple[str, ...]
    precisions: tuple[str, ...]
    train_images: int
    val_images: int
    launch_model: str
    launch_batch: int
    ddp_images: int
    ddp_batch: int
    loader_workers: tuple[int, ...]
    loader_batch: int
    loader_seconds: float
    tp_models: tuple[str, ...]
    tp_batches: tuple[int, ...]
    tp_rounds: int  # instrumented/bare pairs per (model, batch), order alternating
    tp_warmup_steps: int
    workers: int  # loader workers of the training runs
    tp_points: tuple[tuple[str, int], ...] = ()  # overrides tp_models x tp_batches when given

    def throughput_points(self) -> list[tuple[str, int]]:
        return list(self.tp_points) or [(m, b) for m in self.tp_models for b in self.tp_batches]


def sizes_for(tiny: bool, cpus: int) -> Sizes:
    models = ("gelan-t", "gelan-s", "gelan-m", "gelan-c", "yolov9-t", "yolov9-s")
    if tiny:
        # one single-head and one dual-head model: the paths of all six, at a fraction of the time
        return Sizes(imgsz=64, model_batch=2, models=("gelan-t", "yolov9-t"), precisions=("fp32", "bf16", "fp16"),
                     train_images=48, val_images=8, launch_model="gelan-t", launch_batch=8, ddp_images=16, ddp_batch=4,
                     loader_workers=(0, 1), loader_batch=8, loader_seconds=0.5, tp_models=("gelan-t",),
                     tp_batches=(8, 16), tp_rounds=1, tp_warmup_steps=1, workers=0)
    workers = max(1, min(12, cpus - 2))
    return Sizes(imgsz=640, model_batch=2, models=models, precisions=("fp32", "bf16", "fp16"), train_images=1024,
                 val_images=64, launch_model="gelan-s", launch_batch=32, ddp_images=64, ddp_batch=8,
                 loader_workers=(1, 4, 8, 16), loader_batch=16, loader_seconds=2.0,
                 tp_models=("yolov9-s", "gelan-s"), tp_batches=(16, 32, 64), tp_rounds=1, tp_warmup_steps=3,
                 workers=workers)


# ---------------------------------------------------------------------------------------------
# Wheels and paths
# ---------------------------------------------------------------------------------------------


def fetch_wheels(dest: Path, python_version: str) -> int:
    """Download (here, where PyPI is reachable) the wheels the bare device image lacks."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--dest", str(dest),
           "--python-version", python_version, "--implementation", "cp",
           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
           "--platform", "manylinux2014_x86_64", *WHEELS]
    code = subprocess.call(cmd)
    if code == 0:
        total = sum(p.stat().st_size for p in dest.glob("*.whl")) / 2**20
        print(f"wheels for Python {python_version} in {dest} ({total:.1f} MiB): carry them with the call")
    return code


def prepare_paths(wheels: Path | None) -> None:
    """Put ``src/`` (and the carried wheels, installed into ``WHEELS/site``) on every path."""
    entries = [str(ROOT / "src")]
    if wheels is not None:
        site = wheels / "site"
        files = sorted(str(p) for p in wheels.glob("*.whl"))
        if files and not (site / ".installed").is_file():
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                            "--disable-pip-version-check", "--target", str(site), *files], check=True)
            (site / ".installed").write_text("\n".join(files) + "\n")
        entries.insert(0, str(site))
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(entries + ([old] if old else []))


# ---------------------------------------------------------------------------------------------
# Running the sections
# ---------------------------------------------------------------------------------------------


class Kit:
    """Runs sections under a deadline, records each one's status and figures, writes JSON + Markdown."""

    def __init__(self, out: Path, work: Path, budget_s: float, tiny: bool) -> None:
        self.out = out
        self.work = work
        self.deadline = time.monotonic() + budget_s
        self.tiny = tiny
        self.results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "tiny": tiny,
                                        "budget_s": budget_s, "sections": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def section(self, name: str, need_s: float, fn: Callable[[], dict[str, Any]]) -> None:
        record: dict[str, Any]
        if self.left() < need_s:
            record = {"status": "skipped", "reason": f"{self.left():.0f} s left of the budget, needs ~{need_s:.0f} s"}
        else:
            print(f"[gpu_check] {name} ...", flush=True)
            t0 = time.perf_counter()
            try:
                record = {"status": "ok", **fn()}
            except Exception as exc:  # guarded: one failure must not hide the other sections
                record = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-4000:]}
            record["seconds"] = round(time.perf_counter() - t0, 2)
            if record["status"] == "ok" and record.pop("failed", False):
                record["status"] = "failed"
        self.results["sections"][name] = record
        print(f"[gpu_check] {name}: {record['status']} ({record.get('seconds', 0):.1f} s)"
              + (f" {record.get('error', '')}" if record["status"] != "ok" else ""), flush=True)
        self.write()

    def write(self) -> None:
        self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.results))


def device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# env
# ---------------------------------------------------------------------------------------------


def section_env() -> dict[str, Any]:
    import torch

    from detscale.engine.envinfo import environment

    env = environment("gpu-check", None)
    env["device"] = device().type
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["gpu_sm_count"] = props.multi_processor_count
        env["gpu_capability"] = f"{props.major}.{props.minor}"
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
    return env


# ---------------------------------------------------------------------------------------------
# models: forward + backward in every precision and layout
# ---------------------------------------------------------------------------------------------


def fake_targets(batch: int, nc: int, device: Any) -> Any:
    """Three boxes per image, (batch_idx, cls, cx, cy, w, h) normalised, as the loader gives them."""
    import torch

    rows = []
    for b in range(batch):
        for k in range(3):
            rows.append([b, (b + k) % nc, 0.25 + 0.25 * k, 0.5, 0.2 + 0.05 * k, 0.3])
    return torch.tensor(rows, dtype=torch.float32, device=device)


def one_model_check(name: str, precision: str, channels_last: bool, imgsz: int, batch: int) -> dict[str, Any]:
    import torch

    from detscale.engine.trainer import AMP_DTYPES
    from detscale.loss import DetectionLoss
    from detscale.model import build_model, fuse_for_inference, postprocess

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
    import torch

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


# ---------------------------------------------------------------------------------------------
# data: a synthetic set and its cache
# ---------------------------------------------------------------------------------------------


def detscale_cmd(*args: str, cwd: Path, log: Path, timeout: float) -> float:
    """Run ``python -m detscale ARGS``; raise with the log's tail when it fails. Returns seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "detscale", *args], cwd=cwd, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"detscale {args[0]} exited {proc.returncode}: {log.read_text()[-3000:]}")
    return time.perf_counter() - t0


@dataclass(frozen=True)
class DataPaths:
    data_yaml: Path
    cache_dir: Path
    ddp_yaml: Path


def data_paths(work: Path) -> DataPaths:
    return DataPaths(work / "data" / "data.yaml", work / "cache", work / "ddp-data" / "data.yaml")


def section_data(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    paths = data_paths(kit.work)
    logs = kit.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {}
    if not paths.data_yaml.is_file():
        record["synth_seconds"] = detscale_cmd(
            "synth", "--out", str(paths.data_yaml.parent), "--imgsz", str(sizes.imgsz), "--train",
            str(sizes.train_images), "--val", str(sizes.val_images), "--objects", "1", "8", cwd=kit.work,
            log=logs / "synth.log", timeout=300)
    if not paths.ddp_yaml.is_file():
        detscale_cmd("synth", "--out", str(paths.ddp_yaml.parent), "--imgsz", str(sizes.imgsz), "--train",
                     str(sizes.ddp_images), "--val", "4", "--seed", "1", cwd=kit.work, log=logs / "synth-ddp.log",
                     timeout=120)
    for split in ("train", "val"):
        record[f"cache_{split}_seconds"] = detscale_cmd(
            "cache", "--data", str(paths.data_yaml), "--split", split, "--imgsz", str(sizes.imgsz), "--out",
            str(paths.cache_dir), cwd=kit.work, log=logs / f"cache-{split}.log", timeout=300)
    detscale_cmd("cache", "--data", str(paths.ddp_yaml), "--split", "train", "--imgsz", str(sizes.imgsz), "--out",
                 str(paths.ddp_yaml.parent / "cache"), cwd=kit.work, log=logs / "cache-ddp.log", timeout=120)
    npy = paths.cache_dir / f"train-{sizes.imgsz}.npy"
    record.update(train_images=sizes.train_images, val_images=sizes.val_images, imgsz=sizes.imgsz,
                  cache_gib=round(npy.stat().st_size / 2**30, 3))
    return record


# ---------------------------------------------------------------------------------------------
# launch: detscale launch --gpus 1 -- train, then detscale evaluate
# ---------------------------------------------------------------------------------------------

CONFIG = """\
dataset:
  name: gpucheck
  data_yaml: {data_yaml}
grid:
  model: [{model}]
  imgsz: [{imgsz}]
  gpus: [{gpus}]
  batch: [{batch}]
  cache: [{cache}]
  precision: [{precision}]
  epochs: {epochs}
train:
  optimizer: adamw
  lr0: 0.002
  warmup_epochs: {warmup_epochs}
  nominal_batch: {nominal}
  close_mosaic: 1
  channels_last: true
  workers: {workers}
  timing_warmup_steps: {warmup_steps}
eval:
  batch: 32
"""


def write_config(path: Path, **values: Any) -> Path:
    defaults = {"gpus": 1, "cache": "disk", "precision": "bf16", "epochs": 2, "warmup_epochs": 1, "nominal": 64,
                "warmup_steps": 3}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CONFIG.format(**(defaults | values)))
    return path


def run_id(model: str, imgsz: int, gpus: int, batch: int, cache: str, precision: str) -> str:
    return f"{model}_{imgsz}_g{gpus}_b{batch}_{cache}_{precision}_s0_r0"


def check_contract(run: Path, want_device: str) -> list[str]:
    """What is missing or wrong in a trained + evaluated run folder (the design's artifact contract)."""
    import torch

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
            "val_seconds", "train_seconds", "peak_mem_bytes_per_rank", "mem_kind"}
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
    cfg = write_config(kit.work / "launch" / "config.yaml", data_yaml=paths.data_yaml, model=sizes.launch_model,
                       imgsz=sizes.imgsz, batch=sizes.launch_batch, precision=precision, workers=sizes.workers,
                       nominal=2 * sizes.launch_batch)
    rid = run_id(sizes.launch_model, sizes.imgsz, 1, sizes.launch_batch, "disk", precision)
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
        "map50": ev["map50"], "map50_95": ev["map50_95"], "problems": problems, "failed": bool(problems),
    }


# ---------------------------------------------------------------------------------------------
# nccl and ddp: the real loop in a process group on the one card
# ---------------------------------------------------------------------------------------------


def _group_worker(rank: int, world: int, backend: str, store: str, cfg_path: str, data_yaml: str, cache_dir: str,
                  result: str) -> None:
    """One rank: join a FileStore group, train one epoch through the real loop, compare states over ranks."""
    import datetime

    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from detscale import config, dist
    from detscale.data.formats import load_spec
    from detscale.engine.semantics import derive_semantics
    from detscale.engine.timing import RankTiming
    from detscale.engine.trainer import (
        Progress,
        StopFlag,
        build_loaders,
        build_parts,
        optimizer_step,
        to_input,
        train_one_epoch,
        train_step,
    )

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", 0)
    tdist.init_process_group(backend, store=tdist.FileStore(store, world), rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=120), **kwargs)
    try:
        info = dist.init_from_env(120, cpu_threads=1)
        cfg = config.load(cfg_path)
        point = cfg.runs()[0]
        sem = derive_semantics(cfg, point, world, info.device.type)
        parts = build_parts(point, load_spec(Path(data_yaml), splits=()).nc, sem, cfg.train, info)
        loader, _ = build_loaders(point, cfg, Path(data_yaml), Path(cache_dir), sem, info, with_val=False)
        timing = RankTiming(1)
        t0 = time.perf_counter()
        epoch = train_one_epoch(parts, loader, 0, Progress(), sem, cfg.train, info.device, timing, StopFlag())
        seconds = time.perf_counter() - t0
        wrapped_step, ema_updates = None, parts.ema.updates
        if world == 1:  # the trainer wraps the model in DDP only for N > 1: exercise the wrapper here
            parts.model = DDP(parts.raw, device_ids=[0] if info.device.type == "cuda" else None,
                              gradient_as_bucket_view=True)
            imgs, targets, _ = next(iter(loader))
            items = train_step(parts.model, parts.loss_fn, parts.scaler, to_input(imgs, info.device, True), targets,
                               1, parts.amp_dtype)
            optimizer_step(parts, cfg.train.clip_grad_norm)
            wrapped_step = bool(torch.isfinite(items).all())
        state = {f"model.{k}": v.detach().cpu() for k, v in parts.raw.state_dict().items()}
        state |= {f"ema.{k}": v.detach().cpu() for k, v in parts.ema.state_dict().items()}
        states = dist.all_gather_object(state)
        probe = torch.arange(4.0, device=info.device) + rank
        dist.all_reduce_sum(probe)
        if rank == 0:
            differ = [k for k in state if any(not torch.equal(state[k], s[k]) for s in states[1:])]
            expect = sum(torch.arange(4.0) + r for r in range(world))
            Path(result).write_text(json.dumps({
                "backend": tdist.get_backend(), "device": str(info.device), "world_size": world,
                "steps": epoch.step, "ema_updates": ema_updates, "losses": epoch.losses,
                "epoch_seconds": round(seconds, 2), "tensors_compared": len(state), "tensors_differing": differ[:20],
                "all_reduce_ok": bool(torch.equal(probe.cpu(), expect)), "ddp_wrapper_step_finite": wrapped_step,
                "precision": sem.precision, "channels_last": sem.channels_last,
                "finite_losses": all(v == v and abs(v) != float("inf") for v in epoch.losses),
            }))
    finally:
        dist.cleanup()


def run_group(kit: Kit, sizes: Sizes, name: str, world: int, backend: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    dev = device()
    paths = data_paths(kit.work)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    folder = kit.work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # nominal batch = the global batch: one optimiser step (and gradient all-reduce) per batch
    cfg = write_config(folder / "config.yaml", data_yaml=paths.ddp_yaml, model="gelan-t", imgsz=sizes.imgsz,
                       gpus=world, batch=sizes.ddp_batch, precision=precision, workers=min(sizes.workers, 2),
                       epochs=1, warmup_epochs=0, nominal=sizes.ddp_batch * world, warmup_steps=1)
    result = folder / "result.json"
    mp.spawn(_group_worker, args=(world, backend, str(folder / "store"), str(cfg), str(paths.ddp_yaml),
                                  str(paths.ddp_yaml.parent / "cache"), str(result)), nprocs=world, join=True)
    record = json.loads(result.read_text())
    problems = []
    if record["tensors_differing"]:
        problems.append(f"states differ between ranks: {record['tensors_differing']}")
    if not record["all_reduce_ok"]:
        problems.append("all_reduce_sum gave a wrong sum")
    if not record["finite_losses"]:
        problems.append("loss not finite")
    if record["ddp_wrapper_step_finite"] is False:
        problems.append("the step through the DDP wrapper gave a non-finite loss")
    if record["ema_updates"] != record["steps"] or record["steps"] == 0:
        problems.append(f"{record['ema_updates']} EMA updates after {record['steps']} steps")
    if dev.type == "cuda" and not record["device"].startswith("cuda"):
        problems.append(f"ranks ran on {record['device']}, not the GPU")
    record.update(problems=problems, failed=bool(problems))
    return record


# ---------------------------------------------------------------------------------------------
# loader: what the CPU side can deliver, without the model
# ---------------------------------------------------------------------------------------------


def default_augment(work: Path, sizes: Sizes) -> Any:
    """The augmentation a training run gets by default (mosaic 1.0, HSV, flip, scale, translate)."""
    from detscale import config

    cfg = write_config(work / "loader" / "config.yaml", data_yaml=data_paths(work).data_yaml, model="gelan-t",
                       imgsz=sizes.imgsz, batch=sizes.loader_batch, workers=0)
    return config.load(cfg).augment


def loader_rate(dataset: Any, batch: int, workers: int, seconds: float) -> dict[str, Any]:
    from detscale.data.loader import build_train_loader, set_epoch

    loader = build_train_loader(dataset, batch, 0, 1, seed=0, workers=workers)
    epoch = 0
    set_epoch(loader, epoch, mosaic=True)
    it = iter(loader)
    t_start = time.perf_counter()
    next(it)  # workers started, first batch (not counted)
    first_s = time.perf_counter() - t_start
    images, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            imgs, _targets, _metas = next(it)
        except StopIteration:
            epoch += 1
            set_epoch(loader, epoch, mosaic=True)
            it = iter(loader)
            continue
        images += len(imgs)
    elapsed = time.perf_counter() - t0
    del it, loader
    return {"images_per_s": images / elapsed, "images": images, "seconds": round(elapsed, 2),
            "first_batch_s": round(first_s, 2)}


def section_loader(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    from detscale.data.dataset import build_dataset

    paths = data_paths(kit.work)
    augment = default_augment(kit.work, sizes)
    rows = []
    for cache in ("none", "disk"):
        dataset = build_dataset(paths.data_yaml, "train", sizes.imgsz, cache, paths.cache_dir, augment)
        for workers in sizes.loader_workers:
            row = {"cache": cache, "workers": workers, "batch": sizes.loader_batch}
            row.update(loader_rate(dataset, sizes.loader_batch, workers, sizes.loader_seconds))
            rows.append(row)
            print(f"  loader cache={cache} workers={workers}: {row['images_per_s']:.0f} img/s", flush=True)
    return {"imgsz": sizes.imgsz, "mosaic": augment.mosaic, "cpus": os.cpu_count(), "rows": rows}


# ---------------------------------------------------------------------------------------------
# throughput: the real loop vs the same steps without per-step instrumentation
# ---------------------------------------------------------------------------------------------


def bare_epoch(parts: Any, loader: Any, epoch: int, sem: Any, tcfg: Any, dev: Any, warmup_steps: int,
               max_steps: int | None = None) -> dict:
    """The loop's work (loader, train_step, optimizer_step) without its per-step instrumentation.

    No clock read, no synchronisation, no stop-flag all-reduce and no loss copy per step: the
    device is synchronised only where the steady-state window starts and ends.
    """
    import torch

    from detscale.data.loader import set_epoch
    from detscale.engine.trainer import optimizer_step, to_input, train_step

    set_epoch(loader, epoch, mosaic=True)
    parts.model.train()
    nb = len(loader)
    loss_sum = torch.zeros(3, device=dev)
    t_epoch = time.perf_counter()
    t0, images = (t_epoch if warmup_steps == 0 else None), 0
    for i, (imgs, targets, _metas) in enumerate(loader):
        items = train_step(parts.model, parts.loss_fn, parts.scaler, to_input(imgs, dev, sem.channels_last),
                           targets, sem.world_size, parts.amp_dtype)
        if (i + 1) % sem.accumulate == 0 or i == nb - 1:
            optimizer_step(parts, tcfg.clip_grad_norm)
        loss_sum += items
        if i >= warmup_steps:
            images += len(imgs)
        elif i == warmup_steps - 1:  # the window starts where the loop would request batch warmup_steps
            sync()
            t0 = time.perf_counter()
        if max_steps is not None and i + 1 >= max_steps:
            break
    sync()
    end = time.perf_counter()
    return {"epoch_s": end - t_epoch, "steady_images_per_s": images / (end - t0) if t0 is not None else 0.0,
            "loss_finite": bool(torch.isfinite(loss_sum).all())}


def instrumented_epoch(parts: Any, loader: Any, epoch: int, sem: Any, tcfg: Any, dev: Any,
                       warmup_steps: int) -> dict:
    """One epoch of the real loop (``train_one_epoch``), as ``detscale train`` runs it."""
    from detscale.engine.timing import RankTiming
    from detscale.engine.trainer import Progress, StopFlag, train_one_epoch

    timing = RankTiming(warmup_steps)
    sync()
    t0 = time.perf_counter()
    result = train_one_epoch(parts, loader, epoch, Progress(), sem, tcfg, dev, timing, StopFlag())
    sync()
    busy = timing.data_wait_seconds + timing.compute_seconds
    return {"epoch_s": time.perf_counter() - t0, "steady_images_per_s": timing.images_per_s,
            "data_wait_share": timing.data_wait_seconds / busy if busy else 0.0,
            "loss_finite": all(v == v and abs(v) != float("inf") for v in result.losses)}


def section_throughput(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    import torch

    from detscale import config, dist
    from detscale.data.formats import load_spec
    from detscale.engine.semantics import derive_semantics
    from detscale.engine.trainer import build_loaders, build_parts

    dev = device()
    paths = data_paths(kit.work)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    torch.backends.cudnn.benchmark = dev.type == "cuda"
    info = dist.init_from_env(600, cpu_threads=None)
    nc = load_spec(paths.data_yaml, splits=()).nc
    rows = []
    for model, batch in sizes.throughput_points():
        if kit.left() < 25:
            rows.append({"model": model, "batch": batch, "skipped": "budget"})
            continue
        cfg_path = write_config(kit.work / "throughput" / f"{model}-{batch}.yaml", data_yaml=paths.data_yaml,
                                model=model, imgsz=sizes.imgsz, batch=batch, precision=precision,
                                workers=sizes.workers, warmup_epochs=0, nominal=batch, epochs=100,
                                warmup_steps=sizes.tp_warmup_steps)
        cfg = config.load(cfg_path)
        point = cfg.runs()[0]
        sem = derive_semantics(cfg, point, 1, dev.type)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        parts = build_parts(point, nc, sem, cfg.train, info)
        loader, _ = build_loaders(point, cfg, paths.data_yaml, paths.cache_dir, sem, info, with_val=False)
        # workers started, cuDNN autotuned for this shape, allocator grown: a few steps suffice
        warm = bare_epoch(parts, loader, 0, sem, cfg.train, dev, sizes.tp_warmup_steps, sizes.tp_warmup_steps + 5)
        on, off = [], []
        for r in range(sizes.tp_rounds):
            order = ("on", "off") if (r + len(rows)) % 2 == 0 else ("off", "on")
            for mode in order:
                epoch = 1 + len(on) + len(off)
                if mode == "on":
                    on.append(instrumented_epoch(parts, loader, epoch, sem, cfg.train, dev,
                                                 sizes.tp_warmup_steps))
                else:
                    off.append(bare_epoch(parts, loader, epoch, sem, cfg.train, dev, sizes.tp_warmup_steps))
        row: dict[str, Any] = {
            "model": model, "batch": batch, "precision": precision, "channels_last": True,
            "steps_per_epoch": len(loader), "warmup_steps_excluded": sizes.tp_warmup_steps, "rounds": len(on),
            "warm_epoch_s": round(warm["epoch_s"], 2),
            "instrumented_images_per_s": statistics.median(e["steady_images_per_s"] for e in on),
            "bare_images_per_s": statistics.median(e["steady_images_per_s"] for e in off),
            "instrumented_epoch_s": statistics.median(e["epoch_s"] for e in on),
            "bare_epoch_s": statistics.median(e["epoch_s"] for e in off),
            "data_wait_share": statistics.median(e["data_wait_share"] for e in on),
            "loss_finite": all(e["loss_finite"] for e in on + off + [warm]),
        }
        # the instrument's cost: wall time of the same epoch with and without it
        row["instrument_cost"] = row["instrumented_epoch_s"] / row["bare_epoch_s"] - 1
        if dev.type == "cuda":
            row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
            row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(dev) / 2**30, 2)
        rows.append(row)
        print(f"  {model} b{batch}: {row['instrumented_images_per_s']:.0f} img/s instrumented, "
              f"{row['bare_images_per_s']:.0f} bare, data wait {100 * row['data_wait_share']:.0f}%", flush=True)
        del parts, loader
    failed = any(not r.get("loss_finite", True) for r in rows)
    return {"imgsz": sizes.imgsz, "workers": sizes.workers, "rows": rows, "failed": failed}


# ---------------------------------------------------------------------------------------------
# profile: where one training step's time goes, without the loader
# ---------------------------------------------------------------------------------------------


def section_profile(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    """One model's step split into forward, loss, backward, optimiser (+ EMA), and the top operators.

    The input batch stays on the device (no loader): what is left is the step itself. Each part is
    timed with a synchronisation around it over ``repeats`` steps; then ``torch.profiler`` records
    three whole steps and lists the operators by self CPU time and by device time.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from detscale import config, dist
    from detscale.engine.semantics import derive_semantics
    from detscale.engine.trainer import build_parts, to_input

    dev = device()
    paths = data_paths(kit.work)
    precision = "bf16" if dev.type == "cuda" else "fp32"
    model = sizes.tp_models[0]
    batch = sizes.tp_batches[1]
    torch.backends.cudnn.benchmark = dev.type == "cuda"
    cfg_path = write_config(kit.work / "profile" / "config.yaml", data_yaml=paths.data_yaml, model=model,
                            imgsz=sizes.imgsz, batch=batch, precision=precision, workers=0, warmup_epochs=0,
                            nominal=batch)
    cfg = config.load(cfg_path)
    point = cfg.runs()[0]
    sem = derive_semantics(cfg, point, 1, dev.type)
    parts = build_parts(point, 80, sem, cfg.train, dist.init_from_env(600))
    x = to_input(torch.randint(0, 255, (batch, 3, sizes.imgsz, sizes.imgsz), dtype=torch.uint8), dev, True)
    targets = fake_targets(batch, 80, dev)

    def step(timed: dict[str, float] | None) -> None:
        marks = [time.perf_counter()]

        def mark() -> None:
            if timed is not None:
                sync()
                marks.append(time.perf_counter())

        with torch.autocast(dev.type, dtype=parts.amp_dtype or torch.float32, enabled=parts.amp_dtype is not None):
            preds = parts.model(x)
            mark()
            loss, _items = parts.loss_fn(preds, targets)
            mark()
        parts.scaler.scale(loss).backward()
        mark()
        parts.scaler.unscale_(parts.optimizer)
        torch.nn.utils.clip_grad_norm_(parts.raw.parameters(), max_norm=cfg.train.clip_grad_norm)
        parts.scaler.step(parts.optimizer)
        parts.scaler.update()
        parts.optimizer.zero_grad(set_to_none=True)
        mark()
        parts.ema.update(parts.raw)
        mark()
        if timed is not None:
            for name, a, b in zip(("forward", "loss", "backward", "optimizer", "ema"), marks, marks[1:], strict=False):
                timed[name] = timed.get(name, 0.0) + (b - a) * 1000

    parts.model.train()
    for _ in range(3):  # warm-up: cudnn autotuning, allocator growth
        step(None)
    sync()
    repeats = 5
    timed: dict[str, float] = {}
    for _ in range(repeats):
        step(timed)
    parts_ms = {k: round(v / repeats, 2) for k, v in timed.items()}
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step(None)
    sync()
    unsynced_ms = (time.perf_counter() - t0) * 1000 / repeats
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step(None)
        sync()
    events = prof.key_averages()
    device_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"

    def top(key: str) -> list[dict[str, Any]]:
        rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:25]
        return [{"op": e.key, "calls_per_step": e.count / 3, "self_cpu_ms_per_step": e.self_cpu_time_total / 3000,
                 "self_device_ms_per_step": getattr(e, device_attr, 0) / 3000} for e in rows]

    kernels = sum(e.count for e in events if getattr(e, device_attr, 0) > 0) / 3
    return {"model": model, "batch": batch, "imgsz": sizes.imgsz, "precision": precision, "ms_per_part": parts_ms,
            "step_ms_unsynchronised": round(unsynced_ms, 2), "images_per_s": batch * 1000 / unsynced_ms,
            "ops_with_device_time_per_step": kernels, "top_self_cpu": top("self_cpu_time_total"),
            "top_self_device": top(device_attr)}


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(results: dict[str, Any]) -> str:
    s = results["sections"]
    lines = [f"# detscale GPU check ({'tiny CPU self-test' if results['tiny'] else 'full'})", "",
             f"started {results['started']}, finished {results.get('finished', '-')}", "",
             "| section | status | seconds | note |", "|---|---|---|---|"]
    for name in SECTIONS:
        if name in s:
            r = s[name]
            note = r.get("error") or r.get("reason") or "; ".join(r.get("problems", [])) or ""
            lines.append(f"| {name} | {r['status']} | {_fmt(r.get('seconds'))} | {note[:200]} |")
    env = s.get("env", {})
    if env.get("status") == "ok" and env.get("device") == "cpu":
        lines += ["", f"No CUDA device: CPU ranks, torch {env.get('torch')}, Python {env.get('python')}, "
                      f"{env.get('cpu_cores_logical')} CPUs ({env.get('cpu_model')})"]
    elif env.get("status") == "ok":
        lines += ["", f"GPU: {env.get('gpu_model')} ({env.get('gpu_memory_gib')} GiB), driver {env.get('driver')}, "
                      f"torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, NCCL "
                      f"{env.get('nccl')}, Python {env.get('python')}, {env.get('cpu_cores_logical')} CPUs "
                      f"({env.get('cpu_model')})"]
    models = s.get("models", {})
    if models.get("combos"):
        lines += ["", f"## Models: forward + backward at {models['imgsz']} px, batch {models['batch']} "
                      f"({models['passed']}/{models['total']} passed)", "",
                  "| model | precision | channels_last | loss | grad norm | head dtype | s | ok |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in models["combos"]:
            lines.append(f"| {c['model']} | {c['precision']} | {c['channels_last']} | {_fmt(c.get('loss'), 3)} | "
                         f"{_fmt(c.get('grad_norm'), 2)} | {c.get('pred_dtype', '-')} | {_fmt(c.get('seconds'), 2)} | "
                         f"{'yes' if c['ok'] else 'NO: ' + str(c.get('problems') or c.get('error'))[:120]} |")
    launch = s.get("launch", {})
    if "images_per_s" in launch:
        lines += ["", f"## detscale launch --gpus 1 -- train, then evaluate ({launch['run']})", "",
                  f"train {launch['train_wall_s']} s wall, {launch['images_per_s']:.1f} img/s steady state, "
                  f"data wait {100 * launch['data_wait_share']:.1f} %, epochs {launch['epoch_seconds']} s, backend "
                  f"{launch['backend']}; evaluate {launch['eval_wall_s']} s wall, mAP@0.5 {_fmt(launch['map50'], 4)}, "
                  f"mAP@0.5:0.95 {_fmt(launch['map50_95'], 4)} (2 epochs: a smoke test, not an accuracy figure)"]
    for name in ("nccl", "ddp"):
        g = s.get(name, {})
        if "steps" in g:
            lines += ["", f"## {name}: {g['world_size']} rank(s), backend {g['backend']}, {g['device']}, "
                          f"{g['precision']}", "",
                      f"{g['steps']} steps in {g['epoch_seconds']} s; {g['tensors_compared']} tensors compared, "
                      f"{len(g['tensors_differing'])} differ; all-reduce {'ok' if g['all_reduce_ok'] else 'WRONG'}"]
    loader = s.get("loader", {})
    if loader.get("rows"):
        lines += ["", f"## Loader ceiling at {loader['imgsz']} px, mosaic {loader['mosaic']}, {loader['cpus']} CPUs",
                  "", "| cache | workers | img/s | first batch s |", "|---|---|---|---|"]
        for r in loader["rows"]:
            lines.append(f"| {r['cache']} | {r['workers']} | {r['images_per_s']:.0f} | {r['first_batch_s']} |")
    tp = s.get("throughput", {})
    if tp.get("rows"):
        lines += ["", f"## Training throughput at {tp['imgsz']} px, 1 rank, cache disk, {tp['workers']} workers",
                  "", "| model | batch | img/s (loop) | img/s (no per-step instrument) | epoch s loop / bare | "
                      "instrument cost | data wait | peak alloc GiB | peak reserved GiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in tp["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['model']} | {r['batch']} | skipped ({r['skipped']}) | | | | | | |")
                continue
            lines.append(f"| {r['model']} | {r['batch']} | {r['instrumented_images_per_s']:.0f} | "
                         f"{r['bare_images_per_s']:.0f} | {r['instrumented_epoch_s']:.2f} / {r['bare_epoch_s']:.2f} | "
                         f"{100 * r['instrument_cost']:+.1f} % | {100 * r['data_wait_share']:.1f} % | "
                         f"{_fmt(r.get('peak_allocated_gib'), 2)} | {_fmt(r.get('peak_reserved_gib'), 2)} |")
    prof = s.get("profile", {})
    if prof.get("ms_per_part"):
        split = ", ".join(f"{k} {v:.1f}" for k, v in prof["ms_per_part"].items())
        lines += ["", f"## One step of {prof['model']} at {prof['imgsz']} px, batch {prof['batch']}, "
                      f"{prof['precision']}, input on the device", "",
                  f"{prof['step_ms_unsynchronised']:.1f} ms per step without synchronisation "
                  f"({prof['images_per_s']:.0f} img/s); synchronised parts (ms): {split}", "",
                  "| op (top by self CPU time) | calls/step | self CPU ms/step | self device ms/step |",
                  "|---|---|---|---|"]
        for r in prof["top_self_cpu"][:12]:
            lines.append(f"| {r['op'][:60]} | {r['calls_per_step']:.0f} | {r['self_cpu_ms_per_step']:.2f} | "
                         f"{r['self_device_ms_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder for gpu_check.json, gpu_check.md and the work files")
    p.add_argument("--tiny", action="store_true", help="CPU self-test sizes (64 px, a few images)")
    p.add_argument("--budget-s", type=float, default=450.0, help="stop starting sections after this (default 450)")
    p.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)}")
    p.add_argument("--wheels", type=Path, help="folder of carried wheels to install (see the module docstring)")
    p.add_argument("--fetch-wheels", type=Path, metavar="DIR", help="download the wheels into DIR and exit")
    p.add_argument("--python-version", default="3.12", help="target Python of --fetch-wheels (default 3.12)")
    p.add_argument("--work", type=Path, help="folder for datasets, caches and runs (default OUT/work; deleted at "
                                            "the end unless --keep-work)")
    p.add_argument("--throughput-points", default="", metavar="MODEL:BATCH,...",
                   help="throughput only at these points (default: every model x batch of the kit)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder")
    args = p.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.fetch_wheels, args.python_version)
    if args.out is None:
        p.error("--out is required")
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    wanted = set(only or SECTIONS) | {"env"}
    if wanted & NEEDS_DATA:
        wanted.add("data")

    prepare_paths(args.wheels.resolve() if args.wheels else None)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    kit = Kit(out, (args.work or out / "work").resolve(), args.budget_s, args.tiny)
    kit.work.mkdir(parents=True, exist_ok=True)
    sizes = sizes_for(args.tiny, os.cpu_count() or 1)
    if args.throughput_points:
        points = [tuple(x.split(":")) for x in args.throughput_points.split(",")]
        sizes = replace(sizes, tp_points=tuple((m, int(b)) for m, b in points))
    kit.results["sizes"] = sizes.__dict__
    os.environ.setdefault("DETSCALE_GPU_LOCK_DIR", str(kit.work / "gpu-locks"))
    plan: list[tuple[str, float, Callable[[], dict[str, Any]]]] = [
        ("env", 0, section_env),
        ("models", 20, lambda: section_models(sizes)),
        ("data", 20, lambda: section_data(kit, sizes)),
        ("launch", 40, lambda: section_launch(kit, sizes)),
        ("nccl", 15, lambda: run_group(kit, sizes, "nccl", 1, "nccl" if device().type == "cuda" else "gloo")),
        ("ddp", 20, lambda: run_group(kit, sizes, "ddp", 2, "gloo")),
        ("loader", 30, lambda: section_loader(kit, sizes)),
        ("throughput", 40, lambda: section_throughput(kit, sizes)),
        ("profile", 20, lambda: section_profile(kit, sizes)),
    ]
    for name, need_s, fn in plan:
        if name not in wanted:
            continue
        if name in NEEDS_DATA and kit.results["sections"].get("data", {}).get("status") != "ok":
            kit.results["sections"][name] = {"status": "skipped", "reason": "no dataset (section data failed)"}
            kit.write()
            continue
        kit.section(name, need_s if not args.tiny else 0, fn)
    if not args.keep_work:
        shutil.rmtree(kit.work, ignore_errors=True)
    statuses = {n: r["status"] for n, r in kit.results["sections"].items()}
    print(f"[gpu_check] done: {statuses}; {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    return 0 if all(v == "ok" for v in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
