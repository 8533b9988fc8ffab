# Dataset stages: synthetic generation (when configured), validation, image cache.
# Each rule calls one `detscale` command; the logic and its tests live in detscale.data.


if CFG.dataset.synthetic is not None:

    rule synth_dataset:
        output:
            # data.yaml is written last by `detscale synth`: the images and labels beside it are complete.
            data_yaml=source_data_yaml(),
        params:
            out=lambda wildcards, output: os.path.dirname(output.data_yaml),
            seed=CFG.dataset.synthetic.seed,
            imgsz=CFG.dataset.synthetic.imgsz,
            train=CFG.dataset.synthetic.train,
            val=CFG.dataset.synthetic.val,
            objects=" ".join(map(str, CFG.dataset.synthetic.objects)),
            object_size=" ".join(map(str, CFG.dataset.synthetic.object_size)),
        conda:
            CONDA_ENV
        log:
            f"{LOG_DIR}/{DATASET}/synth.log",
        benchmark:
            f"{BENCH_DIR}/{DATASET}/synth.tsv"
        threads: DATA_THREADS
        shell:
            "detscale synth --out {params.out} --seed {params.seed} --imgsz {params.imgsz}"
            " --train {params.train} --val {params.val} --objects {params.objects}"
            " --object-size {params.object_size} --workers {threads} > {log} 2>&1"


# The clean view (DATA_DIR/data.yaml + clean/{train,val}.txt) is what every later stage reads.
# With on_error: fail a defective dataset stops the workflow here; the summary is in the log.
rule validate_dataset:
    input:
        data_yaml=source_data_yaml(),
    output:
        report=f"{DATA_DIR}/validation.json",
        markdown=f"{DATA_DIR}/validation.md",
        train=f"{DATA_DIR}/clean/train.txt",
        val=f"{DATA_DIR}/clean/val.txt",
        data_yaml=CLEAN_DATA_YAML,
    params:
        out=lambda wildcards, output: os.path.dirname(output.report),
        on_error=CFG.dataset.on_error,
    conda:
        CONDA_ENV
    log:
        main=f"{LOG_DIR}/{DATASET}/validate.log",
        # Written only when validation fails: Snakemake then deletes validation.md but keeps logs.
        report=f"{LOG_DIR}/{DATASET}/validation-failed.md",
    benchmark:
        f"{BENCH_DIR}/{DATASET}/validate.tsv"
    threads: DATA_THREADS
    shell:
        "detscale validate {input.data_yaml} --out {params.out} --on-error {params.on_error}"
        " --workers {threads} --failed-report {log.report} > {log.main} 2>&1"


# One cache per (split, image size): decoded and letterboxed once, read by every run of that size.
rule cache_dataset:
    input:
        data_yaml=CLEAN_DATA_YAML,
        images=f"{DATA_DIR}/clean/{{split}}.txt",
    output:
        npy=f"{CACHE_DIR}/{{split}}-{{imgsz}}.npy",
        index=f"{CACHE_DIR}/{{split}}-{{imgsz}}.json",
    wildcard_constraints:
        split="train|val",
        imgsz=r"[1-9][0-9]*",
    params:
        out=lambda wildcards, output: os.path.dirname(output.npy),
    conda:
        CONDA_ENV
    log:
        f"{LOG_DIR}/{DATASET}/cache-{{split}}-{{imgsz}}.log",
    benchmark:
        f"{BENCH_DIR}/{DATASET}/cache-{{split}}-{{imgsz}}.tsv"
    threads: DATA_THREADS
    resources:
        # A cache for one image size may be built while a run of another size trains: take the
        # timed-run slot so that it never steals CPU from a measured run.
        timed_run=TIMED_RUN,
    shell:
        "detscale cache --data {input.data_yaml} --split {wildcards.split} --imgsz {wildcards.imgsz}"
        " --out {params.out} > {log} 2>&1"
