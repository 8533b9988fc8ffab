# Evaluation: COCO mAP of each run's final weights on the clean validation split.


rule eval_config:
    output:
        f"{RUN_DIR}/eval.yaml",
    params:
        digest=run_config_digest("evaluate"),
    log:
        f"{LOG_DIR}/runs/{{run}}/eval_config.log",
    localrule: True
    run:
        dsfiles.write_text(dsruns.run_config_text(CFG, wildcards.run, "evaluate"), output[0])


rule evaluate:
    input:
        weights=f"{RUN_DIR}/weights/last.pt",
        config=f"{RUN_DIR}/eval.yaml",
        data=CLEAN_DATA_YAML,
    output:
        eval=f"{RUN_DIR}/eval.json",
        predictions=f"{RUN_DIR}/predictions.json",
    params:
        out=lambda wildcards, output: os.path.dirname(output.eval),
    conda:
        CONDA_ENV
    log:
        f"{LOG_DIR}/runs/{{run}}/evaluate.log",
    benchmark:
        f"{BENCH_DIR}/runs/{{run}}/evaluate.tsv"
    threads: CFG.placement.eval_threads
    resources:
        gpu=1,
        timed_run=TIMED_RUN,
    shell:
        "detscale evaluate --weights {input.weights} --config {input.config} --run {wildcards.run}"
        " --out {params.out} --data {input.data} > {log} 2>&1"
