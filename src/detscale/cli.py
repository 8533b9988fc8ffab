"""The ``detscale`` command.

Each subcommand lives in ``detscale/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; heavy imports (torch, pandas) happen inside ``run`` so that ``--help``
is instant. A :class:`~detscale.errors.UserError` becomes a clear message and exit code 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from detscale import __version__
from detscale.errors import EXIT_INTERRUPTED, UserError

# name -> help line; the module is detscale.commands.<name with - as _>
COMMANDS: dict[str, str] = {
    "synth": "generate the built-in synthetic shapes dataset (YOLO layout)",
    "validate": "check a YOLO dataset and write validation.json / validation.md",
    "cache": "decode and letterbox a split once into a memory-mapped uint8 cache",
    "model": "model information: parameters and GFLOPs (`detscale model info NAME`)",
    "launch": "claim GPU slots and start `torchrun` for `detscale train`",
    "train": "train one run of the grid (every rank runs this)",
    "comm": "time the all-reduce of a model's gradient on N ranks (run it under `detscale launch`)",
    "evaluate": "COCO mAP of a trained run",
    "report": "scaling tables, plots and index.html from finished runs",
    "compare": "line up two results folders run by run and say which differences exceed their stated spread",
    "runs": "list the run ids of a config's grid",
    "slurm": "Slurm: `detscale slurm check` compares every job's ask with its partition, submitting nothing",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="detscale",
        description="Reproducible single- vs multi-GPU benchmarks of YOLOv9-family detectors.",
    )
    parser.add_argument("--version", action="version", version=f"detscale {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_line in COMMANDS.items():
        module = importlib.import_module(f"detscale.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=help_line, description=(module.__doc__ or help_line).strip())
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def user_message(exc: UserError) -> str:
    """The message of a user error; one raised in a data-loader worker arrives wrapped in the worker's
    traceback (torch re-raises it with ``Caught ... in DataLoader worker process N``): its last line."""
    text = str(exc)
    if "Original Traceback" in text:
        last = [line for line in text.strip().splitlines() if line.strip()][-1]
        head, _, rest = last.partition(": ")
        return rest if rest and head.split(".")[-1] == type(exc).__name__ else last
    return text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args._module.run(args) or 0)
    except UserError as exc:
        logging.getLogger("detscale").error("error: %s", user_message(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        logging.getLogger("detscale").error("interrupted")
        return EXIT_INTERRUPTED
