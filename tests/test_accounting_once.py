"""Accounting once: a σ calibration is memoised on disk (keyed by every input and the accounting code's version,
written atomically), and a run whose charges follow its verified plan is not composed again at every charge -- while
the guard still refuses whatever would exceed a budget, and a ledger that leaves the plan is composed in full."""

import json

import pytest
import torch

from privacy import calibration
from privacy.accountants import epsilon_spent
from privacy.errors import BudgetExceeded
from privacy.events import GaussianEvent, SampledGaussianEvent
from privacy.guard import BudgetGuard, GuardChain
from privacy.ledger import Ledger
from task.learning import accounting

DELTA = 1e-5


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPATE_ACCOUNTING_CACHE", raising=False)
    return tmp_path / "cache" / "accounting"


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_a_calibration_is_computed_once_and_read_back_from_disk(cache, monkeypatch):
    calls = _counting(monkeypatch, calibration, "composed_dpsgd_noise_multiplier")
    ask = dict(accountant="rdp", relation="add-remove")
    first = accounting.dpsgd_noise_multiplier(4.0, DELTA, 0.25, 8, **ask)
    assert accounting.dpsgd_noise_multiplier(4.0, DELTA, 0.25, 8, **ask) == first and len(calls) == 1
    (stored,) = cache.glob("dpsgd-sigma-*.json")
    record = json.loads(stored.read_text())
    assert record["value"] == first and record["version"] == accounting.accounting_version()
    assert record["inputs"] == {"epsilon": 4.0, "delta": DELTA, "runs": [[0.25, 8]], "accountant": "rdp",
                                "relation": "add-remove", "value_discretization_interval": None}
    # what calibration promises: the target is met, on the safe side, within its tolerance
    spent = epsilon_spent([SampledGaussianEvent(0.25, first, 8, relation="add-remove")], DELTA, accountant="rdp")[0]
    assert 4.0 * (1 - calibration.RELATIVE_TOLERANCE) <= spent <= 4.0


def _counted(values):
    """A computation that returns the next of ``values`` and counts its calls (what the memo stores is its
    business; the memo's own logic is what these tests check)."""
    calls = []

    def compute():
        calls.append(1)
        return values[len(calls) - 1]
    return compute, calls


def test_every_input_and_the_code_version_are_in_the_key(cache, monkeypatch):
    compute, calls = _counted([1.0, 2.0, 3.0, 4.0])
    inputs = {"epsilon": 4.0, "runs": [[0.25, 8]]}
    assert accounting.memoised("kind", inputs, compute) == 1.0
    assert accounting.memoised("kind", dict(inputs), compute) == 1.0 and len(calls) == 1
    assert accounting.memoised("kind", {**inputs, "runs": [[0.25, 9]]}, compute) == 2.0
    assert accounting.memoised("other-kind", inputs, compute) == 3.0
    monkeypatch.setattr(accounting, "accounting_version", lambda: "another accounting code")
    assert accounting.memoised("kind", inputs, compute) == 4.0 and len(calls) == 4


def test_a_damaged_or_foreign_memo_is_recomputed_and_replaced(cache, monkeypatch):
    compute, calls = _counted([0.5, 0.5, 0.5, 0.5])
    inputs = {"epsilon": 4.0}
    accounting.memoised("kind", inputs, compute)
    (stored,) = cache.glob("kind-*.json")
    record = json.loads(stored.read_text())
    stored.write_text('{"value": 0.0')                                  # torn
    assert accounting.memoised("kind", inputs, compute) == 0.5 and len(calls) == 2
    assert json.loads(stored.read_text()) == record                     # rewritten whole
    stored.write_text(json.dumps({**record, "inputs": {"epsilon": 9.0}, "value": 0.01}))   # another input set's
    assert accounting.memoised("kind", inputs, compute) == 0.5 and len(calls) == 3
    monkeypatch.setenv("FEDPATE_ACCOUNTING_CACHE", "off")
    assert accounting.memoised("kind", inputs, compute) == 0.5 and len(calls) == 4


def _plan(count=4, sigma=2.0):
    return [GaussianEvent(1.0, sigma)] * count


def _composing_checks(monkeypatch):
    """Every composition a guard's check asks its ledger for (``Ledger.spent`` with hypothetical events)."""
    calls = []
    real = Ledger.spent

    def spent(self, owner, delta, relation=None, accountant=None, extra=()):
        if extra:
            calls.append((self, owner))
        return real(self, owner, delta, relation, accountant, extra)

    monkeypatch.setattr(Ledger, "spent", spent)
    return calls


def test_charges_along_a_verified_plan_compose_nothing_and_the_ledger_reports_the_plan(monkeypatch):
    plan = _plan()
    budget = epsilon_spent(plan, DELTA)[0] * 1.01
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, budget, DELTA)
    assert guard.expect(["h0", "h1"], plan) == ["h0", "h1"]
    composing = _composing_checks(monkeypatch)
    for index, event in enumerate(plan):
        guard.charge(["h0", "h1"], event, f"run:epoch-{index}")
    assert composing == []
    spent = ledger.spent("h0", DELTA)
    assert spent.releases == 4 and spent.epsilon == pytest.approx(epsilon_spent(plan, DELTA)[0], rel=1e-12)
    with pytest.raises(BudgetExceeded):            # past the plan: composed, and refused
        guard.charge(["h0"], plan[0], "run:epoch-4")
    assert len(composing) == 1 and len(ledger) == 4


