"""The hospital owns its patients' budget (docs/PRIVACY.md, "Who is trusted"): it checks the codec it is sent, charges
its own ledger with the sensitivity it computes itself before any teacher runs, refuses what would exceed its lifetime
budget, and a deployed hospital refuses everything meant for simulations only."""

import numpy as np
import pytest

from clients.hospital import Hospital, HospitalSettings
from privacy.errors import BudgetExceeded, PrivacyError
from privacy.events import GaussianEvent
from privacy.guard import BudgetGuard, GuardChain
from privacy.ledger import Ledger
from task.learning.compute import Compute
from task.codecs import AutoencoderCompressor, IdentityCompressor, PCACompressor
from task import codecs
from task.errors import UserError
from task.settings.presets import get_preset

GRID = (8, 8, 8)
PRESET = get_preset("tiny")


def _maps(n=12, seed=0):
    rng = np.random.default_rng(seed)
    return codecs.one_hot(rng.integers(0, 4, size=(n, *GRID)), 4)


class FixedTeachers(Hospital):
    """A hospital whose teachers answer fixed probabilities (no training needed); ``broken`` teachers
    answer NaN. Counts how often any teacher ran."""

    def __init__(self, tmp_path, teachers=3, broken=(), deployed=False, lifetime=4.0, **kw):
        super().__init__("h0", prepared=None, partitions=[[f"p{k}"] for k in range(teachers)], preset=PRESET,
                         workdir=tmp_path / "h0",
                         settings=HospitalSettings(deployed=deployed, lifetime_epsilon=lifetime, delta=1e-3, **kw))
        self.broken = set(broken)
        self.runs = 0

    def load_teachers(self, config=None):   # fixed answers: nothing on disk to load
        pass

    def teacher_probs(self, k, scans, config=None):
        self.runs += 1
        probs = np.full((len(scans), 4, *GRID), 0.25, np.float32)
        if k in self.broken:
            probs[:] = np.nan
        return probs


def _query(release_ids, sigma=0.5, teachers=6, **extra):
    return {"release_ids": list(release_ids), "sigma": sigma, "teachers": teachers, **extra}


# ---------------------------------------------------------------------------------------- codec checks
def test_codec_sensitivity_is_the_compressors_for_every_kind():
    maps = _maps()
    compressors = [PCACompressor(4, "public").fit(maps), PCACompressor(4, "paper").fit(maps),
                   PCACompressor(4, "clip", clip=2.0).fit(maps), IdentityCompressor().fit(maps)]
    for compressor in compressors:
        state = codecs.verify_codec(compressor.state(), codecs.CodecPolicy(allow_identity=True))
        for k in (1, 7, 128):
            assert codecs.codec_sensitivity(state, k) == pytest.approx(compressor.sensitivity(k), rel=1e-5)
    assert codecs.codec_sensitivity({"kind": np.array("ae"), "row_bound": np.array(1.0)}, 8) == 0.25


def test_hospital_refuses_codecs_it_cannot_bound():
    maps = _maps()
    good = PCACompressor(4, "public").fit(maps).state()
    skewed = dict(good, components=good["components"] * 1.5)             # not orthonormal: ||A||_op > 1
    with pytest.raises(codecs.CodecRefused, match="orthonormal"):
        codecs.verify_codec(skewed)
    with pytest.raises(codecs.CodecRefused, match="probability map"):
        codecs.verify_codec(dict(good, mean=good["mean"] + 2.0))
    with pytest.raises(codecs.CodecRefused, match="max-latent-dim"):
        codecs.verify_codec(good, codecs.CodecPolicy(max_latent_dim=3))
    identity = IdentityCompressor().fit(maps).state()
    with pytest.raises(codecs.CodecRefused, match="allow-identity"):
        codecs.verify_codec(identity)
    codecs.verify_codec(identity, codecs.CodecPolicy(allow_identity=True))
    # a claimed row bound smaller than the truth is replaced by the hospital's own computation
    lying = dict(good, row_bound=np.array(1e-3))
    assert float(codecs.verify_codec(lying)["row_bound"]) == pytest.approx(float(good["row_bound"]), rel=1e-6)


