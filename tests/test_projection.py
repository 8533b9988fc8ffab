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
    # the contention probe on 4 ranks of 2 cores measured x2.4: x2 of it is waiting for a core, which the
    # roofline counts itself, so the ranks' CPU seconds grow by x1.2 only
    crowded = project(b, [10**6], 4, 1, LINK, LINK, contention=2.4)
    assert crowded.compute_s == pytest.approx(4 * (0.09 * 1.2 + 0.04 + LINK.allreduce_s(10**6, 4)) / 2)
    assert project(base(cores=8, loader_s_per_image=0.005), [10**6], 4, 1, LINK, LINK, contention=1.2).compute_s \
        == pytest.approx(0.1 * 1.2)  # enough cores: the probe's slowdown is all contention, and the roofline is off
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
    # without spreads (one 1-GPU run, a one-round probe) the interval is the all-reduce's p10..p90 alone
    slow = 16 / (0.106 + (8.0 / 6.5) * (fabric.allreduce_s(4 * 10**6, 2) + fabric.allreduce_s(2 * 10**6, 2)))
    fast = 16 / (0.106 + (6.0 / 6.5) * (fabric.allreduce_s(4 * 10**6, 2) + fabric.allreduce_s(2 * 10**6, 2)))
    # the 2-GPU run's breakdown misses the projection most in its exposed communication (15 ms measured; the
    # model hides most of it behind the backward)
    assert (f"| 2 | 120.0 | {predicted:.1f} ({slow:.1f}–{fast:.1f}) | "
            f"{(predicted - 120) / 120:+.1%} | **no** | exposed communication: 15.0 ms measured, 2.1 ms projected "
            "(the projection is bound by the CPU roofline here) |") in md
    assert "| 1 | 80.0 | 80.0 (80.0–80.0) | +0.0% | yes | — |" in md
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


def test_the_interval_carries_every_input_spread_and_a_miss_names_its_term():
    """A point inside the spread of its inputs is a hit; outside, the step term that misses most is named."""
    from detscale.report.projection import check_point

    b = Baseline(step_s=0.1, backward_s=0.04, forward_s=0.03, optimizer_s=0.015, batch=8, cpu_s=None,
                 loader_s_per_image=0.0, cores=2, device="cuda", scaling="weak", step_spread=(0.95, 1.05))
    comm = comm_result()
    row = {"gpus": 2, "nodes": 1, "device": "cuda", "images_per_s": 150.0, "forward_ms": 33.0, "backward_ms": 44.0,
           "comm_ms": 1.0, "optimizer_ms": 16.5, "step_ms": 16 / 150 * 1000}
    k = check_point(b, [6 * 10**6], 2, [row], comm, LINK, 1.1, (1.05, 1.2))
    # the ends: every input at the same end of its spread
    fabric = Fabric("m", 1e-4, 1e9, "")
    hi = project(b.scaled(0.95), [6 * 10**6], 2, 1, Fabric("", 1e-4 * 6 / 6.5, 1e9 * 6.5 / 6, ""), LINK, 1.05)
    lo = project(b.scaled(1.05), [6 * 10**6], 2, 1, Fabric("", 1e-4 * 8 / 6.5, 1e9 * 6.5 / 8, ""), LINK, 1.2)
    assert k.high == pytest.approx(hi.images_per_s) and k.low == pytest.approx(lo.images_per_s)
    assert k.projected == pytest.approx(project(b, [6 * 10**6], 2, 1, fabric, LINK, 1.1).images_per_s)
    assert k.low < k.projected < k.high
    # 150 img/s: 9 % faster than projected, inside the interval (119.8..151.8): a hit, nothing named
    assert k.inside and k.off_term() == "" and k.error == pytest.approx(k.projected / 150 - 1)
    assert not k.oversubscribed
    cpu_row = dict(row, device="cpu", threads_per_rank=2, cpu_cores=2)
    assert check_point(b, [6 * 10**6], 2, [cpu_row], comm, LINK, 1.1, (1.05, 1.2)).oversubscribed
    # twice the communication the model expects and a slower step: outside, and communication is named
    slow_row = dict(row, comm_ms=60.0, step_ms=170.0, images_per_s=16 / 0.170)
    miss = check_point(b, [6 * 10**6], 2, [slow_row], comm, LINK, 1.1, (1.05, 1.2))
    assert not miss.inside and miss.off_term().startswith("exposed communication: 60.0 ms measured")
    # a slower forward+backward than the probe's contention: the compute term is named
    crowded = dict(row, forward_ms=50.0, backward_ms=70.0, step_ms=150.0, images_per_s=16 / 0.150)
    assert check_point(b, [6 * 10**6], 2, [crowded], comm, LINK, 1.1, (1.05, 1.2)).off_term().startswith(
        "compute under contention (forward + backward): 120.0 ms measured, 77.0 ms projected")
    no_breakdown = {k: v for k, v in slow_row.items() if not k.endswith("_ms")}
    assert "train.step_breakdown" in check_point(b, [6 * 10**6], 2, [no_breakdown], comm, LINK, 1.1,
                                                  (1.05, 1.2)).off_term()


