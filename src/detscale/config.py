"""Typed, validated, frozen experiment configuration.

One JSON schema (``workflow/schemas/config.schema.yaml``) is the single source of truth: the
Snakefile validates against it with ``snakemake.utils.validate`` and this module validates
against it with ``jsonschema``, fills in the defaults, adds the checks a schema cannot express
(paths that must exist, divisibility) and turns the result into frozen dataclasses.

Every mistake raises :class:`ConfigError` with a message that names the key, the value given
and what is allowed.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from detscale.errors import UserError

SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "config.schema.yaml"

PRECISIONS = ("fp32", "bf16", "fp16")
CACHE_MODES = ("none", "disk", "ram")


class ConfigError(UserError):
    """A configuration that cannot be run; the message says which key and how to fix it."""


@cache
def load_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) shared with the Snakefile."""
    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


# ---------------------------------------------------------------------------------------------
# Schema validation with readable messages
# ---------------------------------------------------------------------------------------------


def _key_path(path: Any) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _describe(error: Any) -> str:
    """One sentence for one jsonschema error: key, value given, what is allowed."""
    key = _key_path(error.absolute_path)
    kind, expected, value = error.validator, error.validator_value, error.instance
    if kind == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(value) - set(allowed)) if isinstance(value, dict) else []
        where = f" in '{key}'" if error.absolute_path else ""
        return f"unknown key {', '.join(repr(u) for u in unknown)}{where}; allowed keys: {', '.join(allowed)}"
    if kind == "required":
        missing = [k for k in expected if k not in value]
        return f"'{key}' is missing the required key {', '.join(repr(m) for m in missing)}"
    if kind == "oneOf" and key == "dataset":
        return ("'dataset' needs exactly one of 'data_yaml' (a YOLO data.yaml) or 'synthetic' "
                "(the built-in generated dataset)")
    templates = {
        "type": "must be of type {}",
        "enum": "must be one of {}",
        "minimum": "must be >= {}",
        "maximum": "must be <= {}",
        "exclusiveMinimum": "must be > {}",
        "exclusiveMaximum": "must be < {}",
        "multipleOf": "must be a multiple of {}",
        "minItems": "must have at least {} item(s)",
        "maxItems": "must have at most {} item(s)",
        "uniqueItems": "must not repeat a value",
        "pattern": "must match {}",
        "minLength": "must not be empty",
    }
    shown = ", ".join(map(str, expected)) if kind == "enum" else expected
    allowed = templates[kind].format(shown) if kind in templates else error.message
    return f"'{key}': got {value!r}; {allowed}"


def _fill_defaults(schema: Mapping[str, Any], instance: Any) -> None:
    """Insert schema defaults into nested objects, as snakemake's validate(set_default=True) does."""
    if not isinstance(instance, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        if name not in instance and "default" in sub:
            instance[name] = copy.deepcopy(sub["default"])
        if name in instance:
            _fill_defaults(sub, instance[name])


def validate_dict(raw: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """Validate a raw mapping against the schema and return a copy with defaults filled in."""
    import jsonschema

    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: the configuration must be a mapping of keys, got {type(raw).__name__}")
    data = copy.deepcopy(dict(raw))
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(e.absolute_path)))
    if errors:
        lines = "\n".join(f"  - {_describe(e)}" for e in errors)
        raise ConfigError(f"invalid configuration in {source}:\n{lines}")
    grid = data.get("grid")
    if isinstance(grid, dict) and "seed" in grid:  # the deprecated single seed
        if "seeds" in grid:
            raise ConfigError(f"invalid configuration in {source}:\n  - 'grid.seed' and 'grid.seeds' both given; "
                              f"keep only 'seeds: [{grid['seed']}]' ('seed' is the deprecated form of one seed)")
        grid["seeds"] = [grid.pop("seed")]
    _fill_defaults(load_schema(), data)
    return data


# ---------------------------------------------------------------------------------------------
# Typed, frozen sections
# ---------------------------------------------------------------------------------------------


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items() if k in names})


@dataclass(frozen=True)
class SynthConfig:
    seed: int = 0
    imgsz: int = 640
    train: int = 400
    val: int = 100
    objects: tuple[int, int] = (1, 10)
    object_size: tuple[float, float] = (0.02, 0.6)


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    data_yaml: str | None = None
    synthetic: SynthConfig | None = None
    on_error: str = "fail"

    def resolved_data_yaml(self, results: str | Path = "results") -> Path:
        """The data.yaml every stage reads: the user's, or the generated synthetic one."""
        if self.data_yaml is not None:
            return Path(self.data_yaml)
        return Path(results) / "data" / self.name / "dataset" / "data.yaml"


