"""Budget guard: refuses before anything is written, names owner/spent/requested/budget."""

import pytest

from privacy.errors import BudgetExceeded, PrivacyError
from privacy.events import GaussianEvent, SampledGaussianEvent
from privacy.guard import BudgetGuard
from privacy.ledger import Ledger
from privacy.calibration import pate_sigma


def test_exact_calibration_fits_exactly_n_queries(tmp_path):
    sigma = pate_sigma(8.0, 1e-3, 80, 0.25)
    ledger = Ledger(tmp_path / "ledger.jsonl")
    guard = BudgetGuard(ledger, 8.0, 1e-3)
    for query in range(80):
        guard.charge(["hospital-1", "hospital-2"], GaussianEvent(0.25, sigma), f"query-{query}")
    assert ledger.spent("hospital-1", 1e-3).epsilon <= 8.0
    assert guard.remaining("hospital-1") < 8.0 * 1e-3
    before = (tmp_path / "ledger.jsonl").read_bytes()
    with pytest.raises(BudgetExceeded) as info:
        guard.charge(["hospital-1", "hospital-2"], GaussianEvent(0.25, sigma), "query-80")
    message = str(info.value)
    for piece in ("hospital-1", "budget 8.00", "already spent", "this release", "gdp-exact"):
        assert piece in message
    assert (tmp_path / "ledger.jsonl").read_bytes() == before  # byte-identical
    assert not ledger.has_release("query-80")


def test_per_owner_budgets_and_partial_owners(tmp_path):
    ledger = Ledger(tmp_path / "l.jsonl")
    guard = BudgetGuard(ledger, {"hospital-1": 8.0, "hospital-2": 1.0}, 1e-3)
    event = GaussianEvent(0.25, 1.0)  # μ = 0.25, ε ≈ 0.6 at δ = 1e-3
    guard.charge(["hospital-1", "hospital-2"], event, "a")
    before = (tmp_path / "l.jsonl").read_bytes()
    with pytest.raises(BudgetExceeded, match="hospital-2") as info:
        guard.check(["hospital-1", "hospital-2"], GaussianEvent(0.25, 0.25))
    assert "> budget 1.00" in str(info.value)
    assert (tmp_path / "l.jsonl").read_bytes() == before
    guard.charge(["hospital-1"], GaussianEvent(0.25, 0.25), "b")  # hospital-2 did not answer
    assert ledger.spent("hospital-2", 1e-3).releases == 1
    with pytest.raises(PrivacyError, match="no privacy budget"):
        guard.check(["hospital-3"], event)


def test_retry_of_recorded_release_is_free():
    ledger = Ledger()
    guard = BudgetGuard(ledger, 1.0, 1e-5)
    event = GaussianEvent(1.0, 6.0)
    guard.charge(["h"], event, "r")
    spent = ledger.spent("h", 1e-5).epsilon
    guard.charge(["h"], event, "r")
    assert ledger.spent("h", 1e-5).epsilon == spent and len(ledger) == 1


def test_guard_with_dpsgd_events_and_default_budget():
    ledger = Ledger()
    guard = BudgetGuard(ledger, {"*": 2.0}, 1e-5)
    guard.charge(["central"], SampledGaussianEvent(0.01, 1.0, 500), "epoch-0")
    with pytest.raises(BudgetExceeded, match="central.*accountant pld"):
        guard.check(["central"], SampledGaussianEvent(0.01, 1.0, 1000))


def test_guard_refuses_mixed_relations():
    ledger = Ledger()
    guard = BudgetGuard(ledger, 8.0, 1e-3)
    guard.charge(["h"], GaussianEvent(0.25, 1.0), "pate")
    with pytest.raises(PrivacyError, match="relation"):
        guard.charge(["h"], SampledGaussianEvent(0.01, 1.0, 10), "sgd")
    assert len(ledger) == 1


def test_invalid_budget_and_delta():
    with pytest.raises(PrivacyError, match="budget"):
        BudgetGuard(Ledger(), -1.0, 1e-3)
    with pytest.raises(PrivacyError, match="delta"):
        BudgetGuard(Ledger(), 1.0, 0.0)