# ------------------------------------------------------------------------------------- own ledger
def test_hospital_charges_its_own_ledger_before_answering(tmp_path):
    hospital = FixedTeachers(tmp_path)
    state = PCACompressor(3, "clip", clip=1.0).fit(_maps()).state()
    rows, notes = hospital.answer_query(np.zeros((2, 4, *GRID), np.float32), state, _query(["a", "b"]))
    assert rows.shape == (3, 2, 3) and notes == {"fallback_teachers": 0}
    ledger = Ledger.load(hospital.privacy_ledger)
    # the server's ids, each with the nonce this hospital minted for the batch (one nonce, two releases)
    ids = [r["release_id"] for r in ledger.records()]
    assert [i.split("@")[0] for i in ids] == ["a", "b"] and len({i.split("@")[1] for i in ids}) == 1
    # S = 2C/K for the declared K = 6 (not the hospital's own 3 teachers), computed from the codec
    assert [r["event"]["sensitivity"] for r in ledger.records()] == [pytest.approx(2 * 1.0 / 6)] * 2
    assert ledger.owners() == ["h0"]


def test_hospital_refuses_a_batch_beyond_its_lifetime_budget_and_runs_no_teacher(tmp_path):
    hospital = FixedTeachers(tmp_path, lifetime=1.0)
    state = PCACompressor(3, "clip", clip=1.0).fit(_maps()).state()
    scans = np.zeros((3, 4, *GRID), np.float32)
    with pytest.raises(BudgetExceeded):    # sigma far too small for epsilon 1
        hospital.answer_query(scans, state, _query(["a", "b", "c"], sigma=0.01))
    assert hospital.runs == 0 and not hospital.privacy_ledger.exists()
    # the budget spans runs: a second run cannot spend what the first did
    hospital.answer_query(scans[:1], state, _query(["r1"], sigma=1.5))      # epsilon 0.51
    spent = Ledger.load(hospital.privacy_ledger).spent("h0", 1e-3).epsilon
    assert 0 < spent < 1.0
    with pytest.raises(BudgetExceeded):
        FixedTeachers(tmp_path, lifetime=1.0).answer_query(scans[:1], state, _query(["r2"], sigma=1.0))
    assert len(Ledger.load(hospital.privacy_ledger)) == 1


def test_a_query_must_declare_what_it_releases(tmp_path):
    hospital = FixedTeachers(tmp_path)
    state = PCACompressor(3, "clip", clip=1.0).fit(_maps()).state()
    scans = np.zeros((2, 4, *GRID), np.float32)
    for bad in ({}, _query(["a"]), _query(["a", "a"]), _query(["a", "b"], teachers=2)):
        with pytest.raises(UserError):
            hospital.answer_query(scans, state, bad)
    assert hospital.runs == 0


def test_nan_teacher_answers_a_fixed_row_and_only_its_count_leaves(tmp_path):
    hospital = FixedTeachers(tmp_path, broken={1})
    state = PCACompressor(3, "clip", clip=1.0).fit(_maps()).state()
    rows, notes = hospital.answer_query(np.zeros((2, 4, *GRID), np.float32), state, _query(["a", "b"]))
    assert notes == {"fallback_teachers": 1}
    np.testing.assert_array_equal(rows[1], 0.0)
    assert np.all(np.isfinite(rows)) and np.any(rows[0] != 0)


# --------------------------------------------------------------------- deployment vs simulation
def test_deployed_hospital_refuses_simulation_only_requests(tmp_path):
    deployed = FixedTeachers(tmp_path, deployed=True)
    simulated = FixedTeachers(tmp_path / "sim")
    state = PCACompressor(3, "clip", clip=1.0).fit(_maps()).state()
    scans = np.zeros((1, 4, *GRID), np.float32)
    with pytest.raises(UserError, match="diagnostic"):
        deployed.answer_query(scans, state, {"diagnostic": True})
    with pytest.raises(UserError, match="Dice"):
        deployed.evaluate({"images": scans, "labels": np.zeros((1, *GRID), np.int64)})
    rows, _ = simulated.answer_query(scans, state, {"diagnostic": True})   # simulation: a flagged diagnostic
    assert rows.shape == (3, 1, 3) and not simulated.privacy_ledger.exists()
    # a deployed hospital keeps its own ledger and budget whatever the server says
    with pytest.raises(BudgetExceeded):
        deployed.answer_query(scans, state, _query(["x"], sigma=0.01, lifetime_epsilon=1e9,
                                                   ledger_dir=str(tmp_path / "elsewhere")))
    identity = IdentityCompressor().fit(_maps()).state()
    with pytest.raises(codecs.CodecRefused):
        deployed.answer_query(scans, identity, _query(["y"], allow_identity=True))