@dataclass(frozen=True)
class GridConfig:
    model: tuple[str, ...] = ("gelan-t",)
    imgsz: tuple[int, ...] = (640,)
    gpus: tuple[int, ...] = (1,)
    nodes: int = 1
    batch: tuple[int, ...] = (16,)
    scaling: str = "weak"
    cache: tuple[str, ...] = ("disk",)
    precision: tuple[str, ...] = ("fp32",)
    repeats: int = 1
    epochs: int = 100
    seeds: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class TrainConfig:
    optimizer: str = "sgd"
    lr0: float = 0.01
    lrf: float = 0.01
    momentum: float = 0.937
    weight_decay: float = 0.0005
    warmup_epochs: float = 3
    warmup_bias_lr: float = 0.1
    warmup_momentum: float = 0.8
    warmup_accumulate: str = "fixed"
    nominal_batch: int = 64
    lr_schedule: str = "linear"
    lr_scaling: str = "none"
    ema_decay: float = 0.9999
    ema_tau: float = 2000
    clip_grad_norm: float = 10.0
    sync_bn: bool = False
    channels_last: bool = False
    close_mosaic: int = 15
    workers: int = 2
    cpu_threads_per_rank: int = 1
    timing_warmup_steps: int = 5
    step_breakdown: bool = True
    compile: str = "off"
    compile_mode: str = "default"
    target_bucket: int = 0
    val_interval: int = 0
    box_gain: float = 7.5
    cls_gain: float = 0.5
    dfl_gain: float = 1.5
    timeout_s: int = 1800
    max_restarts: int = 1
    preflight_timeout_s: float = 60.0
    preflight_min_gbps: float = 0.0


@dataclass(frozen=True)
class AugmentConfig:
    hsv_h: float = 0.015
    hsv_s: float = 0.7
    hsv_v: float = 0.4
    translate: float = 0.1
    scale: float = 0.9
    fliplr: float = 0.5
    mosaic: float = 1.0
    mixup: float = 0.0


@dataclass(frozen=True)
class EvalConfig:
    conf: float = 0.001
    iou: float = 0.7
    max_det: int = 300
    batch: int = 32
    tta_fraction: float = 0.9
    gpus: int = 1


@dataclass(frozen=True)
class PlacementConfig:
    allow_overlap: bool = False
    data_threads: int = 4
    eval_threads: int = 1


#: Built-in fabrics of the scaling projection: all-reduce latency and bus bandwidth (nccl-tests'
#: busbw, large messages) that a well-set-up system reaches, with the source of each figure.
FABRICS: dict[str, dict[str, Any]] = {
    "nvlink4": {"latency_us": 15.0, "busbw_GBps": 360.0,
                "source": "NVLink 4 (H100 SXM), 450 GB/s per direction per GPU (NVIDIA H100 datasheet); "
                          "nccl-tests all_reduce_perf busbw ~360 GB/s on 8x H100 without NVLS (NVIDIA NCCL "
                          "performance notes); latency: small-message all-reduce ~15 us"},
    "pcie4": {"latency_us": 20.0, "busbw_GBps": 20.0,
              "source": "PCIe 4.0 x16: 31.5 GB/s per direction (PCI-SIG); ring all-reduce through the host "
                        "bridge reaches ~2/3 of it in nccl-tests"},
    "pcie5": {"latency_us": 20.0, "busbw_GBps": 40.0,
              "source": "PCIe 5.0 x16: 63 GB/s per direction (PCI-SIG); ~2/3 of it as for PCIe 4.0"},
    "ib100": {"latency_us": 30.0, "busbw_GBps": 11.5,
              "source": "InfiniBand EDR/HDR100, 100 Gb/s = 12.5 GB/s per port (IBTA); ~92 % of line rate "
                        "in nccl-tests across nodes with one NIC per node"},
    "ib200": {"latency_us": 30.0, "busbw_GBps": 23.0,
              "source": "InfiniBand HDR, 200 Gb/s = 25 GB/s per port (IBTA); ~92 % of line rate"},
    "ib400": {"latency_us": 30.0, "busbw_GBps": 46.0,
              "source": "InfiniBand NDR, 400 Gb/s = 50 GB/s per port (IBTA); ~92 % of line rate"},
}


@dataclass(frozen=True)
class ProjectionConfig:
    gpus_per_node: tuple[int, ...] = (1, 2, 4, 8)
    nodes: tuple[int, ...] = (1, 2, 4, 8)
    intra_node: str = "measured"
    inter_node: str = "ib200"
    fabrics: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(FABRICS))


@dataclass(frozen=True)
class MachinesConfig:
    results: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class CostConfig:
    currency: str = "USD"
    gpu_hour: dict[str, float] = field(default_factory=dict)

    def price(self, device: str) -> float | None:
        """Price per GPU-hour of ``device`` (the longest key it contains, case-insensitive); None unpriced."""
        keys = [k for k in self.gpu_hour if k.lower() in device.lower()]
        return float(self.gpu_hour[max(keys, key=len)]) if keys else None


