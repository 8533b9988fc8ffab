"""Lockstep runs: detscale's and Ultralytics' training loops fed the same batches from the same weights.

The parity benchmark (bench_parity.py) compares where two trainers end; this one compares how
they get there, optimiser step by optimiser step, so that a gap is located to a component
instead of argued about from seeds. Each trainer runs its own, unmodified loop (detscale's
``detscale.engine.trainer.train``, Ultralytics' ``BaseTrainer._do_train``); only the loader is
swapped, and hooks on the optimiser read what happens:

- a run on its **own** loader records every batch it trains (uint8 images and targets);
- a run on the **other** trainer's batches replays them, in the same order and epochs;
- per optimiser step both record the loss items of the batches it accumulated, the gradient
  norm before clipping, the learning rates of the three parameter groups, which batches went
  into it, and a snapshot of the weights (8 MB a step for gelan-t-detect);
- the **floor**: detscale again on its own batches from weights perturbed by ``--perturb``
  (relative, about one float32 ulp): how fast two runs of one trainer drift apart from
  rounding alone. A trainer pair that stays near the floor computes the same thing.

Five runs (``d`` = detscale's batches, ``u`` = Ultralytics'): D(d) and U(u) on their own
loaders, U(d) and D(u) on the other's batches, D'(d) the floor. Read as a 2 x 2 (trainer x
data), the final EMA weights' mAP (all scored by detscale's evaluator on the same validation
set) separate the two ways a gap can arise: the optimisation (D vs U on the same batches) and
the data pipeline (d vs u for the same trainer).

    .venv/bin/python benchmarks/bench_lockstep.py --family shapes --steps 200 --work results/lockstep

Runs go two at a time on two cores (``--jobs``, ``--threads``); the report is ``WORK/lockstep.md``
and ``WORK/lockstep.json``. Ultralytics (AGPL-3.0) is imported only in its run's subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

RUNS = {  # name: (trainer, batches, perturbed)
    "D(d)": ("detscale", "detscale", False),
    "U(u)": ("ultralytics", "ultralytics", False),
    "U(d)": ("ultralytics", "detscale", False),
    "D(u)": ("detscale", "ultralytics", False),
    "D'(d)": ("detscale", "detscale", True),
}
FLOOR = "D'(d)"
# Pairs compared step by step: (A, B, what differs).
PAIRS = [("D(d)", "U(d)", "trainer, detscale's batches"), ("U(u)", "D(u)", "trainer, Ultralytics' batches"),
         ("D(d)", "D'(d)", "floor: detscale vs itself from perturbed weights")]


class StopLockstep(Exception):  # noqa: N818 - a signal, not an error
    """Raised from the optimiser hook once the requested number of steps is done."""


def run_dir(work: Path, name: str) -> Path:
    return work / "runs" / name.replace("'", "p").replace("(", "_").replace(")", "")


# ---- batches on disk ----------------------------------------------------------------------------


class BatchWriter:
    """Appends (images uint8 [B, 3, H, W], targets float32 [n, 6]) batches to ``folder``."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.images = open(folder / "images.u8", "wb")  # noqa: SIM115 - closed in close()
        self.targets: list[np.ndarray] = []
        self.index: list[dict[str, int]] = []
        self.shape: list[int] | None = None

    def add(self, epoch: int, i: int, imgs: torch.Tensor, targets: torch.Tensor) -> None:
        arr = imgs.numpy().astype(np.uint8, copy=False)
        if self.shape is None:
            self.shape = list(arr.shape)
        if list(arr.shape) != self.shape:
            raise SystemExit(f"batch {epoch}:{i} has shape {arr.shape}, earlier ones {self.shape}")
        self.images.write(np.ascontiguousarray(arr).tobytes())
        t = targets.numpy().astype(np.float32)
        self.index.append({"epoch": epoch, "i": i, "offset": sum(len(x) for x in self.targets), "n": len(t)})
        self.targets.append(t)

    def close(self) -> None:
        self.images.close()
        np.save(self.folder / "targets.npy", np.concatenate(self.targets) if self.targets else np.zeros((0, 6)))
        (self.folder / "index.json").write_text(json.dumps({"shape": self.shape, "batches": self.index}))


