"""Flower's simulation runtime (`flwr run` against our own `--simulation` SuperLink), with the echo app."""

import json

import pytest

from task.errors import UserError
from sim.deployment.local import write_echo_app
from sim.deployment.processes import pid_alive, start_time
from sim.deployment.runtime_simulation import RuntimeSimulation, run_runtime_simulation, simulation_federation_config


@pytest.mark.slow
def test_runtime_simulation_two_supernodes(tmp_path):
    app = write_echo_app(tmp_path / "app")
    result = tmp_path / "result.json"
    status = run_runtime_simulation(RuntimeSimulation(app, {"result-file": str(result), "expected-nodes": 2,
                                                            "wait-seconds": 120.0},
                                                      num_supernodes=2, work_dir=tmp_path / "sim", timeout=400.0))
    assert status.ok, status
    data = json.loads(result.read_text())
    assert len(data["replies"]) == 2 and data["errors"] == []
    assert sorted(r["node-config"]["partition-id"] for r in data["replies"]) == [0, 1]
    # every process it started (SuperLink, SuperExec, simulation, Ray) is gone
    assert status.details["supervised-pids"]
    assert status.details["leftover-pids"] == []
    # by PID and start time: on a busy machine a PID seen earlier may since name an unrelated process
    assert [p for p, started in status.details["supervised-processes"]
            if pid_alive(p) and start_time(p) == started] == []
    assert "insecure = true" in (tmp_path / "sim" / "flwr-home" / "config.toml").read_text()


def test_federation_config_validation():
    assert simulation_federation_config(3)["num-supernodes"] == 3
    with pytest.raises(UserError):
        simulation_federation_config(0)
    with pytest.raises(UserError, match="pyproject.toml"):
        RuntimeSimulation("/nonexistent-app", {}, 2, "/tmp/unused-fedpate-sim")
