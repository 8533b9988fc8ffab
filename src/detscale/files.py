"""One way to write a file, one way to read a checkpoint, and the resume stash.

Every artifact (JSON, text, checkpoints) is written by :func:`write_bytes`: the bytes go to a
temporary file in the destination's folder, are flushed and fsynced, renamed over the old file
(``os.replace``, atomic on POSIX) and the folder is fsynced. A crash or a full disk at any moment
leaves the old file or the new one, never half of one; a full disk (or a file-size limit) is a
:class:`WriteError` that names the path, the bytes needed and the space left.

Checkpoints are serialised in memory first (so their size is known and a failed write is a
plain ``OSError``) and read with ``torch.load(weights_only=True)``: a file whose unpickling would
run code is refused, whatever it holds (:func:`load_torch`).

The resume stash (``detscale launch --resume-stash``) lives here too, because both the launcher
and the trainer's rank 0 write it.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from detscale.errors import UserError

log = logging.getLogger(__name__)

#: errno values that mean "no room for this file": disk full, quota, file-size limit (RLIMIT_FSIZE)
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class WriteError(UserError):
    """A file that could not be written (disk full, quota, file-size limit); the old file is intact."""


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def write_bytes(data: bytes, path: str | Path) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.errno in NO_SPACE:
            free = _free_bytes(path.parent)
            room = f"{free / 2**20:.1f} MiB free there" if free is not None else "free space unknown"
            kept = "the previous file is intact" if path.exists() else "nothing was written"
            raise WriteError(f"cannot write {path}: {os.strerror(exc.errno)} ({len(data) / 2**20:.1f} MiB needed, "
                             f"{room}; a file-size limit, `ulimit -f`, also stops it); {kept}. Free space (or raise "
                             "the limit) and run the same command again") from None
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def write_text(text: str, path: str | Path) -> Path:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    return write_bytes(text.encode("utf-8"), path)


def write_json(obj: Any, path: str | Path, indent: int | None = None) -> Path:
    """:func:`write_bytes` of ``obj`` as JSON (a final newline when indented)."""
    return write_text(json.dumps(obj, indent=indent) + ("\n" if indent is not None else ""), path)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


class UnsafeFileError(UserError):
    """A torch file whose unpickling would import or call something other than tensors and plain types."""


def save_torch(obj: Any, path: str | Path) -> Path:
    """``torch.save`` through :func:`write_bytes`: never a partial file, a clear error on a full disk."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return write_bytes(buffer.getbuffer().tobytes(), path)


def _numpy_globals() -> list[Any]:
    """What checkpoints of detscale <= 0.1 need besides plain types: numpy RNG state arrays."""
    import numpy as np

    names = []
    core = getattr(np, "_core", None) or np.core
    names.append(core.multiarray._reconstruct)
    names += [np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        names.append(dtypes.UInt32DType)
    return names


def load_torch(path: str | Path) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU: tensors and plain Python types only.

    The numpy arrays of the RNG states in checkpoints of the previous format are allowed too
    (numpy's array reconstruction, allow-listed as torch recommends). Anything else that the
    pickle would import or call is refused with :class:`UnsafeFileError`; a damaged file raises
    the loader's own exception (callers say what to do).
    """
    import pickle

    import torch

    try:
        if hasattr(torch.serialization, "safe_globals"):  # torch >= 2.5
            with torch.serialization.safe_globals(_numpy_globals()):
                return torch.load(path, map_location="cpu", weights_only=True)
        torch.serialization.add_safe_globals(_numpy_globals())  # torch 2.4
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        # what torch says when the pickle names a global it does not allow (a damaged file says else)
        if "Unsupported global" in text or "GLOBAL " in text:
            what = text.split("GLOBAL", 1)[1].split()[0] if "GLOBAL" in text else "code"
            raise UnsafeFileError(
                f"{path} was refused: loading it would run {what}, which a detscale checkpoint never holds "
                "(only tensors and plain values, read with torch.load(weights_only=True)). Do not load files "
                "of unknown origin; use the weights/last.pt that `detscale train` wrote"
            ) from None
        raise


# ---------------------------------------------------------------------------------------------
# Resume stash
# ---------------------------------------------------------------------------------------------

#: What a resumed run reads from its folder: the checkpoint, and the epoch rows it keeps.
RESUME_FILES = ("weights/last.pt", "metrics.jsonl")
#: Written last into a stash: its presence marks the stash complete, its content names the config.
STASH_DIGEST = "config_digest"
#: The stash folder, for the trainer's rank 0 to refresh after each checkpoint (set by the launcher).
STASH_ENV = "DETSCALE_RESUME_STASH"


def stash_resume_files(out: Path, stash: Path, digest: str) -> bool:
    """Hard-link the resume files of run folder ``out`` into ``stash``; False when there is no checkpoint.

    Links, not copies: instant (a preempted job has seconds left), and the data survives the
    workflow deleting the originals. A file system that refuses links gets a copy. Each file is
    linked under a temporary name and renamed over the old one, and the digest marker is written
    last, so a process killed at any point leaves the previous stash or the new one, never a mix
    that restores nothing. A stash of another digest (or an incomplete one) is replaced whole.
    """
    if not (out / RESUME_FILES[0]).is_file():
        return False
    marker = stash / STASH_DIGEST
    if stash.exists() and not (marker.is_file() and marker.read_text().strip() == digest):
        shutil.rmtree(stash, ignore_errors=True)
    stash.mkdir(parents=True, exist_ok=True)
    for name in RESUME_FILES:
        src, dst = out / name, stash / name.replace("/", "__")
        if not src.is_file():
            dst.unlink(missing_ok=True)
            continue
        if dst.exists() and os.path.samefile(src, dst):
            continue  # linked already (metrics.jsonl grows in place); rename() would leave tmp behind
        tmp = dst.with_name(f".{dst.name}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    if not marker.is_file():
        write_text(digest + "\n", marker)
    log.debug("resume files of %s kept in %s (config digest %s)", out, stash, digest)
    return True


def refresh_resume_stash(out: Path, digest: str) -> None:
    """Under ``detscale launch --resume-stash``: bring the stash up to the checkpoint just written."""
    stash = os.environ.get(STASH_ENV)
    if stash:
        stash_resume_files(out, Path(stash), digest)


def restore_resume_files(out: Path, stash: Path, digest: str) -> bool:
    """Move stashed resume files back into ``out`` where it lacks them; True when a checkpoint came back.

    A stash written for another config digest, or left incomplete, is deleted: resuming from it
    would fail the trainer's checkpoint check. Files ``out`` still has win (they are as new).
    """
    marker = stash / STASH_DIGEST
    if not stash.is_dir():
        return False
    if not marker.is_file() or marker.read_text().strip() != digest:
        log.info("deleting the stale resume stash %s (another config, or incomplete)", stash)
        shutil.rmtree(stash, ignore_errors=True)
        return False
    restored = False
    for name in RESUME_FILES:
        src, dst = stash / name.replace("/", "__"), out / name
        if src.is_file() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
            restored = restored or name == RESUME_FILES[0]
    shutil.rmtree(stash, ignore_errors=True)
    if restored:
        log.info("restored %s from the resume stash %s", out / RESUME_FILES[0], stash)
    return restored
