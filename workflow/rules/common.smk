# Configuration, validated once (schema + the package's semantic checks), and the helpers rules use.
import sys

from detscale import config as dsconfig

validate(config, "../schemas/config.schema.yaml")
try:
    CFG = dsconfig.from_dict(config, source="the snakemake config")
except dsconfig.ConfigError as exc:
    sys.stderr.write(f"error: {exc}\n")
    sys.exit(2)

DATASET = CFG.dataset.name
DATA_DIR = f"results/data/{DATASET}"
# The data.yaml every stage after validation reads: the clean view written by validate_dataset.
CLEAN_DATA_YAML = f"{DATA_DIR}/data.yaml"


def source_data_yaml():
    """The dataset as given: the user's data.yaml or the generated synthetic one."""
    return str(CFG.dataset.resolved_data_yaml())


def all_targets():
    return [f"{DATA_DIR}/validation.json"]
