"""dp-fedavg-secure (server/dpfedavg_secure.py, clients/secure_gradients.py, task/learning/headgrad.py): full-batch
distributed DP gradient descent of the voxel head through the secure sum.

The server never receives one hospital's contribution, only secure-sum messages and the noisy total; every
step is charged -- ε equal to dp_accounting's for the composed distributed discrete Gaussian events; a request
below a hospital's policy is refused with its ledger byte-identical; the released mean gradient is unbiased;
the cached head gradients are the network's; a compare cell writes results.json with the ledger's ε."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import norm

from privacy.distributed import IntegerGrid, rounded_norm_bound
from privacy.events import DistributedDiscreteGaussianEvent
from privacy.ledger import Ledger
from task.learning.compute import Compute
from task.data.synthetic import SyntheticPrepared
from task.settings.presets import get_preset
from tests.test_pate_run import FakeSplit

DELTA = 1e-3
QUIET = Compute(progress=False)
EPSILON = 8.0


def _world(hospitals: int = 2, per_hospital: int = 3):
    prepared = SyntheticPrepared(28)
    ids = prepared.case_ids
    split = FakeSplit(hospitals={f"h{h}": [[ids[h * per_hospital + k]] for k in range(per_hospital)]
                                 for h in range(hospitals)},
                      public_query=ids[12:16], public_reference=ids[16:22], public_validation=ids[22:24],
                      test=ids[24:28])
    preset = get_preset("tiny").with_changes(hospitals=hospitals, teachers_per_hospital=per_hospital)
    return prepared, split, preset


def _transport(prepared, split, preset, root: Path, policy=None, cls=None):
    from sim.runners.inprocess import InProcessTransport, simulated_hospitals

    config = {"ledger_dir": str(root / "ledgers"), "lifetime_epsilon": EPSILON, "delta": DELTA}
    if policy:
        config["secure_policy"] = dict(policy)
    return (cls or InProcessTransport)(simulated_hospitals(prepared, split, preset, root / "hospitals", 0),
                                       base_config=config)


def _head_model(seed: int = 0):
    from task.learning.networks import build_unet

    torch.manual_seed(seed)
    model = build_unet("tiny", trainable="voxel-head")
    torch.nn.init.normal_(model.voxel_head[2].weight, std=0.2)   # a head that has moved: W1 gets gradients too
    return model


# ------------------------------------------------------------------------------ a recorded run, shared
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One run over two hospitals (12 steps: the tiny plan on 6 patients), every exchange recorded."""
    import clients.secure_gradients as contributor_module
    import server.dpfedavg_secure as server_module
    from server.dpfedavg_secure import DpFedAvgSecureConfig, run_dpfedavg_secure
    from sim.runners.inprocess import InProcessTransport
    from task.world import load_world

    class Recording(InProcessTransport):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.replies, self.other_calls = [], 0

        def secure_stage(self, stage, messages, config):
            replies = super().secure_stage(stage, messages, config)
            self.replies += [(stage, h, reply) for h, reply in replies.items()]
            return replies

        def fedavg_round(self, *args, **kwargs):
            self.other_calls += 1
            return super().fedavg_round(*args, **kwargs)

        def query(self, *args, **kwargs):
            self.other_calls += 1
            return super().query(*args, **kwargs)

    root = tmp_path_factory.mktemp("secure-fedavg")
    prepared, split, preset = _world()
    transport = _transport(prepared, split, preset, root, cls=Recording)
    contributions, sums = [], []
    original_contribution, original_sum = contributor_module.HeadGradientContributor.contribution, server_module.secure_sum

    def contribution(self, session, message, config, policy):
        vector = original_contribution(self, session, message, config, policy)
        contributions.append((self.hospital.hospital_id, session.bits, np.array(vector)))
        return vector

    def secure_sum(*args, **kwargs):
        result = original_sum(*args, **kwargs)
        sums.append(result)
        return result

    patch = pytest.MonkeyPatch()
    patch.setattr(contributor_module.HeadGradientContributor, "contribution", contribution)
    patch.setattr(server_module, "secure_sum", secure_sum)
    try:
        results = run_dpfedavg_secure(transport, load_world(prepared, split), preset,
                                      DpFedAvgSecureConfig(EPSILON, DELTA, compute=QUIET), root / "run")
    finally:
        patch.undo()
    return SimpleNamespace(root=root, transport=transport, results=results, contributions=contributions, sums=sums,
                           world=(prepared, split, preset))


