"""Mechanism-level tests of the seed systems: sensitivities by construction, noise scales checked
statistically through the real code paths, ledger totals, budget refusals."""

import math

import numpy as np
import pytest
import torch

from privacy.errors import BudgetExceeded
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import GaussianMechanism, NoiseSource
from task.classification import SeedRun
from task.classification.tasks import ClassificationTask


def synthetic_task(n=240, d=12, classes=3, hospitals=2, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.uniform(0, 1, (classes, d))
    y = rng.integers(0, classes, n)
    x = np.clip(centres[y] + 0.1 * rng.normal(size=(n, d)), 0, 1).astype(np.float32)
    yt = rng.integers(0, classes, 60)
    xt = np.clip(centres[yt] + 0.1 * rng.normal(size=(60, d)), 0, 1).astype(np.float32)
    return ClassificationTask(
        name="synthetic", n_classes=classes, x_private=x, y_private=y.astype(np.int64),
        hospital_of=np.arange(n) % hospitals, hospitals=[f"h{i}" for i in range(hospitals)],
        x_test=xt, y_test=yt.astype(np.int64), x_query=xt[:40], x_reference=xt[:30],
        y_reference=yt[:30].astype(np.int64), y_query_true=yt[:40].astype(np.int64))


def guard_for(budget, delta=1e-5):
    ledger = Ledger(None)
    return ledger, BudgetGuard(ledger, budget, delta)


# ------------------------------------------------------------------------------------------------ DP-MAC
@pytest.mark.parametrize("order", [1, 2])
def test_dpmac_per_record_coefficients_are_clipped(order):
    from task.classification.dpmac import DPMACConfig, layer_coefficients

    torch.manual_seed(0)
    w, b = torch.randn(7, 5) * 10, torch.randn(7)
    z_prev = torch.randn(30, 5) * 10
    for target, labels in ((torch.randn(30, 7) * 10, None), (None, torch.randint(0, 7, (30,)))):
        sums, clipped = layer_coefficients(w, b, z_prev, target, labels,
                                           DPMACConfig(mu=1.0, clip=0.5, order=order, clip2=0.25))
        assert len(sums) == order
        assert float(clipped[0].max()) <= 0.5 + 1e-5
        if order == 2:
            assert float(clipped[1].max()) <= 0.25 + 1e-5
        # the clipped sum is bounded by n·C: removing one record moves it by at most C
        assert float(sums[0].norm()) <= 30 * 0.5 + 1e-4


@pytest.mark.parametrize("order", [1, 2])
def test_dpmac_adding_one_record_moves_each_block_by_at_most_its_clip(order):
    """Add/remove sensitivity of a W-step (paper Sec. 2.2, Appendix I) on real MNIST batches through the
    product path (Z-step + clipped coefficients): B ∪ {r} minus B is exactly r's own clipped term, so every
    block moves by at most its clip. With the old ``loss / len(y)`` Z-step every record's z depended on |B|."""
    from task.classification.dpmac import DPMACConfig, MACNet, w_step_coefficients
    from task.classification.tasks import load_mnist5k

    task = load_mnist5k(hospitals=1)
    torch.manual_seed(0)
    net = MACNet([task.input_dim, 16, 10])
    cfg = DPMACConfig(hidden=(16,), z_steps=10, z_lr=0.1, clip=0.5, clip2=0.25, order=order)
    x, y = torch.as_tensor(task.x_private), torch.as_tensor(task.y_private)
    rng = np.random.default_rng(0)
    for size in (1, 3, 8, 40):
        batch = rng.choice(len(y), size + 1, replace=False)
        base, sens = w_step_coefficients(net, x[batch[:-1]], y[batch[:-1]], cfg)
        added, _ = w_step_coefficients(net, x[batch], y[batch], cfg)
        alone, _ = w_step_coefficients(net, x[batch[-1:]], y[batch[-1:]], cfg)
        assert len(base) == 2 * order and sens == [0.5, 0.25][:order] * 2
        for b, a, r, s in zip(base, added, alone, sens):
            assert float((a - b).norm()) <= s + 1e-5
            assert torch.allclose(a - b, r, atol=1e-5)


def test_dpmac_output_coefficient_is_the_cross_entropy_gradient():
    from task.classification.dpmac import DPMACConfig, layer_coefficients

    torch.manual_seed(1)
    w = torch.randn(4, 6, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    z = torch.randn(10, 6) * 0.1
    y = torch.randint(0, 4, (10,))
    torch.nn.functional.cross_entropy(z @ w.T + b, y, reduction="sum").backward()
    sums, _ = layer_coefficients(w.detach(), b.detach(), z, None, y, DPMACConfig(mu=1.0, clip=1e6))
    assert torch.allclose(sums[0][:, :-1], w.grad, atol=1e-5)
    assert torch.allclose(sums[0][:, -1], b.grad, atol=1e-5)


def test_dpmac_single_draw_noise_std_per_block():
    """Appendix I: block p gets std σ·S_p·√P from one concatenated draw (zero data signal)."""
    from task.classification.dpmac import perturb_concatenated

    gen = NoiseSource.reproducible(3).generator("step")
    calls = []

    def factory(sigma):
        calls.append(sigma)
        return GaussianMechanism(sigma, gen)

    blocks = [torch.zeros(100, 200), torch.zeros(150, 100)]
    noisy = perturb_concatenated(blocks, [1.0, 3.0], 2.0, factory)
    assert calls == [2.0]     # exactly one mechanism call per step
    for out, s in zip(noisy, (1.0, 3.0)):
        expected = 2.0 * s * math.sqrt(2)
        assert abs(float(out.std()) / expected - 1) < 0.03
        assert abs(float(out.mean())) < 0.05 * expected


def test_dpmac_ledger_epsilon_matches_dp_accounting():
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.privacy_accountant import NeighboringRelation

    from task.classification.dpmac import DPMACConfig, train_dpmac

    task = synthetic_task()
    ledger, guard = guard_for(2.0)
    res = train_dpmac(SeedRun(task, 2.0, 1e-5, guard, task.hospitals, seed=0),
                      DPMACConfig(hidden=(16,), epochs=2, batch_size=40, pca_components=None, z_steps=2))
    q, z, steps = res.details["sampling_rate"], res.details["noise_multiplier"], res.details["steps"]
    # the comparison's one relation, replace-one (sizes are published), straight from dp_accounting
    acc = pld_privacy_accountant.PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4)
    acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), steps)
    reference = acc.get_epsilon(1e-5)
    for owner in task.hospitals:
        spent = ledger.spent(owner, 1e-5)
        assert spent.accountant == "pld" and spent.relation == "replace-one"
        assert spent.epsilon == pytest.approx(reference, rel=2e-3)
        assert 0.99 * 2.0 <= spent.epsilon <= 2.0


