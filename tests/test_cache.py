"""The image cache: same pixels as decoding directly, invalidation, one shared-memory copy per node."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

from detscale.cli import main as cli_main
from detscale.data.augment import letterbox
from detscale.data.cache import CacheError, CacheStaleError, build_cache, cache_paths, open_cache
from detscale.data.dataset import DetectionDataset
from detscale.data.decode import decode_image
from detscale.data.formats import load_spec
from detscale.data.loader import build_val_loader

IMGSZ = 64


def write_dataset(root: Path, n_train: int = 6, n_val: int = 3, seed: int = 0) -> Path:
    """Tiny JPEGs of varied aspect with one known rectangle each, YOLO labels and a data.yaml."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(n):
            h, w = int(rng.integers(30, 90)), int(rng.integers(30, 90))
            img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            x, y, bw, bh = w // 4, h // 4, w // 2, h // 3
            img[y:y + bh, x:x + bw] = (0, 0, 255)
            cv2.imwrite(str(root / "images" / split / f"{i:03d}.jpg"), img)
            (root / "labels" / split / f"{i:03d}.txt").write_text(
                f"{i % 2} {(x + bw / 2) / w:.6f} {(y + bh / 2) / h:.6f} {bw / w:.6f} {bh / h:.6f}\n"
            )
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(root), "train": "images/train", "val": "images/val",
                                    "names": ["a", "b"]}))
    return data


@pytest.fixture
def data_yaml(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "ds")


def test_cache_holds_exactly_the_letterboxed_images(data_yaml: Path, tmp_path: Path) -> None:
    spec = load_spec(data_yaml)
    index_path = build_cache(spec, "train", IMGSZ, tmp_path / "cache", workers=1, progress=False)
    cache = open_cache(index_path, "disk")
    assert cache.array.shape == (6, IMGSZ, IMGSZ, 3)
    for i, path in enumerate(spec.splits["train"]):
        img = decode_image(path)
        expected, ratio, pad = letterbox(img, IMGSZ)
        np.testing.assert_array_equal(cache.array[i], expected)
        entry = cache.entries[i]
        assert entry["path"] == str(path)
        assert entry["orig_shape"] == [img.shape[0], img.shape[1]]
        assert entry["ratio"] == pytest.approx(ratio)
        assert tuple(entry["pad"]) == pad
    # RGB, not BGR: the rectangle drawn as BGR (0, 0, 255) is red.
    e = cache.entries[0]
    h, w = e["orig_shape"]
    cy, cx = int(h / 4 + h / 6) * e["ratio"] + e["pad"][1], int(w / 2) * e["ratio"] + e["pad"][0]
    assert cache.array[0, int(cy), int(cx)].tolist() == pytest.approx([255, 0, 0], abs=40)

    # The process pool writes the same bytes as the in-process path.
    other = build_cache(spec, "train", IMGSZ, tmp_path / "cache2", workers=2, progress=False)
    np.testing.assert_array_equal(np.load(cache_paths(tmp_path / "cache2", "train", IMGSZ)[0]), cache.array)
    assert [e["sha1"] for e in json.loads(other.read_text())["images"]] == [e["sha1"] for e in cache.entries]


def test_dataset_items_are_identical_in_every_cache_mode(data_yaml: Path, tmp_path: Path) -> None:
    spec = load_spec(data_yaml)
    index_path = build_cache(spec, "val", IMGSZ, tmp_path / "cache", workers=1, progress=False)
    sets = [DetectionDataset(spec.splits["val"], IMGSZ, mode, index_path) for mode in ("none", "disk", "ram")]
    for i in range(3):
        items = [ds[i] for ds in sets]
        for img, labels, meta in items[1:]:
            torch.testing.assert_close(img, items[0][0])
            torch.testing.assert_close(labels, items[0][1])
            assert meta == items[0][2]
        img, labels, meta = items[0]
        assert img.dtype == torch.uint8 and img.shape == (3, IMGSZ, IMGSZ)
        assert meta["image_id"] == i and meta["path"] == str(spec.splits["val"][i])
        # The label box lies on the red rectangle of the letterboxed image.
        cls, cx, cy, bw, bh = labels[0].tolist()
        assert cls == i % 2
        centre = img[:, int(cy * IMGSZ), int(cx * IMGSZ)].tolist()
        assert centre == pytest.approx([255, 0, 0], abs=40)


def test_changed_source_makes_cache_stale_and_rebuild_fixes_it(data_yaml: Path, tmp_path: Path) -> None:
    spec = load_spec(data_yaml)
    out = tmp_path / "cache"
    index_path = build_cache(spec, "train", IMGSZ, out, workers=1, progress=False)
    build_id = json.loads(index_path.read_text())["build_id"]

    # Unchanged: reused as is.
    assert build_cache(spec, "train", IMGSZ, out, workers=1, progress=False) == index_path
    assert json.loads(index_path.read_text())["build_id"] == build_id

    # Only touched (same bytes, new mtime): still valid, the index is refreshed, nothing re-decoded.
    victim = spec.splits["train"][2]
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(CacheStaleError):
        open_cache(index_path, "disk")
    build_cache(spec, "train", IMGSZ, out, workers=1, progress=False)
    assert json.loads(index_path.read_text())["build_id"] == build_id
    open_cache(index_path, "disk")

    # New content: stale until rebuilt, and the rebuilt cache holds the new pixels.
    cv2.imwrite(str(victim), np.full((50, 40, 3), 7, np.uint8))
    with pytest.raises(CacheStaleError, match=r"cache is stale: .*002\.jpg changed.*detscale cache"):
        open_cache(index_path, "disk")
    with pytest.raises(CacheStaleError):
        DetectionDataset(spec.splits["train"], IMGSZ, "disk", index_path)
    build_cache(spec, "train", IMGSZ, out, workers=1, progress=False)
    assert json.loads(index_path.read_text())["build_id"] != build_id
    cache = open_cache(index_path, "disk")
    np.testing.assert_array_equal(cache.array[2], letterbox(decode_image(victim), IMGSZ)[0])


