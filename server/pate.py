"""High-dimensional PATE, written against a transport (Fay, Sjölund & Oechtering, *Private Learning for
High-Dimensional Targets with PATE*, Algorithms 1-2; docs/PRIVACY.md).

:func:`run_pate` is the algorithm, one named step per line:

1. :func:`pretrain_public_model` -- a U-Net on the public reference split, self-trained on the public query
   scans where the preset says so: the teachers' initialisation and the start of the student (PATE should
   only add to what public data gives);
2. :func:`train_teachers` -- every hospital fine-tunes one teacher per disjoint partition of its patients
   (Alg. 1-2, "train teacher models on disjoint partitions");
3. :func:`plan_release` -- calibration and compressor: ``c = sigma / S`` for N queries at (epsilon, delta)
   (exact mu-GDP by default, eq. 15 on request; both linear in S); the compressor fitted on the public
   reference label maps only (PCA: basis A_l and l by eq. 7; autoencoder: trained with the deployment
   sigma in its bottleneck, Alg. 2); the codec state as shipped fixes S(K) and sigma = c S(K);
4. :func:`run_query_phase` -- every query is one Gaussian mechanism on the mean of K bounded encodings
   (Alg. 1-2, "aggregate and perturb"), charged to every answering hospital before its noise is drawn;
5. :func:`decode_and_train_student` -- pseudo-labels ``y_hat_n = decode(z_bar_n)`` and the student trained
   on them with the public data (Alg. 1-2, last line);
6. :func:`evaluate` -- student, public-only baseline, public validation Dice (what model selection may
   look at), and the simulation-only diagnostics;
7. :func:`write` -- results.json, the model bundle with its card, predictions (task.reporting.results.write_run).

Dropouts: a hospital that does not answer (or whose reply is rejected) is not in that query's sum; the
next batches declare the smaller K, so S = S(K) grows and the ledger records the S actually used. If a
charge would exceed a budget, querying stops (nothing more is released) and the student is trained on the
answered queries; ``results["stopped_early"]`` says why. The budget is never exceeded: the guard refuses
first.

Diagnostics that are NOT covered by the DP guarantee (simulation only, flagged in results.json under
``not_private_diagnostics``): the mean teacher Dice, the noise-free ensembles (one extra, un-noised
query of the public test scans), and the pseudo-label Dice on the query scans.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch
from tqdm.auto import tqdm

from privacy.calibration import pate_sigma
from privacy.errors import BudgetExceeded
from privacy.events import GaussianEvent
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from server.aggregation import QueryRelease, aggregate_query
from server.pate_secure import is_secure, run_secure_query_phase, who_sees_what
from server.selftrain import PublicModels, train_public_models
from server.student import ModelTraining, train_public_model, train_student
from server.transport import (
    HospitalTransport,
    TeacherEnsembleDiagnostics,
    fallback_counts,
    fresh_run_folder,
    measured_bytes_per_teacher,
    public_dropout_reason,
)
from task import codecs
from task.codecs import Compressor, PublicFit, make_compressor
from task.reporting.bundle import preprocessing_of
from task.learning.compute import Compute, check_compute
from task.learning.device import device_name, model_device
from task.errors import UserError
from task.io import atomic_write_json
from task.settings import methods
from task.learning.metrics import dice_scores
from task.learning.networks import network_config_of
from task.options import PcaMode, PublicScans, Relation, look_up_option
from task.wire.requests import EvaluationRequest, HospitalRequest, QueryRequest, TeacherTrainingRequest
from task.reporting.results import ModelRelease, RunResults, write_run
from task.learning.training import (evaluate_release, evaluate_release_predicting, per_class_of, predict_probs,
                                    public_validation_dice)
from task.world import PublicWorld

if TYPE_CHECKING:
    from task.reporting.realcheck import RealCheck

log = logging.getLogger("fedpate.pate")

#: the server checks its own codec as the hospitals will (any kind it can build, any length)
SERVER_POLICY = codecs.CodecPolicy(max_latent_dim=1 << 62, allow_identity=True)


@dataclass(frozen=True)
class PateConfig:
    """What one PATE run is asked to do (everything but the hospitals, the world and the preset)."""

    method: str                           # pate-pca | pate-ae | pate-anchored | pate-naive
    epsilon: float
    delta: float
    seed: int = 0
    calibration: str = "exact"            # exact mu-GDP | paper (Fay et al. eq. 15)
    query_batch: int = 8                  # public scans per query message
    soft_labels: bool = True              # the student learns the decoded probabilities, not their argmax
    include_reference: bool = True        # the student also trains on the public reference data
    pca_mode: PcaMode = PcaMode.PUBLIC    # PCA sensitivity bound: public | paper | clip (Fay et al. Sec. 3)
    #: fit the compressor on all the public data there is: PCA / autoencoder also fit the
    #: public model's label maps of the public query scans (public model x public scans: no private input)
    fit_on_public_predictions: bool = True
    compressor_options: Mapping[str, Any] | None = None
    local_dp: Mapping[str, Any] | None = None   # teachers trained with local DP-SGD (DPConfig fields)
    diagnostics: bool = True              # simulation-only un-noised measurements (never against deployed)
    #: checkpoints of the epsilon-independent public models, shared by a comparison's cells
    shared_dir: str | Path | None = None
    #: where the server's models (public model, autoencoder, student) run, and the device spec and precision the
    #: simulated hospitals are sent for their teachers (deployed hospitals follow their own node config); progress bars
    compute: Compute = Compute()
    #: secure aggregation's threat model (server/pate_secure.py): colluders, dropouts, threshold (None: none
    #: colluding, no dropout, the smallest threshold); only for the secure methods
    secure: Mapping[str, Any] | None = None
    #: the real-scan check the student is scored on (``task.reporting.realcheck.RealCheck``; None: none)
    real_check: RealCheck | None = None

    def __post_init__(self) -> None:
        pate_methods = methods.names(protocol=methods.Protocol.PATE)   # every registered method this protocol runs
        if self.method not in pate_methods:
            raise UserError(f"method: expected one of {', '.join(pate_methods)}, got {self.method!r}")
        object.__setattr__(self, "pca_mode", look_up_option(self.pca_mode, PcaMode, "pca_mode"))
        check_compute(self.compute)

    def hospital_compute(self) -> HospitalRequest:
        """What every message to the hospitals says about device and precision."""
        return HospitalRequest(device=self.compute.device, precision=self.compute.precision)


# ---------------------------------------------------------------------------------------------- steps' data
@dataclass
class Teachers:
    """Who trained how many teachers (K = ``total``), and what the hospitals reported."""

    per_hospital: dict[str, int]
    metrics: dict[str, dict]

    @property
    def total(self) -> int:
        return int(sum(self.per_hospital.values()))


@dataclass
class ReleasePlan:
    """Calibrated noise and the public codec every query is released through."""

    compressor: Compressor
    codec: dict[str, np.ndarray]          # the state as shipped to the hospitals (verified)
    queries: int                          # N planned
    noise_per_sensitivity: float          # c = sigma / S
    sensitivity: float                    # S(K) of the codec as shipped, K = every planned teacher
    sigma: float
    collapse: dict | None                 # the autoencoder's collapse check (docs/PRIVACY.md, "What limits PATE")
    #: the public model's probabilities on the query scans: the anchored codec's p_n (shipped with each batch,
    #: public side information) and, for every method, what the pseudo-labels must beat
    public_query_probs: np.ndarray | None = None
    public_test_probs: np.ndarray | None = None
    #: how many public maps of each kind the PCA / autoencoder codec was fitted on (None: other codecs)
    fit_maps: dict[str, int] | None = None
    #: the scans those probabilities belong to (public too: the anchored codec's intensity bins come from them)
    public_query_scans: np.ndarray | None = None
    public_test_scans: np.ndarray | None = None

    def _public_side(self, indices, on: PublicScans) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(the public model's probabilities, the scans) for the scans ``indices`` of the query or test set."""
        on = look_up_option(on, PublicScans, "public scans")
        probs = self.public_query_probs if on is PublicScans.QUERY else self.public_test_probs
        scans = self.public_query_scans if on is PublicScans.QUERY else self.public_test_scans
        index = np.asarray(indices, dtype=int)
        return (None if probs is None else probs[index]), (None if scans is None else scans[index])

    def codec_for(self, indices, on: PublicScans = PublicScans.QUERY) -> dict:
        """The codec state shipped with the scans ``indices`` (with the public side information the compressor
        says a batch needs, e.g. the anchored codec's anchors and intensity bins)."""
        probs, scans = self._public_side(indices, on)
        return self.compressor.batch_state(self.codec, probs, scans)

    def decode(self, latents: np.ndarray, indices, on: PublicScans = PublicScans.QUERY, noisy: bool = True
               ) -> np.ndarray:
        """Pseudo-labels from mean latents (``noisy=False``: the un-noised diagnostic, decoded as if sigma were 0)."""
        probs, scans = self._public_side(indices, on)
        return self.compressor.decode_release(latents, probs, self.sigma if noisy else 0.0, scans)


