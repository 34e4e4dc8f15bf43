"""Run a Flower app as a real multi-process deployment on localhost (TLS + SuperNode authentication).

Layout of one ``LocalDeployment`` (all under ``work_dir``; every server binds 127.0.0.1 only)::
    certs/ca.crt certs/superlink.crt|.key certs/supernodes/<hospital>.key|.pub   (sim/deployment/tls.py)
    flwr-home/config.toml          # [superlink.fedpate-local] address + root-certificates (FLWR_HOME)
    superlink.db                   # SuperLink state (--database)
    logs/<process>.log  pids/<process>.pid

    flower-superlink   --host 127.0.0.1 --port P  (TLS, --enable-supernode-auth)   -> SuperExec -> ServerApp
    flower-supernode   --superlink 127.0.0.1:P --port Q_i  (one per hospital)      -> SuperExec -> ClientApp

In Flower 1.41 the SuperLink serves the Fleet, Control and Runtime APIs on ONE HTTP(S) port
(``--host/--port``); a SuperNode serves its own Runtime API on ``--port`` (one port per SuperNode on a
machine). :meth:`LocalDeployment.run` reports the SuperLink's verdict on the run
(sim/deployment/flower_cli.py). ``echo_app/`` is a minimal Flower app that checks the plumbing
(certificates, keys, ports, node configs) without fedpate's data or models: every ClientApp answers a
``query`` message with its node_config.

This module never imports ``flwr``; it drives the installed command-line tools.
"""

from __future__ import annotations

import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from sim.deployment.flower_cli import (
    FLOWER_ENV,
    RunStatus,
    config_string,
    flower_tool,
    flwr_run,
    parse_json_output,
    write_flower_config,
)
from sim.deployment.processes import (
    ManagedProcess,
    ProcessError,
    Supervisor,
    free_ports,
    wait_for_http_health,
    wait_for_port,
)
from sim.deployment.tls import DEFAULT_HOSTS, ROSTER_FILE, make_certificates, make_supernode_keys, write_roster
from task.errors import UserError

CONNECTION = "fedpate-local"
LOOPBACK = "127.0.0.1"
#: the echo app (pyproject.toml + fedpate_echo/), shipped as real files with the package
ECHO_APP = Path(__file__).resolve().parent / "echo_app"


@dataclass
class SuperNodeHandle:
    name: str
    node_config: dict
    port: int
    process: ManagedProcess
    private_key: Path | None
    registered: bool


