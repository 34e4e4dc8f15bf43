"""Empirical privacy audit, fast version (the full one is benchmarks/audit_privacy.py).

For the PATE aggregator with the anchored codec (the demo's pate-anchored; PCA in clip mode too, on the
vectorised path) and for DP-SGD under both relations it can claim (replace-one, the default, and
add-remove), the product's own mechanism is run on worst-case neighbouring inputs -- PATE through
Hospital.answer_query and aggregate_query, DP-SGD through task.learning.training.train_segmentation --
and a 95% lower bound on ε is computed from the runs (privacy/audit.py: Clopper-Pearson, threshold chosen on held-out runs;
Jagielski et al. 2020, Nasr et al. 2021). The bound must stay at or below what the ledger claims for the
real mechanisms and rise above it for deliberately broken ones (so this test can fail). The vectorised
trials are checked against the product paths before they are trusted.

Product runs use reproducible noise streams (fixed seeds), so the test is deterministic; the benchmark
uses the secure source.
"""

import dataclasses
import math

import numpy as np
import pytest
from scipy import stats

from privacy.accountants import gdp_mu_for
from privacy.audit import clopper_pearson_upper, epsilon_from_rates, epsilon_lower_bound, largest_resolvable
from privacy.calibration import pate_sigma
from privacy.errors import BudgetExceeded
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import NoiseSource
from task.learning.dpsgd import DPSession
from server.aggregation import QueryRelease, aggregate_query
from task import codecs
from task.learning import training
from sim.runners import privacy_audit as pa

DELTA = 1e-3

pytestmark = [pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
              pytest.mark.filterwarnings("ignore:Full backward hook is firing")]


# ------------------------------------------------------------------------------------------ statistics
def test_clopper_pearson_upper_bound():
    assert clopper_pearson_upper(0, 100, 0.05) == pytest.approx(1 - 0.05 ** (1 / 100))
    assert clopper_pearson_upper(100, 100, 0.05) == 1.0
    # exact tail: P[Bin(n, upper) <= k] = alpha
    n, k, alpha = 50, 7, 0.025
    upper = float(clopper_pearson_upper(k, n, alpha))
    assert stats.binom.cdf(k, n, upper) == pytest.approx(alpha, rel=1e-6)
    # coverage over many binomial draws at a fixed rate
    rng = np.random.default_rng(0)
    draws = rng.binomial(200, 0.03, size=4000)
    assert np.mean(clopper_pearson_upper(draws, 200, 0.05) >= 0.03) >= 0.95


def test_epsilon_from_rates_and_the_gaussian_pair():
    # a test with FPR = 0.01 and FNR = 0.5 forces eps >= log(0.499 / 0.01)
    assert epsilon_from_rates(0.01, 0.5, DELTA) == pytest.approx(math.log((1 - DELTA - 0.5) / 0.01))
    assert epsilon_from_rates(0.5, 0.5, DELTA) == 0.0
    # scores from an exactly mu-GDP pair: the bound approaches eps(mu) from below, and exceeds it for 4 mu
    rng = np.random.default_rng(1)
    mu = gdp_mu_for(1.0, DELTA)
    tight = epsilon_lower_bound(rng.normal(mu, 1, 200_000), rng.normal(0, 1, 200_000), DELTA)
    assert 0.75 < tight.epsilon_lower <= 1.0
    loose = epsilon_lower_bound(rng.normal(4 * mu, 1, 200_000), rng.normal(0, 1, 200_000), DELTA)
    assert loose.epsilon_lower > 3.0
    same = epsilon_lower_bound(rng.normal(0, 1, 20_000), rng.normal(0, 1, 20_000), DELTA)
    assert same.epsilon_lower < 0.1
    assert largest_resolvable(100, 100, DELTA) == pytest.approx(
        math.log((1 - DELTA - (1 - 0.025 ** 0.01)) / (1 - 0.025 ** 0.01)))


# ------------------------------------------------------------------------------------------------ PATE
PATE = dict(teachers=16, hospitals=2, queries=10, seed=0)     # the anchored codec, grid 16^3, l = 24