@dataclass
class QueryPhase:
    """What the query phase released, and what it did not."""

    answered: list[int] = field(default_factory=list)       # query indices released
    latents: list[np.ndarray] = field(default_factory=list)  # their noisy mean latents
    teachers_seen: list[int] = field(default_factory=list)   # K of each released query
    rejected: dict[str, list] = field(default_factory=dict)  # hospital -> reasons (server log only)
    unreleased: list[int] = field(default_factory=list)      # asked but not released (missing teachers)
    stopped_early: str | None = None
    bytes_up: list[dict] = field(default_factory=list)       # the transport's measurements of these rounds
    notes: list[dict] = field(default_factory=list)
    secure: dict | None = None                               # the secure sum's plan and costs (secure methods)


@dataclass
class Student:
    model: torch.nn.Module
    public_only: torch.nn.Module          # the honest baseline: the same schedule on public data only
    pseudo_labels: np.ndarray             # (answered, C, *grid) decoded probabilities


@dataclass
class Evaluation:
    dice: dict
    dice_per_case: list
    public_only_dice: dict
    public_only_dice_per_case: list
    validation_dice_mean: float | None
    teacher_dice_per_hospital: dict = field(default_factory=dict)   # not private
    teacher_dice_mean: float | None = None                          # not private
    ensemble_dice: dict | None = None                               # not private
    ensemble_vote_dice: dict | None = None                          # not private
    pseudo_label_dice: dict | None = None                           # not private
    public_model_query_dice: dict | None = None                     # public model, the same query scans
    diagnostics: bool = False
    #: the student's test label maps as its Dice scored them (written as the run's predictions)
    test_predictions: np.ndarray | None = None


