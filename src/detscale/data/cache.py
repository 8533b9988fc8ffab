"""The image cache: every image of a split decoded and letterboxed once into one uint8 ``.npy``.

Layout (``out_dir``): ``{split}-{imgsz}.npy`` of shape ``[N, imgsz, imgsz, 3]`` (RGB, grey
padding) and ``{split}-{imgsz}.json``, the index::

    {"version": 1, "split": "train", "imgsz": 640, "count": N, "shape": [N, 640, 640, 3],
     "npy": "train-640.npy", "build_id": "...",
     "images": [{"path": "/abs/a.jpg", "orig_shape": [h, w], "ratio": r, "pad": [pad_w, pad_h],
                 "size": bytes, "mtime_ns": t, "sha1": "..."}, ...]}

Both files are written under temporary names and renamed (the ``.npy`` first), so a reader never
sees a half-written cache. :func:`build_cache` rebuilds when the index does not describe the
current sources (another file list, a changed byte); :func:`open_cache` only compares sizes and
modification times (cheap: one ``stat`` per image) and raises :class:`CacheStaleError` when a
source changed since the build.

Modes (``cache:`` in the config):

- ``disk``: the ``.npy`` is memory-mapped read-only; the OS page cache holds one copy that every
  rank and loader worker of the node shares.
- ``ram``: the ``.npy`` is copied once per node into shared memory (``/dev/shm``, or
  ``$DETSCALE_SHM_DIR``) as ``detscale-<digest>.npy`` and every process memory-maps that file, so
  its pages are shared instead of duplicated per rank or worker.

Lifetime of the shared-memory copy: the first process to open it creates it (under an exclusive
file lock, copy to a temporary name, atomic rename); every process that opens it holds a shared
``flock`` on it while it lives. When a process closes its view (garbage collection or interpreter
exit) it deletes the file if no other process still holds it: the last user out removes it. A
process that dies without cleaning up (SIGKILL) may leave the file behind; the next run with the
same cache reuses it, and ``rm /dev/shm/detscale-*`` frees it by hand.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import weakref
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detscale.data.decode import decode_for, letterboxed_meta
from detscale.data.formats import DatasetError, DatasetSpec
from detscale.errors import UserError
from detscale.files import write_json

log = logging.getLogger(__name__)

INDEX_VERSION = 1
SHM_DIR_ENV = "DETSCALE_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"


class CacheError(UserError):
    """A cache that is missing, unreadable, stale, or that cannot be placed in shared memory."""


class CacheStaleError(CacheError):
    """A source image changed after the cache was built."""


def cache_paths(out_dir: str | Path, split: str, imgsz: int) -> tuple[Path, Path]:
    """``(npy, index_json)`` of a split's cache in ``out_dir``."""
    out_dir = Path(out_dir)
    return out_dir / f"{split}-{imgsz}.npy", out_dir / f"{split}-{imgsz}.json"


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(npy_path: str) -> None:
    _WORKER["array"] = np.load(npy_path, mmap_mode="r+")


