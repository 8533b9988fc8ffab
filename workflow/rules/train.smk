# Training: one job per grid point. The run's config file is narrowed to its point and rewritten
# only when something that affects the run changes (its digest is the rule's parameter), so a
# grid change re-trains only the runs it touches.


rule run_config:
    output:
        f"{RUN_DIR}/run.yaml",
    params:
        digest=run_config_digest("train"),
    log:
        "results/logs/runs/{run}/run_config.log",
    localrule: True
    run:
        dsruns.write_text_atomic(dsruns.run_config_text(CFG, wildcards.run, "train"), output[0])


rule train:
    input:
        config=f"{RUN_DIR}/run.yaml",
        data=CLEAN_DATA_YAML,
        cache=run_cache,
    output:
        timing=f"{RUN_DIR}/timing.json",
        env=f"{RUN_DIR}/env.json",
        config=f"{RUN_DIR}/config.yaml",
        metrics=f"{RUN_DIR}/metrics.jsonl",
        weights=f"{RUN_DIR}/weights/last.pt",
    params:
        out=lambda wildcards, output: os.path.dirname(output.timing),
        gpus=run_gpus,
        nodes=run_nodes_arg,
        cache=run_cache_arg,
        threads=CFG.train.cpu_threads_per_rank,
        max_restarts=CFG.train.max_restarts,
    conda:
        CONDA_ENV
    log:
        "results/logs/runs/{run}/train.log",
    benchmark:
        "results/benchmarks/runs/{run}/train.tsv"
    threads: run_threads
    resources:
        gpu=run_gpus,
        timed_run=TIMED_RUN,
    shell:
        "detscale launch --gpus {params.gpus} {params.nodes} --threads {params.threads}"
        " --max-restarts {params.max_restarts} --"
        " train --config {input.config} --run {wildcards.run} --out {params.out} --resume"
        " --data {input.data} {params.cache} > {log} 2>&1"