@dataclass
class PateOutcome:
    """Everything a run produced, for the record."""

    teachers: Teachers
    plan: ReleasePlan
    queries: QueryPhase
    student: Student
    evaluation: Evaluation
    ledger: Ledger
    dropped: dict[str, str]               # hospitals that left, and why
    noise: NoiseSource


# ---------------------------------------------------------------------------------------------- the algorithm
def run_pate(transport: HospitalTransport, world: PublicWorld, preset, config: PateConfig, out_dir,
             noise: NoiseSource | None = None) -> dict:
    """Run PATE end to end and write ``out_dir`` (docs/PRIVACY.md, "Results"); returns results.json's content.

    Args:
        transport: the hospitals (:class:`server.transport.HospitalTransport`): they train the teachers and
            answer the queries; simulation-only diagnostics are dropped when any of them is deployed.
        world: the server's :class:`task.world.PublicWorld` (reference, query, validation and test sets).
        preset: the preset (network, epochs, compressor defaults).
        config: what the run is asked to do (:class:`PateConfig`: method, budget, seed, device, ...).
        out_dir: the run folder; refused when it already holds a non-empty ledger.jsonl from an earlier run.
        noise: the ``privacy.mechanisms.NoiseSource`` of this run's releases (secure when None); each
            query draws from its own stream, named after its query index (not the run's nonce).
    """
    started = time.perf_counter()
    out = fresh_run_folder(out_dir)
    noise = noise if noise is not None else NoiseSource()
    torch.manual_seed(config.seed)
    # un-noised diagnostics exist only in simulation: deployed hospitals refuse them, so none is asked
    config = _without_diagnostics_if_deployed(config, transport)
    public = pretrain_public_model(world, preset, config)
    teachers = train_teachers(transport, preset, config, public.start)
    plan = plan_release(world, preset, config, teachers, out, public.start)
    ledger = Ledger(out / "ledger.jsonl")
    guard = BudgetGuard(ledger, float(config.epsilon), float(config.delta))
    if is_secure(config.method):   # the hospitals add the noise and only a secure sum reaches the server
        queries, plan = run_secure_query_phase(transport, world, plan, teachers, config, guard, noise, QueryPhase)
    else:
        queries = run_query_phase(transport, world, plan, teachers, config, guard, noise)
    refuse_empty_release(config, queries, out)
    student = decode_and_train_student(world, preset, config, plan, queries, public)
    evaluation = evaluate(transport, world, config, plan, queries, student)
    outcome = PateOutcome(teachers, plan, queries, student, evaluation, ledger, dict(transport.dropped), noise)
    return write(out, world, preset, config, outcome, started)


def refuse_empty_release(config: PateConfig, queries: QueryPhase, out: Path) -> None:
    """A run that released no query has nothing private to train its student on: the student would be the public
    model shipped under a private method's name. Refused (what was charged stays in the ledgers), no model written."""
    if queries.answered:
        return
    why = queries.stopped_early or (f"every query batch failed ({len(queries.unreleased)} queries not released)"
                                    if queries.unreleased else "no query was asked")
    raise UserError(f"{config.method} at epsilon {float(config.epsilon):g}: no query was released ({why}); no student "
                    f"is trained and no model is written to {out}")


# ---------------------------------------------------------------------------------------------- the steps
def pretrain_public_model(world: PublicWorld, preset, config: PateConfig) -> PublicModels:
    """Step 1: the public model (reference images + labels) and the start every model of the run shares (that
    model, or it self-trained on the query scans: the preset's ``public_start``), checkpointed where a
    comparison shares them."""
    shared = Path(config.shared_dir) if config.shared_dir is not None else None
    return train_public_models(world, preset, seed=config.seed,
                               checkpoint=shared / "public-model.pt" if shared else None, compute=config.compute)


