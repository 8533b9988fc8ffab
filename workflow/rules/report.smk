# The scaling report of every run of the grid: tables, plots and a self-contained index.html.


rule experiment_config:
    output:
        EXPERIMENT_CONFIG,
    params:
        digest=CFG.digest(),
    log:
        f"{LOG_DIR}/experiment_config.log",
    localrule: True
    run:
        dsfiles.write_text(dsruns.experiment_config_text(CFG), output[0])


rule report:
    input:
        config=EXPERIMENT_CONFIG,
        timing=run_files("timing.json"),
        evaluation=run_files("eval.json"),
        env=run_files("env.json"),
        run_config=run_files("config.yaml"),
        comm=COMM_FILES,
    output:
        html=report(f"{REPORT_DIR}/index.html", caption="../report/index.rst", category="Report"),
        csv=report(f"{REPORT_DIR}/scaling.csv", caption="../report/scaling.rst", category="Tables"),
        markdown=f"{REPORT_DIR}/scaling.md",
        plots=[
            report(f"{REPORT_DIR}/plots/{name}.png", caption=f"../report/{name}.rst", category="Plots")
            for name in REPORT_PLOTS
        ],
    params:
        runs=expand(RUN_DIR, run=RUNS),
        out=lambda wildcards, output: os.path.dirname(output.html),
    conda:
        CONDA_ENV
    log:
        f"{LOG_DIR}/report.log",
    benchmark:
        f"{BENCH_DIR}/report.tsv"
    localrule: True
    shell:
        "detscale report --runs {params.runs} --config {input.config} --comm {input.comm} --out {params.out} > {log} 2>&1"


# `snakemake machines`: this workflow's results beside other machines' results folders of the same
# grid (config `machines.results`), lined up by grid point (detscale.report.machines).
rule machines:
    input:
        config=EXPERIMENT_CONFIG,
        csv=f"{REPORT_DIR}/scaling.csv",
    output:
        markdown=f"{MACHINES_DIR}/machines.md",
        csv=f"{MACHINES_DIR}/machines.csv",
    params:
        # this workflow's results folder (the report's grandparent), then the others
        results=lambda wildcards, input: " ".join(
            shlex.quote(r) for r in [os.path.dirname(os.path.dirname(input.csv)), *CFG.machines.results]
        ),
        labels=" ".join(f"--label {shlex.quote(label)}" for label in CFG.machines.labels),
        out=lambda wildcards, output: os.path.dirname(output.csv),
    conda:
        CONDA_ENV
    log:
        f"{LOG_DIR}/machines.log",
    localrule: True
    shell:
        "detscale report --results {params.results} {params.labels} --config {input.config} --out {params.out}"
        " > {log} 2>&1"
