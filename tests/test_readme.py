"""The README's promises: the configuration reference (config/README.md) equals the schema; its commands exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from detscale.config import reference_markdown

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_configuration_reference_matches_the_schema():
    guide = (REPO / "config" / "README.md").read_text()
    assert "config/README.md" in README, "README.md must point at the configuration guide"
    table = guide.split("<!-- reference:start -->")[1].split("<!-- reference:end -->")[0].strip()
    assert table == reference_markdown(), (
        "config/README.md's configuration reference differs from workflow/schemas/config.schema.yaml; "
        "regenerate it with "
        "python -c \"from detscale.config import reference_markdown; print(reference_markdown())\""
    )


def test_make_targets_named_in_the_readme_exist():
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"^make (\w+)", README, flags=re.M)):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"README shows `make {target}`, Makefile lacks it"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_subcommand_named_in_the_readme_exists():
    out = subprocess.run(["detscale", "--help"], capture_output=True, text=True, check=True).stdout
    for name in set(re.findall(r"`detscale (\w+)", README)):
        assert re.search(rf"^\s+{name}\s", out, flags=re.M), f"README names `detscale {name}`, --help lacks it"


def test_reliability_table_points_to_existing_tests():
    section = README.split("## Reliability")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line.split("|")[-2]]
    assert len(rows) >= 10
    for row in rows:
        refs = re.findall(r"`([\w/]+\.py)?::(\w+)`", row.split("|")[-2])
        assert refs, row
        current = None
        for file, test in refs:
            current = file or current
            source = (REPO / "tests" / current).read_text()
            assert re.search(rf"^def {test}\(", source, flags=re.M), f"README names {current}::{test}, which is missing"
