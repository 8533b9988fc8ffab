"""Parity benchmark: does detscale learn like a mainstream YOLO trainer on the same data and recipe?

Trains detscale (``gelan-t-detect``) and Ultralytics (``yolov9t.yaml``, from scratch) on the same
``detscale synth`` dataset, with the same epochs, batch, image size, CPU threads and a recipe
mapped key by key (:data:`RECIPE`, printed with ``--recipe``), then evaluates both with
detscale's COCO evaluator against the same ground truth and prints one table per epoch budget:
img/s, epoch time, mAP@0.5, mAP@0.5:0.95 and detscale / Ultralytics.

Ultralytics is AGPL-3.0 and only this benchmark and the tests import it (the package never
does): ``pip install -e '.[peers]'``. It runs offline (``YOLO_OFFLINE=1``, a model built from its
yaml, no weights, no plots, so no font download).

    .venv/bin/python benchmarks/bench_parity.py --epochs 10 20 30 --seeds 0 1 [--work DIR]

By default (``--init same``) both trainers of a pair start from the same weights: detscale's
initial weights of the seed, loaded into Ultralytics' model by position (the architectures are
equal layer for layer). A pair then differs in the trainer only (loss, assigner, augmentation,
schedule, EMA), not in the draw of its initial weights, which from seed to seed moves the mAP
of these short runs as much as a trainer could; ``--init own`` lets each trainer draw its own.

Each (trainer, epochs, seed) is a separate run from scratch, so every budget has its own
learning-rate schedule; runs already finished in ``--work`` are reused (delete the folder to
start over). ``--data-seed`` draws another synthetic dataset ("data the project has not seen").
``--jobs 2 --threads 1`` trains the two runs of a pair side by side, one core each (on a 2-core
host: half the wall time of one at a time, and img/s is read under equal load).
Results go to ``WORK/summary.json`` and ``WORK/summary.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from detscale.files import save_torch, write_json, write_text

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

#: The recipe, key by key: (what it is, Ultralytics argument and value, detscale config key and value).
#: Ultralytics' ``optimizer=auto`` picks AdamW for runs under 10,000 iterations with
#: lr0 = round(0.002 * 5 / (4 + nc), 6), momentum (beta1) 0.9, and sets warmup_bias_lr to 0.
RECIPE = [
    ("architecture", "yolov9t.yaml (GELAN-T, Detect head)", "grid.model: gelan-t-detect (the same, layer for layer)"),
    ("optimiser", "optimizer=AdamW", "train.optimizer: adamw"),
    ("learning rate", "lr0=0.002*5/(4+nc)", "train.lr0: same value"),
    ("final lr fraction, linear schedule", "lrf=0.01, cos_lr=False", "train.lrf: 0.01, lr_schedule: linear"),
    ("beta1", "momentum=0.9", "train.momentum: 0.9"),
    ("weight decay at the nominal batch", "weight_decay=0.0005, nbs=64",
     "train.weight_decay: 0.0005, nominal_batch: 64"),
    ("warm-up", "warmup_epochs=3 (x batches per epoch, never the last epoch)", "train.warmup_epochs: 3 (the same)"),
    ("warm-up start lr of biases", "warmup_bias_lr=0 (auto: AdamW)", "train.warmup_bias_lr: 0"),
    ("warm-up start momentum", "warmup_momentum=0.8 (SGD only)", "train.warmup_momentum: 0.8 (SGD only)"),
    ("accumulation during warm-up", "1 rising to nbs/batch", "train.warmup_accumulate: ramp"),
    ("loss gains", "box=7.5 cls=0.5 dfl=1.5", "train.box_gain/cls_gain/dfl_gain: 7.5/0.5/1.5"),
    ("EMA", "decay 0.9999, tau 2000 (fixed)", "train.ema_decay: 0.9999, ema_tau: 2000"),
    ("gradient clipping", "max_norm 10 (fixed)", "train.clip_grad_norm: 10"),
    ("mosaic, closed for the last epochs", "mosaic=1.0, close_mosaic=10",
     "augment.mosaic: 1.0, train.close_mosaic: 10"),
    ("mixup", "mixup=0", "augment.mixup: 0"),
    ("scale, translate", "scale=0.5, translate=0.1", "augment.scale: 0.5, translate: 0.1"),
    ("HSV", "hsv_h=0.015 hsv_s=0.7 hsv_v=0.4", "augment.hsv_h/s/v: same"),
    ("flips", "fliplr=0.5, flipud=0", "augment.fliplr: 0.5 (no vertical flip)"),
    ("rotation, shear, perspective", "degrees=0 shear=0 perspective=0", "(none in detscale)"),
    ("image cache", "cache=False (decode JPEGs)", "grid.cache: none"),
    ("epoch", "every full batch; accumulation carried across epochs",
     "whole optimiser steps only; the default 448 training images (7 x 64) make both train every "
     "image in 28 batches and 7 optimiser steps per epoch (with 400: 384 images, 6 steps vs 6.25)"),
    ("loader workers, CPU threads", "workers=W, torch threads T", "train.workers: W, detscale launch --threads T"),
    ("evaluation", "val(save_json) conf 0.001, iou 0.7, max_det 300", "eval.conf/iou/max_det: same"),
    ("evaluator", "detscale's COCO evaluator on both predictions.json", "same ground truth JSON"),
]

DETSCALE_CONFIG = """\
dataset:
  name: parity
  data_yaml: {data_yaml}