@pytest.fixture(scope="module")
def pate():
    return pa.pate_setup(pa.PateAudit(1.0, DELTA, **PATE))


@pytest.fixture(scope="module")
def pate_runs(pate):
    return pa.pate_product_scores(pate, 200, NoiseSource.reproducible(1))


def test_pate_setup_is_the_worst_case_of_the_codec_sensitivity(pate):
    # the demo's pate-anchored codec, fitted as plan_release fits it: C from the public model's residual
    assert pate.codec == "anchored" and codecs.scalar(pate.state, "kind") == "anchored"
    assert pate.compressor.shells == (-2, 5) and pate.latent_dim == 24 and pate.anchors.shape[0] == pate.queries
    assert pate.clip == pate.compressor.clip == pytest.approx(2.5 * pate.compressor.public_residual_norm)
    assert pate.sensitivity == pytest.approx(2 * pate.clip / pate.teachers)     # anchored: 2C/K
    assert pate.charged_sensitivity == pate.sensitivity                         # honest: nothing patched
    assert pate.sigma == pa.pate_calibration(pate.compressor, 1.0, DELTA, pate.queries, pate.teachers)[2]
    assert pate.mu_true == pytest.approx(pate.mu_claimed)                       # the pair uses all of it
    gap = pate.clean_means[+1] - pate.clean_means[-1]
    assert np.allclose(np.linalg.norm(gap, axis=1), 2 * pate.clip / pate.teachers, rtol=1e-6)
    assert np.allclose(gap / np.linalg.norm(gap, axis=1, keepdims=True), pate.direction, atol=1e-6)
    for side in (+1, -1):      # every row is what a hospital's codec produced: norms at most C
        for rows in pate.answers[side].values():
            assert np.all(np.linalg.norm(rows, axis=-1) <= pate.clip * (1 + 1e-6))
        # the audited teacher: p_n + side t B_n^T u, whose anchored latent is side t u before the clip, side C u after
        extreme = pate.anchors + side * 10 * pate.clip * pa.anchored_lift(pate.direction, pate.anchors,
                                                                          pate.compressor.shells)
        raw = codecs.anchored_encode(extreme, pate.anchors, pate.compressor.shells, None)
        assert np.allclose(raw, side * 10 * pate.clip * pate.direction, atol=1e-6 * pate.clip)
        assert np.allclose(pate.answers[side]["h0"][0], side * pate.clip * pate.direction, atol=1e-5)
    # every hospital charged its own ledger, with the S it computed from the codec: the same ε as the server
    claimed = pa.pate_product_run(pate, +1, NoiseSource.reproducible(0))[1]
    assert set(pate.hospital_epsilon) == {"h0", "h1"}
    assert all(eps == pytest.approx(claimed, rel=1e-12) for eps in pate.hospital_epsilon.values())


def test_the_binned_codec_audit_reaches_the_worst_case_through_the_bins():
    """The quick preset's codec (shells x 3 T1-Gd bins): the bin map travels with the anchor and every
    hospital verifies it; the audited pair, lifted through the binned regions, reaches C u and -C u exactly, so the
    pair uses all of S = 2C/K, and every hospital charged the ε the server claims."""
    binned = pa.pate_setup(pa.PateAudit(1.0, DELTA, intensity_bins=3, **PATE))
    assert binned.latent_dim == 3 * 24 and binned.compressor.intensity_bins == 3
    assert binned.sensitivity == pytest.approx(2 * binned.clip / binned.teachers)
    assert binned.mu_true == pytest.approx(binned.mu_claimed)
    for side in (+1, -1):
        assert np.allclose(binned.answers[side]["h0"][0], side * binned.clip * binned.direction, atol=1e-5)
        for rows in binned.answers[side].values():
            assert np.all(np.linalg.norm(rows, axis=-1) <= binned.clip * (1 + 1e-6))
    claimed = pa.pate_product_run(binned, +1, NoiseSource.reproducible(0))[1]
    assert all(eps == pytest.approx(claimed, rel=1e-12) for eps in binned.hospital_epsilon.values())
    # the broken control is still caught by its own numbers: it claims 4 times less sensitivity than it has
    broken = pa.pate_setup(pa.PateAudit(1.0, DELTA, intensity_bins=3, broken_factor=4.0, **PATE))
    assert broken.mu_true == pytest.approx(4 * broken.mu_claimed)