class LocalDeployment:
    """A SuperLink plus one SuperNode per hospital, as real processes on 127.0.0.1.

    ``hospitals`` is one ``node_config`` dict per hospital (for fedpate: ``hospital-id``, ``data-dir``,
    ``workdir``, ``teachers-per-hospital``); the SuperNode's name is its ``hospital-id`` (or ``h<i>``).

        with LocalDeployment(app_dir, work_dir, [{"hospital-id": "h0", ...}, ...]) as dep:
            status = dep.run({"out": "/abs/out"}, timeout=1800)
            status.raise_for_status()
    """

    def __init__(self, app_dir: str | Path, work_dir: str | Path, hospitals: Sequence[Mapping[str, Any]],
                 tls: bool = True, auth: bool = True, startup_timeout: float = 180.0,
                 verbose: bool = False, secure_roster: bool = False):
        if auth and not tls:
            raise UserError("SuperNode authentication requires TLS (Flower refuses --enable-supernode-auth "
                            "without certificates): use tls=True")
        self.app_dir = Path(app_dir).resolve()
        if not (self.app_dir / "pyproject.toml").exists():
            raise UserError(f"{self.app_dir}: expected a Flower app folder with pyproject.toml")
        self.work_dir = Path(work_dir).resolve()
        self.hospitals = [dict(h) for h in hospitals]
        self.names = [str(h.get("hospital-id", f"h{i}")) for i, h in enumerate(self.hospitals)]
        if len(set(self.names)) != len(self.names):
            raise UserError(f"hospital ids must be unique, got {self.names}")
        self.tls, self.auth = tls, auth
        #: also write the consortium's roster of hospital keys and give every hospital its node-config keys
        #: ``secure-roster`` and ``secure-signing-key`` (fedpate's secure sums; its SuperNode key when auth is on)
        self.secure_roster = secure_roster
        self.startup_timeout = startup_timeout
        self.verbose = verbose
        self.flwr_home = self.work_dir / "flwr-home"
        self.env = {**FLOWER_ENV, "FLWR_HOME": str(self.flwr_home)}
        self.sup = Supervisor(self.work_dir)
        self.certs: dict = {}
        self.superlink: ManagedProcess | None = None
        self.port: int | None = None
        self.supernodes: list[SuperNodeHandle] = []
        self.started = False

    # ---------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"[deploy] {msg}", flush=True)

    def start(self) -> "LocalDeployment":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self.certs = make_certificates(self.work_dir / "certs", list(DEFAULT_HOSTS),
                                           self.names if self.auth else [])
        if self.secure_roster and len(self.names) >= 2:   # a secure sum needs two hospitals at least
            self._write_roster()
        self.port = free_ports(1)[0]
        write_flower_config(self.flwr_home, CONNECTION, self.address,
                            self.certs.get("ca_cert") if self.tls else None)
        command = [flower_tool("flower-superlink"), "--host", LOOPBACK, "--port", str(self.port),
                   "--database", str(self.work_dir / "superlink.db"),
                   "--disable-runtime-dependency-installation"]
        if self.tls:
            command += ["--ssl-ca-certfile", str(self.certs["ca_cert"]),
                        "--ssl-certfile", str(self.certs["server_cert"]),
                        "--ssl-keyfile", str(self.certs["server_key"])]
        else:
            command += ["--insecure"]
        if self.auth:
            command += ["--enable-supernode-auth"]
        t0 = time.monotonic()
        self.superlink = self.sup.start("superlink", command, env=self.env)
        scheme = "https" if self.tls else "http"
        wait_for_http_health(f"{scheme}://{self.address}/health", self.startup_timeout,
                             cafile=self.certs.get("ca_cert"), proc=self.superlink)
        self._log(f"SuperLink up on {self.address} in {time.monotonic() - t0:.1f} s (pid {self.superlink.pid})")
        for name, node_config in zip(self.names, self.hospitals):
            self.add_supernode(name, node_config, register=self.auth)
        self.started = True

    def _write_roster(self) -> None:
        """The roster (``certs/roster.txt``) of every hospital's key -- the SuperNode keys, made here when
        authentication is off -- and each hospital's ``secure-roster`` / ``secure-signing-key`` node config."""
        folder = self.work_dir / "certs"
        keys = {name: (self.certs.get("supernodes", {}).get(name)
                       or make_supernode_keys(folder / "supernodes", name)) for name in self.names}
        self.certs.setdefault("supernodes", {}).update(keys)
        roster = write_roster(folder / ROSTER_FILE, {name: k["public"] for name, k in keys.items()})
        for name, node_config in zip(self.names, self.hospitals):
            node_config.update({"secure-roster": str(roster), "secure-signing-key": str(keys[name]["private"])})

    def register_key(self, public_key: Path) -> str:
        """``flwr supernode register <public key> <connection>``; returns the node id it printed."""
        code, out = self.sup.run(f"register-{public_key.stem}",
                                 [flower_tool("flwr"), "supernode", "register", str(public_key), CONNECTION,
                                  "--format", "json"],
                                 timeout=self.startup_timeout, env=self.env)
        try:
            data = parse_json_output(out)
        except ValueError:
            data = {}
        if code != 0 or not data.get("success"):
            raise ProcessError(f"flwr supernode register {public_key} failed (exit {code}):\n{out[-2000:]}")
        return str(data.get("node-id"))

    def add_supernode(self, name: str, node_config: Mapping[str, Any], register: bool = True,
                      private_key: Path | None = None) -> SuperNodeHandle:
        """Start one more SuperNode (``register=False`` + auth on = one the SuperLink must refuse)."""
        if self.auth and private_key is None:
            keys = (self.certs.get("supernodes", {}).get(name)
                    or make_supernode_keys(self.work_dir / "certs" / "supernodes", name))
            private_key = Path(keys["private"])
            if register:
                node_id = self.register_key(Path(keys["public"]))
                self._log(f"registered {name} as node {node_id}")
        port = free_ports(1)[0]
        # a bounded retry window: a SuperNode that can never connect gives up instead of living forever
        command = [flower_tool("flower-supernode"), "--superlink", self.address,
                   "--host", LOOPBACK, "--port", str(port),
                   "--max-wait-time", str(max(self.startup_timeout, 60.0))]
        if node_config:
            command += ["--node-config", config_string(node_config)]
        if self.tls:
            command += ["--root-certificates", str(self.certs["ca_cert"])]
        else:
            command += ["--insecure"]
        if private_key is not None:
            command += ["--auth-supernode-private-key", str(private_key)]
        proc = self.sup.start(f"supernode-{name}", command, env=self.env)
        wait_for_port(LOOPBACK, port, self.startup_timeout, proc)
        handle = SuperNodeHandle(name, dict(node_config), port, proc, private_key, register)
        self.supernodes.append(handle)
        self._log(f"SuperNode {name} up (runtime port {port}, pid {proc.pid})")
        return handle

    # ---------------------------------------------------------------------------------------------
    def run(self, run_config: Mapping[str, Any] | None = None, timeout: float = 1800.0) -> RunStatus:
        """Submit the app with ``run_config`` overrides; block until it ends (or ``timeout``)."""
        if not self.started:
            self.start()
        status = flwr_run(self.sup, self.env, self.app_dir, CONNECTION, run_config or {}, timeout)
        self.sup.snapshot()
        return status

    def submit(self, run_config: Mapping[str, Any] | None = None, timeout: float = 1800.0):
        """Like :meth:`run` but in a background thread (for killing a SuperNode mid-run); returns a
        ``concurrent.futures.Future`` of the RunStatus."""

        pool = ThreadPoolExecutor(max_workers=1)
        future = pool.submit(self.run, run_config, timeout)
        pool.shutdown(wait=False)
        return future

    def kill_supernode(self, index_or_name: int | str) -> list[int]:
        """Crash one hospital: SIGKILL its SuperNode, its SuperExec and its ClientApp processes by PID."""
        handle = (self.supernodes[index_or_name] if isinstance(index_or_name, int)
                  else next(h for h in self.supernodes if h.name == index_or_name))
        self.sup.snapshot()
        self.sup.stop(handle.process, grace=0.0, sig=signal.SIGKILL)
        self._log(f"killed SuperNode {handle.name} (pids {handle.process.seen_pids})")
        return list(handle.process.seen_pids)

    def stop(self) -> None:
        """Stop every process this deployment started (SuperNodes first, then the SuperLink), by PID."""
        self.sup.snapshot()
        self.sup.stop_all()
        self.started = False

    def alive_pids(self) -> list[int]:
        return self.sup.alive_pids()

    def __enter__(self) -> "LocalDeployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -------------------------------------------------------------------------------------------------


def write_echo_app(app_dir: str | Path) -> Path:
    """Copy the echo app (pyproject.toml + fedpate_echo/) to ``app_dir`` and return the folder: ``flwr run``
    bundles the folder it is given, so each deployment gets its own copy beside its logs."""
    root = Path(app_dir)
    shutil.copytree(ECHO_APP, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    return root
