"""The GPU acceptance kit (benchmarks/gpu_check.py) on the CPU, so it cannot rot between lent GPUs.

``--tiny`` runs every section at 64 px with a few images: the same code paths as on a GPU
(models in three precisions and two layouts, ``detscale launch`` + ``evaluate``, a process
group of one and of two ranks through the real loop, the loader, the throughput comparison and
the step profile), with CPU ranks and gloo. The tests marked ``gpu`` run the CUDA-only paths
(NCCL, fused optimisers) where a GPU is present.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "benchmarks" / "gpu_check.py"


def _kit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KIT), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_tiny_kit_runs_every_section_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _kit("--out", str(out), "--tiny", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "gpu_check.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["env", "models", "data", "launch", "nccl", "ddp", "loader", "throughput", "compile",
                              "profile"]
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok")
    assert all(s["seconds"] >= 0 for s in sections.values())

    models = sections["models"]
    combos = {(c["model"], c["precision"], c["channels_last"]) for c in models["combos"]}
    assert combos == {(m, p, cl) for m in ("gelan-t", "yolov9-t") for p in ("fp32", "bf16", "fp16")
                      for cl in (False, True)}
    assert all(c["ok"] and c["loss"] > 0 and c["eval_out_shape"][1] == 84 for c in models["combos"])

    launch = sections["launch"]
    assert launch["problems"] == [] and launch["backend"] == "gloo" and launch["images_per_s"] > 0
    for name, world in (("nccl", 1), ("ddp", 2)):
        group = sections[name]
        assert group["world_size"] == world and group["tensors_differing"] == [] and group["all_reduce_ok"]
        assert group["steps"] > 0 and group["ema_updates"] == group["steps"]
    assert sections["nccl"]["ddp_wrapper_step_finite"] is True

    loader = sections["loader"]["rows"]
    assert [(r["cache"], r["workers"]) for r in loader] == [("none", 0), ("none", 1), ("disk", 0), ("disk", 1)]
    assert all(r["images_per_s"] > 0 for r in loader)

    rows = sections["throughput"]["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [("gelan-t", 8), ("gelan-t", 16)]
    for r in rows:
        assert r["instrumented_images_per_s"] > 0 and r["bare_images_per_s"] > 0 and r["loss_finite"]
        assert 0 <= r["data_wait_share"] < 1 and r["rounds"] == 1

    compiled = sections["compile"]
    assert compiled["backend"] == "eager" and (compiled["model"], compiled["batch"]) == ("gelan-t", 8)
    assert [r["mode"] for r in compiled["rows"]] == ["off", "step"]
    for r in compiled["rows"]:
        assert r["steady_images_per_s"] > 0 and r["loss_finite"] and r["rounds"] == 1
    for r in compiled["rows"][1:]:
        assert r["graphs"] >= 1 and r["graph_breaks"] == 0 and r["first_step_seconds"] > 0

    profile = sections["profile"]
    assert set(profile["ms_per_part"]) == {"forward", "loss", "backward", "optimizer", "ema"}
    assert profile["top_self_cpu"] and profile["step_ms_unsynchronised"] > 0

    md = (out / "gpu_check.md").read_text()
    for heading in ("# detscale GPU check (tiny CPU self-test)", "## Models", "## Loader ceiling",
                    "## Training throughput", "## Compiled step: gelan-t", "## One step of gelan-t"):
        assert heading in md
    assert "No CUDA device" in md or "GPU:" in md
    assert not (out / "work").exists()  # datasets and runs are removed unless --keep-work


def test_unknown_section_is_a_clear_error(tmp_path: Path) -> None:
    proc = _kit("--out", str(tmp_path / "out"), "--only", "models,warp", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown section(s) ['warp']" in proc.stderr and "Traceback" not in proc.stderr


def test_only_adds_the_dataset_a_section_needs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _kit("--out", str(out), "--tiny", "--only", "loader", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sections = json.loads((out / "gpu_check.json").read_text())["sections"]
    assert [(n, s["status"]) for n, s in sections.items()] == [("env", "ok"), ("data", "ok"), ("loader", "ok")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_paths_nccl_group_and_two_ranks_on_one_card(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _kit("--out", str(out), "--tiny", "--only", "nccl,ddp,launch", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = json.loads((out / "gpu_check.json").read_text())["sections"]
    assert sections["nccl"]["backend"] == "nccl" and sections["ddp"]["device"].startswith("cuda")
    assert sections["launch"]["backend"] == "nccl"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_optimisers_are_fused_on_cuda() -> None:
    from detscale.engine.optim import build_optimizer

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).cuda()
    for name in ("sgd", "adamw"):
        assert build_optimizer(net, name, 1e-3, 0.9, 5e-4).defaults["fused"] is True
