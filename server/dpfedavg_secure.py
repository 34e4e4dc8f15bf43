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
(``task.learning.networks.VoxelHeadUNet``, 213 parameters on the quick U-Net) on the frozen start model, Adam, the
learning rate of the preset's first voxel-head ``dp_sgd.grid`` entry, flat clipping at ``dp_sgd.max_grad_norm``
and ``epochs x ceil(n / expected batch)`` steps (:func:`pooled_dpsgd_setting`, :func:`planned_steps`; the
quick preset: 10 x ceil(180 / 16) = 120 steps at lr 1e-2, C = 0.1). The trained set is always the voxel head
(a full U-Net's 153k coordinates per secure sum and per step would be another method). Two differences are
deliberate: no augmentation -- the head's inputs ``[u(x), x]`` are then fixed per scan and computed once
(``task.learning.headgrad``: the frozen U-Net has instance normalisation without running statistics and no dropout,
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

import numpy as np
import torch
from tqdm import tqdm

from privacy.distributed import (IntegerGrid, calibrate_local_variance, centered, ddg_event, modulus_bits,
                                 share_count, wrap_bound)
from privacy.errors import BudgetExceeded
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.options import NoiseKind
from server.dpfedavg import FederatedRun
from server.pate_secure import checked_threshold, threat_model
from server.secure import SecureSumFailed, secure_sum
from server.transport import HospitalTransport, fresh_run_folder, public_dropout_reason
from task.reporting.bundle import preprocessing_of
from task.learning.device import device_name, model_device, resolve_device
from task.learning.dpsgd import steps_per_epoch
from task.errors import UserError
from task.settings.methods import Protocol
from task.learning.headgrad import head_dimension, head_parameter_names, head_state, state_digest, unflatten
from task.learning.networks import VOXEL_HEAD, build_unet, load_start_weights, network_config_of
from task.wire.requests import SecureStageRequest
from task.reporting.results import ModelRelease, RunResults, write_run
from task.wire.secagg import CONTRIBUTION_KIND, JOIN_STAGE, RELATION
from task.learning.training import evaluate_release, per_class_of, public_validation_dice

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


@dataclass(frozen=True)
class DpFedAvgSecureConfig(FederatedRun):
    """A dp-fedavg-secure run (:func:`run_dpfedavg_secure`): a :class:`server.dpfedavg.FederatedRun` (its seed
    initialises the head, and the U-Net when there are no start weights; its ``compute.device`` is where the
    hospitals compute the frozen features) with

    Args:
        threat: colluders, dropouts and the Shamir threshold (``server.pate_secure.threat_model``; None: none
            colluding, no dropout, the smallest threshold).
        steps: the number of steps (None: :func:`planned_steps`, pooled DP-SGD's; tests shorten it).
    """

    PROTOCOL: ClassVar[str] = Protocol.DP_FEDAVG_SECURE

    threat: Mapping[str, Any] | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "threat", threat_model(self.threat or {}))
        if self.steps is not None and int(self.steps) < 1:
            raise UserError(f"{METHOD}: steps must be >= 1, got {self.steps}")


@dataclass
class HeadModel:
    """What dp-fedavg-secure trains: the voxel head on the frozen start model."""

    model: torch.nn.Module
    start: dict[str, np.ndarray]                 # the frozen start model's weights (public: sent at join)
    digest: str
    dimension: int
    names: list[str]                             # the head's parameters
    parameters: dict[str, torch.nn.Parameter]


@dataclass
class SecureStepPlan:
    """The plan every hospital checks before it joins a step's secure sum: who takes part with how many patients,
    the integer grid, the calibrated noise and the modulus; ``record`` is what results.json says of it."""

    setting: dict[str, Any]
    counts: dict[str, int]                       # hospital -> patients (public under replace-one)
    steps: int
    counted: int                                 # noise shares every hospital can count on
    threshold: int
    grid: IntegerGrid
    per_step: Any                                # the privacy event of one step's release
    bits: int
    noise_sd: float                              # of the sum, in gradient units
    declaration: dict[str, Any]
    record: dict[str, Any]

    @property
    def participants(self) -> list[str]:
        return sorted(self.counts)


@dataclass
class SecureTraining:
    """How the steps went: why they stopped early (None: all planned ran), who dropped mid-protocol, and per
    released step how many hospitals and patients were in the sum."""

    stopped_early: str | None = None
    dropped_at: dict[str, list[str]] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)


