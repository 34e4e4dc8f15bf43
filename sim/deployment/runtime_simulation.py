"""Run a Flower app in Flower's simulation RUNTIME (``flwr run`` against a ``--simulation`` SuperLink).

Unlike ``flwr.simulation.run_simulation`` (in-process), this is exactly what a user gets with
``flwr run . <connection>``: the app is bundled into a FAB, a SuperLink started with ``--simulation``
runs the ServerApp and K virtual SuperNodes (Ray backend) in a ``flwr-simulation`` process.

We start our own SuperLink on a free 127.0.0.1 port (insecure HTTP is acceptable on loopback) instead of
the default ``:local:`` connection, which leaves a detached SuperLink running after ``flwr run`` returns,
and we stop it -- with its SuperExec, the simulation process and the Ray daemons -- by PID.

Federation settings (number of SuperNodes, client resources) travel with the run as
``flwr run ... --federation-config "num-supernodes=K client-resources-num-cpus=1 ..."``, the 1.41
per-run equivalent of ``flwr federation simulation-config --num-supernodes K``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from task.errors import UserError
from sim.deployment.flower_cli import (
    FLOWER_ENV, RunStatus, config_string, flower_tool, flwr_run, write_flower_config,
)
from sim.deployment.processes import Supervisor, free_ports, wait_for_http_health

CONNECTION = "fedpate-sim"
LOOPBACK = "127.0.0.1"


def simulation_federation_config(num_supernodes: int, num_cpus: int = 1, num_gpus: float = 0.0,
                                 init_num_cpus: int | None = None) -> dict[str, Any]:
    if num_supernodes < 1:
        raise UserError(f"num_supernodes: expected >= 1, got {num_supernodes}")
    if num_cpus < 1:
        raise UserError(f"num_cpus: expected >= 1 CPU per ClientApp, got {num_cpus}")
    config: dict[str, Any] = {"num-supernodes": int(num_supernodes),
                              "client-resources-num-cpus": int(num_cpus),
                              "client-resources-num-gpus": float(num_gpus)}
    if init_num_cpus:
        config["init-args-num-cpus"] = int(init_num_cpus)
    return config


@dataclass(frozen=True)
class RuntimeSimulation:
    """One run of a Flower app in the simulation runtime (:func:`run_runtime_simulation`), validated on
    construction.

    Args:
        app_dir: the Flower app's folder (with pyproject.toml).
        run_config: overrides keys of the app's ``[tool.flwr.app.config]`` (only existing keys; None = none).
        num_supernodes: the number of virtual SuperNodes (at least 1).
        work_dir: where the SuperLink's database, ``FLWR_HOME`` and the processes' logs are written.
        timeout: seconds ``flwr run`` may take (:func:`sim.deployment.flower_cli.flwr_run`).
        num_cpus / num_gpus: the resources of each ClientApp (``client-resources-num-cpus`` / ``-num-gpus``;
            at least one CPU).
        init_num_cpus: the CPUs of the simulation backend (``init-args-num-cpus``; None = Flower's default).
        startup_timeout: seconds the SuperLink may take to answer its health check.
        env: extra environment of every process (on top of :data:`FLOWER_ENV` and ``FLWR_HOME``).
        verbose: print when the SuperLink is up and how the run ended.
    """

    app_dir: Path
    run_config: Mapping[str, Any] | None
    num_supernodes: int
    work_dir: Path
    timeout: float = 1800.0
    num_cpus: int = 1
    num_gpus: float = 0.0
    init_num_cpus: int | None = None
    startup_timeout: float = 180.0
    env: Mapping[str, str] | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        app = Path(self.app_dir).resolve()
        if not (app / "pyproject.toml").exists():
            raise UserError(f"{app}: expected a Flower app folder with pyproject.toml")
        object.__setattr__(self, "app_dir", app)
        object.__setattr__(self, "work_dir", Path(self.work_dir).resolve())
        for name in ("timeout", "startup_timeout"):
            if not float(getattr(self, name)) > 0:
                raise UserError(f"{name}: expected a positive number of seconds, got {getattr(self, name)!r}")
        self.federation   # the SuperNodes and their resources, checked now

    @property
    def federation(self) -> dict[str, Any]:
        """``--federation-config``: the SuperNodes and each ClientApp's resources."""
        return simulation_federation_config(self.num_supernodes, self.num_cpus, self.num_gpus, self.init_num_cpus)


def run_runtime_simulation(simulation: RuntimeSimulation) -> RunStatus:
    """Start a simulation SuperLink, ``flwr run`` the app with ``simulation.num_supernodes`` virtual SuperNodes,
    stop (``simulation``: :class:`RuntimeSimulation`).

    Returns the :class:`~sim.deployment.flower_cli.RunStatus` (``ok`` only for ``finished:completed``); every
    process started here is gone when it returns, whatever happened.
    """
    app, work, verbose = simulation.app_dir, simulation.work_dir, simulation.verbose
    work.mkdir(parents=True, exist_ok=True)
    federation = simulation.federation
    flwr_home = work / "flwr-home"
    environment = {**FLOWER_ENV, "FLWR_HOME": str(flwr_home), **(simulation.env or {})}
    port = free_ports(1)[0]
    write_flower_config(flwr_home, CONNECTION, f"{LOOPBACK}:{port}", None)
    with Supervisor(work) as sup:
        t0 = time.monotonic()
        link = sup.start("superlink-sim",
                         [flower_tool("flower-superlink"), "--insecure", "--simulation",
                          "--host", LOOPBACK, "--port", str(port),
                          "--database", str(work / "superlink-sim.db"),
                          "--disable-runtime-dependency-installation"],
                         env=environment)
        wait_for_http_health(f"http://{LOOPBACK}:{port}/health", simulation.startup_timeout, proc=link)
        if verbose:
            print(f"[runtime-sim] SuperLink (simulation) up on {LOOPBACK}:{port} in "
                  f"{time.monotonic() - t0:.1f} s (pid {link.pid})", flush=True)
        status = flwr_run(sup, environment, app, CONNECTION, simulation.run_config or {}, simulation.timeout,
                          extra_args=["--federation-config", config_string(federation)])
        sup.snapshot()
        if verbose:
            print(f"[runtime-sim] run {status.run_id}: {status.status} in {status.seconds:.1f} s", flush=True)
    status.details["leftover-pids"] = sup.alive_pids()
    status.details["supervised-pids"] = sorted(sup.all_pids)
    # (PID, start time) names a process: a PID alone may since have been given to an unrelated one
    status.details["supervised-processes"] = sup.identities()
    return status
