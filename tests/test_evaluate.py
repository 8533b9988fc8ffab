"""`detscale evaluate` end to end: exact against pycocotools, 1 rank == 2 ranks, clear errors.

The model is a randomly initialised gelan-t whose output layers are re-drawn so that it gives
many detections of varied size and score (300 per image at conf 0.001): the metric code is
exercised on real model output without a training run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch import nn

from detscale.data.synth import SynthParams, generate
from detscale.metrics.predict import detections_to_coco, gather_predictions, sort_detections
from test_coco import assert_same, pycocotools_metrics

NC = 6  # classes of the synthetic dataset
IMGSZ = 128
EVAL = SimpleNamespace(conf=0.001, iou=0.7, max_det=300, batch=4)


def noisy_model(seed: int = 0) -> nn.Module:
    """gelan-t with output layers that predict small-to-medium boxes and spread-out scores."""
    from detscale.model import build_model

    torch.manual_seed(seed)
    model = build_model("gelan-t", NC)
    with torch.no_grad():
        head = model.head
        for box, cls in zip(head.box, head.cls, strict=True):
            box[-1].weight.mul_(10)
            # distribution logits falling with the bin index: distances of a few strides
            box[-1].bias.copy_(-0.5 * torch.arange(head.reg_max).repeat(4) + torch.randn(4 * head.reg_max))
            cls[-1].weight.mul_(5)
            nn.init.normal_(cls[-1].bias, -3, 1)
    return model


def save_checkpoint(model: nn.Module, path: Path, **override) -> Path:
    sd = model.state_dict()
    ckpt = {"model": sd, "ema": sd, "model_name": "gelan-t", "nc": NC, "imgsz": IMGSZ, "epoch": 1, "step": 1}
    ckpt.update(override)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 6-image val split, an experiment config, a checkpoint; the run id of the config."""
    root = tmp_path_factory.mktemp("evaluate")
    generate(root / "ds", seed=3, train=1, val=6, workers=1,
             params=SynthParams(imgsz=96, objects=(1, 5), object_size=(0.1, 0.6)))
    cfg = {
        "dataset": {"name": "evtest", "data_yaml": str(root / "ds" / "data.yaml")},
        "grid": {"model": ["gelan-t"], "imgsz": [IMGSZ], "gpus": [1], "batch": [4], "cache": ["disk"]},
        "train": {"workers": 0, "cpu_threads_per_rank": 1, "timeout_s": 120},
        "eval": {"batch": EVAL.batch},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    weights = save_checkpoint(noisy_model(), root / "run" / "weights" / "last.pt")
    return SimpleNamespace(root=root, data=root / "ds" / "data.yaml", config=root / "config.yaml",
                           weights=weights, run="gelan-t_128_g1_b4_disk_fp32_s0_r0", gt=root / "coco_val.json")


def evaluate_cmd(s, out: Path, weights: Path | None = None, ranks: int = 1) -> list[str]:
    args = ["evaluate", "--weights", str(weights or s.weights), "--config", str(s.config), "--run", s.run,
            "--out", str(out), "--data", str(s.data), "--gt", str(s.gt)]
    if ranks == 1:
        return [sys.executable, "-m", "detscale", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "--", "detscale", *args]  # "--": torchrun would read --run as its --run-path


def run_cmd(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def one_rank(setup):
    out = setup.root / "out1"
    proc = run_cmd(evaluate_cmd(setup, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SimpleNamespace(out=out, proc=proc, metrics=json.loads((out / "eval.json").read_text()))


def test_eval_json_keys_and_table(setup, one_rank):
    m = one_rank.metrics
    assert set(m) == {"map50_95", "map50", "map75", "map_small", "map_medium", "map_large", "ar100",
                      "per_class", "num_images", "ground_truth", "predictions", "prediction_ids"}
    assert m["num_images"] == 6 and m["prediction_ids"].startswith("the ground truth's")
    assert m["ground_truth"] == str(setup.gt) and Path(m["predictions"]) == one_rank.out / "predictions.json"
    names = yaml.safe_load(setup.data.read_text())["names"]
    assert list(m["per_class"]) == [names[i] for i in range(NC)]
    assert "mAP@0.5:0.95" in one_rank.proc.stdout and "AR@100" in one_rank.proc.stdout


def test_predictions_are_coco_results_in_original_pixels(setup, one_rank):
    preds = json.loads((one_rank.out / "predictions.json").read_text())
    gt = json.loads(setup.gt.read_text())
    sizes = {im["id"]: (im["width"], im["height"]) for im in gt["images"]}
    assert len(preds) > 6 * 50  # the noisy model detects plenty
    assert preds == sort_detections(preds)
    per_image = {}
    for d in preds:
        w, h = sizes[d["image_id"]]
        x, y, bw, bh = d["bbox"]
        assert min(x, y) >= 0 and x + bw <= w + 0.011 and y + bh <= h + 0.011  # 96-px originals, not 128
        assert 0.001 < d["score"] <= 1 and 0 <= d["category_id"] < NC
        per_image[d["image_id"]] = per_image.get(d["image_id"], 0) + 1
    assert max(per_image.values()) <= EVAL.max_det


def test_metrics_equal_pycocotools_on_model_output(setup, one_rank):
    """The issue's exactness check: pycocotools on predictions.json + ground truth = eval.json."""
    ref = pycocotools_metrics(setup.gt, one_rank.out / "predictions.json")
    assert_same(one_rank.metrics, ref)
    assert one_rank.metrics["ar100"] > 0  # some detections do match


def test_two_ranks_give_identical_files(setup, one_rank):
    out = setup.root / "out2"
    proc = run_cmd(evaluate_cmd(setup, out, ranks=2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks" in proc.stdout
    two = json.loads((out / "eval.json").read_text())
    assert two.pop("predictions") == str(out / "predictions.json")
    one = dict(one_rank.metrics)
    one.pop("predictions")
    assert two == one
    assert (out / "predictions.json").read_bytes() == (one_rank.out / "predictions.json").read_bytes()


@pytest.mark.parametrize("override, message", [
    ({"model_name": "gelan-s"}, "model 'gelan-s' (expected 'gelan-t')"),
    ({"nc": 3}, "3 classes (expected 6"),
    ({"imgsz": 640}, "image size 640 (expected 128)"),
])
def test_checkpoint_of_another_run_is_a_clear_error(setup, caplog, override, message):
    """Exit code 2 and a message that says what, what was expected and how to fix it; no files."""
    from detscale.cli import main

    bad = save_checkpoint(noisy_model(), setup.root / "bad" / "other.pt", **override)
    cmd = evaluate_cmd(setup, setup.root / "bad_out", weights=bad)
    assert main(cmd[3:]) == 2  # a UserError: the CLI prints the message, never a traceback
    assert "does not belong to this run" in caplog.text and message in caplog.text and "--run" in caplog.text
    assert not (setup.root / "bad_out" / "eval.json").exists()


def test_not_a_checkpoint_is_a_clear_error(setup, caplog):
    from detscale.cli import main

    junk = setup.root / "junk.pt"
    junk.write_bytes(b"\x00not a torch file")
    assert main(evaluate_cmd(setup, setup.root / "junk_out", weights=junk)[3:]) == 2
    assert "not a readable checkpoint" in caplog.text
    plain = setup.root / "plain.pt"
    torch.save({"weights": {}}, plain)
    assert main(evaluate_cmd(setup, setup.root / "junk_out", weights=plain)[3:]) == 2
    assert "lacks ema, model_name, nc" in caplog.text
    assert main(evaluate_cmd(setup, setup.root / "junk_out", weights=setup.root / "missing.pt")[3:]) == 2
    assert "does not exist" in caplog.text


def test_evaluate_model_in_memory_and_without_detections(setup):
    """The trainer's call: no files; and conf 1.0 (no detection at all) gives zeros, not a crash."""
    from detscale.metrics.evaluate import evaluate_model
    from detscale.model import fuse_for_inference

    model = fuse_for_inference(noisy_model())
    none = SimpleNamespace(conf=1.0, iou=0.7, max_det=300, batch=6)
    m = evaluate_model(model, setup.data, "val", IMGSZ, none, setup.gt, None, workers=0)
    assert m["predictions"] is None and m["num_images"] == 6
    assert m["map50_95"] == 0.0 and m["map50"] == 0.0 and m["ar100"] == 0.0
    assert all(v in (0.0, None) for v in m["per_class"].values())


def test_shards_that_miss_images_are_refused(setup):
    from detscale.metrics.evaluate import _metrics_on_main

    with pytest.raises(RuntimeError, match="covered 6 images .5 distinct"):
        _metrics_on_main([], [0, 1, 2, 3, 4, 4], setup.data, "val", setup.gt, None)


# ---------------------------------------------------------------------------------------------
# Units
# ---------------------------------------------------------------------------------------------


def test_detections_to_coco_rounds_and_converts():
    det = torch.tensor([[10.123456, 20.5, 30.0, 60.25, 0.87654321, 2.0]])
    assert detections_to_coco(det, 7) == [
        {"image_id": 7, "category_id": 2, "bbox": [10.12, 20.5, 19.88, 39.75], "score": 0.87654}
    ]
    assert detections_to_coco(torch.zeros(0, 6), 0) == []


def test_gather_sorts_deterministically():
    dets = [
        {"image_id": 1, "category_id": 0, "bbox": [1.0, 1.0, 2.0, 2.0], "score": 0.5},
        {"image_id": 0, "category_id": 2, "bbox": [1.0, 1.0, 2.0, 2.0], "score": 0.5},
        {"image_id": 0, "category_id": 1, "bbox": [5.0, 1.0, 2.0, 2.0], "score": 0.5},
        {"image_id": 0, "category_id": 1, "bbox": [3.0, 1.0, 2.0, 2.0], "score": 0.5},
        {"image_id": 0, "category_id": 3, "bbox": [1.0, 1.0, 2.0, 2.0], "score": 0.9},
    ]
    out = gather_predictions(dets)
    assert [(d["image_id"], d["category_id"], d["bbox"][0]) for d in out] == [
        (0, 3, 1.0), (0, 1, 3.0), (0, 1, 5.0), (0, 2, 1.0), (1, 0, 1.0)]
    assert gather_predictions(list(reversed(dets))) == out
    assert all(type(d["image_id"]) is int and type(d["score"]) is float for d in out)
    assert gather_predictions([]) == []


# ---------------------------------------------------------------------------------------------
# With the trainer's own checkpoint
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_written_by_train_evaluates(tmp_path):
    """`detscale train` (2 short epochs) -> last.pt -> `detscale evaluate` on 1 and 2 ranks.

    Checks the checkpoint contract between the trainer and evaluation, on top of the metric
    checks above: eval.json equal to pycocotools, and identical files from 1 and 2 ranks.
    """
    generate(tmp_path / "ds", seed=1, train=16, val=5, workers=1,
             params=SynthParams(imgsz=96, objects=(1, 4), object_size=(0.15, 0.6)))
    cfg = {
        "dataset": {"name": "evtrain", "data_yaml": str(tmp_path / "ds" / "data.yaml")},
        "grid": {"model": ["gelan-t"], "imgsz": [IMGSZ], "gpus": [1], "batch": [8], "cache": ["none"], "epochs": 2},
        "train": {"workers": 0, "cpu_threads_per_rank": 1, "warmup_epochs": 0, "close_mosaic": 1,
                  "timing_warmup_steps": 1, "timeout_s": 120, "nominal_batch": 8},
        "eval": {"batch": 2, "conf": 0.0001},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    s = SimpleNamespace(root=tmp_path, data=tmp_path / "ds" / "data.yaml", config=tmp_path / "config.yaml",
                        weights=tmp_path / "run" / "weights" / "last.pt", run="gelan-t_128_g1_b8_none_fp32_s0_r0",
                        gt=tmp_path / "coco_val.json")
    train = [sys.executable, "-m", "detscale", "train", "--config", str(s.config), "--run", s.run,
             "--out", str(tmp_path / "run"), "--data", str(s.data)]
    proc = run_cmd(train)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = {}
    for ranks in (1, 2):
        out = tmp_path / f"out{ranks}"
        proc = run_cmd(evaluate_cmd(s, out, ranks=ranks))
        assert proc.returncode == 0, proc.stderr[-3000:]
        files[ranks] = ((out / "predictions.json").read_bytes(), json.loads((out / "eval.json").read_text()))
        files[ranks][1].pop("predictions")
    assert files[1] == files[2]
    assert len(json.loads(files[1][0])) > 0
    assert_same(files[1][1], pycocotools_metrics(s.gt, tmp_path / "out1" / "predictions.json"))
