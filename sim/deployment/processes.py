"""A small process supervisor for Flower's SuperLink / SuperNode / ``flwr`` processes on one machine.

Why more than ``subprocess.Popen``: Flower processes start children of their own. The SuperLink starts a
SuperExec in a NEW session (``start_new_session=True``) which starts the ServerApp; a SuperNode starts
a SuperExec in its own group which starts the ClientApps; the simulation runtime starts Ray daemons.
Killing one PID or one process group leaves the rest behind. So the supervisor

- starts every command in its own process group, with a unique tag in its environment
  (``FEDPATE_PROC_TAG``), which every descendant inherits (Flower passes the environment down);
- records every PID it started in a pidfile under ``<work_dir>/pids/``;
- stops a process by PID: snapshot its descendants (``/proc`` parent links) *before* signalling, SIGTERM
  the group and each descendant, SIGKILL what is left after a grace period;
- finally sweeps ``/proc`` for processes still carrying its tag (our own descendants that were
  re-parented away, e.g. a ServerApp whose SuperExec died) and kills them by PID too.

Linux only (``/proc``). Servers are only ever probed on loopback.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

TAG_VAR = "FEDPATE_PROC_TAG"
LOOPBACK = ("127.0.0.1", "::1", "localhost")



class ProcessError(RuntimeError):
    """A supervised process failed to start or came up unhealthy (message includes its log tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports (all held open until all are picked, so they differ)."""
    socks, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            socks.append(sock)
            ports.append(int(sock.getsockname()[1]))
    finally:
        for sock in socks:
            sock.close()
    return ports


# -------------------------------------------------------------------------------------------------
# /proc helpers
def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), or None if it is gone.

    A PID plus its start time names one process: a PID alone may be handed to another process once the
    first has exited (seen in CI: a "leaked" PID that a busy machine had reused for an unrelated process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def _proc_files(name: str):
    """(pid, bytes of /proc/<pid>/<name>) for every process whose file can be read now."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/{name}", "rb") as f:
                yield int(entry), f.read()
        except OSError:  # the process ended, or is not ours to read
            continue


def _ppid_map() -> dict[int, int]:
    parents = {}
    for pid, stat in _proc_files("stat"):
        rest = stat[stat.rfind(b")") + 2:].split()
        if len(rest) > 1:
            parents[pid] = int(rest[1])
    return parents


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first-level first)."""
    parents = _ppid_map()
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for c in children.get(p, []):
                if c not in found:
                    found.append(c)
                    nxt.append(c)
        frontier = nxt
    return found


def pids_with_tag(tag: str) -> list[int]:
    """PIDs of this user's live processes whose environment carries ``FEDPATE_PROC_TAG=<tag>``."""
    needle = f"{TAG_VAR}={tag}".encode()
    me = os.getpid()
    found = []
    for pid, env in _proc_files("environ"):
        if pid != me and needle in env.split(b"\0") and pid_alive(pid):
            found.append(pid)
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def kill_tree(pid: int, grace: float = 10.0, sig: int = signal.SIGTERM, extra: Iterable[int] = ()) -> list[int]:
    """Stop ``pid``, its process group and all its descendants (+ ``extra`` PIDs); return every PID seen.

    ``sig`` first (SIGTERM by default, lets Flower shut down cleanly), SIGKILL after ``grace`` seconds.
    """
    targets = [pid] + [p for p in descendants(pid) if p != pid] + [p for p in extra if p != pid]
    try:
        pgid = os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        pgid = None
    own_group = os.getpgrp()
    for phase_sig in (sig, signal.SIGKILL):
        if pgid is not None and pgid != own_group:
            _signal_group(pgid, phase_sig)
        for p in targets:
            _signal(p, phase_sig)
        deadline = time.monotonic() + (grace if phase_sig != signal.SIGKILL else 5.0)
        while time.monotonic() < deadline:
            # new children may have been spawned meanwhile (e.g. a SuperExec restarting an app)
            for p in targets:
                for c in descendants(p):
                    if c not in targets:
                        targets.append(c)
                        _signal(c, phase_sig)
            if not any(pid_alive(p) for p in targets):
                return targets
            time.sleep(0.1)
    return targets