# ------------------------------------------------------------------------------ the server's side
def test_server_releases_nothing_when_fewer_teachers_answer_than_declared(tmp_path):
    from server.aggregation import QueryRelease, aggregate_query

    compressor = PCACompressor(3, "clip", clip=1.0).fit(_maps())
    state = codecs.verify_codec(compressor.state())
    guard = BudgetGuard(Ledger(None), 100.0, 1e-3)
    rows = np.full((3, 3), 0.1)
    noisy, k = aggregate_query({"h0": rows}, QueryRelease("q0", 0.5, compressor, state=state,
                                                          expected_rows={"h0": 3, "h1": 3}), guard)
    assert noisy is None and k == 0 and len(guard.ledger) == 0
    noisy, k = aggregate_query({"h0": rows, "h1": rows}, QueryRelease("q1", 0.5, compressor, state=state,
                                                                      expected_rows={"h0": 3, "h1": 3}), guard)
    assert noisy is not None and k == 6
    assert guard.ledger.records()[0]["event"]["sensitivity"] == pytest.approx(2 / 6)


def test_guard_chain_checks_every_budget_and_records_lifetime_first(tmp_path):
    run = BudgetGuard(Ledger(tmp_path / "run.jsonl"), 3.0, 1e-3)
    h0 = BudgetGuard(Ledger(tmp_path / "h0.jsonl"), {"h0": 2.0}, 1e-3)
    h1 = BudgetGuard(Ledger(tmp_path / "h1.jsonl"), {"h1": 0.5}, 1e-3)
    chain = GuardChain(run, [(h0, ["h0"]), (h1, ["h1"])])
    small = GaussianEvent(sensitivity=0.05, sigma=1.0)
    chain.charge(["h0", "h1"], small, "r0")
    assert Ledger.load(tmp_path / "h0.jsonl").owners() == ["h0"]          # each ledger its own owner
    assert Ledger.load(tmp_path / "h1.jsonl").owners() == ["h1"]
    assert Ledger.load(tmp_path / "run.jsonl").owners() == ["h0", "h1"]
    big = GaussianEvent(sensitivity=0.4, sigma=1.0)                        # fits run and h0, not h1
    with pytest.raises(BudgetExceeded, match="h1"):
        chain.charge(["h0", "h1"], big, "r1")
    assert all(len(Ledger.load(tmp_path / f"{n}.jsonl")) == 1 for n in ("run", "h0", "h1"))
    chain.charge(["h0"], big, "r2")                                         # h1 not involved: fine
    assert len(Ledger.load(tmp_path / "h1.jsonl")) == 1
    with pytest.raises(PrivacyError):
        GuardChain(run, [(h0, "h0")])


def test_the_demo_chooses_its_student_on_public_validation_not_test_dice():
    from sim.commands.demo import choose_student

    cells = [{"method": "pate-ae", "epsilon_budget": 8, "dice": {"mean": 0.9}, "validation_dice_mean": 0.5},
             {"method": "pate-pca", "epsilon_budget": 8, "dice": {"mean": 0.1}, "validation_dice_mean": 0.6},
             {"method": "dp-sgd-central", "epsilon_budget": 8, "dice": {"mean": 0.95}, "validation_dice_mean": 0.9}]
    assert choose_student(cells)["method"] == "pate-pca"
    assert choose_student([{"method": "pate-ae", "dice": {"mean": 0.9}}]) is None


@pytest.mark.slow
def test_pate_with_deployed_hospitals_asks_no_diagnostics_and_refuses_a_used_folder(tmp_path):
    """Against deployed hospitals the server runs no un-noised query and asks no teacher Dice; and a
    second run into a folder whose ledger is not empty is refused (its releases would be hidden)."""
    from test_pate_run import FakePrepared, FakeSplit

    from sim.runners.inprocess import InProcessTransport
    from task.world import load_world
    from server.pate import PateConfig, run_pate

    prepared = FakePrepared(24)
    ids = prepared.case_ids
    split = FakeSplit(hospitals={"h0": [[ids[0]], [ids[1]]], "h1": [[ids[2]], [ids[3]]]},
                      public_query=ids[4:8], public_reference=ids[8:16], public_validation=ids[16:18],
                      test=ids[18:22])
    preset = get_preset("tiny").with_changes(teacher=dict(epochs=1), pretrain_epochs=1, student=dict(epochs=1),
                                             hospitals=2, teachers_per_hospital=2)
    hospitals = [Hospital(h, prepared, split.hospitals[h], preset, tmp_path / h,
                          HospitalSettings(deployed=True, lifetime_epsilon=8.0)) for h in sorted(split.hospitals)]
    transport = InProcessTransport(hospitals)
    world = load_world(prepared, split)
    config = PateConfig("pate-pca", 8.0, 1e-3, compute=Compute(progress=False))
    results = run_pate(transport, world, preset, config, tmp_path / "run")
    assert results["queries"] == 4 and results["teacher_dice_mean"] is None
    assert results["ensemble_dice_mean"] is None and results["not_private_diagnostics"] == ["fallback_teachers"]
    assert results["validation_dice_mean"] is not None
    # each deployed hospital charged its own ledger (workdir/privacy-ledger.jsonl) exactly the released queries
    for h in hospitals:
        assert len(Ledger.load(h.privacy_ledger)) == 4
    with pytest.raises(UserError, match="earlier run"):
        run_pate(transport, world, preset, config, tmp_path / "run")


