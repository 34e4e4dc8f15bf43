"""Strings other parties choose never name another file at a hospital: a DP-FedAvg server's run tag, a world's
hospital ids and a node config's hospital-id are plain file-name parts, or the request is refused in one line
before anything is charged or created."""

import os
import threading

import numpy as np
import pytest

from clients.fedavg import local_dpsgd_round
from clients.hospital import Hospital, HospitalSettings
from privacy.events import GaussianEvent
from privacy.ledger import Ledger
from task.errors import UserError
from task.names import check_name_part, safe_name_part
from task.settings.presets import get_preset

PRESET = get_preset("tiny")


def _in_thread(call, seconds=20.0):
    """``call()`` in a daemon thread: a request that deadlocks fails the test instead of hanging it."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the request still runs after 20 s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _files(root):
    return sorted(os.path.relpath(os.path.join(folder, name), root)
                  for folder, dirs, names in os.walk(root) for name in [*dirs, *names])


@pytest.mark.parametrize("run_tag", ["x/../privacy-ledger", "../../outside", "..", "", "a" * 65, "run tag",
                                     ".hidden", "a\\b"])
def test_a_dpfedavg_run_tag_that_is_not_a_plain_name_is_refused_before_anything_is_charged(tmp_path, run_tag):
    hospital = Hospital("h0", prepared=None, partitions=[["p0"]], preset=PRESET, workdir=tmp_path / "nodes" / "h0",
                        settings=HospitalSettings(lifetime_epsilon=8.0, delta=1e-3))
    earlier = Ledger(hospital.privacy_ledger)           # the lifetime ledger a tag like x/../privacy-ledger aliases
    earlier.record(["h0"], GaussianEvent(1.0, 5.0), "earlier@0")
    before, files = hospital.privacy_ledger.read_bytes(), _files(tmp_path)
    config = {"round": 0, "rounds": 1, "epsilon": 4.0, "delta": 1e-3, "run_tag": run_tag, "learning_rate": 3e-3,
              "max_grad_norm": 4.0, "batch_size": 2, "per_layer": True}
    with pytest.raises(UserError, match="the server's run_tag") as info:
        _in_thread(lambda: local_dpsgd_round(hospital, {}, config))
    assert "\n" not in str(info.value)
    assert hospital.privacy_ledger.read_bytes() == before and _files(tmp_path) == files


def test_a_hospital_id_names_no_path(tmp_path):
    from clients.node import hospital_for

    with pytest.raises(UserError, match="hospital id"):
        Hospital("../h0", prepared=None, partitions=[["p0"]], preset=PRESET, workdir=tmp_path / "h0")
    node = {"hospital-id": "../../evil", "data-dir": str(tmp_path / "data"), "epsilon-budget": 8.0,
            "max-teachers": 4}
    with pytest.raises(UserError, match="node-config hospital-id"):
        hospital_for(node, {"preset": "tiny"})
    assert _files(tmp_path) == []


def test_name_parts_are_checked_and_a_server_makes_its_run_tag_one():
    for good in ("h0", "hospital-07", "run-e1e+06-0a1b2c3d", "a.b_c"):
        assert check_name_part(good, "x") == good
    for bad in ("a/b", "a\x00b", "a..b", "-a", None, 7):
        with pytest.raises(UserError, match="x="):
            check_name_part(bad, "x")
    # whatever the server's output folder is called, the tag it sends is accepted
    for folder in ("my run (1)", "..", ".hidden", "x/../y", "résumé", "", "a" * 200):
        part = safe_name_part(folder)
        assert check_name_part(f"{part}-e{1e6:g}-0a1b2c3d", "run_tag") and len(part) <= 32