class Batches:
    """Recorded batches, by epoch: ``epoch(e)`` lists that epoch's (images, targets) in training order."""

    def __init__(self, folder: Path) -> None:
        meta = json.loads((folder / "index.json").read_text())
        self.index = meta["batches"]
        self.images = np.memmap(folder / "images.u8", np.uint8, "r", shape=(len(self.index), *meta["shape"]))
        self.targets = np.load(folder / "targets.npy")

    def epoch(self, e: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for k, b in enumerate(self.index):
            if b["epoch"] == e:
                t = self.targets[b["offset"]:b["offset"] + b["n"]]
                out.append((torch.from_numpy(np.array(self.images[k])), torch.from_numpy(t.copy())))
        return out

    def per_epoch(self) -> int:
        return sum(1 for b in self.index if b["epoch"] == self.index[0]["epoch"])


# ---- what both runs record ----------------------------------------------------------------------


def values_of(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state in the positional order both architectures share (bench_parity.load_by_position)."""
    return [(k, v) for k, v in model.state_dict().items() if ".dfl." not in k]


def flat_parameters(model: torch.nn.Module) -> np.ndarray:
    """Trainable tensors (BatchNorm running statistics and counters excluded), flattened, float32."""
    return torch.cat([v.detach().reshape(-1).float() for k, v in values_of(model)
                      if v.dtype.is_floating_point and not k.endswith(("running_mean", "running_var"))]).numpy()


class Recorder:
    """Per optimiser step: loss items of its batches, gradient norm before clipping, lrs, batches, weights.

    Once ``steps`` optimiser steps are done, the run trains on to the end of that epoch (so that a
    recording holds whole epochs, enough for the other loop to reach ``steps`` on them too) and
    stops at the first batch of the next one; a replay stops where its recording ends.
    """

    #: Snapshot rows allocated beyond ``steps`` (the rest of the last epoch); a sparse file on disk.
    SPARE_STEPS = 400

    def __init__(self, out: Path, steps: int, model_fn: Any, ema_fn: Any) -> None:
        self.out, self.steps, self.model_fn, self.ema_fn = out, steps, model_fn, ema_fn
        self.rows: list[dict[str, Any]] = []
        self.items: list[list[float]] = []
        self.batches: list[str] = []
        self.norm: float | None = None
        self.lrs: dict[str, float] = {}
        self.where = (0, 0)
        self.reached_in: int | None = None  # epoch in which ``steps`` was reached
        self.snaps: np.memmap | None = None
        self.t0 = time.perf_counter()

    def on_batch(self, epoch: int, i: int) -> None:
        if self.reached_in is not None and epoch != self.reached_in:
            self.stop()
        self.where = (epoch, i)
        self.batches.append(f"{epoch}:{i}")

    def on_loss(self, items: list[float]) -> None:
        self.items.append(items)

    def on_clip(self, norm: float) -> None:
        self.norm = norm

    def pre_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.lrs = {str(g.get("name") or g.get("param_group")): float(g["lr"]) for g in optimizer.param_groups}

    def start(self) -> None:
        w0 = flat_parameters(self.model_fn())
        self.snaps = np.lib.format.open_memmap(self.out / "weights.npy", "w+", np.float32,
                                               (self.steps + self.SPARE_STEPS + 1, len(w0)))
        self.snaps[0] = w0

    def post_step(self, *_: Any) -> None:
        step = len(self.rows) + 1
        items = np.mean(self.items, axis=0).tolist() if self.items else [math.nan] * 3
        self.rows.append({"step": step, "epoch": self.where[0], "batches": self.batches, "loss": items,
                          "loss_total": sum(items), "grad_norm": self.norm, "lr": self.lrs,
                          "seconds": time.perf_counter() - self.t0})
        self.items, self.batches, self.norm = [], [], None
        assert self.snaps is not None
        if step < len(self.snaps):
            self.snaps[step] = flat_parameters(self.model_fn())
        if step % 10 == 0:
            print(f"step {step}/{self.steps}: loss {sum(items):.4f} [{time.perf_counter() - self.t0:.0f} s]",
                  flush=True)
        if step == self.steps:
            self.reached_in = self.where[0]

    def stop(self) -> None:
        """Write what was recorded and end the run (raises :class:`StopLockstep`)."""
        assert self.snaps is not None
        self.snaps.flush()
        from detscale.files import save_torch

        save_torch([v.detach().clone() for _, v in values_of(self.ema_fn())], self.out / "ema.pt")
        (self.out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        raise StopLockstep


def until_stopped(train: Any, recorder: Recorder, writer: BatchWriter | None) -> None:
    """Train until the recorder stops the run; if the schedule ends first, keep what was recorded
    (main() then says the schedule was too short for the steps asked)."""
    try:
        train()
        recorder.stop()
    except StopLockstep:
        pass
    finally:
        if writer is not None:
            writer.close()


def hook_clip(recorder: Recorder) -> None:
    """Read the gradient norm that clipping computes (both trainers call torch.nn.utils.clip_grad_norm_)."""
    original = torch.nn.utils.clip_grad_norm_

    def clip(*args: Any, **kwargs: Any) -> torch.Tensor:
        norm = original(*args, **kwargs)
        recorder.on_clip(float(norm))
        return norm

    torch.nn.utils.clip_grad_norm_ = clip


def load_init(model: torch.nn.Module, values: list[torch.Tensor], perturb: float, seed: int) -> None:
    from bench_parity import load_by_position

    if perturb:
        g = torch.Generator().manual_seed(seed + 7919)
        values = [v * (1 + perturb * torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype))
                  if v.dtype.is_floating_point else v for v in values]
    load_by_position(model, values)


# ---- detscale's run -----------------------------------------------------------------------------


class RecordingLoader:
    """detscale's own loader, recording what it yields."""

    def __init__(self, loader: Any, writer: BatchWriter | None, recorder: Recorder) -> None:
        self.loader, self.writer, self.recorder = loader, writer, recorder
        self.sampler = loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for i, (imgs, targets, metas) in enumerate(self.loader):
            epoch = self.sampler.epoch
            if self.writer is not None:  # kept flat [n, 6], the form both trainers' replays read
                from detscale.loss import flat_targets

                self.writer.add(epoch, i, imgs, flat_targets(targets) if targets.dim() == 3 else targets)
            self.recorder.on_batch(epoch, i)
            yield imgs, targets, metas


class ReplayLoader:
    """Recorded batches through detscale's loop: the epoch comes from ``set_epoch``, as the sampler's does."""

    def __init__(self, batches: Batches, recorder: Recorder) -> None:
        from detscale.data.loader import TrainSampler

        self.batches, self.recorder = batches, recorder
        n = batches.per_epoch()
        self.sampler = TrainSampler(range(n), 1, 0, 0, batch_size=1, accumulate=1)

    def __len__(self) -> int:
        return self.batches.per_epoch()

    def __iter__(self) -> Iterator[Any]:
        epoch = self.sampler.epoch
        recorded = self.batches.epoch(epoch)
        for i, (imgs, targets) in enumerate(recorded):
            self.recorder.on_batch(epoch, i)
            yield imgs, targets, [{}] * len(imgs)
        if len(recorded) < len(self):
            self.recorder.stop()  # the recording ends here


def run_detscale(args: argparse.Namespace, out: Path) -> None:
    from bench_parity import DETSCALE_CONFIG, lr0_auto

    import detscale.engine.trainer as trainer
    from detscale.data.formats import load_spec
    from detscale.loss import DetectionLoss

    data_yaml = Path(args.data)
    nc = load_spec(data_yaml, splits=()).nc
    cfg = out / "config.yaml"
    cfg.write_text(DETSCALE_CONFIG.format(data_yaml=data_yaml, model="gelan-t-detect", imgsz=args.imgsz,
                                          batch=args.batch, epochs=args.epochs, seed=args.seed, lr0=lr0_auto(nc),
                                          close_mosaic=args.close_mosaic, workers=args.workers,
                                          threads=args.threads))
    holder: dict[str, Any] = {}
    recorder = Recorder(out, args.steps, lambda: holder["parts"].raw, lambda: holder["parts"].ema.module)
    hook_clip(recorder)
    loss_call = DetectionLoss.__call__

    def loss(self: DetectionLoss, preds: Any, targets: torch.Tensor) -> Any:
        total, items = loss_call(self, preds, targets)
        recorder.on_loss(items.tolist())
        return total, items

    DetectionLoss.__call__ = loss
    build_parts, build_loaders = trainer.build_parts, trainer.build_loaders
    init = torch.load(args.init)

    def parts_with_hooks(*a: Any, **k: Any) -> Any:
        parts = build_parts(*a, **k)
        load_init(parts.raw, init, args.perturb, args.seed)
        load_init(parts.ema.module, init, args.perturb, args.seed)
        parts.optimizer.register_step_pre_hook(recorder.pre_step)
        parts.optimizer.register_step_post_hook(recorder.post_step)
        holder["parts"] = parts
        recorder.start()
        return parts

    writer = BatchWriter(Path(args.record)) if args.record else None

    def loaders(*a: Any, **k: Any) -> Any:
        if args.batches == "native":
            real, _ = build_loaders(*a, **k)
            return RecordingLoader(real, writer, recorder), None
        return ReplayLoader(Batches(Path(args.batches)), recorder), None

    trainer.build_parts, trainer.build_loaders = parts_with_hooks, loaders
    request = trainer.TrainRequest(config_path=cfg, run_id=f"gelan-t-detect_{args.imgsz}_g1_b{args.batch}_none_fp32_"
                                   f"s{args.seed}_r0", out_dir=out / "run", data_yaml=data_yaml)
    until_stopped(lambda: trainer.train(request), recorder, writer)


# ---- Ultralytics' run ---------------------------------------------------------------------------


class UltralyticsRecordingLoader:
    """Ultralytics' own loader (close_mosaic and reset reach it), recording its batches."""

    def __init__(self, loader: Any, trainer: Any, writer: BatchWriter | None, recorder: Recorder) -> None:
        self._loader, self._trainer, self._writer, self._recorder = loader, trainer, writer, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[dict]:
        for i, batch in enumerate(self._loader):
            epoch = self._trainer.epoch
            if self._writer is not None:
                targets = torch.cat((batch["batch_idx"].view(-1, 1).float(), batch["cls"].view(-1, 1).float(),
                                     batch["bboxes"].float()), 1)
                self._writer.add(epoch, i, batch["img"], targets)
            self._recorder.on_batch(epoch, i)
            yield batch


class UltralyticsReplayLoader:
    """Recorded batches in Ultralytics' batch format, for the epoch the trainer is in."""

    def __init__(self, loader: Any, trainer: Any, batches: Batches, recorder: Recorder) -> None:
        self._loader, self._trainer, self._batches, self._recorder = loader, trainer, batches, recorder
        self.num_workers = 0

    @property
    def dataset(self) -> Any:
        return self._loader.dataset

    def reset(self) -> None:
        pass

    def __len__(self) -> int:
        return self._batches.per_epoch()

    def __iter__(self) -> Iterator[dict]:
        epoch = self._trainer.epoch
        recorded = self._batches.epoch(epoch)
        if len(recorded) < len(self):
            self._recorder.stop()  # the recording ends here (Ultralytics needs whole epochs)
        for i, (imgs, t) in enumerate(recorded):
            self._recorder.on_batch(epoch, i)
            yield {"img": imgs, "batch_idx": t[:, 0], "cls": t[:, 1:2], "bboxes": t[:, 2:6],
                   "im_file": [""] * len(imgs), "ori_shape": [tuple(imgs.shape[2:])] * len(imgs),
                   "resized_shape": [tuple(imgs.shape[2:])] * len(imgs)}


def run_ultralytics(args: argparse.Namespace, out: Path) -> None:
    os.environ["YOLO_OFFLINE"] = "1"
    os.environ["YOLO_CONFIG_DIR"] = str(out / "ultralytics-config")
    torch.set_num_threads(args.threads)
    from bench_parity import absolute_data_yaml
    from ultralytics import YOLO
    from ultralytics.utils.loss import v8DetectionLoss

    holder: dict[str, Any] = {}
    recorder = Recorder(out, args.steps, lambda: holder["trainer"].model, lambda: holder["trainer"].ema.ema)
    hook_clip(recorder)
    loss_call = v8DetectionLoss.__call__

    def loss(self: Any, preds: Any, batch: dict) -> Any:
        total, items = loss_call(self, preds, batch)
        recorder.on_loss([float(v) for v in items.values()])
        return total, items

    v8DetectionLoss.__call__ = loss
    init = torch.load(args.init)
    writer = BatchWriter(Path(args.record)) if args.record else None

    def setup(trainer: Any) -> None:
        holder["trainer"] = trainer
        load_init(trainer.model, init, args.perturb, args.seed)
        load_init(trainer.ema.ema, init, args.perturb, args.seed)
        trainer.optimizer.register_step_pre_hook(recorder.pre_step)
        trainer.optimizer.register_step_post_hook(recorder.post_step)
        if args.batches == "native":
            trainer.train_loader = UltralyticsRecordingLoader(trainer.train_loader, trainer, writer, recorder)
        else:
            trainer.train_loader = UltralyticsReplayLoader(trainer.train_loader, trainer, Batches(Path(args.batches)),
                                                           recorder)
        recorder.start()

    model = YOLO("yolov9t.yaml")
    model.add_callback("on_pretrain_routine_end", setup)
    recipe = dict(data=str(absolute_data_yaml(Path(args.data), out)), epochs=args.epochs, imgsz=args.imgsz,
                  batch=args.batch, device="cpu", workers=args.workers, seed=args.seed, deterministic=True,
                  optimizer="auto", close_mosaic=args.close_mosaic, cache=False, amp=False, val=False,
                  plots=False, project=str(out), name="train", exist_ok=True, verbose=False, mosaic=1.0,
                  mixup=0.0, scale=0.5, translate=0.1, fliplr=0.5, flipud=0.0, degrees=0.0, shear=0.0,
                  perspective=0.0, hsv_h=0.015, hsv_s=0.7, hsv_v=0.4, box=7.5, cls=0.5, dfl=1.5, nbs=64,
                  weight_decay=0.0005, warmup_epochs=3, lrf=0.01, cos_lr=False)
    until_stopped(lambda: model.train(**recipe), recorder, writer)


# ---- comparing ----------------------------------------------------------------------------------


def read_run(folder: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]
    return {"rows": rows, "snaps": np.load(folder / "weights.npy", mmap_mode="r")}


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per step of run A, the step of run B that ended on the same batch: both losses, gradient norms,
    weight-group lrs, whether they accumulated the same batches, and their weight distance relative to
    the distance run A has moved from the start. (The loops may group warm-up batches differently,
    so the step indices drift apart; the batches say which steps correspond.)"""
    out = []
    w0 = np.asarray(a["snaps"][0], np.float64)
    by_end = {rb["batches"][-1]: rb for rb in b["rows"] if rb["batches"]}
    for ra in a["rows"]:
        rb = by_end.get(ra["batches"][-1]) if ra["batches"] else None
        if rb is None:
            continue
        wa = np.asarray(a["snaps"][ra["step"]], np.float64)
        wb = np.asarray(b["snaps"][rb["step"]], np.float64)
        moved = float(np.linalg.norm(wa - w0))
        out.append({"step": ra["step"], "step_b": rb["step"], "epoch": ra["epoch"], "loss_a": ra["loss_total"],
                    "loss_b": rb["loss_total"], "loss_rel": rb["loss_total"] / ra["loss_total"] - 1,
                    "grad_a": ra["grad_norm"], "grad_b": rb["grad_norm"], "lr_a": ra["lr"].get("weight"),
                    "lr_b": rb["lr"].get("weight"), "same_batches": ra["batches"] == rb["batches"],
                    "n_batches": (len(ra["batches"]), len(rb["batches"])),
                    "weight_dist": float(np.linalg.norm(wa - wb)) / moved if moved else math.nan})
    return out


def per_epoch_loss(run: dict[str, Any]) -> dict[int, float]:
    """Mean training loss per epoch over the batches each optimiser step accumulated (a step that spans
    an epoch boundary counts for the epoch of its last batch). Both loops train the same batches in
    every epoch, so this compares them where their optimiser steps group the batches differently."""
    sums: dict[int, list[float]] = {}
    for r in run["rows"]:
        acc = sums.setdefault(r["epoch"], [0.0, 0])
        acc[0] += r["loss_total"] * len(r["batches"])
        acc[1] += len(r["batches"])
    return {e: total / n for e, (total, n) in sorted(sums.items()) if n}


def compare_epochs(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per epoch both runs trained completely: their mean losses and B / A - 1."""
    la, lb = per_epoch_loss(a), per_epoch_loss(b)
    complete = sorted(set(la) & set(lb))[:-1]  # the last epoch of a run stops part-way
    return [{"epoch": e, "loss_a": la[e], "loss_b": lb[e], "loss_rel": lb[e] / la[e] - 1} for e in complete]


def first_departure(rows: list[dict[str, Any]], tol: float) -> int | None:
    return next((r["step"] for r in rows if abs(r["loss_rel"]) > tol), None)


def evaluate_ema(folder: Path, data_yaml: Path, imgsz: int, gt: Path, nc: int) -> dict[str, float]:
    from bench_parity import load_by_position

    from detscale.metrics.evaluate import evaluate_model
    from detscale.model import build_model, fuse_for_inference

    net = build_model("gelan-t-detect", nc)
    load_by_position(net, torch.load(folder / "ema.pt"))
    cfg = SimpleNamespace(conf=0.001, iou=0.7, max_det=300, batch=32)
    m = evaluate_model(fuse_for_inference(net).eval(), data_yaml, "val", imgsz, cfg, gt, workers=0)
    return {"map50": m["map50"], "map50_95": m["map50_95"]}


def late_gap(rows: list[dict[str, Any]], last: int = 5) -> float:
    """Mean of B / A - 1 over the last ``last`` complete epochs (the steady reading of the loss gap)."""
    return float(np.mean([r["loss_rel"] for r in rows[-last:]])) if rows else math.nan


def pct(x: float) -> str:
    return "no complete epoch to compare" if math.isnan(x) else f"{x:+.2%}"


def report(work: Path, args: argparse.Namespace, data_yaml: Path, gt: Path, nc: int) -> str:
    names = [name for name in RUNS if name in args.runs]
    runs = {name: read_run(run_dir(work, name)) for name in names}
    scores = {name: evaluate_ema(run_dir(work, name), data_yaml, args.imgsz, gt, nc) for name in names}
    data = args.data or f"data family {args.family} (seed {args.data_seed}), {args.train} training images"
    lines = [f"# Lockstep: detscale gelan-t-detect vs Ultralytics yolov9t.yaml, {args.steps} optimiser steps", "",
             f"{data} at {args.imgsz} px, batch {args.batch}, nominal batch 64, {args.epochs}-epoch schedule "
             f"(warm-up 3 epochs with the accumulation ramp, mosaic closed for the last {args.close_mosaic}), "
             f"training seed {args.seed}, the same initial weights; {args.threads} thread(s) per run. Floor "
             f"{FLOOR}: detscale from weights perturbed by {args.perturb:g} (relative, about one float32 ulp).", ""]
    summary: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}, "pairs": {}, "runs": {}}
    floor_epochs = compare_epochs(runs["D(d)"], runs[FLOOR]) if {"D(d)", FLOOR} <= set(runs) else []
    for a, b, what in PAIRS:
        if a not in runs or b not in runs:
            continue
        steps = compare(runs[a], runs[b])
        paired = [r for r in steps if r["same_batches"]]
        until = next((r["step"] - 1 for r in steps if not r["same_batches"]), steps[-1]["step"] if steps else 0)
        epochs = compare_epochs(runs[a], runs[b])
        summary["pairs"][f"{a} vs {b}"] = {
            "what": what, "steps": steps, "epochs": epochs, "paired_steps": len(paired),
            "first_step_loss_off_1pct": first_departure(paired, 0.01),
            "late_loss_gap": late_gap(epochs), "floor_late_loss_gap": late_gap(floor_epochs)}
        lines += [f"## {a} vs {b} ({what})", "",
                  f"The loops accumulate the same batches into each optimiser step up to step {until} "
                  f"({len(paired)} steps paired by their batches); first paired step whose loss differs by more "
                  f"than 1 %: {first_departure(paired, 0.01) or 'none'}. Mean loss B / A - 1 over the last 5 "
                  f"complete epochs: {pct(late_gap(epochs))} (floor: {pct(late_gap(floor_epochs))}).", "",
                  "| step | loss A | loss B | B/A - 1 | grad norm A | grad norm B | lr A | lr B | "
                  "weight distance / distance moved |", "|---|---|---|---|---|---|---|---|---|"]
        for r in paired:
            if r["step"] <= 10 or r["step"] in (15, 20, 25, 30, until):
                lines.append(f"| {r['step']} | {r['loss_a']:.4f} | {r['loss_b']:.4f} | {r['loss_rel']:+.1e} | "
                             f"{r['grad_a']:.1f} | {r['grad_b']:.1f} | {r['lr_a']:.3g} | {r['lr_b']:.3g} | "
                             f"{r['weight_dist']:.1e} |")
        lines += ["", "| epoch | loss A | loss B | B/A - 1 | floor: D'(d) / D(d) - 1 |", "|---|---|---|---|---|"]
        floor_by = {r["epoch"]: r["loss_rel"] for r in floor_epochs}
        for r in epochs:
            floor = f"{floor_by[r['epoch']]:+.2%}" if r["epoch"] in floor_by else "-"
            lines.append(f"| {r['epoch']} | {r['loss_a']:.3f} | {r['loss_b']:.3f} | {r['loss_rel']:+.2%} | {floor} |")
        lines.append("")
    lines += ["## Trainer x data: the EMA weights after the last step, on the validation set", "",
              "| | detscale's batches (d) | Ultralytics' batches (u) |", "|---|---|---|"]

    def cell(name: str) -> str:
        if name not in runs:
            return "not run"
        return f"{scores[name]['map50_95']:.3f} / {scores[name]['map50']:.3f} / {last_epoch_loss(runs[name]):.3f}"

    for trainer, label in (("D", "detscale (D)"), ("U", "Ultralytics (U)")):
        lines.append(f"| {label} | {cell(f'{trainer}(d)')} | {cell(f'{trainer}(u)')} |")
    lines += ["", "Each cell: mAP@0.5:0.95 / mAP@0.5 (detscale's evaluator on the same validation images) / mean "
                  f"training loss of the last complete epoch. Floor run {FLOOR}: {cell(FLOOR)}.", ""]
    summary["runs"] = {name: {**scores[name], "last_epoch_loss": last_epoch_loss(runs[name]),
                              "steps": len(runs[name]["rows"])} for name in runs}
    from detscale.files import write_json, write_text

    write_json(summary, work / "lockstep.json", indent=1)
    text = "\n".join(lines) + "\n"
    write_text(text, work / "lockstep.md")
    return text


