"""The protocols without Flower: every hospital is a :class:`clients.hospital.Hospital` in this process.

``fedpate simulate --engine inprocess`` and ``fedpate compare --engine inprocess`` run their cells through
:class:`InProcessTransport`; the Flower ServerApp runs the very same protocol code
(``server.protocols.run_cell``) over a ``server.flower_transport.FlowerTransport``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from clients.fedavg import local_dpsgd_round
from clients.hospital import Hospital, HospitalSettings
from clients.secure import SecureHospital, run_stage
from privacy.errors import PrivacyError
from server.pate import PateConfig, run_pate
from server.protocols import PhasedTransport
from task.learning.compute import Compute, check_compute
from task.errors import UserError
from task.settings import methods
from task.settings.presets import get_preset
from task.wire.requests import HospitalRequest
from task.settings.runconfig import check_epsilon
from task.world import build_world, load_world

log = logging.getLogger("fedpate.inprocess")


class InProcessTransport:
    """``server.transport.HospitalTransport`` over in-process hospitals, with the simulation-only
    ``TeacherEnsembleDiagnostics``. ``drop`` ({hospital: query round from which it stops answering})
    simulates dropouts."""

    def __init__(self, hospitals, drop: Mapping[str, int] | None = None, base_config: Mapping | None = None):
        self.hospitals = {h.hospital_id: h for h in hospitals}
        self.drop = dict(drop or {})
        self.base_config = dict(base_config or {})   # what every message carries (ledger_dir, lifetime ε)
        self.deployed = {h: bool(getattr(m, "deployed", False)) for h, m in self.hospitals.items()}
        self.dropped: dict[str, str] = {}
        self.notes: list[dict[str, dict]] = []       # per query round: hospital -> what it said (counts)
        self.bytes_up: list[dict[str, float]] = []   # per query round: hospital -> bytes per teacher per scan
        self.query_rounds = 0
        self.secure_parties: dict[str, SecureHospital] = {}   # each hospital's side of the secure sums
        #: each hospital's per-session secrets between stages (``clients.secure.run_stage``; on a Flower node
        #: they live in its ``context.state``)
        self.secure_state: dict[str, dict] = {}
        self.secure_drop: dict[str, str] = {}

    def hospital_ids(self) -> list[str]:
        for hospital, round_index in self.drop.items():
            if round_index <= self.query_rounds and hospital in self.hospitals:
                self.dropped.setdefault(hospital, f"simulated dropout from query round {round_index}")
        return sorted(h for h in self.hospitals if h not in self.dropped)

    def train(self, config: Mapping[str, Any], init_weights: Mapping[str, np.ndarray] | None = None
              ) -> dict[str, dict]:
        return {h: self.hospitals[h].train_teachers({**self.base_config, **config, "init_weights": init_weights})
                for h in self.hospital_ids()}

    def query(self, scans, codec, config) -> dict[str, np.ndarray]:
        answers = {h: self.hospitals[h].answer_query(scans, codec, {**self.base_config, **config})
                   for h in self.hospital_ids()}
        replies = {h: rows for h, (rows, _) in answers.items()}
        if not config.get("diagnostic"):
            self.query_rounds += 1
            self.bytes_up.append({h: rows.nbytes / max(1, rows.shape[0] * len(scans)) for h, rows in replies.items()})
            self.notes.append({h: notes for h, (_, notes) in answers.items()})
        return replies

    def evaluate(self, config: Mapping[str, Any], test: Mapping[str, np.ndarray] | None = None) -> dict[str, dict]:
        return {h: self.hospitals[h].evaluate({**self.base_config, **config, **dict(test or {})})
                for h in self.hospital_ids()}

    def fedavg_round(self, weights: Mapping[str, np.ndarray], config: Mapping[str, Any]
                     ) -> dict[str, tuple[dict, dict]]:
        replies = {}
        for h in self.hospital_ids():
            new_weights, metrics = local_dpsgd_round(self.hospitals[h], weights, {**self.base_config, **config})
            replies[h] = ({"hospital_id": h, **metrics}, new_weights)
        return replies

    def secure_stage(self, stage: str, messages: Mapping[str, Mapping[str, Any]], config: Mapping[str, Any]
                     ) -> dict[str, dict]:
        """A secure-sum stage (``server/secure.py``) at each hospital's ``clients.secure.SecureHospital``,
        through ``clients.secure.run_stage`` as the Flower ClientApp does; a refusal (its policy, its budget)
        is logged and the hospital is absent from the replies. ``secure_drop`` ({hospital: stage}) simulates
        a hospital leaving mid-protocol."""
        replies = {}
        for h, message in messages.items():
            if h in self.dropped or self.secure_drop.get(h) == stage:
                self.secure_drop.pop(h, None)
                continue
            party = self.secure_parties.setdefault(h, SecureHospital(self.hospitals[h]))
            try:
                replies[h] = run_stage(party, stage, message, {**self.base_config, **config},
                                       self.secure_state.setdefault(h, {}))
            except (UserError, PrivacyError) as exc:
                log.warning("hospital %s refused the secure-sum stage %s: %s", h, stage, exc)
        return replies

    def ensemble_probabilities(self, scans, config: Mapping[str, Any] | None = None) -> np.ndarray:
        """Simulation-only diagnostic: the teachers' averaged probabilities (the ceiling PATE can reach).
        ``config``: the run's ``device`` / ``precision`` (the hospitals' default otherwise: auto)."""
        total, count = None, 0
        for h in self.hospital_ids():
            part = self.hospitals[h].ensemble_probability_sum(scans, {**self.base_config, **dict(config or {})})
            total = part if total is None else total + part
            count += self.hospitals[h].num_teachers
        return total / max(count, 1)


def simulated_hospitals(prepared, split, preset, root: str | Path, seed: int = 0) -> list[Hospital]:
    """One :class:`Hospital` per hospital of the split, each keeping its teachers under ``root/<id>``."""
    return [Hospital(h, prepared, split.hospitals[h], preset, Path(root) / h, HospitalSettings(seed=seed))
            for h in sorted(split.hospitals)]


@dataclass(frozen=True)
class InProcessPateRun:
    """One PATE run with every hospital simulated in this process (:func:`run_pate_inprocess`), validated on
    construction.

    Args:
        preset: a preset's name (or a variant's reference), resolved with ``hospitals`` and
            ``teachers_per_hospital``, or a :class:`task.settings.presets.Preset` used as it is (tests use shortened budgets).
        method: the PATE method (a ``task.settings.methods`` record whose protocol is ``pate``).
        out: the run folder (``server.pate.run_pate``).
        epsilon / delta: the run's budget (None = the preset's).
        seed: the world's split, the hospitals' and the server's training; the noise only when ``noise`` is
            reproducible.
        data: an MSD Task01 or BraTS folder (None = the preset's phantoms).
        hospitals / teachers_per_hospital: override the preset's (None = the preset's).
        prepared / split: a world already built (both, or the world is built from the preset).
        drop: {hospital: query round from which it stops answering}, a simulated dropout (None = none).
        hospitals_root: where the hospitals keep their teachers (shared across a comparison's cells; None =
            ``out/hospitals``).
        hospital_config: where the simulated hospitals keep their own ledgers and their lifetime budget
            (``RunSettings.hospital_privacy_config``); default: ``out/hospital-ledgers`` and this run's epsilon.
        noise: the ``privacy.mechanisms.NoiseSource`` of the releases (None = secure).
        compute: the server's and the simulated hospitals' device and precision, and progress bars.
        options: the other :class:`server.pate.PateConfig` fields (``query_batch``, ``diagnostics``, ...).
    """

    preset: Any
    method: str
    out: Path
    epsilon: float | None = None
    delta: float | None = None
    seed: int = 0
    data: str | None = None
    hospitals: int | None = None
    teachers_per_hospital: int | None = None
    prepared: Any = None
    split: Any = None
    drop: Mapping[str, int] | None = None
    hospitals_root: Path | None = None
    hospital_config: Mapping[str, Any] | None = None
    noise: Any = None
    compute: Compute = Compute()
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        pate_methods = methods.names(protocol=methods.Protocol.PATE)
        if self.method not in pate_methods:
            raise UserError(f"method: expected one of {', '.join(pate_methods)}, got {self.method!r}")
        if self.epsilon is not None:
            object.__setattr__(self, "epsilon", check_epsilon(self.epsilon, "epsilon"))
        if self.delta is not None and not 0 < float(self.delta) < 1:
            raise UserError(f"delta: expected a number in (0, 1), got {self.delta!r}")
        if (self.prepared is None) != (self.split is None):
            raise UserError("prepared / split: give both (a world already built) or neither")
        check_compute(self.compute)
        known = {f.name for f in dataclasses.fields(PateConfig)} - {"method", "epsilon", "delta", "seed", "compute"}
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise UserError(f"options: unknown PateConfig field(s) {', '.join(unknown)}; expected some of "
                            f"{', '.join(sorted(known))}")
        object.__setattr__(self, "out", Path(self.out))
        object.__setattr__(self, "options", dict(self.options))
        if self.hospitals_root is not None:
            object.__setattr__(self, "hospitals_root", Path(self.hospitals_root))


def run_pate_inprocess(run: InProcessPateRun) -> dict:
    """Build the world (task.world), one Hospital per split hospital, and run :func:`server.pate.run_pate`
    (``run``: :class:`InProcessPateRun`)."""
    preset = (get_preset(run.preset, hospitals=run.hospitals, teachers_per_hospital=run.teachers_per_hospital)
              if isinstance(run.preset, str) else run.preset)
    epsilon = preset.epsilon if run.epsilon is None else float(run.epsilon)
    delta = preset.delta if run.delta is None else float(run.delta)
    prepared, split = run.prepared, run.split
    if prepared is None:
        prepared, split = build_world(preset, run.data, run.seed, run.compute.progress, run.hospitals,
                                      run.teachers_per_hospital)
    out = run.out
    # ``hospitals_root``: where the hospitals keep their teachers (shared across a comparison's cells)
    members = simulated_hospitals(prepared, split, preset,
                                  run.hospitals_root if run.hospitals_root is not None else out / "hospitals", run.seed)
    hospital_config = dict(run.hospital_config or HospitalRequest(ledger_dir=str(out / "hospital-ledgers"),
                                                                  lifetime_epsilon=epsilon, delta=delta,
                                                                  allow_identity=True).to_config())
    # the hospitals' work timed as the cell's phases (teachers, queries), as server.protocols.run_cell does
    transport = PhasedTransport(InProcessTransport(members, drop=run.drop, base_config=hospital_config))
    config = PateConfig(run.method, epsilon, delta, seed=run.seed, compute=run.compute, **run.options)
    return run_pate(transport, load_world(prepared, split), preset, config, out, noise=run.noise)