@dataclass
class RunRecord:
    """What the record of a run needs besides its results: its ledger, its transport (who dropped), whether it
    was given start weights and when it started (``time.perf_counter()``)."""

    ledger: Ledger
    transport: HospitalTransport
    started_from_weights: bool
    started: float


def run_dpfedavg_secure(transport: HospitalTransport, world, preset, config: DpFedAvgSecureConfig,
                        out_dir: str | Path, init_weights: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Train the voxel head by distributed DP gradient descent through secure sums; write ``out_dir``.

    Args:
        transport: the hospitals (``server.transport.HospitalTransport``); every request goes through its
            ``secure_stage`` (in-process, or Flower messages: ``query.secure``).
        world: the server's ``task.world.PublicWorld`` (public validation set, test set for the score).
        preset: the preset (network, and pooled DP-SGD's setting: :func:`pooled_dpsgd_setting`).
        config: what the run is asked to do (:class:`DpFedAvgSecureConfig`: budget -- the local noise variance is
            calibrated so that the planned steps spend it --, seed, threat model, device, ...).
        out_dir: the run folder (results.json, ledger.jsonl, model/); refused when it holds an earlier ledger.
        init_weights: the start model's weights (the public model; random weights when None).
    """
    started = time.perf_counter()
    out = fresh_run_folder(out_dir)
    ledger = Ledger(out / "ledger.jsonl")
    guard = BudgetGuard(ledger, config.epsilon, config.delta)
    setting = pooled_dpsgd_setting(preset)
    head = head_model(preset, config.seed, init_weights)
    settings = SecureStageRequest(method=METHOD, delta=config.delta, device=config.compute.device,
                                  precision=config.compute.precision,
                                  secure_noise_seed=int(config.seed) if config.reproducible_noise else None
                                  ).to_config()

    def exchange(stage, messages):
        return transport.secure_stage(stage, messages, settings)

    counts = join_hospitals(exchange, transport, head)
    plan = plan_steps(config, setting, counts, head.dimension)
    training = train_head(exchange, transport, head, plan, config, guard)
    if not plan.record["steps_released"]:   # the start model would ship under a private method's name
        raise UserError(f"{METHOD} at epsilon {float(config.epsilon):g}: no step was released "
                        f"({training.stopped_early or 'none was planned'}); no model is written to {out}")
    return _write_secure(out, world, preset, config, head, plan, training,
                         RunRecord(ledger, transport, init_weights is not None, started))


def head_model(preset, seed: int, init_weights: Mapping[str, np.ndarray] | None) -> HeadModel:
    """The voxel-head network (its head seeded by ``seed``) on the start model ``init_weights`` (random weights
    when None), with only the head's parameters trainable."""
    torch.manual_seed(seed)
    model = build_unet(preset.unet, trainable=VOXEL_HEAD)
    if init_weights is not None:
        load_start_weights(model, {k: torch.as_tensor(np.asarray(v)) for k, v in init_weights.items()
                                   if not k.startswith("voxel_head.")})
    start = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items() if not k.startswith("voxel_head.")}
    names = head_parameter_names(model)
    parameters = dict(model.named_parameters())
    for name, parameter in parameters.items():
        parameter.requires_grad_(name in names)
    return HeadModel(model, start, state_digest(start), head_dimension(model), names, parameters)


def join_hospitals(exchange, transport: HospitalTransport, head: HeadModel) -> dict[str, int]:
    """The join: the public start model out, each hospital's number of patients back (public under replace-one);
    a hospital that answers with another start model, head or count is left out. UserError when fewer than two
    hospitals, or no patient, are left."""
    asked = sorted(transport.hospital_ids())
    joined = exchange(JOIN_STAGE, {h: {"kind": CONTRIBUTION_KIND, "relation": RELATION, "start_weights": head.start}
                                   for h in asked})
    counts = {}
    for hospital, reply in sorted(joined.items()):
        patients, size = reply.get("patients"), reply.get("dimension")
        if (reply.get("start_digest") != head.digest
                or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (patients, size))
                or size != head.dimension or patients < 0):
            log.warning("hospital %s joined with another start model, head or count: left out", hospital)
            continue
        counts[hospital] = int(patients)
    if len(counts) < 2:
        raise UserError(f"{METHOD}: {len(counts)} hospital(s) joined (of {len(asked)}); a secure sum needs at "
                        "least 2")
    if sum(counts.values()) < 1:
        raise UserError(f"{METHOD}: the hospitals that joined hold no patients")
    return counts


