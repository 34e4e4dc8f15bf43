"""A hospital's lifetime ledger that mixes secure-aggregation releases with DP-FedAvg's releases.

The distributed discrete Gaussian (Kairouz, Liu & Steinke 2021, arXiv 2102.06387) is accounted only by
``rdp``/``zcdp``; DP-FedAvg's replace-one Poisson-sampled Gaussians are calibrated with ``pld``. Their union
in one hospital's ledger is therefore read by ``rdp`` (weak triangle inequality for replace-one sampling),
which reads a DP-FedAvg cell calibrated to ε = 8 (PLD) far above 8. The comparison's default lifetime budget
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
    assert accountant_for(fedavg + secure).name == "rdp"   # the mixture falls back to rdp


@pytest.mark.xfail(strict=True, reason=(
    "known: the default lifetime plan sums the cells' budgets as each cell's own accountant reads them, but "
    "a ledger mixing secure-aggregation and DP-FedAvg releases is read by rdp, which reads the PLD-calibrated "
    "DP-FedAvg cell far above its budget; the hospitals' guards then refuse the later cell's releases part-way"))
def test_default_lifetime_plan_covers_a_mixed_ledger():
    planned = planned_lifetime_epsilon(["pate-anchored-secure", "dp-fedavg"], [EPSILON], 1)
    union, accountant = epsilon_spent(list(_dp_fedavg_cell(EPSILON)) + _secure_cell(EPSILON), DELTA)
    assert union <= planned, f"the hospital's guard reads ε={union:.2f} ({accountant}) > planned {planned:g}"
