"""The aggregator's Flower ServerApp: a thin adapter; the protocols live in server/pate.py and
server/dpfedavg.py and are the same code the in-process runner calls.

Configured by ``[tool.flwr.app.config]`` in pyproject.toml (``flwr run . -c 'method="pate-pca" epsilon=2'``)
or, in-process, by :func:`make_app` (used by ``fedpate simulate`` and ``fedpate compare``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from server.dpfedavg import run_dpfedavg
from server.pate import run_pate
from sim.io import atomic_write_json
from sim.runconfig import RunSettings
from sim.errors import UserError
from server.flower_transport import FlowerTransport
from sim.runners.simulation import cell_noise_names
from sim.runners.world_setup import materialise_world, open_world
from sim.world import load_world

log = logging.getLogger("fedpate.server")


def run_federation(grid: Grid, settings: RunSettings) -> list[dict]:
    """Train teachers at the hospitals, then run every cell (method x epsilon) of the plan."""
    preset = settings.resolved_preset
    world_dir = settings.world or materialise_world(preset, settings.data, settings.seed, settings.progress)
    world = load_world(*open_world(world_dir))

    hospitals = FlowerTransport(
        grid, preset.hospitals, wait_seconds=settings.wait_seconds, reply_timeout=settings.reply_timeout,
        base_config={"preset": preset.name, "seed": settings.seed, "world": str(world_dir),
                     "preset_overrides": {"hospitals": preset.hospitals,
                                          "teachers_per_hospital": preset.teachers_per_hospital},
                     **settings.hospital_privacy_config()})
    hospitals.connect()
    refuse_seeded_noise_in_deployment(settings, hospitals.deployed)

    results = []
    for cell in plan_cells(settings):
        noise = settings.noise_source(*cell_noise_names(cell, settings))
        if cell["method"] == "dp-fedavg":
            result = run_dpfedavg(hospitals, world, preset, cell["epsilon"], settings.resolved_delta, cell["out"],
                                  seed=settings.seed, progress=settings.progress,
                                  reproducible_noise=settings.reproducible_noise)
        else:
            result = run_pate(hospitals, world, preset, cell["method"], cell["epsilon"], settings.resolved_delta,
                              cell["out"], seed=settings.seed, calibration=settings.calibration,
                              query_batch=settings.query_batch, shared_dir=cell.get("shared_dir"),
                              progress=settings.progress, noise=noise)
        result["dropped_hospitals"] = dict(hospitals.dropped)
        result["bytes_up_measured_per_query_per_teacher"] = measured_bytes_per_teacher(hospitals)
        atomic_write_json(Path(cell["out"]) / "results.json", result)  # the protocol's results + these two
        log.info("%s at epsilon=%g: results in %s", cell["method"], cell["epsilon"], cell["out"])
        results.append(result)
    return results


def refuse_seeded_noise_in_deployment(settings: RunSettings, deployed: Mapping[str, bool]) -> None:
    """Seeded noise can be regenerated and subtracted by whoever knows the seed: simulations only."""
    real = sorted(h for h, is_deployed in deployed.items() if is_deployed)
    if settings.reproducible_noise and real:
        raise UserError(f"reproducible-noise: refused because hospitals {', '.join(real)} are deployed "
                        "(seeded noise can be regenerated and subtracted; it is for simulations only)")


def plan_cells(settings: RunSettings) -> list[dict[str, Any]]:
    """One cell (the configured method and epsilon) unless a comparison passed a list of cells."""
    cells = settings.extra.get("cells")
    if cells:
        return [dict(cell) for cell in (json.loads(cells) if isinstance(cells, str) else cells)]
    return [{"method": settings.method, "epsilon": settings.budget, "out": settings.out}]


def measured_bytes_per_teacher(transport: FlowerTransport) -> float | None:
    """Encoding payload bytes one teacher actually sent for one query (mean over the query rounds)."""
    sizes = [size for round_bytes in transport.bytes_up for size in round_bytes.values()]
    return None if not sizes else float(sum(sizes) / len(sizes))


def make_app(extra: Mapping[str, Any] | None = None, **overrides) -> ServerApp:
    """A ServerApp whose run settings are ``[tool.flwr.app.config]`` with ``overrides`` applied
    (``extra``: e.g. ``{"cells": [...]}`` from ``fedpate compare``)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        settings = RunSettings.from_run_config(context.run_config, **overrides)
        if extra:
            settings = settings.replace(extra=dict(extra))
        run_federation(grid, settings)

    return server_app


app = make_app()