def teacher_training(preset) -> TeacherTrainingRequest:
    """What the teachers train, as the preset's :class:`task.settings.presets.Teachers` says, as the hospitals' train
    request: the epochs, the trainable set, the learning rate (the preset's when the recipe names none),
    augmentation and the batch size (the preset's, which every method shares)."""
    recipe = preset.teacher
    return TeacherTrainingRequest(teacher_epochs=recipe.epochs, teacher_trainable=recipe.trainable.value,
                                  teacher_learning_rate=float(recipe.learning_rate or preset.learning_rate),
                                  teacher_augment=bool(recipe.augment), teacher_batch_size=int(preset.batch_size))


def student_training(preset) -> dict[str, Any]:
    """What the student trains, as the preset's :class:`task.settings.presets.Student` says: :class:`server.student.ModelTraining`'s
    ``trainable``, ``learning_rate`` (None = the preset's), ``finetune`` (then every weight) and ``ema_decay`` (the
    average of the iterates is released; None = the last iterate)."""
    recipe = preset.student
    return {"trainable": recipe.trainable.value, "learning_rate": recipe.learning_rate, "finetune": recipe.finetune,
            "ema_decay": recipe.ema_decay}


def train_teachers(transport: HospitalTransport, preset, config: PateConfig,
                   public_model: torch.nn.Module) -> Teachers:
    """Step 2: the hospitals train their teachers from the public model's weights."""
    request = replace(teacher_training(preset), seed=config.seed, device=config.compute.device,
                      precision=config.compute.precision, local_dp=dict(config.local_dp) if config.local_dp else None)
    metrics = transport.train(request.to_config(), init_weights=_state_arrays(public_model))
    per_hospital = {h: int(m.get("teachers", 0)) for h, m in metrics.items() if int(m.get("teachers", 0)) > 0}
    if not per_hospital:
        raise UserError("no hospital trained any teacher: nothing to query")
    return Teachers(per_hospital, metrics)


def plan_release(world: PublicWorld, preset, config: PateConfig, teachers: Teachers, out: Path,
                 public_model: torch.nn.Module | None = None) -> ReleasePlan:
    """Step 3: calibration (docs/PRIVACY.md, "Mechanisms") and the compressor (fitted on PUBLIC data only).

    The compressor is asked, never named (a new kind needs no change here): its
    :meth:`task.codecs.Compressor.fit_release` takes the public data of a :class:`task.codecs.PublicFit`
    it needs. The codec state as shipped is the one source of the sensitivity: the hospitals recompute S from it
    (task.codecs.verify_codec / codec_sensitivity) and charge their own ledgers, so the server uses the very same
    numbers (the float32 basis shipped, not the float64 one kept here). ``pate_sigma`` aims 1e-9 below the budget, so
    the guard's own re-computation of the planned queries (batch checks and per-query charges) fits it:
    tests/test_privacy_calibration.py checks exactly that.

    Args:
        world: the server's public world; every query scan is one planned query, and the reference maps (and,
            with ``config.fit_on_public_predictions``, the public model's maps of the query scans) fit the
            compressor.
        preset: the preset (compressor defaults).
        config: the run's :class:`PateConfig` (method, budget, calibration, codec options, device).
        teachers: who trained how many teachers; K = ``teachers.total`` fixes the planned sensitivity.
        out: the run folder (the autoencoder is checkpointed under ``out/compressor``).
        public_model: the public model, whose predictions the anchored codec needs (and the codecs fitted on
            public predictions use); None = no such predictions (refused by a compressor that needs them).
    """
    K = teachers.total
    queries = len(world.query_images)
    noise_per_sensitivity = pate_sigma(config.epsilon, config.delta, queries, 1.0, mode=config.calibration)
    compressor = make_compressor(config.method, preset, seed=config.seed,
                                 checkpoint=out / "compressor" / "autoencoder.pt",
                                 progress=config.compute.progress, device=config.compute.device,
                                 pca_mode=config.pca_mode,
                                 **dict(config.compressor_options or {}))
    if compressor.needs_public_model and (public_model is None or world.reference_images is None):
        raise UserError(f"{config.method} needs the public model and public reference scans with labels")
    public_query = (predict_probs(public_model, world.query_images, precision=config.compute.precision)
                    if public_model is not None else None)
    public = PublicFit(
        reference_maps=codecs.one_hot(world.reference_labels, world.classes),
        reference_probs=(predict_probs(public_model, world.reference_images, precision=config.compute.precision)
                         if compressor.needs_public_model else None),
        query_probs=public_query, reference_is_query=list(world.reference_ids) == list(world.query_ids),
        with_predictions=bool(config.fit_on_public_predictions), reference_scans=world.reference_images)
    compressor.fit_release(public, noise_per_sensitivity, K)
    codec = codecs.verify_codec(compressor.state(), SERVER_POLICY)
    sensitivity = codecs.codec_sensitivity(codec, K)
    sigma = pate_sigma(config.epsilon, config.delta, queries, sensitivity, mode=config.calibration)
    public_test = (predict_probs(public_model, world.test_images, precision=config.compute.precision)
                   if compressor.needs_public_model else None)
    return ReleasePlan(compressor, codec, queries, noise_per_sensitivity, sensitivity, sigma,
                       compressor.release_checks(), public_query, public_test, compressor.fit_counts,
                       world.query_images, world.test_images)