@pytest.mark.parametrize("broken_factor", [None, 4.0])
def test_pate_vectorised_release_is_the_products_formula(pate, broken_factor):
    """Same inputs, same noise stream (the release's own): aggregate_query's release == clean mean + sigma Z,
    to the bit (for the real setup and for the broken control, whose only difference is its smaller sigma)."""
    if broken_factor is not None:
        pate = pa.pate_setup(pa.PateAudit(1.0, DELTA, broken_factor=broken_factor, **PATE))
    source = NoiseSource.reproducible(7)
    for side in (+1, -1):
        releases, claimed = pa.pate_product_run(pate, side, source)
        expected = np.stack([
            (pate.clean_means[side][n] + pate.sigma * source.generator(pate.stream(n)).standard_normal(
                (pate.latent_dim,))).astype(np.float32) for n in range(pate.queries)])
        assert releases.dtype == np.float32 and np.array_equal(releases, expected)
        assert 0.999 * pate.epsilon <= claimed <= pate.epsilon          # the ledger's ε for the N queries


def test_pate_vectorised_scores_match_the_product_distribution(pate, pate_runs):
    pos, neg, _ = pate_runs
    rng = np.random.default_rng(3)
    for side, product in ((+1, pos), (-1, neg)):
        vectorised = pa.pate_vectorised_scores(pate, side, 20_000, rng)
        assert stats.ks_2samp(product, vectorised).pvalue > 1e-3
        assert np.std(vectorised) == pytest.approx(1.0, abs=0.02)      # normalised: unit variance
        assert np.mean(vectorised) == pytest.approx(side * pate.mu_claimed / 2, abs=0.03)


def test_pate_audit_stays_below_the_claim(pate, pate_runs):
    pos, neg, claimed = pate_runs
    assert epsilon_lower_bound(pos, neg, DELTA).epsilon_lower <= claimed
    (row,) = pa.audit_pate(pate, 0, vectorised_trials=200_000, seed=0)
    assert row.claimed_epsilon == claimed
    assert row.bound.epsilon_lower <= claimed
    assert row.bound.epsilon_lower > 0.6 * claimed     # and the audit is nearly tight (limit: the claim)


def test_pate_release_needs_every_declared_teacher(pate):
    """aggregate_query with expected_rows: the audited hospital answering without the audited teacher (a
    K-1 release, whose S would exceed the charged one) releases nothing and charges nothing."""
    guard = pa.make_guard(pate.epsilon, pate.delta)
    replies = pate.replies(0, +1)
    replies[pate.audited_hospital] = replies[pate.audited_hospital][1:]
    release = QueryRelease(pate.release_id(0), pate.sigma, pate.compressor, state=pate.state,
                           expected_rows=pate.expected_rows)
    assert aggregate_query(replies, release, guard) == (None, 0)
    assert guard.ledger.events(pate.audited_hospital) == []


