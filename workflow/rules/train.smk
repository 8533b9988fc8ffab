# Training: one job per grid point. The run's config file is narrowed to its point and rewritten
# only when something that affects the run changes (its digest is the rule's parameter), so a
# grid change re-trains only the runs it touches.
#
# Two rules train, and every run id belongs to exactly one of them (wildcard constraints):
#   train            grid points on one node (grid.nodes == 1)
#   train_multinode  grid points on several nodes (grid.nodes > 1): the job holds all M nodes and
#                    `detscale launch --nodes M` starts one torchrun agent per node with srun.


# The outputs and command shared by both training rules.
TRAIN_OUTPUT = dict(
    timing=f"{RUN_DIR}/timing.json",
    env=f"{RUN_DIR}/env.json",
    config=f"{RUN_DIR}/config.yaml",
    metrics=f"{RUN_DIR}/metrics.jsonl",
    weights=f"{RUN_DIR}/weights/last.pt",
)
# --resume-stash: Snakemake deletes a job's outputs (weights/last.pt among them) before running it
# again, so after a preemption (exit 75) or a failure `detscale launch` keeps the checkpoint in
# RUN_DIR/resume-stash and puts it back on the next start, when the config is still the same;
# `train --resume` then continues the run.
TRAIN_SHELL = (
    "detscale launch --gpus {params.gpus} {params.nodes} --threads {params.threads}"
    " --max-restarts {params.max_restarts} --resume-stash {params.out}/resume-stash --"
    " train --config {input.config} --run {wildcards.run} --out {params.out} --resume {params.elastic}"
    " --data {input.data} {params.cache} > {log} 2>&1"
)


rule run_config:
    output:
        f"{RUN_DIR}/run.yaml",
    params:
        digest=run_config_digest("train"),
    log:
        f"{LOG_DIR}/runs/{{run}}/run_config.log",
    localrule: True
    run:
        dsfiles.write_text(dsruns.run_config_text(CFG, wildcards.run, "train"), output[0])


rule train:
    input:
        config=f"{RUN_DIR}/run.yaml",
        data=CLEAN_DATA_YAML,
        cache=run_cache,
    output:
        **TRAIN_OUTPUT,
    wildcard_constraints:
        run=train_runs_pattern(multinode=False),
    params:
        out=lambda wildcards, output: os.path.dirname(output.timing),
        gpus=run_gpus,
        elastic=run_elastic_arg,
        nodes=run_nodes_arg,
        cache=run_cache_arg,
        threads=CFG.train.cpu_threads_per_rank,
        max_restarts=CFG.train.max_restarts,
    conda:
        CONDA_ENV
    log:
        f"{LOG_DIR}/runs/{{run}}/train.log",
    benchmark:
        f"{BENCH_DIR}/runs/{{run}}/train.tsv"
    threads: run_threads
    resources:
        gpu=run_gpus,
        timed_run=TIMED_RUN,
    shell:
        TRAIN_SHELL


# A multi-node run is one Slurm job over M nodes (snakemake-executor-plugin-slurm 2.x):
#   nodes=M          -> sbatch --nodes=M
#   mpi="srun"       the job-step executor then runs the rule's command as is in the batch
#                    script, instead of inside `srun -n1` (one task on one node, which could not
#                    start an agent on every node); the command itself calls srun (detscale.cluster.slurm).
#                    The plugin only tests that the key exists; the value names the launcher.
#   tasks=M          -> sbatch --ntasks=M: one task (one torchrun agent) per node. The plugin
#                    requires tasks (> 1) or tasks_per_node (> 1) for an `mpi` job.
#   tasks_per_gpu=0  the plugin turns `tasks` of a GPU job into `--ntasks-per-gpu=M` unless
#                    tasks_per_gpu is set; 0 leaves that option out (M tasks per GPU is wrong).
#   gpu=N            -> sbatch --gpus=N (all nodes together), and the number of GPU slots the
#                    job takes of a local `--resources gpu=K`.
#   slurm_extra      --gpus-per-node=N/M --signal=TERM@300 (see run_multinode_slurm_extra).
# CPUs: the profile's cpus_per_gpu -> --cpus-per-gpu; without it, `threads` (one node's share)
# -> --cpus-per-task. Without Slurm (plain `snakemake --cores K`), `detscale launch --nodes M`
# fails with a message saying that it needs a Slurm allocation, unless snakemake itself runs
# inside one (`salloc --nodes M`), where it starts the agents on the allocated nodes.
rule train_multinode:
    input:
        config=f"{RUN_DIR}/run.yaml",
        data=CLEAN_DATA_YAML,
        cache=run_cache,
    output:
        **TRAIN_OUTPUT,
    wildcard_constraints:
        run=train_runs_pattern(multinode=True),
    params:
        out=lambda wildcards, output: os.path.dirname(output.timing),
        gpus=run_gpus,
        elastic=run_elastic_arg,
        nodes=run_nodes_arg,
        cache=run_cache_arg,
        threads=CFG.train.cpu_threads_per_rank,
        max_restarts=CFG.train.max_restarts,
    conda:
        CONDA_ENV
    log:
        f"{LOG_DIR}/runs/{{run}}/train.log",
    benchmark:
        f"{BENCH_DIR}/runs/{{run}}/train.tsv"
    threads: run_threads_per_node
    resources:
        gpu=run_gpus,
        nodes=run_nodes,
        tasks=run_nodes,
        tasks_per_gpu=0,
        mpi="srun",
        slurm_extra=run_multinode_slurm_extra,
        timed_run=TIMED_RUN,
    shell:
        TRAIN_SHELL