def _fill_slot(job: tuple[int, str]) -> tuple[int, dict[str, Any]]:
    """Decode image ``job[1]`` into slot ``job[0]`` of the memory map; return its index entry."""
    i, path = job
    st = os.stat(path)  # before reading: a change during the read then shows as stale later
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise DatasetError(f"cannot read image {path}: {exc.strerror}") from None
    from detscale.data.augment import letterbox

    array = _WORKER["array"]
    img, original = decode_for(path, array.shape[1], data)
    _, ratio, pad = letterbox(img, array.shape[1], out=array[i])
    return i, {
        "crc32": zlib.crc32(array[i]),  # checked whenever the image is read (CachedImages.image)
        "path": path,
        **letterboxed_meta(img, original, ratio, pad),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha1": hashlib.sha1(data).hexdigest(),
    }


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _sha1(path: str) -> str:
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_index(index_path: str | Path) -> dict[str, Any]:
    """The index json of a cache; :class:`CacheError` when missing or unreadable."""
    index_path = Path(index_path)
    try:
        index = json.loads(index_path.read_text())
    except FileNotFoundError:
        raise CacheError(
            f"no image cache at {index_path}; build it with `detscale cache` (snakemake does this in the "
            "rule cache_dataset) or set `cache: none`"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CacheError(
            f"cache index {index_path} is unreadable ({exc}); delete it and re-run `detscale cache`"
        ) from None
    if index.get("version") != INDEX_VERSION:
        raise CacheError(
            f"cache index {index_path} has version {index.get('version')}, this detscale writes "
            f"{INDEX_VERSION}; re-run `detscale cache`"
        )
    return index


def _changed_sources(entries: Sequence[dict[str, Any]]) -> list[str]:
    """Paths whose size or modification time differ from the index (or that are gone)."""
    changed = []
    for e in entries:
        try:
            st = os.stat(e["path"])
        except OSError:
            changed.append(e["path"])
            continue
        if st.st_size != e["size"] or st.st_mtime_ns != e["mtime_ns"]:
            changed.append(e["path"])
    return changed


def _index_status(index_path: Path, npy_path: Path, paths: list[str], imgsz: int) -> tuple[str, dict | None]:
    """``("current" | "touched" | "rebuild", index)``: touched = only times changed, bytes equal."""
    if not (index_path.is_file() and npy_path.is_file()):
        return "rebuild", None
    try:
        index = read_index(index_path)
    except CacheError:
        return "rebuild", None
    if index.get("imgsz") != imgsz or [e["path"] for e in index["images"]] != paths:
        return "rebuild", index
    try:
        arr = np.load(npy_path, mmap_mode="r")
    except (OSError, ValueError):
        return "rebuild", index
    if arr.shape != (len(paths), imgsz, imgsz, 3) or arr.dtype != np.uint8 or npy_changed(index, npy_path):
        return "rebuild", index
    changed = set(_changed_sources(index["images"]))
    if not changed:
        return "current", index
    for e in index["images"]:
        if e["path"] in changed and (not Path(e["path"]).is_file() or _sha1(e["path"]) != e["sha1"]):
            return "rebuild", index
    return "touched", index


def npy_changed(index: dict[str, Any], npy_path: Path) -> str | None:
    """Why the ``.npy`` cannot be the file its index was written for (truncated, extended); None if it can.

    The index records the array file's size (indexes of older versions lack it); the pixels of
    every image are checked against its CRC-32 when read (:meth:`CachedImages.image`).
    """
    if "npy_bytes" not in index:
        return None
    size = npy_path.stat().st_size
    if size != index["npy_bytes"]:
        return f"it has {size} bytes, its index says {index['npy_bytes']} (truncated or replaced)"
    return None


def build_cache(
    spec: DatasetSpec,
    split: str,
    imgsz: int,
    out_dir: str | Path,
    workers: int | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build (or reuse when still valid) the cache of ``spec``'s ``split``; returns the index path.

    Decoding uses ``workers`` processes (default: every core), each writing its images straight
    into the memory-mapped ``.npy`` by index. A cache whose sources only got new modification times
    (same bytes) is kept and its index refreshed.
    """
    from tqdm import tqdm

    import detscale.data.augment  # noqa: F401  (OpenCV single-threaded before the pool forks)

    if split not in spec.splits:
        raise DatasetError(f"{spec.yaml_path}: no split '{split}' (have {', '.join(spec.splits)})")
    paths = [str(Path(p).absolute()) for p in spec.splits[split]]
    if not paths:
        raise DatasetError(f"{spec.yaml_path}: the '{split}' split has no images; nothing to cache")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    npy_path, index_path = cache_paths(out_dir, split, imgsz)

    status, old = ("rebuild", None) if force else _index_status(index_path, npy_path, paths, imgsz)
    if status == "current":
        log.info("cache %s is up to date (%d images)", npy_path, len(paths))
        return index_path
    if status == "touched" and old is not None:
        for e in old["images"]:
            st = os.stat(e["path"])
            e["size"], e["mtime_ns"] = st.st_size, st.st_mtime_ns
        write_json(old, index_path, indent=1)
        log.info("cache %s: sources touched but unchanged (same sha1); index refreshed", npy_path)
        return index_path

    nbytes = len(paths) * imgsz * imgsz * 3
    free = shutil.disk_usage(out_dir).free
    if nbytes > free:
        raise CacheError(
            f"the cache of {len(paths)} images at {imgsz} needs {nbytes / 2**30:.1f} GiB but {out_dir} has "
            f"{free / 2**30:.1f} GiB free; free space, use a smaller imgsz, or set `cache: none`"
        )
    tmp = npy_path.with_name(f".{npy_path.name}.tmp-{os.getpid()}")
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(paths), imgsz, imgsz, 3))
    del arr  # workers open it themselves; the header is on disk
    entries: list[dict[str, Any] | None] = [None] * len(paths)
    workers = max(1, min(workers or _cpu_count(), len(paths)))
    start = time.perf_counter()
    jobs = list(enumerate(paths))
    bar = tqdm(total=len(paths), desc=f"cache {split}-{imgsz}", unit="img", disable=not progress)
    try:
        if workers == 1:
            _init_worker(str(tmp))
            results: Iterator[tuple[int, dict[str, Any]]] = map(_fill_slot, jobs)
            for i, entry in results:
                entries[i] = entry
                bar.update()
            _WORKER.clear()
        else:
            import multiprocessing as mp

            # fork: no re-import of __main__ (callers need no main guard); the workers touch only
            # numpy and OpenCV (one thread each), never torch.
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            with mp.get_context(method).Pool(workers, _init_worker, (str(tmp),)) as pool:
                chunk = max(1, min(16, len(jobs) // (4 * workers)))
                for i, entry in pool.imap_unordered(_fill_slot, jobs, chunksize=chunk):
                    entries[i] = entry
                    bar.update()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, npy_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    index = {
        "version": INDEX_VERSION,
        "split": split,
        "imgsz": imgsz,
        "count": len(paths),
        "shape": [len(paths), imgsz, imgsz, 3],
        "npy": npy_path.name,
        "npy_bytes": npy_path.stat().st_size,
        "build_id": uuid.uuid4().hex,
        "data_yaml": str(spec.yaml_path),
        "build_seconds": round(seconds, 3),
        "images": entries,
    }
    write_json(index, index_path, indent=1)
    log.info(
        "cache %s: %d images, %.2f GiB, %.1f s with %d processes (%.0f img/s)",
        npy_path, len(paths), nbytes / 2**30, seconds, workers, len(paths) / max(seconds, 1e-9),
    )
    return index_path


# ---------------------------------------------------------------------------------------------
# Opening
# ---------------------------------------------------------------------------------------------


def check_fresh(index: dict[str, Any], index_path: str | Path) -> None:
    """Raise :class:`CacheStaleError` when a source image's size or mtime differs from the index."""
    changed = _changed_sources(index["images"])
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise CacheStaleError(
            f"cache is stale: {shown} changed since {index_path} was built; re-run `detscale cache` "
            "(or snakemake, whose rule cache_dataset rebuilds it)"
        )


@contextlib.contextmanager
def _locked(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """Exclusive ``flock`` on ``lock_path``, robust to the file being unlinked by its last user."""
    deadline = time.monotonic() + timeout_s
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise CacheError(
                        f"timed out after {timeout_s:.0f} s waiting for {lock_path} (another process is copying "
                        "the cache into shared memory or hung doing so); if no detscale process is running, "
                        f"remove {lock_path} and its .npy and retry"
                    ) from None
                time.sleep(0.05)
        # If the holder before us unlinked the lock file, our lock is on a dead inode: retry.
        try:
            same = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


@dataclass
class _ShmLease:
    """This process's claim on a shared-memory copy: a shared flock held on an open descriptor."""

    path: Path
    lock_path: Path
    fd: int
    pid: int = field(default_factory=os.getpid)


def _release(lease: _ShmLease, timeout_s: float) -> None:
    """Drop the claim; the last holder deletes the shared-memory file."""
    if os.getpid() != lease.pid:
        return  # a forked child (loader worker) shares the parent's claim: never release it twice
    try:
        with _locked(lease.lock_path, timeout_s):
            try:
                fcntl.flock(lease.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds only if nobody else holds it
            except BlockingIOError:
                return
            lease.path.unlink(missing_ok=True)
            lease.lock_path.unlink(missing_ok=True)
            log.debug("removed %s (last user)", lease.path)
    except (CacheError, OSError) as exc:  # at exit: never raise, say what was left behind
        log.warning("could not clean up %s: %s", lease.path, exc)
    finally:
        with contextlib.suppress(OSError):
            os.close(lease.fd)


def shm_dir() -> Path:
    """Where ``cache: ram`` puts its copy: ``$DETSCALE_SHM_DIR`` or ``/dev/shm``."""
    return Path(os.environ.get(SHM_DIR_ENV, DEFAULT_SHM_DIR))


def _sweep_orphans(directory: Path, keep: Path) -> None:
    """Delete copies left behind by runs that died without cleaning up: nobody holds them now.

    Safe against a process attaching at the same moment: attaching takes the copy's lock file
    first, and a copy in use carries its users' shared flocks.
    """
    for path in directory.glob("detscale-*.npy"):
        if path == keep:
            continue
        lock_path = path.with_suffix(".lock")
        try:
            with _locked(lock_path, 0.0):
                fd = os.open(path, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use by a running job
                finally:
                    os.close(fd)
                path.unlink(missing_ok=True)
                lock_path.unlink(missing_ok=True)
                log.info("cache: removed %s, left behind by a run that did not exit cleanly", path)
        except (CacheError, OSError):
            continue  # busy or already gone


def _attach_shm(npy_path: Path, digest: str, timeout_s: float) -> tuple[_ShmLease, bool]:
    """Create (once per node) or join the shared-memory copy of ``npy_path``."""
    directory = shm_dir()
    if not directory.is_dir():
        raise CacheError(
            f"`cache: ram` needs a shared-memory folder but {directory} does not exist; set "
            f"{SHM_DIR_ENV} to a tmpfs folder or use `cache: disk`"
        )
    target = directory / f"detscale-{digest}.npy"
    lock_path = directory / f"detscale-{digest}.lock"
    created = False
    with _locked(lock_path, timeout_s):
        if not target.exists():
            _sweep_orphans(directory, keep=target)
            need, free = npy_path.stat().st_size, shutil.disk_usage(directory).free
            if need > free:
                raise CacheError(
                    f"`cache: ram` needs {need / 2**30:.1f} GiB in {directory} but only {free / 2**30:.1f} GiB "
                    "are free; use `cache: disk` (as fast once the page cache is warm) or free shared memory"
                )
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            try:
                shutil.copyfile(npy_path, tmp)
                os.replace(tmp, target)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                if exc.errno == errno.ENOSPC:
                    raise CacheError(f"{directory} ran out of space copying the cache; use `cache: disk`") from None
                raise
            created = True
            log.info("cache: copied %s into shared memory %s", npy_path, target)
        fd = os.open(target, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
    return _ShmLease(target, lock_path, fd), created


class CachedImages:
    """Read-only view of a built cache: ``array[i]`` is image ``i`` letterboxed, ``entries[i]`` its
    index entry. Pickles by path (a loader worker started with spawn re-maps the file instead of
    receiving a copy of the pixels)."""

    def __init__(self, index_path: str | Path, mode: str, timeout_s: float = 1800.0):
        if mode not in ("disk", "ram"):
            raise CacheError(f"cache mode must be 'disk' or 'ram' to open a cache, got {mode!r}")
        self.index_path = Path(index_path)
        self.mode = mode
        index = read_index(self.index_path)
        check_fresh(index, self.index_path)
        self.index = index
        self.entries: list[dict[str, Any]] = index["images"]
        npy = self.index_path.parent / index["npy"]
        if not npy.is_file():
            raise CacheError(f"cache index {self.index_path} has no {npy}; re-run `detscale cache`")
        damaged = npy_changed(index, npy)
        if damaged:
            raise CacheError(f"cache {npy} cannot be trusted: {damaged}. Rebuild it: `detscale cache --force` with the "
                             "same arguments, or delete it and rerun snakemake (rule cache_dataset rebuilds it)")
        self.created_shm = False
        self._lease: _ShmLease | None = None
        if mode == "ram":
            digest = hashlib.sha1(f"{npy.resolve()}:{index['build_id']}".encode()).hexdigest()[:16]
            self._lease, self.created_shm = _attach_shm(npy, digest, timeout_s)
            weakref.finalize(self, _release, self._lease, timeout_s)
            npy = self._lease.path
        self.mapped_path = npy
        self._array: np.ndarray | None = None
        if tuple(self.array.shape) != tuple(index["shape"]):
            raise CacheError(
                f"{npy} has shape {self.array.shape} but its index says {index['shape']}; re-run `detscale cache`"
            )

    @property
    def array(self) -> np.ndarray:
        """The ``[N, imgsz, imgsz, 3]`` uint8 memory map (opened on first use in each process)."""
        if self._array is None:
            self._array = np.load(self.mapped_path, mmap_mode="r")
        return self._array

    def image(self, i: int) -> np.ndarray:
        """Image ``i`` (letterboxed, RGB), checked against the CRC-32 the cache recorded when it was built.

        A cache overwritten or damaged after it was built is refused here, before a batch holds
        its pixels (0.24 ms per 640 px image on this project's CPU; caches built before checksums are not
        checked).
        """
        image = self.array[i]
        crc = self.entries[i].get("crc32")
        if crc is not None and zlib.crc32(image) != crc:
            raise CacheError(
                f"cache {self.index_path.parent / self.index['npy']} cannot be trusted: image {i} "
                f"({self.entries[i]['path']}) does not match the checksum recorded when the cache was built "
                "(overwritten or damaged since). Rebuild it: `detscale cache --force` with the same arguments, or "
                "delete it and rerun snakemake (rule cache_dataset rebuilds it)"
            )
        return image

    @property
    def imgsz(self) -> int:
        return int(self.index["imgsz"])

    def __len__(self) -> int:
        return len(self.entries)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_array"] = None  # never pickle the pixels
        state["_lease"] = None  # the claim stays with the process that made it
        return state


def open_cache(index_path: str | Path, mode: str, timeout_s: float = 1800.0) -> CachedImages:
    """Open a built cache in mode ``disk`` or ``ram`` after the cheap freshness check."""
    return CachedImages(index_path, mode, timeout_s)