def test_a_ledger_that_leaves_the_plan_is_composed_in_full_and_refused_past_the_budget(monkeypatch, tmp_path):
    plan = _plan()
    budget = epsilon_spent(plan, DELTA)[0] * 1.01
    ledger = Ledger(tmp_path / "ledger.jsonl")
    guard = BudgetGuard(ledger, budget, DELTA)
    assert guard.expect(["h0"], plan) == ["h0"]
    composing = _composing_checks(monkeypatch)
    for index in range(2):
        guard.charge(["h0"], plan[index], f"run:epoch-{index}")
    # another writer charges the same owner (a second process over the same file): the ledger leaves the plan
    Ledger(tmp_path / "ledger.jsonl").record(["h0"], GaussianEvent(1.0, 1.0), "elsewhere:query-0")
    assert composing == []
    with pytest.raises(BudgetExceeded, match="h0"):
        guard.charge(["h0"], plan[2], "run:epoch-2")   # the plan's third event no longer fits beside it
    assert len(composing) == 1 and not ledger.has_release("run:epoch-2")
    # an owner that held something else before the plan gets no plan at all
    other = Ledger(None)
    other.record(["h1"], GaussianEvent(1.0, 3.0), "before")
    assert BudgetGuard(other, budget, DELTA).expect(["h1"], plan) == []


def test_a_plan_that_exceeds_the_budget_is_not_trusted(monkeypatch):
    plan = _plan()
    budget = epsilon_spent(plan[:2], DELTA)[0] * 1.01        # two of the four events fit
    ledger = Ledger(None)
    guard = BudgetGuard(ledger, budget, DELTA)
    assert guard.expect(["h0"], plan) == [] and guard.plan_of("h0") is None
    guard.charge(["h0"], plan[0], "e0")
    guard.charge(["h0"], plan[1], "e1")
    with pytest.raises(BudgetExceeded):
        guard.charge(["h0"], plan[2], "e2")
    assert len(ledger) == 2


def test_lifetime_ledgers_still_compose_at_every_charge(monkeypatch):
    plan = _plan()
    run_ledger, lifetime = Ledger(None), Ledger(None)
    lifetime.record(["h0"], GaussianEvent(1.0, 5.0), "an-earlier-run")
    chain = GuardChain(BudgetGuard(run_ledger, 100.0, DELTA), [(BudgetGuard(lifetime, 100.0, DELTA), ["h0"])])
    assert chain.expect(["h0"], plan) == ["h0"] and chain.plan_of("h0") == tuple(plan)
    composing = _composing_checks(monkeypatch)
    for index, event in enumerate(plan):
        chain.charge(["h0"], event, f"run:epoch-{index}")
    assert [ledger for ledger, _ in composing] == [lifetime] * 4


def test_a_target_run_given_a_wrong_sigma_is_refused_by_its_guard(cache, monkeypatch):
    """A stale or tampered memo (here: the calibration answers sigma = 2, far too little for epsilon = 2) never makes
    a run overspend: the guard composes the plan, does not trust it, and refuses the first epoch."""
    from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining

    monkeypatch.setattr(calibration, "composed_dpsgd_noise_multiplier", lambda *args, **kwargs: 2.0)
    model = torch.nn.Linear(3, 2)
    dp = DPConfig(mode="target", epsilon=2.0, delta=DELTA, max_grad_norm=1.0)
    ledger = Ledger(None)
    session = DPSession(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        PrivateTraining(dp, BudgetGuard(ledger, 2.0, DELTA), owners=("h0",)), n=2, batch_size=2,
                        epochs=2)
    assert session.base_sigma == 2.0 and session.guard.plan_of("h0") is None
    with pytest.raises(BudgetExceeded):
        session.begin_epoch(0)
    assert len(ledger) == 0 and session.step_noise is None


def test_a_target_run_charges_its_plan_and_reports_the_ledgers_epsilon(cache, monkeypatch):
    from task.learning.dpsgd import DPConfig, DPSession, PrivateTraining, epoch_plan

    monkeypatch.setattr(calibration, "composed_dpsgd_noise_multiplier", lambda *args, **kwargs: 3.0)
    model = torch.nn.Linear(3, 2)
    dp = DPConfig(mode="target", epsilon=8.0, delta=DELTA, max_grad_norm=1.0)
    ledger = Ledger(None)
    session = DPSession(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        PrivateTraining(dp, BudgetGuard(ledger, 8.0, DELTA), owners=("h0", "h1")), n=4, batch_size=2,
                        epochs=2)
    plan = epoch_plan(dp, 4, 2, 2, 3.0)
    assert session.guard.plan_of("h0") == plan
    composing = _composing_checks(monkeypatch)
    for epoch in range(2):
        assert session.begin_epoch(epoch)
        assert (session.epoch_epsilon() is None) == (epoch == 0)   # known without composing only at the end
        session.end_epoch()
    assert composing == []
    assert session.spent(with_rdp=False)["epsilon"] == pytest.approx(epsilon_spent(list(plan), DELTA)[0], rel=1e-9)
