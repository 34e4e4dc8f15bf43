"""Two writers on one ledger file: real processes, not two objects in one process.

(a) Two budget guards over one lifetime ledger, each opened before either charges, both try a release that
fits alone but not twice: exactly one may pass. (b) A writer appends committed records while another process
keeps opening the ledger (which cuts torn tails): no committed record may be lost.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

from privacy.calibration import pate_sigma
from privacy.errors import BudgetExceeded
from privacy.events import GaussianEvent
from privacy.guard import BudgetGuard, GuardChain
from privacy.ledger import Ledger

BUDGET = 8.0
DELTA = 1e-3
# one release of epsilon 6 at delta 1e-3: fits a budget of 8 once, not twice (two compose to mu = 2.3 > 2.08)
SIGMA_EPS6 = pate_sigma(6.0, DELTA, 1, 1.0)


def _race_charge(path: str, name: str, opened, go, results) -> None:
    ledger = Ledger(path)                       # both processes read the (empty) ledger first ...
    guard = BudgetGuard(ledger, {"h0": BUDGET}, DELTA)
    opened.wait()
    go.wait()                                   # ... then charge at the same moment
    try:
        guard.charge(["h0"], GaussianEvent(1.0, SIGMA_EPS6), f"{name}:release")
        results.put((path, name, "charged"))
    except BudgetExceeded:
        results.put((path, name, "refused"))


def _race_chain(path: str, run_path: str, name: str, opened, go, results) -> None:
    chain = GuardChain(BudgetGuard(Ledger(run_path), BUDGET, DELTA),
                       [(BudgetGuard(Ledger(path), {"h0": BUDGET}, DELTA), ["h0"])])
    opened.wait()
    go.wait()
    try:
        chain.charge(["h0"], GaussianEvent(1.0, SIGMA_EPS6), f"{name}:release")
        results.put((path, name, "charged"))
    except BudgetExceeded:
        results.put((path, name, "refused"))


def _run_pair(target, args_for, rounds: int) -> list:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    outcomes = []
    for round_index in range(rounds):
        opened, go = context.Barrier(2), context.Barrier(2)
        processes = [context.Process(target=target, args=(*args_for(round_index, name), opened, go, results))
                     for name in ("a", "b")]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=120)
            assert process.exitcode == 0
        outcomes.append(sorted(results.get(timeout=10)[2] for _ in processes))
    return outcomes


@pytest.mark.parametrize("rounds", [2])
def test_two_processes_never_overspend_one_lifetime_ledger(tmp_path, rounds):
    outcomes = _run_pair(_race_charge, lambda i, name: (str(tmp_path / f"life-{i}.jsonl"), name), rounds)
    for index, outcome in enumerate(outcomes):
        assert outcome == ["charged", "refused"], f"round {index}: {outcome}"
        ledger = Ledger(tmp_path / f"life-{index}.jsonl")
        assert len(ledger) == 1
        assert ledger.spent("h0", DELTA).epsilon <= BUDGET


def test_two_guard_chains_never_overspend_their_shared_hospital_ledger(tmp_path):
    # each process has its own run ledger; only the hospital's lifetime ledger is shared
    outcomes = _run_pair(_race_chain, lambda i, name: (str(tmp_path / f"life-{i}.jsonl"),
                                                      str(tmp_path / f"run-{i}-{name}.jsonl"), name), 2)
    for index, outcome in enumerate(outcomes):
        assert outcome == ["charged", "refused"], f"round {index}: {outcome}"
        assert Ledger(tmp_path / f"life-{index}.jsonl").spent("h0", DELTA).epsilon <= BUDGET


def _writer(path: str, count: int, committed) -> None:
    ledger = Ledger(path)
    for index in range(count):
        ledger.record(["h0"], GaussianEvent(1.0, 50.0), f"w-{index}")
        committed.value = index + 1


def _opener(path: str, stop) -> None:
    while not stop.is_set():
        if os.path.exists(path):
            Ledger(path)            # opening cuts a torn tail: it must never cut a committed record


def test_opening_a_ledger_never_cuts_a_record_another_process_committed(tmp_path):
    path = tmp_path / "life.jsonl"
    # a torn fragment, as a writer killed mid-line leaves it: the first opener cuts it
    path.write_bytes(b'{"release_id": "torn", "owners": ["h0"], "ev')
    context = multiprocessing.get_context("spawn")
    committed, stop = context.Value("i", 0), context.Event()
    openers = [context.Process(target=_opener, args=(str(path), stop)) for _ in range(2)]
    for process in openers:
        process.start()
    writer = context.Process(target=_writer, args=(str(path), 150, committed))
    writer.start()
    writer.join(timeout=300)
    stop.set()
    for process in openers:
        process.join(timeout=60)
    assert writer.exitcode == 0 and committed.value == 150
    ledger = Ledger(path)
    assert len(ledger) == 150
    assert all(ledger.has_release(f"w-{index}") for index in range(150))
    assert not ledger.has_release("torn")


def test_a_lock_is_held_from_check_to_record(tmp_path):
    """In one process: a charge refreshes under the lock, so it sees what another Ledger object appended."""
    first, second = Ledger(tmp_path / "l.jsonl"), Ledger(tmp_path / "l.jsonl")
    BudgetGuard(first, BUDGET, DELTA).charge(["h0"], GaussianEvent(1.0, SIGMA_EPS6), "one")
    with pytest.raises(BudgetExceeded):
        BudgetGuard(second, BUDGET, DELTA).charge(["h0"], GaussianEvent(1.0, SIGMA_EPS6), "two")
    assert len(Ledger(tmp_path / "l.jsonl")) == 1


def test_opening_a_ledger_takes_no_lock_unless_it_must_cut_a_torn_tail(tmp_path, monkeypatch):
    """Reading takes no lock (a model shipped with its ledger on read-only media stays verifiable); only a
    torn tail, which must be cut, takes it."""
    import privacy.ledger as ledger_module

    path = tmp_path / "ledger.jsonl"
    Ledger(path).record(["h0"], GaussianEvent(1.0, SIGMA_EPS6), "one")

    def no_lock(*args):
        raise PermissionError("read-only")

    monkeypatch.setattr(ledger_module.fcntl, "flock", no_lock)
    assert len(Ledger.load(path)) == 1
    with open(path, "ab") as handle:
        handle.write(b'{"release_id": "torn"')
    with pytest.raises(PermissionError):
        Ledger.load(path)


def _count_under_lock(path: str, counter: str, times: int) -> None:
    ledger = Ledger(path)
    for _ in range(times):
        with ledger.exclusive(refresh=False):   # a read-modify-write only a held lock keeps whole
            value = int(open(counter).read())
            with open(counter, "w") as handle:
                handle.write(str(value + 1))


def test_the_lock_file_is_removed_after_use_and_still_excludes_other_processes(tmp_path):
    """The lock file exists only while held (no empty ``.lock`` is left beside a ledger), yet three processes
    taking it 150 times each never overlap: each waiter that wakes up on a removed file takes the current one."""
    path, counter = tmp_path / "ledger.jsonl", tmp_path / "counter"
    counter.write_text("0")
    context = multiprocessing.get_context("fork")   # nothing held at the fork; no interpreter start-up to pay
    processes = [context.Process(target=_count_under_lock, args=(str(path), str(counter), 150)) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    assert counter.read_text() == "450"
    Ledger(path).record(["h0"], GaussianEvent(1.0, SIGMA_EPS6), "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter", "ledger.jsonl"]
    path.with_name("ledger.jsonl.lock").touch()   # left by a holder that was killed: taken, then removed
    Ledger(path).record(["h0"], GaussianEvent(1.0, SIGMA_EPS6 * 4), "two")
    assert not path.with_name("ledger.jsonl.lock").exists()
