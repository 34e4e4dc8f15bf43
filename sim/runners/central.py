"""Centralised baselines on the pooled private data: non-private training and DP-SGD.

The pooled data are every hospital's teacher partitions together (the ``Split``'s private part): the
upper bound that no federation can beat (non-private) and the seed paper's DP-SGD baseline (Fay et al.
Sec. 5: same U-Net, per-layer clipping at 4, sigma^2 = 6, epsilon = 8,
delta = 1e-3). Privacy unit: one patient volume; DP-SGD with Poisson sampling (or zCDP for shuffled batches,
Yu et al.) under ``relation`` -- replace-one by default, since results publish ``train_cases`` (docs/PRIVACY.md;
add-remove for Poisson / zero-out for shuffle on request). Every epoch is charged to every hospital whose
patients are pooled (the owners of the data: a patient's guarantee is this run's ε), and, in a comparison,
also to each hospital's own lifetime ledger (``hospital_ledger_dir``) through a
:class:`privacy.guard.GuardChain`. results.json states the relation from the ledger and the same run's
epsilon under the other relation where it is defined (``epsilon_add_remove`` / ``epsilon_replace_one``).

Writes, in ``out``: ``results.json`` (docs/PRIVACY.md "Results", every field present, null where it does not apply),
``ledger.jsonl`` (empty for non-private training), the model bundle (``model/weights.pt``,
``bundle.json``, card; see ``task.reporting.bundle``; the only copy of the weights, covered by its digest) and
``checkpoint/train.pt`` (resumed when the run is restarted in the same folder with the same settings, which
``central.json`` records; other settings are refused, :func:`record_central_settings`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from privacy.errors import BudgetExceeded
from privacy.guard import BudgetGuard, GuardChain
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from server.selftrain import start_description, train_public_models
from task.learning.dpsgd import (DEFAULT_GRAD_SAMPLE_MODE, DPConfig, check_first_epoch, epoch_plan, private_training,
                                 steps_per_epoch)
from task.learning.compute import Compute, check_compute
from task.learning.device import device_name, resolve_device
from task.errors import UserError
from task.io import atomic_write_bytes, atomic_write_json
from task.learning import accounting
from task.learning.phases import phase
from task.settings import methods as registered_methods
from task.settings.methods import CENTRAL_METHODS
from task.learning.networks import build_unet, network_config, network_config_of
from task.options import CentralMethod, Init, NoiseKind, NoiseMode, Relation, Sampling, Selection, look_up_option
from task.settings.presets import DpSetting, Preset, get_preset, preset_reference
from sim.runners.resume import refuse_other_settings
from task.reporting.results import ModelRelease, RunResults, write_run
from task.learning.selection import (SelectionBudget, SelectionCallbacks, SelectionConfig, run_private_selection,
                                     split_and_plan, stamp_one_time)
from task.learning.training import (LEVER_KEYS, TrainConfig, TrainResult, evaluate_release, evaluate_segmentation,
                                    evaluate_segmentation_per_case, lever_settings, per_class_of, train_segmentation,
                                    trainable_of)
from task.world import build_world, load_world, pooled_private_data
from task.reporting import trust

METHODS = CENTRAL_METHODS

if TYPE_CHECKING:
    from task.reporting.realcheck import RealCheck


def load_central_data(preset, seed: int = 0, data: str | Path | None = None, progress: bool = True,
                      **world) -> dict[str, Any]:
    """The federated runs' world (task.world.build_world: one phantom generation, one split, one test set),
    its hospitals' partitions pooled (task.world.pooled_private_data). ``world``: build_world's ``hospitals``,
    ``layout`` and ``partition_file`` (with a partition file the hospital count decides which patients exist)."""
    if data is not None and not Path(data).exists():
        raise UserError(f"--data: {data} does not exist (expected an MSD Task01 or BraTS folder)")
    prepared, split = build_world(preset, data, seed, progress, **world)
    return pooled_private_data(prepared, split, Path(data) if data else None)


@dataclass(frozen=True)
class TrainingOptions:
    """Training settings fixed by the caller; None = the preset's (for DP-SGD: the preset's ``dpsgd_grid``,
    chosen on public validation). Every explicit setting is fixed for every grid entry.

    Args:
        epochs: training epochs (the preset's ``central_epochs``).
        batch_size: (expected, under Poisson sampling) batch size -- DP-SGD needs larger expected batches
            than plain training: the noise is added once per batch (the preset's ``dpsgd_batch_size``).
        learning_rate: Adam's learning rate.
        max_grad_norm: DP-SGD's clipping norm (ignored by non-private training).
        augment: train with the world's augmentation (``sim.transforms``).
        levers: the DP fine-tuning levers, ``task.learning.training.LEVER_KEYS`` (``trainable``,
            ``augmentation_multiplicity``, ``ema_decay``); None values are the defaults.
    """

    epochs: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    max_grad_norm: float | None = None
    augment: bool = True
    levers: Mapping[str, Any] | None = None

    def explicit(self) -> dict:
        """The settings a grid entry may not change (:class:`task.settings.presets.DpSetting`'s; None = not given)."""
        return {"learning_rate": self.learning_rate, "max_grad_norm": self.max_grad_norm, "epochs": self.epochs,
                "batch_size": self.batch_size,
                **{k: v for k, v in (self.levers or {}).items() if k in LEVER_KEYS}}


@dataclass(frozen=True)
class DPSGDOptions:
    """How DP-SGD releases (ignored by non-private training): the command line's options of one pooled run.

    Layer: the CLI's options, checked on the command line before any work; None = the preset's recipe
    (``task.settings.presets.DpSgd``). Each grid entry's training runs the validated record ``task.learning.dpsgd.DPConfig`` that
    :func:`_dp_config` builds from these options, the preset and the entry.

    Args:
        noise_mode: ``target`` (sigma calibrated to the budget for the planned epochs), ``fixed`` (the
            preset's sigma until the budget is spent) or ``schedule`` (a decaying noise schedule, Yu et al.).
        schedule: the schedule for ``noise_mode="schedule"`` (``privacy.schedules``).
        schedule_options: that schedule's parameters.
        sampling: ``poisson`` (PLD/RDP accounting) or ``shuffle`` (disjoint batches, zCDP).
        noise_multiplier: sigma for ``fixed`` mode / sigma_0 for schedules (the preset's, sqrt 6).
        per_layer: clip each layer's per-sample gradient (Fay et al.; None = the preset's) or the whole one.
        grad_sample_mode: Opacus' per-sample gradient engine (None = the benchmarked fastest).
        relation: the neighbouring relation of the guarantee -- ``replace-one`` (default; the only one that
            holds when dataset sizes are published), ``add-remove`` (Poisson) or ``zero-out`` (shuffle).
        reproducible_noise: simulation only -- noise and batches seeded by the run's seed, which is then
            left out of results.json. Default: secure noise.
    """

    noise_mode: NoiseMode = NoiseMode.TARGET
    schedule: str | None = None
    schedule_options: Mapping[str, Any] | None = None
    sampling: Sampling = Sampling.POISSON
    noise_multiplier: float | None = None
    per_layer: bool | None = None
    grad_sample_mode: str | None = None
    relation: Relation = Relation.REPLACE_ONE
    reproducible_noise: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_mode", look_up_option(self.noise_mode, NoiseMode, "--noise-mode"))
        object.__setattr__(self, "sampling", look_up_option(self.sampling, Sampling, "--sampling"))
        object.__setattr__(self, "relation", look_up_option(self.relation, Relation, "--relation"))


@dataclass(frozen=True)
class CentralConfig:
    """One run on the pooled private data: what it trains, on which world, under which budget.

    Args:
        method: ``nonprivate`` or ``dp-sgd`` (``task.settings.methods.CENTRAL_METHODS``).
        preset: the preset: a registered name, a variant's :attr:`task.settings.presets.Preset.reference`, or a
            :class:`task.settings.presets.Preset` (kept as its reference).
        out: the run folder (results.json, ledger.jsonl, model/, checkpoint/ while it runs).
        epsilon: DP-SGD's budget (None = the preset's); ``delta`` likewise.
        seed: the world's split, the public model and the training; the noise only under
            ``dpsgd.reproducible_noise``.
        data: an MSD Task01 or BraTS folder (None = the embedded phantoms); ``hospitals``, ``layout`` and
            ``partition_file`` shape its world (``task.world.build_world``; None = as the preset says).
        init: ``public`` -- start from the public model (trained on the public reference set, as PATE's
            teachers and student; shared through ``public_model_checkpoint`` in a comparison) -- or
            ``scratch`` (random weights; the seed paper's DP-SGD baseline).
        hospital_ledger_dir / lifetime_epsilon: the hospitals' own ledgers of a comparison
            (``<dir>/<hospital>.jsonl``) and their lifetime budget: every epoch is also charged there, and
            refused when a hospital's lifetime budget would be exceeded.
        compute: where the models train and are evaluated (auto = CUDA when there is one; ``task.learning.device``),
            whether forward passes run under bf16 autocast (both are recorded), and progress bars.
        training: settings fixed by the caller (:class:`TrainingOptions`).
        dpsgd: how DP-SGD releases (:class:`DPSGDOptions`).
        selection: how DP-SGD's setting is chosen: ``public`` (default) -- the preset's grid,
            each entry trained and charged, best on the public validation set; ``private`` -- private selection
            among the grid and the public model unchanged on held-out private patients, charged as one event up
            front (``task.learning.selection``; target mode, Poisson sampling, replace-one, init public).
        selection_config: private selection's settings (``task.learning.selection.SelectionConfig``; None = defaults).
        name: the method its results, model card and noise streams carry: a registered pooled method of the same
            privacy (``task.settings.methods``; e.g. ``dp-sgd-central-decoder``); None = ``CENTRAL_METHODS[method]``.
        real_check: the real-scan check the released model is scored on (``task.reporting.realcheck.RealCheck``; None: none).
    """

    method: CentralMethod = CentralMethod.NONPRIVATE
    preset: str | Preset = "quick"
    out: str | Path = "runs/central"
    epsilon: float | None = None
    delta: float | None = None
    seed: int = 0
    data: str | Path | None = None
    init: Init = Init.PUBLIC
    public_model_checkpoint: str | Path | None = None
    hospital_ledger_dir: str | Path | None = None
    lifetime_epsilon: float | None = None
    hospitals: int | None = None
    layout: str | None = None
    partition_file: str | None = None
    compute: Compute = Compute()
    training: TrainingOptions = TrainingOptions()
    dpsgd: DPSGDOptions = DPSGDOptions()
    selection: Selection = Selection.PUBLIC
    selection_config: SelectionConfig | None = None
    name: str | None = None
    real_check: RealCheck | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "preset", preset_reference(self.preset))
        object.__setattr__(self, "selection", look_up_option(self.selection, Selection, "--selection"))
        if self.selection is Selection.PRIVATE and (self.dpsgd.noise_mode is not NoiseMode.TARGET
                                                    or self.dpsgd.sampling is not Sampling.POISSON
                                                    or self.init != Init.PUBLIC):
            raise UserError("--selection private: needs --noise-mode target, --sampling poisson and --init public")
        if self.selection is Selection.PRIVATE and self.hospital_ledger_dir is not None:
            # a hospital's lifetime ledger would hold PLD-only replace-one DP-SGD epochs beside an RDP-only
            # selection event: no accountant composes both (task/learning/selection.py)
            raise UserError("--selection private: runs on its own (fedpate central), not inside a comparison's "
                            "hospital ledgers")
        object.__setattr__(self, "method", look_up_option(self.method, CentralMethod, "--method"))
        object.__setattr__(self, "init", look_up_option(self.init, Init, "--init"))
        if self.name is not None:
            record = registered_methods.method(self.name) if self.name in registered_methods.names() else None
            if record is None or record.runner != registered_methods.Runner.POOLED or record.private != self.private:
                raise UserError(f"method name {self.name!r}: not a registered pooled "
                                f"{'private' if self.private else 'non-private'} method")
        self.validate()

    def validate(self) -> None:
        """Refuse every setting the run could only refuse later -- after building the world, training the public
        model, or charging the ledger -- naming the command-line flag that sets it. Runs when the config is made,
        so nothing is computed, written or charged for a run that cannot happen."""
        _check_number("--epsilon", self.epsilon, positive=True)
        _check_number("--delta", self.delta, low=0.0, high=1.0, closed_low=False, closed_high=False)
        _check_integer("--seed", self.seed, low=0)
        check_compute(self.compute)
        if self.data is not None and not Path(self.data).exists():
            raise UserError(f"--data: {self.data} does not exist (expected an MSD Task01 or BraTS folder)")
        if self.lifetime_epsilon is not None:
            _check_number("--lifetime-epsilon", self.lifetime_epsilon, positive=True)
        training = self.training
        # zero epochs releases the starting model (the public one under --init public): harmless without DP;
        # DP-SGD needs at least one step to calibrate its noise
        _check_integer("--epochs", training.epochs, low=1 if self.private else 0)
        _check_integer("--batch-size", training.batch_size, low=1)
        _check_number("--learning-rate", training.learning_rate, positive=True)
        _check_number("--max-grad-norm", training.max_grad_norm, positive=True)
        levers = dict(training.levers or {})
        _check_integer("--augmentation-multiplicity", levers.get("augmentation_multiplicity"), low=1)
        _check_number("--ema-decay", levers.get("ema_decay"), low=0.0, high=1.0, closed_high=False)
        _check_number("--noise-multiplier", self.dpsgd.noise_multiplier, positive=True)
        if self.selection is Selection.PRIVATE:
            (self.selection_config or SelectionConfig()).validate()
        try:
            preset = get_preset(self.preset)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        if self.private:   # the DP-SGD configuration each grid entry will run, checked as it will be built
            epsilon = float(self.epsilon if self.epsilon is not None else preset.epsilon)
            delta = float(self.delta if self.delta is not None else preset.delta)
            grid = self.dpsgd.noise_mode is NoiseMode.TARGET and self.dpsgd.sampling is Sampling.POISSON
            for setting in settings_grid(preset, True, self.training.explicit(), grid=grid):
                _dp_config(preset, self.dpsgd, epsilon, delta, setting, None)

    @classmethod
    def of(cls, **options) -> "CentralConfig":
        """A config from flat keyword options (scripts, tests): the fields of :class:`TrainingOptions`,
        :class:`DPSGDOptions` and :class:`task.learning.compute.Compute` go to ``training`` / ``dpsgd`` / ``compute``, the
        rest are this class's own."""
        groups = {name: {k: options.pop(k) for k in [f.name for f in dataclasses.fields(kind)] if k in options}
                  for name, kind in (("training", TrainingOptions), ("dpsgd", DPSGDOptions), ("compute", Compute))}
        return cls(**options, training=TrainingOptions(**groups["training"]), dpsgd=DPSGDOptions(**groups["dpsgd"]),
                   compute=Compute(**groups["compute"]))

    @property
    def private(self) -> bool:
        return self.method is CentralMethod.DP_SGD

    @property
    def method_name(self) -> str:
        """The method this run is (``results.json``'s ``method``)."""
        return self.name if self.name is not None else METHODS[self.method]

    @property
    def selects_privately(self) -> bool:
        """DP-SGD's setting is chosen by private selection (``task.learning.selection``), charged as one event."""
        return self.private and self.selection is Selection.PRIVATE

    @property
    def where(self) -> dict:
        """build_world's options that were given: a run without them builds its world exactly as before."""
        return {k: v for k, v in (("hospitals", self.hospitals), ("layout", self.layout),
                                  ("partition_file", self.partition_file)) if v is not None}


@dataclass(frozen=True)
class PooledRun:
    """One run on the pooled private data, resolved before anything trains (:func:`prepare_run`); the steps of
    :func:`run_central` share it.

    Args:
        config: the run's :class:`CentralConfig`.
        preset: the resolved preset.
        out: the run folder.
        epsilon / delta: the budget (the config's, else the preset's).
        device / precision: where models train and are evaluated (``task.learning.device``).
        world: the pooled world (:func:`load_central_data`).
        settings: the training settings to try (:func:`settings_grid`).
        grid_sigma: the one noise multiplier a DP-SGD grid's entries share (None: a single entry calibrates its
            own, private selection calibrates one for its event, or no DP-SGD).
        start_weights: the public model's weights under ``--init public`` (None: random weights).
        ledger: the run's ledger (empty for non-private training).
        guard: the ledger's budget guard, beside the hospitals' lifetime ledgers in a comparison (None for
            non-private training).
        prefix: the run's release-id prefix (:func:`_release_prefix`; None for non-private training).
        noise: the run's noise source (secure unless reproducible noise was asked for).
    """

    config: CentralConfig
    preset: Preset
    out: Path
    epsilon: float
    delta: float
    device: Any
    precision: str
    world: dict
    settings: list
    grid_sigma: float | None
    start_weights: dict | None
    ledger: Ledger
    guard: Any
    prefix: str | None
    noise: NoiseSource

    def __post_init__(self) -> None:
        if not self.settings:
            raise ValueError("PooledRun: no training setting to try")
        if self.config.private and (self.guard is None or self.prefix is None):
            raise ValueError("PooledRun: DP-SGD needs the run's budget guard and release-id prefix")

    @property
    def compute(self) -> Compute:
        """The config's compute context with the device resolved: what each of the run's trainings is given."""
        return self.config.compute.replace(device=str(self.device), precision=self.precision)


def run_central(config: CentralConfig) -> dict[str, Any]:
    """Train on the pooled private data, evaluate on the test split, write the run folder; return results.

    DP-SGD settings grid: unless a setting is given explicitly, DP-SGD in ``target`` noise mode
    trains one model per entry of the preset's ``dpsgd_grid`` (learning rate, clipping norm, expected batch,
    epochs), all with one noise multiplier calibrated so that the G trainings *together* spend the budget
    (``privacy.calibration.composed_dpsgd_noise_multiplier``), and keeps the one with the best Dice on the
    public validation set (post-processing: it reads no private label and no test case). The ledger holds
    every epoch of every grid entry, so its ε is the budget. DP-SGD's noise is drawn on the host
    (``task.learning.dpsgd``) whatever ``config.compute.device`` is.

    Steps: :func:`prepare_run` (everything refused before anything trains), :func:`_train_grid` or
    :func:`private_selection`, then the chosen model evaluated on the test split and written.
    """
    started = time.perf_counter()
    run = prepare_run(config)
    selected = None
    if config.selects_privately:   # task.learning.selection, charged as one event before anything is trained
        selected, dp = private_selection(run)
        candidates = [(selected.setting or _PUBLIC_SETTING, selected.result or _public_result(selected.model), None)]
    else:
        candidates, dp = _train_grid(run)
        if config.private and not any(result.epochs_completed for _, result, _ in candidates):
            # the start model, uncharged, would ship as DP-SGD's (its card: no privacy, may memorise its patients)
            reasons = sorted({str(result.stopped_reason) for _, result, _ in candidates if result.stopped_reason})
            raise BudgetExceeded(f"{config.method_name}: no epoch fitted the budget ({'; '.join(reasons) or 'none'}); "
                                 f"nothing was trained and no model is written to {run.out}")
    chosen = choose_setting(candidates)
    result = candidates[chosen][1]
    model = result.model
    net_cfg = network_config_of(model, run.preset.unet)   # the released network: with a voxel head if it has one
    dice, dice_per_case = evaluate_release(model, run.world["test_images"], run.world["test_labels"],
                                           device=run.device, precision=run.precision)
    results = _run_results(run, dice, result, selected)
    results.extras = _extras(run, candidates, chosen, selected, dp, dice_per_case)
    preprocessing = {"grid": list(run.preset.grid), "config": _config_dict(run.world["config"])}
    card = {"start": results.extras["start"], "settings": results.extras["setting_selection"]}
    # private selection: how long the run took tells how many repetitions it made, and the guarantee covers
    # releasing the best of a *secret* number of runs (Papernot & Steinke): no wall time in the release
    written = write_run(run.out, results,
                        ModelRelease(model, net_cfg, preprocessing, run.world["source"], card_extra=card),
                        started=None if selected is not None else started, real_check=config.real_check)
    # the checkpoints were only needed to resume; a finished run keeps its results, model bundle and ledger
    # (and the ledger without a checkpoint marks the folder as finished: see _refuse_finished_folder); so was its
    # own public model's (a comparison's shared one stays: its other cells start from it)
    shutil.rmtree(run.out / "checkpoint", ignore_errors=True)
    if config.public_model_checkpoint is None:
        own = run.out / "public-model.pt"
        own.unlink(missing_ok=True)
        shutil.rmtree(own.with_name(own.stem + "-selftrain"), ignore_errors=True)
    if selected is not None:   # and no file time either: the ledger's and the public model's would date the start
        stamp_one_time(run.out)
    return written


def prepare_run(config: CentralConfig) -> PooledRun:
    """Everything a run needs before it trains, in the order that refuses early: the device, the preset and the
    budget; the folder (a finished run's is refused, an earlier start's must have had the same settings); the world
    and the settings to try; what needs only the data's sizes (a budget that cannot be met is refused before the
    public model is trained or anything is written to --out); then the start model, the ledger and the noise."""
    device = resolve_device(config.compute.device)   # a GPU asked for and missing: refused before any data is touched
    precision = config.compute.precision
    try:
        p = get_preset(config.preset)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    out = Path(config.out)
    seed, dpsgd = config.seed, config.dpsgd
    epsilon = float(config.epsilon if config.epsilon is not None else p.epsilon)
    delta = float(config.delta if config.delta is not None else p.delta)
    _refuse_finished_folder(out)
    # what this folder already holds (a checkpoint, the public model) is resumed only with the same settings
    record_central_settings(config, out, p.reference, epsilon, delta)

    torch.manual_seed(seed)
    with phase("data"):
        world = load_central_data(p, seed=seed, data=config.data, progress=config.compute.progress, **config.where)
    # the grid needs one sigma for all its runs: Poisson sampling in target mode (PLD composition)
    settings = settings_grid(p, config.private, config.training.explicit(),
                             grid=(config.private and dpsgd.noise_mode is NoiseMode.TARGET
                                   and dpsgd.sampling is Sampling.POISSON))
    grid_sigma = _plan_budget(config, world, settings, epsilon, delta)
    out.mkdir(parents=True, exist_ok=True)
    start_weights = None
    if config.init is Init.PUBLIC:
        with phase("public model"):
            start_weights = public_start(p, seed=seed, data=config.data, progress=config.compute.progress,
                                         checkpoint=config.public_model_checkpoint or out / "public-model.pt",
                                         device=device, precision=precision, **config.where)
    ledger, guard = _open_ledger(config, out / "ledger.jsonl", world["hospital_ids"], epsilon, delta)
    prefix = _release_prefix(out / "ledger.jsonl") if config.private else None
    noise = (NoiseSource.reproducible(seed) if dpsgd.reproducible_noise else NoiseSource()).child(
        config.method_name, f"eps-{epsilon:g}")
    return PooledRun(config=config, preset=p, out=out, epsilon=epsilon, delta=delta, device=device,
                     precision=precision, world=world, settings=settings, grid_sigma=grid_sigma,
                     start_weights=start_weights, ledger=ledger, guard=guard, prefix=prefix, noise=noise)


def _refuse_finished_folder(out: Path) -> None:
    """A ledger without a checkpoint is a finished (or never-started) earlier run: training again from scratch
    would be a second release of the same data that its release ids would hide."""
    ledger_path = out / "ledger.jsonl"
    if ledger_path.exists() and ledger_path.stat().st_size > 0 and not any((out / "checkpoint").glob("*.pt")):
        raise UserError(f"--out {out}: already holds {ledger_path.name} from an earlier run; use a new folder")


def _plan_budget(config: CentralConfig, world: dict, settings: list[dict], epsilon: float,
                 delta: float) -> float | None:
    """What needs only the data's sizes, planned before anything is trained: the one sigma of a DP-SGD grid, whose
    G trainings together spend the budget (returned; None without such a grid), or private selection's plan
    (refused here when the budget cannot be met)."""
    if not config.private:
        return None
    relation = config.dpsgd.relation
    preset = get_preset(config.preset)
    for setting in settings:   # fixed or scheduled noise: the first epoch must fit, or nothing would be trained
        check_first_epoch(_dp_config(preset, config.dpsgd, epsilon, delta, setting, None),
                          len(world["train_ids"]), setting["batch_size"])
    if config.selects_privately:
        split_and_plan(settings, len(world["train_images"]), epsilon, delta, relation, config.seed,
                       config.selection_config or SelectionConfig(), steps_per_epoch)
        return None
    if len(settings) == 1:
        return None
    n = len(world["train_ids"])
    # memoised on disk (task.learning.accounting): the guard composes the grid's plan once anyway (_train_grid)
    return accounting.composed_dpsgd_noise_multiplier(
        epsilon, delta, [(1.0 / steps_per_epoch(n, s["batch_size"]), steps_per_epoch(n, s["batch_size"]) * s["epochs"])
                         for s in settings],
        relation=relation)


def _open_ledger(config: CentralConfig, ledger_path: Path, hospital_ids, epsilon: float, delta: float):
    """(the run's ledger, its budget guard): for DP-SGD the guard charges every pooled hospital (and their lifetime
    ledgers in a comparison); non-private training gets an empty ledger and no guard."""
    # private selection: its one record carries no time (it would date the start of the secret repetitions)
    ledger = Ledger(ledger_path, timestamps=not config.selects_privately)
    if config.private:
        return ledger, _pooled_guard(ledger, epsilon, delta, hospital_ids, config)
    # non-private: an empty ledger (nothing was released privately), owner-only as every ledger
    atomic_write_bytes(ledger_path, b"", private=True)
    return ledger, None


def _train_grid(run: PooledRun) -> tuple[list, DPConfig | None]:
    """Every setting to try trained from the run's start (DP-SGD's epochs charged through the guard; each entry
    with its own checkpoint and noise stream) and scored on the public validation set. Returns the candidates
    ``(setting, TrainResult, validation Dice)`` and the last entry's DPConfig (None without DP-SGD)."""
    config, p, settings, world = run.config, run.preset, run.settings, run.world
    candidates, dp = [], None
    if config.private and run.grid_sigma is not None:
        # the grid's calibrated plan (every entry's epochs at the one sigma, in order), composed once by the run's
        # guard: the epochs that follow it are then charged without a composition each (BudgetGuard.expect)
        n = len(world["train_ids"])
        plan = [event for index, setting in enumerate(settings) for event in epoch_plan(
            _dp_config(p, config.dpsgd, run.epsilon, run.delta, setting, run.grid_sigma, release_prefix="plan"),
            n, setting["batch_size"], setting["epochs"], run.grid_sigma)]
        run.guard.expect(tuple(world["hospital_ids"]), plan)
    for index, setting in enumerate(settings):
        tag = "" if len(settings) == 1 else f":setting-{index}"
        train_config = _setting_training(
            config, setting, run.start_weights, run.compute,
            checkpoint=run.out / "checkpoint" / ("train.pt" if len(settings) == 1 else f"setting-{index}.pt"),
            description=config.method_name + (f" setting {index + 1}/{len(settings)}" if tag else ""),
            extra_checkpoint={"network_config": network_config(p.unet, trainable=trainable_of(setting))})
        if config.private:
            dp = _dp_config(p, config.dpsgd, run.epsilon, run.delta, setting, run.grid_sigma,
                            release_prefix=run.prefix + tag, stream_prefix="central-dpsgd" + tag)
        torch.manual_seed(config.seed)
        result = train_segmentation(build_unet(p.unet, trainable=trainable_of(setting)), world["train_images"],
                                    world["train_labels"], train_config,
                                    private_training(dp, run.guard, owners=tuple(world["hospital_ids"]),
                                                     noise=run.noise.child(f"setting-{index}") if tag else run.noise),
                                    validation=world["validation"])
        validation_dice = None
        last = result.history[-1] if result.history else {}
        if world["validation"] is not None and setting.get("ema_decay") is None and "validation_dice_mean" in last:
            # the training scored this very model on the same set after its last epoch: scored once, not twice
            validation_dice = last["validation_dice_mean"]
        elif world["validation"] is not None:   # public: the only data a choice of setting may look at
            validation_dice = evaluate_segmentation(result.model, *world["validation"], device=run.device,
                                                    precision=run.precision).get("mean")
        candidates.append((setting, result, validation_dice))
    return candidates, dp


def _run_results(run: PooledRun, dice: dict, result: TrainResult, selected) -> RunResults:
    """The results record's own fields: the method, Dice, the hospitals, where it ran and, for DP-SGD, the ledger's
    ε (the worst owner's; here all owners alike), the budget and the released model's noise multiplier."""
    config, dpsgd = run.config, run.config.dpsgd
    results = RunResults(method=config.method_name, dice=dice, hospitals=run.world["hospitals"],
                         # under reproducible noise the seed also drives the other cells' noise: never published
                         seed=None if dpsgd.reproducible_noise else config.seed,
                         device=device_name(run.device), precision=run.precision)
    if config.private:   # the epsilon written anywhere is the ledger's (the worst owner; here all owners alike)
        results.account(run.ledger, run.delta, relation=dpsgd.relation)
        results.epsilon_budget = run.epsilon
        results.sigma = result.sigmas[0] if result.sigmas else None
        if selected is not None:
            results.sigma = selected.info["dpsgd_noise_multiplier"]
    return results


def _extras(run: PooledRun, candidates: list, chosen: int, selected, dp: DPConfig | None,
            dice_per_case) -> dict:
    """results.json's ``extras`` of a central run: the data, the start, the settings tried and chosen, the released
    training's DP-SGD record and the public validation Dice."""
    config, p, world = run.config, run.preset, run.world
    private = config.private
    setting, result, validation_dice = candidates[chosen]
    return {
        "dice_per_case": dice_per_case,
        "dice_per_case_class": per_class_of(dice_per_case),
        **(run.noise.describe() if private else {}),
        "preset": p.reference,
        "grid": list(p.grid),
        "privacy_unit": "one patient volume (pooled from all hospitals' private partitions)",
        "train_cases": len(world["train_ids"]),
        "test_cases": len(world["test_ids"]),
        "init": config.init,
        "start": (start_description(p)
                  if config.init is Init.PUBLIC else "random weights"),
        "settings_grid": [dict(s) for s in run.settings],
        "settings_validation_dice": [v for _, _, v in candidates],
        "setting_chosen": selected.info["chosen"] if selected is not None else chosen,
        **({"selection": selected.info} if selected is not None else {}),
        "setting_selection": (selected.info["mechanism"] if selected is not None else
                              "best Dice on the public validation set among the grid, every grid entry trained "
                              "on the private data and charged to the ledger" if len(candidates) > 1 else
                              "one setting (the preset's, or given explicitly)"),
        "learning_rate": setting["learning_rate"], "batch_size": setting["batch_size"],
        "epochs_planned": setting["epochs"],
        "epochs_completed": result.epochs_completed,
        # the training loss is an un-noised statistic of the private data: only non-private runs have the key
        **({} if private else {"final_loss": result.history[-1]["loss"] if result.history else None}),
        "epsilon_rdp": result.epsilon_rdp if private else None,
        "dpsgd": None if not private or dp is None else {
            "noise_mode": dp.mode, "schedule": dp.schedule, "sampling": dp.sampling,
            "sigmas": result.sigmas, "max_grad_norm": setting.get("max_grad_norm"), "per_layer": dp.per_layer,
            "sampling_rate": result.sampling_rate, "steps_per_epoch": result.steps_per_epoch,
            "grad_sample_mode": dp.grad_sample_mode, "stopped_reason": result.stopped_reason,
            "adaptive": result.adaptive,
        },
        "data_source": world["source"],
        "aggregation": "pooled", "who_sees_what": trust.pooled(private),
        # DP-SGD's wall time grows with its Poisson batch sizes, the sampling's secret randomness: a simulation
        # diagnostic the guarantee does not cover (private selection writes no wall time at all)
        **({"not_private_diagnostics": ["wall_seconds"]} if private and selected is None else {}),
        # public validation Dice: what model selection may look at (never the test set)
        "validation_dice_mean": validation_dice,
    }


_PUBLIC_SETTING = {"learning_rate": None, "max_grad_norm": None, "batch_size": None, "epochs": 0}


def _public_result(model):
    return TrainResult(model=model, history=[])


def private_selection(run: PooledRun) -> tuple[Any, DPConfig | None]:
    """The torch side of ``task.learning.selection.run_private_selection`` for the pooled baseline: each candidate is
    fine-tuned from the public model (``run.start_weights``, also a candidate itself) with DP-SGD at the
    calibrated multiplier (fixed mode, no checkpoint: a selection is never resumed, its ledger marks the folder as
    used), steps checked by the CoveredGuard, on ``run.device``. Charged through ``run.guard`` under the run's
    budget, release-id prefix and noise source. Returns (Selected, the DPConfig of the released candidate's
    training; None when the public model was released)."""
    config, p, world, seed = run.config, run.preset, run.world, run.config.seed

    def dp_config(setting, rep, z, release_prefix):
        return _dp_config(p, dataclasses.replace(config.dpsgd, noise_mode=NoiseMode.FIXED, noise_multiplier=z),
                          run.epsilon, run.delta, setting, None, release_prefix=release_prefix,
                          stream_prefix=f"central-dpsgd:selection:rep-{rep}")

    def public_model():
        model = build_unet(p.unet)
        model.load_state_dict(run.start_weights)
        return model

    def train_candidate(setting, index, rep, images, labels, z, covered, stream):
        dp = dp_config(setting, rep, z, f"{run.prefix}:selection:rep-{rep}")
        # no bar of its own: task.learning.selection shows one bar for the whole selection (a bar per candidate would
        # count the repetitions and name the candidates drawn)
        train_config = _setting_training(config, setting, run.start_weights, run.compute.replace(progress=False),
                                         checkpoint=None, description="private selection")
        torch.manual_seed(seed)
        return train_segmentation(build_unet(p.unet, trainable=trainable_of(setting)), images, labels, train_config,
                                  private_training(dp, covered, owners=tuple(world["hospital_ids"]), noise=stream),
                                  validation=world["validation"])

    def per_case(model, images, labels):
        return evaluate_segmentation_per_case(model, images, labels, device=run.device, precision=run.precision)[1]

    selected = run_private_selection(
        run.settings, world["train_images"], world["train_labels"],
        budget=SelectionBudget(guard=run.guard, owners=tuple(world["hospital_ids"]), release_prefix=run.prefix,
                               noise=run.noise, epsilon=run.epsilon, delta=run.delta,
                               relation=config.dpsgd.relation),
        seed=seed, config=config.selection_config or SelectionConfig(),
        callbacks=SelectionCallbacks(public_model=public_model, train_candidate=train_candidate,
                                     evaluate_per_case=per_case, steps_per_epoch=steps_per_epoch),
        progress=config.compute.progress)
    # the released model's own DP-SGD configuration, and none when the public model was released: whether some
    # other candidate was trained on the way is not part of the release
    if selected.setting is None:
        return selected, None
    return selected, dp_config(selected.setting, 0, selected.info["dpsgd_noise_multiplier"], run.prefix)


def _setting_training(config: CentralConfig, setting: dict, start_weights, compute: Compute, **run) -> TrainConfig:
    """One grid entry's training (its epochs, batch, learning rate and levers) from the run's start, computed as
    ``compute`` says; ``run``: its checkpoint, progress description and checkpoint extras."""
    return TrainConfig(epochs=setting["epochs"], batch_size=setting["batch_size"],
                       learning_rate=setting["learning_rate"], seed=config.seed, augment=config.training.augment,
                       init_from=start_weights, compute=compute,
                       **lever_settings(setting), **run)


def _pooled_guard(ledger: Ledger, epsilon: float, delta: float, hospital_ids, config: CentralConfig):
    """The run's own budget, and in a comparison every pooled hospital's lifetime ledger beside it."""
    guard = BudgetGuard(ledger, epsilon, delta)
    if config.hospital_ledger_dir is None:
        return guard
    lifetime = float(config.lifetime_epsilon or epsilon)
    return GuardChain(guard, [(BudgetGuard(Ledger(Path(config.hospital_ledger_dir) / f"{h}.jsonl"), {h: lifetime},
                                           delta), [h]) for h in hospital_ids])


def _dp_config(preset, dpsgd: DPSGDOptions, epsilon: float, delta: float, setting: dict, sigma: float | None,
               **ids) -> DPConfig:
    """One grid entry's DPConfig: a grid shares one calibrated ``sigma`` (fixed mode); alone, the entry
    calibrates its own (target mode) or uses the given / the preset's."""
    if sigma is not None:
        mode, multiplier = NoiseMode.FIXED, sigma
    else:
        mode = dpsgd.noise_mode
        multiplier = (dpsgd.noise_multiplier if dpsgd.noise_multiplier is not None else
                      preset.dp_sgd.noise_multiplier if dpsgd.noise_mode is not NoiseMode.TARGET else None)
    per_layer = bool(preset.dp_sgd.per_layer if dpsgd.per_layer is None else dpsgd.per_layer)
    return DPConfig(mode=mode, epsilon=epsilon, delta=delta, noise_multiplier=multiplier,
                    max_grad_norm=setting["max_grad_norm"], per_layer=per_layer, sampling=dpsgd.sampling,
                    schedule=dpsgd.schedule, schedule_options=dict(dpsgd.schedule_options or {}),
                    grad_sample_mode=dpsgd.grad_sample_mode or DEFAULT_GRAD_SAMPLE_MODE,
                    relation=dpsgd.relation, **ids)


def _check_number(flag: str, value, *, positive: bool = False, low: float | None = None, high: float | None = None,
                  closed_low: bool = True, closed_high: bool = True) -> None:
    """UserError naming ``flag`` unless ``value`` is None (not given) or a finite number in the range."""
    if value is None:
        return
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    ok = not isinstance(value, bool) and math.isfinite(number)
    if positive:
        ok, expected = ok and number > 0, "a positive finite number"
    else:
        ok = ok and (low is None or (number >= low if closed_low else number > low))
        ok = ok and (high is None or (number <= high if closed_high else number < high))
        expected = f"a number in {'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
    if not ok:
        raise UserError(f"{flag}: expected {expected}, got {value!r}")


def _check_integer(flag: str, value, *, low: int) -> None:
    """UserError naming ``flag`` unless ``value`` is None (not given) or an integer >= ``low``."""
    if value is None:
        return
    integral = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or int(value) < low:
        raise UserError(f"{flag}: expected an integer >= {low}, got {value!r}")



def settings_grid(preset, private: bool, explicit: dict, grid: bool) -> list[dict]:
    """The training settings to try: the preset's ``dp_sgd.grid`` for DP-SGD (``grid``), one setting
    otherwise; any setting given explicitly (not None in ``explicit``) is fixed for every entry."""
    recipe = preset.dp_sgd
    base = {"learning_rate": preset.learning_rate, "epochs": preset.central_epochs,
            "max_grad_norm": recipe.max_grad_norm,
            "batch_size": (recipe.batch_size if private else None) or preset.batch_size}
    if not private and preset.central_ema_decay is not None:
        # the ceiling's released model averages its iterates (the preset's central_ema_decay); DP-SGD keeps its
        # recipe's own levers
        base["ema_decay"] = preset.central_ema_decay
    entries = list(recipe.grid) if (private and grid and recipe.grid) else [DpSetting()]
    fixed = {k: v for k, v in explicit.items() if v is not None}
    settings = []
    for entry in entries:
        setting = {**base, **entry.fixed(), **fixed}
        setting = {"learning_rate": float(setting["learning_rate"]), "max_grad_norm": float(setting["max_grad_norm"]),
                   "batch_size": int(setting["batch_size"]), "epochs": int(setting["epochs"]),
                   **lever_settings(setting)}
        if not private:   # no clipping without DP-SGD
            del setting["max_grad_norm"]
        if setting not in settings:
            settings.append(setting)
    return settings


def choose_setting(candidates) -> int:
    """Index of the candidate with the best public validation Dice (the first when none has one)."""
    scores = [(-1.0 if v is None else v) for _, _, v in candidates]
    return max(range(len(candidates)), key=lambda i: (scores[i], -i))


def public_start(preset, seed: int, data, progress: bool, checkpoint: str | Path, device=None,
                 precision: str = "32", **where) -> dict:
    """The start model's weights (``server.selftrain.train_public_models``: the public model trained on the public
    reference set, self-trained on the public query scans where the preset says so; the PATE teachers' and
    student's start too); trained once per checkpoint and reused by every method that passes it.

    Args:
        preset: the preset (its world, network and pre-training epochs).
        seed: the world's split and the training.
        data: an MSD Task01 or BraTS folder (None = the preset's phantoms).
        progress: progress bars.
        checkpoint: the public model's checkpoint: resumed from when it exists, so every method that passes the
            same one shares one training.
        device / precision: where the model trains (``task.learning.device``; None = auto) and whether forward passes run
            under bf16 autocast (``"32"`` = float32).
        **where: ``task.world.build_world``'s ``hospitals``, ``layout`` and ``partition_file``.
    """
    world = load_world(*build_world(preset, data, seed, progress, **where))
    model = train_public_models(world, preset, seed=seed, checkpoint=checkpoint,
                                compute=Compute(device=device, precision=precision, progress=bool(progress))).start
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


#: the settings a central run's folder was started with (sim.runners.resume); the seed under reproducible noise
#: goes to the checkpoint folder instead, removed when the run finishes
CENTRAL_SETTINGS = "central.json"
#: what the public model (``public-model.pt``, resumed from by every later start) depends on
PUBLIC_MODEL_SETTINGS = ("preset", "seed", "noise", "data", "hospitals", "layout", "partition_file", "precision")


def record_central_settings(config: CentralConfig, out: Path, preset: str, epsilon: float, delta: float) -> None:
    """Refuse a folder an earlier start left with other settings (its checkpoint or public model would be
    resumed into this run), then record this start's. Under a comparison (``hospital_ledger_dir``) the lifetime
    budget and the shared public model are the comparison's, which checks them itself; the device may differ."""
    reproducible, private = config.dpsgd.reproducible_noise, config.private
    # "name": the same settings under another method name draw other noise streams (`central --trainable decoder`
    # and `dp-sgd-central-decoder`), so a checkpoint of one is not resumed as the other (folders written before the
    # name was recorded are not compared on it)
    settings = {"method": config.method, "name": config.method_name, "preset": preset,
                "epsilon": epsilon if private else None,
                "delta": delta if private else None,
                "seed": None if reproducible else config.seed, "noise": NoiseKind.REPRODUCIBLE if reproducible else NoiseKind.SECURE,
                "data": None if config.data is None else str(config.data), "hospitals": config.hospitals,
                "layout": config.layout, "partition_file": config.partition_file, "init": config.init,
                "precision": config.compute.precision, "selection": config.selection,
                "selection_config": dataclasses.asdict(config.selection_config) if config.selection_config else None,
                "training": dataclasses.asdict(config.training),
                "dpsgd": {k: v for k, v in dataclasses.asdict(config.dpsgd).items() if k != "reproducible_noise"}}
    # a start that left nothing this run would reuse (it failed on its options) does not bind the folder; one that
    # left only the public model binds what that model depends on
    resumed = any((out / "checkpoint").glob("*.pt"))
    if resumed or (out / "results.json").exists():
        refuse_other_settings(out / CENTRAL_SETTINGS, settings)
    elif (out / "public-model.pt").exists():
        refuse_other_settings(out / CENTRAL_SETTINGS, {k: settings[k] for k in PUBLIC_MODEL_SETTINGS})
    # the seed that drives reproducible noise is published nowhere: it is checked only while a checkpoint exists
    seed_file = out / "checkpoint" / "seed.json"
    if reproducible:
        if resumed:
            refuse_other_settings(seed_file, {"seed": config.seed}, hidden=("seed",))
        atomic_write_json(seed_file, {"seed": config.seed})
    atomic_write_json(out / CENTRAL_SETTINGS, settings)


def _release_prefix(ledger_path: Path) -> str:
    """Release ids unique to this run: the hospitals' lifetime ledgers outlive it, and an id they already
    hold would merge a new release into an old one. A resumed run (checkpoint + ledger) keeps its ids
    (``central-dpsgd:<nonce>``, without the grid entry's ``:setting-i`` or the epoch)."""
    if ledger_path.exists() and ledger_path.stat().st_size > 0:
        first = Ledger.load(ledger_path).records()[0]["release_id"]
        return ":".join(first.split(":")[:2])
    return f"central-dpsgd:{secrets.token_hex(4)}"


def _config_dict(config) -> dict:
    if dataclasses.is_dataclass(config):
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()}
    return {"grid": list(config.grid)}
