"""Accountants: golden values, agreement of exact GDP with dp_accounting's PLD, zCDP/basic rules."""

import math

import numpy as np
import pytest
from scipy import stats

from privacy.accountants import (
    GaussianGDPAccountant,
    PLDAccountant,
    PureDPAccountant,
    RDPAccountant,
    ZCDPAccountant,
    accountant_for,
    epsilon_spent,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    make_accountant,
    zcdp_epsilon,
)
from privacy.errors import PrivacyError, UnsupportedEvent
from privacy.events import (
    ComposedEvent,
    GaussianEvent,
    LaplaceEvent,
    PureDPEvent,
    SampledGaussianEvent,
    ZCDPEvent,
)


# ------------------------------------------------------------------ golden values (reference values)

def test_gdp_golden_pate_setting():
    event = GaussianEvent(0.25, 1.0733, 80)
    assert gdp_mu([event]) == pytest.approx(2.0833, abs=1e-4)
    assert gdp_epsilon(2.0833, 1e-3) == pytest.approx(8.0, abs=1e-3)


def test_sampled_gaussian_golden_pld_and_rdp():
    event = SampledGaussianEvent(0.01, 1.0, 1000)
    pld = PLDAccountant().compose(event).get_epsilon(1e-5)
    rdp = RDPAccountant().compose(event).get_epsilon(1e-5)
    assert pld == pytest.approx(1.83, abs=0.01)
    assert rdp == pytest.approx(2.10, abs=0.01)
    assert pld < rdp  # PLD is tighter than RDP's conversion


def test_opacus_golden_value_honestly():
    """Opacus' own test value is 7.3291 (σ=1.5, q=0.04, 2250 steps, δ=1e-5).

    dp_accounting's RdpAccountant gives 7.32933: the same conversion and the same optimal order (3.9), but its
    fractional-order RDP of the sampled Gaussian differs from Opacus' in the 5th digit (integer orders agree
    to 1e-12). We assert both numbers, and that the difference is only that.
    """
    from dp_accounting.rdp import rdp_privacy_accountant as dpa
    from opacus.accountants.analysis import rdp as opacus_rdp

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    opacus_eps, opacus_order = opacus_rdp.get_privacy_spent(
        orders=orders, rdp=opacus_rdp.compute_rdp(q=0.04, noise_multiplier=1.5, steps=2250, orders=orders), delta=1e-5
    )
    assert opacus_eps == pytest.approx(7.3291, abs=1e-4)
    ours = RDPAccountant(orders=orders).compose(SampledGaussianEvent(0.04, 1.5, 2250)).get_epsilon(1e-5)
    assert ours == pytest.approx(7.3293, abs=1e-4)
    assert abs(ours - opacus_eps) < 5e-4
    assert ours == pytest.approx(RDPAccountant().compose(SampledGaussianEvent(0.04, 1.5, 2250)).get_epsilon(1e-5))
    for order in (2, 4, 8, 32):
        a = opacus_rdp.compute_rdp(q=0.04, noise_multiplier=1.5, steps=1, orders=[order])[0]
        b = dpa._compute_rdp_poisson_subsampled_gaussian(0.04, 1.5, [order])[0]
        assert a == pytest.approx(b, rel=1e-12)
    assert opacus_order == 3.9


# ------------------------------------------------------------------ exact GDP vs dp_accounting PLD

@pytest.mark.parametrize("interval, settings", [(1e-3, 24), (1e-4, 4)])
def test_gdp_agrees_with_pld_on_random_settings(interval, settings):
    """Exact GDP vs dp_accounting PLD (pessimistic): PLD ≥ exact, and within the grid's tolerance."""
    rng = np.random.default_rng(2024)
    checked = 0
    while checked < settings:
        sigma = float(rng.uniform(0.5, 5.0))
        count = int(rng.integers(1, 200))
        sens = float(rng.uniform(0.05, 2.0))
        delta = float(10 ** rng.uniform(-7, -2))
        event = GaussianEvent(sens, sigma, count)
        if not 0.1 <= event.mu <= 6:  # the range calibrations use (ε up to ~40); keeps the PLD grid small
            continue
        checked += 1
        exact = GaussianGDPAccountant().compose(event).get_epsilon(delta)
        pld_acc = PLDAccountant(value_discretization_interval=interval).compose(event)
        pld = pld_acc.get_epsilon(delta)
        assert pld >= exact - 1e-9, (sigma, count, sens, delta)  # PLD is pessimistic
        assert pld - exact <= interval * (1 + exact), (sigma, count, sens, delta, exact, pld)
        eps = max(exact, 0.1)  # and δ(ε) agrees too
        assert pld_acc.get_delta(eps) == pytest.approx(gdp_delta(event.mu, eps), rel=0.02, abs=1e-9)


