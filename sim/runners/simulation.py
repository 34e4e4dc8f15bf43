"""Run the fedpate Flower apps in Flower's simulation engine (``fedpate simulate``, ``fedpate compare``).

Engines:
- ``flower`` (default): ``flwr.simulation.run_simulation`` in this process (Ray backend, one virtual
  SuperNode per hospital, 1 CPU each). The ServerApp's settings are bound in with ``make_app``.
- ``runtime``: the simulation runtime behind ``flwr run`` (a ``--simulation`` SuperLink started on a free
  loopback port and stopped by PID; sim/deployment/runtime_simulation.py) -- the same path ``flwr run .`` takes.
- ``inprocess``: no Flower at all (sim/runners/inprocess.py); same protocol code (server/protocols.py),
  fastest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Iterator

from sim.deployment.flower_cli import FLOWER_ENV, PROJECT_ROOT
from sim.deployment.runtime_simulation import RuntimeSimulation, run_runtime_simulation
from server.protocols import run_cell
from task.errors import UserError
from task.options import Engine, look_up_option
from task.settings.runconfig import Cell, RunSettings
from sim.runners.inprocess import InProcessTransport, simulated_hospitals
from task.world import load_world, materialise_world, open_world

#: Flower's environment, and every hospital's log line shown (Ray folds repeated lines by default)
SIMULATION_ENV = {**FLOWER_ENV, "RAY_DEDUP_LOGS": "0"}


def simulate(settings: RunSettings, engine: str = Engine.FLOWER, cells: list[Cell] | None = None) -> list[dict]:
    """Run the configured method (or the given :class:`task.settings.runconfig.Cell` s) with all hospitals simulated on
    this machine."""
    engine = look_up_option(engine, Engine, "--engine")
    for key, value in SIMULATION_ENV.items():
        os.environ.setdefault(key, value)
    if not settings.world:  # a caller (compare) may already have materialised it
        world = materialise_world(settings.resolved_preset, settings.data, settings.seed, settings.compute.progress,
                                  layout=settings.layout, partition_file=settings.partition_file)
        settings = settings.replace(world=str(world))
    if cells:
        settings = settings.replace(cells=tuple(c if isinstance(c, Cell) else Cell.from_dict(c) for c in cells))
    cells = settings.planned_cells()
    if engine is Engine.INPROCESS:
        return _run_inprocess(settings, cells)
    if engine is Engine.FLOWER:
        _run_flower_inprocess(settings, cells)
    else:
        _run_runtime(settings, cells)
    results = []
    for cell in cells:
        path = Path(cell.out) / "results.json"
        if not path.exists():
            raise UserError(f"simulation finished without {path}: the ServerApp failed (see the log above)")
        results.append(json.loads(path.read_text()))
    return results


def _settings_fields(settings: RunSettings) -> dict[str, Any]:
    """Every field of ``settings`` as the ServerApp's overrides (its cells and real-scan check included), with the
    budget and delta resolved."""
    resolved = {"epsilon": settings.budget, "delta": settings.resolved_delta}
    return {f.name: resolved.get(f.name, getattr(settings, f.name)) for f in dataclasses.fields(RunSettings)}


def _run_flower_inprocess(settings: RunSettings, cells) -> None:
    # Flower (and Ray behind it) only for this engine: the in-process engine never pays for importing them
    from flwr.simulation import run_simulation

    from clients.client_app import app as client_app
    from server.server_app import make_app

    for cell in cells:  # a stale result must not pass for this run's
        (Path(cell.out) / "results.json").unlink(missing_ok=True)
    server_app = make_app(**_settings_fields(settings))
    logging.getLogger("flwr").setLevel(logging.WARNING)
    hospitals = settings.resolved_preset.hospitals
    gpus = client_gpus(settings.compute.device, hospitals)
    with quiet_flower():
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=hospitals,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": gpus},
                                       "init_args": {"log_to_driver": True}})


#: what Flower and Ray tell a developer about the library calls fedpate makes, never the user's to act on:
#: Flower's notice that ``run_simulation`` is deprecated in favour of ``flwr run`` (``--engine runtime`` is
#: that path), and Ray's tip on how it will set CUDA_VISIBLE_DEVICES for workers asking no GPU
FLOWER_NOTICES = ("DEPRECATED FEATURE",)
RAY_TIPS = r"Tip: In future versions of Ray"


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(notice in message for notice in FLOWER_NOTICES)


@contextlib.contextmanager
def quiet_flower() -> Iterator[None]:
    """Silence, for the block, the library notices a user of ``fedpate simulate`` need not see
    (:data:`FLOWER_NOTICES`, :data:`RAY_TIPS`); every other Flower or Ray warning and error still shows."""
    flower = logging.getLogger("flwr")
    dropping = _DropNotices()
    flower.addFilter(dropping)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=RAY_TIPS, category=FutureWarning)
            yield
    finally:
        flower.removeFilter(dropping)


def client_gpus(device: str, hospitals: int) -> float:
    """Ray's GPU share per simulated hospital: 0 on the CPU; with a GPU every hospital gets an equal share of
    the GPUs this process sees, so that Ray schedules the hospitals' workers onto them and sets their
    ``CUDA_VISIBLE_DEVICES`` (a worker that asked for no GPU is not promised one). Not run here: no GPU on the
    build machine."""
    from task.learning.device import resolve_device

    if resolve_device(device).type != "cuda":
        return 0.0
    import torch

    return min(1.0, torch.cuda.device_count() / max(1, hospitals))


def _run_runtime(settings: RunSettings, cells) -> None:
    if len(cells) != 1:
        raise UserError("--engine runtime runs one cell at a time (use --engine flower for comparisons)")
    if settings.real_check is not None:   # the run config carries no open check: the ServerApp could not score
        raise UserError("--real-check: needs --engine flower or inprocess (the ServerApp then runs in this process "
                        "and scores the model it releases); --engine runtime runs it elsewhere")
    cell = cells[0]
    (Path(cell.out) / "results.json").unlink(missing_ok=True)
    run_config = {**settings.replace(method=cell.method, epsilon=cell.epsilon,
                                     out=str(Path(cell.out).resolve()), init=cell.init).to_run_config(),
                  "world": settings.world}
    run_runtime_simulation(RuntimeSimulation(PROJECT_ROOT, run_config, settings.resolved_preset.hospitals,
                                             Path(cell.out) / "runtime", timeout=3600))


def _run_inprocess(settings: RunSettings, cells) -> list[dict]:
    """Every cell through the same protocol code as the ServerApp, the hospitals as objects in this process
    (their teachers under the world's ``nodes/``, shared by the cells)."""
    prepared, split = open_world(settings.world)
    world = load_world(prepared, split)
    results = []
    for cell in cells:
        hospitals = simulated_hospitals(prepared, split, settings.resolved_preset, Path(settings.world) / "nodes",
                                        settings.seed)
        transport = InProcessTransport(hospitals,
                                       base_config=settings.replace(out=cell.out).hospital_privacy_config())
        results.append(run_cell(transport, world, settings, cell))
    return results