def run_query_phase(transport: HospitalTransport, world: PublicWorld, plan: ReleasePlan, teachers: Teachers,
                    config: PateConfig, guard: BudgetGuard, noise: NoiseSource) -> QueryPhase:
    """Step 4: the queries, batch by batch, under the budget guard.

    Each batch declares K -- the teachers of the hospitals still connected; the hospitals charge their own
    ledgers for that K, so a query fewer teachers answered is not released. A batch is refused before any
    teacher runs if not even its first query fits the budget (after a dropout, larger S, only a prefix may
    fit). Release ids carry a per-run nonce: the hospitals' own ledgers outlive this run, and an identical
    id would merge a new release into an old one.

    Args:
        transport: the hospitals; asked batch by batch, only those still connected.
        world: the public world whose query scans are asked.
        plan: the calibrated release (:class:`ReleasePlan`: sigma, codec, number of queries).
        teachers: each hospital's teacher count (what each asked hospital must answer with).
        config: the run's :class:`PateConfig` (method, seed, delta, ``query_batch`` scans per message, device).
        guard: the budget guard every query is charged through before its noise is drawn.
        noise: the ``NoiseSource`` whose per-query streams (``query-<index>``) the noise is drawn from.
    """
    phase = QueryPhase()
    first_round = len(transport.bytes_up), len(transport.notes)
    run_nonce = secrets.token_hex(4)
    bar = _progress_bar(plan.queries, f"{config.method} queries") if config.compute.progress else None
    batch_size = max(1, int(config.query_batch))
    for start in range(0, plan.queries, batch_size):
        asked = {h: teachers.per_hospital[h] for h in transport.hospital_ids() if h in teachers.per_hospital}
        declared = int(sum(asked.values()))
        if declared == 0:
            phase.stopped_early = "no hospital with teachers is connected"
            break
        batch, refusal = _largest_affordable(list(range(start, min(plan.queries, start + batch_size))), guard,
                                             sorted(asked), codecs.codec_sensitivity(plan.codec, declared),
                                             plan.sigma)
        if not batch:
            phase.stopped_early = refusal
            break
        release_ids = [f"{config.method}:{run_nonce}:query-{index}" for index in batch]
        request = QueryRequest(method=config.method, seed=config.seed, queries=batch, release_ids=release_ids,
                               sigma=float(plan.sigma), teachers=declared, delta=float(config.delta),
                               device=config.compute.device, precision=config.compute.precision)
        replies = transport.query(world.query_images[batch], plan.codec_for(batch), request.to_config())
        answered = AnsweredBatch(batch, release_ids, replies, asked)
        phase.stopped_early = _aggregate_batch(phase, answered, plan, guard, noise, bar)
        if phase.stopped_early:
            break
    if bar is not None:
        bar.close()
    if phase.stopped_early:
        log.warning("query phase stopped early after %d queries: %s", len(phase.answered), phase.stopped_early)
    phase.bytes_up = list(transport.bytes_up[first_round[0]:])
    phase.notes = list(transport.notes[first_round[1]:])
    return phase


def decode_and_train_student(world: PublicWorld, preset, config: PateConfig, plan: ReleasePlan,
                             queries: QueryPhase, public: PublicModels) -> Student:
    """Step 5: pseudo-labels from the noisy latents; the student starts from the run's start model, and the
    public-only baseline continues the reference-trained public model on the same schedule without them.

    Args:
        world: the public world (query scans, reference data).
        preset: the preset (student epochs, network).
        config: the run's :class:`PateConfig` (``soft_labels``, ``include_reference``, seed, ``shared_dir``
            where the public-only baseline is checkpointed, device).
        plan: the release plan whose codec decodes the latents.
        queries: what the query phase released (answered indices and their noisy latents).
        public: the public models (:class:`server.selftrain.PublicModels`).
    """
    pseudo = (plan.decode(np.stack(queries.latents), queries.answered) if queries.latents
              else np.zeros((0, world.classes, *world.grid), np.float32))
    targets = pseudo if config.soft_labels else pseudo.argmax(axis=1)
    start_init = {k: v.clone() for k, v in public.start.state_dict().items()}
    public_init = {k: v.clone() for k, v in public.reference.state_dict().items()}
    shared = Path(config.shared_dir) if config.shared_dir is not None else None
    training = ModelTraining(seed=config.seed, compute=config.compute)
    student = train_student(world, targets, queries.answered, preset,
                            replace(training, include_reference=config.include_reference, **student_training(preset)),
                            init=start_init)
    public_only = train_public_model(world, preset,
                                     replace(training, epochs=preset.student.epochs,
                                             checkpoint=shared / "public-only.pt" if shared else None),
                                     init=public_init)
    return Student(student, public_only, pseudo)