@dataclass(frozen=True)
class RunPoint:
    """One point of the grid: everything that identifies a training run."""

    model: str
    imgsz: int
    gpus: int
    nodes: int
    batch: int
    scaling: str
    cache: str
    precision: str
    seed: int
    repeat: int

    @property
    def batch_per_rank(self) -> int:
        return self.batch if self.scaling == "weak" else self.batch // self.gpus

    @property
    def global_batch(self) -> int:
        return self.batch * self.gpus if self.scaling == "weak" else self.batch

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def run_id(self) -> str:
        """e.g. ``gelan-t_256_g2_b16_disk_fp32_s0_r0`` (seed 0, repeat 0); ``g8n2`` for 8 GPUs on 2 nodes."""
        gpus = f"g{self.gpus}" + (f"n{self.nodes}" if self.nodes > 1 else "")
        batch = f"b{self.batch}" + ("s" if self.scaling == "strong" else "")
        return f"{self.model}_{self.imgsz}_{gpus}_{batch}_{self.cache}_{self.precision}_s{self.seed}_r{self.repeat}"

    @property
    def group(self) -> str:
        """The point without its GPU count, seed and repeat: runs of one group are compared for speed-up,
        and their runs of one seed pair up for the accuracy comparison."""
        batch = f"b{self.batch}" + ("s" if self.scaling == "strong" else "")
        return f"{self.model}_{self.imgsz}_{batch}_{self.cache}_{self.precision}"