def test_a_hospital_without_its_teachers_refuses_a_query_and_its_ledger_is_unchanged(tmp_path):
    import torch

    from task.learning.networks import build_unet

    hospital = Hospital("h0", prepared=None, partitions=[["p0"], ["p1"]], preset=PRESET, workdir=tmp_path / "h0",
                        settings=HospitalSettings(lifetime_epsilon=4.0, delta=1e-3))
    earlier = Ledger(hospital.privacy_ledger)   # what it spent before: must survive byte for byte
    earlier.record(["h0"], GaussianEvent(sensitivity=1.0, sigma=5.0), "earlier@0")
    before = hospital.privacy_ledger.read_bytes()
    state = PCACompressor(3, "clip", clip=1.0).fit(_maps()).state()
    scans = np.zeros((2, 4, *GRID), np.float32)
    with pytest.raises(UserError, match="teacher 0 has not been trained"):     # never trained
        hospital.answer_query(scans, state, _query(["a", "b"]))
    assert hospital.privacy_ledger.read_bytes() == before
    # half trained: teacher 0 is on disk, teacher 1 is not
    hospital._teacher_path(0).parent.mkdir(parents=True)
    torch.save(build_unet(PRESET.unet).state_dict(), hospital._teacher_path(0))
    with pytest.raises(UserError, match="teacher 1 has not been trained"):
        hospital.answer_query(scans, state, _query(["a", "b"]))
    # a torn teacher file
    hospital._teacher_path(1).write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot load teacher 1"):
        hospital.answer_query(scans, state, _query(["a", "b"]))
    assert hospital.privacy_ledger.read_bytes() == before


class TrainedFixedTeachers(FixedTeachers):
    """FixedTeachers with a training record's fingerprint, as teachers this product trained carry one."""

    fingerprint = "trained-once"

    def _teachers_fingerprint(self):
        return self.fingerprint


def test_another_budgets_query_is_charged_and_reuses_the_teachers_rows(tmp_path):
    """A comparison's PATE cells (fresh hospitals on the same folder) ask the same teachers about the same public
    scans under another σ: the teachers run once, yet every batch is charged before its rows are returned, a batch
    the budget refuses gets nothing, and retrained teachers run again."""
    state = PCACompressor(3, "clip", clip=1.0).fit(_maps()).state()
    scans = np.random.default_rng(0).random((2, 4, *GRID), dtype=np.float32)
    first_cell = TrainedFixedTeachers(tmp_path, lifetime=8.0)
    first, _ = first_cell.answer_query(scans, state, _query(["e1-a", "e1-b"], sigma=2.0))
    assert first_cell.runs == 3
    second_cell = TrainedFixedTeachers(tmp_path, lifetime=8.0)
    second, notes = second_cell.answer_query(scans, state, _query(["e8-a", "e8-b"], sigma=1.0))
    assert second_cell.runs == 0 and notes == {"fallback_teachers": 0}
    np.testing.assert_array_equal(second, first)
    ledger = Ledger.load(second_cell.privacy_ledger)
    assert [r["release_id"].split("@")[0] for r in ledger.records()] == ["e1-a", "e1-b", "e8-a", "e8-b"]
    assert [r["event"]["sigma"] for r in ledger.records()] == [2.0, 2.0, 1.0, 1.0]
    with pytest.raises(BudgetExceeded):   # charged before the kept rows are looked up
        second_cell.answer_query(scans, state, _query(["e100-a", "e100-b"], sigma=0.01))
    assert len(Ledger.load(second_cell.privacy_ledger)) == 4
    # other scans, or retrained teachers, run the teachers again
    second_cell.answer_query(scans[:1], state, _query(["o-a"], sigma=2.0))
    assert second_cell.runs == 3
    second_cell.fingerprint = "trained-again"
    second_cell.answer_query(scans, state, _query(["r-a", "r-b"], sigma=2.0))
    assert second_cell.runs == 6
