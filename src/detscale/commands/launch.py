"""Claim GPU slots (or CPU ranks), pick a rendezvous port and run ``torchrun`` for ``detscale train``.

Usage: ``detscale launch --gpus N [--nodes M] [--threads T] [--max-restarts R] [--resume-stash DIR] -- train ARGS``,
or ``-- comm ARGS`` for the all-reduce benchmark on the same ranks.
The train arguments are checked first (config, run id, GPU count, batch divisibility), so a
mistake is reported before any rank starts. Exit code: torchrun's, or 75 after a SIGTERM
(the run saved ``weights/last.pt``; rerun the same command to resume).
"""

from __future__ import annotations

import argparse

from detscale.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, required=True,
                        help="ranks in total (GPUs; CPU ranks on a host without CUDA)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (multi-node runs go through Slurm)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per CPU rank (default: the config's train.cpu_threads_per_rank)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="torchrun --max-restarts (default: the config's train.max_restarts)")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--standalone", action="store_true", help="let torchrun pick the rendezvous itself")
    parser.add_argument("--lock-timeout", type=float, default=24 * 3600.0,
                        help="seconds to wait for free GPU slots (default: a day)")
    parser.add_argument("--resume-stash", default=None, metavar="DIR",
                        help="keep the checkpoint of a failed or preempted run in DIR and put it back on the "
                             "next start (for workflows that delete a job's outputs before rerunning it)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- train ARGS (or -- comm ARGS)")


#: the commands every rank can run under ``detscale launch``
RANK_COMMANDS = ("train", "comm")


def _rank_argv(rest: list[str]) -> list[str]:
    argv = rest[1:] if rest[:1] == ["--"] else rest
    if argv[:1] not in ([c] for c in RANK_COMMANDS):
        raise UserError(f"expected `-- train ARGS` or `-- comm ARGS` after the launch options, got "
                        f"{' '.join(rest) or 'nothing'}; e.g. detscale launch --gpus 2 -- train --config C "
                        "--run RUN --out DIR")
    return argv


def _parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"detscale {argv[0]}", exit_on_error=False)
    module.add_arguments(parser)
    try:
        return parser.parse_args(argv[1:])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise UserError(f"invalid {argv[0]} arguments {' '.join(argv[1:])!r}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from detscale import config
    from detscale.cluster.torchrun import LaunchError, LaunchRequest, launch
    from detscale.commands import comm as comm_cmd
    from detscale.commands import train as train_cmd
    from detscale.engine.semantics import check_run_request, config_digest

    if args.gpus < 1 or args.nodes < 1 or args.gpus % args.nodes:
        raise LaunchError(f"--gpus {args.gpus} --nodes {args.nodes}: both must be >= 1 and the GPUs must "
                          "divide evenly over the nodes")
    argv = _rank_argv(list(args.rest))
    if argv[0] == "comm":
        if args.resume_stash:
            raise LaunchError("--resume-stash is for training runs; the all-reduce benchmark has nothing to resume")
        cfg = config.load(_parse(comm_cmd, argv).config)
        point = None
    else:
        train_args = _parse(train_cmd, argv)
        cfg, point = check_run_request(train_args.config, train_args.run, world_size=args.gpus,
                                       elastic=train_args.elastic)
    threads = args.threads if args.threads is not None else cfg.train.cpu_threads_per_rank
    restarts = args.max_restarts if args.max_restarts is not None else cfg.train.max_restarts
    if threads < 1 or restarts < 0:
        raise LaunchError("--threads must be >= 1 and --max-restarts >= 0")
    # The digest the trainer checks a checkpoint against: a stash of another config is never restored.
    stash = (Path(train_args.out), Path(args.resume_stash), config_digest(cfg, point)) if args.resume_stash else None
    preflight = None
    if args.nodes > 1 and point is not None and cfg.train.preflight_timeout_s > 0:
        preflight = (Path(train_args.out) / "preflight.json", cfg.train.preflight_timeout_s,
                     cfg.train.preflight_min_gbps)
    return launch(LaunchRequest(args.gpus, args.nodes, threads, restarts, args.port, args.standalone,
                                args.lock_timeout, tuple(argv), stash, preflight))