def test_dpmac_with_dp_pca_is_accounted_and_within_budget():
    from task.classification.dpmac import DPMACConfig, train_dpmac

    task = synthetic_task()
    ledger, guard = guard_for(3.0)
    train_dpmac(SeedRun(task, 3.0, 1e-5, guard, task.hospitals, seed=0),
                DPMACConfig(hidden=(8,), epochs=1, batch_size=40, pca_components=4, z_steps=1, pca_basis="dp"))
    kinds = [type(e).__name__ for e in ledger.events("h0")]
    assert kinds == ["GaussianEvent", "SampledGaussianEvent"]
    assert 0.98 * 3.0 <= ledger.spent("h0", 1e-5).epsilon <= 3.0


def test_dpmac_public_basis_reads_no_private_record_and_returns_its_budget_to_the_w_steps():
    """The default PCA basis is a function of the public images alone: replacing every private record leaves
    it unchanged, it is what ``public_pca`` gives on the query pool and reference set, nothing is charged for
    it, and the W-steps alone spend the budget (less noise than with a DP-PCA share)."""
    from task.classification.dpmac import DPMACConfig, public_images, public_pca, train_dpmac

    task = synthetic_task()
    other = synthetic_task(seed=5)          # different private records, same public ones
    other.x_test, other.y_test, other.x_query, other.x_reference, other.y_reference = (
        task.x_test, task.y_test, task.x_query, task.x_reference, task.y_reference)
    cfg = DPMACConfig(hidden=(8,), epochs=1, batch_size=40, pca_components=4, z_steps=1)
    runs = []
    for t in (task, other):
        ledger, guard = guard_for(3.0)
        res = train_dpmac(SeedRun(t, 3.0, 1e-5, guard, t.hospitals, seed=0), cfg)
        runs.append(res)
        assert [type(e).__name__ for e in ledger.events("h0")] == ["SampledGaussianEvent"]
        assert 0.98 * 3.0 <= ledger.spent("h0", 1e-5).epsilon <= 3.0
    first, second = (r.model.projection.numpy() for r in runs)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, public_pca(public_images(task), 4), atol=1e-6)
    assert len(public_images(task)) == len(task.x_query) + len(task.x_reference)
    assert runs[0].details["pca_basis"] == "public" and runs[0].details["pca_sigma"] is None
    _, guard = guard_for(3.0)
    with_dp_pca = train_dpmac(SeedRun(task, 3.0, 1e-5, guard, task.hospitals, seed=0),
                              DPMACConfig(hidden=(8,), epochs=1, batch_size=40, pca_components=4, z_steps=1,
                                          pca_basis="dp"))
    assert runs[0].sigma < with_dp_pca.sigma         # the DP-PCA share went back to the W-steps


