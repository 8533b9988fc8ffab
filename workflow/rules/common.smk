# Configuration, validated once (schema + the package's semantic checks), and the helpers rules use.
import os
import re
import shlex
import sys

from detscale import config as dsconfig
from detscale.commands import runs as dsruns
from detscale import files as dsfiles
from detscale import layout as dslayout

# set_default=False: defaults are filled by detscale.config (a filled-in seeds: [0] would clash with a
# deprecated grid.seed).
validate(config, "../schemas/config.schema.yaml", set_default=False)
try:
    CFG = dsconfig.from_dict(config, source="the snakemake config")
except dsconfig.ConfigError as exc:
    sys.stderr.write(f"error: {exc}\n")
    sys.exit(2)

DATASET = CFG.dataset.name
# Every results/ path comes from detscale.layout, which the trainer's and commands' defaults share.
DATA_DIR = str(dslayout.data_dir(DATASET))
# The data.yaml every stage after validation reads: the clean view written by validate_dataset.
CLEAN_DATA_YAML = str(dslayout.clean_data_yaml(DATASET))
CACHE_DIR = str(dslayout.cache_dir(DATASET))
# The software of every rule (documentation, and used with --use-conda); relative to workflow/rules/.
CONDA_ENV = "../../environment.yml"

# The experiment grid: one training run per point, its id encoding the point
# (model_imgsz_gGPUS_bBATCH_cache_precision_sSEED_rREPEAT, see detscale.config.RunPoint.run_id).
RUNS = [point.run_id for point in CFG.runs()]
RUN_DIR = str(dslayout.runs_dir() / "{run}")
REPORT_DIR = str(dslayout.report_dir())
MACHINES_DIR = str(dslayout.RESULTS / "machines")
COMM_DIR = str(dslayout.comm_dir())
EXPERIMENT_CONFIG = str(dslayout.experiment_config())
LOG_DIR = str(dslayout.logs_dir())
BENCH_DIR = str(dslayout.benchmarks_dir())
# (model, imgsz, gpus) of every single-node grid point with 2 or more ranks: one all-reduce benchmark each.
COMM_POINTS = sorted({(p.model, p.imgsz, p.gpus) for p in CFG.runs() if p.gpus > 1 and p.nodes == 1})
COMM_FILES = [str(dslayout.comm_file(m, s, g)) for m, s, g in COMM_POINTS]
REPORT_PLOTS = [
    "throughput", "efficiency", "memory", "map", "step_time", "accuracy_pairs", "time_to_accuracy", "projection",
]

wildcard_constraints:
    run="|".join(re.escape(r) for r in RUNS),

# Placement of timed runs. Every train job takes `timed_run` (1 unless placement.allow_overlap)
# and the machine has 1 of it unless the user gives `--resources timed_run=K`, so measured runs
# train one at a time. Evaluation takes it too, so nothing of this workflow competes with a
# measured run for its CPUs or cards. GPUs themselves are the `gpu` resource (`--resources
# gpu=4`); `detscale launch` gives concurrent runs disjoint cards with file locks.
TIMED_RUN = 0 if CFG.placement.allow_overlap else 1
# CPU threads of the data and evaluation jobs: capped at --cores locally, the CPU ask of each
# job on a cluster (so they come from the config, never a fixed number a partition may lack).
DATA_THREADS = CFG.placement.data_threads


# On Slurm (profiles/slurm): before the first sbatch, every job's ask is compared with its
# partition's nodes, and a job pending with a reason that means it can never start is cancelled
# with that reason; neither waits silently. Nothing happens with other executors.
onstart:
    from snakemake.exceptions import WorkflowError
    from detscale.cluster import slurmfit as dsslurmfit

    try:
        dsslurmfit.on_start(workflow)
    except dsslurmfit.SlurmFitError as exc:
        raise WorkflowError(str(exc)) from None
if "timed_run" not in workflow.global_resources:
    workflow.global_resources["timed_run"] = 1


def all_targets():
    return [f"{DATA_DIR}/validation.json", f"{REPORT_DIR}/index.html"]


def source_data_yaml():
    """The dataset as given: the user's data.yaml or the generated synthetic one."""
    return str(CFG.dataset.resolved_data_yaml())


def point(wildcards):
    """The grid point of the job's run."""
    return CFG.run(wildcards.run)


def run_gpus(wildcards):
    """The ranks a run trains on: its grid point's GPUs, or the config's `continue_on` for it."""
    return CFG.continue_on.get(wildcards.run, point(wildcards).gpus)


def run_elastic_arg(wildcards):
    """`--elastic` for a run that `continue_on` moves to another GPU count (from its checkpoint)."""
    return "--elastic" if wildcards.run in CFG.continue_on else ""


def run_threads(wildcards):
    """CPU threads a run uses: one torch thread budget per rank (capped by Snakemake at --cores)."""
    return run_gpus(wildcards) * CFG.train.cpu_threads_per_rank


def run_cache(wildcards):
    """The image caches a run reads: the training split (and validation when it validates while training)."""
    p = point(wildcards)
    if p.cache == "none":
        return []
    splits = ["train", "val"] if CFG.train.val_interval > 0 else ["train"]
    return [f"{CACHE_DIR}/{split}-{p.imgsz}.{ext}" for split in splits for ext in ("npy", "json")]


def run_cache_arg(wildcards):
    return "" if point(wildcards).cache == "none" else f"--cache-dir {CACHE_DIR}"


def run_nodes_arg(wildcards):
    nodes = point(wildcards).nodes
    return f"--nodes {nodes}" if nodes > 1 else ""


def run_config_digest(stage):
    """Params value that changes exactly when the run's `stage` config file would (see detscale runs)."""
    return lambda wildcards: dsruns.run_config_digest(CFG, wildcards.run, stage)


def run_files(name):
    """`name` (e.g. "timing.json") of every run of the grid."""
    return expand(f"{RUN_DIR}/{name}", run=RUNS)


# Training rules (train.smk): which rule trains a run, and what a multi-node run asks of Slurm.

def train_runs_pattern(multinode):
    """Regex of the run ids trained by one rule: the multi-node points, or the single-node ones."""
    ids = [p.run_id for p in CFG.runs() if (p.nodes > 1) == multinode]
    # "(?!)" matches nothing: a grid without points of this kind gives the rule no jobs.
    return "|".join(re.escape(r) for r in ids) or "(?!)"


def run_nodes(wildcards):
    return point(wildcards).nodes


def run_threads_per_node(wildcards):
    """CPU threads of one node of a multi-node run (its ranks on that node x threads per rank)."""
    return point(wildcards).gpus_per_node * CFG.train.cpu_threads_per_rank


def run_multinode_slurm_extra(wildcards):
    """sbatch options of a multi-node run that depend on the point, so they live in the rule.

    `--gpus-per-node`: Slurm may otherwise spread `--gpus=N` unevenly over the nodes (3 + 1),
    while every node runs gpus/nodes ranks. `--signal=TERM@300`: as the profile sets for `train`
    (SIGTERM 300 s before the time limit: checkpoint and exit 75). A profile `slurm_extra` for
    train_multinode would replace this whole string, so the profile sets none.
    """
    return f"--gpus-per-node={point(wildcards).gpus_per_node} --signal=TERM@300"
