"""The forward-and-loss of a training step, eager or compiled (``train.compile``), and what the
compiler did.

- ``off``: eager PyTorch.
- ``model``: ``torch.compile`` of the model; the assigner and the loss run eagerly.
- ``step``: ``torch.compile`` of the model and the loss together, one graph per bucket of the
  padded targets (the loader pads them on the CPU, :func:`detscale.data.loader.collate`); the
  backward is compiled with it (AOTAutograd). The optimiser (fused kernels) and the EMA (one
  ``_foreach`` call) are already a few launches and stay eager.

``train.compile_mode``: torch.compile's ``default`` or ``max-autotune``. Refused: SyncBatchNorm
(``train.sync_bn`` with several ranks), whose global loss normaliser is a collective inside the
loss.

:class:`CompileWatch` reads torch's own counters around the run: graphs compiled, graph breaks,
and recompilations after the first step (a new target bucket costs one; anything more means a
shape or a guard that changes from batch to batch). They go into the run's ``timing.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from detscale.config import ConfigError

COMPILE_CHOICES = ("off", "model", "step")
COMPILE_MODES = ("default", "max-autotune")

ForwardLoss = Callable[[torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]


def check_compile(compile_: str, mode: str, sync_bn: bool, world_size: int) -> None:
    """Refuse what cannot be compiled, naming the keys."""
    if compile_ not in COMPILE_CHOICES:
        raise ConfigError(f"'train.compile': got {compile_!r}; must be one of {', '.join(COMPILE_CHOICES)}")
    if mode not in COMPILE_MODES:
        raise ConfigError(f"'train.compile_mode': got {mode!r}; must be one of {', '.join(COMPILE_MODES)}")
    if compile_ != "off" and sync_bn and world_size > 1:
        raise ConfigError("'train.compile' cannot be used with 'train.sync_bn: true' on several ranks: "
                          "SyncBatchNorm and its global loss normaliser are collectives inside the step, "
                          "which the compiled step does not support; set train.compile: off or train.sync_bn: false")


def forward_loss(model: nn.Module, loss_fn: Any, compile_: str = "off", mode: str = "default",
                 backend: str = "inductor") -> ForwardLoss:
    """``fn(x, targets) -> (loss, items)``: the model's forward and the loss, compiled per ``compile_``
    (``backend``: torch.compile's; the trainer always uses inductor, the tests and the tiny GPU-kit
    self-test ``aot_eager``)."""
    options: dict[str, Any] = {"backend": backend}
    if backend == "inductor" and mode != "default":
        options["mode"] = mode
    if compile_ == "model":
        compiled_model = torch.compile(model, **options)
        return lambda x, targets: loss_fn(compiled_model(x), targets)

    def eager(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_fn(model(x), targets)

    if compile_ == "step":
        return torch.compile(eager, **options)
    return eager


def _counters() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from torch's dynamo counters."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


class CompileWatch:
    """Counts what torch.compile does from :meth:`start` on: call :meth:`first_step_done` after the
    first trained batch (its compilation), then :meth:`report`."""

    def __init__(self, compile_: str, mode: str) -> None:
        self.compile, self.mode = compile_, mode
        self.at_start = self.after_first = (0, 0)
        self.first_step_s: float | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self.at_start = _counters()
        self._t0 = time.perf_counter()

    def first_step_done(self) -> None:
        if self.first_step_s is None:
            self.after_first = _counters()
            self.first_step_s = time.perf_counter() - self._t0

    def report(self) -> dict[str, Any]:
        if self.compile == "off":
            return {"compile": "off"}
        now = _counters()
        first = self.after_first if self.first_step_s is not None else now
        return {"compile": self.compile, "compile_mode": self.mode,
                "graphs": now[0] - self.at_start[0], "graph_breaks": now[1] - self.at_start[1],
                "recompiles_after_first_step": now[0] - first[0],
                "first_step_seconds": self.first_step_s}
