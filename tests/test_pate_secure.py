"""Secure PATE end to end on the synthetic world (server/pate_secure.py): the server receives no teacher
encoding, only secure-sum messages; every release is a distributed discrete Gaussian charged to the run and
to each hospital's own ledger; the results say who could see what."""

from pathlib import Path

import numpy as np
import pytest

from privacy.events import DistributedDiscreteGaussianEvent
from privacy.ledger import Ledger
from tests.test_pate_run import world  # noqa: F401  (the module-scoped synthetic world fixture)
from task.learning.compute import Compute


@pytest.mark.slow
def test_secure_pate_runs_and_the_server_sees_only_the_secure_sum(world, tmp_path):  # noqa: F811
    from server.pate import PateConfig, run_pate
    from sim.runners.inprocess import InProcessTransport, simulated_hospitals
    from task.world import load_world

    prepared, split, preset = world
    preset = preset.with_changes(codec=dict(anchored_intensity_bins=1, anchored_decoder="mass-matching"))

    class Recording(InProcessTransport):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.encodings_received = 0
            self.masked_received = []

        def query(self, scans, codec, config):
            replies = super().query(scans, codec, config)
            self.encodings_received += len(replies)
            return replies

        def secure_stage(self, stage, messages, config):
            replies = super().secure_stage(stage, messages, config)
            if stage == "collect-masked":
                self.masked_received += [np.asarray(r["masked"]) for r in replies.values()]
            return replies

    ledgers = tmp_path / "hospital-ledgers"
    members = simulated_hospitals(prepared, split, preset, tmp_path / "hospitals", 0)
    transport = Recording(members, base_config={"ledger_dir": str(ledgers), "lifetime_epsilon": 8.0, "delta": 1e-3,
                                                "allow_identity": True})
    config = PateConfig("pate-anchored-secure", 8.0, 1e-3, seed=0, diagnostics=False, query_batch=4,
                        compute=Compute(progress=False))
    results = run_pate(transport, load_world(prepared, split), preset, config, tmp_path / "run")
    assert transport.encodings_received == 0                   # no teacher encoding ever reached the server
    assert len(transport.masked_received) == 2 * 2             # two hospitals x two batches of four queries
    assert results["aggregation"] == "secure" and results["accountant"] == "rdp"
    assert 7.9 < results["epsilon"] <= 8.0 and results["queries"] == 8
    assert "uniform modulo" in results["who_sees_what"]["aggregator"]
    secure = results["secure_aggregation"]
    assert secure["counted_shares"] == 2 and secure["wrap_probability_bound"] <= 1e-9
    for hospital in ("h0", "h1"):
        events = Ledger(ledgers / f"{hospital}.jsonl").events(hospital)
        assert len(events) == 8 and all(isinstance(e, DistributedDiscreteGaussianEvent) for e in events)
        assert Ledger(ledgers / f"{hospital}.jsonl").spent(hospital, 1e-3).epsilon <= 8.0
    run_events = Ledger(Path(tmp_path / "run" / "ledger.jsonl")).events("h0")
    assert run_events == Ledger(ledgers / "h0.jsonl").events("h0")


def test_the_report_says_who_could_see_what_per_method():
    from server.pate_secure import who_sees_what
    from sim.report import who_sees_what_lines

    secure = {"bits": 40, "participants": 4, "colluders": 1, "counted_shares": 3}
    cells = [{"method": "pate-anchored", "aggregation": "trusted", "who_sees_what": who_sees_what(None)},
             {"method": "pate-anchored-secure", "aggregation": "secure", "who_sees_what": who_sees_what(secure)},
             {"method": "public-only"}]
    lines = who_sees_what_lines(cells)
    assert len(lines) == 2
    assert "**trusted**" in lines[0] and "un-noised encoding" in lines[0]
    assert "**secure**" in lines[1] and "uniform modulo 2^40" in lines[1] and "at least 3 honest shares" in lines[1]


