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
import secrets
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

import torch
from tqdm import tqdm

from privacy.events import event_from_dict
from privacy.ledger import Ledger
from server.selftrain import start_description
from server.transport import HospitalTransport, fresh_run_folder, public_dropout_reason
from task.bundle import preprocessing_of
from task.device import check_device_spec, check_precision, device_name, model_device, resolve_device
from task.names import safe_name_part
from task.options import Relation
from task.presets import DpSetting
from task.networks import build_unet, load_start_weights, network_config_of
from task.results import ModelRelease, RunResults, write_run
from task.training import (LEVER_KEYS, evaluate_segmentation_per_case, lever_settings, per_class_of,
                           public_validation_dice, trainable_of)


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


def run_dpfedavg(transport: HospitalTransport, world, preset, epsilon: float, delta: float, out_dir: str | Path,
                 seed: int = 0, rounds: int | None = None, local_epochs: int = 1, progress: bool = True,
                 reproducible_noise: bool = False, relation: Relation = Relation.REPLACE_ONE,
                 init_weights: Mapping[str, np.ndarray] | None = None, init: str = "public", device: str = "auto",
                 precision: str = "32") -> dict[str, Any]:
    """Rounds of local DP-SGD averaged with public weights; writes ``out_dir`` and returns its results.

    Settings grid (``dpfedavg_settings``): every entry is a full federated run from the same start; the
    hospitals calibrate one noise multiplier for all entries together (the plan travels in each round's
    config), so their ledgers' ε over the whole grid is the budget; the entry whose global model has the best
    public validation Dice is kept (post-processing of released models).

    Args:
        transport: the hospitals (:class:`server.transport.HospitalTransport`); each round is one
            ``fedavg_round``.
        world: the server's :class:`task.world.PublicWorld` (public validation set for the choice among the grid,
            test set for the score).
        preset: the preset (network, learning rate, clipping norm, batch, rounds, ``dpfedavg_grid``).
        epsilon / delta: the run's budget, sent to the hospitals, which calibrate their noise to it and charge
            their ledgers; ``delta`` is also the δ the mirrored ledger is accounted at.
        out_dir: the run folder (results.json, ledger.jsonl with the hospitals' mirrored records, model/).
        seed: the global model's initialisation (when ``init_weights`` is None) and the hospitals' local
            training; also their noise under ``reproducible_noise``.
        rounds: federated rounds of every grid entry (None = the preset's: ``central_epochs`` split into
            rounds of ``local_epochs``, or the grid entry's own ``rounds``).
        local_epochs: local DP-SGD epochs per round at each hospital.
        progress: a progress bar over rounds.
        reproducible_noise: simulation only -- the hospitals' noise seeded by ``seed``, which is then left out
            of results.json. Default: secure noise.
        relation: the neighbouring relation of the guarantee (``replace-one``, the default: dataset sizes are
            treated as public; see the module docstring); the hospitals calibrate and the ledger is accounted
            under it.
        init_weights: the starting global model -- the start model (every method starts from the same
            public model, as PATE's teachers and student); random weights
            when None.
        init: the name of that start recorded in results.json (``public`` / ``scratch``); ``scratch`` is
            recorded whatever it says when ``init_weights`` is None. It loads nothing itself.
        device / precision: sent to the simulated hospitals with every round (deployed ones use
            their node config) and used here to evaluate the global models.
    """
    device, precision = check_device_spec(device), check_precision(precision)
    started = time.perf_counter()
    out = fresh_run_folder(out_dir)
    ledger = Ledger(out / "ledger.jsonl")
    settings = dpfedavg_settings(preset, rounds, local_epochs)

    def start_of(setting) -> dict[str, np.ndarray]:
        """The global model every round 0 of ``setting`` starts from: the public model (random weights when
        none), with the setting's voxel head (task.networks.VoxelHeadUNet, identity at start) if it trains one."""
        torch.manual_seed(seed)
        model = build_unet(preset.unet, trainable=trainable_of(setting))
        if init_weights is not None:
            load_start_weights(model, {name: torch.as_tensor(np.asarray(value)) for name, value in init_weights.items()})
        return {name: value.detach().cpu().numpy() for name, value in model.state_dict().items()}

    # unique per run: the hospitals keep a ledger per run tag, and their lifetime ledgers outlive runs. It names
    # a file at every hospital, which accepts only a plain name part (task.names): the folder's name is made one
    run_tag = f"{safe_name_part(out.resolve().name)}-e{epsilon:g}-{secrets.token_hex(4)}"
    plan = json.dumps([{"batch_size": s["batch_size"], "epochs": s["rounds"] * s["local_epochs"]} for s in settings])
    candidates = []
    last_replies = None
    for index, setting in enumerate(settings):
        weights, history = start_of(setting), []
        iterator = range(setting["rounds"])
        if progress:
            label = "dp-fedavg rounds" + (f" (setting {index + 1}/{len(settings)})" if len(settings) > 1 else "")
            iterator = tqdm(iterator, desc=label, unit="round")
        for round_index in iterator:
            replies = transport.fedavg_round(weights, {
                "round": round_index, "rounds": setting["rounds"], "local_epochs": setting["local_epochs"],
                "epsilon": epsilon, "delta": delta, "seed": seed, "run_tag": run_tag,
                "reproducible_noise": bool(reproducible_noise), "relation": relation,
                "setting": index, "plan": plan, "learning_rate": setting["learning_rate"],
                "max_grad_norm": setting["max_grad_norm"], "batch_size": setting["batch_size"],
                "device": device, "precision": precision, **lever_settings(setting)})
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
        candidate = build_unet(preset.unet, trainable=trainable_of(setting))
        candidate.load_state_dict({name: torch.as_tensor(value) for name, value in weights.items()})
        candidate.to(resolve_device(device))
        # public labels only: what may choose among the released global models
        candidates.append((setting, candidate, history, public_validation_dice(candidate, world, precision=precision)))
    chosen = max(range(len(candidates)), key=lambda i: (-1.0 if candidates[i][3] is None else candidates[i][3], -i))
    setting, model, history, validation_dice = candidates[chosen]
    dice, dice_per_case = evaluate_segmentation_per_case(model, world.test_images, world.test_labels,
                                                         precision=precision)
    results = RunResults(
        method="dp-fedavg", dice=dice, epsilon_budget=epsilon, hospitals=len(transport.hospital_ids()),
        # the seed drives the hospitals' noise when it is reproducible: then it is never published
        seed=None if reproducible_noise else seed,
        device=device_name(model_device(model)), precision=precision,
    ).account(ledger, delta, relation=relation)   # the worst hospital's, from the mirrored records
    results.extras = {
        "dice_per_case": dice_per_case,
        "dice_per_case_class": per_class_of(dice_per_case),
        "noise": "reproducible" if reproducible_noise else "secure",
        "rounds": history, "epsilon_per_hospital": {o: ledger.spent(o, delta).epsilon for o in ledger.owners()},
        # fewer rounds than planned: the hospitals' budgets (a lifetime budget shared with other cells) ran out
        "stopped_by_budget": (None if sum(1 for entry in history if entry.get("hospitals")) >= setting["rounds"] else
                              f"{sum(1 for entry in history if entry.get('hospitals'))} of {setting['rounds']} rounds"),
        "validation_dice_mean": validation_dice,   # public: what model selection may use
        "init": init if init_weights is not None else "scratch",
        "start": (start_description(preset)
                  if init_weights is not None else "random weights"),
        "settings_grid": [dict(c[0]) for c in candidates],
        "settings_validation_dice": [c[3] for c in candidates],
        "setting_chosen": chosen,
        "setting_selection": ("best Dice on the public validation set among the grid; every entry was a full "
                              "federated run on the private data, charged to the hospitals' ledgers"
                              if len(candidates) > 1 else "one setting (the preset's)"),
        "learning_rate": setting["learning_rate"], "batch_size": setting["batch_size"],
        "max_grad_norm": setting["max_grad_norm"],
        "fedavg_weights": "equal per hospital (public; hospitals' example counts are not used)",
        "dropped_hospitals": {h: public_dropout_reason(why) for h, why in transport.dropped.items()},
        # where each hospital ran its local DP-SGD in the last round (a deployed hospital chooses its own)
        "hospital_devices": {h: m.get("device") for h, (m, _) in (last_replies or {}).items()},
    }
    release = ModelRelease(model, network_config_of(model, preset.unet), preprocessing_of(world), world.source,
                           card_extra={"start": results.extras["start"], "settings": results.extras["setting_selection"]})
    return write_run(out, results, release, started=started)
