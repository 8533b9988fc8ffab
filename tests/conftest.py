"""Shared test set-up: the venv's bin on PATH so subprocesses find `detscale` and `snakemake`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True, scope="session")
def _venv_on_path():
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    yield


@pytest.fixture
def repo() -> Path:
    return REPO


def pytest_collection_modifyitems(config, items):
    """Run the tests that bring up Slurm last.

    They install Slurm's client commands (``tests/slurm/cluster.sh``) and stop the cluster when
    they finish. With ``sinfo`` on PATH and no controller answering, every later ``snakemake``
    call waits 10 s at start-up: the Slurm executor plugin runs ``scontrol show config`` (10 s
    timeout) to word its ``--help``. Last, they cost the other workflow tests nothing.
    """
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("slurm") is not None)