def test_a_compressor_misreporting_its_sensitivity_is_caught_by_construction(pate, tmp_path):
    """The old broken control (the compressor reports S/4) no longer breaks anything: calibration reads S
    from the shipped codec state, and a server that took the compressor's word anyway is refused by the
    guard, which charges the true S -- as does every hospital's own ledger."""
    liar = pa.misreporting_compressor(pate.compressor, 4.0)
    assert liar.sensitivity(pate.teachers) == pytest.approx(pate.sensitivity / 4)
    state, sensitivity, sigma = pa.pate_calibration(liar, 1.0, DELTA, pate.queries, pate.teachers)
    assert (sensitivity, sigma) == (pate.sensitivity, pate.sigma)
    word = pate_sigma(1.0, DELTA, pate.queries, liar.sensitivity(pate.teachers))   # the old calibration
    assert word == pytest.approx(pate.sigma / 4)
    guard = pa.make_guard(1.0, DELTA)
    believed = QueryRelease(pate.release_id(0), word, liar, state=state, expected_rows=pate.expected_rows)
    with pytest.raises(BudgetExceeded):
        aggregate_query(pate.replies(0, +1), believed, guard)
    assert guard.ledger.events(pate.audited_hospital) == []          # refused: nothing recorded or released
    roomy = BudgetGuard(Ledger(None), 1e6, DELTA)
    aggregate_query(pate.replies(0, +1), believed, roomy)
    (event,) = roomy.ledger.events(pate.audited_hospital)
    assert event.sensitivity == pytest.approx(pate.sensitivity)      # the true S, not the compressor's
    grid = pate.anchors.shape[2:]
    hospital = pa.audit_hospital("h0", np.full((8, 1, 4, *grid), 0.25, np.float32), tmp_path, 1.0, DELTA,
                                 max_teachers=pate.teachers)
    shipped = codecs.with_anchor(liar.state(), pate.anchors[:1])
    request = {"release_ids": ["q"], "sigma": word, "teachers": pate.teachers}
    with pytest.raises(BudgetExceeded):
        hospital.answer_query(np.zeros((1, 4, *grid)), shipped, request)
    hospital.lifetime_epsilon = 1e6
    hospital.answer_query(np.zeros((1, 4, *grid)), shipped, request)
    (event,) = Ledger(hospital.privacy_ledger).events("h0")
    assert event.sensitivity == pytest.approx(pate.sensitivity)


def test_pate_audit_catches_an_understated_codec_sensitivity(pate):
    """codec_sensitivity understated 4x (the one function calibration, the server's charge and every
    hospital's charge use): sigma 4x too small while every ledger claims eps = 1. The vectorised audit
    refutes the claim; a grosser bug (16x) is refuted by the product path itself within 150 runs per side.
    (Refuting the 4x bug on the product path reliably needs ~1000 runs per side: the benchmark does it.)"""
    broken = pa.pate_setup(pa.PateAudit(1.0, DELTA, broken_factor=4.0, **PATE))
    assert broken.sensitivity == pate.sensitivity and broken.charged_sensitivity == pate.sensitivity / 4
    assert broken.sigma == pytest.approx(pate.sigma / 4)
    assert broken.mu_true == pytest.approx(4 * broken.mu_claimed)
    assert all(0.999 <= eps <= 1.0 for eps in broken.hospital_epsilon.values())   # the hospitals are fooled too
    assert codecs.codec_sensitivity(broken.state, broken.teachers) == pate.sensitivity   # the patch is closed
    (vectorised,) = pa.audit_pate(broken, 0, vectorised_trials=100_000, seed=0)
    assert 0.999 <= vectorised.claimed_epsilon <= 1.0       # the ledger believes the budget holds
    assert vectorised.violated and vectorised.bound.epsilon_lower > 3.0
    gross = pa.pate_setup(pa.PateAudit(1.0, DELTA, broken_factor=16.0, **PATE))
    (product,) = pa.audit_pate(gross, 150, noise=NoiseSource.reproducible(2), seed=0)
    assert product.claimed_epsilon <= 1.0 and product.violated and product.bound.epsilon_lower > 2.0


