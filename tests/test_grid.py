"""Grid expansion: run ids, derived batches, strong scaling, and the per-run config files the workflow keys on."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from detscale import cli
from detscale import config as dsconfig
from detscale import files as dsfiles
from detscale.commands import runs as dsruns

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "dataset": {"name": "shapes", "synthetic": {"imgsz": 64, "train": 8, "val": 4}},
    "grid": {"model": ["gelan-t"], "imgsz": [64], "gpus": [1, 2], "batch": [8], "cache": ["disk"],
             "precision": ["fp32"], "repeats": 1, "epochs": 2},
}


def make(**grid) -> dsconfig.ExperimentConfig:
    raw = copy.deepcopy(BASE)
    raw["grid"].update(grid)
    return dsconfig.from_dict(raw)


def test_default_config_runs():
    cfg = dsconfig.load(ROOT / "config" / "config.yaml")
    points = cfg.runs()
    assert sorted(p.gpus for p in points) == [1, 2]
    assert all(p.scaling == "weak" for p in points)
    ids = [p.run_id for p in points]
    assert len(set(ids)) == len(ids)
    one = next(p for p in points if p.gpus == 1)
    assert one.run_id == f"{one.model}_{one.imgsz}_g1_b{one.batch}_{one.cache}_{one.precision}_s{one.seed}_r0"


def test_every_point_trains_once_per_seed_and_run_ids_carry_it():
    cfg = make(gpus=[1, 2], seeds=[3, 0, 7], repeats=2)
    points = cfg.runs()
    assert len(points) == 2 * 3 * 2
    assert [(p.gpus, p.seed, p.repeat) for p in points][:4] == [(1, 3, 0), (1, 3, 1), (1, 0, 0), (1, 0, 1)]
    ids = {p.run_id for p in points}
    assert len(ids) == len(points) and "gelan-t_64_g2_b8_disk_fp32_s7_r1" in ids
    assert {p.group for p in points} == {"gelan-t_64_b8_disk_fp32"}  # seeds pair up within one group


@pytest.mark.parametrize(("seeds", "message"), [
    ([], "'grid.seeds': got []; must have at least 1 item(s)"),
    ([1, 1], "'grid.seeds': got [1, 1]; must not repeat a value"),
    ([0, -2], "'grid.seeds[1]': got -2; must be >= 0"),
    ("0", "'grid.seeds': got '0'; must be of type array"),
])
def test_bad_seeds_are_config_errors_naming_the_key(seeds, message):
    with pytest.raises(dsconfig.ConfigError) as err:
        make(seeds=seeds)
    assert message in str(err.value)


def test_deprecated_single_seed_is_one_seed_and_not_both():
    assert make(seed=5).grid.seeds == (5,)
    assert {p.seed for p in make(seed=5).runs()} == {5}
    with pytest.raises(dsconfig.ConfigError, match=r"'grid.seed' and 'grid.seeds' both given; keep only 'seeds: \[5"):
        make(seed=5, seeds=[1, 2])


def test_full_product_in_stable_order():
    cfg = make(model=["gelan-t", "gelan-s"], imgsz=[64, 128], gpus=[1, 2, 4], batch=[8, 16],
               cache=["disk", "ram"], precision=["fp32", "bf16"], repeats=3)
    points = cfg.runs()
    assert len(points) == 2 * 2 * 3 * 2 * 2 * 2 * 3
    assert len({p.run_id for p in points}) == len(points)
    assert points == cfg.runs()  # deterministic
    assert points[0].run_id == "gelan-t_64_g1_b8_disk_fp32_s0_r0"
    assert points[1].run_id == "gelan-t_64_g1_b8_disk_fp32_s0_r1"
    # every point round-trips through its id
    for p in points[:20]:
        assert cfg.run(p.run_id) == p


def test_weak_scaling_batches():
    g4 = make(gpus=[1, 4]).run("gelan-t_64_g4_b8_disk_fp32_s0_r0")
    assert (g4.batch_per_rank, g4.global_batch) == (8, 32)


def test_strong_scaling_batches_and_ids():
    cfg = make(gpus=[1, 2, 4], batch=[32], scaling="strong")
    ids = [p.run_id for p in cfg.runs()]
    assert ids == ["gelan-t_64_g1_b32s_disk_fp32_s0_r0", "gelan-t_64_g2_b32s_disk_fp32_s0_r0",
                   "gelan-t_64_g4_b32s_disk_fp32_s0_r0"]
    for p in cfg.runs():
        assert p.global_batch == 32 and p.batch_per_rank == 32 // p.gpus
    assert len({p.group for p in cfg.runs()}) == 1
    assert cfg.runs()[0].group.endswith("b32s_disk_fp32")  # weak and strong never share a group


def test_strong_scaling_indivisible_is_an_error():
    with pytest.raises(dsconfig.ConfigError, match="divide evenly"):
        make(gpus=[1, 3], batch=[16], scaling="strong")


def test_multi_node_ids():
    cfg = make(gpus=[8, 16], nodes=2)
    p = cfg.runs()[0]
    assert p.run_id == "gelan-t_64_g8n2_b8_disk_fp32_s0_r0" and p.gpus_per_node == 4
    with pytest.raises(dsconfig.ConfigError, match="divide by the number of nodes"):
        make(gpus=[3], nodes=2)


def test_group_is_the_point_without_gpus_and_repeat():
    cfg = make(gpus=[1, 2], cache=["disk", "none"], repeats=2)
    groups = {}
    for p in cfg.runs():
        groups.setdefault(p.group, set()).add((p.gpus, p.repeat))
    assert set(groups) == {"gelan-t_64_b8_disk_fp32", "gelan-t_64_b8_none_fp32"}
    assert all(v == {(1, 0), (1, 1), (2, 0), (2, 1)} for v in groups.values())


def test_unknown_run_is_a_clear_error():
    with pytest.raises(dsconfig.ConfigError, match="not in the grid.*runs are: gelan-t_64_g1"):
        make().run("gelan-t_64_g3_b8_disk_fp32_s0_r0")


def test_run_config_is_narrowed_and_loadable(tmp_path: Path):
    cfg = make(gpus=[1, 2, 4], repeats=2)
    run = "gelan-t_64_g2_b8_disk_fp32_s0_r1"
    path = dsfiles.write_text(dsruns.run_config_text(cfg, run), tmp_path / "r.yaml")
    narrowed = dsconfig.load(path)
    assert [p.run_id for p in narrowed.runs()] == ["gelan-t_64_g2_b8_disk_fp32_s0_r0", run]
    assert narrowed.run("gelan-t_64_g2_b8_disk_fp32_s0_r1") == cfg.run("gelan-t_64_g2_b8_disk_fp32_s0_r1")
    assert narrowed.grid.epochs == cfg.grid.epochs and narrowed.train == cfg.train


def test_run_config_changes_only_with_what_affects_the_run():
    run = "gelan-t_64_g1_b8_disk_fp32_s0_r0"
    before = make()
    digest = dsruns.run_config_digest(before, run)
    # adding GPU counts, repeats or another cache mode adds runs but leaves this one alone
    assert dsruns.run_config_digest(make(gpus=[1, 2, 4]), run) == digest
    assert dsruns.run_config_digest(make(repeats=3), run) == digest
    assert dsruns.run_config_digest(make(cache=["disk", "ram"]), run) == digest
    # what changes the training does change it
    assert dsruns.run_config_digest(make(epochs=3), run) != digest
    raw = copy.deepcopy(BASE)
    raw["train"] = {"lr0": 0.02}
    assert dsruns.run_config_digest(dsconfig.from_dict(raw), run) != digest
    # evaluation and placement settings re-evaluate but do not re-train
    raw = copy.deepcopy(BASE)
    raw["eval"] = {"conf": 0.01}
    raw["placement"] = {"allow_overlap": True}
    changed = dsconfig.from_dict(raw)
    assert dsruns.run_config_digest(changed, run, "train") == digest
    assert dsruns.run_config_digest(changed, run, "evaluate") != dsruns.run_config_digest(before, run, "evaluate")
    # the report's own settings touch neither training nor evaluation
    raw = copy.deepcopy(BASE)
    raw.update(projection={"inter_node": "measured"}, cost={"gpu_hour": {"H100": 2.5}},
               machines={"results": ["elsewhere"]})
    report_only = dsconfig.from_dict(raw)
    for stage in ("train", "evaluate"):
        assert dsruns.run_config_digest(report_only, run, stage) == dsruns.run_config_digest(before, run, stage)
    # moving a run to another GPU count (continue_on) is how it runs this time, not what it computes
    raw = copy.deepcopy(BASE)
    raw["continue_on"] = {run: 2}
    moved = dsconfig.from_dict(raw)
    assert dsruns.run_config_digest(moved, run) == digest and moved.continue_on == {run: 2}
    for wrong, message in (({"nope": 2}, "'nope' is not a run of the grid"), ({run: 1}, "already runs on 1 GPU")):
        raw["continue_on"] = wrong
        with pytest.raises(dsconfig.ConfigError, match=message):
            dsconfig.from_dict(raw)
    # ...unless the run validates while training
    raw = copy.deepcopy(BASE)
    raw["eval"] = {"conf": 0.01}
    raw["train"] = {"val_interval": 1}
    with_val = dsconfig.from_dict(raw)
    raw["eval"] = {"conf": 0.02}
    assert dsruns.run_config_digest(with_val, run) != dsruns.run_config_digest(dsconfig.from_dict(raw), run)


def test_runs_command(tmp_path: Path, capsys):
    config_path = tmp_path / "c.yaml"
    config_path.write_text(yaml.safe_dump(BASE))
    assert cli.main(["runs", "--config", str(config_path)]) == 0
    assert capsys.readouterr().out.split() == ["gelan-t_64_g1_b8_disk_fp32_s0_r0", "gelan-t_64_g2_b8_disk_fp32_s0_r0"]
    out = tmp_path / "run" / "run.yaml"
    assert cli.main(["runs", "--config", str(config_path), "--run", "gelan-t_64_g2_b8_disk_fp32_s0_r0",
                     "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["grid"]["gpus"] == [2]
    assert cli.main(["runs", "--config", str(config_path), "--run", "nope", "--out", str(out)]) == 2
    assert cli.main(["runs", "--config", str(config_path), "--run", "gelan-t_64_g2_b8_disk_fp32_s0_r0"]) == 2


def test_coco_config(tmp_path: Path):
    """The real-hardware config: valid once data_yaml names an existing file; 1-8 GPUs, bf16, reference hyps."""
    raw = yaml.safe_load((ROOT / "config" / "coco-yolov9s.yaml").read_text())
    with pytest.raises(dsconfig.ConfigError, match="data_yaml"):
        dsconfig.from_dict(raw)  # the placeholder path must be edited by the user
    data_yaml = tmp_path / "data.yaml"
    data_yaml.write_text("path: .\ntrain: images/train2017\nval: images/val2017\nnames: {0: person}\n")
    raw["dataset"]["data_yaml"] = str(data_yaml)
    cfg = dsconfig.from_dict(raw)
    points = cfg.runs()
    assert [p.gpus for p in points] == [1, 2, 4, 8]
    assert [p.global_batch for p in points] == [16, 32, 64, 128]
    assert {(p.model, p.imgsz, p.precision) for p in points} == {("yolov9-s", 640, "bf16")}
    assert (cfg.grid.epochs, cfg.train.close_mosaic, cfg.augment.mixup) == (500, 15, 0.15)
    assert (cfg.train.lr0, cfg.train.nominal_batch, cfg.augment.scale) == (0.01, 64, 0.9)
