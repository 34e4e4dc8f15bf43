"""Real multi-process deployment on localhost: SuperLink with TLS + SuperNode authentication, one SuperNode
per hospital, driven with the echo app (sim/deployment/local.py). Every process is checked dead afterwards."""

import json
import time

import pytest

from sim.deployment.local import LocalDeployment, write_echo_app
from sim.deployment.processes import pid_alive

pytestmark = pytest.mark.slow

HOSPITALS = [
    {"hospital-id": "h0", "data-dir": "/data/hospital 0/Task01_BrainTumour", "teachers-per-hospital": 2},
    {"hospital-id": "h1", "data-dir": "/data/h1", "teachers-per-hospital": 2},
]
RUN_TIMEOUT = 300.0   # bounded, generous for a loaded 2-core machine (a run takes ~20 s when idle)


def _assert_all_stopped(dep: LocalDeployment, extra_pids=()):
    seen = set(dep.sup.all_pids) | set(extra_pids)
    assert seen, "the deployment recorded no PIDs"
    assert dep.alive_pids() == []
    # by PID and start time: on a busy machine a PID seen earlier may since name an unrelated process
    assert [p for p in seen if dep.sup.still_running(p)] == []
    assert not list((dep.work_dir / "pids").glob("*.pid")), "pidfiles of stopped processes remain"


def _result(path):
    data = json.loads(path.read_text())
    return data, {r["node-config"]["hospital-id"] for r in data["replies"]}


def test_tls_auth_deployment_runs_and_reports_failures(tmp_path):
    app = write_echo_app(tmp_path / "app")
    result = tmp_path / "result.json"
    dep = LocalDeployment(app, tmp_path / "dep", HOSPITALS, tls=True, auth=True)
    t0 = time.monotonic()
    try:
        dep.start()
        command = " ".join(dep.superlink.command)
        assert "--enable-supernode-auth" in command and "--ssl-certfile" in command
        assert "insecure" not in (dep.flwr_home / "config.toml").read_text()
        status = dep.run({"result-file": str(result), "expected-nodes": 2, "wait-seconds": 120.0},
                         timeout=RUN_TIMEOUT)
        assert status.ok, status
        data, ids = _result(result)
        assert ids == {"h0", "h1"} and data["errors"] == []
        by_id = {r["node-config"]["hospital-id"]: r["node-config"] for r in data["replies"]}
        assert by_id["h0"] == HOSPITALS[0]   # node_config arrives intact (space in the path, int type)

        # `flwr run --stream` exits 0 when the ServerApp raises: the status must still say failed
        failed = dep.run({"fail": True, "expected-nodes": 2}, timeout=RUN_TIMEOUT)
        assert failed.exit_code == 0 and not failed.ok and failed.status == "finished:failed"
        print(f"deployment: start + 2 runs in {time.monotonic() - t0:.1f} s")
    finally:
        dep.stop()
    _assert_all_stopped(dep)


def test_unregistered_supernode_is_refused(tmp_path):
    app = write_echo_app(tmp_path / "app")
    result = tmp_path / "result.json"
    dep = LocalDeployment(app, tmp_path / "dep", HOSPITALS, tls=True, auth=True)
    try:
        dep.start()
        intruder = dep.add_supernode("intruder", {"hospital-id": "intruder", "data-dir": "/x"}, register=False)
        # ask for 3 nodes, wait up to 25 s: only the two registered ones may ever show up
        status = dep.run({"result-file": str(result), "expected-nodes": 3, "wait-seconds": 25.0},
                         timeout=RUN_TIMEOUT)
        assert status.ok, status
        data, ids = _result(result)
        assert len(data["nodes"]) == 2 and ids == {"h0", "h1"}
        assert data["waited-seconds"] >= 24.0
        intruder_pids = list(intruder.process.seen_pids)
    finally:
        dep.stop()
    _assert_all_stopped(dep, intruder_pids)


def test_killing_one_hospital_mid_run_leaves_the_run_going(tmp_path):
    app = write_echo_app(tmp_path / "app")
    result = tmp_path / "result.json"
    dep = LocalDeployment(app, tmp_path / "dep", HOSPITALS, tls=True, auth=True)
    try:
        dep.start()
        future = dep.submit({"result-file": str(result), "expected-nodes": 2, "reply-delay": 30.0,
                             "reply-timeout": 90.0}, timeout=RUN_TIMEOUT)
        # wait until h1's ClientApp process is running, then crash that hospital
        h1 = dep.supernodes[1]
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not future.done():
            dep.sup.snapshot()
            cmdlines = []
            for pid in h1.process.seen_pids:
                try:
                    cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read())
                except OSError:
                    pass
            if any(b"flwr-clientapp" in c for c in cmdlines):
                break
            time.sleep(0.5)
        else:
            pytest.fail("h1's ClientApp never started")
        killed = dep.kill_supernode("h1")
        assert any(pid_alive(p) for p in killed) is False
        status = future.result(timeout=RUN_TIMEOUT + 60)
        assert status.ok, status
        data, ids = _result(result)
        assert ids == {"h0"}
    finally:
        dep.stop()
    _assert_all_stopped(dep)
