"""Where and how a run computes: one frozen record every run configuration composes.

A run's device, forward-pass precision, worker processes and progress bars say nothing about *what* it
computes -- a fixed seed gives the same results whatever they are (``tests/test_device.py`` measures how far
bf16 moves them) -- so they live here once, not in every configuration. :class:`Compute` checks the device
*spec* only (``task.learning.device.check_device_spec``: pure string work, no torch, so that the command line's start-up
stays free of it); every party resolves it where it runs (``task.learning.device.resolve_device``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from task.learning.device import check_device_spec, check_precision
from task.errors import UserError
from task.options import Precision


@dataclass(frozen=True)
class Compute:
    """How a run computes, validated on construction.

    Args:
        device: where models train and predict: ``auto`` (CUDA when the process that resolves it sees one), ``cpu``,
            ``cuda`` or ``cuda:N``; a ``torch.device`` or None is accepted and kept as its spec string.
        precision: forward-pass precision (:class:`task.options.Precision`: ``32`` or ``bf16`` autocast).
        workers: processes that run cells at once (``sim.runners.compare.run_in_workers``; 1 = this process).
        progress: progress bars.
    """

    device: str = "auto"
    precision: Precision = Precision.FP32
    workers: int = 1
    progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", check_device_spec(self.device, "--device"))
        object.__setattr__(self, "precision", check_precision(self.precision, "--precision"))
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise UserError(f"--workers: expected a whole number >= 1, got {self.workers!r}")
        if not isinstance(self.progress, bool):
            raise UserError(f"--no-progress: expected true or false, got {self.progress!r}")

    def replace(self, **changes: Any) -> "Compute":
        return dataclasses.replace(self, **changes)


#: the defaults: auto device, float32, one worker, progress bars
DEFAULT_COMPUTE = Compute()


def check_compute(value: Any) -> Compute:
    """``value`` if it is a :class:`Compute` (what every run configuration's ``compute`` field must hold), else a
    one-line UserError naming its type."""
    if not isinstance(value, Compute):
        raise UserError(f"compute: expected a task.learning.compute.Compute, got {type(value).__name__}")
    return value