def test_dpmac_falls_back_to_dp_pca_without_enough_public_images():
    from task.classification.dpmac import DPMACConfig, train_dpmac

    task = synthetic_task()
    task.x_query, task.x_reference = task.x_query[:0], task.x_reference[:2]
    ledger, guard = guard_for(3.0)
    res = train_dpmac(SeedRun(task, 3.0, 1e-5, guard, task.hospitals, seed=0),
                      DPMACConfig(hidden=(8,), epochs=1, batch_size=40, pca_components=4, z_steps=1))
    assert res.details["pca_basis"] == "dp"
    assert [type(e).__name__ for e in ledger.events("h0")] == ["GaussianEvent", "SampledGaussianEvent"]


# ------------------------------------------------------------------------------------------------ AdLM
def test_adlm_relevance_is_bounded_and_sensitivity_is_2d_over_n():
    from task.classification import build_mlp
    from task.classification.adlm import lrp_relevance, relevance_sensitivity

    torch.manual_seed(0)
    model = build_mlp(12, (8,), 3)
    x = torch.rand(50, 12)
    r = lrp_relevance(model, x).numpy()
    assert r.min() >= 0 and r.max() <= 1
    # replace one record by an arbitrary other: the mean moves by ≤ d/n ≤ Δ_R = 2d/n in L1 (Lemma 1)
    x2 = x.clone()
    x2[0] = torch.rand(12) * 5
    r2 = lrp_relevance(model, x2).numpy()
    assert np.abs(r.mean(0) - r2.mean(0)).sum() <= relevance_sensitivity(12, 50) + 1e-9
    assert relevance_sensitivity(12, 50) == pytest.approx(2 * 12 / 50)


def test_adlm_feature_noise_scales_statistically():
    from task.classification.adlm import budget_ratios, feature_scales, perturb_features

    d, n, eps2 = 4, 40000, 2.0
    beta = budget_ratios(np.array([0.1, 0.2, 0.3, 0.4]), d)
    assert beta.sum() == pytest.approx(d)
    scales = feature_scales(beta, eps2)
    ledger, guard = guard_for(10.0)
    noisy = perturb_features(np.zeros((n, d)), scales, guard, ["h0"], "affine", NoiseSource.reproducible(1))
    mean_abs = np.abs(noisy).mean(axis=0)               # E|Lap(b)| = b
    assert np.allclose(mean_abs / scales, 1.0, atol=0.03)
    # per-record privacy loss Σ_j Δ_x / b_j is exactly ε2 (Lemma 4 with per-record calibration)
    assert ledger.spent("h0", 1e-5).epsilon == pytest.approx(eps2)
    # ILM: identical scale d/ε2
    ilm = feature_scales(budget_ratios(None, d), eps2)
    assert np.allclose(ilm, d / eps2)


