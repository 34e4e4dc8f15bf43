"""The slice task protects a patient, not a slice: every seed system samples, clips or partitions
whole patients, and its results say so. Checked on a task whose patients have 1-6 slices, stored out of order."""

import copy

import numpy as np
import pytest
import torch

from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from task.classification import SeedRun
from task.classification.tasks import ClassificationTask


def patient_task(patients=30, hospitals=2, d=12, seed=0):
    rng = np.random.default_rng(seed)
    group_of = rng.permutation(np.repeat(np.arange(patients), rng.integers(1, 7, patients)))
    n = len(group_of)
    centres = rng.uniform(0, 1, (2, d))
    y = rng.integers(0, 2, n)
    x = np.clip(centres[y] + 0.2 * rng.normal(size=(n, d)), 0, 1).astype(np.float32)
    yt = rng.integers(0, 2, 60)
    xt = np.clip(centres[yt] + 0.2 * rng.normal(size=(60, d)), 0, 1).astype(np.float32)
    return ClassificationTask(
        name="patients", n_classes=2, x_private=x, y_private=y.astype(np.int64), hospital_of=group_of % hospitals,
        hospitals=[f"h{i}" for i in range(hospitals)], x_test=xt, y_test=yt.astype(np.int64), x_query=xt[:40],
        x_reference=xt[:30], y_reference=yt[:30].astype(np.int64), y_query_true=yt[:40].astype(np.int64),
        group_of=group_of)


def test_units_are_whole_patients_in_batches_padded_rows_and_capped_sets():
    from privacy.mechanisms import NoiseSource
    from task.learning.dpsgd import poisson_batches
    from task.classification import capped_units, gather_units, padded_units

    task = patient_task()
    units = task.unit_records()
    assert task.privacy_unit == "patient" and len(units) == 30
    assert np.array_equal(np.sort(np.concatenate(units)), np.arange(len(task.y_private)))
    for records in units:
        assert len(np.unique(task.group_of[records])) == 1 and len(np.unique(task.hospital_of[records])) == 1
    patient_of_unit = [int(task.group_of[r[0]]) for r in units]
    for chosen in poisson_batches(len(units), 0.3, 20, NoiseSource.reproducible(0).generator("batches")):
        records, groups = gather_units(units, chosen)
        for position, unit in enumerate(chosen):
            assert set(records[groups == position]) == set(units[unit])      # the whole patient, nothing else
        assert sorted(task.group_of[records].tolist()) == sorted(
            p for u in chosen for p in [patient_of_unit[u]] * len(units[u]))
    xu, yu, mask = padded_units(task.x_private, task.y_private, units)
    for i, records in enumerate(units):
        assert int(mask[i].sum()) == len(records)
        np.testing.assert_array_equal(xu[i, :len(records)].numpy(), task.x_private[records])
    capped = capped_units(units, 4)
    assert capped.shape == (30, 4)
    for row, records in zip(capped, units):
        assert set(row) <= set(records) and len(set(row)) == min(4, len(records))


@pytest.mark.parametrize("order", [1, 2])
def test_dpmac_adding_one_patient_moves_each_block_by_at_most_its_clip(order):
    """Per-patient clipping (sum a patient's slice terms, then clip): adding a 6-slice patient adds exactly
    its own clipped sum. Clipping slices one by one (the old unit) lets it move a block by up to 6·C."""
    from task.classification import gather_units
    from task.classification.dpmac import DPMACConfig, MACNet, w_step_coefficients

    task = patient_task()
    units = task.unit_records()
    big = next(u for u, r in enumerate(units) if len(r) == 6)
    others = [u for u in range(len(units)) if u != big][:8]
    torch.manual_seed(0)
    net = MACNet([task.input_dim, 6, 2])
    cfg = DPMACConfig(hidden=(6,), z_steps=5, clip=0.05, clip2=0.05, order=order)
    x, y = torch.as_tensor(task.x_private), torch.as_tensor(task.y_private)

    def blocks(chosen, per_patient=True):
        records, groups = gather_units(units, chosen)
        return w_step_coefficients(net, x[records], y[records], cfg,
                                   torch.from_numpy(groups) if per_patient else None)

    (base, sens), (added, _), (alone, _) = blocks(others), blocks(others + [big]), blocks([big])
    for b, a, r, s in zip(base, added, alone, sens):
        assert float((a - b).norm()) <= s + 1e-6
        assert torch.allclose(a - b, r, atol=1e-6)
    per_slice = [float((a - b).norm()) for a, b in zip(blocks(others + [big], False)[0], blocks(others, False)[0])]
    assert max(per_slice) > 2 * cfg.clip          # slice-level clipping is not a patient-level bound


