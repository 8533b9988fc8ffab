"""The config loader: defaults, freezing, and one test per kind of mistake (asserting the message)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml

from detscale import config

REPO = Path(__file__).resolve().parents[1]


def base(**grid) -> dict:
    return {"dataset": {"name": "shapes", "synthetic": {}}, "grid": dict(grid)}


def error_of(raw: dict, base_dir: Path = REPO) -> str:
    with pytest.raises(config.ConfigError) as info:
        config.from_dict(raw, source="test.yaml", base=base_dir)
    return str(info.value)


def test_default_config_loads_and_is_frozen():
    cfg = config.load(REPO / "config" / "config.yaml")
    assert cfg.dataset.synthetic is not None
    assert [p.gpus for p in cfg.runs()] == sorted(cfg.grid.gpus)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.grid.epochs = 3  # type: ignore[misc]


def test_defaults_are_filled_from_the_schema():
    cfg = config.from_dict(base())
    assert cfg.train.lr0 == 0.01 and cfg.train.nominal_batch == 64
    assert cfg.augment.mosaic == 1.0 and cfg.augment.mixup == 0.0
    assert cfg.eval.iou == 0.7 and cfg.eval.max_det == 300
    assert cfg.dataset.synthetic.imgsz == 640 and cfg.dataset.on_error == "fail"


def test_unknown_key_is_named_with_the_allowed_keys():
    msg = error_of({**base(), "trian": {"epochs": 3}})
    assert "unknown key 'trian'" in msg and "allowed keys:" in msg and "train" in msg


def test_unknown_nested_key():
    msg = error_of(base(gpu=[1]))
    assert "unknown key 'gpu' in 'grid'" in msg and "gpus" in msg


def test_wrong_type_names_key_value_and_type():
    msg = error_of(base(epochs="ten"))
    assert "'grid.epochs': got 'ten'; must be of type integer" in msg


def test_zero_gpus():
    msg = error_of(base(gpus=[0]))
    assert "'grid.gpus[0]': got 0; must be >= 1" in msg


def test_negative_epochs():
    msg = error_of(base(epochs=-1))
    assert "'grid.epochs': got -1; must be >= 1" in msg


def test_image_size_not_a_multiple_of_32():
    msg = error_of(base(imgsz=[100]))
    assert "'grid.imgsz[0]': got 100; must be a multiple of 32" in msg


def test_value_outside_an_enum():
    msg = error_of(base(cache=["ssd"]))
    assert "'grid.cache[0]': got 'ssd'; must be one of none, disk, ram" in msg


def test_missing_dataset_path(tmp_path):
    raw = {"dataset": {"name": "coco", "data_yaml": "no/such/data.yaml"}, "grid": {}}
    msg = error_of(raw, base_dir=tmp_path)
    assert "'dataset.data_yaml': got 'no/such/data.yaml'; no such file" in msg


def test_existing_dataset_path(tmp_path):
    (tmp_path / "data.yaml").write_text("names: [a]\n")
    cfg = config.from_dict({"dataset": {"name": "d", "data_yaml": "data.yaml"}, "grid": {}}, base=tmp_path)
    assert cfg.dataset.data_yaml == "data.yaml"


def test_both_or_neither_dataset_source():
    both = {"dataset": {"name": "d", "data_yaml": "x.yaml", "synthetic": {}}, "grid": {}}
    assert "exactly one of 'data_yaml'" in error_of(both)
    assert "exactly one of 'data_yaml'" in error_of({"dataset": {"name": "d"}, "grid": {}})


def test_strong_scaling_batch_must_divide():
    msg = error_of(base(batch=[10], gpus=[1, 3], scaling="strong"))
    assert "global batch 10 with 3 GPUs" in msg and "divide evenly" in msg


def test_gpus_must_divide_by_nodes():
    msg = error_of(base(gpus=[3], nodes=2))
    assert "'grid.gpus': got 3 with nodes 2" in msg


def test_all_mistakes_reported_at_once():
    msg = error_of(base(gpus=[0], imgsz=[100]))
    assert "gpus[0]" in msg and "imgsz[0]" in msg


def test_not_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(config.ConfigError, match="must be a mapping"):
        config.load(path)


def test_run_lookup_and_ids():
    cfg = config.from_dict(base(gpus=[1, 2], batch=[8], repeats=2, cache=["ram"]))
    ids = [p.run_id for p in cfg.runs()]
    assert "gelan-t_640_g2_b8_ram_fp32_s0_r1" in ids and len(ids) == 4
    point = cfg.run("gelan-t_640_g2_b8_ram_fp32_s0_r1")
    assert (point.batch_per_rank, point.global_batch, point.group) == (8, 16, "gelan-t_640_b8_ram_fp32")
    with pytest.raises(config.ConfigError, match="not in the grid"):
        cfg.run("nope")


def test_strong_scaling_divides_the_global_batch():
    cfg = config.from_dict(base(gpus=[1, 4], batch=[32], scaling="strong"))
    four = [p for p in cfg.runs() if p.gpus == 4][0]
    assert (four.batch_per_rank, four.global_batch, four.run_id) == (8, 32, "gelan-t_640_g4_b32s_disk_fp32_s0_r0")


def test_save_round_trips(tmp_path):
    cfg = config.load(REPO / "config" / "config.yaml")
    config.save(cfg, tmp_path / "c.yaml")
    again = config.from_dict(yaml.safe_load((tmp_path / "c.yaml").read_text()), source="again")
    assert dataclasses.replace(again, source=cfg.source) == cfg
    assert again.digest() == cfg.digest()


def test_cli_reports_config_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(base(gpus=[0])))
    proc = subprocess.run(["detscale", "runs", "--config", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "'grid.gpus[0]': got 0; must be >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
