"""`detscale compare`: two results folders lined up run by run, each difference judged against its spread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from detscale import cli
from detscale import config as dsconfig
from detscale.report.compare import CompareError, compare, markdown, parse_spread, summary
from test_report import write_config, write_run

G1 = "gelan-t_64_g1_b8_disk_fp32_s0_r0"
G2 = "gelan-t_64_g2_b8_disk_fp32_s0_r0"


def results(tmp_path: Path, name: str, values: dict[str, tuple[float, float]]) -> Path:
    """A results folder (``NAME/runs/RUN_ID``) of the [1, 2]-GPU grid with the given (img/s, mAP) per run."""
    root = tmp_path / name
    root.mkdir()
    cfg = dsconfig.load(write_config(root, [1, 2]))
    for run_id, (ips, m) in values.items():
        write_run(root / "runs", cfg, run_id, ips, m)
    return root


def quantity(result, run_id: str, column: str) -> dict:
    pair = next(p for p in result.pairs if p.run_id == run_id)
    return next(q for q in pair.quantities if q["column"] == column)


def test_a_reproduction_within_the_spreads_is_called_reproduced(tmp_path: Path, capsys):
    a = results(tmp_path, "a", {G1: (100.0, 0.50), G2: (180.0, 0.49)})
    b = results(tmp_path, "b", {G1: (104.0, 0.51), G2: (190.0, 0.50)})
    result = compare(a, b)
    assert [p.run_id for p in result.pairs] == [G1, G2]
    assert not any(p.exceeded or p.config_changes or p.env_changes for p in result.pairs)
    q = quantity(result, G1, "images_per_s")
    assert q["difference"] == pytest.approx(0.04) and q["verdict"] == "within"
    # speed-up 1.80 -> 1.827: +1.5 %, inside the 5 % spread
    assert quantity(result, G2, "speedup")["difference"] == pytest.approx((190 / 104) / 1.8 - 1)
    assert quantity(result, G2, "forward_ms")["verdict"] == "not measured"
    assert cli.main(["compare", str(a), str(b), "--strict"]) == 0
    assert "reproduced" in capsys.readouterr().out


def test_differences_beyond_their_spread_are_named(tmp_path: Path, capsys):
    a = results(tmp_path, "a", {G1: (100.0, 0.50), G2: (180.0, 0.49)})
    b = results(tmp_path, "b", {G1: (100.0, 0.40), G2: (140.0, 0.60)})
    result = compare(a, b)
    assert {q["column"] for q in result.pairs[0].exceeded} == {"map50_95"}  # -0.10 of mAP, spread 0.02
    assert {q["column"] for q in result.pairs[1].exceeded} == {
        "images_per_s", "speedup", "efficiency", "map50_95", "delta_map50_95_vs_1gpu"}
    assert quantity(result, G2, "delta_map50_95_vs_1gpu")["difference"] == pytest.approx(0.21)
    out = tmp_path / "cmp.md"
    assert cli.main(["compare", str(a), str(b), "--out", str(out), "--strict"]) == 1
    text = capsys.readouterr().out
    assert "beyond the stated spread" in text and f"{G1}: mAP@0.5:0.95 0.5 -> 0.4 (-0.100, spread ±0.020)" in text
    assert "**exceeds**" in out.read_text()
    # A wider stated spread turns the same difference into a reproduction.
    wide = compare(a, b, {"map50_95": 0.2})
    assert not wide.pairs[0].exceeded
    assert cli.main(["compare", str(a), str(b)]) == 0  # without --strict the comparison is information


def test_environment_and_config_differences_are_listed(tmp_path: Path):
    a = results(tmp_path, "a", {G1: (100.0, 0.50)})
    b = results(tmp_path, "b", {G1: (100.0, 0.50), G2: (150.0, 0.5)})
    env_path = b / "runs" / G1 / "env.json"
    env = json.loads(env_path.read_text())
    env.update(cpu_capability="AVX2", host="other")
    env_path.write_text(json.dumps(env))
    cfg_path = b / "runs" / G1 / "config.yaml"
    raw = yaml.safe_load(cfg_path.read_text())
    raw["train"]["lr0"] = 0.5
    cfg_path.write_text(yaml.safe_dump(raw))
    result = compare(a, b)
    pair = result.pairs[0]
    assert ("cpu_capability", None, "AVX2") in pair.env_changes and ("host", "testhost", "other") in pair.env_changes
    assert [k for k, _, _ in pair.config_changes] == ["train.lr0"]
    assert result.only_b == [G2] and result.only_a == []
    text = markdown(result)
    assert "`train.lr0`" in text and "`cpu_capability`: None → AVX2" in text and "Only in B" in text


def test_incomplete_runs_and_bad_arguments(tmp_path: Path):
    a = results(tmp_path, "a", {G1: (100.0, 0.50), G2: (180.0, 0.49)})
    b = results(tmp_path, "b", {G1: (100.0, 0.50), G2: (180.0, 0.49)})
    (b / "runs" / G2 / "eval.json").unlink()
    result = compare(a, b)
    assert [p.run_id for p in result.pairs] == [G1] and result.only_a == [G2]
    assert any("eval.json" in m for m in result.incomplete)
    assert cli.main(["compare", str(a), str(tmp_path / "missing")]) == 2
    other = results(tmp_path, "other", {})
    (other / "runs" / "x").mkdir(parents=True)
    (other / "runs" / "x" / "timing.json").write_text("{}")  # a run that never finished its artifacts
    nothing = compare(a, other)
    assert not nothing.pairs and "nothing was compared" in summary(nothing) and "reproduced" not in summary(nothing)
    with pytest.raises(CompareError, match="one of"):
        parse_spread("mAP=0.1")
    with pytest.raises(CompareError, match="not a number"):
        parse_spread("map50_95=abc")
    assert parse_spread("map50_95=0.05") == ("map50_95", 0.05)
