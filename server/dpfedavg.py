"""DP-FedAvg: rounds of local DP-SGD at each hospital, averaged by the server (the federated baseline).

Privacy (docs/PRIVACY.md, "Neighbouring relations"): a patient's guarantee is its hospital's DP-SGD accountant (Poisson sampling,
replace-one by default: dataset sizes are treated as public and fixed, so add/remove would not hold once
they are known). Averaging and evaluating the global model are post-processing. FedAvg weights are
public -- equal per hospital -- and never the example counts hospitals report: a reported count is
itself an un-noised statistic of the private data, and weighting by it would make the update depend on it
outside any accountant. Each
hospital charges its own ledger before every local epoch and sends this round's records with its
update; the server mirrors them into the run's ``ledger.jsonl`` under the same owner, so the ε of the
global model is computed from a ledger (the worst hospital's), never from a reported number.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import numpy as np

import torch
from tqdm import tqdm

from privacy.events import event_from_dict
from privacy.ledger import Ledger
from server.selftrain import start_description
from server.transport import HospitalTransport, fresh_run_folder, public_dropout_reason
from task.reporting.bundle import preprocessing_of
from task.learning.compute import Compute, check_compute
from task.learning.device import device_name, model_device, resolve_device
from task.errors import UserError
from task.names import safe_name_part
from task.options import Init, NoiseKind, Relation, look_up_option
from task.settings.presets import DpSetting
from task.learning.networks import build_unet, load_start_weights, network_config_of
from task.wire.requests import FedAvgRoundRequest
from task.reporting.results import ModelRelease, RunResults, write_run
from task.learning.training import (LEVER_KEYS, evaluate_release, lever_settings, per_class_of,
                                    public_validation_dice, trainable_of)
from task.settings import methods
from task.reporting import trust

if TYPE_CHECKING:
    from task.reporting.realcheck import RealCheck


def federated_average(updates: Mapping[str, Mapping[str, np.ndarray]],
                      public_weights: Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
    """FedAvg (McMahan et al. 2017, Alg. 1 with weights n_k/n) with *public* weights.

    ``public_weights`` (hospital -> weight): equal when None (the default of the DP-FedAvg baseline), or
    planned public sizes. Never pass sizes the hospitals report: with published, data-dependent weights
    only replace-one DP can hold, and the weights themselves would be an unaccounted release.
    """
    if not updates:
        raise ValueError("federated_average: no updates")
    weights = {h: 1.0 for h in updates} if public_weights is None else {h: float(public_weights[h]) for h in updates}
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("federated_average: the public weights of the updates sum to zero")
    first = next(iter(updates.values()))
    averaged = {}
    for name in first.keys():
        acc = None
        for hospital, params in updates.items():
            value = np.asarray(params[name], dtype=np.float64) * (weights[hospital] / total)
            acc = value if acc is None else acc + value
        averaged[name] = acc.astype(np.asarray(first[name]).dtype)
    return averaged


def mirror_hospital_records(ledger: Ledger, hospital: str, records_json: str) -> int:
    """Record a hospital's reported ledger records (owner = that hospital) in the server's ledger."""
    count = 0
    for record in json.loads(records_json or "[]"):
        if list(record["owners"]) != [hospital]:
            raise ValueError(f"hospital {hospital} reported a record for owners {record['owners']}")
        ledger.record([hospital], event_from_dict(record["event"]), f"{hospital}/{record['release_id']}",
                      note={"mirrored_from": hospital, **(record.get("note") or {})})
        count += 1
    return count


#: the settings a DP-FedAvg grid entry may fix (anything else comes from the preset)
FEDAVG_SETTING_KEYS = ("learning_rate", "max_grad_norm", "batch_size", "rounds", "local_epochs", *LEVER_KEYS)


def dpfedavg_settings(preset, rounds: int | None = None, local_epochs: int = 1) -> list[dict]:
    """The DP-FedAvg settings to try: one per entry of the preset's ``dp_fedavg.grid`` (one when empty).
    Defaults: the preset's learning rate, DP-SGD's clipping norm (``dp_sgd.max_grad_norm``), DP-FedAvg's expected
    local batch (``dp_fedavg.batch_size``, else the preset's batch size), ``central_epochs`` rounds of
    ``local_epochs`` local epochs. ``rounds`` given explicitly fixes the rounds of every entry."""
    recipe = preset.dp_fedavg
    base = {"learning_rate": preset.learning_rate, "max_grad_norm": preset.dp_sgd.max_grad_norm,
            "batch_size": int(recipe.batch_size or preset.batch_size),
            "rounds": int(rounds or max(1, preset.central_epochs // max(1, local_epochs))),
            "local_epochs": int(local_epochs)}
    settings = []
    for entry in (recipe.grid or (DpSetting(),)):
        setting = {**base, **entry.fixed()}
        if rounds:
            setting["rounds"] = int(rounds)
        setting = {**{k: (float(setting[k]) if k in ("learning_rate", "max_grad_norm") else int(setting[k]))
                      for k in FEDAVG_SETTING_KEYS if k not in LEVER_KEYS}, **lever_settings(setting)}
        if setting not in settings:
            settings.append(setting)
    return settings


@dataclass(frozen=True)
class FederatedRun:
    """What a federated DP run (DP-FedAvg, dp-fedavg-secure) is asked to do, validated when built.

    Args:
        epsilon / delta: the run's budget, sent to the hospitals, which calibrate their noise to it and charge
            their ledgers; ``delta`` is also the δ the run's ledger is accounted at.
        seed: the global model's initialisation (when there are no start weights) and the hospitals' local
            training; also their noise under ``reproducible_noise``.
        reproducible_noise: simulation only -- the hospitals' noise seeded by ``seed`` (a deployed hospital
            refuses it), which is then left out of results.json. Default: secure noise.
        init: the name of the start recorded in results.json (:class:`task.options.Init`); ``scratch`` is recorded
            whatever it says when the run is given no start weights. It loads nothing itself.
        compute: ``progress`` -- a progress bar over the rounds (or steps); ``device`` / ``precision`` -- sent
            to the simulated hospitals with every request (deployed ones use their node config) and used here to
            evaluate the global model (:class:`task.learning.compute.Compute`; ``workers`` is not used here).
        method: the registered method this run is (``results.json``'s ``method``), one whose record runs this
            class's :attr:`PROTOCOL` (None: the first registered such method).
        real_check: the real-scan check the released model is scored on (``task.reporting.realcheck.RealCheck``; None: none).
    """

    #: the federated protocol (``task.settings.methods.Protocol``) a run of this kind is; each subclass names its own
    PROTOCOL: ClassVar[str] = ""

    epsilon: float
    delta: float
    seed: int = 0
    reproducible_noise: bool = False
    init: Init = Init.PUBLIC
    compute: Compute = Compute()
    method: str | None = field(default=None, kw_only=True)
    real_check: RealCheck | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        runs_it = methods.names(protocol=self.PROTOCOL)
        if self.method is None and runs_it:
            object.__setattr__(self, "method", runs_it[0])
        if self.method not in runs_it:
            raise UserError(f"method: {self.method!r} is not run by the {self.PROTOCOL or 'no'} protocol; expected "
                            f"one of {', '.join(runs_it) or 'none'}")
        if not (math.isfinite(float(self.epsilon)) and float(self.epsilon) > 0):
            raise UserError(f"epsilon: expected a positive number, got {self.epsilon!r}")
        if not 0 < float(self.delta) < 1:
            raise UserError(f"delta: expected a number in (0, 1), got {self.delta!r}")
        object.__setattr__(self, "epsilon", float(self.epsilon))
        object.__setattr__(self, "delta", float(self.delta))
        object.__setattr__(self, "init", look_up_option(self.init, Init, "init"))
        check_compute(self.compute)

    def recorded_init(self, started_from_weights: bool) -> Init:
        """The start recorded in results.json: ``init``, or ``scratch`` for a run given no start weights."""
        return self.init if started_from_weights else Init.SCRATCH


@dataclass(frozen=True)
class DpFedAvgConfig(FederatedRun):
    """A DP-FedAvg run (:func:`run_dpfedavg`): a :class:`FederatedRun` with

    Args:
        rounds: federated rounds of every grid entry (None = the preset's: ``central_epochs`` split into
            rounds of ``local_epochs``, or the grid entry's own ``rounds``).
        local_epochs: local DP-SGD epochs per round at each hospital.
        relation: the neighbouring relation of the guarantee (``replace-one``, the default: dataset sizes are
            treated as public; see the module docstring); the hospitals calibrate and the ledger is accounted
            under it.
    """

    PROTOCOL: ClassVar[str] = methods.Protocol.DP_FEDAVG

    rounds: int | None = None
    local_epochs: int = 1
    relation: Relation = Relation.REPLACE_ONE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounds is not None and int(self.rounds) < 1:
            raise UserError(f"rounds: expected a positive integer, got {self.rounds!r}")
        if int(self.local_epochs) < 1:
            raise UserError(f"local_epochs: expected a positive integer, got {self.local_epochs!r}")
        object.__setattr__(self, "relation", look_up_option(self.relation, Relation, "relation"))


@dataclass
class Candidate:
    """One grid entry's federated run: its setting, its global model and how its rounds went."""

    setting: dict
    model: torch.nn.Module
    history: list[dict]
    validation_dice: float | None


@dataclass
class FedAvgOutcome:
    """What a DP-FedAvg run produced, for the record."""

    candidates: list[Candidate]
    ledger: Ledger
    last_replies: dict | None          # the last round any hospital answered (where each trained)
    started_from_weights: bool         # whether the run was given start weights


def run_dpfedavg(transport: HospitalTransport, world, preset, config: DpFedAvgConfig, out_dir: str | Path,
                 init_weights: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Rounds of local DP-SGD averaged with public weights; writes ``out_dir`` and returns its results.

    Settings grid (``dpfedavg_settings``): every entry is a full federated run from the same start; the
    hospitals calibrate one noise multiplier for all entries together (the plan travels in each round's
    request), so their ledgers' ε over the whole grid is the budget; the entry whose global model has the best
    public validation Dice is kept (post-processing of released models).

    Args:
        transport: the hospitals (:class:`server.transport.HospitalTransport`); each round is one
            ``fedavg_round``.
        world: the server's :class:`task.world.PublicWorld` (public validation set for the choice among the grid,
            test set for the score).
        preset: the preset (network, learning rate, clipping norm, batch, rounds, ``dpfedavg_grid``).
        config: what the run is asked to do (:class:`DpFedAvgConfig`: budget, seed, rounds, relation, device, ...).
        out_dir: the run folder (results.json, ledger.jsonl with the hospitals' mirrored records, model/).
        init_weights: the starting global model -- the start model (every method starts from the same
            public model, as PATE's teachers and student); random weights when None.
    """
    started = time.perf_counter()
    out = fresh_run_folder(out_dir)
    ledger = Ledger(out / "ledger.jsonl")
    settings = dpfedavg_settings(preset, config.rounds, config.local_epochs)
    # unique per run: the hospitals keep a ledger per run tag, and their lifetime ledgers outlive runs. It names
    # a file at every hospital, which accepts only a plain name part (task.names): the folder's name is made one
    run_tag = f"{safe_name_part(out.resolve().name)}-e{config.epsilon:g}-{secrets.token_hex(4)}"
    plan = json.dumps([{"batch_size": s["batch_size"], "epochs": s["rounds"] * s["local_epochs"]} for s in settings])
    outcome = FedAvgOutcome([], ledger, None, init_weights is not None)
    for index, setting in enumerate(settings):
        request = FedAvgRoundRequest(
            round=0, rounds=setting["rounds"], local_epochs=setting["local_epochs"], epsilon=config.epsilon,
            delta=config.delta, seed=config.seed, run_tag=run_tag, reproducible_noise=bool(config.reproducible_noise),
            relation=config.relation, setting=index, plan=plan, learning_rate=setting["learning_rate"],
            max_grad_norm=setting["max_grad_norm"], batch_size=setting["batch_size"],
            per_layer=bool(preset.dp_sgd.per_layer), device=config.compute.device,
            precision=config.compute.precision, **lever_settings(setting))
        label = "dp-fedavg rounds" + (f" (setting {index + 1}/{len(settings)})" if len(settings) > 1 else "")
        start = _start_of(preset, setting, config.seed, init_weights)
        candidate, replies = _federate(transport, world, preset, config, outcome.ledger, start, request, label)
        candidate.setting = setting
        outcome.candidates.append(candidate)
        outcome.last_replies = replies or outcome.last_replies
    return _write_dpfedavg(out, world, preset, config, outcome, transport, started)


def _start_of(preset, setting, seed: int, init_weights) -> dict[str, np.ndarray]:
    """The global model every round 0 of ``setting`` starts from: the public model (random weights when
    none), with the setting's voxel head (task.learning.networks.VoxelHeadUNet, identity at start) if it trains one."""
    torch.manual_seed(seed)
    model = build_unet(preset.unet, trainable=trainable_of(setting))
    if init_weights is not None:
        load_start_weights(model, {name: torch.as_tensor(np.asarray(value)) for name, value in init_weights.items()})
    return {name: value.detach().cpu().numpy() for name, value in model.state_dict().items()}


def _federate(transport: HospitalTransport, world, preset, config: DpFedAvgConfig, ledger: Ledger,
              weights: dict[str, np.ndarray], request: FedAvgRoundRequest, label: str) -> tuple[Candidate, dict | None]:
    """The rounds of one grid entry from ``weights`` (each a ``request`` for its round), mirroring the
    hospitals' records into ``ledger``; returns the entry's global model as a :class:`Candidate` and the last
    replies any hospital sent (None: none)."""
    history, last_replies = [], None
    iterator = range(request.rounds)
    if config.compute.progress:
        iterator = tqdm(iterator, desc=label, unit="round")
    for round_index in iterator:
        replies = transport.fedavg_round(weights, replace(request, round=round_index).to_config())
        if not replies:
            history.append({"round": round_index, "hospitals": 0})
            break
        last_replies = replies
        updates = {}
        for hospital, (metrics, new_weights) in replies.items():
            mirror_hospital_records(ledger, hospital, metrics.get("ledger_records", "[]"))
            if int(metrics.get("epochs_trained", 0)) > 0:
                updates[hospital] = new_weights   # equal public weights: no reported size is used
        if not updates:  # every hospital's budget is spent
            history.append({"round": round_index, "hospitals": 0, "reason": "budget spent"})
            break
        weights = federated_average(updates)
        history.append({"round": round_index, "hospitals": len(updates)})
    model = build_unet(preset.unet, trainable=trainable_of(request.levers()))
    model.load_state_dict({name: torch.as_tensor(value) for name, value in weights.items()})
    model.to(resolve_device(config.compute.device))
    # public labels only: what may choose among the released global models
    validation = public_validation_dice(model, world, precision=config.compute.precision)
    return Candidate({}, model, history, validation), last_replies


def _write_dpfedavg(out: Path, world, preset, config: DpFedAvgConfig, outcome: FedAvgOutcome,
                    transport: HospitalTransport, started: float) -> dict[str, Any]:
    """The entry with the best public validation Dice (the earliest on ties) scored on the test set, and the
    run's record: results.json from the mirrored ledger, the model bundle (task.reporting.results.write_run)."""
    candidates, ledger, delta = outcome.candidates, outcome.ledger, config.delta
    chosen = max(range(len(candidates)), key=lambda i: (-1.0 if candidates[i].validation_dice is None
                                                       else candidates[i].validation_dice, -i))
    best = candidates[chosen]
    setting, model, history = best.setting, best.model, best.history
    dice, dice_per_case = evaluate_release(model, world.test_images, world.test_labels,
                                           precision=config.compute.precision)
    results = RunResults(
        method=config.method, dice=dice, epsilon_budget=config.epsilon, hospitals=len(transport.hospital_ids()),
        # the seed drives the hospitals' noise when it is reproducible: then it is never published
        seed=None if config.reproducible_noise else config.seed,
        device=device_name(model_device(model)), precision=config.compute.precision,
    ).account(ledger, delta, relation=config.relation)   # the worst hospital's, from the mirrored records
    rounds_run = sum(1 for entry in history if entry.get("hospitals"))
    results.extras = {
        "dice_per_case": dice_per_case,
        "dice_per_case_class": per_class_of(dice_per_case),
        "noise": NoiseKind.REPRODUCIBLE if config.reproducible_noise else NoiseKind.SECURE,
        "rounds": history, "epsilon_per_hospital": {o: ledger.spent(o, delta).epsilon for o in ledger.owners()},
        # fewer rounds than planned: the hospitals' budgets (a lifetime budget shared with other cells) ran out
        "stopped_by_budget": (None if rounds_run >= setting["rounds"] else
                              f"{rounds_run} of {setting['rounds']} rounds"),
        "validation_dice_mean": best.validation_dice,   # public: what model selection may use
        "init": config.recorded_init(outcome.started_from_weights),
        "start": start_description(preset) if outcome.started_from_weights else "random weights",
        "settings_grid": [dict(c.setting) for c in candidates],
        "settings_validation_dice": [c.validation_dice for c in candidates],
        "setting_chosen": chosen,
        "setting_selection": ("best Dice on the public validation set among the grid; every entry was a full "
                              "federated run on the private data, charged to the hospitals' ledgers"
                              if len(candidates) > 1 else "one setting (the preset's)"),
        "learning_rate": setting["learning_rate"], "batch_size": setting["batch_size"],
        "max_grad_norm": setting["max_grad_norm"],
        "fedavg_weights": "equal per hospital (public; hospitals' example counts are not used)",
        "dropped_hospitals": {h: public_dropout_reason(why) for h, why in transport.dropped.items()},
        # where each hospital ran its local DP-SGD in the last round (a deployed hospital chooses its own)
        "hospital_devices": {h: m.get("device") for h, (m, _) in (outcome.last_replies or {}).items()},
        "aggregation": "trusted", "who_sees_what": trust.federated_averaging(),
    }
    release = ModelRelease(model, network_config_of(model, preset.unet), preprocessing_of(world), world.source,
                           card_extra={"start": results.extras["start"], "settings": results.extras["setting_selection"]})
    return write_run(out, results, release, started=started, real_check=config.real_check)