def test_the_server_sees_only_protocol_messages_and_never_a_hospitals_contribution(recorded):
    transport, results = recorded.transport, recorded.results
    assert transport.other_calls == 0      # no plain FedAvg update and no PATE query ever reached the server
    allowed = {"join": {"patients", "start_digest", "dimension"}, "setup": {"pk1", "pk2"},
               "share-keys": {"ciphertexts"}, "collect-masked": {"masked"}, "unmask": {"shares"}}
    assert all(set(reply) == allowed[stage] for stage, _, reply in transport.replies)
    masked = [(h, np.asarray(r["masked"])) for stage, h, r in transport.replies if stage == "collect-masked"]
    steps = results["secure_aggregation"]["steps_released"]
    assert steps == 12 and len(masked) == len(recorded.contributions) == 2 * steps
    for (hospital, vector), (owner, bits, contribution) in zip(masked, recorded.contributions):
        assert hospital == owner
        assert not np.array_equal(vector, contribution & ((1 << bits) - 1))   # what arrived was masked
    # ... and yet the unmasked sum is exactly the hospitals' noised contributions added up (nothing else)
    for step, result in enumerate(recorded.sums):
        bits = recorded.contributions[2 * step][1]
        added = sum(c for _, _, c in recorded.contributions[2 * step:2 * step + 2])
        assert np.array_equal(result.total, added & ((1 << bits) - 1))
    assert results["aggregation"] == "secure" and "uniform modulo" in results["who_sees_what"]["aggregator"]
    assert "never one hospital's gradients" in results["who_sees_what"]["aggregator"]