def test_gdp_heterogeneous_composition_equals_single_mu():
    events = [GaussianEvent(0.25, 1.0), GaussianEvent(2 / 7, 1.0, 3), GaussianEvent(0.2, 0.8, 5)]
    mu = math.sqrt(0.25**2 + 3 * (2 / 7) ** 2 + 5 * (0.2 / 0.8) ** 2)
    assert gdp_mu(events) == pytest.approx(mu)
    acc = GaussianGDPAccountant()
    for event in events:
        acc.compose(event)
    assert acc.get_epsilon(1e-3) == pytest.approx(gdp_epsilon(mu, 1e-3))
    pld = PLDAccountant()
    for event in events:
        pld.compose(event)
    assert pld.get_epsilon(1e-3) == pytest.approx(acc.get_epsilon(1e-3), abs=3e-3)


def test_gdp_delta_matches_direct_formula_and_is_stable():
    for mu, eps in [(0.5, 0.3), (2.0, 1.0), (2.0833, 8.0), (5.0, 10.0)]:
        direct = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        assert gdp_delta(mu, eps) == pytest.approx(direct, rel=1e-9, abs=1e-300)
    # large ε: the naive formula cancels (e^ε·Φ(...) vs Φ(...)); ours matches 50-digit arithmetic
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    for mu, eps in [(1.0, 20.0), (2.0, 30.0), (5.0, 60.0), (0.5, 8.0)]:
        exact = mpmath.ncdf(-eps / mu + mu / 2) - mpmath.e**eps * mpmath.ncdf(-eps / mu - mu / 2)
        assert gdp_delta(mu, eps) == pytest.approx(float(exact), rel=1e-8)
        naive = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
        assert gdp_delta(mu, eps) > 0 or naive <= 0
    assert gdp_delta(1.0, 40.0) == 0.0  # true value 3.9e-343 underflows double precision: 0 is correct


def test_gdp_epsilon_inverts_delta():
    for mu in (0.3, 1.0, 2.0833, 6.0):
        for delta in (1e-2, 1e-5, 1e-9):
            eps = gdp_epsilon(mu, delta)
            assert gdp_delta(mu, eps) <= delta
            if eps > 0:
                assert gdp_delta(mu, eps * (1 - 1e-6) - 1e-12) > delta * (1 - 1e-3)


# ------------------------------------------------------------------ zCDP, basic, selection

def test_zcdp_shuffled_epochs_formula():
    acc = ZCDPAccountant()
    acc.compose(ZCDPEvent.shuffled_epochs(2.0, 3)).compose(ZCDPEvent.shuffled_epochs(1.0, 1))
    rho = 3 / 8 + 1 / 2
    assert acc.rho == pytest.approx(rho)
    assert acc.get_epsilon(1e-5) == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)))
    assert acc.get_delta(acc.get_epsilon(1e-5)) == pytest.approx(1e-5)


def test_zcdp_refuses_poisson_and_leaves_state_unchanged():
    acc = ZCDPAccountant().compose(ZCDPEvent(0.2))
    before = (acc.rho, list(acc.events))
    with pytest.raises(UnsupportedEvent, match="Poisson"):
        acc.compose(SampledGaussianEvent(0.01, 1.0, 10))
    with pytest.raises(UnsupportedEvent):
        acc.compose(ComposedEvent((ZCDPEvent(0.1), SampledGaussianEvent(0.01, 1.0, 10))))
    assert (acc.rho, acc.events) == before
    assert not acc.supports(SampledGaussianEvent(0.01, 1.0))