def test_pca_clip_codec_is_audited_too():
    """PCA in clip mode, the codec the audit exercised before the anchored one: the same pair (rows +-C u)
    through the same hospitals and aggregate_query; the vectorised audit stays under the claim and
    catches the 4x understated sensitivity."""
    pca = pa.pate_setup(pa.PateAudit(1.0, DELTA, codec="pca", latent_dim=8, **PATE))
    assert codecs.scalar(pca.state, "kind") == "pca" and pca.anchors is None
    assert pca.sensitivity == pytest.approx(2 * pca.clip / pca.teachers) and pca.mu_true == pytest.approx(pca.mu_claimed)
    for side in (+1, -1):
        assert np.allclose(pca.answers[side]["h0"][0], side * pca.clip * pca.direction, atol=1e-5)
    source = NoiseSource.reproducible(7)
    releases, claimed = pa.pate_product_run(pca, -1, source)
    expected = (pca.clean_means[-1] + pca.sigma * np.stack([source.generator(pca.stream(n)).standard_normal(
        (pca.latent_dim,)) for n in range(pca.queries)])).astype(np.float32)
    assert np.array_equal(releases, expected) and 0.999 <= claimed <= 1.0
    (row,) = pa.audit_pate(pca, 0, vectorised_trials=100_000, seed=0)
    assert row.claimed_epsilon == claimed and 0.6 * claimed < row.bound.epsilon_lower <= claimed
    broken = pa.pate_setup(pa.PateAudit(1.0, DELTA, codec="pca", latent_dim=8, broken_factor=4.0, **PATE))
    (row,) = pa.audit_pate(broken, 0, vectorised_trials=100_000, seed=0)
    assert row.claimed_epsilon <= 1.0 and row.violated and row.bound.epsilon_lower > 3.0


# ---------------------------------------------------------------------------------------------- DP-SGD
# q = 1/2, 4 steps, fixed sigma chosen so each relation's ledger says eps ~ 0.94 at 1e-3 (budget 1)
DPSGD = dict(others=3, batch_size=2, epochs=2)
SIGMA = {"replace-one": 5.4, "add-remove": 3.0}
RELATIONS = ("replace-one", "add-remove")


@pytest.fixture(scope="module", params=RELATIONS)
def dpsgd(request):
    return pa.dpsgd_setup(pa.DPSGDAudit(1.0, DELTA, relation=request.param, **DPSGD), sigma=SIGMA[request.param])


@pytest.fixture(scope="module")
def dpsgd_runs(dpsgd):
    return pa.dpsgd_product_runs(dpsgd, 100, NoiseSource.reproducible(4))


def _contribution(setup, with_canary):
    return setup.signal if with_canary else setup.replacement


@pytest.mark.parametrize("relation", RELATIONS)
def test_dpsgd_pair_has_the_relations_sizes(relation):
    setup = pa.DPSGDSetup(1.0, DELTA, relation=relation, clip=1.0, **DPSGD)
    with_canary, without = setup.data(True), setup.data(False)
    assert with_canary[-1, 1] == setup.scale
    if relation == "replace-one":   # same size; the last record's gradient points the other way
        assert len(without) == len(with_canary) and without[-1, 1] == -setup.scale
    else:                           # one record fewer
        assert len(without) == len(with_canary) - 1 and not without[:, 1].any()


def test_dpsgd_audit_trains_through_train_segmentation(dpsgd, monkeypatch):
    """Every DP-SGD audit run is one call of the product's task.learning.training.train_segmentation (not a copy of its
    loop), with the run's DPConfig and the two TrainConfig hooks the canary needs; the broken controls swap
    the session inside it for their run only."""
    calls = []
    real = training.train_segmentation

    def spy(model, images, targets, config, **options):
        calls.append((config, options))
        return real(model, images, targets, config, **options)

    monkeypatch.setattr(training, "train_segmentation", spy)
    run = pa.dpsgd_product_run(dpsgd, True, NoiseSource.reproducible(3))
    ((config, options),) = calls
    dp = options["private"].dp
    assert (dp.mode, dp.noise_multiplier, dp.relation, dp.sampling, dp.per_layer) == (
        "fixed", dpsgd.sigma, dpsgd.relation, "poisson", True)
    assert config.loss_fn is not None and config.optimizer_factory is not None and config.augment is False
    assert len(run.observations) == dpsgd.steps and 0.9 < run.claimed_epsilon < 1.0
    quarter = pa.dpsgd_setup(pa.DPSGDAudit(1.0, DELTA, relation=dpsgd.relation, noise_factor=0.25, **DPSGD), sigma=dpsgd.sigma)
    pa.dpsgd_product_run(quarter, True, NoiseSource.reproducible(3))
    assert len(calls) == 3 and calls[-1][1]["private"].dp.noise_multiplier == dpsgd.sigma   # charged at the full sigma
    assert training.DPSession is DPSession                                          # the patch is closed
    defaults = training.TrainConfig(epochs=1, batch_size=1, learning_rate=1e-3)     # the product's own loss / Adam
    assert defaults.loss_fn is None and defaults.optimizer_factory is None


