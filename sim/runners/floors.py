"""What one public floor cell of a comparison is asked to do (``public-only``, ``public-selftrain``): the public
data only, no hospital involved, nothing charged (``task.settings.methods``' ``floor`` role)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from task.learning.compute import Compute, check_compute
from task.errors import UserError

if TYPE_CHECKING:
    from task.reporting.realcheck import RealCheck


@dataclass(frozen=True)
class FloorRun:
    """One public floor cell, validated on construction.

    Args:
        preset: the comparison's resolved :class:`task.settings.presets.Preset` (its world, network, schedule and
            ``self_training``).
        out: the cell's folder (results.json, an empty ledger.jsonl, the model bundle).
        shared_dir: where the comparison's public models are checkpointed (``public-model.pt``, ``public-only.pt``),
            shared with its other cells.
        data: an MSD Task01 or BraTS folder (None = the preset's phantoms).
        seed: the world's split and the trainings.
        publish_seed: record the seed in results.json (False when it drives a comparison's reproducible noise).
        layout / partition_file: the data folder's layout (None = detected) and a FeTS partition CSV whose
            partitions are the hospitals (``task.world.build_world``; None = none).
        compute: where the models train and are evaluated, at which forward-pass precision, and progress bars.
        real_check: the real-scan check the released model is scored on (``task.reporting.realcheck.RealCheck``; None: none).
    """

    preset: Any
    out: Path
    shared_dir: Path
    data: str | None = None
    seed: int = 0
    publish_seed: bool = True
    layout: str | None = None
    partition_file: str | None = None
    compute: Compute = Compute()
    real_check: RealCheck | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "shared_dir", Path(self.shared_dir))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"--seed: expected a whole number >= 0, got {self.seed!r}")
        check_compute(self.compute)

    @property
    def where(self) -> dict[str, str | None]:
        """The data folder's layout and partition file (``task.world.build_world``'s options)."""
        return {"layout": self.layout, "partition_file": self.partition_file}