def test_zcdp_converts_gaussian_and_pure():
    acc = ZCDPAccountant().compose(GaussianEvent(0.5, 2.0, 4)).compose(PureDPEvent(0.2))
    assert acc.rho == pytest.approx(4 * 0.25**2 / 2 + 0.02)


def test_rejected_events_leave_state_unchanged():
    gdp = GaussianGDPAccountant().compose(GaussianEvent(1.0, 2.0))
    with pytest.raises(UnsupportedEvent):
        gdp.compose(ComposedEvent((GaussianEvent(1.0, 1.0), LaplaceEvent(1.0, 1.0))))
    assert gdp.mu == pytest.approx(0.5)
    pld = PLDAccountant().compose(GaussianEvent(1.0, 2.0))
    eps = pld.get_epsilon(1e-5)
    with pytest.raises(UnsupportedEvent):
        pld.compose(ComposedEvent((GaussianEvent(1.0, 1.0), ZCDPEvent(0.1, relation="replace-one"))))
    assert pld.get_epsilon(1e-5) == eps and len(pld.events) == 1


def test_basic_composition():
    acc = PureDPAccountant().compose(LaplaceEvent(2.0, 4.0, 3)).compose(PureDPEvent(0.25))
    assert acc.get_epsilon(1e-5) == pytest.approx(1.75)
    assert acc.get_delta(1.75) == 0.0 and acc.get_delta(1.0) == 1.0


def test_laplace_pld_and_rdp_match_basic_for_one_release():
    event = LaplaceEvent(1.0, 2.0)  # 0.5-DP
    assert PLDAccountant().compose(event).get_epsilon(1e-9) == pytest.approx(0.5, abs=1e-3)
    # RDP of the Laplace mechanism converted back to (ε, δ) is valid but a little loose
    assert 0.5 <= RDPAccountant().compose(event).get_epsilon(1e-9) <= 0.55


def test_accountant_for_picks_the_tightest():
    assert accountant_for([GaussianEvent(1, 2), GaussianEvent(1, 3, 4)]).name == "gdp-exact"
    assert accountant_for([LaplaceEvent(1, 2), PureDPEvent(1.0)]).name == "basic"
    assert accountant_for([ZCDPEvent(0.1), GaussianEvent(1, 2, relation="add-remove")]).name == "zcdp"
    assert accountant_for([SampledGaussianEvent(0.1, 1.0)]).name == "pld"
    assert accountant_for([GaussianEvent(1, 2), LaplaceEvent(1, 2)]).name == "pld"
    assert accountant_for([GaussianEvent(1, 2), PureDPEvent(1.0)]).name == "zcdp"
    # shuffled epochs (zCDP) plus Poisson steps: zcdp refuses the Poisson part, RDP composes both exactly
    assert accountant_for([ZCDPEvent(0.1), SampledGaussianEvent(0.1, 1.0)]).name == "rdp"
    with pytest.raises(UnsupportedEvent):
        accountant_for([ZCDPEvent(0.1), PureDPEvent(1.0, relation="add-remove"), SampledGaussianEvent(0.1, 1.0)])


def test_epsilon_spent_and_names():
    eps, name = epsilon_spent([GaussianEvent(0.25, 1.0733, 80)], 1e-3)
    assert name == "gdp-exact" and eps == pytest.approx(8.0, abs=1e-3)
    eps_rdp, name = epsilon_spent([GaussianEvent(0.25, 1.0733, 80)], 1e-3, accountant="rdp")
    assert name == "rdp" and eps_rdp > eps
    assert epsilon_spent([], 1e-3) == (0.0, "gdp-exact")
    with pytest.raises(PrivacyError, match="accountant"):
        make_accountant("moments")
    with pytest.raises(PrivacyError, match="delta"):
        GaussianGDPAccountant().compose(GaussianEvent(1, 1)).get_epsilon(0.0)


def test_zcdp_epsilon_function():
    assert zcdp_epsilon(0.5, 1e-3) == pytest.approx(0.5 + 2 * math.sqrt(0.5 * math.log(1e3)))