def test_dpsgd_canary_contributes_exactly_the_clip_without_noise(dpsgd):
    """With the noise switched off, every step's projected update is +1 when the canary was in the Poisson
    batch (-1 when its replacement was, under replace-one) and 0 otherwise: clipping to C per tensor
    (C_total in all) and nothing else in its direction."""
    silent = pa.dpsgd_setup(pa.DPSGDAudit(1.0, DELTA, relation=dpsgd.relation, noise_factor=0.0, **DPSGD), sigma=dpsgd.sigma)
    seen = 0
    for with_canary in (True, False):
        for t in range(4):
            run = pa.dpsgd_product_run(silent, with_canary, NoiseSource.reproducible(5).child(with_canary, t))
            expected = _contribution(silent, with_canary) * run.members
            assert np.allclose(run.observations, expected, atol=1e-5)
            seen += int(run.members.sum())
    assert seen > 0
    unclipped = pa.dpsgd_setup(pa.DPSGDAudit(1.0, DELTA, relation=dpsgd.relation, noise_factor=0.0, unclipped=True,
                                             **DPSGD), sigma=dpsgd.sigma)
    run = pa.dpsgd_product_run(unclipped, True, NoiseSource.reproducible(6))
    assert np.allclose(run.observations, unclipped.signal * run.members, rtol=1e-5)


def test_dpsgd_batches_and_noise_come_from_the_charged_epochs_stream(dpsgd):
    """Replaying the stream DPSession opens after charging epoch e (named after its release id): its
    Poisson masks, and from the stream spawned from it one flat float32 buffer per step (tensor a's noise,
    then tensor b's), give the product's observations exactly (float32):
    ``c b_t + sigma (-xi_a - xi_b)[canary coordinate] / sqrt 2``."""
    source = NoiseSource.reproducible(11)
    for with_canary in (True, False):
        run = pa.dpsgd_product_run(dpsgd, with_canary, source)
        n = dpsgd.size(with_canary)
        expected, members = [], []
        for epoch in range(dpsgd.epochs):
            stream = source.generator(f"audit:epoch-{epoch}")
            noise = stream.spawn()
            for _ in range(dpsgd.steps_per_epoch):
                member = bool((stream.uniform((n,)) < dpsgd.sampling_rate)[-1])
                flat = noise.standard_normal((2 * dpsgd.dim,)).astype(np.float32)
                xi_a, xi_b = flat[None, :dpsgd.dim], flat[None, dpsgd.dim:]
                members.append(member)
                expected.append(_contribution(dpsgd, with_canary) * member
                                + dpsgd.sigma * (-xi_a[0, 1] - xi_b[0, 1]) / math.sqrt(2))
        last_present = with_canary or dpsgd.relation == "replace-one"
        assert np.array_equal(run.members, np.array(members) & last_present)
        assert np.allclose(run.observations, expected, atol=1e-4)


def test_dpsgd_vectorised_matches_the_product(dpsgd, dpsgd_runs):
    with_runs, without_runs, claimed = dpsgd_runs
    assert dpsgd.sampling_rate == 0.5 and dpsgd.steps == 4
    obs, residual = {}, []
    for with_canary, runs in ((True, with_runs), (False, without_runs)):
        members = np.stack([r.members for r in runs])
        obs[with_canary] = np.stack([r.observations for r in runs])
        if with_canary or dpsgd.relation == "replace-one":   # Poisson rate q for the canary / its replacement
            assert abs(members.mean() - dpsgd.sampling_rate) < 4 * math.sqrt(0.25 / members.size)
        else:
            assert not members.any()
        residual.append((obs[with_canary] - _contribution(dpsgd, with_canary) * members).ravel())
    residual = np.concatenate(residual)
    assert np.std(residual) == pytest.approx(dpsgd.sigma, rel=0.08)          # noise sigma * C_total
    assert abs(np.mean(residual)) < 4 * dpsgd.sigma / math.sqrt(residual.size)
    rng = np.random.default_rng(8)
    for with_canary in (True, False):
        product = pa.dpsgd_scores(dpsgd, obs[with_canary])
        vectorised = pa.dpsgd_vectorised_scores(dpsgd, with_canary, 20_000, rng)
        assert stats.ks_2samp(product, vectorised).pvalue > 1e-3