def test_the_contention_range_comes_from_the_probe_rounds():
    from detscale.report.projection import contention_range_by_ranks, contention_range_for

    probe = dict(comm_result(), contention={"factor": 1.1, "factor_min": 1.02, "factor_max": 1.3})
    old = dict(comm_result(4), contention={"factor": 1.2})  # a one-round probe of an older version
    ranges = contention_range_by_ranks([probe, old])
    assert ranges == {2: (1.02, 1.3), 4: (1.2, 1.2)}
    assert contention_range_for(ranges, 1) == (1.0, 1.0) and contention_range_for(ranges, 3) == (1.02, 1.3)


def test_inter_node_measured_fits_the_multinode_preflight(tmp_path: Path):
    """``inter_node: measured``: the alpha-beta fit of a multi-node run's preflight.json sweep."""
    from detscale.report.projection import fabric_from_preflight

    # 2 nodes: bus factor 1, so t = 50 us + S / 2 GB/s exactly
    sweep = [{"bytes": s, "seconds": 50e-6 + s / 2e9, "bus_gbps": s / (50e-6 + s / 2e9) / 1e9}
             for s in (1 << 16, 1 << 20, 1 << 23)]
    record = {"nodes": [{"host": "a", "interface": "ib0"}, {"host": "b", "interface": "ib0"}], "allreduce": sweep}
    fabric = fabric_from_preflight(record)
    assert fabric.latency_s == pytest.approx(50e-6) and fabric.busbw_Bps == pytest.approx(2e9)
    assert "preflight of a, b over ib0" in fabric.source

    cfg_path = write_config(tmp_path, [1, 2])
    raw = json.loads(json.dumps(dsconfig.load(cfg_path).to_dict()))
    raw["projection"] = {"inter_node": "measured"}
    (tmp_path / "config.yaml").write_text(json.dumps(raw))
    cfg = dsconfig.load(cfg_path)
    one = write_run(tmp_path / "runs", cfg, "gelan-t_64_g1_b8_disk_fp32_s0_r0", ips=80.0, map50_95=0.4)
    two = write_run(tmp_path / "runs", cfg, "gelan-t_64_g2_b8_disk_fp32_s0_r0", ips=120.0, map50_95=0.4)
    _with_breakdown(one, {"data_wait": 10, "forward": 30, "backward": 40, "comm": 0, "optimizer": 15, "other": 5},
                    cpu_ms=90.0, loader_ms=2.0)
    comm = tmp_path / "comm.json"
    comm.write_text(json.dumps(comm_result()))
    md = build_report([one, two], cfg_path, tmp_path / "report", [comm]).markdown.read_text()
    assert "no run of these results went through a multi-node network preflight" in md
    (two / "preflight.json").write_text(json.dumps(record))
    files = build_report([one, two], cfg_path, tmp_path / "report2", [comm])
    assert "measured (preflight, 2 nodes)" in files.html.read_text()
