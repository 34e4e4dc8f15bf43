"""PATE without Flower: every hospital is a :class:`clients.hospital.Hospital` in this process.

``fedpate simulate --engine inprocess`` and ``fedpate compare`` call :func:`run_pate_inprocess`; the
Flower ServerApp calls the same :func:`server.pate.run_pate` with a Flower transport.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np


class InProcessTransport:
    """``server.pate.HospitalTransport`` over in-process hospitals. ``drop`` ({hospital: query round
    from which it stops answering}) simulates dropouts."""

    def __init__(self, hospitals, drop: Mapping[str, int] | None = None, base_config: Mapping | None = None):
        self.hospitals = {h.hospital_id: h for h in hospitals}
        self.drop = dict(drop or {})
        self.base_config = dict(base_config or {})   # what every message carries (ledger_dir, lifetime ε)
        self.deployed = {h: bool(getattr(m, "deployed", False)) for h, m in self.hospitals.items()}
        self.notes: list[dict[str, dict]] = []       # per query round: hospital -> what it said (counts)
        self.query_rounds = 0
        self.bytes_up: list[dict[str, int]] = []

    def hospital_ids(self) -> list[str]:
        return sorted(h for h in self.hospitals if self.drop.get(h, 1 << 60) > self.query_rounds)

    def train(self, config: dict, init_weights: Mapping[str, np.ndarray] | None = None) -> dict[str, dict]:
        return {h: self.hospitals[h].train_teachers({**self.base_config, **config, "init_weights": init_weights})
                for h in self.hospital_ids()}

    def query(self, scans, codec, config) -> dict[str, np.ndarray]:
        answers = {h: self.hospitals[h].answer_query(scans, codec, {**self.base_config, **config})
                   for h in self.hospital_ids()}
        replies = {h: rows for h, (rows, _) in answers.items()}
        if not config.get("diagnostic"):
            self.query_rounds += 1
            self.bytes_up.append({h: int(r.nbytes) for h, r in replies.items()})
            self.notes.append({h: notes for h, (_, notes) in answers.items()})
        return replies

    def evaluate(self, config: dict, test: Mapping[str, np.ndarray] | None = None) -> dict[str, dict]:
        return {h: self.hospitals[h].evaluate({**self.base_config, **config, **dict(test or {})})
                for h in self.hospital_ids()}

    def ensemble_probabilities(self, scans) -> np.ndarray:
        """Simulation-only diagnostic: the teachers' averaged probabilities (SPEC section 11 ceiling)."""
        total, count = None, 0
        for h in self.hospital_ids():
            part = self.hospitals[h].ensemble_probability_sum(scans)
            total = part if total is None else total + part
            count += self.hospitals[h].num_teachers
        return total / max(count, 1)


PHANTOM_SEED = 0


def build_world(preset, data=None, seed: int = 0, progress: bool = True, hospitals=None, teachers_per_hospital=None):
    """(prepared dataset, split) for a preset: phantoms generated once and cached when ``data`` is None."""
    from sim.data.partitions import make_split
    from sim.data.phantoms import ensure_phantoms
    from sim.data.preprocess import PreprocessConfig, prepare_dataset
    from sim.io import cache_root

    # The simulated dataset is one fixed world (generator seed PHANTOM_SEED) whatever the run's seed, which
    # drives the split and training: runs with different seeds are comparable on the same patients.
    root = Path(data) if data is not None else ensure_phantoms(preset, cache_root() / "phantoms",
                                                               seed=PHANTOM_SEED, progress=progress)
    cache = cache_root() / "prepared" / f"{root.name}-{'x'.join(map(str, preset.grid))}"
    prepared = prepare_dataset(root, cache, PreprocessConfig(grid=tuple(preset.grid)), progress=progress)
    split = make_split(prepared, hospitals or preset.hospitals, teachers_per_hospital or preset.teachers_per_hospital,
                       preset.split_scheme, preset.n_query, preset.n_reference, preset.n_validation, preset.n_test,
                       seed)
    return prepared, split


def run_pate_inprocess(preset_name: str, method: str, epsilon: float | None, delta: float | None, out,
                       seed: int = 0, data=None, hospitals: int | None = None,
                       teachers_per_hospital: int | None = None, progress: bool = True, *, prepared=None,
                       split=None, drop: Mapping[str, int] | None = None, hospitals_root=None,
                       hospital_config: Mapping | None = None, **options) -> dict:
    """Build the world (sim.data), one Hospital per split hospital, and run :func:`server.pate.run_pate`.

    ``hospital_config``: where the simulated hospitals keep their own ledgers and their lifetime budget
    (``RunSettings.hospital_privacy_config``); default: ``out/hospital-ledgers`` and this run's epsilon.
    """
    from clients.hospital import Hospital
    from server.pate import run_pate
    from sim.presets import get_preset
    from sim.world import load_world

    if isinstance(preset_name, str):
        preset = get_preset(preset_name, hospitals=hospitals, teachers_per_hospital=teachers_per_hospital)
    else:  # a Preset object (tests use shortened budgets)
        preset = preset_name
    epsilon = preset.epsilon if epsilon is None else float(epsilon)
    delta = preset.delta if delta is None else float(delta)
    if prepared is None or split is None:
        prepared, split = build_world(preset, data, seed, progress, hospitals, teachers_per_hospital)
    out = Path(out)
    world = load_world(prepared, split)
    # ``hospitals_root``: where the hospitals keep their teachers (shared across a comparison's cells)
    root = Path(hospitals_root) if hospitals_root is not None else out / "hospitals"
    members = [Hospital(h, prepared, split.hospitals[h], preset, root / h, seed)
               for h in sorted(split.hospitals)]
    hospital_config = dict(hospital_config or {"ledger_dir": str(out / "hospital-ledgers"),
                                               "lifetime_epsilon": epsilon, "delta": delta, "allow_identity": True})
    transport = InProcessTransport(members, drop=drop, base_config=hospital_config)
    results = run_pate(transport, world, preset, method, epsilon, delta, out, seed, progress=progress, **options)
    return results