def evaluate(transport: HospitalTransport, world: PublicWorld, config: PateConfig, plan: ReleasePlan,
             queries: QueryPhase, student: Student) -> Evaluation:
    """Step 6: test Dice of the student and of public-only, public validation Dice; in simulation, the
    teachers' own Dice (at the hospitals), the noise-free ensemble through the codec (one un-noised query
    of the public test scans), the teachers' averaged probabilities where the transport can give them,
    and the pseudo-labels' Dice. None of the simulation diagnostics is covered by the guarantee.

    Args:
        transport: the hospitals, asked for the diagnostics (only when ``config.diagnostics``).
        world: the public world (test and validation sets; query labels for the pseudo-label Dice when present).
        config: the run's :class:`PateConfig` (``diagnostics``, precision, method).
        plan: the release plan (decodes the un-noised ensemble; the public model's query probabilities).
        queries: the query phase (which queries were answered).
        student: the student, the public-only baseline and the pseudo-labels.
    """
    precision = config.compute.precision   # the models are already on the run's device
    dice, per_case, predicted = evaluate_release_predicting(student.model, world.test_images, world.test_labels,
                                                            precision=precision)
    public_dice, public_per_case = evaluate_release(student.public_only, world.test_images,
                                                    world.test_labels, precision=precision)
    result = Evaluation(dice, per_case, public_dice, public_per_case,
                        public_validation_dice(student.model, world, precision=precision),
                        diagnostics=config.diagnostics, test_predictions=predicted)
    if not config.diagnostics:
        return result
    teacher_dice = transport.evaluate(
        EvaluationRequest(seed=config.seed, device=config.compute.device,
                          precision=config.compute.precision).to_config(),
        test={"images": world.test_images, "labels": world.test_labels})
    scores = [d for m in teacher_dice.values() for d in (m.get("teacher_dice") or []) if d is not None]
    result.teacher_dice_mean = float(np.mean(scores)) if scores else None
    result.teacher_dice_per_hospital = {h: m.get("teacher_dice_mean") for h, m in teacher_dice.items()}
    test_indices = np.arange(len(world.test_images))
    diagnostic = QueryRequest(method=config.method, diagnostic=True, device=config.compute.device,
                              precision=config.compute.precision)
    clean = transport.query(world.test_images, plan.codec_for(test_indices, on=PublicScans.TEST),
                            diagnostic.to_config())
    rows = [np.asarray(r, np.float64) for r in clean.values() if np.asarray(r).ndim == 3]
    if rows:
        mean_latent = np.concatenate(rows, axis=0).mean(axis=0)
        result.ensemble_dice = noise_free_ensemble_dice(plan, mean_latent, world, config.shared_dir)
    if isinstance(transport, TeacherEnsembleDiagnostics):
        result.ensemble_vote_dice = _label_dice(transport.ensemble_probabilities(world.test_images,
                                                                                 config.hospital_compute().to_config()),
                                                world.test_labels)
    if world.query_labels is not None and queries.answered:
        result.pseudo_label_dice = _label_dice(student.pseudo_labels, world.query_labels[queries.answered])
        if plan.public_query_probs is not None:   # what the pseudo-labels must beat, same scans
            result.public_model_query_dice = _label_dice(plan.public_query_probs[queries.answered],
                                                         world.query_labels[queries.answered])
    return result


def noise_free_ensemble_dice(plan: ReleasePlan, mean_latent: np.ndarray, world: PublicWorld,
                             shared_dir: str | Path | None) -> dict:
    """Test Dice of the teachers' un-noised mean latents on the public test scans, decoded as if sigma were 0 (a
    simulation-only diagnostic), remembered in a comparison's ``shared_dir``.

    Why: it does not depend on epsilon -- the same teachers, codec and scans give the same latents in every cell of
    a comparison -- yet the head-fit decoder took 54 s per cell on the quick preset. It is reused only when the
    compressor names what its decode depends on (:meth:`task.codecs.Compressor.noise_free_decode_key`), under a
    key over that, the latents, the codec as shipped for the test scans (anchors, bins), the scans and the labels."""
    indices = np.arange(len(world.test_images))
    key = plan.compressor.noise_free_decode_key()
    if shared_dir is None or key is None:
        return _label_dice(plan.decode(mean_latent, indices, on=PublicScans.TEST, noisy=False), world.test_labels)
    digest = hashlib.sha256(key.encode())
    shipped = plan.codec_for(indices, on=PublicScans.TEST)
    arrays = {"latents": np.asarray(mean_latent, np.float64), "scans": world.test_images,
              "labels": world.test_labels, **{f"codec.{name}": value for name, value in shipped.items()}}
    for name in sorted(arrays):
        value = np.ascontiguousarray(np.asarray(arrays[name]))
        digest.update(f"{name}:{value.dtype}:{value.shape}".encode() + value.tobytes())
    path = Path(shared_dir) / "noise-free-decodes" / f"{digest.hexdigest()[:32]}.json"
    if path.exists():
        return json.loads(path.read_text())
    dice = json.loads(json.dumps(_label_dice(plan.decode(mean_latent, indices, on=PublicScans.TEST, noisy=False),
                                             world.test_labels), default=float))
    atomic_write_json(path, dice)
    return dice


