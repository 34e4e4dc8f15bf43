"""End-to-end in-process PATE on a synthetic world (task.data.synthetic, not the phantoms): schema, ledger, budget."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from task.learning.compute import Compute
from task.data.synthetic import SyntheticPrepared as FakePrepared
from task.settings.presets import get_preset

SCHEMA = ["method", "dice", "epsilon", "epsilon_budget", "delta", "relation", "accountant", "teachers",
          "hospitals", "queries", "sigma", "teacher_dice_mean", "ensemble_dice_mean",
          "bytes_up_per_query_per_teacher", "wall_seconds", "seed"]


@dataclass
class FakeSplit:
    hospitals: dict
    public_query: list
    public_reference: list
    public_validation: list = field(default_factory=list)
    test: list = field(default_factory=list)


@pytest.fixture(scope="module")
def world():
    prepared = FakePrepared(28)
    ids = prepared.case_ids
    split = FakeSplit(hospitals={"h0": [[ids[0]], [ids[1]], [ids[2]]], "h1": [[ids[3]], [ids[4]], [ids[5]]]},
                      public_query=ids[6:14], public_reference=ids[14:22], test=ids[22:26])
    preset = get_preset("tiny").with_changes(teacher=dict(epochs=1), pretrain_epochs=2, student=dict(epochs=1),
                                             codec=dict(ae_epochs=3), hospitals=2, teachers_per_hospital=3)
    return prepared, split, preset


@pytest.mark.slow
@pytest.mark.parametrize("method", ["pate-pca", "pate-ae", "pate-anchored", "pate-naive"])
def test_inprocess_tiny_run_writes_schema_complete_results(world, method, tmp_path, monkeypatch):
    import task.learning.training
    from privacy.ledger import Ledger
    from sim.runners.inprocess import InProcessPateRun, run_pate_inprocess

    mirrored = []   # every test-time-mirrored batch of the run: the student's and public-only's test sets, once each
    monkeypatch.setattr(task.learning.training, "mirrored_probabilities",
                        lambda model, x, original=task.learning.training.mirrored_probabilities: mirrored.append(len(x))
                        or original(model, x))
    prepared, split, preset = world
    results = run_pate_inprocess(InProcessPateRun(preset, method, tmp_path, 8.0, 1e-3, seed=0, prepared=prepared,
                                                  split=split, compute=Compute(progress=False)))
    assert sum(mirrored) == 2 * len(split.test)   # the predictions written are those the Dice scored
    written = json.loads((tmp_path / "results.json").read_text())
    assert all(key in written for key in SCHEMA)
    assert written["method"] == method and written["relation"] == "replace-one"
    assert written["accountant"] == "gdp-exact" and written["teachers"] == 6 and written["hospitals"] == 2
    assert written["queries"] == 8 and written["dice"]["mean"] is not None
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    assert ledger.owners() == ["h0", "h1"]
    assert len(ledger.events("h0")) == 8
    spent = max(ledger.spent(o, 1e-3).epsilon for o in ledger.owners())
    assert written["epsilon"] == pytest.approx(spent) and spent <= 8.0
    assert spent > 7.9  # the calibration uses the budget (exact GDP)
    assert written["bytes_up_per_query_per_teacher"] == 4 * written["components"]
    assert (tmp_path / "model" / "weights.pt").exists() or (tmp_path / "model" / "model.pt").exists()
    assert len(list((tmp_path / "predictions").glob("*.nii.gz"))) == 4
    # per-case test Dice for the report's paired comparisons: one entry per test case, student and public-only
    assert len(written["dice_per_case"]) == len(written["public_only_dice_per_case"]) == len(split.test)
    # nothing a hospital keeps leaves its folder: teacher weights are under hospitals/<id>/teachers
    assert len(list(Path(tmp_path, "hospitals", "h0", "teachers").glob("*.pt"))) == 3
    assert results["epsilon"] == written["epsilon"]
    # everything un-noised is flagged, the full ensemble Dice dict included; rejections are counts only
    assert {"ensemble_dice", "ensemble_dice_mean", "teacher_dice_mean"} <= set(written["not_private_diagnostics"])
    assert all(isinstance(v, int) for v in written["rejected_replies"].values())


@pytest.mark.slow
def test_dropout_stops_when_the_budget_would_be_exceeded(world, tmp_path):
    """h1 leaves after the first query batch: K halves, S doubles, the guard refuses before the budget is
    exceeded, and the student is trained on the answered queries."""
    from privacy.ledger import Ledger
    from sim.runners.inprocess import InProcessPateRun, run_pate_inprocess

    prepared, split, preset = world
    results = run_pate_inprocess(InProcessPateRun(preset, "pate-ae", tmp_path, 8.0, 1e-3, prepared=prepared,
                                                  split=split, drop={"h1": 1}, compute=Compute(progress=False),
                                                  options={"query_batch": 2, "diagnostics": False}))
    ledger = Ledger.load(tmp_path / "ledger.jsonl")
    s_full, s_half = (e.sensitivity for e in ledger.events("h0")[1:3])
    assert s_half == pytest.approx(2 * s_full)
    assert results["stopped_early"] and results["queries"] < 8
    assert max(ledger.spent(o, 1e-3).epsilon for o in ledger.owners()) <= 8.0


@pytest.mark.slow
def test_head_fit_decoder_and_voxel_head_student_run_end_to_end(world, tmp_path):
    """The quick preset's PATE (voxel-head teachers, 3 T1-Gd bins, the head-fit decoder, a voxel-head student) on the
    tiny world: the results name the decoder, the bundle holds the head on the public model, its card carries the
    ledger's epsilon."""
    from task.reporting.bundle import load_bundle
    from task.learning.networks import VoxelHeadUNet
    from sim.runners.inprocess import InProcessPateRun, run_pate_inprocess

    prepared, split, preset = world
    preset = preset.with_changes(teacher=dict(trainable="voxel-head", learning_rate=1e-2, augment=False),
                                 codec=dict(anchored_intensity_bins=3, anchored_decoder="head-fit"),
                                 student=dict(trainable="voxel-head", learning_rate=1e-2))
    results = run_pate_inprocess(InProcessPateRun(preset, "pate-anchored", tmp_path, 8.0, 1e-3, seed=0,
                                                  prepared=prepared, split=split, compute=Compute(progress=False)))
    assert results["compressor"]["decoder"] == "head-fit" and results["compressor"]["intensity_bins"] == 3
    bundle = load_bundle(tmp_path)
    assert isinstance(bundle.model, VoxelHeadUNet) and bundle.network["voxel_head_hidden"] == 16
    assert bundle.card["epsilon"] == pytest.approx(results["epsilon"]) and 7.9 < results["epsilon"] <= 8.0
