"""The parity benchmark's reading of its runs (benchmarks/bench_parity.py): pairs, not a glance."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import statistics
import threading
from pathlib import Path

import pytest
from scipy import stats

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_parity.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_parity", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(trainer: str, epochs: int, seed: int, map50_95: float) -> dict:
    return {"trainer": trainer, "epochs": epochs, "seed": seed, "map50": 2 * map50_95, "map50_95": map50_95,
            "images_per_s": 20.0 if trainer != "ultralytics" else 12.0, "epoch_seconds": 22.4}


def test_pooled_ratio_reads_each_seed_as_one_paired_sample(bench):
    ours, ref = [0.141, 0.158, 0.342], [0.184, 0.144, 0.351]
    pairs = [(record("d", e, s, a), record("ultralytics", e, s, b))
             for (e, s), a, b in zip([(20, 0), (20, 1), (30, 2)], ours, ref, strict=True)]
    line = bench.pooled_ratio("d", pairs)
    logs = [math.log(a / b) for a, b in zip(ours, ref, strict=True)]
    mean, half = statistics.fmean(logs), 4.302653 * statistics.stdev(logs) / math.sqrt(3)  # t(0.975, 2 df)
    assert "(3 pairs, 3 seeds;" in line
    assert f"ratio {math.exp(mean):.2f} (geometric mean)" in line
    assert f"95 % CI {math.exp(mean - half):.2f}..{math.exp(mean + half):.2f}" in line
    needed = int(re.search(r"takes about (\d+) seeds", line).group(1))
    sd, gap = statistics.stdev(logs), -math.log(0.95)
    assert stats.t.ppf(0.975, needed - 1) * sd / math.sqrt(needed) <= gap
    assert stats.t.ppf(0.975, needed - 2) * sd / math.sqrt(needed - 1) > gap


def test_pooled_ratio_averages_the_budgets_of_one_seed(bench):
    """Two budgets of one seed share its initial weights: one sample, not two."""
    pairs = [(record("d", 20, 0, 0.1), record("ultralytics", 20, 0, 0.2)),
             (record("d", 30, 0, 0.4), record("ultralytics", 30, 0, 0.2)),
             (record("d", 20, 1, 0.3), record("ultralytics", 20, 1, 0.2))]
    line = bench.pooled_ratio("d", pairs)
    logs = [0.0, math.log(1.5)]  # seed 0: mean of log 0.5 and log 2
    mean, half = statistics.fmean(logs), 12.706205 * statistics.stdev(logs) / math.sqrt(2)  # t(0.975, 1 df)
    assert "(3 pairs, 2 seeds;" in line
    assert f"ratio {math.exp(mean):.2f} (geometric mean), 95 % CI {math.exp(mean - half):.2f}.." in line
    assert "no interval possible" in bench.pooled_ratio("d", pairs[:2])


def test_pooled_ratio_with_one_pair_or_identical_pairs(bench):
    one = [(record("d", 20, 0, 0.1), record("ultralytics", 20, 0, 0.2))]
    assert "no interval possible" in bench.pooled_ratio("d", one)
    same = [(record("d", 20, s, 0.19), record("ultralytics", 20, s, 0.2)) for s in range(3)]
    line = bench.pooled_ratio("d", same)
    assert "ratio 0.95" in line and "95 % CI 0.95..0.95" in line and "about 2 seeds" in line


def test_summary_pairs_runs_of_the_same_budget_and_seed(bench):
    records = [record("detscale-x", 20, 0, 0.1), record("ultralytics", 20, 0, 0.2),
               record("detscale-x", 20, 1, 0.3), record("ultralytics", 20, 1, 0.2),
               record("detscale-x", 30, 0, 0.4)]  # no reference run: not paired
    args = argparse.Namespace(model="m", ultralytics_model="u", data_seed=0, train=448, val=100, imgsz=256,
                              batch=16, threads=1, workers=1, jobs=2, init="same")
    text = bench.summarise(records, args)
    assert "1 CPU thread(s), 1 loader worker(s), 2 run(s) at a time" in text
    assert "the same initial weights for both" in text
    assert "| 20 | detscale-x | 2 | 0.50, 1.50 | 1.00 | 1.67 |" in text
    assert "| 30 | detscale-x |" not in text
    assert "(2 pairs, 2 seeds;" in text


def test_initial_weights_start_the_reference_model_where_detscale_starts(bench, tmp_path):
    """--init same: Ultralytics' yolov9t.yaml, loaded with detscale's initial weights of a seed by
    position, computes what detscale's model of that seed computes, and its parameters stay the
    tensors an optimiser already holds (loaded in place)."""
    import torch
    from ultralytics.nn.tasks import DetectionModel

    from detscale.engine.build import initial_model

    args = argparse.Namespace(model="gelan-t-detect")
    path = bench.initial_weights(args, 6, 3, tmp_path)
    assert bench.initial_weights(args, 6, 3, tmp_path) == path  # reused
    ours = initial_model("gelan-t-detect", 6, 3).eval()
    ref = DetectionModel("yolov9t.yaml", nc=6, verbose=False)
    params = [id(q) for q in ref.parameters()]
    bench.load_by_position(ref, torch.load(path))
    assert [id(q) for q in ref.parameters()] == params
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(ours(x)[:, 4:], ref.eval()(x)[0][:, 4:], atol=1e-6)
    with pytest.raises(SystemExit, match="shapes differ"):
        bench.load_by_position(DetectionModel("yolov9s.yaml", nc=6, verbose=False), torch.load(path))


def test_final_train_loss_reads_both_trainers_logs(bench, tmp_path):
    """The last epochs' training loss, from detscale's metrics.jsonl and Ultralytics' results.csv."""
    ours = tmp_path / "d" / "run"
    ours.mkdir(parents=True)
    rows = [{"epoch": e, "loss_box": 1.0 + e, "loss_cls": 2.0, "loss_dfl": 0.5} for e in range(5)]
    (ours / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert bench.final_train_loss(tmp_path / "d", "detscale") == pytest.approx(3.5 + 3.0)  # epochs 2..4
    ref = tmp_path / "u" / "train"
    ref.mkdir(parents=True)
    ref.joinpath("results.csv").write_text(
        "epoch,time,train/box_loss,train/cls_loss,train/dfl_loss\n1,9,2.0,3.0,1.0\n2,18,1.5,2.5,1.0\n")
    assert bench.final_train_loss(tmp_path / "u", "ultralytics", last=1) == pytest.approx(5.0)
    assert bench.final_train_loss(tmp_path / "missing", "ultralytics") is None
    pairs = [(record("d", 20, s, 0.1) | {"train_loss": 4.0 + s}, record("ultralytics", 20, s, 0.1) | {"train_loss": 4})
             for s in range(3)]
    line = bench.pooled_ratio("d", pairs, key="train_loss", label="training loss")
    geometric = (1.0 * 1.25 * 1.5) ** (1 / 3)
    assert line.startswith("- d, all budgets pooled (3 pairs, 3 seeds;")
    assert f"training loss ratio {geometric:.2f}" in line


def test_run_queue_trains_the_two_runs_of_a_pair_side_by_side(bench):
    both = threading.Barrier(2, timeout=30)  # passes only when two runs are training at once
    ran = []

    def train(epochs, seed, name):
        both.wait()
        ran.append((epochs, seed, name))

    bench.run_queue([(20, 0, "detscale"), (20, 0, "ultralytics"), (30, 0, "detscale"), (30, 0, "ultralytics")],
                    train, jobs=2)
    assert sorted(ran) == [(20, 0, "detscale"), (20, 0, "ultralytics"), (30, 0, "detscale"), (30, 0, "ultralytics")]
    with pytest.raises(threading.BrokenBarrierError):  # one at a time, a run never has a partner
        alone = threading.Barrier(2, timeout=0.2)
        bench.run_queue([(20, 0, "detscale"), (20, 0, "ultralytics")], lambda *item: alone.wait(), jobs=1)


def test_run_queue_stops_at_the_first_failure_after_the_running_runs_finish(bench):
    partner_failed = threading.Event()
    finished = []

    def train(epochs, seed, name):
        if name == "fails":
            partner_failed.set()
            raise SystemExit("run failed; see its train.log")
        assert partner_failed.wait(timeout=30)  # still training when its partner fails
        finished.append((epochs, seed, name))

    with pytest.raises(SystemExit, match="see its train.log"):
        bench.run_queue([(20, 0, "trains"), (20, 0, "fails"), (30, 0, "never starts")], train, jobs=2)
    assert finished == [(20, 0, "trains")]


def test_seed_spread_gives_each_trainers_spread_and_the_pairs_correlation(bench):
    ours, ref = [0.119, 0.167, 0.190, 0.199], [0.149, 0.180, 0.165, 0.142]
    pairs = [(record("d", 20, s, a), record("ultralytics", 20, s, b))
             for s, (a, b) in enumerate(zip(ours, ref, strict=True))]
    log_d, log_u = [math.log(x) for x in ours], [math.log(x) for x in ref]
    r = stats.pearsonr(log_d, log_u).statistic
    assert bench.seed_spread(pairs) == f"{statistics.stdev(log_d):.2f} / {statistics.stdev(log_u):.2f} | {r:.2f}"
    assert bench.seed_spread(pairs[:2]).endswith("| -")  # two seeds: a spread, no correlation
    assert bench.seed_spread(pairs[:1]) == "- | -"
    moving_together = [(record("d", 20, s, 0.1 * (s + 1)), record("ultralytics", 20, s, 0.2 * (s + 1)))
                       for s in range(3)]
    assert bench.seed_spread(moving_together).endswith("| 1.00")