def test_adlm_label_noise_scale_statistically():
    from task.classification.adlm import LABEL_SENSITIVITY, perturb_label_coefficients

    ledger, guard = guard_for(10.0)
    y = np.zeros(30000, np.int64)
    phi = perturb_label_coefficients(y, 3, 0.5, guard, ["h0"], "loss", NoiseSource.reproducible(2))
    clean = 0.5 - np.eye(3)[y]
    b = LABEL_SENSITIVITY / 0.5
    assert np.abs(phi - clean).mean() == pytest.approx(b, rel=0.03)
    assert ledger.spent("h0", 1e-5).epsilon == pytest.approx(0.5)


def test_adlm_noise_free_reference_charges_nothing_and_learns():
    """epsilon=None switches the mechanism off: nothing is released or charged, no ε is claimed, and the same
    network, polynomial loss and optimiser learn the task (the noise, not the optimiser, is what costs)."""
    from task.classification.adlm import AdLMConfig, train_adlm

    task = synthetic_task()
    ledger, guard = guard_for(1.0)
    res = train_adlm(SeedRun(task, None, 1e-5, guard, task.hospitals, seed=0),
                     AdLMConfig(hidden=(16, 8), epochs=30, batch_size=32))
    assert ledger.records() == [] and res.relation is None and res.details["noise_free"] is True
    assert res.details["epsilon_split"] is None and res.details["label_scale"] is None
    assert res.accuracy > 0.8                     # three well-separated classes
    _, guard = guard_for(1.0)
    noisy = train_adlm(SeedRun(task, 1.0, 1e-5, guard, task.hospitals, seed=0),
                       AdLMConfig(hidden=(16, 8), epochs=30, batch_size=32))
    assert noisy.details["noise_free"] is False and noisy.relation == "replace-one"


def test_adlm_output_bias_starts_at_the_polynomial_loss_constant_minimiser():
    """The output bias starts where the polynomial loss (Eq. 25) is smallest over constant outputs: its gradient
    there is zero, and without noise it is 4p_l − 2 for the class frequencies p_l."""
    from task.classification.adlm import build_adlm_net, constant_output_minimiser, taylor_loss

    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 200)
    for phi in (0.5 - np.eye(4)[y], 0.5 - np.eye(4)[y] + rng.laplace(0, 3, (200, 4))):
        c = torch.tensor(constant_output_minimiser(phi), requires_grad=True)      # one output per class
        taylor_loss(c.expand(200, 4), torch.as_tensor(phi)).backward()
        assert float(c.grad.abs().max()) < 1e-12
    assert constant_output_minimiser(0.5 - np.eye(4)[y]) == pytest.approx(4 * np.bincount(y, minlength=4) / 200 - 2)
    assert build_adlm_net(6, (5, 3), 4)[-1].bias is not None


def test_adlm_noise_free_reference_is_level_with_the_same_network_trained_plainly():
    """The noise-free row is a stable upper reference: at every seed it is within a few points of AdLM's network
    trained with cross-entropy (same records, initialisation, batches, optimiser, epochs). Ten classes make the
    one-vs-all targets of Eq. 25 mostly −2; without an output bias started at the loss's constant minimiser
    (none at all, as in Eq. 23) the noise-free network ended at 0.08-0.28 here at these seeds."""
    from task.classification import accuracy
    from task.classification.adlm import AdLMConfig, train_adlm, train_plain_reference

    task = synthetic_task(n=400, d=20, classes=10)
    cfg = AdLMConfig(hidden=(64, 32), epochs=20, batch_size=64)
    for seed in (0, 1, 2):
        ledger, guard = guard_for(1.0)
        noise_free = train_adlm(SeedRun(task, None, 1e-5, guard, task.hospitals, seed=seed), cfg).accuracy
        plain = accuracy(train_plain_reference(task, cfg, seed), task.x_test, task.y_test)
        assert ledger.records() == []
        assert plain > 0.9 and noise_free >= plain - 0.03, (seed, noise_free, plain)


