"""Run a Flower app as a real multi-process deployment on localhost (TLS + SuperNode authentication),
and print the equivalent commands for real separate machines.

Layout of one ``LocalDeployment`` (all under ``work_dir``; every server binds 127.0.0.1 only)::

    certs/ca.crt certs/superlink.crt|.key certs/supernodes/<hospital>.key|.pub   (sim/deployment/tls.py)
    flwr-home/config.toml          # [superlink.fedpate-local] address + root-certificates (FLWR_HOME)
    superlink.db                   # SuperLink state (--database)
    logs/<process>.log  pids/<process>.pid

    flower-superlink   --host 127.0.0.1 --port P  (TLS, --enable-supernode-auth)   -> SuperExec -> ServerApp
    flower-supernode   --superlink 127.0.0.1:P --port Q_i  (one per hospital)      -> SuperExec -> ClientApp

In Flower 1.41 the SuperLink serves the Fleet, Control and Runtime APIs on ONE HTTP(S) port
(``--host/--port``); a SuperNode serves its own Runtime API on ``--port`` (one port per SuperNode on a
machine). ``flwr run --stream`` exits 0 even when the ServerApp fails, so :meth:`LocalDeployment.run`
asks ``flwr ls --run-id N --format json`` for the real status.

This module never imports ``flwr``; it drives the installed command-line tools.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from sim.errors import UserError
from sim.deployment.processes import (
    ManagedProcess, ProcessError, Supervisor, free_ports, wait_for_http_health, wait_for_port,
)
from sim.deployment.tls import DEFAULT_HOSTS, make_certificates, make_supernode_keys

CONNECTION = "fedpate-local"
LOOPBACK = "127.0.0.1"


# -------------------------------------------------------------------------------------------------
# small helpers shared with runtime_simulation.py
def flower_tool(name: str) -> str:
    """Path of a Flower console script next to the running interpreter (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise UserError(f"{name}: not found next to {sys.executable} nor on PATH (is flwr installed?)")
    return found


def toml_value(value: Any, quote: str = "'") -> str:
    """One value in the ``key=value`` syntax of ``--node-config`` / ``flwr run -c`` (a TOML value).

    Flower splits that syntax with a regex that does not understand escapes, so a string is written as
    a TOML literal ``'...'`` (no escaping at all) or, if it contains ``'``, as a basic ``"..."`` string.
    ``quote='"'`` prefers the basic form (nicer inside a single-quoted shell argument).
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    basic_ok = '"' not in text and "\\" not in text
    if quote == '"' and basic_ok:
        return '"' + text + '"'
    if "'" not in text:
        return "'" + text + "'"
    if not basic_ok:
        raise UserError(f"config value {text!r}: cannot contain both ' and \" (or backslashes)")
    return '"' + text + '"'


def config_string(config: Mapping[str, Any], quote: str = "'") -> str:
    """``{"hospital-id": "h0", "teachers-per-hospital": 2}`` -> ``hospital-id='h0' teachers-per-hospital=2``."""
    for key in config:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(key)):
            raise UserError(f"config key {key!r}: expected letters, digits, '-', '_' or '.'")
    return " ".join(f"{k}={toml_value(v, quote)}" for k, v in config.items())


def write_flower_config(flwr_home: Path, name: str, address: str, root_certificates: Path | None) -> Path:
    """A project-local ``$FLWR_HOME/config.toml`` with one SuperLink connection (the default)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f'address = "{address}"']
    if root_certificates is None:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {toml_value(str(Path(root_certificates).resolve()))}")
    path = flwr_home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


_RUN_ID = re.compile(r"Successfully started run (\d+)")