def plan_steps(config: DpFedAvgSecureConfig, setting: Mapping[str, Any], counts: Mapping[str, int],
               dimension: int) -> SecureStepPlan:
    """The plan: steps, grid, noise, modulus -- every hospital checks the declaration against its own policy."""
    threat, participants, patients = config.threat, len(counts), sum(counts.values())
    total_steps = planned_steps(setting, patients) if config.steps is None else int(config.steps)
    if total_steps < 1:
        raise UserError(f"{METHOD}: steps must be >= 1, got {total_steps}")
    threshold = checked_threshold(METHOD, participants, threat)
    counted = share_count(participants, threat["colluders"], threat["dropouts"])
    grid = IntegerGrid.for_rows(float(setting["max_grad_norm"]), dimension, inflation=GRID_INFLATION)
    variance = calibrate_local_variance(config.epsilon, config.delta, total_steps, grid, counted, RELATION)
    per_step = ddg_event(grid, variance, counted, 1, RELATION)
    bits = modulus_bits(patients * grid.row_bound, participants * variance, dimension, WRAP_PROBABILITY)
    noise_sd = grid.granularity * math.sqrt(participants * variance)   # of the sum, in gradient units
    declaration = {"kind": CONTRIBUTION_KIND, "relation": RELATION, "local_variance": variance, "shares": counted,
                   "total_variance": counted * variance, "colluders": threat["colluders"],
                   "dropouts": threat["dropouts"], "clip": grid.clip, "granularity": grid.granularity,
                   "dimension": dimension}
    record = {"aggregation": "secure", "participants": participants, "colluders": threat["colluders"],
              "dropouts": threat["dropouts"], "threshold": threshold, "counted_shares": counted,
              "local_variance": variance, "granularity": grid.granularity, "row_bound": grid.row_bound,
              "bits": bits, "wrap_probability_bound": wrap_bound(bits, patients * grid.row_bound,
                                                                  participants * variance, dimension),
              "dimension": dimension, "patients": patients, "patients_per_hospital": dict(counts),
              "steps_planned": total_steps, "steps_released": 0, "failed_steps": 0,
              "released_mean_gradient_sigma": noise_sd / patients,
              "bytes_up_per_hospital_per_step": {}, "bytes_down_per_hospital_per_step": {}}
    return SecureStepPlan(dict(setting), dict(counts), total_steps, counted, threshold, grid, per_step, bits,
                          noise_sd, declaration, record)