# ------------------------------------------------------------------ replace-one DP-SGD

# z that makes q = 1/9, 90 steps, δ = 1e-3 cost exactly ε = 8 and ε = 1 under add/remove: computed with
# dp_accounting directly (mechanism_calibration.calibrate_dp_mechanism, PLD ADD_OR_REMOVE_ONE, grid 1e-4,
# tol 1e-6), as the demo's DP-SGD cells calibrate them.
DEMO_Z = {8.0: 0.7987086695279885, 1.0: 2.89144950957031}


def _dp_accounting_pld(q, z, steps, delta, relation):
    import dp_accounting
    from dp_accounting.privacy_accountant import NeighboringRelation

    acc = dp_accounting.pld.PLDAccountant(getattr(NeighboringRelation, relation), value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("nominal, replace_one", [(8.0, 11.74), (1.0, 2.12)])
def test_replace_one_dpsgd_golden_values(nominal, replace_one):
    """The demo's add/remove ε = 8 (1) DP-SGD spends ε ≈ 11.7 (2.1) under replace-one."""
    z = DEMO_Z[nominal]
    ours = PLDAccountant().compose(SampledGaussianEvent(1 / 9, z, 90, relation="replace-one")).get_epsilon(1e-3)
    assert ours == pytest.approx(_dp_accounting_pld(1 / 9, z, 90, 1e-3, "REPLACE_ONE"), rel=1e-9)
    assert ours == pytest.approx(replace_one, abs=0.01)
    # the same mechanism under add/remove is the nominal budget
    assert PLDAccountant().compose(SampledGaussianEvent(1 / 9, z, 90)).get_epsilon(1e-3) == pytest.approx(
        nominal, abs=1e-3)
    assert accountant_for([SampledGaussianEvent(1 / 9, z, 90, relation="replace-one")]).name == "pld"


@pytest.mark.parametrize("interval, settings", [(1e-3, 12), (1e-4, 3)])
def test_gdp_agrees_with_pld_under_replace_one(interval, settings):
    """A replace-one Gaussian (explicit S = 2C/K) in a REPLACE_ONE dp_accounting PLD: the wrapper passes S/2 as
    the norm bound that REPLACE_ONE doubles, so ε matches exact GDP (a doubled S would give μ twice as big)."""
    rng = np.random.default_rng(15)
    checked = 0
    while checked < settings:
        sigma, count = float(rng.uniform(0.5, 5.0)), int(rng.integers(1, 200))
        sens, delta = float(rng.uniform(0.05, 2.0)), float(10 ** rng.uniform(-7, -2))
        event = GaussianEvent(sens, sigma, count)
        if not 0.1 <= event.mu <= 6:
            continue
        checked += 1
        exact = GaussianGDPAccountant().compose(event).get_epsilon(delta)
        pld = PLDAccountant(interval, neighboring_relation="replace-one").compose(event)
        assert pld._inner_relation == "replace-one"
        assert exact - 1e-9 <= pld.get_epsilon(delta) <= exact + interval * (1 + exact), (sigma, count, sens, delta)


def test_owner_with_pate_and_replace_one_dpsgd_composes_with_pld():
    """One owner: PATE queries (replace-one Gaussians, S = 2/K) then replace-one DP-SGD. PLD composes them;
    the result matches composing dp_accounting's PLDs directly (explicit-sensitivity Gaussian ∘ REPLACE_ONE
    sampled Gaussian), lies between each part alone and their basic composition, and does not depend on
    the order in which the ledger saw them."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.privacy_accountant import NeighboringRelation

    from privacy.ledger import Ledger

    delta, z = 1e-3, DEMO_Z[1.0]
    pate, sgd = GaussianEvent(0.25, 1.0733, 80), SampledGaussianEvent(1 / 9, z, 90, relation="replace-one")
    ledger = Ledger(None)
    ledger.record(["h1"], pate, "pate:query-batch")
    assert ledger.spent("h1", delta).accountant == "gdp-exact"
    ledger.record(["h1"], sgd, "dpsgd:epochs")
    both = ledger.spent("h1", delta)
    assert (both.accountant, both.relation, both.releases) == ("pld", "replace-one", 2)

    direct = (pld_lib.from_gaussian_mechanism(1.0733, sensitivity=0.25, value_discretization_interval=1e-4)
              .self_compose(80)
              .compose(pld_lib.from_gaussian_mechanism(z, sampling_prob=1 / 9, value_discretization_interval=1e-4,
                                                      neighboring_relation=NeighboringRelation.REPLACE_ONE)
                       .self_compose(90)))
    assert both.epsilon == pytest.approx(direct.get_epsilon_for_delta(delta), rel=1e-6)
    assert both.epsilon == pytest.approx(8.6307, abs=1e-3)

    alone_pate = GaussianGDPAccountant().compose(pate)
    alone_sgd = PLDAccountant().compose(sgd)
    assert both.epsilon >= max(alone_pate.get_epsilon(delta), alone_sgd.get_epsilon(delta))
    # (ε1, δ/2) ∘ (ε2, δ/2) is (ε1 + ε2, δ): basic composition is the ceiling
    assert both.epsilon <= alone_pate.get_epsilon(delta / 2) + alone_sgd.get_epsilon(delta / 2)
    reverse = PLDAccountant().compose(sgd).compose(pate)
    assert reverse.get_epsilon(delta) == pytest.approx(both.epsilon, rel=1e-9)


def test_replace_one_poisson_is_exact_in_pld_only_and_refusals_change_nothing():
    sgd = SampledGaussianEvent(0.1, 1.0, 5, relation="replace-one")
    for acc in (ZCDPAccountant(),):
        with pytest.raises(UnsupportedEvent, match="pld"):
            acc.compose(sgd)
        assert acc.events == [] and acc.relation is None
    # rdp takes it through the weak triangle inequality: valid, never tighter than the exact PLD
    assert RDPAccountant().compose(sgd).get_epsilon(1e-5) >= PLDAccountant().compose(sgd).get_epsilon(1e-5)
    # Laplace has no REPLACE_ONE PLD in dp_accounting: it cannot join replace-one Poisson events (either order)
    held = PLDAccountant().compose(LaplaceEvent(1.0, 2.0))
    eps = held.get_epsilon(1e-5)
    with pytest.raises(UnsupportedEvent, match="REPLACE_ONE"):
        held.compose(sgd)
    assert held.get_epsilon(1e-5) == eps and held._inner_relation == "add-remove" and len(held.events) == 1
    with pytest.raises(UnsupportedEvent, match="REPLACE_ONE"):
        PLDAccountant().compose(sgd).compose(LaplaceEvent(1.0, 2.0))


def test_an_accountant_accounts_one_relation():
    acc = PLDAccountant().compose(SampledGaussianEvent(0.1, 1.0, 5))
    with pytest.raises(PrivacyError, match="relation"):
        acc.compose(SampledGaussianEvent(0.1, 1.0, 5, relation="replace-one"))
    with pytest.raises(PrivacyError, match="relation"):
        GaussianGDPAccountant().compose(GaussianEvent(1, 2)).compose(GaussianEvent(1, 2, relation="add-remove"))
    assert len(acc.events) == 1 and acc.relation == "add-remove"


def test_epsilon_under_the_other_relation():
    from privacy.accountants import epsilon_under

    events = [SampledGaussianEvent(1 / 9, DEMO_Z[1.0], 45, relation="replace-one")] * 2
    add_remove, name = epsilon_under(events, 1e-3, "add-remove")
    assert name == "pld" and add_remove == pytest.approx(1.0, abs=1e-3)
    assert epsilon_under(events, 1e-3, "replace-one")[0] == pytest.approx(2.12, abs=0.01)
    assert epsilon_under([GaussianEvent(0.25, 1.0)], 1e-3, "add-remove") is None  # S was derived for replace-one
    assert epsilon_under([], 1e-3, "add-remove") is None
    from privacy.accountants import epsilon_per_relation

    both = epsilon_per_relation(events, 1e-3, "replace-one", 2.1208)
    assert both["epsilon_replace_one"] == 2.1208 and both["epsilon_add_remove"] == pytest.approx(add_remove)
    adaptive = [SampledGaussianEvent(0.1, 2.0, 5, adaptive=True)]
    assert epsilon_per_relation(adaptive, 1e-3, "add-remove", 1.0) == {  # no filter for replace-one Poisson
        "epsilon_add_remove": 1.0, "epsilon_replace_one": None}


# ------------------------------------------------------------------ adaptively chosen events: privacy filters

def test_adaptive_events_get_a_filter_valid_accountant():
    from privacy.accountants import FILTER_ACCOUNTANTS, RDPFilterAccountant

    adaptive = SampledGaussianEvent(0.1, 1.0, 10, adaptive=True)
    fixed = SampledGaussianEvent(0.1, 1.5, 10)
    assert accountant_for([fixed]).name == "pld"
    assert accountant_for([fixed, adaptive]).name == "rdp-filter"  # one adaptive event: a filter for all
    assert accountant_for([ZCDPEvent.shuffled_epochs(2.0, 1, "replace-one", adaptive=True)]).name == "zcdp"
    assert accountant_for([GaussianEvent(0.25, 1.0, adaptive=True)]).name == "gdp-exact"
    for acc in (PLDAccountant(), RDPAccountant()):
        with pytest.raises(UnsupportedEvent, match="filter"):
            acc.compose(adaptive)
    with pytest.raises(UnsupportedEvent, match="filter"):
        accountant_for([SampledGaussianEvent(0.1, 1.0, 10, relation="replace-one", adaptive=True)])
    assert all(make_accountant(name).filter_valid for name in FILTER_ACCOUNTANTS)
    assert not PLDAccountant.filter_valid and not RDPAccountant.filter_valid
    assert isinstance(make_accountant("rdp-filter"), RDPFilterAccountant)


def dp_accounting_sampled(q, z):
    import dp_accounting

    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))


def test_rdp_filter_epsilon_is_the_union_bound_over_its_orders():
    """ε = min over the filter's orders of the improved conversion (Balle et al. 2020, Prop. 12) at δ/|Λ|,
    checked against dp_accounting's own conversion; it is above the ordinary RDP ε (the price of validity
    under adaptive choices) and get_delta inverts it."""
    from dp_accounting.rdp import rdp_privacy_accountant as dpa

    from privacy.accountants import FILTER_RDP_ORDERS, RDPFilterAccountant

    events = [SampledGaussianEvent(1 / 9, s, 9, adaptive=True) for s in (1.2, 1.1, 1.0, 0.9)]
    acc = RDPFilterAccountant()
    for event in events:
        acc.compose(event)
    direct = dpa.RdpAccountant(orders=FILTER_RDP_ORDERS)
    for s in (1.2, 1.1, 1.0, 0.9):
        direct.compose(dp_accounting_sampled(1 / 9, s), 9)
    delta = 1e-3
    expected, _ = dpa.compute_epsilon(FILTER_RDP_ORDERS, direct._rdp, delta / len(FILTER_RDP_ORDERS))
    assert acc.get_epsilon(delta) == pytest.approx(expected, rel=1e-9)
    plain = RDPAccountant(orders=FILTER_RDP_ORDERS)
    for event in events:
        plain.compose(SampledGaussianEvent(event.sampling_rate, event.noise_multiplier, event.steps))
    assert acc.get_epsilon(delta) > plain.get_epsilon(delta)
    assert acc.get_delta(acc.get_epsilon(delta)) == pytest.approx(delta, rel=1e-6)


def test_guard_checks_adaptive_events_with_the_filter():
    """A budget the PLD of a fixed event fits is refused for the same event chosen adaptively."""
    from privacy.accountants import RDPFilterAccountant
    from privacy.errors import BudgetExceeded
    from privacy.guard import BudgetGuard
    from privacy.ledger import Ledger

    fixed, adaptive = SampledGaussianEvent(1 / 9, 1.0, 90), SampledGaussianEvent(1 / 9, 1.0, 90, adaptive=True)
    pld = PLDAccountant().compose(fixed).get_epsilon(1e-3)
    filt = RDPFilterAccountant().compose(adaptive).get_epsilon(1e-3)
    assert pld < 6.0 < filt
    guard = BudgetGuard(Ledger(None), 6.0, 1e-3)
    guard.charge(["h"], fixed, "fixed")
    guard2 = BudgetGuard(Ledger(None), 6.0, 1e-3)
    with pytest.raises(BudgetExceeded, match="rdp-filter"):
        guard2.charge(["h"], adaptive, "adaptive")
    assert len(guard2.ledger) == 0
    spent = guard.ledger.spent("h", 1e-3, extra=[SampledGaussianEvent(1 / 9, 5.0, 1, adaptive=True)])
    assert spent.accountant == "rdp-filter"


def test_identical_events_compose_as_one_self_composition_with_the_same_epsilon():
    """compose_all groups equal events (dp_accounting's count): same ε as composing them one by one,
    and a batch that mixes relations is still refused."""
    from privacy.accountants import make_accountant
    from privacy.errors import PrivacyError
    from privacy.events import GaussianEvent, SampledGaussianEvent

    events = ([GaussianEvent(sensitivity=0.1, sigma=0.5)] * 30
              + [SampledGaussianEvent(0.2, 1.5, 5, relation="replace-one")] * 10
              + [GaussianEvent(sensitivity=0.1, sigma=0.5)] * 5)
    one_by_one = make_accountant("pld")
    for event in events:
        one_by_one.compose(event)
    grouped = make_accountant("pld").compose_all(events)
    assert len(grouped.events) == len(events)
    assert grouped.get_epsilon(1e-3) == pytest.approx(one_by_one.get_epsilon(1e-3), rel=1e-3)
    mixed = [SampledGaussianEvent(0.2, 1.5, 5, relation="replace-one"), SampledGaussianEvent(0.2, 1.5, 5)]
    with pytest.raises(PrivacyError):
        make_accountant("pld").compose_all(mixed)


def test_pld_accountant_reuses_an_events_pld_and_gets_dp_accountings_epsilon():
    """The PLD accountant builds each (event, count)'s PLD once (a guard charges the same DP-SGD epoch
    event to several ledgers, twice each); the ε is what plain dp_accounting gives for the same events."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    from privacy.accountants import pld as pld_module
    from privacy.accountants import make_accountant
    from privacy.events import GaussianEvent, LaplaceEvent, SampledGaussianEvent

    def dp_accounting_epsilon(events, relation):
        plain = pld_privacy_accountant.PLDAccountant(
            dp_accounting.privacy_accountant.NeighboringRelation.REPLACE_ONE if relation == "replace-one"
            else dp_accounting.privacy_accountant.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-4)
        for event in events:
            plain.compose(event.to_dp_accounting(relation))
        return plain.get_epsilon(1e-3)

    pld_module._event_plds.clear()
    replace_one = [SampledGaussianEvent(0.1, 0.9, 12, relation="replace-one")] * 3 + [
        GaussianEvent(sensitivity=0.2, sigma=1.0, relation="replace-one")]
    cached = make_accountant("pld")
    for event in replace_one:   # one at a time, as a guard charges them: the repeats hit the cache
        cached.compose(event)
    assert len(pld_module._event_plds) == 2
    assert cached.get_epsilon(1e-3) == pytest.approx(dp_accounting_epsilon(replace_one, "replace-one"), rel=1e-9)

    add_remove = [LaplaceEvent(sensitivity=1.0, scale=4.0, relation="add-remove"),
                  SampledGaussianEvent(0.05, 1.2, 40, relation="add-remove")] * 2
    again = make_accountant("pld")
    for event in add_remove:
        again.compose(event)
    assert again.get_epsilon(1e-3) == pytest.approx(dp_accounting_epsilon(add_remove, "add-remove"), rel=1e-9)
    # a different σ is a different PLD, never a cache hit
    louder = make_accountant("pld").compose(SampledGaussianEvent(0.1, 2.0, 12, relation="replace-one"))
    assert louder.get_epsilon(1e-3) < make_accountant("pld").compose(replace_one[0]).get_epsilon(1e-3)
