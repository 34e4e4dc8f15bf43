"""One cell of a run plan -- a method at a budget -- through the protocol that method names, over any
:class:`server.transport.HospitalTransport`. The ServerApp (server/server_app.py) and the in-process
engine (sim/runners/simulation.py) run their cells through :func:`run_cell`, so both run the same code.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from pathlib import Path

from server.dpfedavg import DpFedAvgConfig, run_dpfedavg
from server.dpfedavg_secure import DpFedAvgSecureConfig, run_dpfedavg_secure
from server.selftrain import train_public_models
from task.errors import UserError
from task.learning.phases import timed
from server.pate import PateConfig, run_pate
from server.transport import HospitalTransport
from task.settings.methods import Protocol
from task.options import Init
from task.settings.registry import Registry
from task.settings.runconfig import Cell, RunSettings
from task.world import PublicWorld


def run_cell(transport: HospitalTransport, world: PublicWorld, settings: RunSettings, cell: Cell) -> dict:
    """Run ``cell`` through the protocol its method's record names (:data:`PROTOCOLS`) and return its results."""
    if isinstance(cell, Mapping):
        cell = Cell.from_dict(cell)
    protocol = cell.record.protocol
    if protocol not in PROTOCOLS:
        raise UserError(f"{cell.method}: no federated protocol {protocol!r} (registered: {', '.join(PROTOCOLS)})")
    return PROTOCOLS.get(protocol)(PhasedTransport(transport), world, settings, cell)


class PhasedTransport:
    """A transport whose calls count as the phases of a cell's cost (``task.learning.phases``): the server waits for the
    hospitals' training (``teachers``), their answers to queries (``queries``), their scoring (``evaluation``) and
    their federated rounds (``training``). Everything else is the wrapped transport's."""

    _PHASES = {"train": "teachers", "query": "queries", "evaluate": "evaluation", "fedavg_round": "training",
               "secure_stage": "training"}

    def __init__(self, transport: HospitalTransport) -> None:
        self._transport = transport
        # an optional capability stays visible to isinstance checks of runtime protocols, which look the attribute up
        # statically (TeacherEnsembleDiagnostics)
        if hasattr(transport, "ensemble_probabilities"):
            self.ensemble_probabilities = transport.ensemble_probabilities

    def __getattr__(self, name: str):
        value = getattr(self._transport, name)
        if name in self._PHASES and callable(value):
            return timed(self._PHASES[name])(value)
        return value


def start_weights(world: PublicWorld, settings: RunSettings, cell: Cell) -> dict[str, np.ndarray] | None:
    """The start model's weights for a cell that starts from it (``cell.init`` is ``Init.PUBLIC``): the same model
    PATE's teachers and student start from, shared with the comparison's other cells through ``cell.shared_dir``;
    None (random weights) for ``scratch``."""
    if cell.init is not Init.PUBLIC:
        return None
    public = train_public_models(world, settings.resolved_preset, seed=settings.seed,
                                 checkpoint=Path(cell.shared_dir) / "public-model.pt" if cell.shared_dir else None,
                                 compute=settings.compute)
    return {k: v.detach().cpu().numpy() for k, v in public.start.state_dict().items()}


def run_dpfedavg_cell(transport: HospitalTransport, world: PublicWorld, settings: RunSettings, cell: Cell) -> dict:
    """DP-FedAvg from the public model (or random weights); the hospitals draw their own noise
    (clients/fedavg.py)."""
    preset = settings.resolved_preset
    start = start_weights(world, settings, cell)
    config = DpFedAvgConfig(cell.epsilon, settings.resolved_delta, seed=settings.seed,
                            reproducible_noise=settings.reproducible_noise, init=cell.init, compute=settings.compute,
                            method=cell.method, real_check=settings.real_check)
    return run_dpfedavg(transport, world, preset, config, cell.out, init_weights=start)


def run_dpfedavg_secure_cell(transport: HospitalTransport, world: PublicWorld, settings: RunSettings,
                             cell: Cell) -> dict:
    """Distributed DP gradient descent through secure sums (``server.dpfedavg_secure``), from the same start
    model as DP-FedAvg and pooled DP-SGD; the hospitals draw their own noise shares."""
    preset = settings.resolved_preset
    start = start_weights(world, settings, cell)
    config = DpFedAvgSecureConfig(cell.epsilon, settings.resolved_delta, seed=settings.seed,
                                  reproducible_noise=settings.reproducible_noise, init=cell.init,
                                  compute=settings.compute, threat=settings.threat_model, method=cell.method,
                                  real_check=settings.real_check)
    return run_dpfedavg_secure(transport, world, preset, config, cell.out, init_weights=start)


def run_pate_cell(transport: HospitalTransport, world: PublicWorld, settings: RunSettings, cell: Cell) -> dict:
    """PATE (Fay et al., Algorithms 1-2) with the cell's method's codec; its noise comes from the cell's own
    namespace (``RunSettings.cell_noise_source``)."""
    config = PateConfig(cell.method, cell.epsilon, settings.resolved_delta, seed=settings.seed,
                        calibration=settings.calibration, query_batch=settings.query_batch,
                        shared_dir=cell.shared_dir, compute=settings.compute,
                        secure=settings.threat_model if cell.record.secure_sum else None,
                        real_check=settings.real_check)
    return run_pate(transport, world, settings.resolved_preset, config, cell.out,
                    noise=settings.cell_noise_source(cell))


#: a federated method record's ``protocol`` -> the function that runs one of its cells (the one
#: place a protocol is chosen; ``register_protocol`` adds one)
PROTOCOLS: Registry[Callable[[HospitalTransport, PublicWorld, RunSettings, Cell], dict]] = Registry("protocol")
register_protocol = PROTOCOLS.register
register_protocol(Protocol.PATE, run_pate_cell)
register_protocol(Protocol.DP_FEDAVG, run_dpfedavg_cell)
register_protocol(Protocol.DP_FEDAVG_SECURE, run_dpfedavg_secure_cell)
