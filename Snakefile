# detscale: dataset -> validation -> cache -> training (1..N ranks) -> evaluation -> report.
# A table of contents; the rules live in workflow/rules/, the logic in the detscale package.
from snakemake.utils import min_version, validate

min_version("8.0")


# The default config, unless the command line names one: `--configfile X` then replaces it
# instead of being merged into it (a merge would mix the default synthetic dataset into X's).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/comm.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        all_targets(),
    default_target: True
