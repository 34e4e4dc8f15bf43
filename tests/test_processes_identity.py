"""A PID names a process only together with its start time: a supervisor must not call an unrelated process
that inherited a reused PID one of its own, nor signal it (seen in CI on a busy machine). And stopping leaves
nothing alive, even a process started by one that was being stopped."""

import subprocess
import sys
import time

from sim.deployment.processes import Supervisor, pid_alive, start_time


def test_a_reused_pid_is_not_ours(tmp_path):
    sup = Supervisor(tmp_path)
    try:
        proc = sup.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert sup.still_running(proc.pid) and proc.pid in sup.alive_pids()
        assert start_time(proc.pid) is not None
        # pretend the PID was first seen as another process (what PID reuse looks like from here)
        sup._started_at[proc.pid] = start_time(proc.pid) - 1
        assert not sup.still_running(proc.pid)
        # (alive_pids still lists it: the process carries this supervisor's tag, which a stranger would not)
        sup._started_at[proc.pid] = start_time(proc.pid)
    finally:
        sup.stop_all(grace=1.0)
    assert sup.alive_pids() == [] and not sup.still_running(proc.pid)
    assert proc.pid in dict(sup.identities())


def test_start_time_of_a_gone_process_is_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert start_time(child.pid) is None


# On SIGTERM, start the next link of the chain in a new session (out of this process group and, once this
# process exits, out of its tree), record its PID, wait until that link is ready, then exit: what a shutting-down
# parent that launches one more child looks like to the supervisor. How far the chain gets depends on the
# machine's load (a link signalled before its handler is installed just dies), so the test asks for the first
# link started while stopping, not for the whole chain.
_CHAIN = """
import os, signal, subprocess, sys, time
depth, ready = int(sys.argv[1]), sys.argv[2]
def on_term(signum, frame):
    if depth > 0:
        child = subprocess.Popen([sys.executable, __file__, str(depth - 1), ready], start_new_session=True)
        with open(f"{ready}.spawned.{depth}", "w") as handle:
            handle.write(str(child.pid))
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{ready}.{depth - 1}") and time.monotonic() < deadline:
            time.sleep(0.01)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(f"{ready}.{depth}", "w").close()
time.sleep(120)
"""


def test_stopping_leaves_no_process_alive_even_one_started_while_stopping(tmp_path):
    script = tmp_path / "chain.py"
    script.write_text(_CHAIN)
    ready = tmp_path / "ready"
    sup = Supervisor(tmp_path)
    try:
        sup.start("chain", [sys.executable, str(script), "4", str(ready)])
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready.4").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "ready.4").exists(), "the first link never started"
    finally:
        sup.stop_all(grace=1.0)
    assert sup.alive_pids() == []
    # the first link, stopped, started another process in a new session; neither that one nor any later one lives
    spawned = sorted(tmp_path.glob("ready.spawned.*"))
    assert (tmp_path / "ready.spawned.4") in spawned
    assert not any(pid_alive(int(path.read_text())) for path in spawned)