def train_head(exchange, transport: HospitalTransport, head: HeadModel, plan: SecureStepPlan,
               config: DpFedAvgSecureConfig, guard: BudgetGuard) -> SecureTraining:
    """The steps: each charged to the run's ledger, then one secure sum of the hospitals' noised head gradients,
    then an Adam step on its mean; stops when a hospital left, the budget is spent or a sum fails.

    Args:
        exchange: sends each named hospital its message for a secure-sum stage (``transport.secure_stage``).
        transport: the hospitals (who is still connected).
        head: the model trained (its head's parameters step; ``plan.record`` counts what was released).
        plan: the participants, grid, noise and modulus every hospital accepted.
        config: the run (its epsilon names the noise streams; ``progress``).
        guard: the run ledger's guard, charged before each step's sum.
    """
    participants, counts, record = plan.participants, plan.counts, plan.record
    optimizer = torch.optim.Adam([head.parameters[name] for name in head.names], lr=float(plan.setting["learning_rate"]))
    run_nonce = secrets.token_hex(4)
    training = SecureTraining()
    bytes_up = {h: 0 for h in participants}
    bytes_down = {h: 0 for h in participants}
    iterator = range(plan.steps)
    if config.compute.progress:
        iterator = tqdm(iterator, desc=f"{METHOD} steps", unit="step")
    for step in iterator:
        connected = sorted(h for h in transport.hospital_ids() if h in counts)
        if connected != participants:
            training.stopped_early = (f"hospitals {sorted(set(participants) - set(connected))} left; the noise was "
                                      f"planned for {len(participants)} participants")
            break
        release_id = f"{METHOD}:{run_nonce}:step-{step}"
        try:   # the run's ledger first: nothing is summed for a step it cannot pay for
            guard.charge_all(participants, plan.per_step, [release_id],
                             {"secure_sum": True, "counted_shares": plan.counted, "participants": len(participants),
                              "kind": CONTRIBUTION_KIND})
        except BudgetExceeded as exc:
            training.stopped_early = str(exc)
            break
        weights = head_state(head.model)
        inputs = {h: {"head": weights, "start_digest": head.digest,
                      "stream": f"{METHOD}:eps-{config.epsilon:g}:step-{step}"} for h in participants}
        try:
            result = secure_sum(exchange, participants, plan.threshold, plan.bits, head.dimension,
                                {**plan.declaration, "release_ids": [release_id]}, inputs)
        except SecureSumFailed as exc:
            record["failed_steps"] += 1
            training.stopped_early = f"step {step} was not released: {exc}"
            log.warning("%s: %s", METHOD, training.stopped_early)
            break
        in_sum = sum(counts[h] for h in result.survivors)
        total = plan.grid.to_reals(centered(result.total, plan.bits))
        mean = total / max(1, in_sum)
        for name, gradient in unflatten(head.model, mean).items():
            head.parameters[name].grad = gradient.to(head.parameters[name].device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record["steps_released"] += 1
        for h, stage in result.dropped.items():
            training.dropped_at.setdefault(h, []).append(f"step {step}: dropped at {stage}")
        for h in participants:
            bytes_up[h] += result.bytes_up.get(h, 0)
            bytes_down[h] += result.bytes_down.get(h, 0)
        training.history.append({"step": step, "hospitals": len(result.survivors), "patients": in_sum})
    released = max(1, record["steps_released"])
    record["bytes_up_per_hospital_per_step"] = {h: round(b / released) for h, b in bytes_up.items()}
    record["bytes_down_per_hospital_per_step"] = {h: round(b / released) for h, b in bytes_down.items()}
    return training


def _write_secure(out: Path, world, preset, config: DpFedAvgSecureConfig, head: HeadModel, plan: SecureStepPlan,
                  training: SecureTraining, run: RunRecord) -> dict[str, Any]:
    """The trained head evaluated (public validation, test) and the run's record written
    (task.reporting.results.write_run)."""
    model, setting, record, ledger = head.model, plan.setting, plan.record, run.ledger
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    model.to(resolve_device(config.compute.device))
    validation_dice = public_validation_dice(model, world, precision=config.compute.precision)
    dice, dice_per_case = evaluate_release(model, world.test_images, world.test_labels,
                                           precision=config.compute.precision)
    results = RunResults(method=config.method, dice=dice, epsilon_budget=config.epsilon, hospitals=len(plan.counts),
                         sigma=plan.noise_sd / plan.grid.clip, seed=None if config.reproducible_noise else config.seed,
                         device=device_name(model_device(model)), precision=config.compute.precision,
                         ).account(ledger, config.delta, relation=RELATION)
    results.extras = {
        "dice_per_case": dice_per_case,
        "dice_per_case_class": per_class_of(dice_per_case),
        "noise": NoiseKind.REPRODUCIBLE if config.reproducible_noise else NoiseKind.SECURE,
        "init": config.recorded_init(run.started_from_weights),
        "start": ("the public model (pre-trained on the public reference set, as PATE's teachers and student)"
                  if run.started_from_weights else "random weights"),
        "validation_dice_mean": validation_dice,
        "trainable": VOXEL_HEAD, "learning_rate": setting["learning_rate"], "max_grad_norm": setting["max_grad_norm"],
        "epochs": setting["epochs"], "pooled_expected_batch": setting["batch_size"], "steps": record["steps_released"],
        "batch": "full: every patient of every hospital in the sum, every step (no subsampling)",
        "settings_principle": PRINCIPLE,
        "epsilon_per_hospital": {o: ledger.spent(o, config.delta).epsilon for o in ledger.owners()},
        "stopped_early": training.stopped_early,
        "history": training.history,
        "dropped_hospitals": {h: public_dropout_reason(why) for h, why in run.transport.dropped.items()},
        "dropped_mid_protocol": training.dropped_at,
        "privacy_statement": (f"({results.epsilon:.4g}, {config.delta:g})-DP per patient, replace-one adjacency, "
                              f"{results.accountant} accountant over {record['steps_released']} distributed discrete "
                              f"Gaussian releases of the summed clipped head gradients through a secure sum "
                              f"({plan.counted} counted noise shares); covers the trained head"),
        "aggregation": "secure",
        "secure_aggregation": record,
        "who_sees_what": who_sees_what(record),
    }
    release = ModelRelease(model, network_config_of(model, preset.unet), preprocessing_of(world), world.source,
                           card_extra={"start": results.extras["start"], "aggregation": "secure sum (SecAgg+) with "
                                       "distributed discrete Gaussian noise"})
    return write_run(out, results, release, started=run.started, real_check=config.real_check)