@pytest.mark.slow
def test_a_hospital_leaving_mid_batch_is_recovered_and_the_rest_count_only_what_they_rely_on(tmp_path):
    """Three hospitals, each counting on at most one dropout: one leaves after sharing its keys in the first
    batch; the survivors unmask without it (its pairwise masks rebuilt from their shares), that batch averages
    the four teachers left, and every charge counts 3 - 1 = 2 noise shares."""
    from server.pate import PateConfig, run_pate
    from task.data.synthetic import SyntheticPrepared
    from task.settings.presets import get_preset
    from sim.runners.inprocess import InProcessTransport, simulated_hospitals
    from task.world import load_world
    from tests.test_pate_run import FakeSplit

    prepared = SyntheticPrepared(28)
    ids = prepared.case_ids
    split = FakeSplit(hospitals={"h0": [[ids[0]], [ids[1]]], "h1": [[ids[2]], [ids[3]]], "h2": [[ids[4]], [ids[5]]]},
                      public_query=ids[6:14], public_reference=ids[14:22], test=ids[22:26])
    preset = get_preset("tiny").with_changes(teacher=dict(epochs=1), pretrain_epochs=2, student=dict(epochs=1),
                                             hospitals=3, teachers_per_hospital=2)
    ledgers = tmp_path / "hospital-ledgers"
    transport = InProcessTransport(simulated_hospitals(prepared, split, preset, tmp_path / "hospitals", 0),
                                   base_config={"ledger_dir": str(ledgers), "lifetime_epsilon": 8.0, "delta": 1e-3,
                                                "secure_policy": {"dropouts": 1}})
    transport.secure_drop = {"h2": "collect-masked"}
    config = PateConfig("pate-anchored-secure", 8.0, 1e-3, seed=0, diagnostics=False, query_batch=4,
                        secure={"dropouts": 1}, compute=Compute(progress=False))
    results = run_pate(transport, load_world(prepared, split), preset, config, tmp_path / "run")
    assert results["queries"] == 8 and results["teachers_per_query"] == {"min": 4, "max": 6}
    assert results["secure_aggregation"]["counted_shares"] == 2 and results["epsilon"] <= 8.0
    assert results["rejected_replies"] == {"h2": 1}
    counts = {h: len(Ledger(ledgers / f"{h}.jsonl").events(h)) for h in ("h0", "h1", "h2")}
    assert counts == {"h0": 8, "h1": 8, "h2": 4}      # h2 left before drawing its share: not charged for batch 1
    assert all(e.shares == 2 for h in counts for e in Ledger(ledgers / f"{h}.jsonl").events(h))


def test_reproducible_noise_seeds_every_hospital_share_and_secure_noise_does_not(tmp_path, monkeypatch):
    """Under reproducible noise (simulation only) two runs of one seed release the same secure sums -- every
    hospital's rounding and noise share drawn from a stream named by the query batch, not the run's nonce --
    and publish no seed; a run with secure noise draws other shares."""
    import server.pate_secure as pate_secure
    from privacy.mechanisms import NoiseSource
    from server.pate import PateConfig, run_pate
    from task.data.synthetic import SyntheticPrepared
    from task.settings.presets import get_preset
    from sim.runners.inprocess import InProcessTransport, simulated_hospitals
    from task.world import load_world
    from tests.test_pate_run import FakeSplit

    prepared = SyntheticPrepared(24)
    ids = prepared.case_ids
    split = FakeSplit(hospitals={"h0": [[ids[0]], [ids[1]]], "h1": [[ids[2]], [ids[3]]]},
                      public_query=ids[4:8], public_reference=ids[8:16], test=ids[16:20])
    preset = get_preset("tiny").with_changes(teacher=dict(epochs=1), pretrain_epochs=1, student=dict(epochs=1),
                                             hospitals=2, teachers_per_hospital=2)
    totals = []
    real_secure_sum = pate_secure.secure_sum

    def recording_secure_sum(*args, **kwargs):
        result = real_secure_sum(*args, **kwargs)
        totals[-1].append(np.asarray(result.total).copy())
        return result

    monkeypatch.setattr(pate_secure, "secure_sum", recording_secure_sum)

    def released(name, noise):
        totals.append([])
        transport = InProcessTransport(simulated_hospitals(prepared, split, preset, tmp_path / name / "hospitals", 0),
                                       base_config={"ledger_dir": str(tmp_path / name / "ledgers"),
                                                    "lifetime_epsilon": 8.0, "delta": 1e-3})
        config = PateConfig("pate-anchored-secure", 8.0, 1e-3, seed=3, diagnostics=False,
                            query_batch=4, compute=Compute(device="cpu", progress=False))
        results = run_pate(transport, load_world(prepared, split), preset, config, tmp_path / name / "run",
                           noise=noise)
        return totals[-1], results

    first, results = released("a", NoiseSource.reproducible(3))
    second, _ = released("b", NoiseSource.reproducible(3))
    secure, _ = released("c", NoiseSource())
    assert len(first) == 1 and all(np.array_equal(x, y) for x, y in zip(first, second))
    assert results["seed"] is None                          # the seed that would let anyone subtract the noise
    assert not np.array_equal(first[0], secure[0])
