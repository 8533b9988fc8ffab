"""(being built) `detscale synth`."""

from __future__ import annotations

import argparse

from detscale.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    raise UserError("`detscale synth` is not available yet")
