"""Noise schedules (Yu et al. Sec. IV-A): formulas, per-epoch events, budget stopping, decay planning."""

import math

import pytest

from privacy.accountants import epsilon_spent
from privacy.errors import PrivacyError
from privacy.events import SampledGaussianEvent, ZCDPEvent
from privacy.schedules import (
    EpochAccounting,
    ExponentialSchedule,
    PolynomialSchedule,
    StepSchedule,
    TimeBasedSchedule,
    ValidationSchedule,
    epochs_within_budget,
    make_schedule,
    plan_decay,
    schedule_epsilon,
    schedule_events,
)


def test_formulas():
    assert TimeBasedSchedule(2.0, 0.5).sigma(4) == pytest.approx(2.0 / 3)
    assert ExponentialSchedule(2.0, 0.1).sigma(3) == pytest.approx(2.0 * math.exp(-0.3))
    assert StepSchedule(2.0, 0.5, period=3).sigma(7) == pytest.approx(0.5)
    poly = PolynomialSchedule(3.0, 1.0, 2.0, period=4)
    assert poly.sigma(0) == 3.0 and poly.sigma(2) == pytest.approx(2 * 0.25 + 1)
    assert poly.sigma(4) == 1.0 and poly.sigma(100) == 1.0  # clamped at sigma_end after the period
    assert TimeBasedSchedule(2.0, 1.0, period=2).sigma(3) == pytest.approx(1.0)


def test_validation_schedule_rule():
    schedule = ValidationSchedule(4.0, 0.5, threshold=0.01, window=2, period=2)
    schedule.observe(0.30)
    schedule.observe(0.40)  # avg 0.35 > 0 + 0.01: keep 4.0
    assert schedule.sigma(2) == 4.0
    schedule.observe(0.45)
    schedule.observe(0.35)  # avg 0.40: +0.05 > 0.01: keep
    assert schedule.sigma(3) == 4.0
    schedule.observe(0.40)
    schedule.observe(0.405)  # avg 0.4025: +0.0025 <= 0.01: decay by k
    assert schedule.sigma(4) == 2.0
    with pytest.raises(PrivacyError, match="period"):
        ValidationSchedule(1.0, 0.5, window=3, period=2)


def test_invalid_parameters():
    with pytest.raises(PrivacyError, match="k"):
        StepSchedule(1.0, 1.5)
    with pytest.raises(PrivacyError, match="sigma_end"):
        PolynomialSchedule(1.0, 2.0, 1.0, 5)
    with pytest.raises(PrivacyError, match="mode"):
        schedule_events(TimeBasedSchedule(1.0, 0.1), 3, 0.1, 10, mode="sampled")
    with pytest.raises(PrivacyError, match="validation"):
        make_schedule("validation", 1.0, 0.5)


def test_schedule_events_match_batching():
    schedule = ExponentialSchedule(2.0, 0.1)
    poisson = schedule_events(schedule, 3, 0.05, 20, mode="poisson")
    assert poisson == [SampledGaussianEvent(0.05, schedule.sigma(t), 20) for t in range(3)]
    shuffle = schedule_events(schedule, 3, 0.05, 20, mode="shuffle")
    assert [e.rho for e in shuffle] == pytest.approx([1 / (2 * schedule.sigma(t) ** 2) for t in range(3)])
    assert all(isinstance(e, ZCDPEvent) for e in shuffle)


def test_schedule_events_carry_the_relation():
    schedule = ExponentialSchedule(2.0, 0.1)
    shuffle = schedule_events(schedule, 3, 0.05, 20, mode="shuffle")
    assert {e.relation for e in shuffle} == {"zero-out"}  # Yu et al.'s 1/(2σ²) holds for zero-out adjacency
    replace = schedule_events(schedule, 3, 0.05, 20, mode="shuffle", relation="replace-one")
    assert [e.rho for e in replace] == pytest.approx([2 / schedule.sigma(t) ** 2 for t in range(3)])
    poisson = schedule_events(schedule, 2, 0.05, 20, relation="replace-one")
    assert poisson == [SampledGaussianEvent(0.05, schedule.sigma(t), 20, relation="replace-one") for t in range(2)]
    with pytest.raises(PrivacyError, match="zero-out"):
        schedule_events(schedule, 1, 0.05, 20, mode="shuffle", relation="add-remove")


