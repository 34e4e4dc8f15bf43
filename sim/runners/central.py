"""Centralised baselines on the pooled private data: non-private training and DP-SGD (SPEC section 6, 9).

The pooled data are every hospital's teacher partitions together (the ``Split``'s private part): the
upper bound that no federation can beat (non-private) and the seed paper's DP-SGD baseline (Fay et al.
``../shared/papers/004_*`` Sec. 5: same U-Net, per-layer clipping at 4, sigma^2 = 6, epsilon = 8,
delta = 1e-3). Privacy unit: one patient volume; DP-SGD with Poisson sampling (or zCDP for shuffled batches,
Yu et al.) under ``relation`` -- replace-one by default, since results publish ``train_cases`` (SPEC section 2;
add-remove for Poisson / zero-out for shuffle on request). Every epoch is charged to every hospital whose
patients are pooled (the owners of the data: a patient's guarantee is this run's ε), and, in a comparison,
also to each hospital's own lifetime ledger (``hospital_ledger_dir``) through a
:class:`privacy.guard.GuardChain`. results.json states the relation from the ledger and the same run's
epsilon under the other relation where it is defined (``epsilon_add_remove`` / ``epsilon_replace_one``).

Writes, in ``out``: ``results.json`` (SPEC section 10, every field present, null where it does not apply),
``ledger.jsonl`` (empty for non-private training), the model bundle (``model/weights.pt``,
``bundle.json``, card; see ``sim.bundle``; the only copy of the weights, covered by its digest) and
``checkpoint/train.pt`` (resumed when the run is restarted in the same folder).
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from privacy.guard import BudgetGuard, GuardChain
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from privacy import calibration
from server.student import train_public_model
from sim.dpsgd import DEFAULT_GRAD_SAMPLE_MODE, DPConfig, steps_per_epoch
from sim.device import check_precision, device_name, resolve_device
from sim.errors import UserError
from sim.io import atomic_write_bytes
from sim.methods import CENTRAL_METHODS
from sim.networks import build_unet, network_config
from sim.presets import get_preset
from sim.results import ModelRelease, RunResults, write_run
from sim.selection import SELECTIONS, SelectionConfig, run_private_selection
from sim.training import (LEVER_KEYS, TrainConfig, evaluate_segmentation, evaluate_segmentation_per_case,
                          lever_settings, per_class_of, train_segmentation)
from sim.world import build_world, load_world, pooled_private_data

METHODS = CENTRAL_METHODS


def load_central_data(preset, seed: int = 0, data: str | Path | None = None, progress: bool = True,
                      **world) -> dict[str, Any]:
    """The federated runs' world (sim.world.build_world: one phantom generation, one split, one test set),
    its hospitals' partitions pooled (sim.world.pooled_private_data). ``world``: build_world's ``hospitals``,
    ``layout`` and ``partition_file`` (with a partition file the hospital count decides which patients exist)."""
    if data is not None and not Path(data).exists():
        raise UserError(f"--data: {data} does not exist (expected an MSD Task01 or BraTS folder)")
    prepared, split = build_world(preset, data, seed, progress, **world)
    return pooled_private_data(prepared, split, Path(data) if data else None)


def run_central(method: str = "nonprivate", preset: str = "quick", out: str | Path = "runs/central",
                epsilon: float | None = None, delta: float | None = None, seed: int = 0,
                data: str | Path | None = None, progress: bool = True, *, noise_mode: str = "target",
                schedule: str | None = None, sampling: str = "poisson", noise_multiplier: float | None = None,
                max_grad_norm: float | None = None, per_layer: bool | None = None, grad_sample_mode: str | None = None,
                epochs: int | None = None, augment: bool = True,
                schedule_options: dict | None = None, batch_size: int | None = None,
                reproducible_noise: bool = False, relation: str = "replace-one",
                hospital_ledger_dir: str | Path | None = None, lifetime_epsilon: float | None = None,
                init: str = "public", public_model_checkpoint: str | Path | None = None,
                learning_rate: float | None = None, hospitals: int | None = None, layout: str | None = None,
                partition_file: str | None = None, device: str = "auto", precision: str = "32",
                levers: dict | None = None, selection: str = "public",
                selection_config: "SelectionConfig | None" = None) -> dict[str, Any]:
    """Train on the pooled private data, evaluate on the test split, write the run folder; return results.

    ``batch_size`` (default: the preset's; DP-SGD: the preset's ``dpsgd_batch_size`` extra when set) --
    DP-SGD needs larger expected batches than plain training: the noise is added once per batch.
    ``reproducible_noise`` (simulation only): DP-SGD noise and batches seeded by ``seed``; the seed is then
    left out of results.json. Default: secure noise. ``hospital_ledger_dir`` / ``lifetime_epsilon``: the
    hospitals' own ledgers of a comparison (``<dir>/<hospital>.jsonl``) and their lifetime budget; every
    epoch is then also charged there, and refused when a hospital's lifetime budget would be exceeded.

    ``init`` (issue 17): ``"public"`` (default) starts from the public model -- the same U-Net trained on the
    public reference set that PATE's teachers and student start from (``server.student.train_public_model``,
    shared through ``public_model_checkpoint`` in a comparison) -- and fine-tunes on the private data;
    ``"scratch"`` starts from random weights (the seed paper's DP-SGD baseline).

    DP-SGD settings grid (issue 17): unless a setting is given explicitly, DP-SGD in ``target`` noise mode
    trains one model per entry of the preset's ``dpsgd_grid`` (learning rate, clipping norm, expected batch,
    epochs), all with one noise multiplier calibrated so that the G trainings *together* spend the budget
    (``privacy.calibration.composed_dpsgd_noise_multiplier``), and keeps the one with the best Dice on the
    public validation set (post-processing: it reads no private label and no test case). The ledger holds
    every epoch of every grid entry, so its ε is the budget.

    ``device`` / ``precision`` (issue 30, ``sim.device``): where the public model and the pooled model train and
    are evaluated (auto = CUDA when there is one; DP-SGD's noise is still drawn on the host, ``sim.dpsgd``), and
    whether forward passes run under bf16 autocast. Both are recorded in results.json and the model card.

    ``selection`` (issue 28 item 4): ``"public"`` (default) is the grid above; ``"private"`` chooses among the
    grid and the public model unchanged by private selection on held-out private patients, charged as one
    event up front (``sim.selection``; DP-SGD in target mode with Poisson sampling, replace-one).
    """
    started = time.perf_counter()
    device = resolve_device(device)   # a GPU asked for and missing: refused before any data is touched
    precision = check_precision(precision)
    if selection not in SELECTIONS:
        raise UserError(f"--selection: expected one of {', '.join(SELECTIONS)}, got {selection!r}")
    if method not in METHODS:
        raise UserError(f"--method: expected one of {', '.join(METHODS)}, got {method!r}")
    if init not in INITS:
        raise UserError(f"--init: expected one of {', '.join(INITS)}, got {init!r}")
    try:
        p = get_preset(preset)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    private = method == "dp-sgd"
    epsilon = float(epsilon if epsilon is not None else p.epsilon)
    delta = float(delta if delta is not None else p.delta)
    checkpoints = out / "checkpoint"
    ledger_path = out / "ledger.jsonl"
    if ledger_path.exists() and ledger_path.stat().st_size > 0 and not any(checkpoints.glob("*.pt")):
        # A ledger without a checkpoint is a finished (or never-started) earlier run: training again from
        # scratch would be a second release of the same data that its release ids would hide.
        raise UserError(f"--out {out}: already holds {ledger_path.name} from an earlier run; use a new folder")

    torch.manual_seed(seed)
    # only what was given: the world of a run without them is built exactly as before (and callers that stand
    # in for load_central_data keep their signature)
    where = {k: v for k, v in (("hospitals", hospitals), ("layout", layout), ("partition_file", partition_file))
             if v is not None}
    world = load_central_data(p, seed=seed, data=data, progress=progress, **where)
    net_cfg = network_config(p.unet)
    start_weights = None
    if init == "public":
        start_weights = public_start(p, seed=seed, data=data, progress=progress,
                                     checkpoint=public_model_checkpoint or out / "public-model.pt",
                                     device=device, precision=precision, **where)
    # ``levers`` (issue 28: trainable, augmentation_multiplicity, ema_decay; sim.training.LEVER_KEYS): set
    # explicitly, they are fixed for every grid entry like any other explicit setting
    explicit = {"learning_rate": learning_rate, "max_grad_norm": max_grad_norm, "epochs": epochs,
                "batch_size": batch_size, **{k: v for k, v in (levers or {}).items() if k in LEVER_KEYS}}
    # the grid needs one sigma for all its runs: Poisson sampling in target mode (PLD composition)
    settings = settings_grid(p, private, explicit, grid=private and noise_mode == "target" and sampling == "poisson")
    select_privately = private and selection == "private"
    if select_privately and (noise_mode != "target" or sampling != "poisson" or init != "public"):
        raise UserError("--selection private: needs --noise-mode target, --sampling poisson and --init public")
    ledger = Ledger(ledger_path)
    dp = guard = None
    sigma = None
    if private:
        guard = BudgetGuard(ledger, epsilon, delta)
        if hospital_ledger_dir is not None:
            lifetime = float(lifetime_epsilon or epsilon)
            guard = GuardChain(guard, [(BudgetGuard(Ledger(Path(hospital_ledger_dir) / f"{h}.jsonl"), {h: lifetime},
                                                    delta), [h]) for h in world["hospital_ids"]])
        if len(settings) > 1 and not select_privately:   # one sigma for the whole grid: the G trainings together spend the budget
            n = len(world["train_ids"])
            sigma = calibration.composed_dpsgd_noise_multiplier(
                epsilon, delta, [(1.0 / steps_per_epoch(n, s["batch_size"]),
                                  steps_per_epoch(n, s["batch_size"]) * s["epochs"]) for s in settings],
                relation=relation)
    else:
        atomic_write_bytes(ledger_path, b"")   # non-private: an empty ledger (nothing was released privately)

    prefix = _release_prefix(ledger_path) if private else None
    noise = (NoiseSource.reproducible(seed) if reproducible_noise else NoiseSource()).child(
        METHODS[method], f"eps-{epsilon:g}")
    candidates = []
    for index, setting in enumerate(settings if not select_privately else ()):
        tag = "" if len(settings) == 1 else f":setting-{index}"
        train_config = TrainConfig(epochs=setting["epochs"], batch_size=setting["batch_size"],
                                   learning_rate=setting["learning_rate"], seed=seed, augment=augment,
                                   progress=progress, init_from=start_weights,
                                   checkpoint=checkpoints / ("train.pt" if len(settings) == 1 else f"setting-{index}.pt"),
                                   description=METHODS[method] + (f" setting {index + 1}/{len(settings)}" if tag else ""),
                                   extra_checkpoint={"network_config": net_cfg}, device=device, precision=precision,
                                   **lever_settings(setting))
        if private:
            dp = DPConfig(mode=noise_mode if sigma is None else "fixed", epsilon=epsilon, delta=delta,
                          noise_multiplier=sigma if sigma is not None else noise_multiplier if noise_multiplier is not None else
                          (p.dpsgd_noise_multiplier if noise_mode != "target" else None),
                          max_grad_norm=setting["max_grad_norm"],
                          per_layer=bool(p.extra.get("dpsgd_per_layer", True) if per_layer is None else per_layer),
                          sampling=sampling, schedule=schedule,
                          schedule_options=dict(schedule_options or {}),
                          grad_sample_mode=grad_sample_mode or DEFAULT_GRAD_SAMPLE_MODE,
                          release_prefix=prefix + tag, stream_prefix="central-dpsgd" + tag,
                          relation=relation).validate()
        torch.manual_seed(seed)
        result = train_segmentation(build_unet(p.unet), world["train_images"], world["train_labels"], train_config,
                                    dp=dp, guard=guard, owners=tuple(world["hospital_ids"]),
                                    validation=world["validation"], noise=noise.child(f"setting-{index}") if tag else noise)
        validation_dice = None
        if world["validation"] is not None:   # public: the only data a choice of setting may look at
            validation_dice = evaluate_segmentation(result.model, *world["validation"], device=device,
                                                    precision=precision).get("mean")
        candidates.append((setting, result, validation_dice))
    selected = None
    if select_privately:   # issue 28 item 4: sim.selection, charged as one event before anything is trained
        selected, dp = private_selection(p, settings, world, guard, prefix, noise, epsilon, delta, relation, seed,
                                         selection_config, start_weights, augment, progress, device, precision,
                                         per_layer, grad_sample_mode)
        candidates = [(selected.setting or _PUBLIC_SETTING, selected.result or _public_result(selected.model), None)]
    chosen = choose_setting(candidates)
    setting, result, validation_dice = candidates[chosen]
    model = result.model
    dice, dice_per_case = evaluate_segmentation_per_case(model, world["test_images"], world["test_labels"],
                                                         device=device, precision=precision)

    results = RunResults(method=METHODS[method], dice=dice, hospitals=world["hospitals"],
                         # under reproducible noise the seed also drives the other cells' noise: never published
                         seed=None if reproducible_noise else seed,
                         device=device_name(device), precision=precision)
    if private:   # the epsilon written anywhere is the ledger's (the worst owner; here all owners alike)
        results.account(ledger, delta, relation=relation)
        results.epsilon_budget = epsilon
        results.sigma = result.sigmas[0] if result.sigmas else None
        if selected is not None:
            results.sigma = selected.info["dpsgd_noise_multiplier"]
    results.extras = {
        "dice_per_case": dice_per_case,
        "dice_per_case_class": per_class_of(dice_per_case),
        **(noise.describe() if private else {}),
        "preset": p.name,
        "grid": list(p.grid),
        "privacy_unit": "one patient volume (pooled from all hospitals' private partitions)",
        "train_cases": len(world["train_ids"]),
        "test_cases": len(world["test_ids"]),
        "init": init,
        "start": ("the public model (pre-trained on the public reference set, as PATE's teachers and student)"
                  if init == "public" else "random weights"),
        "settings_grid": [dict(s) for s in settings] if selected is not None else [dict(s) for s, _, _ in candidates],
        "settings_validation_dice": [v for _, _, v in candidates],
        "setting_chosen": chosen,
        **({"selection": selected.info} if selected is not None else {}),
        "setting_selection": selected.info["mechanism"] if selected is not None else ("best Dice on the public validation set among the grid, every grid entry trained "
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
        # public validation Dice: what model selection may look at (never the test set)
        "validation_dice_mean": validation_dice,
    }
    preprocessing = {"grid": list(p.grid), "config": _config_dict(world["config"])}
    card = {"start": results.extras["start"], "settings": results.extras["setting_selection"]}
    written = write_run(out, results, ModelRelease(model, net_cfg, preprocessing, world["source"], card_extra=card),
                        started=started)
    # the checkpoints were only needed to resume; a finished run keeps its results, model bundle and ledger
    # (and the ledger without a checkpoint marks the folder as finished: see the check above)
    shutil.rmtree(checkpoints, ignore_errors=True)
    return written


INITS = ("public", "scratch")
_PUBLIC_SETTING = {"learning_rate": None, "max_grad_norm": None, "batch_size": None, "epochs": 0}


def _public_result(model):
    from sim.training import TrainResult
    return TrainResult(model=model, history=[])


def private_selection(p, settings, world, guard, prefix, noise, epsilon, delta, relation, seed, config,
                      start_weights, augment, progress, device, precision, per_layer, grad_sample_mode):
    """The torch side of ``sim.selection.run_private_selection`` for the pooled baseline: each candidate is
    fine-tuned from the public model with DP-SGD at the calibrated multiplier (fixed mode, no checkpoint: a
    selection is never resumed, its ledger marks the folder as used), steps checked by the CoveredGuard.
    Returns (Selected, the DPConfig of the candidates' training)."""
    used = {}

    def dp_config(setting, rep, z, release_prefix):
        return DPConfig(mode="fixed", epsilon=epsilon, delta=delta, noise_multiplier=z,
                        max_grad_norm=setting["max_grad_norm"],
                        per_layer=bool(p.extra.get("dpsgd_per_layer", True) if per_layer is None else per_layer),
                        sampling="poisson", grad_sample_mode=grad_sample_mode or DEFAULT_GRAD_SAMPLE_MODE,
                        release_prefix=release_prefix, stream_prefix=f"central-dpsgd:selection:rep-{rep}",
                        relation=relation).validate()

    def public_model():
        model = build_unet(p.unet)
        model.load_state_dict(start_weights)
        return model

    def train_candidate(setting, index, rep, images, labels, z, covered, stream):
        used["dp"] = dp_config(setting, rep, z, f"{prefix}:selection:rep-{rep}")
        config = TrainConfig(epochs=setting["epochs"], batch_size=setting["batch_size"],
                             learning_rate=setting["learning_rate"], seed=seed, augment=augment, progress=progress,
                             init_from=start_weights, checkpoint=None,
                             description=f"private selection: repetition {rep + 1}, setting {index + 1}",
                             device=device, precision=precision, **lever_settings(setting))
        torch.manual_seed(seed)
        return train_segmentation(build_unet(p.unet), images, labels, config, dp=used["dp"], guard=covered,
                                  owners=tuple(world["hospital_ids"]), validation=world["validation"], noise=stream)

    def per_case(model, images, labels):
        return evaluate_segmentation_per_case(model, images, labels, device=device, precision=precision)[1]

    selected = run_private_selection(
        settings=settings, train_images=world["train_images"], train_labels=world["train_labels"], guard=guard,
        owners=tuple(world["hospital_ids"]), release_prefix=prefix, noise=noise, epsilon=epsilon, delta=delta,
        relation=relation, seed=seed, config=config or SelectionConfig(), public_model=public_model,
        train_candidate=train_candidate, evaluate_per_case=per_case, steps_per_epoch=steps_per_epoch)
    if selected.setting is not None:   # the released model's own DP-SGD configuration
        used["dp"] = dp_config(selected.setting, 0, selected.info["dpsgd_noise_multiplier"], prefix)
    return selected, used.get("dp")
#: the settings a grid entry may fix (anything else comes from the preset)
SETTING_KEYS = ("learning_rate", "max_grad_norm", "batch_size", "epochs", *LEVER_KEYS)


def settings_grid(preset, private: bool, explicit: dict, grid: bool) -> list[dict]:
    """The training settings to try: the preset's ``dpsgd_grid`` for DP-SGD (``grid``), one setting
    otherwise; any setting given explicitly (not None in ``explicit``) is fixed for every entry."""
    base = {"learning_rate": preset.learning_rate, "epochs": preset.central_epochs,
            "max_grad_norm": preset.dpsgd_max_grad_norm,
            "batch_size": (preset.extra.get("dpsgd_batch_size") if private else None) or preset.batch_size}
    entries = list(preset.dpsgd_grid) if (private and grid and preset.dpsgd_grid) else [{}]
    fixed = {k: v for k, v in explicit.items() if v is not None}
    settings = []
    for entry in entries:
        unknown = set(entry) - set(SETTING_KEYS)
        if unknown:
            raise UserError(f"preset {preset.name}: dpsgd_grid entry has unknown keys {sorted(unknown)}")
        setting = {**base, **entry, **fixed}
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
    """The public model's weights (server.student.train_public_model on the public reference set, the PATE
    teachers' and student's start); trained once per checkpoint and reused by every method that passes it."""
    world = load_world(*build_world(preset, data, seed, progress, **where))
    model = train_public_model(world, preset, seed=seed, progress=progress, checkpoint=checkpoint, device=device,
                               precision=precision)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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