# -------------------------------------------------------------------------------------------------
def wait_for_port(host: str, port: int, timeout: float, proc: "ManagedProcess | None" = None) -> None:
    """Wait until something accepts TCP connections on ``host:port`` (loopback only)."""
    if host not in LOOPBACK:
        raise ValueError(f"wait_for_port probes loopback only, got {host!r}")
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and not proc.alive():
            raise ProcessError(f"{proc.name} exited (code {proc.returncode()}) before port {port} came up\n"
                               + proc.log_tail())
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ProcessError(f"{proc.name if proc else 'process'}: port {host}:{port} not up after "
                               f"{timeout:.0f} s\n" + (proc.log_tail() if proc else ""))
        time.sleep(0.25)


def wait_for_http_health(url: str, timeout: float, cafile: str | Path | None = None,
                         proc: "ManagedProcess | None" = None) -> None:
    """Wait until ``GET url`` answers 200 (the SuperLink serves ``/health``); ``cafile`` verifies TLS."""
    host = url.split("//", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    if host not in LOOPBACK:
        raise ValueError(f"wait_for_http_health probes loopback only, got {host!r}")
    context = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        if proc is not None and not proc.alive():
            raise ProcessError(f"{proc.name} exited (code {proc.returncode()}) before {url} was healthy\n"
                               + proc.log_tail())
        try:
            with opener.open(url, timeout=3.0) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (urllib.error.URLError, OSError, ssl.SSLError) as exc:
            last = str(exc)
        if time.monotonic() > deadline:
            raise ProcessError(f"{url} not healthy after {timeout:.0f} s ({last})\n"
                               + (proc.log_tail() if proc else ""))
        time.sleep(0.3)


@dataclass
class ManagedProcess:
    name: str
    command: list[str]
    popen: subprocess.Popen
    log_path: Path
    pidfile: Path | None
    seen_pids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- last lines of {self.log_path} ---\n" + "\n".join(text[-lines:])


class Supervisor:
    """Starts processes and guarantees they (and their descendants) are stopped by PID.

    Use as a context manager; ``stop_all`` also runs at interpreter exit as a safety net::

        with Supervisor(work_dir) as sup:
            link = sup.start("superlink", ["flower-superlink", ...], env=...)
            wait_for_port("127.0.0.1", port, 120, link)
            ...
        # every process started above, and every descendant, is gone here (even after an exception)
    """

    def __init__(self, work_dir: str | Path, tag: str | None = None, grace: float = 10.0):
        self.work_dir = Path(work_dir)
        self.tag = tag or uuid.uuid4().hex
        self.grace = grace
        self.processes: list[ManagedProcess] = []
        self.all_pids: set[int] = set()   # every PID started or seen as a descendant, for leak checks
        self._started_at: dict[int, int | None] = {}   # PID -> the start time of the process it named when last seen
        self._finalizer = weakref.finalize(self, Supervisor._stop_pids, list(), self.tag)
        atexit.register(self._atexit)

    # a plain function for weakref.finalize / atexit (cannot hold self)
    @staticmethod
    def _stop_pids(pids: list[int], tag: str) -> None:
        for pid in pids + pids_with_tag(tag):
            kill_tree(pid, grace=2.0)

    def _atexit(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_all(grace=2.0)

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        merged = dict(os.environ)
        merged["PYTHONUNBUFFERED"] = "1"   # the logs must show what a process printed before it died
        # Flower processes start their helpers by bare name (the SuperLink and SuperNode run
        # `flower-superexec`, which runs `flwr-serverapp` / `flwr-clientapp`): the venv must be on PATH.
        bin_dir = str(Path(sys.executable).parent)
        path = merged.get("PATH", "")
        if bin_dir not in path.split(os.pathsep):
            merged["PATH"] = bin_dir + (os.pathsep + path if path else "")
        if env:
            merged.update(env)
        merged[TAG_VAR] = self.tag
        return merged

    def start(self, name: str, command: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None, log_path: str | Path | None = None) -> ManagedProcess:
        logs = self.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        used = {p.name for p in self.processes}
        if name in used:  # each start gets its own log and pidfile
            name = next(f"{name}-{i}" for i in range(2, 10**6) if f"{name}-{i}" not in used)
        log_path = Path(log_path) if log_path else logs / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.environment(env),
                                     cwd=str(cwd) if cwd else None, start_new_session=True)
        pid_dir = self.work_dir / "pids"
        pid_dir.mkdir(parents=True, exist_ok=True)
        pidfile = pid_dir / f"{name}.pid"
        pidfile.write_text(f"{popen.pid}\n")
        proc = ManagedProcess(name, list(command), popen, log_path, pidfile, [popen.pid])
        self.processes.append(proc)
        self._remember(popen.pid)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, Supervisor._stop_pids,
                                           [p.pid for p in self.processes], self.tag)
        return proc

    def run(self, name: str, command: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            cwd: str | Path | None = None) -> tuple[int | None, str]:
        """Run a command to completion (killed by PID after ``timeout``); return (exit code or None, output)."""
        proc = self.start(name, command, env=env, cwd=cwd)
        try:
            code: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            self.stop(proc)
        return code, proc.log_path.read_text(errors="replace")

    def snapshot(self) -> None:
        """Remember the current descendants of every live process (so later leak checks know them)."""
        for proc in self.processes:
            if proc.alive():
                for pid in descendants(proc.pid):
                    if pid not in proc.seen_pids:
                        proc.seen_pids.append(pid)
                    self._remember(pid)

    def _remember(self, pid: int) -> None:
        """Record ``pid`` as one of ours, as the process it names now (a reused PID names our new process)."""
        self.all_pids.add(pid)
        self._started_at[pid] = start_time(pid)

    def identities(self) -> list[tuple[int, int | None]]:
        """(PID, start time) of every process this supervisor started or saw (:func:`start_time`)."""
        return sorted(self._started_at.items(), key=lambda item: item[0])

    def still_running(self, pid: int) -> bool:
        """True if the process this supervisor saw under ``pid`` is still alive -- not merely its PID, which a
        busy machine may have given to an unrelated process since (compared by start time)."""
        return pid_alive(pid) and start_time(pid) == self._started_at.get(pid, start_time(pid))

    def stop(self, proc: ManagedProcess, grace: float | None = None, sig: int = signal.SIGTERM) -> None:
        # a PID seen earlier that now names another process is not ours to signal
        extra = [p for p in proc.seen_pids if self.still_running(p)]
        seen = kill_tree(proc.pid, grace=self.grace if grace is None else grace, sig=sig, extra=extra)
        for pid in seen:
            self._remember(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(5.0)  # reap
        if proc.pidfile is not None:
            with contextlib.suppress(OSError):
                proc.pidfile.unlink()

    def stop_all(self, grace: float | None = None, settle: float = 60.0) -> None:
        """Stop every started process in reverse start order, then every straggler, until none is alive.

        A process being stopped may start another (a SuperExec launching an app as it shuts down) in a new
        session, which leaves the process tree before a scan sees it; so stragglers -- tagged or recorded,
        :meth:`alive_pids` -- are stopped again until none is left, for at most ``settle`` seconds."""
        for proc in reversed(self.processes):
            self.stop(proc, grace)
        deadline = time.monotonic() + settle
        while (stragglers := self.alive_pids()) and time.monotonic() < deadline:
            for pid in stragglers:
                for seen in kill_tree(pid, grace=2.0):
                    self._remember(seen)
        if stragglers:
            warnings.warn(f"processes {stragglers} survived stopping for {settle:.0f} s", RuntimeWarning,
                          stacklevel=2)

    def alive_pids(self) -> list[int]:
        """Every process this supervisor started or saw, plus tagged processes, that is still alive."""
        return sorted({p for p in self.all_pids if self.still_running(p)} | set(pids_with_tag(self.tag)))

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
        atexit.unregister(self._atexit)
