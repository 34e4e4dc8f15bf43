"""``dp-fedavg-secure``: patient-level distributed DP gradient descent through secure aggregation.

What it is. Every step, each hospital computes the gradient of every one of its patients' losses with respect
to the trained parameters (**full batch**: all its patients, no subsampling), clips each to L2 norm ``C``,
scales and conditionally rounds each onto an integer grid, sums them and adds its own share of discrete
Gaussian noise; the sums go through the SecAgg+ secure sum (``server.secure.secure_sum``: masks, Shamir
shares, recovery of hospitals that drop mid-protocol; the hospital side is ``clients.secure`` and
``clients.secure_gradients``). The server sees only the noisy total over the hospitals, divides it by the
number of patients whose hospitals are in the sum, and takes an Adam step. This is the distributed discrete
Gaussian mechanism of Kairouz, Liu & Steinke 2021 ("The distributed discrete Gaussian mechanism for federated
learning with secure aggregation", arXiv 2102.06387, Algorithm 1) with the patients as the clients' rows and
the hospitals as the parties that add noise.

What it trains and for how long -- a stated principle: **what pooled DP-SGD (``dp-sgd-central``) trains, with
its optimiser, learning rate, clipping norm and number of optimiser steps**, so that the two differ only in
where the noise comes from and how the steps see the patients. At the preset that is the voxel head
(``task.networks.VoxelHeadUNet``, 213 parameters on the quick U-Net) on the frozen start model, Adam, the
learning rate of the preset's first voxel-head ``dp_sgd.grid`` entry, flat clipping at ``dp_sgd.max_grad_norm``
and ``epochs x ceil(n / expected batch)`` steps (:func:`pooled_dpsgd_setting`, :func:`planned_steps`; the
quick preset: 10 x ceil(180 / 16) = 120 steps at lr 1e-2, C = 0.1). The trained set is always the voxel head
(a full U-Net's 153k coordinates per secure sum and per step would be another method). Two differences are
deliberate: no augmentation -- the head's inputs ``[u(x), x]`` are then fixed per scan and computed once
(``task.headgrad``: the frozen U-Net has instance normalisation without running statistics and no dropout,
so it computes the same features in training mode, checked); PATE's voxel-head teachers train without
augmentation for the same reason -- and full batches instead of Poisson batches (below).

Privacy accounting. One step releases one secure sum: a ``privacy.events.DistributedDiscreteGaussianEvent``
(their Proposition 14, ρ-zCDP, read by the ``rdp`` accountant) with the sensitivity of a sum of rounded
rows when one patient is replaced (``privacy.distributed.row_sensitivity``: 2Δ, the rounding inside Δ) and
the noise shares every hospital can count on (``participants - colluders - dropouts``). Full batches make the
run exactly T of these events composed: dp_accounting has no tight accountant for a Poisson-subsampled
discrete Gaussian (nor for its distributed sum), so amplification by subsampling is not claimed and not
used. The local variance is calibrated once for the T releases
(``privacy.distributed.calibrate_local_variance``). Each step is charged to the run's ledger (every
participating hospital as owner) before the secure sum starts, and each hospital charges its own ledger
before it reads a patient (``clients.secure_gradients``); the released ε is read from the run's ledger.

Neighbouring relation: replace-one, as DP-FedAvg and pooled DP-SGD. The numbers of patients are then the same
in neighbouring datasets, hence public: the hospitals state theirs when they join, the server plans T from
their total and divides each sum by the patients of the hospitals in it (post-processing of the release and
of public counts). Any other relation is refused (a count would then be private).

Dropouts: a hospital leaving mid-protocol is recovered by the secure sum; its patients' rows and its noise are
then missing, the server divides by the survivors' patients, and the charge already counted only the shares
left after the dropouts the hospitals' policy allows (the survivors refuse to unmask when more leave). A step
whose sum fails (too few hospitals stayed, or they refused) releases nothing and ends the training: its
charge stays in the ledgers. A hospital that left before the step (no longer connected) ends it too: the
noise was planned for the participants that joined.

Who sees what (the report's "who sees what"): the server -- public keys, ciphertexts it cannot read, masked
vectors uniform modulo 2^bits, and each step's noisy sum over the hospitals; never one hospital's gradients
or update. A hospital -- its own patients, the public start model and each step's head weights, the others'
public keys and encrypted key shares. Anyone reading the results -- the trained head.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from tqdm import tqdm

from privacy.distributed import (IntegerGrid, calibrate_local_variance, centered, ddg_event, modulus_bits,
                                 share_count, wrap_bound)
from privacy.errors import BudgetExceeded
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from server.pate_secure import threat_model
from server.secure import SecureSumFailed, secure_sum
from server.transport import HospitalTransport, fresh_run_folder, public_dropout_reason
from task.bundle import preprocessing_of
from task.device import check_device_spec, check_precision, device_name, model_device, resolve_device
from task.dpsgd import steps_per_epoch
from task.errors import UserError
from task.headgrad import head_dimension, head_parameter_names, head_state, state_digest, unflatten
from task.networks import VOXEL_HEAD, build_unet, load_start_weights, network_config_of
from task.results import ModelRelease, RunResults, write_run
from task.secagg import CONTRIBUTION_KIND, JOIN_STAGE, RELATION
from task.training import evaluate_segmentation_per_case, per_class_of, public_validation_dice

log = logging.getLogger("fedpate.dpfedavg")

METHOD = "dp-fedavg-secure"
#: the probability the secure sum's modulus may wrap on some coordinate of one step, at most
WRAP_PROBABILITY = 1e-9
#: the rounding grid's inflation of the clipped rows' norm bound, at most (``IntegerGrid.for_rows``)
GRID_INFLATION = 1e-3

PRINCIPLE = ("what pooled DP-SGD trains at the preset -- the voxel head on the frozen start model, Adam at its "
             "learning rate, flat clipping at its norm -- for its number of optimiser steps, epochs x ceil(n / "
             "expected batch); full batches of every patient, no augmentation (the head's inputs are computed once)")


def pooled_dpsgd_setting(preset) -> dict[str, Any]:
    """Pooled DP-SGD's setting at ``preset``, as ``sim.runners.central.settings_grid`` builds it: the preset's
    learning rate and epochs, its DP-SGD recipe's clipping norm and expected batch, overridden by the recipe's
    first grid entry that trains a voxel head (none: the recipe's own values). The trained set is the voxel
    head."""
    recipe = preset.dp_sgd
    setting = {"learning_rate": float(preset.learning_rate), "epochs": int(preset.central_epochs),
               "max_grad_norm": float(recipe.max_grad_norm), "batch_size": int(recipe.batch_size or preset.batch_size)}
    entry = next((e.fixed() for e in recipe.grid if e.trainable == VOXEL_HEAD), {})
    for key in setting:
        if key in entry:
            setting[key] = type(setting[key])(entry[key])
    return {**setting, "trainable": VOXEL_HEAD}


def planned_steps(setting: Mapping[str, Any], patients: int) -> int:
    """Pooled DP-SGD's optimiser steps on ``patients``: epochs x ceil(patients / expected batch)."""
    return int(setting["epochs"]) * steps_per_epoch(int(patients), int(setting["batch_size"]))


def who_sees_what(secure: Mapping[str, Any]) -> dict[str, str]:
    """What each party could see in a dp-fedavg-secure run (the report prints it per method)."""
    return {"aggregator": (f"masked vectors (uniform modulo 2^{secure['bits']}) and, per step, the sum over the "
                           f"hospitals of their patients' clipped, rounded head gradients with the noise shares of "
                           f"{secure['participants']} hospitals (with up to {secure['colluders']} colluding "
                           f"hospital(s) still at least {secure['counted_shares']} honest shares); never one "
                           "hospital's gradients or update"),
            "hospitals": ("their own patients, the public start model and each step's head weights, the others' "
                          "public keys and encrypted key shares"),
            "results": "the trained voxel head"}


def run_dpfedavg_secure(transport: HospitalTransport, world, preset, epsilon: float, delta: float,
                        out_dir: str | Path, *, seed: int = 0, progress: bool = True, reproducible_noise: bool = False,
                        init_weights: Mapping[str, np.ndarray] | None = None, init: str = "public",
                        device: str = "auto", precision: str = "32", threat: Mapping[str, Any] | None = None,
                        steps: int | None = None) -> dict[str, Any]:
    """Train the voxel head by distributed DP gradient descent through secure sums; write ``out_dir``.

    Args:
        transport: the hospitals (``server.transport.HospitalTransport``); every request goes through its
            ``secure_stage`` (in-process, or Flower messages: ``query.secure``).
        world: the server's ``task.world.PublicWorld`` (public validation set, test set for the score).
        preset: the preset (network, and pooled DP-SGD's setting: :func:`pooled_dpsgd_setting`).
        epsilon / delta: the run's budget; the local noise variance is calibrated so that the planned steps
            spend it.
        out_dir: the run folder (results.json, ledger.jsonl, model/); refused when it holds an earlier ledger.
        seed: the head's initialisation (and the U-Net's when ``init_weights`` is None); the hospitals' noise
            only under ``reproducible_noise``.
        progress: a progress bar over the steps.
        reproducible_noise: simulation only -- the hospitals' noise and rounding seeded by ``seed`` (a deployed
            hospital refuses), which is then left out of results.json. Default: secure noise.
        init_weights: the start model's weights (the public model; random weights when None).
        init: the name of that start recorded in results.json.
        device / precision: sent to the simulated hospitals (the frozen features' forward pass) and used here
            to evaluate.
        threat: colluders, dropouts and the Shamir threshold (``server.pate_secure.threat_model``; None: none
            colluding, no dropout, the smallest threshold).
        steps: the number of steps (None: :func:`planned_steps`, pooled DP-SGD's; tests shorten it).
    """
    device, precision = check_device_spec(device), check_precision(precision)
    started = time.perf_counter()
    out = fresh_run_folder(out_dir)
    ledger = Ledger(out / "ledger.jsonl")
    guard = BudgetGuard(ledger, float(epsilon), float(delta))
    threat = threat_model(threat or {})
    setting = pooled_dpsgd_setting(preset)

    torch.manual_seed(seed)
    model = build_unet(preset.unet, trainable=VOXEL_HEAD)
    if init_weights is not None:
        load_start_weights(model, {k: torch.as_tensor(np.asarray(v)) for k, v in init_weights.items()
                                   if not k.startswith("voxel_head.")})
    start = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items() if not k.startswith("voxel_head.")}
    digest = state_digest(start)
    dimension = head_dimension(model)
    names = head_parameter_names(model)
    parameters = dict(model.named_parameters())
    for name, parameter in parameters.items():
        parameter.requires_grad_(name in names)
    settings = {"method": METHOD, "delta": float(delta), "device": device, "precision": precision}
    if reproducible_noise:
        settings["secure_noise_seed"] = int(seed)

    def exchange(stage, messages):
        return transport.secure_stage(stage, messages, settings)

    # join: the public start model out, each hospital's number of patients back (public under replace-one)
    asked = sorted(transport.hospital_ids())
    joined = exchange(JOIN_STAGE, {h: {"kind": CONTRIBUTION_KIND, "relation": RELATION, "start_weights": start}
                                   for h in asked})
    counts = {}
    for hospital, reply in sorted(joined.items()):
        patients, size = reply.get("patients"), reply.get("dimension")
        if (reply.get("start_digest") != digest or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                                            for v in (patients, size))
                or size != dimension or patients < 0):
            log.warning("hospital %s joined with another start model, head or count: left out", hospital)
            continue
        counts[hospital] = int(patients)
    participants = sorted(counts)
    if len(participants) < 2:
        raise UserError(f"{METHOD}: {len(participants)} hospital(s) joined (of {len(asked)}); a secure sum needs at "
                        "least 2")
    patients = sum(counts.values())
    if patients < 1:
        raise UserError(f"{METHOD}: the hospitals that joined hold no patients")
    total_steps = planned_steps(setting, patients) if steps is None else int(steps)
    if total_steps < 1:
        raise UserError(f"{METHOD}: steps must be >= 1, got {total_steps}")

    # the plan: grid, noise, modulus -- every hospital checks the declaration against its own policy
    counted = share_count(len(participants), threat["colluders"], threat["dropouts"])
    threshold = int(threat.get("threshold") or max(2, threat["colluders"] + 1))
    grid = IntegerGrid.for_rows(float(setting["max_grad_norm"]), dimension, inflation=GRID_INFLATION)
    variance = calibrate_local_variance(float(epsilon), float(delta), total_steps, grid, counted, RELATION)
    per_step = ddg_event(grid, variance, counted, 1, RELATION)
    bits = modulus_bits(patients * grid.row_bound, len(participants) * variance, dimension, WRAP_PROBABILITY)
    noise_sd = grid.granularity * math.sqrt(len(participants) * variance)   # of the sum, in gradient units
    declaration = {"kind": CONTRIBUTION_KIND, "relation": RELATION, "local_variance": variance, "shares": counted,
                   "total_variance": counted * variance, "clip": grid.clip, "granularity": grid.granularity,
                   "dimension": dimension}
    record = {"aggregation": "secure", "participants": len(participants), "colluders": threat["colluders"],
              "dropouts": threat["dropouts"], "threshold": threshold, "counted_shares": counted,
              "local_variance": variance, "granularity": grid.granularity, "row_bound": grid.row_bound,
              "bits": bits, "wrap_probability_bound": wrap_bound(bits, patients * grid.row_bound,
                                                                  len(participants) * variance, dimension),
              "dimension": dimension, "patients": patients, "patients_per_hospital": dict(counts),
              "steps_planned": total_steps, "steps_released": 0, "failed_steps": 0,
              "released_mean_gradient_sigma": noise_sd / patients,
              "bytes_up_per_hospital_per_step": {}, "bytes_down_per_hospital_per_step": {}}

    optimizer = torch.optim.Adam([parameters[name] for name in names], lr=float(setting["learning_rate"]))
    run_nonce = secrets.token_hex(4)
    stopped_early, dropped_at, history = None, {}, []
    bytes_up = {h: 0 for h in participants}
    bytes_down = {h: 0 for h in participants}
    iterator = range(total_steps)
    if progress:
        iterator = tqdm(iterator, desc=f"{METHOD} steps", unit="step")
    for step in iterator:
        connected = sorted(h for h in transport.hospital_ids() if h in counts)
        if connected != participants:
            stopped_early = (f"hospitals {sorted(set(participants) - set(connected))} left; the noise was planned "
                             f"for {len(participants)} participants")
            break
        release_id = f"{METHOD}:{run_nonce}:step-{step}"
        try:   # the run's ledger first: nothing is summed for a step it cannot pay for
            guard.charge_all(participants, per_step, [release_id],
                             {"secure_sum": True, "counted_shares": counted, "participants": len(participants),
                              "kind": CONTRIBUTION_KIND})
        except BudgetExceeded as exc:
            stopped_early = str(exc)
            break
        head = head_state(model)
        inputs = {h: {"head": head, "start_digest": digest, "stream": f"{METHOD}:eps-{float(epsilon):g}:step-{step}"}
                  for h in participants}
        try:
            result = secure_sum(exchange, participants, threshold, bits, dimension,
                                {**declaration, "release_ids": [release_id]}, inputs)
        except SecureSumFailed as exc:
            record["failed_steps"] += 1
            stopped_early = f"step {step} was not released: {exc}"
            log.warning("%s: %s", METHOD, stopped_early)
            break
        in_sum = sum(counts[h] for h in result.survivors)
        total = grid.to_reals(centered(result.total, bits))
        mean = total / max(1, in_sum)
        for name, gradient in unflatten(model, mean).items():
            parameters[name].grad = gradient.to(parameters[name].device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record["steps_released"] += 1
        for h, stage in result.dropped.items():
            dropped_at.setdefault(h, []).append(f"step {step}: dropped at {stage}")
        for h in participants:
            bytes_up[h] += result.bytes_up.get(h, 0)
            bytes_down[h] += result.bytes_down.get(h, 0)
        history.append({"step": step, "hospitals": len(result.survivors), "patients": in_sum})
    released = max(1, record["steps_released"])
    record["bytes_up_per_hospital_per_step"] = {h: round(b / released) for h, b in bytes_up.items()}
    record["bytes_down_per_hospital_per_step"] = {h: round(b / released) for h, b in bytes_down.items()}

    for parameter in model.parameters():
        parameter.requires_grad_(True)
    model.to(resolve_device(device))
    validation_dice = public_validation_dice(model, world, precision=precision)
    dice, dice_per_case = evaluate_segmentation_per_case(model, world.test_images, world.test_labels,
                                                         precision=precision)
    results = RunResults(method=METHOD, dice=dice, epsilon_budget=float(epsilon), hospitals=len(participants),
                         sigma=noise_sd / grid.clip, seed=None if reproducible_noise else seed,
                         device=device_name(model_device(model)), precision=precision,
                         ).account(ledger, float(delta), relation=RELATION)
    results.extras = {
        "dice_per_case": dice_per_case,
        "dice_per_case_class": per_class_of(dice_per_case),
        "noise": "reproducible" if reproducible_noise else "secure",
        "init": init if init_weights is not None else "scratch",
        "start": ("the public model (pre-trained on the public reference set, as PATE's teachers and student)"
                  if init_weights is not None else "random weights"),
        "validation_dice_mean": validation_dice,
        "trainable": VOXEL_HEAD, "learning_rate": setting["learning_rate"], "max_grad_norm": setting["max_grad_norm"],
        "epochs": setting["epochs"], "pooled_expected_batch": setting["batch_size"], "steps": record["steps_released"],
        "batch": "full: every patient of every hospital in the sum, every step (no subsampling)",
        "settings_principle": PRINCIPLE,
        "epsilon_per_hospital": {o: ledger.spent(o, float(delta)).epsilon for o in ledger.owners()},
        "stopped_early": stopped_early,
        "history": history,
        "dropped_hospitals": {h: public_dropout_reason(why) for h, why in transport.dropped.items()},
        "dropped_mid_protocol": dropped_at,
        "privacy_statement": (f"({results.epsilon:.4g}, {float(delta):g})-DP per patient, replace-one adjacency, "
                              f"{results.accountant} accountant over {record['steps_released']} distributed discrete "
                              f"Gaussian releases of the summed clipped head gradients through a secure sum "
                              f"({counted} counted noise shares); covers the trained head"),
        "aggregation": "secure",
        "secure_aggregation": record,
        "who_sees_what": who_sees_what(record),
    }
    release = ModelRelease(model, network_config_of(model, preset.unet), preprocessing_of(world), world.source,
                           card_extra={"start": results.extras["start"], "aggregation": "secure sum (SecAgg+) with "
                                       "distributed discrete Gaussian noise"})
    return write_run(out, results, release, started=started)
