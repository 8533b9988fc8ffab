# Dataset stages: synthetic generation (when configured), validation, image cache.
import os


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
        log:
            f"results/logs/{DATASET}/synth.log",
        benchmark:
            f"results/benchmarks/{DATASET}/synth.tsv"
        threads: workflow.cores
        shell:
            "detscale synth --out {params.out} --seed {params.seed} --imgsz {params.imgsz}"
            " --train {params.train} --val {params.val} --objects {params.objects}"
            " --object-size {params.object_size} --workers {threads} > {log} 2>&1"