grid:
  model: [{model}]
  imgsz: [{imgsz}]
  gpus: [1]
  batch: [{batch}]
  cache: [none]
  precision: [fp32]
  epochs: {epochs}
  seeds: [{seed}]
train:
  optimizer: adamw
  lr0: {lr0}
  lrf: 0.01
  lr_schedule: linear
  momentum: 0.9
  weight_decay: 0.0005
  nominal_batch: 64
  warmup_epochs: 3
  warmup_bias_lr: 0.0
  warmup_momentum: 0.8
  warmup_accumulate: ramp
  box_gain: 7.5
  cls_gain: 0.5
  dfl_gain: 1.5
  ema_decay: 0.9999
  ema_tau: 2000
  clip_grad_norm: 10.0
  close_mosaic: {close_mosaic}
  workers: {workers}
  cpu_threads_per_rank: {threads}
  timing_warmup_steps: 3
augment:
  hsv_h: 0.015
  hsv_s: 0.7
  hsv_v: 0.4
  translate: 0.1
  scale: 0.5
  fliplr: 0.5
  mosaic: 1.0
  mixup: 0.0
eval:
  conf: 0.001
  iou: 0.7
  max_det: 300
  batch: 32
"""

ULTRALYTICS_RUN = r"""
import json, os, sys, time
os.environ["YOLO_OFFLINE"] = "1"
import torch
torch.set_num_threads({threads})
from ultralytics import YOLO
model = YOLO("{arch}")
epoch_times, marks = [], {{}}
INIT = {init!r}  # detscale's initial weights (None: Ultralytics' own)
sys.path.insert(0, {bench_dir!r})
from bench_parity import load_by_position


def same_init(trainer):
    # after _setup_train: the optimiser holds the model's tensors (loaded in place), the EMA a copy of its own
    if INIT is not None:
        values = torch.load(INIT)
        for target in (trainer.model, trainer.ema.ema):
            load_by_position(target, values)
        print(f"same_init: {{len(values)}} tensors of {{INIT}} loaded into the model and its EMA", flush=True)


model.add_callback("on_pretrain_routine_end", same_init)
model.add_callback("on_train_epoch_start", lambda trainer: marks.update(t=time.perf_counter()))
model.add_callback("on_train_epoch_end", lambda trainer: epoch_times.append(time.perf_counter() - marks["t"]))
t0 = time.perf_counter()
model.train(data="{data_yaml}", epochs={epochs}, imgsz={imgsz}, batch={batch}, device="cpu", workers={workers},
            seed={seed}, deterministic=True, optimizer="auto", close_mosaic={close_mosaic}, cache=False, amp=False,
            val=False, plots=False, project="{project}", name="train", exist_ok=True, verbose=False,
            mosaic=1.0, mixup=0.0, scale=0.5, translate=0.1, fliplr=0.5, flipud=0.0, degrees=0.0, shear=0.0,
            perspective=0.0, hsv_h=0.015, hsv_s=0.7, hsv_v=0.4, box=7.5, cls=0.5, dfl=1.5, nbs=64,
            weight_decay=0.0005, warmup_epochs=3, lrf=0.01, cos_lr=False)
