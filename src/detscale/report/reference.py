"""Published multi-GPU figures of YOLO-family trainers (``data/reference.yaml``), shipped as data,
so a report can show the user's own scaling beside what others measured on known cards.

An entry is one published table: a trainer, model, card and batch per GPU, and the time of one
epoch per GPU count. img/s is the epoch's images over its seconds; speed-up and efficiency are
against the entry's own 1-GPU time. An entry is *drawn* beside a report's points when a run's GPU
model contains the entry's ``device_match`` (the same card family); it is always *listed*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml


@dataclass(frozen=True)
class ReferencePoint:
    trainer: str
    model: str
    imgsz: int
    device: str
    device_match: str
    batch_per_gpu: int
    gpus: int
    epoch_seconds: float
    images_per_s: float
    speedup: float
    efficiency: float
    source: str


def _seconds(text: str) -> float:
    """'20:39' or '1:02:03' -> seconds."""
    total = 0.0
    for part in str(text).split(":"):
        total = total * 60 + float(part)
    return total


def load(entries: Sequence[Mapping[str, Any]] | None = None) -> list[ReferencePoint]:
    """Every published point (``entries`` defaults to the shipped ``data/reference.yaml``)."""
    if entries is None:
        text = resources.files("detscale.report").joinpath("data/reference.yaml").read_text()
        entries = yaml.safe_load(text) or []
    points = []
    for e in entries:
        times = {int(g): _seconds(t) for g, t in e["epoch_time"].items()}
        base_gpus = min(times)
        base_rate = e["images_per_epoch"] / times[base_gpus]
        for gpus, seconds in sorted(times.items()):
            rate = e["images_per_epoch"] / seconds
            speedup = rate / base_rate
            points.append(ReferencePoint(e["trainer"], e["model"], int(e["imgsz"]), e["device"], e["device_match"],
                                         int(e["batch_per_gpu"]), gpus, seconds, rate, speedup,
                                         speedup / (gpus / base_gpus), e["source"]))
    return points


def matching(points: Sequence[ReferencePoint], gpu_models: Sequence[str]) -> list[ReferencePoint]:
    """The points whose card family one of ``gpu_models`` (env.json's ``gpu_model``) belongs to."""
    return [p for p in points if any(p.device_match in (m or "") for m in gpu_models)]


HEADING = "Published reference figures"
HEADER = ["trainer", "model", "card", "batch/GPU", "GPUs", "epoch", "img/s", "speed-up", "efficiency", "source"]


def intro(drawn: Sequence[ReferencePoint]) -> str:
    return ("Other trainers' published multi-GPU figures, as their sources give them (epoch time; img/s = images "
            "per epoch / seconds; speed-up against their own 1-GPU time). Not the same model, data or software as "
            "the runs above: read them for the shape of the curve on a card, not as a target."
            + (" Drawn on the efficiency plot: the entries on this report's card family." if drawn else
               " None is on this report's card family, so none is drawn."))


def rows(points: Sequence[ReferencePoint]) -> list[list[str]]:
    """The table's cells, one row per point (:data:`HEADER`), for the Markdown and the HTML report."""
    out = []
    for p in points:
        minutes, seconds = divmod(int(round(p.epoch_seconds)), 60)
        out.append([p.trainer, f"{p.model} {p.imgsz} px", p.device, str(p.batch_per_gpu), str(p.gpus),
                    f"{minutes}:{seconds:02d}", f"{p.images_per_s:.0f}", f"{p.speedup:.2f}", f"{p.efficiency:.0%}",
                    p.source])
    return out


def markdown(points: Sequence[ReferencePoint], drawn: Sequence[ReferencePoint]) -> list[str]:
    return (["", f"## {HEADING}", "", intro(drawn), "", "| " + " | ".join(HEADER) + " |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
            + ["| " + " | ".join(r) + " |" for r in rows(points)])
