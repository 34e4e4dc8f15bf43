"""FedAvg maths and the server's mirroring of hospital ledgers."""

import json

import numpy as np
import pytest

from privacy.events import SampledGaussianEvent
from privacy.ledger import Ledger
from server.dpfedavg import federated_average, mirror_hospital_records


def test_federated_average_is_example_weighted():
    a = {"w": np.array([0.0, 2.0], np.float32)}
    b = {"w": np.array([4.0, 6.0], np.float32)}
    avg = federated_average({"h0": (a, 1), "h1": (b, 3)})
    assert avg["w"].dtype == np.float32
    np.testing.assert_allclose(avg["w"], [3.0, 5.0])


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
