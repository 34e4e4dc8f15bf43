"""Calibration: golden σ values, safe side within 0.1 %, monotonicity (hypothesis), DP-SGD and zCDP."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.accountants import GaussianGDPAccountant, epsilon_spent, gdp_epsilon, zcdp_epsilon, zcdp_rho_for
from privacy.calibration import (
    calibrate,
    dpsgd_noise_multiplier,
    paper_sigma,
    pate_sigma,
    pate_sigma_for_accountant,
    shuffled_noise_multiplier,
)
from privacy.errors import PrivacyError
from privacy.events import ComposedEvent, GaussianEvent, SampledGaussianEvent, ZCDPEvent


def _exact_epsilon(sigma, queries, sens, delta):
    return GaussianGDPAccountant().compose(GaussianEvent(sens, sigma, queries)).get_epsilon(delta)


def test_golden_pate_sigmas():
    exact = pate_sigma(8, 1e-3, 80, 2 / 8)
    paper = paper_sigma(8, 1e-3, 80, 2 / 8)
    assert exact == pytest.approx(1.0733, abs=1e-4)
    assert paper == pytest.approx(1.2826, abs=1e-4)
    assert pate_sigma(8, 1e-3, 80, 0.25, mode="paper") == paper
    assert paper / exact == pytest.approx(1.195, abs=1e-3)
    assert paper_sigma(1, 1e-3, 80, 0.25) / pate_sigma(1, 1e-3, 80, 0.25) == pytest.approx(1.49, abs=0.01)
    # calibrating with RDP (improved conversion) instead gives 1.1629
    assert pate_sigma_for_accountant(8, 1e-3, 80, 0.25, "rdp") == pytest.approx(1.1629, rel=1e-3)


def test_paper_sigma_is_eq15_literally():
    eps, delta, n, d, k = 8.0, 1e-3, 80, 64**3 * 4, 8
    log_inv = math.log(1 / delta)
    eq15 = math.sqrt(n * d) * (math.sqrt(log_inv + eps) + math.sqrt(log_inv)) / (math.sqrt(2) * k * eps)
    assert paper_sigma(eps, delta, n, math.sqrt(d) / k) == pytest.approx(eq15, rel=1e-12)
    # eq. 15 is the zCDP conversion, hence valid (ε under exact GDP is below target)
    assert _exact_epsilon(paper_sigma(eps, delta, n, 0.25), n, 0.25, delta) < eps


@settings(max_examples=40, deadline=None)
@given(
    eps=st.floats(0.05, 30),
    delta=st.floats(1e-9, 1e-2),
    queries=st.integers(1, 5000),
    sens=st.floats(1e-3, 10),
)
def test_exact_sigma_is_safe_and_within_tolerance(eps, delta, queries, sens):
    sigma = pate_sigma(eps, delta, queries, sens)
    spent = _exact_epsilon(sigma, queries, sens, delta)
    assert spent <= eps
    assert spent >= eps * (1 - 1e-3)
    assert sigma < paper_sigma(eps, delta, queries, sens)  # exact is never worse than eq. 15


@settings(max_examples=30, deadline=None)
@given(
    eps=st.floats(0.1, 20),
    factor=st.floats(1.01, 3),
    delta=st.floats(1e-8, 1e-2),
    queries=st.integers(1, 2000),
)
def test_sigma_monotonic(eps, factor, delta, queries):
    base = pate_sigma(eps, delta, queries, 0.25)
    assert pate_sigma(eps * factor, delta, queries, 0.25) < base  # more budget, less noise
    assert pate_sigma(eps, delta, queries + 1, 0.25) > base  # more queries, more noise
    assert pate_sigma(eps, min(delta * factor, 0.5), queries, 0.25) < base  # larger δ, less noise


@settings(max_examples=25, deadline=None)
@given(eps=st.floats(0.2, 15), delta=st.floats(1e-8, 1e-2), queries=st.integers(1, 500), sens=st.floats(0.01, 2))
def test_generic_calibrate_safe_side(eps, delta, queries, sens):
    sigma = calibrate(lambda s: GaussianEvent(sens, s, queries), eps, delta, "gdp-exact", 0.01, 1.0)
    spent = _exact_epsilon(sigma, queries, sens, delta)
    assert eps * (1 - 1e-3) <= spent <= eps


def test_generic_calibrate_increasing_parameter():
    # number of queries of a fixed Gaussian is increasing in ε; continuous relaxation via sensitivity
    sens = calibrate(lambda s: GaussianEvent(s, 1.0, 80), 8.0, 1e-3, "gdp-exact", 0.01, 0.02)
    assert sens == pytest.approx(1 / 1.0733 * 0.25, rel=2e-3)
    assert _exact_epsilon(1.0, 80, sens, 1e-3) <= 8.0


def test_calibrate_rejects_impossible_and_discontinuous():
    with pytest.raises(PrivacyError, match="lo"):
        calibrate(lambda s: GaussianEvent(1, s), 1.0, 1e-5, "gdp-exact", 2.0, 1.0)
    with pytest.raises(PrivacyError, match="jumps"):
        # a step count is discrete: ε jumps over the 0.1 % window
        calibrate(lambda n: GaussianEvent(1, 5.0, max(1, int(n))), 2.0, 1e-5, "gdp-exact", 1, 1000)


def test_dpsgd_noise_multiplier_rdp_and_pld():
    z_rdp = dpsgd_noise_multiplier(2.1014, 1e-5, 0.01, 1000, accountant="rdp")
    assert z_rdp == pytest.approx(1.0, rel=2e-3)  # inverts the golden value
    eps = epsilon_spent([SampledGaussianEvent(0.01, z_rdp, 1000)], 1e-5, "rdp")[0]
    assert 2.1014 * (1 - 1e-3) <= eps <= 2.1014
    z_pld = dpsgd_noise_multiplier(2.0, 1e-5, 0.02, 200, accountant="pld")
    eps = epsilon_spent([SampledGaussianEvent(0.02, z_pld, 200)], 1e-5, "pld")[0]
    assert 2.0 * (1 - 1e-3) <= eps <= 2.0
    assert z_pld < dpsgd_noise_multiplier(2.0, 1e-5, 0.02, 200, accountant="rdp")
    with pytest.raises(PrivacyError, match="accountant"):
        dpsgd_noise_multiplier(2.0, 1e-5, 0.01, 10, accountant="zcdp")
    with pytest.raises(PrivacyError, match="sampling_rate"):
        dpsgd_noise_multiplier(2.0, 1e-5, 0.0, 10)


def test_dpsgd_noise_multiplier_under_replace_one():
    """q = 1/9, 90 steps, δ = 1e-3 (the demo's DP-SGD): the replace-one z spends ε within the 1e-3 window under
    dp_accounting's REPLACE_ONE PLD, and is larger than the add/remove z, whose replace-one ε is ≈ 11.74."""
    import dp_accounting
    from dp_accounting.privacy_accountant import NeighboringRelation

    z = dpsgd_noise_multiplier(8.0, 1e-3, 1 / 9, 90, relation="replace-one")
    direct = dp_accounting.pld.PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4)
    direct.compose(dp_accounting.PoissonSampledDpEvent(1 / 9, dp_accounting.GaussianDpEvent(z)), 90)
    assert 8.0 * (1 - 2e-3) <= direct.get_epsilon(1e-3) <= 8.0 + 1e-3
    assert z == pytest.approx(1.0234, abs=2e-3)
    assert z > dpsgd_noise_multiplier(8.0, 1e-3, 1 / 9, 90)  # add/remove: 0.7987
    with pytest.raises(PrivacyError, match="pld"):
        dpsgd_noise_multiplier(8.0, 1e-3, 1 / 9, 90, accountant="rdp", relation="replace-one")
    with pytest.raises(PrivacyError, match="relation"):
        dpsgd_noise_multiplier(8.0, 1e-3, 1 / 9, 90, relation="zero-out")