train_s = time.perf_counter() - t0
trainer = model.trainer
weights = trainer.last
val = YOLO(str(weights))
val.val(data="{data_yaml}", imgsz={imgsz}, batch=32, device="cpu", conf=0.001, iou=0.7, max_det=300,
        save_json=True, plots=False, project="{project}", name="val", exist_ok=True, verbose=False)
json.dump({{"train_seconds": train_s, "weights": str(weights), "epoch_times": epoch_times,
           "lr0": trainer.args.lr0, "optimizer": type(trainer.optimizer).__name__,
           "params": sum(p.numel() for p in model.model.parameters())}}, open("{out}", "w"))
"""


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0


def run_queue(queue: list[tuple], train: Callable[..., None], jobs: int) -> None:
    """``train(*item)`` for every item, ``jobs`` at a time in queue order (each run is a subprocess,
    so the threads only wait). The first failure is raised once the runs already training have
    finished; the items not yet started never start."""
    failed = threading.Event()

    def guarded(*item: object) -> None:
        if failed.is_set():  # set by the failing run's own thread before it can take the next item
            return
        try:
            train(*item)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for done in [pool.submit(guarded, *item) for item in queue]:
            done.result()


def make_dataset(work: Path, args: argparse.Namespace) -> Path:
    """The data.yaml to train on: ``--data`` as given, or a generated family's (made once in ``work``)."""
    if getattr(args, "data", None):
        return Path(args.data).resolve()
    if args.family != "synth":
        from families import generate

        return generate(args.family, work / f"data-{args.family}-{args.data_seed}", args.data_seed, args.train,
                        args.val, args.imgsz)
    data = work / f"data-{args.data_seed}"
    if not (data / "data.yaml").is_file():
        run([sys.executable, "-m", "detscale", "synth", "--out", str(data), "--seed", str(args.data_seed),
             "--imgsz", str(args.imgsz), "--train", str(args.train), "--val", str(args.val),
             "--objects", str(args.objects[0]), str(args.objects[1]),
             "--object-size", str(args.object_size[0]), str(args.object_size[1])], work / f"synth-{args.data_seed}.log")
    return data / "data.yaml"


def data_key(data_yaml: Path) -> str:
    """A short name of a dataset for file names in the work folder: its folder and a hash of its path."""
    import hashlib

    resolved = str(Path(data_yaml).resolve())
    return f"{Path(resolved).parent.name}-{hashlib.sha1(resolved.encode()).hexdigest()[:8]}"


def ground_truth(data_yaml: Path, work: Path) -> Path:
    """The COCO ground truth of the validation split, in ``work`` (never beside a user's dataset)."""
    from detscale.data.formats import load_spec
    from detscale.metrics.coco import ensure_coco_gt

    gt = work / "gt" / f"{data_key(data_yaml)}.json"
    gt.parent.mkdir(parents=True, exist_ok=True)
    ensure_coco_gt(load_spec(data_yaml, splits=("val",)), "val", gt)
    return gt


def runs_dir(work: Path, args: argparse.Namespace) -> Path:
    """The runs of one dataset and initialisation mode (only runs of the same mode pair up)."""
    init = "-same-init" if args.init == "same" else ""
    if getattr(args, "data", None):
        return work / f"data-{data_key(Path(args.data))}{init}"
    family = "" if args.family == "synth" else f"{args.family}-"
    return work / f"{family}d{args.data_seed}{init}"


def variant_name(args: argparse.Namespace) -> str:
    """The detscale variant's name: model, then the --tag of an ablation."""
    return f"detscale-{args.model}" + (f"-{args.tag}" if args.tag else "")


def override(config_text: str, settings: list[str]) -> str:
    """The config with ``section.key=value`` settings (YAML values) applied: for ablations."""
    import yaml

    if not settings:
        return config_text
    cfg = yaml.safe_load(config_text)
    for item in settings:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        if not name or section not in cfg:
            raise SystemExit(f"--set {item!r}: expected SECTION.KEY=VALUE with a section of {sorted(cfg)}")
        cfg[section][name] = yaml.safe_load(value)
    return yaml.safe_dump(cfg, sort_keys=False)


