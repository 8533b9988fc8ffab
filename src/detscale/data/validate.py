"""Dataset validation: say precisely what is wrong before training, and write the clean view.

A COCO or VOC dataset is first converted to the YOLO view (:mod:`detscale.data.sources`). Every
image is read and decoded (a very large JPEG at a reduced size), every label line parsed, in a pool
of worker processes (:mod:`detscale.data.checks`). Findings have a kind (see
:data:`detscale.data.checks.KINDS`), a severity and the file and line they concern. The outputs, in
``DIR``:

- ``validation.json``: counts per kind and every finding (split, file, line, kind, severity, message);
- ``validation.md``: the same for people;
- ``clean/train.txt``, ``clean/val.txt`` and ``data.yaml``: the *clean view* every later stage
  reads (absolute image paths; with ``quarantine``, defective images left out). ``data.yaml``
  is written last, so its presence means the rest is complete.

Policy ``fail`` raises :class:`ValidationFailed` (after writing the reports) when any finding
has severity ``error``; ``quarantine`` drops the images with an error, the later copies of
duplicate images, and the training copy of an image that is also in ``val``. The user's files
are only ever read.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from detscale.data import formats, sources
from detscale.data.checks import KINDS, TOLERANCE, Finding, ImageResult, check_one
from detscale.data.formats import DatasetError, DatasetSpec
from detscale.files import write_text

log = logging.getLogger(__name__)

POLICIES = ("fail", "quarantine")
# Examples per kind in the error summary and in the report.
EXAMPLES = 3
REPORT_EXAMPLES = 10


class ValidationFailed(DatasetError):
    """The dataset has errors and the policy is ``fail``."""


@dataclass
class ValidationReport:
    """Everything validation found, and the images kept in each split."""

    data_yaml: str
    root: str
    out: str
    policy: str
    names: tuple[str, ...]
    images: dict[str, list[ImageResult]]
    orphans: list[Finding]
    seconds: float = 0.0
    path_notes: tuple[str, ...] = ()  # split paths found only on a retry (formats.DatasetSpec.path_notes)
    source_format: str = "yolo"  # the format the dataset came in (converted to YOLO when coco or voc)
    conversion_notes: tuple[str, ...] = ()  # what the conversion left out or mapped (sources.Converted.notes)

    def findings(self) -> list[Finding]:
        """Every finding: per image in split order, then the orphan label files."""
        out = [f for split in self.images.values() for r in split for f in r.findings]
        return out + self.orphans

    def counts(self) -> dict[str, int]:
        """Findings per kind (every kind, zeros included)."""
        c = Counter(f.kind for f in self.findings())
        return {kind: c.get(kind, 0) for kind in KINDS}

    def severity_counts(self) -> dict[str, int]:
        c = Counter(f.severity for f in self.findings())
        return {s: c.get(s, 0) for s in ("error", "warning", "info")}

    def kept(self, split: str) -> list[str]:
        """The images of ``split`` in the clean view (all of them unless quarantined)."""
        return [r.image for r in self.images[split] if self.policy == "fail" or not r.dropped]

    def split_stats(self) -> dict[str, dict[str, int]]:
        return {
            split: {
                "images": len(results),
                "kept": len(self.kept(split)),
                "dropped": len(results) - len(self.kept(split)),
                "background": sum(r.background for r in results),
                "boxes": sum(r.boxes for r in results),
            }
            for split, results in self.images.items()
        }

    def to_dict(self) -> dict:
        sev = self.severity_counts()
        return {
            "data_yaml": self.data_yaml,
            "root": self.root,
            "policy": self.policy,
            "passed": sev["error"] == 0,
            "names": list(self.names),
            "path_notes": list(self.path_notes),
            "source_format": self.source_format,
            "conversion_notes": list(self.conversion_notes),
            "tolerance": TOLERANCE,
            "seconds": round(self.seconds, 3),
            "splits": self.split_stats(),
            "severity_counts": sev,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings()],
        }


def _init_worker() -> None:
    import cv2

    cv2.setNumThreads(1)  # one process per core already


# ---------------------------------------------------------------------------------------------
# Dataset-level checks
# ---------------------------------------------------------------------------------------------


def _mark_duplicates(images: dict[str, list[ImageResult]]) -> None:
    """Duplicate images within a split (later copies) and training images also in val."""
    val_first: dict[str, str] = {}
    for r in images.get("val", []):
        if r.digest is not None:
            val_first.setdefault(r.digest, r.image)
    for split, results in images.items():
        first: dict[str, str] = {}
        for r in results:
            if r.digest is None:
                continue
            if split == "train" and r.digest in val_first:
                same = "the same file" if val_first[r.digest] == r.image else f"{val_first[r.digest]}"
                r.findings.append(Finding(split, r.image, None, "train_val_overlap",
                                          f"also in val ({same}): evaluation would see training data"))
            if r.digest in first:
                r.findings.append(Finding(split, r.image, None, "duplicate_image",
                                          f"same content as {first[r.digest]}"))
            else:
                first[r.digest] = r.image


def _image_for_label(label: Path) -> Path | None:
    """The image a label file belongs to by the images/ -> labels/ convention, if one exists."""
    parts = list(label.parts)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "labels":
            parts[i] = "images"
            break
    else:
        return None
    stem = Path(*parts).with_suffix("")
    for suffix in formats.IMAGE_SUFFIXES:
        for candidate in (stem.with_suffix(suffix), stem.with_suffix(suffix.upper())):
            if candidate.is_file():
                return candidate
    return None


def find_orphans(images: dict[str, list[ImageResult]]) -> list[Finding]:
    """Label files, in the label folders the splits use, with no image beside them."""
    folders: dict[Path, str] = {}
    expected: set[Path] = set()
    for split, results in images.items():
        for r in results:
            label = formats.label_path_for(Path(r.image))
            expected.add(label)
            folders.setdefault(label.parent, split)
    out = []
    for folder, split in sorted(folders.items()):
        if not folder.is_dir():
            continue
        for label in sorted(folder.glob("*.txt")):
            if label not in expected and _image_for_label(label) is None:
                out.append(Finding(split, str(label), None, "label_orphan", "no image with this name in "
                                   f"{Path(*[('images' if p == 'labels' else p) for p in folder.parts])}"))
    return out


# ---------------------------------------------------------------------------------------------
# Running, reporting, writing
# ---------------------------------------------------------------------------------------------


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_dataset(
    spec: DatasetSpec,
    workers: int = 0,
    progress: Callable[[int], object] | None = None,
) -> tuple[dict[str, list[ImageResult]], list[Finding]]:
    """Check every image and label of ``spec``: per-image results by split, and orphan labels."""
    tasks = [(split, i, str(p), spec.nc) for split, paths in spec.splits.items() for i, p in enumerate(paths)]
    workers = max(1, min(workers or default_workers(), len(tasks)))
    results: list[ImageResult] = []
    if workers == 1:
        for r in map(check_one, tasks):
            results.append(r)
            if progress:
                progress(1)
    else:
        chunk = max(1, min(64, len(tasks) // (workers * 8)))
        with get_context("spawn").Pool(workers, initializer=_init_worker) as pool:
            for r in pool.imap(check_one, tasks, chunksize=chunk):
                results.append(r)
                if progress:
                    progress(1)
    images: dict[str, list[ImageResult]] = {split: [] for split in spec.splits}
    for r in results:
        images[r.split].append(r)
    _mark_duplicates(images)
    return images, find_orphans(images)


def _display(path: str, root: str) -> str:
    """A path relative to the dataset root when it is inside it (shorter in reports)."""
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def _where(f: Finding, root: str) -> str:
    return _display(f.file, root) + (f":{f.line}" if f.line is not None else "")


def summary_text(report: ValidationReport, kinds: Iterable[str] | None = None, examples: int = EXAMPLES) -> str:
    """Findings grouped by kind with the first examples of each (errors and warnings only by default)."""
    by_kind: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings():
        by_kind[f.kind].append(f)
    wanted = list(kinds) if kinds is not None else [k for k in KINDS if KINDS[k][0] != "info"]
    lines = []
    for kind in wanted:
        found = by_kind.get(kind, [])
        if not found:
            continue
        lines.append(f"  {kind} ({KINDS[kind][0]}, {len(found)}): {KINDS[kind][1]}")
        for f in found[:examples]:
            lines.append(f"      {_where(f, report.root)}: {f.message}")
        if len(found) > examples:
            lines.append(f"      ... and {len(found) - examples} more")
    return "\n".join(lines)


def markdown(report: ValidationReport) -> str:
    """The human report, validation.md."""
    sev = report.severity_counts()
    verdict = "passed" if sev["error"] == 0 else ("FAILED" if report.policy == "fail" else "quarantined")
    out = [
        f"# Dataset validation: {verdict}",
        "",
        f"- dataset: `{report.data_yaml}` (root `{report.root}`)",
        f"- policy: `{report.policy}`; classes: {len(report.names)} ({', '.join(report.names[:20])}"
        f"{', ...' if len(report.names) > 20 else ''})",
        f"- findings: {sev['error']} errors, {sev['warning']} warnings, {sev['info']} notes",
        f"- format: `{report.source_format}`"
        + (" (converted to the YOLO layout in `source/`: images linked, labels written)"
           if report.source_format != "yolo" else ""),
        *(f"- conversion: {note}" for note in report.conversion_notes),
        *(f"- path: {note}" for note in report.path_notes),
        "",
        "| split | images | kept | dropped | background | boxes |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for split, s in report.split_stats().items():
        out.append(f"| {split} | {s['images']} | {s['kept']} | {s['dropped']} | {s['background']} | {s['boxes']} |")
    out += ["", "## Findings by kind", "", "| kind | severity | count | meaning |", "|---|---|---:|---|"]
    for kind, n in report.counts().items():
        out.append(f"| {kind} | {KINDS[kind][0]} | {n} | {KINDS[kind][1]} |")
    by_kind: dict[str, list[Finding]] = defaultdict(list)
    for f in report.findings():
        by_kind[f.kind].append(f)
    shown = [k for k in KINDS if by_kind.get(k)]
    if shown:
        out += ["", "## Examples", ""]
    for kind in shown:
        found = by_kind[kind]
        out += [f"### {kind} ({len(found)})", "", "| split | file | line | message |", "|---|---|---:|---|"]
        for f in found[:REPORT_EXAMPLES]:
            msg = f.message.replace("|", "\\|")
            out.append(f"| {f.split} | `{_display(f.file, report.root)}` | {f.line or ''} | {msg} |")
        if len(found) > REPORT_EXAMPLES:
            out.append(f"\n... and {len(found) - REPORT_EXAMPLES} more in validation.json.")
        out.append("")
    return "\n".join(out) + "\n"


def _check_out(out: Path, data_yaml: Path) -> None:
    if (out / "data.yaml").resolve() == data_yaml.resolve():
        raise DatasetError(
            f"--out {out} would overwrite the dataset's own {data_yaml}: validation never modifies the "
            "user's files; choose another output folder"
        )


def validate(
    data_yaml: str | Path,
    out: str | Path,
    policy: str = "fail",
    workers: int = 0,
    progress: Callable[[int], object] | None = None,
    failed_report: str | Path | None = None,
    on_total: Callable[[int], object] | None = None,
) -> ValidationReport:
    """Validate ``data_yaml`` and write the reports and the clean view to ``out``.

    Raises :class:`ValidationFailed` (after writing validation.json and validation.md, and a
    copy of validation.md to ``failed_report`` when given) when the policy is ``fail`` and an
    error was found, and :class:`DatasetError` when quarantine leaves a split without images.
    ``on_total`` hears the number of images to check once it is known (after a conversion).
    """
    if policy not in POLICIES:
        raise DatasetError(f"--on-error must be one of {', '.join(POLICIES)}, got {policy!r}")
    start = time.perf_counter()
    out = Path(out).resolve()
    _check_out(out, Path(data_yaml))
    converted = sources.convert(data_yaml, out / "source")
    for note in converted.notes:
        log.warning("%s", note)
    spec = formats.load_spec(converted.data_yaml)
    if on_total is not None:
        on_total(sum(len(images) for images in spec.splits.values()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.yaml").unlink(missing_ok=True)  # never leave a previous clean view over new findings
    images, orphans = check_dataset(spec, workers, progress)
    report = ValidationReport(str(Path(data_yaml).resolve()), str(spec.root), str(out), policy, spec.names, images,
                              orphans, time.perf_counter() - start, spec.path_notes, converted.format,
                              tuple(converted.notes))
    for note in spec.path_notes:
        log.warning("%s", note)
    write_text(json.dumps(report.to_dict(), indent=1) + "\n", out / "validation.json")
    write_text(markdown(report), out / "validation.md")
    errors = report.severity_counts()["error"]
    if errors and policy == "fail":
        where = out / "validation.md"
        if failed_report is not None:
            # Snakemake deletes a failed job's outputs but keeps its logs: a copy there survives.
            where = Path(failed_report).resolve()
            where.parent.mkdir(parents=True, exist_ok=True)
            write_text(markdown(report), where)
        raise ValidationFailed(
            f"{spec.yaml_path}: {errors} error(s) in the dataset (on_error: fail)\n{summary_text(report)}\n"
            f"Full report: {where}. Fix these files, or set dataset.on_error: quarantine "
            "(--on-error quarantine) to leave the defective images out."
        )
    empty = [split for split in images if not report.kept(split)]
    if empty:
        raise DatasetError(
            f"{spec.yaml_path}: no usable image left in {', '.join(empty)} after validation; "
            f"see {out / 'validation.md'}"
        )
    (out / "clean").mkdir(exist_ok=True)
    for split in images:
        write_text("".join(f"{p}\n" for p in report.kept(split)), out / "clean" / f"{split}.txt")
    tmp = out / ".data.yaml.tmp"
    formats.write_data_yaml(tmp, spec.names, "clean/train.txt", "clean/val.txt", out,
                            extra={"detscale_source": str(spec.source)} if spec.source else None)
    os.replace(tmp, out / "data.yaml")
    report.seconds = time.perf_counter() - start
    return report