def test_plan_decay_shuffle_under_replace_one():
    k = plan_decay("exponential", 6.0, 10, 6.0, 1e-5, EpochAccounting(mode="shuffle", relation="replace-one"))
    schedule = make_schedule("exponential", 6.0, k)
    eps = schedule_epsilon(schedule, 10, 1e-5, EpochAccounting(1.0, 1, mode="shuffle", relation="replace-one"))
    assert 6.0 * (1 - 1e-3) <= eps <= 6.0
    # the same σ_t under zero-out spend a quarter of the ρ: far less than the budget
    assert schedule_epsilon(schedule, 10, 1e-5, EpochAccounting(1.0, 1, mode="shuffle")) < 3.0


def test_epochs_within_budget_shuffle_constant_matches_closed_form():
    # constant σ: E epochs give ρ = E/(2σ²); the number that fits is the largest E with ε(ρ) ≤ budget
    sigma, eps, delta = 3.0, 4.0, 1e-5
    fit = epochs_within_budget(TimeBasedSchedule(sigma, 0.0), eps, delta, EpochAccounting(1.0, 1, mode="shuffle"))
    rho_max = (math.sqrt(math.log(1 / delta) + eps) - math.sqrt(math.log(1 / delta))) ** 2
    assert fit == math.floor(rho_max * 2 * sigma**2)
    assert epochs_within_budget(TimeBasedSchedule(sigma, 0.0), eps, delta, EpochAccounting(1.0, 1, mode="shuffle"),
                                max_epochs=3) == 3


@pytest.mark.parametrize("family, extra", [
    ("time", {}), ("exponential", {}), ("step", {"period": 2}), ("polynomial", {"sigma_end": 0.8, "period": 12}),
])
def test_plan_decay_shuffle_fits_exactly_target(family, extra):
    k = plan_decay(family, 3.0, 10, 6.0, 1e-5, EpochAccounting(mode="shuffle"), **extra)
    schedule = make_schedule(family, 3.0, k, **extra)
    eps = schedule_epsilon(schedule, 10, 1e-5, EpochAccounting(1.0, 1, mode="shuffle"))
    assert 6.0 * (1 - 1e-3) <= eps <= 6.0
    assert epochs_within_budget(schedule, 6.0, 1e-5, EpochAccounting(1.0, 1, mode="shuffle")) == 10


def test_plan_decay_poisson_rdp():
    k = plan_decay("exponential", 1.5, 4, 3.0, 1e-5,
                   EpochAccounting(sampling_rate=0.05, steps_per_epoch=20, mode="poisson", accountant="rdp"))
    schedule = ExponentialSchedule(1.5, k)
    events = schedule_events(schedule, 4, 0.05, 20)
    eps = epsilon_spent(events, 1e-5, "rdp")[0]
    assert 3.0 * (1 - 1e-3) <= eps <= 3.0
    assert epochs_within_budget(schedule, 3.0, 1e-5, EpochAccounting(0.05, 20, accountant="rdp")) == 4


def test_plan_decay_impossible():
    with pytest.raises(PrivacyError, match="constant"):
        plan_decay("time", 0.5, 50, 1.0, 1e-5, EpochAccounting(mode="shuffle"))
    with pytest.raises(PrivacyError, match="sigma_end"):
        plan_decay("polynomial", 30.0, 3, 8.0, 1e-5, EpochAccounting(mode="shuffle"), sigma_end=20.0, period=3)
