"""Slurm helpers. ``detscale slurm check``: would every job of the workflow fit its partition?

Runs the workflow's own start-up check (``detscale.cluster.slurmfit``) without submitting anything: every
job Snakemake would submit through the profile, with its asks after the profile's
``default-resources``, ``set-resources`` and ``set-threads``, compared with the partition's nodes
(``sinfo``, ``scontrol show partition``). Exit status 0 when every job fits, 2 with one line per
ask that no node can ever satisfy (rule, ask, largest node, the key to change).

    detscale slurm check --profile profiles/slurm --configfile config/my-cluster.yaml
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from detscale.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="compare every job's ask with its partition; submit nothing",
                           description=__doc__)
    check.add_argument("--profile", required=True, type=Path, help="the Snakemake profile (profiles/slurm)")
    check.add_argument("--configfile", nargs="+", type=Path, default=None,
                       help="config file(s), as for snakemake (default: the workflow's config/config.yaml)")
    check.add_argument("--snakefile", type=Path, default=Path("Snakefile"), help="the workflow (default: Snakefile)")
    check.add_argument("--directory", type=Path, default=Path("."), help="working directory (default: .)")


def run(args: argparse.Namespace) -> int:
    from detscale.cluster import slurmfit

    if not (args.profile / "config.yaml").is_file():
        raise UserError(f"{args.profile}: no config.yaml, not a Snakemake profile (e.g. profiles/slurm)")
    if not args.snakefile.is_file():
        raise UserError(f"{args.snakefile}: no such Snakefile; run from the detscale checkout or give --snakefile")
    with tempfile.TemporaryDirectory(prefix="detscale-slurm-check-") as tmp:
        verdict = Path(tmp) / "verdict.txt"
        cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(args.snakefile.resolve()), "--directory",
               str(args.directory), "--profile", str(args.profile), "--nolock"]
        if args.configfile:
            cmd += ["--configfile", *map(str, args.configfile)]
        env = {**os.environ, slurmfit.CHECK_ONLY_ENV: str(verdict)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if verdict.is_file():
            text = verdict.read_text()
            print(text, end="")
            return 2 if proc.returncode else 0
    if proc.returncode == 0:
        print("Slurm check: nothing to submit, every job of the workflow is up to date")
        return 0
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
    raise UserError(f"snakemake stopped before the check could run (status {proc.returncode}):\n{tail}")
