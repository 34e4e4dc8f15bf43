"""A PID names a process only together with its start time: a supervisor must not call an unrelated process
that inherited a reused PID one of its own, nor signal it (seen in CI on a busy machine)."""

import subprocess
import sys

from sim.deployment.processes import Supervisor, start_time


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