@dataclass(frozen=True)
class ExperimentConfig:
    dataset: DatasetConfig
    grid: GridConfig
    train: TrainConfig
    augment: AugmentConfig
    eval: EvalConfig
    placement: PlacementConfig
    projection: ProjectionConfig = field(default_factory=ProjectionConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    machines: MachinesConfig = field(default_factory=MachinesConfig)
    continue_on: dict[str, int] = field(default_factory=dict)  # run id -> GPU count (elastic continuation)
    source: str = "config"

    def runs(self) -> list[RunPoint]:
        """Every run of the grid, in a stable order."""
        g = self.grid
        return [
            RunPoint(m, s, n, g.nodes, b, g.scaling, c, p, seed, r)
            for m, s, n, b, c, p, seed, r in itertools.product(
                g.model, g.imgsz, g.gpus, g.batch, g.cache, g.precision, g.seeds, range(g.repeats)
            )
        ]

    def run(self, run_id: str) -> RunPoint:
        """The grid point of ``run_id``; a clear error when it is not in this config's grid."""
        for point in self.runs():
            if point.run_id == run_id:
                return point
        known = ", ".join(p.run_id for p in self.runs())
        raise ConfigError(f"run '{run_id}' is not in the grid of {self.source}; runs are: {known}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, no tuples) in the config file's layout; ``source`` left out."""
        out = json.loads(json.dumps(asdict(self)))
        out.pop("source")
        if out["dataset"]["synthetic"] is None:
            out["dataset"].pop("synthetic")
        if out["dataset"]["data_yaml"] is None:
            out["dataset"].pop("data_yaml")
        return out

    def digest(self, *sections: str) -> str:
        """Short hash of the given sections (all when none): changes when any of their values do."""
        data = self.to_dict()
        picked = {k: data[k] for k in (sections or sorted(data))}
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:12]


def _semantic_checks(cfg: ExperimentConfig, base: Path) -> None:
    """What the schema cannot say: existing paths, divisibility, sizes that fit."""
    problems: list[str] = []
    d = cfg.dataset
    if d.data_yaml is not None:
        path = Path(d.data_yaml) if Path(d.data_yaml).is_absolute() else base / d.data_yaml
        if not path.is_file():
            problems.append(
                f"'dataset.data_yaml': got {d.data_yaml!r}; no such file (looked at {path}). "
                "Give the path of an existing YOLO data.yaml, or use 'synthetic:' instead"
            )
    if d.synthetic is not None:
        lo, hi = d.synthetic.objects
        if lo > hi:
            problems.append(f"'dataset.synthetic.objects': got [{lo}, {hi}]; the minimum must not exceed the maximum")
        slo, shi = d.synthetic.object_size
        if slo > shi:
            problems.append(
                f"'dataset.synthetic.object_size': got [{slo}, {shi}]; the minimum must not exceed the maximum"
            )
    g = cfg.grid
    for n in g.gpus:
        if n % g.nodes:
            problems.append(
                f"'grid.gpus': got {n} with nodes {g.nodes}; every GPU count must divide by the number of nodes"
            )
    if g.scaling == "strong":
        for b, n in itertools.product(g.batch, g.gpus):
            if b % n:
                problems.append(
                    f"'grid.batch': got global batch {b} with {n} GPUs and scaling 'strong'; the global batch "
                    f"must divide evenly by the GPU count (for example {math.ceil(b / n) * n})"
                )
    points = {p.run_id: p for p in cfg.runs()}
    for run_id, gpus in sorted(cfg.continue_on.items()):
        if run_id not in points:
            problems.append(f"'continue_on': {run_id!r} is not a run of the grid (`detscale runs --config` lists them)")
        elif points[run_id].nodes > 1:
            problems.append(f"'continue_on': {run_id} is a multi-node point; only single-node runs continue elsewhere")
        elif gpus == points[run_id].gpus:
            problems.append(f"'continue_on': {run_id} already runs on {gpus} GPU(s); leave it out")
    if cfg.machines.labels and len(cfg.machines.labels) != len(cfg.machines.results) + 1:
        problems.append(f"'machines.labels': got {len(cfg.machines.labels)} label(s) for "
                        f"{len(cfg.machines.results) + 1} results folders (this workflow's and machines.results); "
                        "give one each, this workflow's first, or none")
    pr = cfg.projection
    names = ", ".join(sorted(pr.fabrics))
    if pr.intra_node != "measured" and pr.intra_node not in pr.fabrics:
        problems.append(f"'projection.intra_node': got {pr.intra_node!r}; use 'measured' or one of projection.fabrics: "
                        f"{names}")
    if pr.inter_node != "measured" and pr.inter_node not in pr.fabrics:
        problems.append(f"'projection.inter_node': got {pr.inter_node!r}; use 'measured' or one of projection.fabrics: "
                        f"{names}")
    if problems:
        raise ConfigError(f"invalid configuration in {cfg.source}:\n" + "\n".join(f"  - {p}" for p in problems))


def from_dict(raw: Mapping[str, Any], source: str = "config", base: str | Path = ".") -> ExperimentConfig:
    """Validate ``raw`` and build the frozen config; relative paths are checked against ``base``."""
    data = validate_dict(raw, source)
    if data["train"].get("compile") is False:  # YAML 1.1 reads an unquoted `off` as false
        data["train"] = {**data["train"], "compile": "off"}
    ds = dict(data["dataset"])
    if "synthetic" in ds:
        ds["synthetic"] = _build(SynthConfig, ds["synthetic"])
    cfg = ExperimentConfig(
        dataset=_build(DatasetConfig, ds),
        grid=_build(GridConfig, data["grid"]),
        train=_build(TrainConfig, data["train"]),
        augment=_build(AugmentConfig, data["augment"]),
        eval=_build(EvalConfig, data["eval"]),
        placement=_build(PlacementConfig, data["placement"]),
        projection=_build(ProjectionConfig, data["projection"]),
        cost=_build(CostConfig, data["cost"]),
        machines=_build(MachinesConfig, data["machines"]),
        continue_on=dict(data["continue_on"]),
        source=source,
    )
    _semantic_checks(cfg, Path(base))
    return cfg


def load(path: str | Path) -> ExperimentConfig:
    """Read, validate and freeze a config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass --configfile/--config with an existing YAML file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return from_dict(raw or {}, source=str(path))


def save(cfg: ExperimentConfig, path: str | Path, extra: Mapping[str, Any] | None = None) -> None:
    """Write the frozen config (plus ``extra`` sections, e.g. a run's derived values) as YAML."""
    data = cfg.to_dict()
    if extra:
        data.update(extra)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def reference_rows(schema: Mapping[str, Any] | None = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every leaf key of the schema: config/README.md's reference."""
    schema = load_schema() if schema is None else schema
    rows: list[tuple[str, str, str, str]] = []
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        if sub.get("type") == "object" and "properties" in sub:
            rows += reference_rows(sub, prefix=f"{key}.")
            continue
        if "enum" in sub:
            kind = " \\| ".join(map(str, sub["enum"]))
        elif sub.get("type") == "array":
            item = sub.get("items", {})
            kind = "list of " + (" \\| ".join(map(str, item["enum"])) if "enum" in item else item.get("type", "any"))
        else:
            kind = str(sub.get("type", "any"))
        default = json.dumps(sub["default"]) if "default" in sub else "required" if name in schema.get(
            "required", []) else "-"
        desc = " ".join(str(sub.get("description", "")).split())
        rows.append((key, kind, default, desc))
    return rows


def reference_markdown() -> str:
    """The configuration reference table of config/README.md, generated from the schema."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | `{d}` | {m} |" for k, t, d, m in reference_rows()]
    return "\n".join(lines)
