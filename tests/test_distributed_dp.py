"""The distributed discrete Gaussian (privacy/distributed.py, DistributedDiscreteGaussianEvent): the exact
sampler, conditional rounding, the accounting against dp_accounting, calibration and the modulus."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privacy.accountants import accountant_for, epsilon_spent, make_accountant
from privacy.distributed import (
    IntegerGrid,
    calibrate_local_variance,
    centered,
    conditional_round,
    ddg_event,
    modulus_bits,
    rounded_norm_bound,
    row_sensitivity,
    sample_discrete_gaussian,
    share_count,
    wrap_bound,
)
from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import DistributedDiscreteGaussianEvent, GaussianEvent, event_from_dict
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.mechanisms import make_generator


def _pmf(variance: float, span: int) -> tuple[np.ndarray, np.ndarray]:
    support = np.arange(-span, span + 1)
    weights = np.exp(-support.astype(float) ** 2 / (2 * variance))
    return support, weights / weights.sum()


def test_discrete_gaussian_sampler_matches_the_pmf():
    variance = 2.5
    draws = sample_discrete_gaussian(variance, 20000, make_generator(3))
    support, pmf = _pmf(variance, 12)
    counts = np.array([(draws == x).sum() for x in support])
    assert counts.sum() == len(draws)                       # nothing outside ±12 (mass there < 1e-12)
    expected = pmf * len(draws)
    keep = expected > 5
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    # chi-square with ~11 degrees of freedom: 40 is far beyond its 0.9999 quantile (~35)
    assert chi2 < 40, chi2
    assert abs(draws.mean()) < 0.05
    assert abs(draws.var() - float((pmf * support**2).sum())) < 0.1


def test_discrete_gaussian_sampler_is_reproducible_only_when_asked():
    seeded = [sample_discrete_gaussian(7.0, 200, make_generator(11)) for _ in range(2)]
    np.testing.assert_array_equal(seeded[0], seeded[1])
    secure = [sample_discrete_gaussian(7.0, 200, None) for _ in range(2)]
    assert not np.array_equal(secure[0], secure[1])
    assert np.issubdtype(secure[0].dtype, np.integer)


def test_large_variance_sampler_scales():
    draws = sample_discrete_gaussian(1e6, 4000, make_generator(5))
    assert abs(draws.var() / 1e6 - 1) < 0.1


def test_conditional_rounding_is_unbiased_and_bounded():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(50, 16))
    rows = 30.0 * rows / np.linalg.norm(rows, axis=1, keepdims=True)   # norm 30 each
    bound = rounded_norm_bound(30.0, 16)
    generator = make_generator(1)
    total = np.zeros_like(rows)
    for _ in range(200):
        rounded = conditional_round(rows, bound, generator)
        assert np.issubdtype(rounded.dtype, np.integer)
        assert np.all(np.sum(rounded.astype(float) ** 2, axis=1) <= bound**2)
        assert np.all(np.abs(rounded - rows) < 1)
        total += rounded
    assert np.max(np.abs(total / 200 - rows)) < 0.15


def test_conditional_rounding_refuses_rows_longer_than_the_bound():
    with pytest.raises(PrivacyError, match="norm bound"):
        conditional_round(np.full((1, 4), 10.0), rounded_norm_bound(5.0, 4), make_generator(0), max_tries=5)


def test_norm_bound_formula_and_grid():
    c, d, beta = 100.0, 9, math.exp(-0.5)
    first = c * c + d / 4 + 1.0 * (c + 3 / 2)
    assert rounded_norm_bound(c, d, beta) == pytest.approx(math.sqrt(min(first, (c + 3) ** 2)))
    assert rounded_norm_bound(0.1, 1, 1e-9) == pytest.approx(1.1)    # the deterministic branch (c + sqrt d)
    grid = IntegerGrid.for_rows(2.0, 120)
    assert grid.row_bound * grid.granularity <= 2.0 * (1 + 1e-3)
    rows = np.random.default_rng(1).normal(size=(3, 120)) * 5            # longer than the clip: re-clipped
    integers = grid.to_integers(rows, make_generator(0))
    assert np.all(np.linalg.norm(integers, axis=1) <= grid.row_bound)
    assert row_sensitivity(10.0, 4, "replace-one") == (20.0, 40.0)
    assert row_sensitivity(10.0, 400, "add-remove") == (10.0, 100.0)


def test_one_share_is_the_discrete_gaussians_own_zcdp():
    event = DistributedDiscreteGaussianEvent(l2_sensitivity=3.0, l1_sensitivity=9.0, local_variance=50.0, shares=1,
                                             dimension=10, count=4)
    assert event.tau == 0.0
    assert event.rho == pytest.approx(4 * 9.0 / (2 * 50.0))


def test_tau_and_rho_follow_proposition_14():
    event = DistributedDiscreteGaussianEvent(l2_sensitivity=2.0, l1_sensitivity=4.0, local_variance=0.2, shares=3,
                                             dimension=100)
    tau = 10 * sum(math.exp(-2 * math.pi**2 * 0.2 * k / (k + 1)) for k in (1, 2))
    assert event.tau == pytest.approx(tau)
    a2 = a1 = None
    a2, a1 = 2.0 / math.sqrt(0.6), 4.0 / math.sqrt(0.6)
    expected = 0.5 * min((a2 + tau * 10) ** 2, a2**2 + 2 * a1 * tau + tau**2 * 100)
    assert event.rho == pytest.approx(expected)
    # with realistic variances the sum is as private as one discrete Gaussian of the total variance
    big = DistributedDiscreteGaussianEvent(2.0, 4.0, 25.0, 5, 1000)
    assert big.rho == pytest.approx(4.0 / (2 * 125.0), rel=1e-12)


def test_epsilon_agrees_with_dp_accounting_rdp_of_the_same_zcdp():
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    event = ddg_event(IntegerGrid.for_rows(1.0, 64), 4.0e7, shares=4, count=80)
    ours, name = epsilon_spent([event], 1e-5)
    assert name == "rdp"
    theirs = rdp_privacy_accountant.RdpAccountant()
    theirs.compose(dp_event.ZCDpEvent(event.rho))
    assert ours == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-12)
    # zcdp accountant: ρ + 2 sqrt(ρ ln 1/δ), never tighter than the RDP conversion
    zcdp = make_accountant("zcdp").compose(event).get_epsilon(1e-5)
    assert zcdp == pytest.approx(event.rho + 2 * math.sqrt(event.rho * math.log(1e5)))
    assert ours <= zcdp


def test_one_dimensional_discrete_gaussian_against_dp_accountings_pld():
    """For one share, one coordinate and an integer sensitivity the sum *is* dp_accounting's discrete
    Gaussian; our (RDP) epsilon must be an upper bound on its PLD epsilon, and not a loose one."""
    from dp_accounting.pld import privacy_loss_distribution

    sigma, sensitivity, count, delta = 20.0, 2, 10, 1e-5
    event = DistributedDiscreteGaussianEvent(float(sensitivity), float(sensitivity), sigma**2, 1, 1, count)
    ours = epsilon_spent([event], delta)[0]
    pld = privacy_loss_distribution.from_discrete_gaussian_mechanism(sigma, sensitivity=sensitivity)
    exact = pld.self_compose(count).get_epsilon_for_delta(delta)
    assert exact <= ours <= 1.2 * exact, (exact, ours)
    # and the continuous Gaussian of the same sigma is within a few per cent (Canonne et al.)
    continuous = epsilon_spent([GaussianEvent(sensitivity, sigma, count)], delta)[0]
    assert abs(exact - continuous) / continuous < 0.05


def test_event_round_trips_and_pld_refuses_it():
    event = ddg_event(IntegerGrid.for_rows(1.0, 8), 1e6, 3, 5)
    assert event_from_dict(event.to_dict()) == event
    assert not make_accountant("pld").supports(event)
    with pytest.raises(UnsupportedEvent):
        make_accountant("pld").compose(event)
    assert accountant_for([event, GaussianEvent(0.5, 2.0, 3)]).name == "split:gdp-exact+rdp"
    with pytest.raises(PrivacyError, match="l1_sensitivity"):
        DistributedDiscreteGaussianEvent(2.0, 1.0, 1.0, 1, 4)


def test_calibration_is_on_the_safe_side():
    grid = IntegerGrid.for_rows(0.5, 200)
    variance = calibrate_local_variance(4.0, 1e-5, 60, grid, shares=3)
    spent = epsilon_spent([ddg_event(grid, variance, 3, 60)], 1e-5)[0]
    assert 4.0 * (1 - 1e-3) <= spent <= 4.0
    # fewer counted shares need more noise per share, the same total
    fewer = calibrate_local_variance(4.0, 1e-5, 60, grid, shares=1)
    assert fewer == pytest.approx(3 * variance, rel=2e-3)


def test_ledger_and_guard_charge_the_event():
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, 2.0, 1e-5)
    grid = IntegerGrid.for_rows(1.0, 16)
    event = ddg_event(grid, calibrate_local_variance(1.5, 1e-5, 10, grid, 2), 2, 10)
    guard.charge(["h0"], event, "q0")
    spent = ledger.spent("h0", 1e-5)
    assert spent.accountant == "rdp" and spent.epsilon <= 1.5
    from privacy.errors import BudgetExceeded

    with pytest.raises(BudgetExceeded):
        guard.charge(["h0"], event, "q1")
    assert ledger.spent("h0", 1e-5).releases == 1


def test_modulus_holds_the_noisy_sum():
    rows, d, parties, variance = 6, 50, 4, 3.0e4
    grid = IntegerGrid(1.0, 1 / 64, d)
    bits = modulus_bits(rows * grid.row_bound, parties * variance, d * 10, 1e-9)
    assert wrap_bound(bits, rows * grid.row_bound, parties * variance, d * 10) <= 1e-9
    generator = make_generator(2)
    for _ in range(10):
        signal = grid.to_integers(np.random.default_rng(0).normal(size=(rows, d)), generator).sum(axis=0)
        noise = sum(sample_discrete_gaussian(variance, d, generator) for _ in range(parties))
        total = signal + noise
        np.testing.assert_array_equal(centered(total & ((1 << bits) - 1), bits), total)
    with pytest.raises(PrivacyError, match="bits"):
        modulus_bits(2.0**70, 1.0, 10)


def test_share_count():
    assert share_count(10, 2, 1) == 7
    with pytest.raises(PrivacyError):
        share_count(3, 2, 1)


def test_a_lifetime_ledger_mixing_secure_pate_and_replace_one_dpsgd_has_an_accountant():
    """A hospital's lifetime ledger in a comparison holds both: PLD cannot take the secure sum's event, so the
    ledger is read by the split accountant: the smaller of PLD(DP-SGD) at δ/2 + RDP(secure) at δ/2 and rdp over
    both (the replace-one DP-SGD steps through the weak triangle, replace_one_sampled_gaussian_rdp)."""
    from privacy.accountants import PLDAccountant, RDPAccountant, replace_one_sampled_gaussian_rdp
    from privacy.events import SampledGaussianEvent

    sgd = SampledGaussianEvent(1 / 6, 1.1, 60, relation="replace-one")
    secure = ddg_event(IntegerGrid.for_rows(1.0, 32), 1e8, 2, 40)
    assert accountant_for([sgd, secure]).name == "split:pld+rdp"
    ledger = Ledger(None)
    ledger.record(["h0"], sgd, "round-1")
    ledger.record(["h0"], secure, "query-1")
    spent = ledger.spent("h0", 1e-5)
    assert spent.accountant == "split:pld+rdp"
    # the rdp reading of the union: the composed curve is the sum of the two curves, read with dp_accounting's improved conversion
    acc = RDPAccountant().compose(sgd)
    orders = acc._inner.orders
    expected = replace_one_sampled_gaussian_rdp(1 / 6, 1.1, 60, orders) + secure.rho * np.asarray(orders)
    np.testing.assert_allclose(acc._inner._rdp, replace_one_sampled_gaussian_rdp(1 / 6, 1.1, 60, orders))
    acc.compose(secure)
    np.testing.assert_allclose(acc._inner._rdp, expected)
    split = PLDAccountant().compose(sgd).get_epsilon(5e-6) + RDPAccountant().compose(secure).get_epsilon(5e-6)
    assert spent.epsilon == pytest.approx(min(split, acc.get_epsilon(1e-5)))
    assert spent.epsilon >= PLDAccountant().compose(sgd).get_epsilon(1e-5)