def last_epoch_loss(run: dict[str, Any]) -> float:
    """Mean training loss of the run's last complete epoch."""
    losses = per_epoch_loss(run)
    return losses[sorted(losses)[-2]] if len(losses) > 1 else math.nan


# ---- orchestration -----------------------------------------------------------------------------


def spawn(args: argparse.Namespace, work: Path, name: str, data_yaml: Path, init: Path) -> subprocess.Popen:
    trainer, batches, perturbed = RUNS[name]
    out = run_dir(work, name)
    out.mkdir(parents=True, exist_ok=True)
    native = trainer == batches
    cmd = [sys.executable, __file__, "_run", "--trainer", trainer, "--data", str(data_yaml), "--init", str(init),
           "--out", str(out), "--batches", "native" if native else str(work / f"batches-{batches}"),
           "--steps", str(args.steps), "--epochs", str(args.epochs), "--imgsz", str(args.imgsz),
           "--batch", str(args.batch), "--seed", str(args.seed), "--threads", str(args.threads),
           "--workers", str(args.workers if native else 0), "--close-mosaic", str(args.close_mosaic),
           "--perturb", str(args.perturb if perturbed else 0.0)]
    if native and not perturbed:
        cmd += ["--record", str(work / f"batches-{batches}")]
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    log = open(out / "run.log", "w")  # noqa: SIM115 - the child owns it
    print(f"start {name}: {trainer} on {batches}'s batches" + (" (perturbed)" if perturbed else ""), flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_all(args: argparse.Namespace, work: Path, data_yaml: Path, init: Path) -> None:
    def done(name: str) -> bool:
        return (run_dir(work, name) / "steps.jsonl").is_file()

    for stage in (["D(d)", "U(u)"], ["U(d)", "D(u)", "D'(d)"]):  # replays need the recordings
        queue = [n for n in stage if n in args.runs and not done(n)]
        running: list[tuple[str, subprocess.Popen]] = []
        while queue or running:
            while queue and len(running) < args.jobs:
                name = queue.pop(0)
                running.append((name, spawn(args, work, name, data_yaml, init)))
            time.sleep(2)
            for item in list(running):
                name, proc = item
                if proc.poll() is not None:
                    running.remove(item)
                    if proc.returncode != 0 or not done(name):
                        for _, other in running:
                            other.terminate()
                        log = run_dir(work, name) / "run.log"
                        raise SystemExit(f"run {name} failed ({proc.returncode}); see {log}:\n"
                                         f"{log.read_text()[-3000:]}")
                    print(f"done {name}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    one = sub.add_parser("_run", help="one run (internal)")
    for q in (p, one):
        q.add_argument("--steps", type=int, default=200)
        q.add_argument("--epochs", type=int, default=30, help="schedule length (the run stops after --steps)")
        q.add_argument("--imgsz", type=int, default=256)
        q.add_argument("--batch", type=int, default=16)
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--threads", type=int, default=1)
        q.add_argument("--workers", type=int, default=1)
        q.add_argument("--close-mosaic", type=int, default=10)
    one.add_argument("--trainer", choices=["detscale", "ultralytics"], required=True)
    one.add_argument("--data", required=True)
    one.add_argument("--init", required=True)
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--batches", default="native")
    one.add_argument("--record", default="")
    one.add_argument("--perturb", type=float, default=0.0)
    p.add_argument("--work", type=Path, default=Path("results/lockstep"))
    p.add_argument("--family", default="shapes", help="synth or a family of benchmarks/families.py")
    p.add_argument("--data", default="", metavar="DATA_YAML", help="a YOLO dataset instead of a generated family")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--train", type=int, default=448)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--perturb", type=float, default=1e-7)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                   help="the runs to make (default all five); D(d) U(d) D'(d) is the trainer comparison on "
                        "detscale's batches with its floor, in three runs")
    args = p.parse_args()
    if args.command == "_run":
        torch.set_num_threads(args.threads)
        with contextlib.suppress(StopLockstep):
            (run_detscale if args.trainer == "detscale" else run_ultralytics)(args, args.out)
        done = args.out / "steps.jsonl"
        if not done.is_file() or len(done.read_text().splitlines()) < args.steps - 4:
            raise SystemExit(f"the run ended before {args.steps} optimiser steps: lower --steps or raise --epochs")
        return 0
    from bench_parity import ground_truth, initial_weights, make_dataset

    from detscale.data.formats import load_spec

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ns = SimpleNamespace(family=args.family, data_seed=args.data_seed, train=args.train, val=args.val,
                         imgsz=args.imgsz, objects=(1, 8), object_size=(0.05, 0.5), model="gelan-t-detect",
                         data=args.data)
    data_yaml = make_dataset(work, ns)
    gt = ground_truth(data_yaml, work)
    nc = load_spec(data_yaml, splits=()).nc
    init = initial_weights(ns, nc, args.seed, work)
    needed = {RUNS[name][1] for name in args.runs}  # whose batches the asked runs train on
    args.runs = sorted(set(args.runs) | {f"{t[0].upper()}({t[0]})" for t in needed}, key=list(RUNS).index)
    run_all(args, work, data_yaml, init)
    print(report(work, args, data_yaml, gt, nc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
