"""How one non-federated cell of a comparison runs: a registry from a method record's ``runner`` key
(``task.settings.methods``) to the function that runs it. Federated methods run through ``server.protocols`` instead,
batched into one simulation per K; everything here runs in this process.

A runner takes the comparison's :class:`CompareContext` (what every cell of it shares, built once in
``sim.runners.compare.run_compare``) and the :class:`task.settings.runconfig.Cell`, and writes the cell's folder
(results.json, ledger.jsonl, model bundle). ``register_cell_runner`` adds one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from server.selftrain import train_public_models
from server.student import ModelTraining, train_public_model
from task.reporting.bundle import preprocessing_of
from task.learning.compute import Compute
from task.learning.device import device_name, model_device
from task.learning.networks import network_config
from task.settings.methods import Runner
from task.settings.registry import Registry
from task.reporting.results import ModelRelease, RunResults, write_run
from task.settings.runconfig import Cell
from sim.runners.central import CentralConfig, DPSGDOptions, TrainingOptions, run_central
from sim.runners.floors import FloorRun
from sim.runners.selftrain import run_public_selftrain
from task.learning.training import evaluate_release, per_class_of, public_validation_dice
from task.world import build_world, load_world
from task.reporting import trust

if TYPE_CHECKING:
    from task.reporting.realcheck import RealCheck


@dataclass(frozen=True)
class CompareContext:
    """What every cell of one comparison shares: the world (preset, data, seed, where the data's hospitals come
    from), the hospitals' lifetime ledgers and budget, the public model's checkpoint, device and noise."""

    preset_name: str
    preset: object                      # the resolved preset of the comparison's first K
    data: str | None
    seed: int
    delta: float
    hospitals: int | None
    ledger_dir: Path
    lifetime_epsilon: float
    public_checkpoint: Path             # the public model every cell starts from
    reproducible_noise: bool = False
    compute: Compute = Compute()        # device, precision and progress bars of every cell
    where: dict = field(default_factory=dict)   # layout / partition_file
    real_check: RealCheck | None = None   # the real-scan check every released model is scored on (task.reporting.realcheck)

    @property
    def shared_dir(self) -> Path:
        return self.public_checkpoint.parent


CellRunner = Callable[[CompareContext, Cell], None]
_RUNNERS: Registry[CellRunner] = Registry("cell runner")
register_cell_runner, unregister_cell_runner, cell_runner = _RUNNERS.register, _RUNNERS.unregister, _RUNNERS.get


def run_pooled(context: CompareContext, cell: Cell) -> None:
    """Training on the pooled private patients: DP-SGD when the record is private (charged to every hospital's
    lifetime ledger), non-private training otherwise (``sim.runners.central``)."""
    record = cell.record
    private = record.private
    # a method that fixes its own trainable set / learning rate (task.settings.methods.Method) overrides the preset's
    training = TrainingOptions(learning_rate=record.learning_rate,
                               levers={"trainable": record.trainable} if record.trainable is not None else None)
    run_central(CentralConfig(
        method="dp-sgd" if private else "nonprivate", preset=context.preset_name, out=cell.out,
        epsilon=cell.epsilon, delta=context.delta, seed=context.seed, data=context.data,
        hospital_ledger_dir=context.ledger_dir if private else None,
        lifetime_epsilon=context.lifetime_epsilon if private else None, init=cell.init,
        public_model_checkpoint=context.public_checkpoint, hospitals=context.hospitals,
        compute=context.compute, **context.where, training=training, name=record.name,
        dpsgd=DPSGDOptions(reproducible_noise=context.reproducible_noise), real_check=context.real_check))


def run_floor(floor: Callable) -> CellRunner:
    """A public floor's runner: no hospital involved, nothing charged (the seed is not published when it
    drives reproducible noise)."""

    def run(context: CompareContext, cell: Cell) -> None:
        floor(FloorRun(context.preset, Path(cell.out), context.shared_dir, data=context.data, seed=context.seed,
                       publish_seed=not context.reproducible_noise, compute=context.compute, **context.where,
                       real_check=context.real_check))

    return run


def shared_public_models(world, preset, seed: int, shared_dir: Path, compute: Compute):
    """(start model, public-only model) at a comparison's shared checkpoints, trained or loaded: the model every
    cell starts from (``public-model.pt``, self-trained in ``public-model-selftrain/`` where the preset's
    ``public_start`` says so) and the reference-trained public model's continuation on the student's schedule
    (``public-only.pt``, the baseline) -- the same calls ``server.pate`` makes.

    Args:
        world: the comparison's :class:`task.world.PublicWorld` (its public reference maps train both).
        preset: the preset (network, public and student epochs).
        seed: the training seed.
        shared_dir: the folder of both checkpoints (a finished checkpoint is loaded, not retrained).
        compute: where they train (``task.learning.device``), whether forward passes run under bf16, progress bars.
    """
    shared_dir = Path(shared_dir)
    public = train_public_models(world, preset, seed=seed, checkpoint=shared_dir / "public-model.pt", compute=compute)
    init = {k: v.clone() for k, v in public.reference.state_dict().items()}
    public_only = train_public_model(world, preset,
                                     ModelTraining(seed=seed, epochs=preset.student.epochs,
                                                   checkpoint=shared_dir / "public-only.pt", compute=compute),
                                     init=init)
    return public.start, public_only


def run_public_only(run: FloorRun) -> dict:
    """The student trained on the public reference set only (same schedule as PATE's public-only model), in
    ``run.out``; the public model (``public-model.pt``) and this model (``public-only.pt``) are checkpointed in
    ``run.shared_dir`` (:class:`sim.runners.floors.FloorRun`)."""
    started = time.perf_counter()
    preset, seed, out, precision = run.preset, run.seed, run.out, run.compute.precision
    world = load_world(*build_world(preset, run.data, seed, run.compute.progress, **run.where))
    _, model = shared_public_models(world, preset, seed, run.shared_dir, run.compute)
    dice, dice_per_case = evaluate_release(model, world.test_images, world.test_labels,
                                           precision=precision)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ledger.jsonl").touch(mode=0o600)   # no private data: an empty ledger, no privacy cost
    results = RunResults(method="public-only", dice=dice, seed=seed if run.publish_seed else None,
                         device=device_name(model_device(model)), precision=precision)
    results.extras = {"dice_per_case": dice_per_case, "dice_per_case_class": per_class_of(dice_per_case),
                      "reference_cases": len(world.reference_labels),
                      "validation_dice_mean": public_validation_dice(model, world, precision=precision),
                      "aggregation": "none", "who_sees_what": trust.public_only()}
    release = ModelRelease(model, network_config(preset.unet), preprocessing_of(world), world.source,
                           card_extra={"note": "trained on public reference data only: no private data, "
                                               "no privacy cost"})
    return write_run(out, results, release, started=started, real_check=run.real_check)


register_cell_runner(Runner.POOLED, run_pooled)
register_cell_runner(Runner.PUBLIC_ONLY, run_floor(run_public_only))
register_cell_runner(Runner.PUBLIC_SELFTRAIN, run_floor(run_public_selftrain))
