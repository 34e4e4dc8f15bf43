"""FedAvg maths and the server's mirroring of hospital ledgers."""

import json

import numpy as np
import pytest

from privacy.events import SampledGaussianEvent
from privacy.ledger import Ledger
from server.dpfedavg import federated_average, mirror_hospital_records
from task.learning.compute import Compute


def test_federated_average_uses_public_weights_only():
    """Equal weights per hospital by default; planned public weights when given; no reported sizes."""
    a = {"w": np.array([0.0, 2.0], np.float32)}
    b = {"w": np.array([4.0, 6.0], np.float32)}
    avg = federated_average({"h0": a, "h1": b})
    assert avg["w"].dtype == np.float32
    np.testing.assert_allclose(avg["w"], [2.0, 4.0])
    np.testing.assert_allclose(federated_average({"h0": a, "h1": b}, {"h0": 1, "h1": 3})["w"], [3.0, 5.0])
    with pytest.raises(ValueError):
        federated_average({})


def test_local_round_uses_the_requested_relation_and_does_not_report_its_size(tmp_path, monkeypatch):
    """The hospital calibrates and charges under the relation the server asks for (default replace-one) and
    its reply carries no example count for the server to weight by."""
    from types import SimpleNamespace

    import privacy.calibration as calibration
    from clients.fedavg import local_dpsgd_round, plan_noise_multiplier
    from clients.hospital import Hospital, HospitalSettings
    from privacy.events import event_from_dict
    from task.learning.networks import build_unet
    from task.settings.presets import get_preset

    asked = []
    monkeypatch.setattr(calibration, "composed_dpsgd_noise_multiplier",
                        lambda *args, **kwargs: asked.append(kwargs.get("relation")) or 3.0)  # skip the PLD search
    plan_noise_multiplier.cache_clear()
    prepared = SimpleNamespace(images=lambda ids: np.zeros((len(ids), 4, 16, 16, 16), np.float32),
                               labels=lambda ids: np.zeros((len(ids), 16, 16, 16), np.int64))
    weights = {k: v.numpy() for k, v in build_unet("tiny").state_dict().items()}
    for relation in (None, "add-remove"):
        hospital = Hospital("h0", prepared, [["a", "b"], ["c", "d"]], get_preset("tiny"), tmp_path / str(relation),
                            HospitalSettings(lifetime_epsilon=100.0))
        config = {"round": 0, "rounds": 1, "epsilon": 50.0, "delta": 1e-3, "reproducible_noise": True,
                  "learning_rate": 3e-3, "max_grad_norm": 4.0, "batch_size": 2, "per_layer": True}
        _, metrics = local_dpsgd_round(hospital, weights, {**config, **({"relation": relation} if relation else {})})
        assert "n_examples" not in metrics and metrics["epochs_trained"] == 1
        events = [event_from_dict(r["event"]) for r in json.loads(metrics["ledger_records"])]
        assert events and {e.relation for e in events} == {relation or "replace-one"}
        # the round was charged to the hospital's own lifetime ledger too
        assert len(Ledger.load(hospital.privacy_ledger)) == len(events)
    assert asked == ["replace-one", "add-remove"]


def test_mirrored_ledger_gives_the_hospitals_epsilon(tmp_path):
    hospital_ledger = Ledger(tmp_path / "h0.jsonl")
    for epoch in range(3):
        hospital_ledger.record(["h0"], SampledGaussianEvent(sampling_rate=0.1, noise_multiplier=1.2, steps=10),
                               f"round-0:epoch-{epoch}")
    server = Ledger(tmp_path / "server.jsonl")
    assert mirror_hospital_records(server, "h0", json.dumps(hospital_ledger.records())) == 3
    # mirroring the same round again (a retried reply) counts once
    mirror_hospital_records(server, "h0", json.dumps(hospital_ledger.records()))
    assert server.spent("h0", 1e-5).epsilon == pytest.approx(hospital_ledger.spent("h0", 1e-5).epsilon)
    assert server.spent("h0", 1e-5).releases == 3


def test_a_hospital_cannot_charge_another_owner(tmp_path):
    forged = [{"release_id": "x", "owners": ["h1"], "event": SampledGaussianEvent(
        sampling_rate=0.1, noise_multiplier=1.0).to_dict()}]
    with pytest.raises(ValueError, match="reported a record for owners"):
        mirror_hospital_records(Ledger(None), "h0", json.dumps(forged))


