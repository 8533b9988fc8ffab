"""Section ``compile``: the trainer's own loop with ``train.compile: off`` against ``model`` and
``step``, at one throughput point, bare epochs (no instruments) alternated between the modes, so
the compiled step's gain is measured side by side on the loop that trains. Reported per mode: the
first epoch's seconds (compilation included), steady img/s (median of the rounds), MFU against
the card's measured matrix-multiply peak, and what torch.compile did (graphs, graph breaks,
recompilations after the first step)."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from detscale.engine.build import build_loaders, build_parts
from detscale.engine.compiled import CompileWatch, forward_loss
from detscale.engine.loop import FirstStep
from detscale.engine.mfu import measure_peak, train_gflops_per_image
from detscale.engine.semantics import derive_semantics
from gpukit.kit import Kit, Sizes, experiment, one_card
from gpukit.throughput import bare_epoch


def section_compile(kit: Kit, sizes: Sizes) -> dict[str, Any]:
    card = one_card(kit.work)
    dev, paths, precision, info, nc = card.dev, card.paths, card.precision, card.info, card.nc
    model, batch = sizes.throughput_points()[0]
    base = experiment(paths.data_yaml, model, sizes.imgsz, batch, precision=precision, workers=sizes.workers,
                      warmup_epochs=0, nominal=batch, epochs=100, warmup_steps=sizes.tp_warmup_steps)
    peak = measure_peak(dev, precision)
    runs: dict[str, dict[str, Any]] = {}
    modes = sizes.compile_modes
    for mode in modes:
        if kit.left() < 30:
            runs[mode] = {"skipped": "budget"}
            continue
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, compile=mode))
        point = cfg.runs()[0]
        sem = derive_semantics(cfg, point, 1, dev.type)
        parts = build_parts(point, nc, sem, cfg.train, info)
        if sizes.compile_backend != "inductor":
            parts.forward_loss = forward_loss(parts.model, parts.loss_fn, mode, backend=sizes.compile_backend)
        loader, _ = build_loaders(point, cfg, paths.data_yaml, paths.cache_dir, sem, info, with_val=False)
        # the watch's first step is the first batch (its compilation), as in detscale train
        watch = CompileWatch(mode, cfg.train.compile_mode)
        watch.start()
        first = bare_epoch(parts, loader, 0, sem, cfg.train, dev, sizes.tp_warmup_steps, sizes.tp_warmup_steps + 5,
                           extra=(FirstStep(watch.first_step_done),))
        runs[mode] = {"parts": parts, "loader": loader, "sem": sem, "cfg": cfg, "first_epoch_s": first["epoch_s"],
                      "watch": watch, "epochs": [], "finite": first["loss_finite"]}
    live = [m for m in modes if "parts" in runs[m]]
    for r in range(sizes.tp_rounds):
        for mode in (live if r % 2 == 0 else live[::-1]):
            run = runs[mode]
            epoch = 1 + len(run["epochs"])
            e = bare_epoch(run["parts"], run["loader"], epoch, run["sem"], run["cfg"].train, dev,
                           sizes.tp_warmup_steps)
            run["epochs"].append(e)
            run["finite"] = run["finite"] and e["loss_finite"]
    gflops = train_gflops_per_image(runs[live[0]]["parts"].raw, sizes.imgsz) if live else 0.0
    rows = []
    eager = statistics.median(e["steady_images_per_s"] for e in runs["off"]["epochs"]) \
        if "off" in live and runs["off"]["epochs"] else None
    for mode in modes:
        run = runs[mode]
        if "skipped" in run:
            rows.append({"mode": mode, "skipped": run["skipped"]})
            continue
        ips = statistics.median(e["steady_images_per_s"] for e in run["epochs"]) if run["epochs"] else 0.0
        rows.append({"mode": mode, **run["watch"].report(), "first_epoch_s": round(run["first_epoch_s"], 2),
                     "rounds": len(run["epochs"]), "steady_images_per_s": ips,
                     "x_eager": ips / eager if eager else None,
                     "mfu": ips * gflops / peak["gflops"] if peak["gflops"] else None,
                     "loss_finite": run["finite"]})
        print(f"  compile {mode}: {ips:.0f} img/s, first epoch {run['first_epoch_s']:.1f} s", flush=True)
    failed = any(not r.get("loss_finite", True) or r.get("graph_breaks", 0) > 0 for r in rows)
    return {"model": model, "batch": batch, "imgsz": sizes.imgsz, "precision": precision,
            "backend": sizes.compile_backend,
            "train_gflops_per_image": gflops, "peak_gflops": peak["gflops"], "peak_method": peak["method"],
            "warmup_steps_excluded": sizes.tp_warmup_steps, "rows": rows, "failed": failed}
