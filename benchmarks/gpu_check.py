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
``compile``     the same loop at the first throughput point with ``train.compile`` off, model and
                step, bare epochs alternated between the modes: first epoch (compilation), steady
                img/s, x eager, MFU, graphs, graph breaks and recompilations.

``--budget-s`` bounds the whole run: a section that would not fit in what is left is recorded
as skipped. ``--only a,b`` reruns chosen sections (``data`` is added when one needs it).

Wheels. The device image lacks jsonschema and faster-coco-eval (and what jsonschema needs).
Fetch them here once, for the machine's Python (3.12 on the H200 image)::

    python3 benchmarks/gpu_check.py --fetch-wheels .gpukit/wheels --python-version 3.12

then carry ``.gpukit`` with the call; ``--wheels DIR`` installs them with ``pip --no-index
--no-deps --target`` into ``DIR/site`` (nothing else on the machine changes) and puts that and
``src/`` on the path of this process and of every command it starts.

The sections live in ``benchmarks/gpukit/``, one module each; this script sets up the paths
(``src/``, the wheels) and runs them.

CPU self-test (``--tiny``: 64 px, a few images, 0-1 workers) runs in the test suite, so the kit
cannot rot between lent GPUs: ``python benchmarks/gpu_check.py --out DIR --tiny``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpukit import NEEDS_DATA, SECTIONS

ROOT = Path(__file__).resolve().parents[1]
#: Wheels the device image lacks (jsonschema's own dependencies included; attrs is there).
WHEELS = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "faster-coco-eval")


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
    # Only now can detscale (and the wheels it needs) be imported: the sections import it at their top.
    from gpukit.compile import section_compile
    from gpukit.data import section_data
    from gpukit.env import section_env
    from gpukit.groups import run_group
    from gpukit.kit import Kit, device, sizes_for
    from gpukit.launch import section_launch
    from gpukit.loader import section_loader
    from gpukit.markdown import markdown
    from gpukit.models import section_models
    from gpukit.step_profile import section_profile
    from gpukit.throughput import section_throughput

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    kit = Kit(out, (args.work or out / "work").resolve(), args.budget_s, args.tiny, markdown)
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
        ("compile", 60, lambda: section_compile(kit, sizes)),
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