def final_train_loss(run_dir: Path, trainer: str, last: int = 3) -> float | None:
    """The training loss (box + cls + dfl, gains applied, per batch as both trainers log it) averaged
    over the last ``last`` epochs: the objective both trainers minimise, the same function (the loss
    oracle in tests/test_oracles.py), read from each trainer's own per-epoch log. Far less noisy
    than the mAP of a short run: a second reading of "learns like the reference"."""
    if trainer == "ultralytics":
        import csv

        path = run_dir / "train" / "results.csv"
        if not path.is_file():
            return None
        rows = [{k.strip(): v for k, v in row.items()} for row in csv.DictReader(path.open())]
        totals = [sum(float(row[f"train/{k}_loss"]) for k in ("box", "cls", "dfl")) for row in rows]
    else:
        paths = sorted(run_dir.glob("*/metrics.jsonl"))
        if not paths:
            return None
        rows = [json.loads(line) for line in paths[0].read_text().splitlines() if line.strip()]
        totals = [row["loss_box"] + row["loss_cls"] + row["loss_dfl"] for row in rows if "loss_box" in row]
    return statistics.fmean(totals[-last:]) if totals else None


def steady_epoch_seconds(epoch_seconds: list[float]) -> float:
    """Median training time of the epochs after the first (loader start-up), validation excluded."""
    return statistics.median(epoch_seconds[1:] if len(epoch_seconds) > 1 else epoch_seconds)