def test_other_file_list_rebuilds_and_mismatch_is_refused(data_yaml: Path, tmp_path: Path) -> None:
    spec = load_spec(data_yaml)
    out = tmp_path / "cache"
    index_path = build_cache(spec, "train", IMGSZ, out, workers=1, progress=False)
    fewer = spec.splits["train"][:4]
    with pytest.raises(CacheError, match="re-run `detscale cache`"):
        DetectionDataset(fewer, IMGSZ, "disk", index_path)
    with pytest.raises(CacheError, match="no image cache"):
        DetectionDataset(fewer, IMGSZ, "disk", out / "val-64.json")
    spec4 = type(spec)(spec.yaml_path, spec.root, spec.names, {"train": fewer})
    build_cache(spec4, "train", IMGSZ, out, workers=1, progress=False)
    assert json.loads(index_path.read_text())["count"] == 4
    assert len(DetectionDataset(fewer, IMGSZ, "disk", index_path)) == 4


_RAM_CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from detscale.data.cache import open_cache
    index, me, other = sys.argv[1], sys.argv[2], sys.argv[3]
    cache = open_cache(index, "ram")
    total = int(cache.array.sum(dtype="int64"))  # touch every page
    print(json.dumps({"created": cache.created_shm, "path": str(cache.mapped_path),
                      "inode": os.stat(cache.mapped_path).st_ino, "sum": total}), flush=True)
    open(me, "w").close()
    deadline = time.time() + 60
    while not os.path.exists(other) and time.time() < deadline:
        time.sleep(0.02)
    """
)


def test_ram_mode_shares_one_copy_between_processes(data_yaml: Path, tmp_path: Path) -> None:
    spec = load_spec(data_yaml)
    index_path = build_cache(spec, "train", IMGSZ, tmp_path / "cache", workers=1, progress=False)
    flags = [tmp_path / "ready0", tmp_path / "ready1"]
    procs = [
        subprocess.Popen([sys.executable, "-c", _RAM_CHILD, str(index_path), str(flags[k]), str(flags[1 - k])],
                         stdout=subprocess.PIPE, text=True)
        for k in (0, 1)
    ]
    reports = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted(r["created"] for r in reports) == [False, True]  # copied once
    assert reports[0]["path"] == reports[1]["path"] and reports[0]["inode"] == reports[1]["inode"]
    assert reports[0]["sum"] == reports[1]["sum"] == int(np.load(tmp_path / "cache" / "train-64.npy").sum())
    assert Path(reports[0]["path"]).parent == Path(os.environ.get("DETSCALE_SHM_DIR", "/dev/shm"))
    assert not Path(reports[0]["path"]).exists()  # the last user removed it


def test_ram_copy_survives_forked_workers_and_goes_with_its_owner(data_yaml: Path, tmp_path: Path) -> None:
    spec = load_spec(data_yaml)
    index_path = build_cache(spec, "val", IMGSZ, tmp_path / "cache", workers=1, progress=False)
    ds = DetectionDataset(spec.splits["val"], IMGSZ, "ram", index_path)
    shm = ds.cache.mapped_path
    assert ds.cache.created_shm and shm.exists()
    loader = build_val_loader(ds, 2, rank=0, world_size=1, workers=2)
    assert sum(len(m) for _, _, m in loader) == 3
    del loader
    gc.collect()
    assert shm.exists()  # exiting workers did not remove the owner's copy
    second = DetectionDataset(spec.splits["val"], IMGSZ, "ram", index_path)
    assert not second.cache.created_shm and second.cache.mapped_path == shm
    del ds
    gc.collect()
    assert shm.exists()  # still used by `second`
    del second
    gc.collect()
    assert not shm.exists()


def test_cache_command(data_yaml: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results" / "cache" / "tiny"
    args = ["cache", "--data", str(data_yaml), "--split", "val", "--imgsz", str(IMGSZ), "--out", str(out),
            "--workers", "1"]
    assert cli_main(args) == 0
    assert (out / "val-64.npy").is_file() and (out / "val-64.json").is_file()
    assert "3 images" in capsys.readouterr().out
    assert cli_main(args) == 0
    assert "up to date" in capsys.readouterr().out
    assert cli_main(args[:-4] + ["--out", str(out)] + ["--imgsz", "50"]) == 2  # not a multiple of 32
    assert cli_main(["cache", "--data", str(tmp_path / "missing.yaml"), "--split", "val", "--imgsz", "64",
                     "--out", str(out)]) == 2


def test_ram_mode_removes_orphaned_copies_but_not_busy_ones(
    data_yaml: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("DETSCALE_SHM_DIR", str(shm))
    orphan, busy = shm / "detscale-0000000000000000.npy", shm / "detscale-1111111111111111.npy"
    orphan.write_bytes(b"left by a killed run")
    busy.write_bytes(b"used by a running job")
    fd = os.open(busy, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        spec = load_spec(data_yaml)
        index_path = build_cache(spec, "val", IMGSZ, tmp_path / "cache", workers=1, progress=False)
        cache = open_cache(index_path, "ram")
        assert cache.created_shm and cache.mapped_path.parent == shm
        assert not orphan.exists() and busy.exists()
    finally:
        os.close(fd)