@pytest.mark.parametrize("adaptive", [True, False])
def test_adlm_ledger_total_is_sum_and_independent_of_epochs(adaptive):
    from task.classification.adlm import AdLMConfig, train_adlm

    task = synthetic_task()
    spent = []
    for epochs in (1, 4):
        ledger, guard = guard_for(1.5)
        res = train_adlm(SeedRun(task, 1.5, 1e-5, guard, task.hospitals, seed=0),
                         AdLMConfig(hidden=(8, 4), epochs=epochs, batch_size=32,
                                    relevance_epochs=3), adaptive=adaptive)
        s = ledger.spent("h1", 1e-5)
        assert s.accountant == "basic" and s.relation == "replace-one"
        assert s.epsilon == pytest.approx(sum(res.details["epsilon_split"]), rel=1e-9)
        assert len(ledger.events("h1")) == (3 if adaptive else 2)
        spent.append(s.epsilon)
    assert spent[0] == pytest.approx(spent[1], rel=1e-12)
    assert spent[0] == pytest.approx(1.5, rel=1e-6) and spent[0] <= 1.5


# ------------------------------------------------------------------------------------------------ GNMax
def test_vote_histogram_replace_one_sensitivity_is_sqrt2():
    from task.classification.gnmax import VOTE_SENSITIVITY, vote_histograms

    rng = np.random.default_rng(0)
    preds = rng.integers(0, 5, (9, 100))
    other = preds.copy()
    other[4] = (other[4] + 1 + rng.integers(0, 4, 100)) % 5    # one teacher (one record's partition) changes
    diff = vote_histograms(preds, 5) - vote_histograms(other, 5)
    assert np.linalg.norm(diff, axis=1).max() <= VOTE_SENSITIVITY + 1e-12
    assert np.abs(diff).max(axis=1).max() <= 1       # the max vote moves by ≤ 1 (threshold sensitivity)


def test_gnmax_noise_scale_and_ledger_composition():
    from privacy.accountants import epsilon_spent
    from privacy.events import GaussianEvent
    from task.classification.gnmax import VOTE_SENSITIVITY, gnmax_answer

    # zero data signal: every histogram is flat → the answer is argmax of pure noise (uniform over classes)
    ledger, guard = guard_for(100.0)
    hist = np.zeros((400, 4))
    labels = gnmax_answer(hist, 30.0, guard, ["h0", "h1"], "q", NoiseSource.reproducible(0))
    counts = np.bincount(labels, minlength=4)
    assert counts.min() > 60
    events = ledger.events("h0")
    assert len(events) == 400 and all(e.sigma == 30.0 and e.sensitivity == VOTE_SENSITIVITY for e in events)
    expected, _ = epsilon_spent([GaussianEvent(VOTE_SENSITIVITY, 30.0, count=400)], 1e-5)
    assert ledger.spent("h1", 1e-5).epsilon == pytest.approx(expected, rel=1e-9)


def test_gnmax_threshold_noise_std_statistically():
    from task.classification.gnmax import gnmax_answer

    # histograms with max vote exactly at the threshold: P(answer) = 1/2 for any σ1 ; with the max vote
    # one σ1 above the threshold P(answer) = Φ(1) ≈ 0.841 — checks the noise std actually used
    ledger, guard = guard_for(1e6)
    hist = np.zeros((800, 3))     # (the guard re-accounts every record per charge: keep N moderate)
    hist[:, 0] = 13.0
    labels = gnmax_answer(hist, 1.0, guard, ["h0"], "c", NoiseSource.reproducible(5), threshold=10.0,
                          sigma_threshold=3.0)
    frac = (labels >= 0).mean()
    assert frac == pytest.approx(0.8413, abs=0.045)   # 3.5 binomial std
    kinds = [e.sensitivity for e in ledger.events("h0")]
    assert kinds.count(1.0) == 800                      # every threshold check charged
    assert kinds.count(math.sqrt(2)) == int((labels >= 0).sum())   # answers charged only when answered


