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


def _charge_in_thread(charge, seconds=20.0):
    """Run ``charge`` in a daemon thread: a lock that waits for itself fails the test instead of hanging it."""
    import threading

    outcome = {}

    def run():
        try:
            charge()
            outcome["done"] = True
        except BaseException as exc:   # reported to the test below
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the charge still waits for a lock after 20 s (it locks one file twice)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome


def test_a_chain_over_two_paths_naming_one_ledger_takes_its_lock_once(tmp_path):
    from privacy.guard import GuardChain

    lifetime_path = tmp_path / "privacy-ledger.jsonl"
    aliased = tmp_path / "x" / ".." / "privacy-ledger.jsonl"     # another path, the same file
    lifetime, run = Ledger(lifetime_path), Ledger(aliased)
    chain = GuardChain(BudgetGuard(run, 8.0, 1e-3), [(BudgetGuard(lifetime, {"h0": 8.0}, 1e-3), ["h0"])])
    event = GaussianEvent(1.0, 2.0)
    _charge_in_thread(lambda: chain.charge(["h0"], event, "round-0@n"))
    assert lifetime.lock_identity() == run.lock_identity() and lifetime.lock_path != run.lock_path
    # one file: the release is written once and both views count it once
    assert len(Ledger.load(lifetime_path)) == 1
    assert lifetime.has_release("round-0@n") and run.has_release("round-0@n")
    # and the chain still refuses past the budget (the shared file is re-read under the one lock)
    with pytest.raises(BudgetExceeded):
        _charge_in_thread(lambda: chain.charge(["h0"], GaussianEvent(1.0, 0.05), "round-1@n"))
    assert len(Ledger.load(lifetime_path)) == 1


def test_two_ledger_objects_on_one_file_share_its_lock_in_one_thread(tmp_path):
    first, second = Ledger(tmp_path / "l.jsonl"), Ledger(tmp_path / "l.jsonl")

    def nested():
        with first.exclusive():
            second.record(["h0"], GaussianEvent(1.0, 2.0), "r")   # would wait for the first's flock forever
            # what the other object appended under the same lock is read before this one writes: nothing cut
            first.record(["h0"], GaussianEvent(1.0, 3.0), "s")
            first.record(["h0"], GaussianEvent(1.0, 2.0), "r")   # a repeat of the other's record: merged
    _charge_in_thread(nested)
    assert [r["release_id"] for r in Ledger.load(tmp_path / "l.jsonl").records()] == ["r", "s"]
    assert second.refresh() == 1 and len(first) == len(second) == 2