def write(out: Path, world: PublicWorld, preset, config: PateConfig, outcome: PateOutcome, started: float) -> dict:
    """Step 7: the results record from the ledger, the bundle, the predictions (task.reporting.results.write_run).

    Args:
        out: the run folder.
        world: the public world (grid, test scans predicted, preprocessing and source for the bundle).
        preset: the preset (its name and network configuration are recorded).
        config: the run's :class:`PateConfig` (method, budget, seed, calibration, recorded settings).
        outcome: everything the run produced (:class:`PateOutcome`; the ledger gives ε).
        started: ``time.perf_counter()`` at the run's start (for the recorded wall time).
    """
    teachers, plan, queries, evaluation = outcome.teachers, outcome.plan, outcome.queries, outcome.evaluation
    student, ledger, noise = outcome.student, outcome.ledger, outcome.noise
    results = RunResults(
        method=config.method, dice=evaluation.dice, epsilon_budget=float(config.epsilon),
        teachers=teachers.total, hospitals=len(teachers.per_hospital), queries=len(queries.answered),
        sigma=float(plan.sigma), teacher_dice_mean=evaluation.teacher_dice_mean,
        ensemble_dice_mean=None if evaluation.ensemble_dice is None else evaluation.ensemble_dice.get("mean"),
        bytes_up_per_query_per_teacher=int(plan.compressor.bytes_per_query_per_teacher),
        # with reproducible noise the seed would let anyone regenerate and subtract it: never published
        seed=None if noise.is_reproducible else int(config.seed),
        device=device_name(model_device(student.model)), precision=config.compute.precision,
    ).account(ledger, config.delta, relation=Relation.REPLACE_ONE)
    results.extras = {
        **noise.describe(),
        "dice_per_case": evaluation.dice_per_case,
        "dice_per_case_class": per_class_of(evaluation.dice_per_case),
        "preset": preset.reference, "grid": list(world.grid), "calibration": config.calibration,
        "queries_planned": plan.queries, "sensitivity": float(plan.sensitivity),
        "noise_per_sensitivity": float(plan.noise_per_sensitivity),
        "teachers_per_query": {"min": int(min(queries.teachers_seen)) if queries.teachers_seen else None,
                               "max": int(max(queries.teachers_seen)) if queries.teachers_seen else None},
        "compressor": plan.compressor.describe(), "components": int(plan.compressor.latent_dim),
        "compressor_fit_maps": plan.fit_maps,
        "ae_collapsed": None if plan.collapse is None else plan.collapse["collapsed"], "ae_collapse": plan.collapse,
        "public_only_dice": evaluation.public_only_dice,
        "public_only_dice_mean": evaluation.public_only_dice.get("mean"),
        "public_only_dice_per_case": evaluation.public_only_dice_per_case,
        "ensemble_dice": evaluation.ensemble_dice,
        "ensemble_vote_dice_mean": _mean(evaluation.ensemble_vote_dice),
        "pseudo_label_dice_mean": _mean(evaluation.pseudo_label_dice),
        # the two ratios that say whether PATE carries what the hospitals know (simulation only:
        # the probability average needs every teacher's full-resolution output, which never leaves a hospital)
        "ensemble_probability_average_dice_mean": _mean(evaluation.ensemble_vote_dice),
        "ensemble_decoded_over_probability_average": _ratio(evaluation.ensemble_dice, evaluation.ensemble_vote_dice),
        "public_model_query_dice_mean": _mean(evaluation.public_model_query_dice),
        "pseudo_label_minus_public_model_query_dice": _difference(evaluation.pseudo_label_dice,
                                                                  evaluation.public_model_query_dice),
        "teacher_dice_per_hospital": evaluation.teacher_dice_per_hospital,
        "local_epsilon": {h: m.get("local_epsilon") for h, m in teachers.metrics.items()},
        # where each hospital trained its teachers (a deployed hospital chooses its own device)
        "hospital_devices": {h: m.get("device") for h, m in teachers.metrics.items()},
        "soft_labels": bool(config.soft_labels), "student_includes_reference": bool(config.include_reference),
        "stopped_early": queries.stopped_early,
        # counts only: a rejection's reason can carry numbers computed from private data (norms)
        "rejected_replies": {h: len(reasons) for h, reasons in queries.rejected.items()},
        "unreleased_queries": len(queries.unreleased),
        "fallback_teachers": fallback_counts(queries.notes),
        "dropped_hospitals": {h: public_dropout_reason(why) for h, why in outcome.dropped.items()},
        "bytes_up_measured_per_query_per_teacher": measured_bytes_per_teacher(queries.bytes_up),
        # public validation Dice: what model selection may look at (never the test set)
        "validation_dice_mean": evaluation.validation_dice_mean,
        "ledger_owners": ledger.owners(),
        "not_private_diagnostics": (["teacher_dice_mean", "ensemble_dice_mean", "ensemble_dice",
                                     "ensemble_vote_dice_mean", "pseudo_label_dice_mean",
                                     "ensemble_probability_average_dice_mean",
                                     "ensemble_decoded_over_probability_average",
                                     "pseudo_label_minus_public_model_query_dice",
                                     "teacher_dice_per_hospital"] if evaluation.diagnostics else [])
                                   # counts that depend on the hospitals' teachers, outside any DP guarantee
                                   + ["fallback_teachers"],
        "privacy_statement": (f"({results.epsilon:.4g}, {config.delta:g})-DP per patient, replace-one adjacency, "
                              f"{results.accountant} accountant over {len(queries.answered)} "
                              + ("distributed discrete Gaussian queries through a secure sum "
                                 f"({queries.secure['counted_shares']} counted noise shares)" if queries.secure else
                                 f"Gaussian queries (sigma={plan.sigma:.4g})")
                              + "; covers the pseudo-labels and the student"),
        "aggregation": (queries.secure or {}).get("aggregation", "trusted"),
        "secure_aggregation": queries.secure,
        "who_sees_what": who_sees_what(queries.secure),
    }
    release = ModelRelease(student.model, network_config_of(student.model, preset.unet), preprocessing_of(world), world.source,
                           # the label maps its Dice scored, not predicted a second time
                           test_predictions=(None if evaluation.test_predictions is None
                                             else (evaluation.test_predictions, world)))
    return write_run(out, results, release, started=started, real_check=config.real_check)


