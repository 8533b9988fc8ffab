# Dataset stages: synthetic generation (when configured), validation, image cache.


if CFG.dataset.synthetic is not None:

    rule synth_dataset:
        output:
            data_yaml=source_data_yaml(),
        params:
            synth=CFG.dataset.synthetic,
        log:
            f"results/logs/{DATASET}/synth.log",
        benchmark:
            f"results/benchmarks/{DATASET}/synth.tsv"
        shell:
            "detscale synth --config {workflow.configfiles[0]} --out $(dirname {output.data_yaml}) > {log} 2>&1"