def test_server_averages_with_equal_weights_and_states_the_relation(tmp_path):
    """A hospital that claims more examples gets no more weight; results take the relation from the ledger and
    state the add/remove ε of the same mechanisms beside the replace-one one."""
    from types import SimpleNamespace

    from privacy.accountants import epsilon_under
    from server.dpfedavg import DpFedAvgConfig, run_dpfedavg
    from task.settings.presets import get_preset

    preset = get_preset("tiny")
    event = SampledGaussianEvent(0.5, 3.0, 2, relation="replace-one")
    seen = []

    class Transport:
        dropped = {}

        def hospital_ids(self):
            return ["h0", "h1"]

        def fedavg_round(self, weights, config):
            seen.append((weights, config))
            replies = {}
            for hospital, value, claimed in (("h0", 0.0, 1), ("h1", 1.0, 1000)):
                record = {"release_id": f"r{config['round']}", "owners": [hospital], "event": event.to_dict()}
                metrics = {"epochs_trained": 1, "n_examples": claimed, "ledger_records": json.dumps([record])}
                replies[hospital] = (metrics, {k: np.full_like(v, value) for k, v in weights.items()})
            return replies

    world = SimpleNamespace(test_images=np.zeros((1, 4, *preset.grid), np.float32),
                            test_labels=np.zeros((1, *preset.grid), np.int64), grid=preset.grid,
                            validation_images=None, validation_labels=None, source={"kind": "synthetic-test"})
    quiet = Compute(progress=False)
    results = run_dpfedavg(Transport(), world, preset, DpFedAvgConfig(8.0, 1e-3, rounds=2, compute=quiet),
                           tmp_path / "run")
    assert all(config["relation"] == "replace-one" for _, config in seen)
    averaged = seen[1][0]  # what the server sent in round 2: the mean of round 1's updates
    assert all(np.allclose(v, 0.5) for v in averaged.values() if np.issubdtype(v.dtype, np.floating))
    server = Ledger.load(tmp_path / "run" / "ledger.jsonl")
    assert results["relation"] == "replace-one" == server.spent("h0", 1e-3).relation
    assert results["epsilon"] == pytest.approx(server.spent("h1", 1e-3).epsilon)
    assert results["epsilon_replace_one"] == results["epsilon"]
    add_remove = epsilon_under(server.events("h0"), 1e-3, "add-remove")[0]
    assert results["epsilon_add_remove"] == pytest.approx(add_remove) and add_remove < results["epsilon"]


def test_a_cell_of_a_registered_dp_fedavg_method_is_recorded_under_its_own_name_and_scored_on_its_check(tmp_path):
    """The method written to results.json is the cell's (its record's name), not the protocol's; the real-scan check
    reaches the release through the run's settings (no module-level state); a config naming a method that another
    protocol runs is refused in one line."""
    from types import SimpleNamespace

    from server.dpfedavg import DpFedAvgConfig
    from server.protocols import run_cell
    from task.errors import UserError
    from task.settings.methods import Family, Method, Protocol, Role, register_method, unregister_method
    from task.settings.presets import get_preset
    from task.reporting.realcheck import open_check
    from task.settings.runconfig import Cell, RunSettings
    from test_realcheck import write_cases

    preset = get_preset("tiny")
    event = SampledGaussianEvent(0.5, 3.0, 1, relation="replace-one")

    class Transport:
        dropped, deployed = {}, {}

        def hospital_ids(self):
            return ["h0", "h1"]

        def fedavg_round(self, weights, config):
            record = {"release_id": f"r{config['round']}:{config.get('setting', 0)}", "event": event.to_dict()}
            return {h: ({"epochs_trained": 1, "ledger_records": json.dumps([{**record, "owners": [h]}])}, dict(weights))
                    for h in self.hospital_ids()}

    world = SimpleNamespace(test_images=np.zeros((1, 4, *preset.grid), np.float32),
                            test_labels=np.zeros((1, *preset.grid), np.int64), grid=preset.grid,
                            validation_images=None, validation_labels=None, source={"kind": "synthetic-test"})
    check = open_check([write_cases(tmp_path / "real", "brats2023")], cache_dir=None)
    register_method(Method("dp-fedavg-toy", Family.DP_FEDAVG, Role.PRIVATE, federated=True,
                           protocol=Protocol.DP_FEDAVG, per_epsilon=True))
    try:
        settings = RunSettings(method="dp-fedavg-toy", preset="tiny", out=str(tmp_path / "run"), real_check=check,
                               compute=Compute(progress=False))
        results = run_cell(Transport(), world, settings, Cell("dp-fedavg-toy", 50.0, str(tmp_path / "run"),
                                                              init="scratch"))
        with pytest.raises(UserError, match="'pate-ae' is not run by the dp-fedavg protocol"):
            DpFedAvgConfig(8.0, 1e-3, method="pate-ae")
    finally:
        unregister_method("dp-fedavg-toy")
    assert results["method"] == "dp-fedavg-toy"
    assert json.loads((tmp_path / "run" / "results.json").read_text())["method"] == "dp-fedavg-toy"
    assert [case["case"] for case in results["real_check"]["cases"]] == ["Case000"]
    assert DpFedAvgConfig(8.0, 1e-3).method == "dp-fedavg"
