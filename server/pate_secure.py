"""PATE whose aggregator need not be trusted: the query phase through the secure sum with distributed noise.

In trusted PATE (``server/pate.py``) every hospital sends each teacher's encoding and the server adds the
Gaussian noise. Here (a PATE method whose record says ``secure_sum``, ``task.settings.methods``) each hospital sends, per query
batch, only the masked sum of its teachers' rounded encodings plus its own share of discrete Gaussian
noise (``clients/secure.py``); the server learns nothing but the sum over the K teachers with every
hospital's noise share in it (Kairouz, Liu & Steinke 2021, arXiv 2102.06387; SecAgg+, Bell et al. CCS
2020), divides by K and decodes as trusted PATE does (post-processing).

Calibration: the local variance v is the smallest with which ``N`` releases, each with the shares the
hospitals can count on (``participants - colluders - dropouts``), stay within (ε, δ)
(``privacy.distributed.calibrate_local_variance``); the integer grid is the coarsest with at most 0.1 %
rounding inflation of the row bound, and the modulus holds the sum except with probability 1e-9 per batch.
The replace-one sensitivity of the *sum* does not depend on K (one patient changes one teacher's row), so a
hospital that drops out changes K, not the guarantee.

What each party sees (the report's "who sees what"): the server -- public keys, ciphertexts it cannot read,
masked vectors that are uniform modulo 2^bits, and the noisy K-teacher sum; a hospital -- its own teachers
and the other hospitals' key shares; anyone reading the results -- the student and the noisy sums' decoding.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from privacy.distributed import (IntegerGrid, calibrate_local_variance, centered, ddg_event, modulus_bits,
                                 share_count, wrap_bound)
from privacy.errors import BudgetExceeded
from server.secure import SecureSumFailed, secure_sum
from server.transport import HospitalTransport
from task import codecs
from task.settings import methods
from task.errors import UserError
from task.wire.requests import SecureStageRequest
from task.wire.secagg import smallest_threshold, threat_problem

log = logging.getLogger("fedpate.pate")

#: what a secure run assumes unless told otherwise: no colluding hospital, no dropout (a hospital that leaves
#: then stops the release of its batch: the survivors refuse to unmask), the smallest Shamir threshold
DEFAULT_THREAT = {"colluders": 0, "dropouts": 0}

WRAP_PROBABILITY = 1e-9


def is_secure(method: str) -> bool:
    """Whether ``method`` is a registered PATE method whose queries go through the secure sum (its record's
    ``secure_sum``; its codec and decoder are its codec kind's, as a trusted PATE method's)."""
    return method in methods.names(protocol=methods.Protocol.PATE, secure_sum=True)


def threat_model(config) -> dict:
    """The secure sums' threat model: a run configuration's ``secure`` settings (or those settings as a
    mapping) over :data:`DEFAULT_THREAT`."""
    given = dict((config if isinstance(config, Mapping) else getattr(config, "secure", None)) or {})
    unknown = set(given) - {"colluders", "dropouts", "threshold"}
    if unknown:
        raise UserError(f"secure aggregation: unknown setting(s) {sorted(unknown)} (colluders, dropouts, threshold)")
    return {**DEFAULT_THREAT, **given}


def checked_threshold(method: str, participants: int, threat: Mapping[str, Any]) -> int:
    """The Shamir threshold of a secure sum over ``participants`` hospitals under ``threat`` (its ``threshold``,
    else the smallest safe one, ``task.wire.secagg.smallest_threshold``); UserError, before anything is charged,
    when the threat model makes the sum impossible or unsafe (``task.wire.secagg.threat_problem``)."""
    colluders, dropouts = int(threat["colluders"]), int(threat["dropouts"])
    threshold = int(threat.get("threshold") or smallest_threshold(participants, colluders, dropouts))
    problem = threat_problem(participants, colluders, dropouts, threshold)
    if problem:
        raise UserError(f"{method}: {problem}")
    return threshold


@dataclass(frozen=True)
class SecureQueryPlan:
    """How every secure query sum of a run is made: the Shamir threshold, the noise shares every hospital counts,
    the integer grid, the local variance, one query's privacy event, the modulus bits, the released mean's noise
    and the declaration each hospital checks (:func:`plan_secure_queries`)."""

    threshold: int
    counted: int
    grid: IntegerGrid
    variance: float
    per_query: Any
    bits: int
    mean_sigma: float
    declaration: dict


@dataclass(frozen=True)
class SecureQueryShape:
    """The size of a run's secure query sums.

    Attributes:
        teachers: K, the teachers whose encodings are summed.
        participants: H, the hospitals taking part.
        latent: the encoding's length per scan.
        batch_size: the scans summed in one secure sum.
    """

    teachers: int
    participants: int
    latent: int
    batch_size: int


def plan_secure_queries(method: str, codec, shape: SecureQueryShape, threat: Mapping[str, Any],
                        epsilon: float, delta: float, queries: int) -> SecureQueryPlan:
    """The secure query phase's plan: the smallest local variance with which ``queries`` releases, each with the
    shares the hospitals count on, stay within (ε, δ); the coarsest grid with 0.1 % rounding inflation of the
    codec's row bound; bits for a batch of queries of every teacher's rows that wrap with probability at most
    :data:`WRAP_PROBABILITY`.

    Args:
        method: the secure method's name (for errors).
        codec: the verified codec, whose row bound sets the grid.
        shape: teachers, hospitals, encoding length and batch size of the sums.
        threat: colluders, dropouts and an optional threshold (UserError if the hospitals cannot hold it).
        epsilon: the run's budget ε.
        delta: its δ.
        queries: the number of queries released.
    """
    teachers, participants, latent, batch_size = shape.teachers, shape.participants, shape.latent, shape.batch_size
    threshold = checked_threshold(method, participants, threat)
    counted = share_count(participants, threat["colluders"], threat["dropouts"])
    grid = IntegerGrid.for_rows(codecs.row_bound(codec), latent)
    variance = calibrate_local_variance(epsilon, delta, queries, grid, counted)
    bits = modulus_bits(teachers * grid.row_bound, participants * variance, batch_size * latent, WRAP_PROBABILITY)
    declaration = {"local_variance": variance, "shares": counted, "total_variance": counted * variance,
                   "colluders": int(threat["colluders"]), "dropouts": int(threat["dropouts"]),
                   "clip": grid.clip, "granularity": grid.granularity, "dimension": latent}
    return SecureQueryPlan(threshold, counted, grid, variance, ddg_event(grid, variance, counted, 1), bits,
                           grid.granularity * math.sqrt(participants * variance) / teachers, declaration)


def run_secure_query_phase(transport: HospitalTransport, world, plan, teachers, config, guard, noise, phase_type):
    """Step 4 of :func:`server.pate.run_pate` for a secure method: returns ``(QueryPhase, plan)``, the plan's
    ``sigma`` now the standard deviation of the released mean's noise (what the decoder assumes).

    Each batch is one secure sum over the hospitals still connected; the run's ledger is charged (one
    distributed-discrete-Gaussian release per query, the counted shares) before the sum is unmasked, and each
    hospital charges its own before it draws its share. A batch whose sum fails (too few hospitals stayed,
    or they refused) is not released.

    Args:
        transport: the hospitals, reached through the transport contract.
        world: the public query scans and the world's description.
        plan: the query plan of the trusted method (codec, compressor, queries); its sigma is replaced.
        teachers: the trained teachers per hospital (K in all).
        config: the run's PATE configuration (budget, query batch, threat model).
        guard: the run ledger's guard, charged before each sum is unmasked.
        noise: the run's noise source (secure unless reproducible noise was asked for).
        phase_type: the query phase record to fill.
    """
    threat = threat_model(config)
    phase = phase_type()
    hospitals = sorted(h for h in transport.hospital_ids() if h in teachers.per_hospital)
    participants = len(hospitals)
    batch_size = max(1, int(config.query_batch))
    K = teachers.total
    latent = int(plan.compressor.latent_dim)
    secure = plan_secure_queries(config.method, plan.codec, SecureQueryShape(K, participants, latent, batch_size),
                                 threat, config.epsilon, config.delta, plan.queries)
    threshold, counted, grid, variance = secure.threshold, secure.counted, secure.grid, secure.variance
    per_query, bits, mean_sigma, declaration = secure.per_query, secure.bits, secure.mean_sigma, secure.declaration
    plan = replace(plan, sigma=mean_sigma)
    run_nonce = secrets.token_hex(4)
    record = {"aggregation": "secure", "participants": participants, "colluders": threat["colluders"],
              "dropouts": threat["dropouts"], "threshold": threshold, "counted_shares": counted,
              "local_variance": variance, "granularity": grid.granularity, "row_bound": grid.row_bound,
              "bits": bits, "wrap_probability_bound": wrap_bound(bits, K * grid.row_bound, participants * variance,
                                                                   batch_size * latent),
              "released_mean_sigma": mean_sigma, "failed_batches": 0, "bytes_up_per_hospital": [],
              "bytes_down_per_hospital": []}
    first_round = len(transport.bytes_up)
    for start in range(0, plan.queries, batch_size):
        batch = list(range(start, min(plan.queries, start + batch_size)))
        asked = sorted(h for h in transport.hospital_ids() if h in teachers.per_hospital)
        if asked != hospitals:
            phase.stopped_early = (f"hospitals {sorted(set(hospitals) - set(asked))} left; the noise was planned for "
                                   f"{participants} participants")
            break
        release_ids = [f"{config.method}:{run_nonce}:query-{index}" for index in batch]
        try:
            guard.charge_all(asked, per_query, release_ids,
                             {"secure_sum": True, "counted_shares": counted, "participants": participants})
        except BudgetExceeded as exc:
            phase.stopped_early = str(exc)
            break
        codec = plan.codec_for(batch)
        # with reproducible noise (simulation only) each hospital seeds its rounding and noise shares by the run's
        # seed and a stream named by what the release is (the query batch), so the run repeats; a deployed
        # hospital refuses it
        settings = SecureStageRequest(method=config.method, seed=config.seed, delta=float(config.delta),
                                      device=config.compute.device, precision=config.compute.precision,
                                      secure_noise_seed=int(config.seed) if noise.is_reproducible else None
                                      ).to_config()
        stream = f"{config.method}:eps-{float(config.epsilon):g}:queries-{batch[0]}-{batch[-1]}"
        try:
            result = secure_sum(lambda stage, messages: transport.secure_stage(stage, messages, settings), asked,
                                threshold, bits, len(batch) * latent, {**declaration, "release_ids": release_ids},
                                {h: {"scans": world.query_images[batch], "codec": codec, "stream": stream}
                                 for h in asked})
        except SecureSumFailed as exc:
            log.warning("secure batch %s not released: %s", batch, exc)
            record["failed_batches"] += 1
            phase.unreleased.extend(batch)
            continue
        answered = sum(teachers.per_hospital[h] for h in result.survivors)
        sums = grid.to_reals(centered(result.total, bits)).reshape(len(batch), latent)
        for j, index in enumerate(batch):
            phase.answered.append(index)
            phase.latents.append((sums[j] / answered).astype(np.float32))
            phase.teachers_seen.append(int(answered))
        for h, why in result.dropped.items():
            phase.rejected.setdefault(h, []).append(f"dropped at {why}")
        record["bytes_up_per_hospital"].append(dict(result.bytes_up))
        record["bytes_down_per_hospital"].append(dict(result.bytes_down))
        transport.bytes_up.append({h: result.bytes_up[h] / max(1, teachers.per_hospital[h] * len(batch))
                                   for h in result.survivors})
    phase.bytes_up = list(transport.bytes_up[first_round:])
    phase.secure = record
    return phase, plan


def who_sees_what(secure: Mapping[str, Any] | None) -> dict[str, str]:
    """What each party could see in a PATE run (the report prints it per cell)."""
    if not secure:
        return {"aggregator": "every teacher's un-noised encoding of every query scan (trusted to add the noise)",
                "hospitals": "their own teachers only",
                "results": "the student and the decoded noisy means"}
    return {"aggregator": (f"masked vectors (uniform modulo 2^{secure['bits']}) and the K-teacher sum with the "
                           f"noise shares of {secure['participants']} hospitals; with up to {secure['colluders']} "
                           f"colluding hospital(s) still at least {secure['counted_shares']} honest shares"),
            "hospitals": "their own teachers, the others' public keys and encrypted key shares",
            "results": "the student and the decoded noisy means"}