def test_gnmax_end_to_end_spends_at_most_budget():
    from task.classification.gnmax import GNMaxConfig, train_pate_gnmax

    task = synthetic_task()
    ledger, guard = guard_for(4.0)
    res = train_pate_gnmax(SeedRun(task, 4.0, 1e-5, guard, task.hospitals, seed=0),
                           GNMaxConfig(teachers_per_hospital=3, queries=40, teacher_epochs=5, student_epochs=5))
    assert res.teachers == 6 and res.queries == 40
    s = ledger.spent("h0", 1e-5)
    assert s.accountant == "gdp-exact" and 0.99 * 4.0 <= s.epsilon <= 4.0


def test_gnmax_default_teachers_hold_ten_units_each():
    """K ≈ n / 10 by default: each hospital gets one teacher per 10 of its privacy units."""
    from task.classification.gnmax import RECORDS_PER_TEACHER, teacher_partitions, teachers_per_hospital_for

    task = synthetic_task(n=240, hospitals=2)            # 120 records per hospital
    assert RECORDS_PER_TEACHER == 10 and teachers_per_hospital_for(task) == 12
    parts = teacher_partitions(task, teachers_per_hospital_for(task))
    assert len(parts) == 24 and {len(idx) for _, idx in parts} == {10}
    assert teachers_per_hospital_for(synthetic_task(n=12, hospitals=2)) == 1      # never fewer than one


def test_gnmax_default_queries_keep_a_quarter_lead_at_two_noise_std():
    """The vote-margin rule: the calibrated σ of N queries keeps 2·σ·√2 ≤ K/4, and N + 1 queries would not;
    N grows with ε and K, and is clamped to [classes, pool]."""
    from task.classification.gnmax import calibrate_gnmax, queries_for

    for eps, K in ((2.0, 340), (8.0, 340), (2.0, 100)):
        n = queries_for(eps, 1e-5, K, pool=10_000, classes=1)
        sigma, _ = calibrate_gnmax(eps, 1e-5, n, False, 1.0)
        above, _ = calibrate_gnmax(eps, 1e-5, n + 1, False, 1.0)
        assert 2 * math.sqrt(2) * sigma <= K / 4 * (1 + 1e-4) and K / 4 < 2 * math.sqrt(2) * above
    assert 75 <= queries_for(2.0, 1e-5, 340, 500, 10) <= 150             # mnist5k's K at ε = 2
    assert queries_for(0.5, 1e-5, 340, 500, 10) == 10                     # at least one query per class
    assert queries_for(8.0, 1e-5, 340, 500, 10) == 500                    # at most the public pool
    assert queries_for(1.0, 1e-5, 340, 10_000, 10) < queries_for(2.0, 1e-5, 340, 10_000, 10)


def test_gnmax_uses_the_rules_when_k_and_n_are_not_given():
    from task.classification.gnmax import GNMaxConfig, queries_for, train_pate_gnmax

    task = synthetic_task(n=240, hospitals=2)
    ledger, guard = guard_for(4.0)
    res = train_pate_gnmax(SeedRun(task, 4.0, 1e-5, guard, task.hospitals),
                           GNMaxConfig(teacher_epochs=2, student_epochs=2))
    assert res.teachers == 24 and res.details["teachers_per_hospital"] == 12
    assert res.queries == queries_for(4.0, 1e-5, 24, len(task.x_query), task.n_classes)
    assert len(ledger.events("h0")) == res.queries and ledger.spent("h0", 1e-5).epsilon <= 4.0


# ------------------------------------------------------------------------------------------------ guard
def test_budget_guard_refuses_before_anything_is_recorded():
    from task.classification.adlm import AdLMConfig, train_adlm
    from task.classification.gnmax import GNMaxConfig, train_pate_gnmax

    task = synthetic_task()
    ledger, guard = guard_for(0.5)
    with pytest.raises(BudgetExceeded):
        train_adlm(SeedRun(task, 1.0, 1e-5, guard, task.hospitals),
                   AdLMConfig(hidden=(4, 4), epochs=1, relevance_epochs=1))
    # the relevance release (ε1 = 0.2) fitted; the affine release (0.5) would not, and was not recorded
    assert len(ledger.events("h0")) == 1
    ledger2, guard2 = guard_for(0.5)
    with pytest.raises(BudgetExceeded):
        train_pate_gnmax(SeedRun(task, 2.0, 1e-5, guard2, task.hospitals),
                         GNMaxConfig(teachers_per_hospital=2, queries=10, teacher_epochs=1, student_epochs=1))
    assert ledger2.spent("h0", 1e-5).epsilon <= 0.5


