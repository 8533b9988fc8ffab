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
