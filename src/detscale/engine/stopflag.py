"""The stop flag: SIGTERM/SIGINT set it; the ranks agree on it at an optimiser-step boundary."""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch

from detscale import dist

log = logging.getLogger(__name__)


class StopFlag:
    """Set by SIGTERM/SIGINT; :meth:`agreed` is the all-ranks decision (collective: call on every rank).

    With several ranks the flags are combined by an all-reduce that runs in the background, on a
    gloo group of its own (CPU tensors: no device synchronisation): :meth:`agreed` returns the
    result of the all-reduce started at the previous call and starts the next, so the ranks stop
    together one optimiser step after the signal, and no step waits for the vote.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._vote: torch.Tensor | None = None
        self._work: Any = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.close()

    def _handle(self, signum: int, _frame: object) -> None:
        self.requested = True
        log.warning("signal %d received: stopping at the next optimiser step and saving last.pt", signum)

    def agreed(self, device: torch.device) -> bool:
        if dist.get_world_size() == 1:
            return self.requested
        import torch.distributed as tdist

        if self._group is None:
            self._group = tdist.new_group(backend="gloo")
        stop = False
        if self._work is not None and self._vote is not None:
            self._work.wait()
            stop = bool(self._vote.item() > 0)
        self._vote = torch.tensor([1.0 if self.requested else 0.0])
        self._work = tdist.all_reduce(self._vote, op=tdist.ReduceOp.MAX, group=self._group, async_op=True)
        return stop

    def close(self) -> None:
        """Finish the vote in flight (before the process group goes)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