def test_dp_pca_second_moment_moves_by_at_most_one_per_patient():
    from task.classification.dpmac import clipped_second_moment

    task = patient_task()
    units = task.unit_records()
    x = task.x_private
    for drop in range(len(units)):
        kept = [r for u, r in enumerate(units) if u != drop]
        diff = clipped_second_moment(x, units) - clipped_second_moment(x, kept)
        assert np.linalg.norm(diff) <= 1 + 1e-9
    rows = list(np.arange(len(x))[:, None])          # slice-level clipping: a patient moves it by up to 6
    many = max(units, key=len)
    diff = clipped_second_moment(x, rows) - clipped_second_moment(x, [r for r in rows if r[0] not in many])
    assert np.linalg.norm(diff) > 2


def test_dpsgd_per_sample_gradient_is_the_patients_summed_gradient():
    """What Opacus clips (a row's per-sample gradient) is the gradient of the patient's summed loss."""
    from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining
    from task.classification import build_mlp, padded_units
    from task.classification.dpsgd_classifier import unit_loss

    task = patient_task()
    units = task.unit_records()
    xu, yu, mask = padded_units(task.x_private, task.y_private, units)
    torch.manual_seed(0)
    model = build_mlp(task.input_dim, (5,), 2)
    reference = copy.deepcopy(model)
    dp = DPConfig(mode="fixed", noise_multiplier=1.0, max_grad_norm=1.0, per_layer=False, grad_sample_mode="hooks",
                  epsilon=8.0, delta=1e-3)
    session = DPSession(model, torch.optim.SGD(model.parameters(), lr=0.1), PrivateTraining(dp), n=len(units),
                        batch_size=5, epochs=1)
    chosen = torch.tensor([0, 3, 7, 11])
    unit_loss(session.model(xu[chosen]), yu[chosen], mask[chosen]).backward()
    x, y = torch.as_tensor(task.x_private), torch.as_tensor(task.y_private)
    for row, unit in enumerate(chosen.tolist()):
        reference.zero_grad()
        records = torch.as_tensor(units[unit])
        torch.nn.functional.cross_entropy(reference(x[records]), y[records], reduction="sum").backward()
        for p, ref in zip(session.model._module.parameters(), reference.parameters()):
            assert torch.allclose(p.grad_sample[row], ref.grad, atol=1e-5)


def test_adlm_sizes_every_release_for_k_slices_per_patient():
    from task.classification.adlm import LABEL_SENSITIVITY, AdLMConfig, budget_ratios, feature_scales, train_adlm

    task = patient_task()
    ledger = Ledger(None)
    res = train_adlm(SeedRun(task, 1.5, 1e-5, BudgetGuard(ledger, 1.5, 1e-5), task.hospitals, seed=0),
                     AdLMConfig(hidden=(4, 4), epochs=1, relevance_epochs=2, records_per_patient=3))
    e1, e2, e3 = res.details["epsilon_split"]
    assert res.details["records_per_unit"] == 3 and res.details["privacy_unit"] == "patient"
    assert res.details["label_scale"] == pytest.approx(3 * LABEL_SENSITIVITY / e3)
    assert res.details["relevance_scale"] == pytest.approx(2 * task.input_dim * 3 / (3 * 30) / e1)
    scales = feature_scales(budget_ratios(None, 12), e2, 3)
    assert np.allclose(scales, 3 * feature_scales(budget_ratios(None, 12), e2))
    # every charged event is per patient: k records' sensitivity, so the three add up to the budget
    assert [e.sensitivity / e.scale for e in ledger.events("h0")] == pytest.approx([e1, e2, e3])
    assert ledger.spent("h1", 1e-5).epsilon == pytest.approx(1.5, rel=1e-6)


def test_results_and_report_state_the_patient_as_the_unit(tmp_path):
    from sim.runners.classification_compare import CellSettings, run_cell, write_report

    task = patient_task()
    settings = CellSettings(delta=1e-5, seed=0, preset="tiny", progress=False)
    cells = [run_cell(task, m, 2.0, tmp_path / m, settings) for m in ("adlm", "pate-gnmax")]
    for cell in cells:
        assert cell["error"] is None and cell["privacy_unit"].startswith("one patient")
        assert cell["details"]["privacy_unit"] == "patient"
    write_report(cells, tmp_path, task.summary(), 1e-5)
    report = (tmp_path / "report.md").read_text()
    assert "Privacy unit: one patient" in report and "per patient, not per slice" in report
