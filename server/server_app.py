"""The aggregator's Flower ServerApp: a thin adapter; the protocols live in server/pate.py and
server/dpfedavg.py and are the same code the in-process engine runs (server/protocols.py).

Configured by ``[tool.flwr.app.config]`` in pyproject.toml (``flwr run . -c 'method="pate-pca" epsilon=2'``)
or, in-process, by :func:`make_app` (used by ``fedpate simulate`` and ``fedpate compare``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from server.flower_transport import FlowerTransport, TransportSettings
from server.protocols import run_cell
from task.errors import UserError
from task.wire.requests import RunContext
from task.settings.runconfig import RunSettings
from task.world import load_world, materialise_world, open_world

log = logging.getLogger("fedpate.server")


def run_federation(grid: Grid, settings: RunSettings) -> list[dict]:
    """Connect to the hospitals, then run every cell (method x epsilon) of the plan through them."""
    world_dir = settings.world or materialise_world(settings.resolved_preset, settings.data, settings.seed,
                                                    settings.compute.progress, layout=settings.layout,
                                                    partition_file=settings.partition_file)
    world = load_world(*open_world(world_dir))
    hospitals = connect_hospitals(grid, settings, world_dir)
    refuse_seeded_noise_in_deployment(settings, hospitals.deployed)
    results = []
    for cell in settings.planned_cells():
        results.append(run_cell(hospitals, world, settings, cell))
        log.info("%s at epsilon=%s: results in %s", cell.method, cell.epsilon, cell.out)
    return results


def connect_hospitals(grid: Grid, settings: RunSettings, world_dir) -> FlowerTransport:
    """The hospitals connected to ``grid`` (waiting up to ``wait_seconds`` for the preset's number). Every
    message carries the preset, the seed, the simulated world's folder (simulated hospitals find their
    partitions there; deployed ones ignore it) and the simulated hospitals' privacy settings."""
    preset = settings.resolved_preset
    context = RunContext(preset=settings.preset, seed=settings.seed, world=str(world_dir),
                         preset_overrides={"hospitals": preset.hospitals,
                                           "teachers_per_hospital": preset.teachers_per_hospital})
    hospitals = FlowerTransport(grid, TransportSettings(
        preset.hospitals, wait_seconds=settings.wait_seconds, reply_timeout=settings.reply_timeout,
        query_timeout=settings.query_timeout,
        base_config={**context.to_config(), **settings.hospital_privacy_config()}))
    hospitals.connect()
    return hospitals


def refuse_seeded_noise_in_deployment(settings: RunSettings, deployed: Mapping[str, bool]) -> None:
    """Seeded noise can be regenerated and subtracted by whoever knows the seed: simulations only."""
    real = sorted(h for h, is_deployed in deployed.items() if is_deployed)
    if settings.reproducible_noise and real:
        raise UserError(f"reproducible-noise: refused because hospitals {', '.join(real)} are deployed "
                        "(seeded noise can be regenerated and subtracted; it is for simulations only)")


def make_app(**overrides: Any) -> ServerApp:
    """A ServerApp whose run settings are ``[tool.flwr.app.config]`` with ``overrides`` (:class:`RunSettings`
    fields) applied: what ``fedpate simulate`` and ``fedpate compare`` bind in, the typed records among them
    (``cells``, ``real_check``) that Flower's run config does not carry."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_federation(grid, RunSettings.from_run_config(context.run_config, **overrides))

    return server_app


app = make_app()
