"""The scaling projection (alpha-beta all-reduce, overlap with the backward, CPU roofline) and its report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from detscale import config as dsconfig
from detscale.report.build import build_report, contention_note
from detscale.report.projection import Baseline, Fabric, contention_for, exposed_comm_s, project
from test_report import write_config, write_run

LINK = Fabric("test", latency_s=1e-3, busbw_Bps=1e9, source="test")


def test_alpha_beta_follows_nccl_tests_bus_factor():
    assert LINK.allreduce_s(1e9, 1) == 0.0
    assert LINK.allreduce_s(1e9, 2) == pytest.approx(1e-3 + 1.0)  # 2 (n - 1) / n = 1
    assert LINK.allreduce_s(1e9, 8) == pytest.approx(1e-3 + 1.75)


def test_one_bucket_is_exposed_whole_and_many_hide_behind_the_backward():
    # one bucket is ready only when the backward ends: all of its all-reduce is exposed
    assert exposed_comm_s([10**8], 0.5, 2, LINK) == pytest.approx(LINK.allreduce_s(10**8, 2))
    # ten buckets of 10 MB during a 1 s backward: each takes 11 ms and is ready every 100 ms; only the last shows
    exposed = exposed_comm_s([10**7] * 10, 1.0, 2, LINK)
    assert exposed == pytest.approx(LINK.allreduce_s(10**7, 2))
    # a backward too short to hide anything: everything after the backward's end
    assert exposed_comm_s([10**8] * 4, 0.01, 2, LINK) == pytest.approx(4 * LINK.allreduce_s(10**8, 2) + 0.01 / 4 - 0.01,
                                                                       rel=1e-6)


def base(**kw) -> Baseline:
    values = dict(step_s=0.1, backward_s=0.04, batch=8, cpu_s=0.09, loader_s_per_image=0.0, cores=8, device="cpu",
                  scaling="weak")
    values.update(kw)
    return Baseline(**values)


def test_one_gpu_is_the_measurement_and_efficiency_falls_with_exposed_comm():
    b = base()
    one = project(b, [10**6], 1, 1, LINK, LINK)
    assert one.step_s == pytest.approx(0.1) and one.efficiency == pytest.approx(1.0)
    two = project(b, [10**6], 2, 1, LINK, LINK)
    assert two.exposed_comm_s == pytest.approx(LINK.allreduce_s(10**6, 2))
    assert two.images_per_s == pytest.approx(16 / (0.1 + two.exposed_comm_s))
    assert two.efficiency < 1 and not two.cpu_bound


def test_cpu_roofline_binds_when_ranks_and_loaders_want_more_cores_than_the_node_has():
    # each rank needs 90 ms of CPU per step and its workers 5 ms per image: 130 ms per step on 2 cores
    b = base(cores=2, loader_s_per_image=0.005)
    four = project(b, [10**6], 4, 1, LINK, LINK)
    # (on CPU ranks the all-reduce is CPU work too)
    assert four.cpu_bound and four.compute_s == pytest.approx(4 * (0.09 + 0.04 + LINK.allreduce_s(10**6, 4)) / 2)
    assert four.step_s == pytest.approx(four.compute_s)
    # strong scaling: the global batch is split, the per-rank work shrinks with it
    strong = project(base(scaling="strong", cores=64), [10**6], 4, 1, LINK, LINK)
    assert strong.compute_s == pytest.approx(0.1 * 2 / 8) and strong.images_per_s == pytest.approx(
        8 / strong.step_s)


def test_fewer_accumulated_batches_make_the_optimiser_a_larger_share():
    # 1 GPU accumulates 4 batches of 8 (nominal 32), so 20 ms of optimiser per step is 5 ms per batch;
    # 2 GPUs accumulate 2: 10 ms per batch; 4 GPUs 1: 20 ms per batch; 8 GPUs still 1.
    b = base(optimizer_s=0.005, accumulate=4, cores=64)
    assert [b.accumulate_for(n, 8) for n in (1, 2, 4, 8)] == [4, 2, 1, 1]
    steps = {n: project(b, [10**3], n, 1, LINK, LINK).compute_s for n in (1, 2, 4, 8)}
    assert steps[1] == pytest.approx(0.1)
    assert steps[2] == pytest.approx(0.105) and steps[4] == pytest.approx(0.115) and steps[8] == pytest.approx(0.115)


def test_contention_slows_every_rank_of_a_node_but_not_one_rank():
    b = base(cores=64)
    assert project(b, [10**3], 1, 4, LINK, LINK, contention=1.2).compute_s == pytest.approx(0.1)
    assert project(b, [10**3], 2, 1, LINK, LINK, contention=1.2).compute_s == pytest.approx(0.12)
    assert contention_for({2: 1.1, 4: 1.3}, 1) == 1.0 and contention_for({2: 1.1, 4: 1.3}, 3) == 1.1
    assert contention_for({2: 1.1, 4: 1.3}, 8) == 1.3 and contention_for({}, 8) == 1.0


def test_nodes_use_the_slower_fabric():
    slow = Fabric("slow", latency_s=5e-3, busbw_Bps=1e8, source="test")
    one_node = project(base(), [10**7], 2, 1, LINK, slow)
    two_nodes = project(base(), [10**7], 1, 2, LINK, slow)
    assert two_nodes.exposed_comm_s == pytest.approx(slow.allreduce_s(10**7, 2))
    assert two_nodes.step_s > one_node.step_s


def _with_breakdown(run_dir: Path, ms: dict[str, float], cpu_ms: float, loader_ms: float) -> None:
    path = run_dir / "timing.json"
    timing = json.loads(path.read_text())
    timing["step_breakdown_ms"] = ms
    timing["cpu_ms_per_step"], timing["loader_cpu_ms_per_image"] = cpu_ms, loader_ms
    timing["threads_per_rank"] = 1
    path.write_text(json.dumps(timing))
    env = json.loads((run_dir / "env.json").read_text())
    env["cpu_affinity"] = 2
    (run_dir / "env.json").write_text(json.dumps(env))


def comm_result(world: int = 2) -> dict:
    return {"model": "gelan-t", "imgsz": 64, "nc": 3, "world_size": world, "backend": "gloo", "device": "cpu",
            "bucket_bytes": [4 * 10**6, 2 * 10**6], "gradient_bytes": 6 * 10**6, "iters": 20, "warmup": 5,
            "time_ms": 6.5, "time_ms_p10": 6.0, "time_ms_p90": 8.0, "algbw_GBps": 0.92, "busbw_GBps": 0.92,
            "sweep": [], "fit": {"latency_us": 100.0, "busbw_GBps": 1.0}}


def test_report_shows_communication_projection_and_its_error(tmp_path: Path):
    cfg_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(cfg_path)
    one = write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", ips=80.0, map50_95=0.4)
    two = write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", ips=120.0, map50_95=0.4)
    # 1 GPU: 100 ms per step of 8 images
    _with_breakdown(one, {"data_wait": 10, "forward": 30, "backward": 40, "comm": 0, "optimizer": 15, "other": 5},
                    cpu_ms=90.0, loader_ms=2.0)
    _with_breakdown(two, {"data_wait": 10, "forward": 35, "backward": 45, "comm": 15, "optimizer": 20, "other": 8},
                    cpu_ms=110.0, loader_ms=2.0)
    comm = tmp_path / "comm.json"
    comm.write_text(json.dumps(comm_result()))
    files = build_report([one, two], cfg_path, tmp_path / "report", [comm])
    md = files.markdown.read_text()
    assert "## Communication" in md and "| gelan-t | 64 | 2 cpu | gloo | 5.7 | 2 | 6.50 |" in md
    # predicted at 2 ranks: the CPU roofline binds, 2 x (90 + 2 x 8 + the all-reduce, CPU work here) / 2 cores
    fabric = Fabric("m", 1e-4, 1e9, "")
    predicted = 16 / (0.106 + fabric.allreduce_s(4 * 10**6, 2) + fabric.allreduce_s(2 * 10**6, 2))
    assert f"| 2 | 120.0 | {predicted:.1f} | {(predicted - 120) / 120:+.1%} |" in md
    assert "| 1 | 80.0 | 80.0 | +0.0% |" in md
    page = files.html.read_text()
    assert "Scaling projection" in page and "ib200" in page and "IBTA" in page
    assert files.plots["projection"].read_bytes()[:4] == b"\x89PNG"
    # ranks x (1 thread + 2 loader workers, the default) on 2 cores is crowded
    assert "CPU contention: 1 rank(s) x (1 thread(s) + 2 loader worker(s)) = 3 > 2 cores; 2 rank(s)" in md


def test_without_a_communication_benchmark_the_report_says_so(tmp_path: Path):
    cfg_path = write_config(tmp_path, [1, 2])
    cfg = dsconfig.load(cfg_path)
    dirs = [write_run(tmp_path / "runs", cfg, f"gelan-t_64_g{g}_b8_disk_fp32_s0_r0", ips=80.0 * g, map50_95=0.4)
            for g in (1, 2)]
    md = build_report(dirs, cfg_path, tmp_path / "report").markdown.read_text()
    assert "No projection for gelan-t_64_b8_disk_fp32: no 1-GPU run with a step breakdown" in md


def test_contention_note_needs_more_demand_than_cores():
    row = {"device": "cpu", "gpus": 2, "nodes": 1, "threads_per_rank": 1.0, "workers": 0, "cpu_cores": 2}
    assert contention_note([row]) is None
    assert "= 4 > 2 cores" in contention_note([dict(row, workers=1)])
    assert contention_note([dict(row, workers=1, device="cuda", threads_per_rank=math.nan)]) is None


def test_projection_fabrics_are_checked_by_name():
    raw = {"dataset": {"name": "x", "synthetic": {}}, "grid": {"model": ["gelan-t"]},
           "projection": {"intra_node": "nvlink9"}}
    with pytest.raises(dsconfig.ConfigError, match="'projection.intra_node': got 'nvlink9'; use 'measured' or one of"):
        dsconfig.from_dict(raw)
    raw["projection"] = {"intra_node": "mine", "fabrics": {"mine": {"latency_us": 5, "busbw_GBps": 100,
                                                                      "source": "our own nccl-tests run"}},
                         "inter_node": "mine"}
    assert dsconfig.from_dict(raw).projection.fabrics["mine"]["busbw_GBps"] == 100