@dataclass
class RunStatus:
    """What happened to one ``flwr run``: ``ok`` only if the SuperLink reports ``finished:completed``."""
    run_id: int | None
    status: str                 # e.g. "finished:completed", "finished:failed", "timeout", "not-started"
    ok: bool
    seconds: float
    exit_code: int | None       # of `flwr run` (0 even when the ServerApp failed!)
    log_path: Path | None = None
    details: dict = field(default_factory=dict)

    def raise_for_status(self) -> "RunStatus":
        if not self.ok:
            tail = ""
            if self.log_path and self.log_path.exists():
                tail = "\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"Flower run {self.run_id} ended with status {self.status!r}{tail}")
        return self


def parse_run_id(output: str) -> int | None:
    matches = _RUN_ID.findall(re.sub(r"\x1b\[[0-9;]*m", "", output))
    return int(matches[-1]) if matches else None


def _parse_json_output(text: str) -> Any:
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise ValueError(f"no JSON in output: {text[-500:]!r}")
    return json.JSONDecoder().raw_decode(re.sub(r"\x1b\[[0-9;]*m", "", text[start:]))[0]


def query_run_status(sup: Supervisor, env: Mapping[str, str], connection: str, run_id: int,
                     timeout: float = 120.0, wait_finished: float = 60.0) -> dict:
    """``flwr ls <connection> --run-id N --format json`` -> that run's dict (waits a little for 'finished')."""
    deadline = time.monotonic() + wait_finished
    while True:
        code, out = sup.run(f"flwr-ls-{run_id}",
                            [flower_tool("flwr"), "ls", connection, "--run-id", str(run_id), "--format", "json"],
                            timeout=timeout, env=env)
        info: dict = {}
        try:
            data = _parse_json_output(out)
            runs = data.get("runs", []) if isinstance(data, dict) else data
            info = next((r for r in runs if str(r.get("run-id")) == str(run_id)), {})
        except ValueError:
            info = {}
        if str(info.get("status", "")).startswith("finished") or time.monotonic() > deadline:
            return info
        time.sleep(2.0)


def flwr_run(sup: Supervisor, env: Mapping[str, str], app_dir: Path, connection: str,
             run_config: Mapping[str, Any], timeout: float, extra_args: Sequence[str] = (),
             name: str = "flwr-run") -> RunStatus:
    """``flwr run <app> <connection> --stream -c ...``, then the SuperLink's verdict on that run."""
    command = [flower_tool("flwr"), "run", str(app_dir), connection, "--stream", *extra_args]
    if run_config:
        command += ["--run-config", config_string(run_config)]
    t0 = time.monotonic()
    proc = sup.start(name, command, env=env)
    try:
        exit_code: int | None = proc.wait(timeout)
        timed_out = False
    except Exception:  # subprocess.TimeoutExpired
        exit_code, timed_out = None, True
    finally:
        sup.stop(proc, grace=5.0)
    output = proc.log_path.read_text(errors="replace")
    run_id = parse_run_id(output)
    seconds = time.monotonic() - t0
    if run_id is None:
        return RunStatus(None, "not-started", False, seconds, exit_code, proc.log_path)
    info = query_run_status(sup, env, connection, run_id, wait_finished=0.0 if timed_out else 60.0)
    status = "timeout" if timed_out and not str(info.get("status", "")).startswith("finished") \
        else str(info.get("status", "unknown"))
    if timed_out:  # do not leave the run going on the SuperLink
        sup.run(f"flwr-stop-{run_id}", [flower_tool("flwr"), "stop", str(run_id), connection],
                timeout=60.0, env=env)
    return RunStatus(run_id, status, status == "finished:completed", seconds, exit_code, proc.log_path, info)