def test_dpsgd_audit_stays_below_the_claim(dpsgd, dpsgd_runs):
    with_runs, without_runs, claimed = dpsgd_runs
    assert 0.9 < claimed < 1.0
    pos = pa.dpsgd_scores(dpsgd, np.stack([r.observations for r in with_runs]))
    neg = pa.dpsgd_scores(dpsgd, np.stack([r.observations for r in without_runs]))
    assert epsilon_lower_bound(pos, neg, DELTA).epsilon_lower <= claimed
    (row,) = pa.audit_dpsgd(dpsgd, 0, vectorised_trials=200_000, seed=0, limit=True)
    assert row.claimed_epsilon == claimed
    assert row.limit == pytest.approx(claimed, rel=1e-6)      # the pair run is the one the accountant analyses
    assert 0.5 * claimed < row.bound.epsilon_lower <= claimed


def test_dpsgd_audit_catches_missing_clipping_and_missing_noise(dpsgd):
    unclipped = pa.dpsgd_setup(pa.DPSGDAudit(1.0, DELTA, relation=dpsgd.relation, unclipped=True, **DPSGD), sigma=dpsgd.sigma)
    (row,) = pa.audit_dpsgd(unclipped, 60, noise=NoiseSource.reproducible(9), seed=0)
    assert row.claimed_epsilon < 1.0 and row.violated and row.bound.epsilon_lower > 1.5
    quarter = pa.dpsgd_setup(pa.DPSGDAudit(1.0, DELTA, relation=dpsgd.relation, noise_factor=0.25, **DPSGD), sigma=dpsgd.sigma)
    # the product's broken session really adds a quarter of the noise (what the vectorised path draws)
    runs = [pa.dpsgd_product_run(quarter, False, NoiseSource.reproducible(10).child(t)) for t in range(40)]
    residual = np.concatenate([r.observations - quarter.replacement * r.members for r in runs])
    assert np.std(residual) == pytest.approx(dpsgd.sigma / 4, rel=0.15)
    (row,) = pa.audit_dpsgd(quarter, 0, vectorised_trials=100_000, seed=0)
    assert row.violated and row.bound.epsilon_lower > 3.0


# ================================================================================================ secure sums
@pytest.mark.parametrize("kind", ["pate", "dp-fedavg"])
def test_the_secure_audit_runs_the_product_and_its_broken_control_is_told_apart(kind, tmp_path):
    """A secure PATE query and a dp-fedavg-secure step through full secure sums of the hospitals' own parties:
    every run's ledger claims the server plan's ε, the scores are in units of the declared noise (the honest
    sides overlap), and with every noise share a tenth of what was charged D and D' come apart completely
    (seeded noise, so the test is exact)."""
    from sim.runners.privacy_audit import (SecureAudit, secure_fedavg_setup, secure_pate_setup,
                                           secure_product_scores)

    make = secure_pate_setup if kind == "pate" else secure_fedavg_setup
    honest = make(SecureAudit(), tmp_path / "honest")
    positive, negative, claimed = secure_product_scores(honest, 4, noise_seed=1)
    assert claimed == pytest.approx(honest.planned_epsilon) and 0.99 < claimed <= 1.0
    assert max(positive) > min(negative) and np.all(np.abs(np.concatenate([positive, negative])) < 4)
    broken = dataclasses.replace(honest, audit=dataclasses.replace(honest.audit, broken_factor=100.0))
    positive, negative, claimed = secure_product_scores(broken, 4, noise_seed=1)
    assert claimed == pytest.approx(honest.planned_epsilon)      # the ledger still says the budget holds
    assert min(positive) > max(negative)
