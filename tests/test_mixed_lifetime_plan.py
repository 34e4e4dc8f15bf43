"""A hospital's lifetime ledger that mixes secure-aggregation releases with DP-FedAvg's releases.

The distributed discrete Gaussian (Kairouz, Liu & Steinke 2021, arXiv 2102.06387) is accounted only by
``rdp``/``zcdp``; DP-FedAvg's replace-one Poisson-sampled Gaussians are calibrated with ``pld``. Their union
in one hospital's ledger is therefore read by ``rdp`` (weak triangle inequality for replace-one sampling),
which reads a DP-FedAvg cell calibrated to ε = 8 (PLD) far above 8 -- so such a union is read by the split
accountant instead (each family by its own accountant at δ/2, added up). The comparison's default lifetime budget
(:func:`planned_lifetime_epsilon`, the sum of the cells' budgets) must still cover what the hospital's
guard will compute for those very cells, or the second cell is refused for budget.
"""

from __future__ import annotations

import functools

import pytest

from privacy.accountants import accountant_for, epsilon_spent
from privacy.calibration import calibrate
from privacy.distributed import IntegerGrid, calibrate_local_variance, ddg_event
from privacy.events import SampledGaussianEvent
from sim.runners.compare import planned_lifetime_epsilon

DELTA = 1e-3          # the tiny preset's δ
EPSILON = 8.0
RATE, STEPS, EPOCHS = 1.0 / 9.0, 9, 8   # one tiny-preset DP-FedAvg cell: 8 epoch releases of 9 Poisson steps


@functools.lru_cache(maxsize=None)
def _dp_fedavg_cell(epsilon: float) -> tuple[SampledGaussianEvent, ...]:
    """The releases of a DP-FedAvg cell whose noise is calibrated to ``epsilon`` with PLD (as the cell does)."""
    def cell(z: float):
        return SampledGaussianEvent(sampling_rate=RATE, noise_multiplier=z, steps=STEPS * EPOCHS,
                                    relation="replace-one")
    z = calibrate(cell, epsilon, DELTA, "pld", 0.8, 1.2)
    return tuple(SampledGaussianEvent(sampling_rate=RATE, noise_multiplier=z, steps=STEPS, relation="replace-one")
                 for _ in range(EPOCHS))


def _secure_cell(epsilon: float) -> list:
    """The releases of a secure-aggregation PATE cell calibrated to ``epsilon`` (8 scans, 2 counted shares)."""
    grid = IntegerGrid.for_rows(1.0, 24)
    variance = calibrate_local_variance(epsilon, DELTA, 8, grid, 2)
    return [ddg_event(grid, variance, 2, 1) for _ in range(8)]


def test_each_cell_alone_meets_its_budget_with_its_own_accountant():
    fedavg, secure = list(_dp_fedavg_cell(EPSILON)), _secure_cell(EPSILON)
    assert epsilon_spent(fedavg, DELTA)[1] == "pld"
    assert epsilon_spent(fedavg, DELTA)[0] <= EPSILON
    assert epsilon_spent(secure, DELTA)[0] <= EPSILON
    assert accountant_for(fedavg + secure).name == "split:pld+rdp"   # no single tight accountant: split


def test_default_lifetime_plan_covers_a_mixed_ledger():
    planned = planned_lifetime_epsilon(["pate-anchored-secure", "dp-fedavg"], [EPSILON], 1, delta=DELTA)
    union, accountant = epsilon_spent(list(_dp_fedavg_cell(EPSILON)) + _secure_cell(EPSILON), DELTA)
    assert union <= planned, f"the hospital's guard reads ε={union:.2f} ({accountant}) > planned {planned:g}"


def test_a_mixed_ledger_is_read_by_the_split_accountant_far_below_rdp():
    from privacy.accountants import SplitDeltaAccountant, make_accountant

    fedavg, secure = list(_dp_fedavg_cell(EPSILON)), _secure_cell(EPSILON)
    union, name = epsilon_spent(fedavg + secure, DELTA)
    assert name == "split:pld+rdp" and isinstance(accountant_for(fedavg + secure), SplitDeltaAccountant)
    # basic composition of the two families at δ/2 each: exactly the sum of their own readings there
    halves = epsilon_spent(fedavg, DELTA / 2)[0] + epsilon_spent(secure, DELTA / 2)[0]
    assert union == pytest.approx(min(halves, epsilon_spent(fedavg + secure, DELTA, "rdp")[0]), rel=1e-9)
    assert union < 0.8 * epsilon_spent(fedavg + secure, DELTA, "rdp")[0]
    assert 2 * EPSILON < union < 2 * EPSILON + 1.5          # the δ split costs a little, not a factor
    # the order of the events does not matter, and the name rebuilds the same accountant (the ledger's cache)
    mixed = [e for pair in zip(fedavg, secure) for e in pair] + secure[len(fedavg):]
    assert make_accountant(name).compose_all(mixed).get_epsilon(DELTA) == pytest.approx(union, rel=1e-9)
    # get_delta inverts get_epsilon
    accountant = make_accountant(name).compose_all(fedavg + secure)
    assert accountant.get_epsilon(accountant.get_delta(union + 0.5)) <= union + 0.5 + 1e-6


def test_the_split_accountant_never_takes_adaptive_events_and_pure_ledgers_keep_their_accountant():
    from privacy.accountants import make_accountant
    from privacy.errors import UnsupportedEvent

    fedavg, secure = list(_dp_fedavg_cell(EPSILON)), _secure_cell(EPSILON)
    assert accountant_for(fedavg).name == "pld" and accountant_for(secure).name == "rdp"
    adaptive = SampledGaussianEvent(sampling_rate=RATE, noise_multiplier=2.0, steps=3, relation="add-remove",
                                    adaptive=True)
    with pytest.raises(UnsupportedEvent):
        make_accountant("split:pld+rdp").compose(adaptive)
    assert not accountant_for([adaptive] + [e.with_relation("add-remove") or e for e in secure]).name.startswith("split:")


def test_every_secure_sum_method_says_so_in_its_record():
    """The lifetime plan tells secure-sum cells from PLD-accounted ones by the method record; a secure method that
    forgot to say so would be planned at the full δ and cut short by the split accountant's δ/2 reading."""
    from task.settings import methods as registry

    secure = {name for name in registry.names() if registry.method(name).secure_sum}
    assert secure == {name for name in registry.names() if name.endswith("-secure")}
    assert planned_lifetime_epsilon(["dp-fedavg-secure", "dp-sgd-central"], [EPSILON], 1, delta=DELTA) > 2 * EPSILON