# ---------------------------------------------------------------------------------------------- helpers
def _without_diagnostics_if_deployed(config: PateConfig, transport: HospitalTransport) -> PateConfig:
    if config.diagnostics and any(transport.deployed.values()):
        return replace(config, diagnostics=False)
    return config


@dataclass(frozen=True)
class AnsweredBatch:
    """One query batch as the hospitals answered it: the query indices, their release ids, each hospital's
    (T_h, n, l) rows, and the teachers each asked hospital must answer with."""

    indices: list[int]
    release_ids: list[str]
    replies: Mapping[str, Any]
    asked: Mapping[str, int]


def _aggregate_batch(phase: QueryPhase, batch: AnsweredBatch, plan: ReleasePlan, guard: BudgetGuard,
                     noise: NoiseSource, bar) -> str | None:
    """One noisy mean per query of the batch (server.aggregation.aggregate_query); returns why the phase
    stops, if a charge would exceed a budget."""
    for j, index in enumerate(batch.indices):
        per_query = {}
        for hospital, rows in batch.replies.items():
            rows = np.asarray(rows)
            per_query[hospital] = rows[:, j, :] if rows.ndim == 3 and rows.shape[1] == len(batch.indices) else rows
        try:
            release = QueryRelease(batch.release_ids[j], plan.sigma, plan.compressor, state=plan.codec,
                                   expected_rows=batch.asked, stream=f"query-{index}", note={"query": int(index)})
            noisy, teachers = aggregate_query(per_query, release, guard, noise, rejected=phase.rejected)
        except BudgetExceeded as exc:
            return str(exc)
        if noisy is None:
            phase.unreleased.append(index)
        else:
            phase.answered.append(index)
            phase.latents.append(noisy)
            phase.teachers_seen.append(teachers)
        if bar is not None:
            bar.update(1)
    return None


def _largest_affordable(batch: list, guard, owners: list, sensitivity: float, sigma: float) -> tuple[list, str | None]:
    """The longest prefix of ``batch`` whose queries all fit every owner's budget (and, when none fits,
    the guard's reason); nothing is recorded."""
    refusal = None
    for size in range(len(batch), 0, -1):
        try:
            guard.check(owners, GaussianEvent(sensitivity=sensitivity, sigma=sigma, count=size))
            return batch[:size], None
        except BudgetExceeded as exc:
            refusal = refusal or str(exc)
    return [], refusal


def _progress_bar(total: int, description: str):
    return tqdm(total=total, desc=description, leave=False)


def _state_arrays(model) -> dict[str, np.ndarray]:
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in model.state_dict().items()}


def _label_dice(probs: np.ndarray, labels: np.ndarray) -> dict:
    return dice_scores(np.asarray(probs).argmax(axis=1), labels)


def _mean(dice: dict | None) -> float | None:
    return None if dice is None else dice.get("mean")


def _ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    top, bottom = _mean(numerator), _mean(denominator)
    return None if top is None or not bottom else float(top / bottom)


def _difference(first: dict | None, second: dict | None) -> float | None:
    a, b = _mean(first), _mean(second)
    return None if a is None or b is None else float(a - b)