@settings(max_examples=30, deadline=None)
@given(eps=st.floats(0.05, 50), delta=st.floats(1e-10, 1e-2), epochs=st.integers(1, 500),
       relation=st.sampled_from(["zero-out", "replace-one"]))
def test_shuffled_noise_multiplier(eps, delta, epochs, relation):
    sigma = shuffled_noise_multiplier(eps, delta, epochs, relation=relation)
    spent = zcdp_epsilon(ZCDPEvent.shuffled_epochs(sigma, epochs, relation).rho, delta)
    assert eps * (1 - 1e-9) <= spent <= eps


def test_shuffled_noise_multiplier_relations():
    """Replace-one doubles the sensitivity of a shuffled batch (2C), so σ doubles; add/remove is refused."""
    zero_out = shuffled_noise_multiplier(4.0, 1e-3, 3)
    assert zero_out == pytest.approx(math.sqrt(3 / (2 * zcdp_rho_for(4.0, 1e-3))), rel=1e-9)
    assert shuffled_noise_multiplier(4.0, 1e-3, 3, relation="replace-one") == pytest.approx(2 * zero_out, rel=1e-9)
    with pytest.raises(PrivacyError, match="zero-out"):
        shuffled_noise_multiplier(4.0, 1e-3, 3, relation="add-remove")