# -------------------------------------------------------------------------------------------------
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
                 env: Mapping[str, str] | None = None, verbose: bool = False):
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
        self.startup_timeout = startup_timeout
        self.verbose = verbose
        self.flwr_home = self.work_dir / "flwr-home"
        self.env = {"FLWR_HOME": str(self.flwr_home), **(env or {})}
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

    def register_key(self, public_key: Path) -> str:
        """``flwr supernode register <public key> <connection>``; returns the node id it printed."""
        code, out = self.sup.run(f"register-{public_key.stem}",
                                 [flower_tool("flwr"), "supernode", "register", str(public_key), CONNECTION,
                                  "--format", "json"],
                                 timeout=self.startup_timeout, env=self.env)
        try:
            data = _parse_json_output(out)
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
        from concurrent.futures import ThreadPoolExecutor

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
def deployment_commands(certs_dir: str | Path, superlink: str, hospitals: Sequence[tuple[str, str]],
                        app_dir: str = ".", superlink_port: int | None = None,
                        supernode_port: int = 9094, teachers_per_hospital: int | None = None,
                        remote_certs: str = "/etc/fedpate/certs", workdir_root: str = "/var/lib/fedpate") -> str:
    """The step-by-step commands for real separate machines, as text.

    ``superlink`` is ``HOST:PORT`` as the hospitals reach the aggregator; ``hospitals`` is
    ``[(hospital_id, data_dir_on_that_hospital), ...]``; ``certs_dir`` is where ``fedpate deploy certs``
    wrote the CA, the SuperLink certificate and one key pair per hospital.
    """
    if ":" not in superlink:
        raise UserError(f"--superlink {superlink!r}: expected HOST:PORT")
    host, port = superlink.rsplit(":", 1)
    if not port.isdigit():
        raise UserError(f"--superlink {superlink!r}: port must be a number")
    certs = Path(certs_dir)
    q = shlex.quote
    r = remote_certs.rstrip("/")
    lines = [
        "# fedpate deployment: one aggregator (SuperLink + ServerApp) and one SuperNode per hospital.",
        f"# Generated from certificates in {certs}. Run each block on the machine named in its heading.",
        "# Every machine: the same fedpate + flwr 1.41 installation (bash .ci/install), and for every command",
        "export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1",
        "",
        "## 0. On the machine that made the certificates: distribute the files (never copy *.key elsewhere",
        "##    than stated; ca.key stays offline)",
        f"ssh {host} 'mkdir -p {r} && chmod 700 {r}'",
        f"scp {q(str(certs / 'ca.crt'))} {q(str(certs / 'superlink.crt'))} {q(str(certs / 'superlink.key'))} "
        f"{host}:{r}/",
    ]
    for hid, _ in hospitals:
        lines += [
            f"ssh <{hid}-machine> 'mkdir -p {r} && chmod 700 {r}'",
            f"scp {q(str(certs / 'ca.crt'))} {q(str(certs / 'supernodes' / (hid + '.key')))} <{hid}-machine>:{r}/",
            f"scp {q(str(certs / 'supernodes' / (hid + '.pub')))} {host}:{r}/   # public key, for registration",
        ]
    lines += [
        "",
        f"## 1. Aggregator ({host}): open TCP {port} to the hospitals only (the SuperLink's single HTTPS port:",
        "##    Fleet API for SuperNodes, Control API for `flwr`, Runtime API for its ServerApp)",
        f"flower-superlink --host 0.0.0.0 --port {port} \\",
        f"    --ssl-ca-certfile {r}/ca.crt --ssl-certfile {r}/superlink.crt --ssl-keyfile {r}/superlink.key \\",
        "    --enable-supernode-auth --database /var/lib/fedpate/superlink.db \\",
        "    --disable-runtime-dependency-installation",
        "",
        f"## 2. Aggregator ({host}): a FLWR_HOME with the connection, then register every hospital's key",
        "export FLWR_HOME=/var/lib/fedpate/flwr-home && mkdir -p $FLWR_HOME",
        "cat > $FLWR_HOME/config.toml <<'EOF'",
        "[superlink]",
        'default = "fedpate"',
        "[superlink.fedpate]",
        f'address = "{host}:{port}"',
        f'root-certificates = "{r}/ca.crt"',
        "EOF",
    ]
    for hid, _ in hospitals:
        lines.append(f"flwr supernode register {r}/{hid}.pub fedpate --name {hid}")
    lines.append("flwr supernode ls fedpate        # every hospital listed, status 'registered'")
    lines.append("")
    for hid, data in hospitals:
        node_config = {"hospital-id": hid, "data-dir": data, "workdir": f"{workdir_root}/{hid}"}
        if teachers_per_hospital:
            node_config["teachers-per-hospital"] = teachers_per_hospital
        lines += [
            f"## 3. Hospital {hid}: outbound TCP to {host}:{port} only; nothing listens except 127.0.0.1:{supernode_port}",
            f"flower-supernode --superlink {host}:{port} --root-certificates {r}/ca.crt \\",
            f"    --auth-supernode-private-key {r}/{hid}.key \\",
            f"    --host 127.0.0.1 --port {supernode_port} \\",
            "    --node-config " + q(config_string(node_config, quote='"')),
            "",
        ]
    lines += [
        f"## 4. Aggregator ({host}), from the fedpate source folder: start the run (logs stream back)",
        f"flwr run {app_dir} fedpate --stream -c \"method='pate-ae' preset='quick' hospitals={len(hospitals)}\"",
        "flwr ls fedpate --format json     # the run's real status: finished:completed (flwr run exits 0 anyway)",
    ]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------------