def images_per_epoch(args: argparse.Namespace, trainer: str) -> int:
    """Images one epoch trains: Ultralytics drops the last partial batch (and carries the accumulation
    across epochs); detscale trains whole optimiser steps (nominal batch 64) only."""
    if trainer == "ultralytics":
        return (args.train // args.batch) * args.batch
    step = args.batch * max(round(64 / args.batch), 1)
    return (args.train // step) * step


def lr0_auto(nc: int) -> float:
    """Ultralytics' optimizer=auto learning rate for AdamW."""
    return round(0.002 * 5 / (4 + nc), 6)


def train_detscale(data_yaml: Path, gt: Path, epochs: int, seed: int, work: Path, args: argparse.Namespace,
                   nc: int) -> dict:
    run_dir = work / variant_name(args) / f"e{epochs}_s{seed}"
    result = run_dir / "parity.json"
    if result.is_file():
        return json.loads(result.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "config.yaml"
    text = DETSCALE_CONFIG.format(data_yaml=data_yaml, model=args.model, imgsz=args.imgsz, batch=args.batch,
                                  epochs=epochs, seed=seed, lr0=lr0_auto(nc), close_mosaic=args.close_mosaic,
                                  workers=args.workers, threads=args.threads)
    cfg.write_text(override(text, args.set))
    run_id = f"{args.model}_{args.imgsz}_g1_b{args.batch}_none_fp32_s{seed}_r0"
    out = run_dir / run_id
    train_s = run([sys.executable, "-m", "detscale", "launch", "--gpus", "1", "--threads", str(args.threads), "--",
                   "train", "--config", str(cfg), "--run", run_id, "--out", str(out), "--data", str(data_yaml)],
                  run_dir / "train.log")
    run([sys.executable, "-m", "detscale", "evaluate", "--weights", str(out / "weights" / "last.pt"), "--config",
         str(cfg), "--run", run_id, "--out", str(out), "--data", str(data_yaml), "--gt", str(gt)],
        run_dir / "eval.log")
    timing = json.loads((out / "timing.json").read_text())
    ev = json.loads((out / "eval.json").read_text())
    epoch_s = steady_epoch_seconds(timing["epoch_seconds"])
    record = {"trainer": variant_name(args), "model": args.model, "set": args.set, "init": args.init,
              "epochs": epochs, "seed": seed,
              "images_per_s": images_per_epoch(args, "detscale") / epoch_s, "epoch_seconds": epoch_s,
              "images_per_epoch": images_per_epoch(args, "detscale"), "steady_images_per_s": timing["images_per_s"],
              "train_wall_s": train_s, "map50": ev["map50"], "map50_95": ev["map50_95"],
              "train_loss": final_train_loss(run_dir, "detscale"), "runs_at_once": args.jobs}
    write_json(record, result, indent=2)  # atomic: a killed run leaves no half record
    return record


def initial_weights(args: argparse.Namespace, nc: int, seed: int, work: Path) -> Path:
    """detscale's initial weights for ``seed`` (as its trainer builds them), for Ultralytics to start from.

    Saved as a list of tensors in state_dict order, without the DFL projection (a constant both
    models hold under different names); the architectures are equal layer for layer
    (tests/test_oracles.py), so the list loads into ``yolov9t.yaml`` by position.
    """
    from detscale.engine.build import initial_model

    path = work / "init" / f"{args.model}_nc{nc}_s{seed}.pt"
    if not path.is_file():  # two invocations (one per --trainers) may write it at once: a unique temp file each
        state = initial_model(args.model, nc, seed).state_dict()
        save_torch([v for k, v in state.items() if ".dfl." not in k], path)
    return path


def load_by_position(model: torch.nn.Module, values: list[torch.Tensor]) -> None:
    """Load tensors saved by :func:`initial_weights` into a model of the same architecture, by position
    (the two trainers name their layers differently), in place: an optimiser built on the model
    keeps training the loaded tensors."""
    state = {k: v for k, v in model.state_dict().items() if ".dfl." not in k}
    if [tuple(v.shape) for v in state.values()] != [tuple(v.shape) for v in values]:
        raise SystemExit(f"{len(values)} initial tensors do not fit {type(model).__name__}: shapes differ")
    model.load_state_dict(dict(zip(state, values, strict=True)), strict=False)


def ultralytics_predictions_to_coco(pred_json: Path, gt: Path, out: Path) -> Path:
    """Map Ultralytics' save_json output (image_id = file stem, category_id = class + 1) onto our ground truth."""
    gt_data = json.loads(gt.read_text())
    by_stem = {Path(img["file_name"]).stem: img["id"] for img in gt_data["images"]}
    cat_ids = sorted(c["id"] for c in gt_data["categories"])  # our ids, in class order
    mapped = []
    for det in json.loads(pred_json.read_text()):
        stem = Path(det["file_name"]).stem if "file_name" in det else str(det["image_id"])
        if stem not in by_stem:
            raise SystemExit(f"Ultralytics predicted image {stem!r}, which the ground truth {gt} does not hold")
        mapped.append({"image_id": by_stem[stem], "category_id": cat_ids[int(det["category_id"]) - 1],
                       "bbox": det["bbox"], "score": det["score"]})
    out.write_text(json.dumps(mapped))
    return out


def absolute_data_yaml(data_yaml: Path, out_dir: Path | None = None) -> Path:
    """The same dataset with the absolute ``path:`` detscale resolves (Ultralytics resolves a relative
    one against its own datasets folder), written to ``out_dir`` (default: beside ``data_yaml``)."""
    import yaml

    from detscale.data.formats import load_spec

    spec = yaml.safe_load(data_yaml.read_text())
    spec["path"] = str(load_spec(data_yaml, splits=()).root)
    folder = out_dir if out_dir is not None else data_yaml.parent
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"data-ultralytics-{data_key(data_yaml)}.yaml"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def train_ultralytics(data_yaml: Path, gt: Path, epochs: int, seed: int, work: Path, args: argparse.Namespace,
                      nc: int) -> dict:
    from detscale.metrics.coco import evaluate_files

    run_dir = work / "ultralytics" / f"e{epochs}_s{seed}"
    result = run_dir / "parity.json"
    if result.is_file():
        return json.loads(result.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    data_yaml = absolute_data_yaml(data_yaml, run_dir)
    script = run_dir / "run.py"
    info = run_dir / "info.json"
    init = str(initial_weights(args, nc, seed, work)) if args.init == "same" else None
    script.write_text(ULTRALYTICS_RUN.format(arch=args.ultralytics_model, data_yaml=data_yaml, epochs=epochs, init=init,
                                             bench_dir=str(Path(__file__).resolve().parent),
                                             imgsz=args.imgsz, batch=args.batch, workers=args.workers, seed=seed,
                                             close_mosaic=args.close_mosaic, project=run_dir, out=info,
                                             threads=args.threads))
    env = os.environ | {"YOLO_OFFLINE": "1", "YOLO_CONFIG_DIR": str(work / "ultralytics-config"),
                        "OMP_NUM_THREADS": str(args.threads)}
    run([sys.executable, str(script)], run_dir / "train.log", env=env, cwd=run_dir)
    meta = json.loads(info.read_text())
    preds = ultralytics_predictions_to_coco(run_dir / "val" / "predictions.json", gt, run_dir / "predictions.json")
    ev = evaluate_files(gt, preds)
    epoch_s = steady_epoch_seconds(meta["epoch_times"])
    record = {"trainer": "ultralytics", "model": args.ultralytics_model, "epochs": epochs, "seed": seed,
              "init": args.init,
              "images_per_s": images_per_epoch(args, "ultralytics") / epoch_s, "epoch_seconds": epoch_s,
              "images_per_epoch": images_per_epoch(args, "ultralytics"),
              "train_wall_s": meta["train_seconds"], "map50": ev["map50"], "map50_95": ev["map50_95"],
              "train_loss": final_train_loss(run_dir, "ultralytics"),
              "lr0": meta["lr0"], "optimizer": meta["optimizer"], "params": meta["params"], "runs_at_once": args.jobs}
    write_json(record, result, indent=2)  # atomic: a killed run leaves no half record
    return record


def summarise(records: list[dict], args: argparse.Namespace) -> str:
    data = f"dataset {args.data}" if getattr(args, "data", None) else \
        f"data family {getattr(args, 'family', 'synth')} (seed {args.data_seed})"
    lines = [f"detscale {args.model} vs Ultralytics {args.ultralytics_model}: {data}, "
             f"{args.train} train / {args.val} val images at {args.imgsz} px, batch {args.batch}, "
             f"{args.threads} CPU thread(s), {args.workers} loader worker(s), {args.jobs} run(s) at a time, "
             + ("the same initial weights for both (detscale's of the seed)" if args.init == "same"
                else "each trainer's own initial weights") + "; img/s = images per epoch / median "
             "training time of epochs 2+ (validation excluded), the same for both", "",
             "| epochs | seed | trainer | img/s | epoch s | mAP@0.5 | mAP@0.5:0.95 | train loss, last 3 epochs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["epochs"], r["seed"], r["trainer"])):
        lines.append(f"| {r['epochs']} | {r['seed']} | {r['trainer']} | {r['images_per_s']:.1f} | "
                     f"{r['epoch_seconds']:.1f} | {r['map50']:.3f} | {r['map50_95']:.3f} | "
                     + (f"{r['train_loss']:.3f} |" if r.get("train_loss") else "- |"))
    lines += ["", "| epochs | trainer | seeds | mAP@0.5:0.95 ratio to Ultralytics, per seed | mean ratio | "
                  "img/s ratio | seed spread, detscale / Ultralytics | pair correlation |",
              "|---|---|---|---|---|---|---|---|"]
    variants = sorted({r["trainer"] for r in records if r["trainer"] != "ultralytics"})
    ref = {(r["epochs"], r["seed"]): r for r in records if r["trainer"] == "ultralytics"}
    pairs_of = {variant: [(r, ref[(r["epochs"], r["seed"])])
                          for r in sorted(records, key=lambda r: (r["epochs"], r["seed"]))
                          if r["trainer"] == variant and (r["epochs"], r["seed"]) in ref] for variant in variants}
    for epochs in sorted({r["epochs"] for r in records}):
        for variant in variants:
            pairs = [(d, u) for d, u in pairs_of[variant] if d["epochs"] == epochs]
            if not pairs:
                continue
            ratios = [d["map50_95"] / u["map50_95"] if u["map50_95"] else float("nan") for d, u in pairs]
            speed = statistics.mean(d["images_per_s"] / u["images_per_s"] for d, u in pairs)
            lines.append(f"| {epochs} | {variant} | {len(pairs)} | {', '.join(f'{x:.2f}' for x in ratios)} | "
                         f"{statistics.mean(ratios):.2f} | {speed:.2f} | {seed_spread(pairs)} |")
    lines += ["", "Seed spread: the standard deviation of log mAP@0.5:0.95 over seeds, per trainer; pair "
                  "correlation: of the two trainers' log mAP over seeds. Near 0, a pair's two runs vary as "
                  "independent runs would, and the ratio of a pair spreads by about the root of the sum of "
                  "their squares.", ""]
    lines += [pooled_ratio(variant, pairs_of[variant]) for variant in variants]
    loss = "training loss of the last 3 epochs (below 1: detscale's is lower)"
    lines += [pooled_ratio(variant, pairs_of[variant], key="train_loss", label=loss) for variant in variants]
    return "\n".join(lines) + "\n"


def seed_spread(pairs: list[tuple[dict, dict]]) -> str:
    """Each trainer's spread of log mAP@0.5:0.95 over seeds and the correlation of the pairs (two table
    cells): whether sharing the seed (initial weights, data) makes a pair's runs move together."""
    if len(pairs) < 2 or any(r["map50_95"] <= 0 for pair in pairs for r in pair):
        return "- | -"
    ours, ref = ([math.log(pair[i]["map50_95"]) for pair in pairs] for i in (0, 1))
    spread = f"{statistics.stdev(ours):.2f} / {statistics.stdev(ref):.2f}"
    if len(pairs) < 3 or len(set(ours)) == 1 or len(set(ref)) == 1:
        return f"{spread} | -"
    return f"{spread} | {statistics.correlation(ours, ref):.2f}"


def pooled_ratio(variant: str, pairs: list[tuple[dict, dict]], gap: float = 0.05, key: str = "map50_95",
                 label: str = "mAP@0.5:0.95") -> str:
    """log(detscale / Ultralytics ``key``, by default mAP@0.5:0.95) per seed, read as paired samples.

    A seed's runs at several budgets share their initial weights and the start of their data
    order, so they are not independent: a seed's sample is the mean of its budgets' log ratios,
    and the interval is a t interval over seeds (scipy.stats). Reported: the geometric-mean
    ratio with its 95 % interval, and how many seeds a ``gap`` would take to be resolved at the
    spread measured here (the fewest whose half-width in log ratio is at most ``-log(1 - gap)``).
    Pooling the budgets assumes one ratio for all of them; the per-budget rows show whether that holds.
    """
    from scipy import stats

    by_seed: dict[int, list[float]] = {}
    for d, u in pairs:
        if (d.get(key) or 0) > 0 and (u.get(key) or 0) > 0:
            by_seed.setdefault(d["seed"], []).append(math.log(d[key] / u[key]))
    logs = [statistics.fmean(v) for v in by_seed.values()]
    n_pairs = sum(len(v) for v in by_seed.values())
    if len(logs) < 2:
        return f"- {variant}, {label}: {n_pairs} pair(s) of {len(logs)} seed(s), no interval possible."
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    low, high = stats.t.interval(0.95, len(logs) - 1, loc=mean, scale=sd / math.sqrt(len(logs))) if sd else (mean, mean)
    needed = next((n for n in range(2, 10_000) if stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= -math.log1p(-gap)),
                  None)
    return (f"- {variant}, all budgets pooled ({n_pairs} pairs, {len(logs)} seeds; a seed's budgets share its initial "
            f"weights, so each seed is one sample: the mean of its log ratios): {label} ratio "
            f"{math.exp(mean):.2f} (geometric mean), 95 % CI {math.exp(low):.2f}..{math.exp(high):.2f} "
            f"(paired t over seeds); spread {sd:.2f} in log ratio per seed, so resolving a {gap:.0%} gap "
            f"takes about {needed if needed else 'more than 10,000'} seeds at these budgets.")


def main() -> int:
    from families import FAMILIES  # benchmarks/families.py, beside this script

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("results/bench_parity"))
    p.add_argument("--epochs", type=int, nargs="+", default=[10, 20, 30], help="epoch budgets (one run each)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds")
    p.add_argument("--trainers", nargs="+", default=["detscale", "ultralytics"], choices=["detscale", "ultralytics"])
    p.add_argument("--family", default="synth", choices=["synth", *FAMILIES],
                   help="data family: synth (detscale synth, the default) or a generator of benchmarks/families.py "
                        "(shapes, dense, gray), which differ in what makes detection hard")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic dataset")
    p.add_argument("--data", default="", metavar="DATA_YAML",
                   help="train on this YOLO dataset instead of generated data (its split sizes replace --train "
                        "and --val; nothing is written beside it)")
    p.add_argument("--imgsz", type=int, default=256)
    p.add_argument("--train", type=int, default=448,
                   help="training images (default 448, a multiple of the nominal batch 64: both trainers then "
                        "take the same optimiser steps per epoch)")
    p.add_argument("--val", type=int, default=100)
    p.add_argument("--objects", type=int, nargs=2, default=(1, 8))
    p.add_argument("--object-size", type=float, nargs=2, default=(0.05, 0.5))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--close-mosaic", type=int, default=10)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (default 1). With --jobs 2 --threads 1 on 2 cores, the two runs of a pair "
                        "train side by side, one core each: half the wall time, and img/s compares the trainers "
                        "under equal load (not with the numbers of runs that had the host to themselves)")
    p.add_argument("--model", default="gelan-t-detect",
                   help="detscale model (default gelan-t-detect: the architecture of yolov9t.yaml, layer for layer)")
    p.add_argument("--ultralytics-model", default="yolov9t.yaml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a detscale config key (repeatable; for ablations, with --tag)")
    p.add_argument("--init", choices=["same", "own"], default="same",
                   help="same (default): Ultralytics starts from detscale's initial weights of the seed (the "
                        "architectures are equal layer for layer), so a pair differs in the trainer only; own: each "
                        "trainer initialises its model itself")
    p.add_argument("--tag", default="", help="name of an ablation: its runs go to WORK/d*/detscale-MODEL-TAG")
    p.add_argument("--recipe", action="store_true", help="print the recipe mapping and exit")
    args = p.parse_args()
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.recipe:
        print("| what | Ultralytics | detscale |\n|---|---|---|")
        for row in RECIPE:
            print("| " + " | ".join(row) + " |")
        return 0
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data_yaml = make_dataset(work, args)
    gt = ground_truth(data_yaml, work)
    from detscale.data.formats import load_spec

    spec = load_spec(data_yaml)
    nc = spec.nc
    if args.data:  # the images each trainer trains per epoch follow from the real split sizes
        args.train, args.val = len(spec.splits["train"]), len(spec.splits["val"])
    trainers = {"detscale": train_detscale, "ultralytics": train_ultralytics}

    def train(epochs: int, seed: int, name: str) -> None:
        t0 = time.perf_counter()
        record = trainers[name](data_yaml, gt, epochs, seed, runs_dir(work, args), args, nc)
        print(f"{name} {epochs} epochs seed {seed}: mAP@0.5 {record['map50']:.3f} mAP@0.5:0.95 "
              f"{record['map50_95']:.3f}, {record['images_per_s']:.1f} img/s "
              f"[{time.perf_counter() - t0:.0f} s]", flush=True)

    # in pair order, so with --jobs 2 the two trainers of a (budget, seed) pair run side by side
    run_queue([(epochs, seed, name) for epochs in args.epochs for seed in args.seeds for name in args.trainers],
              train, args.jobs)
    # every finished run of this dataset, earlier invocations (other variants) included
    found = sorted(runs_dir(work, args).glob("*/e*_s*/parity.json"))
    records = [json.loads(f.read_text()) for f in found]
    for r, f in zip(records, found, strict=True):  # records of older versions lack the count and the loss
        kind = "ultralytics" if r["trainer"] == "ultralytics" else "detscale"
        r.setdefault("images_per_epoch", images_per_epoch(args, kind))
        if "train_loss" not in r:
            r["train_loss"] = final_train_loss(f.parent, kind)
        r["images_per_s"] = r["images_per_epoch"] / r["epoch_seconds"]
    text = summarise(records, args)
    write_json({"settings": vars(args) | {"work": str(work)}, "records": records}, work / "summary.json", indent=2)
    write_text(text, work / "summary.md")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