def test_dpsgd_guard_refuses_over_budget():
    from task.classification.dpsgd_classifier import DPSGDConfig, train_dpsgd

    task = synthetic_task()
    ledger, guard = guard_for(0.5)
    with pytest.raises(BudgetExceeded):
        train_dpsgd(SeedRun(task, 1.0, 1e-5, guard, task.hospitals), DPSGDConfig(hidden=(8,), epochs=1, batch_size=40))
    assert ledger.owners() == []


# ------------------------------------------------------------------------------------------------ noise
class WatchedSource(NoiseSource):
    """A reproducible NoiseSource that fails when a stream is opened before its release is in the ledger, and
    logs every opened stream and every Gaussian draw (the privacy maths itself is untouched)."""

    def __init__(self, ledger, seed=0, path=(), log=None):
        super().__init__(seed, path)
        self.ledger, self.log = ledger, log if log is not None else {"opened": [], "normal": []}

    def child(self, *names):
        return WatchedSource(self.ledger, self._seed, self.path + tuple(map(str, names)), self.log)

    def generator(self, *names):
        assert len(names) == 1 and self.ledger.has_release(names[0]), f"stream {names} opened before its charge"
        self.log["opened"].append(names[0])
        return self._watched(super().generator(*names))

    def _watched(self, gen):
        """Log the Gaussian draws of ``gen`` and of the streams spawned from it (DP-SGD's gradient noise)."""
        draw, fill, spawn = gen.standard_normal, gen.fill_standard_normal, gen.spawn

        def standard_normal(shape):
            self.log["normal"].append(tuple(shape))
            return draw(shape)

        def fill_standard_normal(out):
            self.log["normal"].append(tuple(out.shape))
            return fill(out)

        gen.standard_normal, gen.fill_standard_normal = standard_normal, fill_standard_normal
        gen.spawn = lambda: self._watched(spawn())
        return gen


def _run_seed_method(method, task, guard, noise, seed=0, epsilon=2.0):
    """One small private run (DP-MAC at a fixed noise multiplier: no calibration, which is slow)."""
    from task.classification.adlm import AdLMConfig, train_adlm
    from task.classification.dpmac import DPMACConfig, train_dpmac
    from task.classification.dpsgd_classifier import DPSGDConfig, train_dpsgd
    from task.classification.gnmax import GNMaxConfig, train_pate_gnmax

    run = SeedRun(task, epsilon, 1e-5, guard, task.hospitals, seed=seed, noise=noise)
    if method == "dp-mac":
        return train_dpmac(run, DPMACConfig(hidden=(8,), epochs=1, batch_size=40, pca_components=4, z_steps=1,
                                            noise_multiplier=2.0))
    if method == "adlm":
        return train_adlm(run, AdLMConfig(hidden=(8, 4), epochs=1, batch_size=32, relevance_epochs=2))
    if method == "pate-gnmax":
        return train_pate_gnmax(run, GNMaxConfig(teachers_per_hospital=2, queries=20, teacher_epochs=2,
                                                 student_epochs=3, confident=True, threshold_fraction=0.3))
    return train_dpsgd(run, DPSGDConfig(hidden=(4,), epochs=2, batch_size=60,
                                        schedule="exp" if method == "dp-sgd-scheduled" else None))


SEED_METHODS = ("dp-mac", "adlm", "pate-gnmax", "dp-sgd", "dp-sgd-scheduled")


@pytest.mark.parametrize("method", SEED_METHODS)
def test_every_release_is_charged_before_its_own_stream_is_opened(method):
    """Each release draws from its own stream, opened only once the release is in the ledger."""
    task = synthetic_task()
    ledger, guard = guard_for(50.0)
    source = WatchedSource(ledger, seed=0)
    _run_seed_method(method, task, guard, source.child(method, "eps-2"))
    released = [r["release_id"] for r in ledger.records()]
    assert released and sorted(source.log["opened"]) == sorted(released)   # one stream per release, each once


