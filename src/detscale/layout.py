"""The ``results/`` layout, named once: the workflow's rules (``common.smk``), the trainer's and the
commands' defaults all build their paths here, so a folder is renamed in one place.

    results/data/DATASET/      the validated dataset: data.yaml (clean view), validation.json
    results/cache/DATASET/     the decoded-image cache of every split and image size
    results/runs/RUN_ID/       one training run: config.yaml, env.json, timing.json, eval.json, ...
    results/comm/              the all-reduce benchmarks, MODEL_IMGSZ_gN.json
    results/report/            the scaling report
    results/config.yaml        the whole experiment config the report shows
    results/logs/, results/benchmarks/   one log and one Snakemake benchmark table per job
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path("results")


def data_dir(dataset: str, root: Path = RESULTS) -> Path:
    return root / "data" / dataset


def clean_data_yaml(dataset: str, root: Path = RESULTS) -> Path:
    """The data.yaml every stage after validation reads (the clean view)."""
    return data_dir(dataset, root) / "data.yaml"


def cache_dir(dataset: str, root: Path = RESULTS) -> Path:
    return root / "cache" / dataset


def runs_dir(root: Path = RESULTS) -> Path:
    return root / "runs"


def report_dir(root: Path = RESULTS) -> Path:
    return root / "report"


def comm_dir(root: Path = RESULTS) -> Path:
    return root / "comm"


def comm_file(model: str, imgsz: int, gpus: int, root: Path = RESULTS) -> Path:
    return comm_dir(root) / f"{model}_{imgsz}_g{gpus}.json"


def experiment_config(root: Path = RESULTS) -> Path:
    """The whole experiment config, as the workflow ran it."""
    return root / "config.yaml"


def logs_dir(root: Path = RESULTS) -> Path:
    return root / "logs"


def benchmarks_dir(root: Path = RESULTS) -> Path:
    return root / "benchmarks"
