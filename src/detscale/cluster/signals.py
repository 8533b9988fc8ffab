"""SIGTERM and SIGINT around a child process, and the exit status they turn into.

A launcher runs ``torchrun`` (or Slurm's agent runs it) as a child and must report what happened:
the child's own status, or :data:`~detscale.errors.EXIT_PREEMPTED` (75) after a SIGTERM, when the
ranks have written ``weights/last.pt`` at a step boundary and rerunning resumes, or
:data:`~detscale.errors.EXIT_INTERRUPTED` (130) after a SIGINT.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator, Sequence

from detscale.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def caught_signals(forward_to: subprocess.Popen | None = None) -> Iterator[list[int]]:
    """Record SIGINT/SIGTERM while inside (yields the list of those received) and, with ``forward_to``,
    send each on to that child. The previous handlers come back on exit."""
    received: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)
        if forward_to is not None:
            with contextlib.suppress(ProcessLookupError):
                forward_to.send_signal(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def exit_status(code: int, received: Sequence[int]) -> int:
    """The status to report for a child that ended with ``code`` after the signals ``received``."""
    if signal.SIGTERM in received:
        return EXIT_PREEMPTED
    if signal.SIGINT in received:
        return EXIT_INTERRUPTED
    return code
