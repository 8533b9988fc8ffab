"""``gpu_check.md``: the kit's results as a summary a person reads."""

from __future__ import annotations

from typing import Any

from gpukit import SECTIONS


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
    comp = s.get("compile", {})
    if comp.get("rows"):
        lines += ["", f"## Compiled step: {comp['model']} at {comp['imgsz']} px, batch {comp['batch']}, "
                      f"{comp['precision']}, bare loop, modes alternated, backend {comp.get('backend')}", "",
                  f"{comp['train_gflops_per_image']:.1f} training GFLOPs per image; peak {comp['peak_gflops']:.0f} "
                  f"GFLOP/s ({comp['peak_method']})", "",
                  "| train.compile | first epoch s (compilation) | img/s | x eager | MFU | graphs | graph breaks | "
                  "recompiles after step 1 |", "|---|---|---|---|---|---|---|---|"]
        for r in comp["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['mode']} | skipped ({r['skipped']}) | | | | | | |")
                continue
            lines.append(f"| {r['mode']} | {r['first_epoch_s']:.1f} | {r['steady_images_per_s']:.0f} | "
                         f"{_fmt(r.get('x_eager'), 2)} | {_fmt(100 * r['mfu'] if r.get('mfu') else None)} % | "
                         f"{r.get('graphs', '-')} | {r.get('graph_breaks', '-')} | "
                         f"{r.get('recompiles_after_first_step', '-')} |")
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
