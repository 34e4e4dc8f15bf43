"""One cell of a run plan -- a method at a budget -- through the protocol that method names, over any
:class:`server.transport.HospitalTransport`. The ServerApp (server/server_app.py) and the in-process
engine (sim/runners/simulation.py) run their cells through :func:`run_cell`, so both run the same code.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from pathlib import Path

from server.dpfedavg import run_dpfedavg
from server.student import train_public_model
from sim.errors import UserError
from server.pate import PateConfig, run_pate
from server.transport import HospitalTransport
from sim.runconfig import RunSettings
from sim.world import PublicWorld


def plan_cells(settings: RunSettings) -> list[dict[str, Any]]:
    """One cell (the configured method and epsilon) unless a comparison passed a list of cells."""
    cells = settings.extra.get("cells")
    if cells:
        return [dict(cell) for cell in (json.loads(cells) if isinstance(cells, str) else cells)]
    return [{"method": settings.method, "epsilon": settings.budget, "out": settings.out, "init": settings.init}]


def run_cell(transport: HospitalTransport, world: PublicWorld, settings: RunSettings,
             cell: Mapping[str, Any]) -> dict:
    """Run ``cell`` (``method``, ``epsilon``, ``out``, optional ``shared_dir``) and return its results; its
    noise comes from its own namespace (``RunSettings.cell_noise_source``)."""
    preset = settings.resolved_preset
    if cell["method"] == "dp-fedavg":   # the hospitals draw their own noise (clients/fedavg.py)
        init = str(cell.get("init", settings.init))
        start = None
        if init == "public":   # the same public model PATE starts from (shared with its cells in a comparison)
            shared = cell.get("shared_dir")
            public_model = train_public_model(world, preset, seed=settings.seed, progress=settings.progress,
                                              checkpoint=Path(shared) / "public-model.pt" if shared else None,
                                              device=settings.device, precision=settings.precision)
            start = {k: v.detach().cpu().numpy() for k, v in public_model.state_dict().items()}
        elif init != "scratch":
            raise UserError(f"init: expected public or scratch, got {init!r}")
        return run_dpfedavg(transport, world, preset, cell["epsilon"], settings.resolved_delta, cell["out"],
                            seed=settings.seed, progress=settings.progress,
                            reproducible_noise=settings.reproducible_noise, init_weights=start, init=init,
                            device=settings.device, precision=settings.precision)
    config = PateConfig(cell["method"], cell["epsilon"], settings.resolved_delta, seed=settings.seed,
                        calibration=settings.calibration, query_batch=settings.query_batch,
                        shared_dir=cell.get("shared_dir"), progress=settings.progress,
                        device=settings.device, precision=settings.precision)
    return run_pate(transport, world, preset, config, cell["out"], noise=settings.cell_noise_source(cell))