def test_the_charged_epsilon_is_dp_accountings_for_the_composed_events(recorded):
    from dp_accounting import dp_event, rdp

    results = recorded.results
    secure = results["secure_aggregation"]
    assert results["accountant"] == "rdp" and results["relation"] == "replace-one"
    grid = IntegerGrid(results["max_grad_norm"], secure["granularity"], 213)
    delta2 = 2 * rounded_norm_bound(grid.clip / grid.granularity, 213)            # replace-one, rounding inside
    delta1 = delta2 * min(math.sqrt(213), delta2)
    v, n = secure["local_variance"], secure["counted_shares"]
    tau = 10 * sum(math.exp(-2 * math.pi ** 2 * v * k / (k + 1)) for k in range(1, n))
    a2, a1 = delta2 / math.sqrt(n * v), delta1 / math.sqrt(n * v)
    rho = 0.5 * min((a2 + tau * math.sqrt(213)) ** 2, a2 * a2 + 2 * a1 * tau + tau * tau * 213)   # Prop. 14
    accountant = rdp.RdpAccountant()
    for _ in range(results["steps"]):
        accountant.compose(dp_event.ZCDpEvent(rho))
    expected = accountant.get_epsilon(DELTA)
    assert results["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert 7.9 < results["epsilon"] <= EPSILON           # the calibration spends the budget, never more
    run = Ledger.load(recorded.root / "run" / "ledger.jsonl")
    assert run.owners() == ["h0", "h1"]
    for hospital in ("h0", "h1"):   # every hospital charged its own ledger the same releases, each before its noise
        own = Ledger.load(recorded.root / "ledgers" / f"{hospital}.jsonl")
        events = own.events(hospital)
        assert len(events) == 12 and all(isinstance(e, DistributedDiscreteGaussianEvent) for e in events)
        assert events == run.events(hospital)
        assert events[0].l2_sensitivity == pytest.approx(delta2) and events[0].shares == 2
        assert own.spent(hospital, DELTA).epsilon == pytest.approx(expected, rel=1e-9)


def test_a_below_policy_request_is_refused_with_the_hospitals_ledgers_unchanged(recorded, tmp_path):
    """Each hospital now assumes one colluder: with two participants it can count one noise share, the server
    declares two -- refused at setup, nothing charged, no step released."""
    from server.dpfedavg_secure import DpFedAvgSecureConfig, run_dpfedavg_secure
    from task.world import load_world

    prepared, split, preset = recorded.world
    ledgers = sorted((recorded.root / "ledgers").glob("*.jsonl"))
    before = {p.name: p.read_bytes() for p in ledgers}
    from task.errors import UserError

    transport = _transport(prepared, split, preset, recorded.root, policy={"colluders": 1})
    with pytest.raises(UserError, match="no step was released .*not released"):   # the start model is not shipped
        run_dpfedavg_secure(transport, load_world(prepared, split), preset,
                            DpFedAvgSecureConfig(EPSILON, DELTA, compute=QUIET), tmp_path / "run")
    assert not (tmp_path / "run" / "results.json").exists() and not (tmp_path / "run" / "model").exists()
    assert {p.name: p.read_bytes() for p in sorted((recorded.root / "ledgers").glob("*.jsonl"))} == before


def test_a_hospital_refuses_to_join_under_add_remove_and_a_deployed_one_refuses_seeded_noise(tmp_path):
    from clients.secure import SecureHospital, SecurePolicy, SecureRequestRefused
    from task.errors import UserError
    from task.wire.secagg import CONTRIBUTION_KIND

    prepared, split, preset = _world()
    transport = _transport(prepared, split, preset, tmp_path)
    hospital = transport.hospitals["h0"]
    start = {k: v.numpy() for k, v in _head_model().state_dict().items() if not k.startswith("voxel_head.")}
    party = SecureHospital(hospital)
    with pytest.raises(UserError, match="replace-one"):
        party.handle("join", {"kind": CONTRIBUTION_KIND, "relation": "add-remove", "start_weights": start})
    joined = party.handle("join", {"kind": CONTRIBUTION_KIND, "relation": "replace-one", "start_weights": start})
    assert joined["patients"] == 3 and joined["dimension"] == 213
    # another process of the node (nothing in memory) finds the start model on the hospital's disk, by digest
    from clients import secure_gradients

    secure_gradients._CONTRIBUTORS.clear()
    assert secure_gradients.contributor_for(hospital)._model(joined["start_digest"]) is not None
    assert secure_gradients.contributor_for(hospital)._model("f" * 64) is None
    hospital.deployed = True
    grid = IntegerGrid.for_rows(0.1, 213)
    session = SimpleNamespace(noise={"kind": CONTRIBUTION_KIND, "local_variance": 100.0, "shares": 2,
                                     "total_variance": 200.0, "clip": grid.clip, "granularity": grid.granularity,
                                     "dimension": 213, "release_ids": ["r"]},
                              counted=2, participants=["h0", "h1"], threshold=2, length=213)
    from task.learning.headgrad import head_state

    message = {"head": head_state(_head_model()), "start_digest": joined["start_digest"]}
    config = {**transport.base_config, "secure_noise_seed": 3}
    with pytest.raises(SecureRequestRefused, match="seeded noise"):
        party.gradients.contribution(session, message, config, SecurePolicy())
    with pytest.raises(SecureRequestRefused, match="no start model"):
        party.gradients.contribution(session, {**message, "start_digest": "0" * 64}, config, SecurePolicy())
    assert not (tmp_path / "ledgers" / "h0.jsonl").exists()


def test_head_weights_that_overflow_a_patients_gradient_cannot_abort_the_step_after_the_charge(tmp_path):
    """Finite head weights of 1e35 make the patients' gradients overflow: each such patient contributes a zero
    row, so the contribution is still released (finite, inside the clip the charge assumed) and charged once,
    never aborted after the charge by something one patient's data decides."""
    from clients.secure import SecureHospital, SecurePolicy
    from task.learning.headgrad import head_state
    from task.wire.secagg import CONTRIBUTION_KIND

    prepared, split, preset = _world()
    transport = _transport(prepared, split, preset, tmp_path)
    config = {**transport.base_config, "lifetime_epsilon": math.inf}
    model = _head_model()
    start = {k: v.numpy() for k, v in model.state_dict().items() if not k.startswith("voxel_head.")}
    party = SecureHospital(transport.hospitals["h0"])
    digest = party.handle("join", {"kind": CONTRIBUTION_KIND, "start_weights": start}, config)["start_digest"]
    head = {name: np.full_like(value, 1e35) for name, value in head_state(model).items()}
    grid = IntegerGrid.for_rows(0.1, 213)
    session = SimpleNamespace(noise={"kind": CONTRIBUTION_KIND, "local_variance": 100.0, "shares": 2,
                                     "total_variance": 200.0, "clip": grid.clip, "granularity": grid.granularity,
                                     "dimension": 213, "release_ids": ["overflow"]},
                              counted=2, participants=["h0", "h1"], threshold=2, length=213)
    vector = party.gradients.contribution(session, {"head": head, "start_digest": digest}, config, SecurePolicy())
    assert vector.shape == (213,) and vector.dtype == np.int64
    # every patient's row was the zero fallback: what is left is the noise share alone (sd 10 per coordinate)
    assert np.abs(vector).max() < 100 and 50 < np.var(vector) < 200
    assert len(Ledger.load(tmp_path / "ledgers" / "h0.jsonl").records()) == 1


# ------------------------------------------------------------------------------ the gradients themselves
def _clipped_patient_gradients_through_the_network(model, images, labels, clip):
    """Reference: each patient's head gradient by plain autograd through the whole network, clipped flat."""
    from task.learning.headgrad import head_parameter_names
    from task.learning.training import per_sample_loss

    names = head_parameter_names(model)
    parameters = dict(model.named_parameters())
    rows = []
    model.train()
    for image, label in zip(images, labels):
        model.zero_grad(set_to_none=True)
        logits = model(torch.from_numpy(image[None]))
        per_sample_loss(logits, torch.from_numpy(label[None]).long()).sum().backward()
        rows.append(torch.cat([parameters[n].grad.reshape(-1) for n in names]).double().numpy())
    rows = np.stack(rows)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows * np.minimum(1.0, clip / (norms + 1e-6))


def test_cached_head_gradients_equal_the_networks():
    from task.learning.headgrad import check_frozen_deterministic, frozen_features, per_sample_head_gradients
    from task.learning.networks import build_unet
    from task.errors import UserError

    prepared = SyntheticPrepared(6)
    images, labels = prepared.images(prepared.case_ids), prepared.labels(prepared.case_ids)
    model = _head_model()
    cached = per_sample_head_gradients(model, frozen_features(model, images, batch_size=4), labels, chunk=4)
    reference = _clipped_patient_gradients_through_the_network(model, images, labels, np.inf)
    assert cached.shape == (6, 213) and np.abs(reference).max() > 1e-3
    np.testing.assert_allclose(cached, reference, rtol=1e-4, atol=1e-7)
    # ... and the per-sample gradients pooled DP-SGD's engine computes (Opacus on the network, U-Net frozen)
    from opacus import GradSampleModule

    from task.learning.headgrad import head_parameter_names
    from task.learning.networks import freeze_all_but
    from task.learning.training import per_sample_loss

    engine = _head_model()
    freeze_all_but(engine, "voxel-head")
    wrapped = GradSampleModule(engine, batch_first=True, loss_reduction="sum")
    per_sample_loss(wrapped(torch.from_numpy(images)), torch.from_numpy(labels).long()).sum().backward()
    parameters = dict(engine.named_parameters())
    opacus = torch.cat([parameters[n].grad_sample.reshape(6, -1) for n in head_parameter_names(engine)], dim=1)
    np.testing.assert_allclose(cached, opacus.double().numpy(), rtol=1e-4, atol=1e-7)
    # train and eval mode give the same features: nothing in the frozen U-Net depends on the mode
    model.eval()
    np.testing.assert_array_equal(frozen_features(model, images).numpy(), frozen_features(model, images).numpy())
    with torch.no_grad():
        eval_logits = model.model(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(frozen_features(model, images)[:, :4].numpy(), eval_logits, rtol=1e-5, atol=1e-6)
    # a frozen network with dropout would not give fixed features: refused
    dropout = build_unet("tiny", trainable="voxel-head")
    dropout.model[0].add_module("drop", torch.nn.Dropout3d(0.1))
    with pytest.raises(UserError, match="dropout"):
        check_frozen_deterministic(dropout)


def test_the_mean_of_many_noisy_steps_is_the_mean_clipped_gradient(tmp_path):
    """300 noisy contributions of two hospitals, decoded as the server does: per coordinate within about 5.9
    standard errors of the true mean clipped patient gradient (a family-wise false alarm of one in a million), and the squared z-scores average about 1 (a rounding
    that always floored would shift every coordinate by ~3.7 standard errors)."""
    from clients.secure import SecureHospital, SecurePolicy
    from task.learning.headgrad import head_state
    from task.wire.secagg import CONTRIBUTION_KIND

    prepared, split, preset = _world()
    transport = _transport(prepared, split, preset, tmp_path)
    config = {**transport.base_config, "lifetime_epsilon": math.inf}
    model = _head_model(1)
    start = {k: v.numpy() for k, v in model.state_dict().items() if not k.startswith("voxel_head.")}
    clip, variance, draws = 0.01, 100.0, 300
    grid = IntegerGrid.for_rows(clip, 213)
    parties = {h: SecureHospital(transport.hospitals[h]) for h in ("h0", "h1")}
    digests = {h: p.handle("join", {"kind": CONTRIBUTION_KIND, "start_weights": start}, config)["start_digest"]
               for h, p in parties.items()}
    noise = {"kind": CONTRIBUTION_KIND, "local_variance": variance, "shares": 2, "total_variance": 2 * variance,
             "clip": clip, "granularity": grid.granularity, "dimension": 213, "release_ids": ["step"]}
    released = []
    for k in range(draws):
        session = SimpleNamespace(noise={**noise, "release_ids": [f"step-{k}"]}, counted=2,
                                  participants=["h0", "h1"], threshold=2, length=213)
        total = sum(parties[h].gradients.contribution(session, {"head": head_state(model),
                                                                "start_digest": digests[h]}, config, SecurePolicy())
                    for h in parties)
        released.append(grid.to_reals(total) / 6)
    cases = [c for h in ("h0", "h1") for part in split.hospitals[h] for c in part]
    truth = _clipped_patient_gradients_through_the_network(model, prepared.images(cases), prepared.labels(cases),
                                                           clip).mean(axis=0)
    assert np.all(np.linalg.norm(_clipped_patient_gradients_through_the_network(
        model, prepared.images(cases), prepared.labels(cases), np.inf), axis=1) > clip)   # every row is clipped
    standard_error = grid.granularity * math.sqrt(2 * variance) / 6 / math.sqrt(draws)
    z = (np.mean(released, axis=0) - truth) / standard_error
    # the noise is the OS's, so this test sees a fresh draw every run: the largest of 213 |z| stays below the
    # threshold a correct sum crosses once in a million runs (5 was crossed about once in 8,000)
    assert np.max(np.abs(z)) < norm.isf(1e-6 / (2 * z.size))
    assert 0.7 < np.mean(z * z) < 1.3
    assert len(Ledger.load(tmp_path / "ledgers" / "h0.jsonl").records()) == draws   # every draw was charged


def test_a_hospital_dropping_mid_protocol_is_recovered_and_the_charges_count_the_missing_share(tmp_path):
    from server.dpfedavg_secure import DpFedAvgSecureConfig, run_dpfedavg_secure
    from task.world import load_world

    prepared, split, preset = _world(hospitals=3, per_hospital=2)
    transport = _transport(prepared, split, preset, tmp_path, policy={"dropouts": 1})
    transport.secure_drop = {"h2": "collect-masked"}      # h2 leaves after sharing its keys, in the first step
    results = run_dpfedavg_secure(transport, load_world(prepared, split), preset,
                                  DpFedAvgSecureConfig(EPSILON, DELTA, compute=QUIET, threat={"dropouts": 1}, steps=3),
                                  tmp_path / "run")
    assert results["steps"] == 3 and results["stopped_early"] is None
    assert results["history"][0] == {"step": 0, "hospitals": 2, "patients": 4}     # divided by the survivors'
    assert results["history"][1] == {"step": 1, "hospitals": 3, "patients": 6}
    assert results["secure_aggregation"]["counted_shares"] == 2 and results["epsilon"] <= EPSILON
    counts = {h: len(Ledger.load(tmp_path / "ledgers" / f"{h}.jsonl").events(h)) for h in ("h0", "h1", "h2")}
    assert counts == {"h0": 3, "h1": 3, "h2": 2}     # h2 left before it drew its share: not charged for step 0
    events = [e for h in counts for e in Ledger.load(tmp_path / "ledgers" / f"{h}.jsonl").events(h)]
    assert all(e.shares == 2 for e in events)


def test_the_settings_are_pooled_dpsgds_at_the_quick_preset():
    from server.dpfedavg_secure import planned_steps, pooled_dpsgd_setting
    from sim.runners.central import settings_grid

    quick = get_preset("quick")
    pooled = settings_grid(quick, True, {}, grid=True)
    assert len(pooled) == 1
    ours = pooled_dpsgd_setting(quick)
    assert ours == {k: pooled[0][k] for k in ("learning_rate", "epochs", "max_grad_norm", "batch_size", "trainable")}
    assert ours["trainable"] == "voxel-head" and ours["learning_rate"] == 1e-2 and ours["max_grad_norm"] == 0.1
    assert planned_steps(ours, 180) == 10 * 12


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_compare_cell_writes_results_with_the_ledgers_epsilon(tmp_path, monkeypatch, tiny_phantoms):
    from sim.cli import main

    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cmp"
    assert main(["compare", "--preset", "tiny", "--epsilons", "8", "--methods", "dp-fedavg-secure", "--engine",
                 "inprocess", "--workers", "1", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "dp-fedavg-secure" / "eps-8" / "results.json").read_text())
    ledger = Ledger.load(out / "dp-fedavg-secure" / "eps-8" / "ledger.jsonl")
    assert results["epsilon"] == pytest.approx(max(ledger.spent(o, results["delta"]).epsilon for o in ledger.owners()))
    assert 0 < results["epsilon"] <= 8 and results["accountant"] == "rdp" and results["dice"]["mean"] is not None
    assert results["steps"] == results["secure_aggregation"]["steps_planned"] > 0
    report = (out / "report.md").read_text()
    assert "dp-fedavg-secure" in report and "aggregation: **secure**" in report


def test_dp_fedavg_secure_over_the_flower_transport(tiny_prepared, tiny_split, tmp_path):
    """The same protocol over Flower messages (the real ClientApp behind an in-memory Grid): a new
    SecureHospital per message, the start model found again by its digest; only identify and secure-sum
    messages travel, the server side receives only protocol fields, and ε is the run ledger's."""
    from server.dpfedavg_secure import DpFedAvgSecureConfig, run_dpfedavg_secure
    from server.flower_transport import FlowerTransport, TransportSettings
    from task.world import load_world
    from tests.test_flower_secure import RecordingGrid

    tiny_split.to_json(tmp_path / "split.json")
    (tmp_path / "world.json").write_text(json.dumps({"prepared": str(tiny_prepared.path), "preset": "tiny"}))
    grid = RecordingGrid(tmp_path, nodes=2)
    transport = FlowerTransport(grid, TransportSettings(2, wait_seconds=1, reply_timeout=30, poll_seconds=0.01,
                                base_config={"preset": "tiny", "seed": 0, "world": str(tmp_path),
                                             "ledger_dir": str(tmp_path / "hospital-ledgers"),
                                             "lifetime_epsilon": EPSILON, "delta": DELTA}))
    transport.connect()
    results = run_dpfedavg_secure(transport, load_world(tiny_prepared, tiny_split), get_preset("tiny"),
                                  DpFedAvgSecureConfig(EPSILON, DELTA, compute=QUIET, steps=3), tmp_path / "run")
    assert results["steps"] == 3 and results["stopped_early"] is None and results["hospitals"] == 2
    ledger = Ledger.load(tmp_path / "run" / "ledger.jsonl")
    assert results["epsilon"] == pytest.approx(max(ledger.spent(o, DELTA).epsilon for o in ledger.owners()))
    assert {kind for _, kind, _ in grid.sent} == {"query.identify", "query.secure"}
    allowed = {"join": {"patients", "start_digest", "dimension"}, "setup": {"pk1", "pk2"},
               "share-keys": {"ciphertexts"}, "collect-masked": {"masked"}, "unmask": {"shares"}}
    from task.wire.flower_wire import unpack_nested

    for _, stage, config, arrays in grid.incoming:
        assert set(unpack_nested(config["reply"], arrays.get("reply", {}))) == allowed[stage]
    for hospital in ("hospital-00", "hospital-01"):
        own = Ledger.load(tmp_path / "hospital-ledgers" / f"{hospital}.jsonl").events(hospital)
        assert len(own) == 3 and own == ledger.events(hospital)


def test_noise_is_seeded_only_under_reproducible_noise(tmp_path):
    """Two runs with reproducible noise and one seed train the same head and publish no seed; secure runs
    (the default) draw fresh noise every time."""
    from server.dpfedavg_secure import DpFedAvgSecureConfig, run_dpfedavg_secure
    from task.world import load_world

    prepared, split, preset = _world()

    def head_after(name, reproducible):
        transport = _transport(prepared, split, preset, tmp_path / name)
        results = run_dpfedavg_secure(transport, load_world(prepared, split), preset,
                                      DpFedAvgSecureConfig(EPSILON, DELTA, compute=QUIET, steps=2,
                                                           reproducible_noise=reproducible), tmp_path / name / "run")
        weights = torch.load(tmp_path / name / "run" / "model" / "weights.pt", weights_only=True)
        return results, torch.cat([v.reshape(-1) for k, v in sorted(weights.items()) if k.startswith("voxel_head.")])

    first, a = head_after("a", True)
    _, b = head_after("b", True)
    secure, c = head_after("c", False)
    assert torch.equal(a, b) and first["seed"] is None and first["noise"] == "reproducible"
    assert not torch.equal(a, c) and secure["seed"] == 0 and secure["noise"] == "secure"
