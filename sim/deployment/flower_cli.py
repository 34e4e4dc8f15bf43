"""Flower's command-line tools, driven as processes: where they are, their config syntax, ``flwr run``.

Shared by the localhost deployment (sim/deployment/local.py), the simulation runtime
(sim/deployment/runtime_simulation.py) and the recipe for separate machines (sim/deployment/recipe.py).
``flwr run --stream`` exits 0 even when the ServerApp fails, so :func:`flwr_run` asks the SuperLink
(``flwr ls --run-id N --format json``) for the real status. Never imports ``flwr``.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from task.errors import UserError

if TYPE_CHECKING:  # annotations only: the supervisor is passed in by the callers
    from sim.deployment.processes import Supervisor

#: The fedpate Flower app: the folder with pyproject.toml ([tool.flwr.app]), i.e. the source tree.
PROJECT_ROOT = Path(__file__).resolve().parents[2]

#: Environment every Flower process and ``flwr`` command gets: no telemetry, no update check, and no dependency
#: installation at run time (nothing may download; Flower 1.41's SuperLink would otherwise run ``uv sync`` per run).
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


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


def parse_json_output(text: str) -> Any:
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise ValueError(f"no JSON in output: {text[-500:]!r}")
    return json.JSONDecoder().raw_decode(re.sub(r"\x1b\[[0-9;]*m", "", text[start:]))[0]


def query_run_status(sup: Supervisor, env: Mapping[str, str], connection: str, run_id: int,
                     timeout: float = 120.0, wait_finished: float = 60.0) -> dict:
    """``flwr ls <connection> --run-id N --format json`` -> that run's dict (waits a little for 'finished').

    Args:
        sup: the :class:`sim.deployment.processes.Supervisor` that runs (and, on timeout, kills) ``flwr ls``.
        env: the environment of the ``flwr`` command (``FLWR_HOME`` with the connection, :data:`FLOWER_ENV`).
        connection: the SuperLink connection's name in ``$FLWR_HOME/config.toml``.
        run_id: the run asked about.
        timeout: seconds each ``flwr ls`` may take before it is killed.
        wait_finished: seconds to keep asking (every 2 s) until the status starts with ``finished``; the last
            answer is returned either way ({} when the SuperLink did not list the run).
    """
    deadline = time.monotonic() + wait_finished
    while True:
        code, out = sup.run(f"flwr-ls-{run_id}",
                            [flower_tool("flwr"), "ls", connection, "--run-id", str(run_id), "--format", "json"],
                            timeout=timeout, env=env)
        info: dict = {}
        try:
            data = parse_json_output(out)
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
    """``flwr run <app> <connection> --stream -c ...``, then the SuperLink's verdict on that run.

    Args:
        sup: the :class:`sim.deployment.processes.Supervisor` that starts and stops ``flwr run`` (its log is
            where the run id is read from).
        env: the environment of the ``flwr`` commands (``FLWR_HOME`` with the connection, :data:`FLOWER_ENV`).
        app_dir: the Flower app's folder (pyproject.toml with ``[tool.flwr.app]``; :data:`PROJECT_ROOT`).
        connection: the SuperLink connection's name in ``$FLWR_HOME/config.toml``.
        run_config: the run config, passed as ``--run-config`` (:func:`config_string`; empty = none).
        timeout: seconds ``flwr run`` may take; then it is stopped, the run is stopped on the SuperLink and the
            status is ``timeout`` unless the SuperLink already reports it finished.
        extra_args: further arguments of ``flwr run``.
        name: the supervised process's name (its log file's).
    """
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
