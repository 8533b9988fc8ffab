"""Checkpoints written atomically by rank 0, and the RNG states that make resume exact.

A checkpoint is written to a temporary file in the same folder, flushed and fsynced, renamed
over the old one with ``os.replace`` (atomic on POSIX) and the folder fsynced, so a crash at any
moment leaves either the old or the new file, never half of one.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detscale.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not belong to this run."""


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` that never leaves a partial file at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU; a clear error when the file is missing or damaged."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; train the run first (or leave out --resume)")
    try:
        # Our own files: they hold RNG states and optimiser state, not only tensors.
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for a damaged zip
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); delete it to start the run again") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a detscale checkpoint (no 'model' key)")
    return ckpt


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: Python, NumPy, torch CPU and (when present) CUDA."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