# A minimal Flower app to check the plumbing (certificates, keys, ports, node configs) without fedpate's
# data or models: every ClientApp answers a `query` message with its node_config.
ECHO_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedpate-echo"
version = "0.1.0"
description = "fedpate deployment smoke-check app: each SuperNode echoes its node_config"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "fedpate"

[tool.flwr.app.components]
serverapp = "fedpate_echo.server_app:app"
clientapp = "fedpate_echo.client_app:app"

[tool.flwr.app.config]
expected-nodes = 2
wait-seconds = 120.0
settle-seconds = 0.0
reply-timeout = 120.0
result-file = ""
reply-delay = 0.0
fail = false
"""

ECHO_CLIENT = """\
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    delay = float(msg.content["q"].get("reply-delay", 0.0))
    if delay:
        time.sleep(delay)
    node = {str(k): v for k, v in context.node_config.items()}
    return Message(RecordDict({"r": ConfigRecord(node)}), reply_to=msg)
"""

ECHO_SERVER = """\
import json
import os
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    expected = int(cfg["expected-nodes"])
    t0 = time.monotonic()
    deadline = t0 + float(cfg["wait-seconds"])
    nodes = sorted(grid.get_node_ids())
    while len(nodes) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        nodes = sorted(grid.get_node_ids())
    settle = time.monotonic() + float(cfg["settle-seconds"])   # give extra (e.g. refused) nodes a chance
    while time.monotonic() < settle:
        time.sleep(0.5)
        nodes = sorted(grid.get_node_ids())
    waited = time.monotonic() - t0
    if bool(cfg["fail"]):
        raise RuntimeError("echo app asked to fail")
    messages = [Message(RecordDict({"q": ConfigRecord({"reply-delay": float(cfg["reply-delay"])})}),
                        dst_node_id=node, message_type="query") for node in nodes]
    replies = list(grid.send_and_receive(messages, timeout=float(cfg["reply-timeout"])))
    result = {"nodes": nodes, "waited-seconds": waited, "replies": [], "errors": []}
    for reply in replies:
        src = reply.metadata.src_node_id
        if reply.has_error():
            result["errors"].append({"node-id": src, "error": str(reply.error.reason)})
        else:
            result["replies"].append({"node-id": src, "node-config": dict(reply.content["r"])})
    out = str(cfg["result-file"])
    if out:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, out)
"""


def write_echo_app(app_dir: str | Path) -> Path:
    """Write the echo app to ``app_dir`` (pyproject.toml + fedpate_echo/) and return the folder."""
    root = Path(app_dir)
    package = root / "fedpate_echo"
    package.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(ECHO_PYPROJECT)
    (package / "__init__.py").write_text("")
    (package / "client_app.py").write_text(ECHO_CLIENT)
    (package / "server_app.py").write_text(ECHO_SERVER)
    return root
