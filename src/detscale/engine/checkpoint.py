"""Reading checkpoints, and the RNG states that make resume exact.

Checkpoints are written by :func:`detscale.files.save_torch` (atomic: the old file or the new
one, never half of one) and read by :func:`detscale.files.load_torch` (``weights_only=True``: a
file that would run code when unpickled is refused). They hold tensors and plain Python values
only; the RNG states are stored as such (the previous format's numpy arrays still load).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detscale.errors import UserError
from detscale.files import UnsafeFileError, load_torch


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not belong to this run."""


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint onto the CPU; a clear error when the file is missing or damaged."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; train the run first (or leave out --resume)")
    try:
        ckpt = load_torch(path)
    except UnsafeFileError:
        raise
    except Exception as exc:  # torch raises several types for a damaged zip
        raise CheckpointError(
            f"checkpoint {path} is damaged and cannot be read ({type(exc).__name__}: {exc}). A run cannot resume "
            f"from it: delete {path} (and the run folder's resume-stash/, which holds the same file, if there is "
            "one) and run the same command to train the run from the start; nothing else was deleted"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise CheckpointError(f"{path} is not a detscale checkpoint (no 'model' key)")
    return ckpt


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: Python, NumPy, torch CPU and (when present) CUDA."""
    return {
        "python": random.getstate(),
        # plain values (weights_only=True reads no numpy arrays): (name, keys as a tensor, pos, gauss)
        "numpy": _numpy_state_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _numpy_state_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
