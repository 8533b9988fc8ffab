"""Test helpers shared by the training, resume, multi-node, preemption and Slurm tests."""

from __future__ import annotations

from pathlib import Path

from detscale.data.synth import SynthParams, generate


def tiny_dataset(
    root: Path,
    train: int,
    val: int,
    objects: tuple[int, int] = (1, 3),
    object_size: tuple[float, float] = (0.2, 0.5),
    imgsz: int = 64,
) -> Path:
    """A small synthetic dataset (``detscale synth`` in-process, seed 0) at ``root``; its data.yaml."""
    generate(root, seed=0, train=train, val=val, workers=1,
             params=SynthParams(imgsz=imgsz, objects=objects, object_size=object_size))
    return Path(root) / "data.yaml"
