"""CPU scaling benchmark: 1 rank x 1 thread against 2 ranks x 1 thread, through `detscale launch`.

The synthetic set is generated (``detscale synth``) and cached (``detscale cache``, read with
``cache: disk``); each configuration trains the same grid point (weak scaling: the same batch per
rank) and its ``timing.json`` gives the steady-state throughput (warm-up steps of every epoch
excluded) and the data-wait share. Prints a table and writes ``summary.json`` into ``--work``.

    .venv/bin/python benchmarks/bench_scaling.py [--images 192] [--imgsz 160] [--batch 8] [--epochs 2]

Scaling efficiency = throughput(2) / (2 x throughput(1)); the target on two free cores is >= 0.85.
The load average before and after is printed: other processes on the cores lower the figure.

``--overhead`` measures what the step breakdown (``train.step_breakdown``: marks per phase, the
DDP communication hook) costs: every rank count trains with it on and off, alternating trial by
trial, and the table shows both throughputs and their ratio (goal: within 2 %).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIG = """\
dataset:
  name: bench
  data_yaml: {data_yaml}
grid:
  model: [{model}]
  imgsz: [{imgsz}]
  gpus: [1, 2]
  batch: [{batch}]
  cache: [disk]
  precision: [fp32]
  epochs: {epochs}
train:
  warmup_epochs: 0
  close_mosaic: 0
  workers: {workers}
  cpu_threads_per_rank: 1
  timing_warmup_steps: {warmup_steps}
  step_breakdown: {breakdown}
"""


def detscale(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "detscale", *args], check=True, cwd=cwd)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("results/bench_scaling"), help="working folder")
    p.add_argument("--model", default="gelan-t")
    p.add_argument("--images", type=int, default=192, help="training images of the synthetic set")
    p.add_argument("--imgsz", type=int, default=160)
    p.add_argument("--batch", type=int, default=8, help="batch per rank")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="loader workers per rank")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps per epoch left out of the throughput")
    p.add_argument("--repeats", type=int, default=1, help="trials of each configuration (median reported)")
    p.add_argument("--overhead", action="store_true",
                   help="train every rank count with the step breakdown on and off, side by side")
    args = p.parse_args()

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not (data / "data.yaml").is_file():
        detscale("synth", "--out", str(data), "--imgsz", "256", "--train", str(args.images), "--val", "8",
                 "--objects", "1", "6", "--object-size", "0.08", "0.45", cwd=work)
    cache = work / "cache"
    detscale("cache", "--data", str(data / "data.yaml"), "--split", "train", "--imgsz", str(args.imgsz),
             "--out", str(cache), cwd=work)
    configs = {}
    for breakdown in ((True, False) if args.overhead else (True,)):
        configs[breakdown] = work / f"config-breakdown-{'on' if breakdown else 'off'}.yaml"
        configs[breakdown].write_text(CONFIG.format(
            data_yaml=data / "data.yaml", model=args.model, imgsz=args.imgsz, batch=args.batch, epochs=args.epochs,
            workers=args.workers, warmup_steps=args.warmup_steps, breakdown=str(breakdown).lower()))
    load_before = os.getloadavg()
    trials: dict[int, list[dict]] = {1: [], 2: []}
    off_trials: dict[int, list[dict]] = {1: [], 2: []}
    # Alternate 1, 2, 1, 2, ... (and on, off): a load change from other processes then hits all alike.
    for _ in range(args.repeats):
        for ranks in (1, 2):
            for breakdown, cfg in configs.items():
                run = f"{args.model}_{args.imgsz}_g{ranks}_b{args.batch}_disk_fp32_s0_r0"
                out = work / "runs" / run
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                detscale("launch", "--gpus", str(ranks), "--threads", "1", "--", "train", "--config", str(cfg),
                         "--run", run, "--out", str(out), "--data", str(data / "data.yaml"), "--cache-dir", str(cache),
                         cwd=work)
                timing = json.loads((out / "timing.json").read_text())
                timing["wall_seconds"] = time.perf_counter() - t0
                (trials if breakdown else off_trials)[ranks].append(timing)
    load_after = os.getloadavg()
    # the median trial by throughput of each configuration
    results = {r: sorted(ts, key=lambda t: t["images_per_s"])[len(ts) // 2] for r, ts in trials.items()}

    base = results[1]["images_per_s"]
    rows = []
    for ranks, t in results.items():
        speedup = t["images_per_s"] / base if base else float("nan")
        rows.append({"ranks": ranks, "threads_per_rank": 1, "global_batch": t["global_batch"],
                     "images_per_s": t["images_per_s"], "images_per_s_per_rank": t["images_per_s_per_rank"],
                     "speedup": speedup, "efficiency": speedup / ranks, "data_wait_share": t["data_wait_share"],
                     "measured_steps": t["measured_steps"], "peak_rss_mib": max(t["peak_mem_bytes_per_rank"]) / 2**20,
                     "wall_seconds": t["wall_seconds"]})
    summary = {"rows": rows,
               "trials_images_per_s": {r: [t["images_per_s"] for t in ts] for r, ts in trials.items()},
               "load_before": load_before, "load_after": load_after, "cores": os.cpu_count(),
               "settings": vars(args) | {"work": str(work)}}
    (work / "summary.json").write_text(json.dumps(summary, indent=2))

    header = f"{'ranks':>5} {'img/s':>8} {'img/s/rank':>16} {'speed-up':>8} {'effic.':>7} {'data wait':>9} " \
             f"{'steps':>5} {'RSS MiB':>8}"
    sys.stdout.write(f"{args.model} {args.imgsz}px, batch {args.batch}/rank, {args.images} images, cache disk, "
                     f"{args.workers} loader worker(s)/rank, {os.cpu_count()} cores\n{header}\n")
    for r in rows:
        per_rank = "/".join(f"{v:.1f}" for v in r["images_per_s_per_rank"])
        sys.stdout.write(f"{r['ranks']:>5} {r['images_per_s']:>8.1f} {per_rank:>16} {r['speedup']:>8.2f} "
                         f"{r['efficiency']:>7.2f} {100 * r['data_wait_share']:>8.1f}% {r['measured_steps']:>5} "
                         f"{r['peak_rss_mib']:>8.0f}\n")
    for ranks, ts in trials.items():
        values = ", ".join(f"{t['images_per_s']:.1f}" for t in ts)
        sys.stdout.write(f"trials, {ranks} rank(s): {values} img/s\n")
    if args.overhead:
        summary["overhead"] = []
        sys.stdout.write("\nstep breakdown on vs off (median img/s over the trials, alternated):\n"
                         f"{'ranks':>5} {'on':>8} {'off':>8} {'on/off':>7}   trials on | off\n")
        for ranks in (1, 2):
            on = sorted(t["images_per_s"] for t in trials[ranks])
            off = sorted(t["images_per_s"] for t in off_trials[ranks])
            m_on, m_off = on[len(on) // 2], off[len(off) // 2]
            summary["overhead"].append({"ranks": ranks, "on": on, "off": off, "ratio": m_on / m_off})
            sys.stdout.write(f"{ranks:>5} {m_on:>8.1f} {m_off:>8.1f} {m_on / m_off:>7.3f}   "
                             f"{', '.join(f'{v:.1f}' for v in on)} | {', '.join(f'{v:.1f}' for v in off)}\n")
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
    sys.stdout.write(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
