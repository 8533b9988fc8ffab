# Communication benchmark: the all-reduce of each model's gradient, in DDP's buckets, on every
# single-node rank count of the grid above 1 (gloo CPU ranks here, NCCL on GPUs). The report
# shows its figures and fits the scaling projection's alpha-beta model to it.


rule comm:
    input:
        config=EXPERIMENT_CONFIG,
        data=CLEAN_DATA_YAML,
    output:
        str(dslayout.comm_file("{model}", "{imgsz}", "{gpus}")),
    wildcard_constraints:
        model="|".join(re.escape(m) for m in sorted({p[0] for p in COMM_POINTS})) or "none",
        imgsz=r"\d+",
        gpus=r"\d+",
    params:
        threads=CFG.train.cpu_threads_per_rank,
        # the contention probe's batch per rank: the grid's largest
        batch=max(CFG.grid.batch),
    conda:
        CONDA_ENV
    log:
        f"{LOG_DIR}/comm/{{model}}_{{imgsz}}_g{{gpus}}.log",
    threads: lambda wildcards: int(wildcards.gpus) * CFG.train.cpu_threads_per_rank
    resources:
        gpu=lambda wildcards: int(wildcards.gpus),
        timed_run=TIMED_RUN,
    shell:
        "detscale launch --gpus {wildcards.gpus} --threads {params.threads} -- comm --config {input.config}"
        " --model {wildcards.model} --imgsz {wildcards.imgsz} --batch {params.batch} --data {input.data}"
        " --out {output} > {log} 2>&1"
