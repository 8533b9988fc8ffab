"""The scaling projection against more measured points than the default's 1 and 2 ranks.

For each setting (batch per rank, 1 thread per rank) it trains 1, 2 (and, at batch 32, 4) CPU
ranks of the default model on the default synthetic data, with the step breakdown on, runs the
communication benchmark (all-reduce and the contention probe in interleaved rounds) on every rank
count above 1, and prints each measured point against its projection: projected img/s with the
interval from its inputs' spread, the error, whether the point is inside, and the step term that
misses most when it is not. Points whose rank threads outnumber the cores are marked
oversubscribed (4 ranks on 2 cores): the projection's CPU roofline is what is tested there.

    .venv/bin/python benchmarks/bench_projection.py [--work DIR] [--epochs 5] [--images 1024] [--fresh]

Writes DIR/summary.json. Run it on an otherwise idle host (one CPU-heavy job at a time).
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

import yaml

# (threads per rank, batch per rank, rank counts). Not here: 2 ranks of 2 threads on 2 cores. OpenMP's
# threads spin while they wait, and two such ranks on too few cores slowed to 233 s for the first epoch
# (2 ranks of 1 thread: 2.7-3.0 s per epoch): contention the projection does not model and a run nobody
# should make; the report's contention note warns of it.
SETTINGS = ((1, 32, (1, 2, 4)), (1, 8, (1, 2)))


def detscale(*args: str, cwd: Path, log: Path | None = None) -> None:
    out = open(log, "w") if log else None  # noqa: SIM115 - closed below
    try:
        subprocess.run([sys.executable, "-m", "detscale", *args], check=True, cwd=cwd, stdout=out,
                       stderr=subprocess.STDOUT if out else None)
    finally:
        if out:
            out.close()


def setting_config(base: dict, data_yaml: Path, threads: int, batch: int, ranks: tuple[int, ...],
                   epochs: int) -> dict:
    """The default config with the grid narrowed to one setting (what changes: threads, batch, ranks)."""
    cfg = json.loads(json.dumps(base))
    cfg["dataset"] = {"name": "bench", "data_yaml": str(data_yaml)}
    cfg["grid"].update(gpus=list(ranks), batch=[batch], epochs=epochs, seeds=[0], repeats=1)
    cfg["train"].update(cpu_threads_per_rank=threads, step_breakdown=True, val_interval=0, warmup_epochs=0)
    return cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("results/bench_projection"))
    p.add_argument("--config", type=Path, default=Path("config/config.yaml"), help="the config to start from")
    p.add_argument("--images", type=int, default=1024,
                   help="training images of the synthetic set (the default config's)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--fresh", action="store_true",
                   help="train and benchmark every point again (default: reuse the points measured earlier)")
    args = p.parse_args()

    from detscale import config as dsconfig
    from detscale.report import projection, tables

    repo = Path(__file__).resolve().parent.parent
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load((repo / args.config).read_text() if not args.config.is_absolute()
                          else args.config.read_text())
    syn = base["dataset"]["synthetic"]
    imgsz = base["grid"]["imgsz"][0]
    model = base["grid"]["model"][0]
    data = work / "data"
    if not (data / "data.yaml").is_file():
        detscale("synth", "--out", str(data), "--seed", str(syn["seed"]), "--imgsz", str(syn["imgsz"]),
                 "--train", str(args.images), "--val", "8", "--objects", *map(str, syn["objects"]),
                 "--object-size", *map(str, syn["object_size"]), cwd=work)
    cache = work / "cache"
    detscale("cache", "--data", str(data / "data.yaml"), "--split", "train", "--imgsz", str(imgsz),
             "--out", str(cache), cwd=work)

    load_before = os.getloadavg()
    results = []
    for threads, batch, ranks in SETTINGS:
        name = f"t{threads}_b{batch}"
        folder = work / name
        if args.fresh:
            shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(exist_ok=True)
        cfg_path = folder / "config.yaml"
        cfg_path.write_text(yaml.safe_dump(setting_config(base, data / "data.yaml", threads, batch, ranks,
                                                          args.epochs)))
        cfg = dsconfig.load(cfg_path)
        run_dirs, comm = [], []
        for point in cfg.runs():
            out = folder / "runs" / point.run_id
            comm_json = folder / f"comm_g{point.gpus}.json"
            run_dirs.append(out)
            if (out / "timing.json").is_file() and (point.gpus == 1 or comm_json.is_file()):
                if point.gpus > 1:  # measured by an earlier invocation (without --fresh)
                    comm.append(json.loads(comm_json.read_text()))
                continue
            t0 = time.perf_counter()
            detscale("launch", "--gpus", str(point.gpus), "--threads", str(threads), "--", "train", "--config",
                     str(cfg_path), "--run", point.run_id, "--out", str(out), "--data", str(data / "data.yaml"),
                     "--cache-dir", str(cache), cwd=folder, log=folder / f"{point.run_id}.log")
            sys.stdout.write(f"{name}: {point.gpus} rank(s) trained in {time.perf_counter() - t0:.0f} s\n")
            if point.gpus > 1:
                detscale("launch", "--gpus", str(point.gpus), "--threads", str(threads), "--", "comm", "--config",
                         str(cfg_path), "--model", model, "--imgsz", str(imgsz), "--batch", str(batch),
                         "--data", str(data / "data.yaml"), "--out", str(comm_json), cwd=folder,
                         log=folder / f"comm_g{point.gpus}.log")
                comm.append(json.loads(comm_json.read_text()))
        # The runs are loaded as the report loads them; it wants an eval.json, which the projection does not
        # read: these runs are not evaluated (NaN mAP), only timed.
        for d in run_dirs:
            (d / "eval.json").write_text(json.dumps({**{k: float("nan") for k in tables.EVAL_KEYS}, "num_images": 0}))
        rows = tables.scaling_rows([tables.load_run(d, cfg) for d in run_dirs])
        groups, skipped = projection.project_groups(rows, comm, cfg.projection)
        if skipped:
            sys.stdout.write(f"{name}: no projection: {skipped}\n")
        for g in groups:
            for k in g.checks:
                results.append({"setting": name, "threads": threads, "batch": batch, "ranks": k.gpus,
                                "measured": k.measured, "projected": k.projected, "low": k.low, "high": k.high,
                                "error": k.error, "inside": k.inside, "off_term": k.off_term(),
                                "oversubscribed": k.oversubscribed,
                                "contention": g.contention, "contention_range": g.contention_range})
    load_after = os.getloadavg()
    summary = {"points": results, "load_before": load_before, "load_after": load_after, "cores": os.cpu_count(),
               "settings": {"images": args.images, "epochs": args.epochs, "model": model, "imgsz": imgsz}}
    (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))

    sys.stdout.write(f"\n{model} {imgsz}px, {args.images} images, {args.epochs} epochs, {os.cpu_count()} cores\n")
    sys.stdout.write(f"{'setting':<8} {'ranks':>5} {'measured':>9} {'projected (interval)':>24} {'error':>7} "
                     f"{'inside':>6}  term off\n")
    for r in results:
        ranks = f"{r['ranks']}{'*' if r['oversubscribed'] else ''}"
        interval = f"{r['projected']:.1f} ({r['low']:.1f}-{r['high']:.1f})"
        sys.stdout.write(f"{r['setting']:<8} {ranks:>5} {r['measured']:>9.1f} {interval:>24} {r['error']:>+7.1%} "
                         f"{'yes' if r['inside'] else 'no':>6}  {r['off_term']}\n")
    sys.stdout.write("* oversubscribed: rank threads outnumber the cores\n"
                     f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