@pytest.mark.parametrize("method", SEED_METHODS[:4])    # the scheduled DP-SGD shares DP-SGD's session
def test_noise_is_unpredictable_unless_reproducible_noise_is_asked_for(method):
    """Secure by default: the same seed twice gives different releases (noise and Poisson batches no longer
    follow the published seed); a reproducible source repeats a cell exactly, and two cells differ."""
    task = synthetic_task()

    def outputs(noise):
        _, guard = guard_for(50.0)
        res = _run_seed_method(method, task, guard, noise, seed=0)
        with torch.no_grad():
            return res.model(torch.as_tensor(task.x_test)).numpy()

    secure = [outputs(None), outputs(NoiseSource())]
    assert not np.allclose(secure[0], secure[1])
    cell = outputs(NoiseSource.reproducible(11).child(method, "eps-2"))
    np.testing.assert_array_equal(cell, outputs(NoiseSource.reproducible(11).child(method, "eps-2")))
    assert not np.allclose(cell, outputs(NoiseSource.reproducible(11).child(method, "eps-4")))


def test_dpsgd_classifier_takes_a_noise_only_step_for_every_empty_poisson_batch():
    """The sampled-Gaussian analysis assumes every step releases noise: with many empty Poisson batches the
    number of Gaussian draws still equals the accounted steps (one flat buffer over every parameter tensor)."""
    from task.classification.dpsgd_classifier import DPSGDConfig, train_dpsgd

    task = synthetic_task(n=60)
    ledger, guard = guard_for(8.0)
    source = WatchedSource(ledger, seed=3)
    res = train_dpsgd(SeedRun(task, 8.0, 1e-5, guard, task.hospitals, noise=source.child("dp-sgd", "eps-8")),
                      DPSGDConfig(hidden=(4,), epochs=2, batch_size=2))
    steps = res.details["steps"]
    assert steps == 2 * 30 and res.details["empty_batches"] >= 3        # q = 1/30, n = 60: ~e^-2 empty
    assert sum(e.steps for e in ledger.events("h0")) == steps
    sizes = {shape for shape in source.log["normal"]}
    assert len(source.log["normal"]) == steps                              # one buffer at every step ...
    assert sizes == {(sum(p.numel() for p in res.model.parameters()),)}    # ... of W1, b1, W2 and b2


# ------------------------------------------------------------------------------------------------ results
def test_results_flag_what_no_epsilon_covers(tmp_path, monkeypatch):
    """GNMax's teacher and noise-free ensemble accuracies (and DP-SGD's empty-batch count) are listed under
    ``not_private_diagnostics``; every listed name points at a value the cell actually wrote."""
    import json

    from sim.runners import classification_compare as runner

    monkeypatch.setitem(runner.PRESET_SETTINGS, "tiny", {"epochs": 1, "adlm_epochs": 1, "teachers_per_hospital": 2,
                                                         "queries": 20, "teacher_epochs": 2})
    task = synthetic_task()
    for method in ("pate-gnmax", "dp-sgd", "nonprivate"):
        cell = runner.run_cell(task, method, None if method == "nonprivate" else 4.0, tmp_path / method,
                               runner.CellSettings(delta=1e-5, seed=0, preset="tiny", progress=False))
        written = json.loads((tmp_path / method / "results.json").read_text())
        flagged = written["not_private_diagnostics"]
        assert cell["error"] is None and flagged == cell["not_private_diagnostics"]
        for name in flagged:
            value = written["details"][name[len("details."):]] if name.startswith("details.") else written[name]
            assert value is not None, name
        if method == "pate-gnmax":
            assert {"teacher_accuracy_mean", "ensemble_accuracy"} <= set(flagged)
        elif method == "dp-sgd":
            assert "details.empty_batches" in flagged and "accuracy" not in flagged
        else:
            assert flagged == ["accuracy"]