def test_invalid_inputs_name_the_parameter():
    with pytest.raises(PrivacyError, match="epsilon"):
        pate_sigma(0, 1e-3, 80, 0.25)
    with pytest.raises(PrivacyError, match="delta"):
        pate_sigma(8, 1.5, 80, 0.25)
    with pytest.raises(PrivacyError, match="mode"):
        pate_sigma(8, 1e-3, 80, 0.25, mode="loose")
    with pytest.raises(PrivacyError, match="sensitivity"):
        paper_sigma(8, 1e-3, 80, -1)


def test_gdp_epsilon_of_calibrated_mu():
    sigma = pate_sigma(8, 1e-3, 80, 0.25)
    assert gdp_epsilon(math.sqrt(80) * 0.25 / sigma, 1e-3) <= 8.0


def test_pld_calibration_with_wide_bracket_is_prescreened_by_rdp():
    """A wide bracket must not make PLD evaluate z = 0.05 (minutes): RDP narrows it first."""
    make = lambda z: ComposedEvent((GaussianEvent(1.0, 20.0, relation="add-remove"),  # noqa: E731
                                    SampledGaussianEvent(0.01, z, 100)))
    z = calibrate(make, 2.0, 1e-5, "pld", 0.05, 500.0)
    eps = epsilon_spent([make(z)], 1e-5, "pld")[0]
    assert 2.0 * (1 - 1e-3) <= eps <= 2.0


def test_wide_pld_bracket_for_replace_one_poisson_is_prescreened_through_add_remove():
    """RDP refuses replace-one Poisson events, so the prescreen reads them under add/remove (about 16 s here
    against 96 s for PLD over the whole bracket); the answer is still the exact replace-one PLD one."""
    make = lambda z: SampledGaussianEvent(0.01, z, 100, relation="replace-one")  # noqa: E731
    z = calibrate(make, 2.0, 1e-5, "pld", 0.05, 500.0)
    eps = epsilon_spent([make(z)], 1e-5, "pld")[0]
    assert 2.0 * (1 - 1e-3) <= eps <= 2.0
    assert z == pytest.approx(0.7525, abs=1e-3)


@settings(max_examples=60, deadline=None)
@given(epsilon=st.floats(0.3, 20), log_delta=st.floats(-7, -2), queries=st.integers(1, 150),
       teachers=st.integers(2, 512), batch=st.sampled_from([1, 2, 8, 16]))
def test_a_calibrated_pate_plan_passes_the_budget_guard(epsilon, log_delta, queries, teachers, batch):
    """The guard recomputes ε from the ledger in its own float order (a count-b check per batch, then one
    charge per query): every query of a plan calibrated by pate_sigma must be allowed, and ε ≤ budget."""
    from privacy.guard import BudgetGuard
    from privacy.ledger import Ledger

    delta = 10 ** log_delta
    sensitivity = 2 / teachers
    sigma = pate_sigma(epsilon, delta, queries, sensitivity)
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, epsilon, delta)
    for start in range(0, queries, batch):
        size = min(batch, queries - start)
        guard.check(["h0"], GaussianEvent(sensitivity=sensitivity, sigma=sigma, count=size))
        for j in range(size):
            guard.charge(["h0"], GaussianEvent(sensitivity=sensitivity, sigma=sigma), f"query-{start + j}")
    assert ledger.spent("h0", delta).epsilon <= epsilon
