"""Ledger: durable append-only JSONL, repeats merged, truncated tail tolerated, survives SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from privacy.errors import PrivacyError
from privacy.events import GaussianEvent, LaplaceEvent, SampledGaussianEvent, ZCDPEvent
from privacy.ledger import Ledger

REPO = Path(__file__).resolve().parents[1]


def _fill(ledger):
    ledger.record(["h1", "h2"], GaussianEvent(0.25, 1.0733), "q0", note={"query": 0})
    ledger.record(["h1"], GaussianEvent(0.25, 1.0733, 3), "q1")
    ledger.record(["h3"], SampledGaussianEvent(0.01, 1.0, 1000), "sgd-epoch-0")


def test_record_and_reload(tmp_path):
    path = tmp_path / "out" / "ledger.jsonl"
    ledger = Ledger(path)
    _fill(ledger)
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert set(first) == {"release_id", "owners", "event", "note", "time"}
    assert first["owners"] == ["h1", "h2"] and first["event"]["type"] == "gaussian"
    again = Ledger.load(path)
    assert again.owners() == ["h1", "h2", "h3"]
    assert again.events("h1") == [GaussianEvent(0.25, 1.0733), GaussianEvent(0.25, 1.0733, 3)]
    assert again.digest() == ledger.digest()
    spent = again.spent("h1", 1e-3)
    assert spent.accountant == "gdp-exact" and spent.relation == "replace-one" and spent.releases == 2
    assert spent.epsilon == pytest.approx(ledger.spent("h1", 1e-3).epsilon)
    sgd = again.spent("h3", 1e-5)
    assert sgd.accountant == "pld" and sgd.relation == "add-remove"
    assert sgd.epsilon == pytest.approx(1.83, abs=0.01)
    empty = again.spent("nobody", 1e-3)
    assert empty.epsilon == 0.0 and empty.releases == 0


def test_in_memory_ledger():
    ledger = Ledger()
    _fill(ledger)
    assert len(ledger) == 3 and ledger.path is None


def test_repeats_merge_and_conflicts_refused(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    _fill(ledger)
    eps = ledger.spent("h1", 1e-3).epsilon
    ledger.record(["h2", "h1"], GaussianEvent(0.25, 1.0733), "q0", note={"retry": True})  # same content
    assert ledger.spent("h1", 1e-3).epsilon == eps
    with pytest.raises(PrivacyError, match="q0"):
        ledger.record(["h1", "h2"], GaussianEvent(0.25, 2.0), "q0")
    # a file holding the same release twice (two processes, a resumed run) counts it once
    line = path.read_text().splitlines()[0]
    with open(path, "a") as handle:
        handle.write(line + "\n")
    merged = Ledger.load(path)
    assert len(merged) == 3 and merged.spent("h1", 1e-3).epsilon == pytest.approx(eps)
    assert merged.digest() == ledger.digest()
    # ... but different content under one id is an error
    record = json.loads(line)
    record["event"]["sigma"] = 5.0
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    with pytest.raises(PrivacyError, match="q0"):
        Ledger.load(path)


def test_truncated_last_line_is_dropped_and_cut(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = Ledger(path)
    _fill(ledger)
    full = path.read_bytes()
    path.write_bytes(full + b'{"release_id": "q9", "owners": ["h1"], "ev')
    reloaded = Ledger.load(path)
    assert len(reloaded) == 3
    reloaded.record(["h1"], GaussianEvent(1.0, 2.0), "q10")
    assert Ledger.load(path).records()[-1]["release_id"] == "q10"
    assert path.read_bytes().startswith(full) and path.read_bytes().count(b"\n") == 4


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    _fill(Ledger(path))
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PrivacyError, match=r"ledger\.jsonl, line 2"):
        Ledger.load(path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"release_id": "a", "owners": ["h"], "event": {"type": "gaussian", "sensitivity": -1, "sigma": 1}}\n\n')
    with pytest.raises(PrivacyError, match="line 1.*sensitivity"):
        Ledger.load(bad)
    with pytest.raises(PrivacyError, match="does not exist"):
        Ledger.load(tmp_path / "missing.jsonl")


def test_mixed_relations_refused_unless_filtered():
    ledger = Ledger()
    ledger.record(["h1"], GaussianEvent(0.25, 1.0), "pate-0")  # replace-one
    ledger.record(["h1"], SampledGaussianEvent(0.01, 1.0, 100), "sgd-0")  # add-remove
    with pytest.raises(PrivacyError, match="relation"):
        ledger.spent("h1", 1e-3)
    pate = ledger.spent("h1", 1e-3, relation="replace-one")
    sgd = ledger.spent("h1", 1e-3, relation="add-remove")
    assert (pate.accountant, pate.releases) == ("gdp-exact", 1)
    assert (sgd.accountant, sgd.releases, sgd.relation) == ("pld", 1, "add-remove")


def test_record_validates(tmp_path):
    ledger = Ledger(tmp_path / "l.jsonl")
    with pytest.raises(PrivacyError, match="owners"):
        ledger.record([], GaussianEvent(1, 1), "a")
    with pytest.raises(PrivacyError, match="owners"):
        ledger.record("h1", GaussianEvent(1, 1), "a")
    with pytest.raises(PrivacyError, match="release_id"):
        ledger.record(["h1"], GaussianEvent(1, 1), "")
    with pytest.raises(PrivacyError, match="event"):
        ledger.record(["h1"], {"type": "gaussian"}, "a")
    with pytest.raises(PrivacyError, match="note"):
        ledger.record(["h1"], GaussianEvent(1, 1), "a", note={"x": object()})
    assert not (tmp_path / "l.jsonl").exists() or (tmp_path / "l.jsonl").read_bytes() == b""


def test_accounting_is_incremental_and_matches_fresh(tmp_path):
    ledger = Ledger(tmp_path / "l.jsonl")
    for epoch in range(3):
        ledger.record(["h"], ZCDPEvent.shuffled_epochs(2.0, 1), f"e{epoch}")
        fresh = Ledger.load(tmp_path / "l.jsonl").spent("h", 1e-5)
        assert ledger.spent("h", 1e-5) == fresh
    ledger.record(["h"], LaplaceEvent(1.0, 10.0, relation="zero-out"), "lap")
    assert ledger.spent("h", 1e-5).accountant == "zcdp"



def test_a_checked_release_is_composed_once_and_only_the_checked_events_reuse_the_check(tmp_path, monkeypatch):
    """A budget check composes the release onto a copy; when exactly those events are then recorded the copy
    becomes the ledger's accountant (no second composition), and when anything else is recorded it is not used:
    epsilon is always the one a freshly loaded ledger computes."""
    from privacy.accountants.dp_accounting_wrapper import _DpAccountingWrapper

    composed = []
    original = _DpAccountingWrapper.compose_all
    monkeypatch.setattr(_DpAccountingWrapper, "compose_all",
                        lambda self, events: (composed.append(len(list(events))), original(self, events))[1])
    epoch = SampledGaussianEvent(0.1, 1.1, 10, relation="replace-one")
    ledger = Ledger(tmp_path / "l.jsonl")
    ledger.record(["h"], epoch, "e0")
    ledger.spent("h", 1e-5)
    checked = ledger.spent("h", 1e-5, extra=[epoch, epoch])        # the check: a copy with both epochs
    ledger.record(["h"], epoch, "e1")
    ledger.record(["h"], epoch, "e2")
    composed.clear()
    after = ledger.spent("h", 1e-5)
    assert not any(composed)                                      # the check's copy, nothing composed again
    assert after.epsilon == checked.epsilon and after.releases == 3
    assert after.epsilon == pytest.approx(Ledger.load(tmp_path / "l.jsonl").spent("h", 1e-5).epsilon, rel=1e-9)

    checked = ledger.spent("h", 1e-5, extra=[epoch])               # checked one epoch at sigma 1.1 ...
    other = SampledGaussianEvent(0.1, 0.6, 10, relation="replace-one")
    ledger.record(["h"], other, "e3")                              # ... and recorded another mechanism
    recorded = ledger.spent("h", 1e-5)
    fresh = Ledger.load(tmp_path / "l.jsonl").spent("h", 1e-5)
    assert recorded.epsilon == pytest.approx(fresh.epsilon, rel=1e-9) and recorded.releases == 4
    assert recorded.epsilon > checked.epsilon                      # not the check's (smaller) epsilon either


CHILD = r"""
import sys
from privacy.events import GaussianEvent
from privacy.ledger import Ledger
ledger = Ledger(sys.argv[1])
i = 0
while True:
    ledger.record(["h1", "h2"], GaussianEvent(0.25, 1.0 + i % 7), f"r{i}", note={"pad": "x" * 3000, "i": i})
    print(f"r{i}", flush=True)
    i += 1
"""


def test_ledger_survives_sigkill(tmp_path):
    path = tmp_path / "ledger.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    printed = []
    deadline = time.monotonic() + 60
    try:
        while len(printed) < 150 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            printed.append(line.strip())
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    # read through the text wrapper, not the pipe's descriptor (as communicate() does): lines the child printed
    # may already sit in this side's buffer, and they too were printed after their record() returned
    rest = child.stdout.read()
    child.stdout.close()
    printed += [line.strip() for line in rest.splitlines() if line.strip()]
    assert child.returncode == -signal.SIGKILL
    assert len(printed) >= 150
    ledger = Ledger.load(path)
    recorded = {record["release_id"] for record in ledger.records()}
    assert set(printed) <= recorded  # every release whose record() returned is in the ledger
    assert len(recorded) - len(printed) <= 1  # at most the one in flight when killed
    assert ledger.spent("h1", 1e-3).releases == len(recorded)
    ledger.record(["h1"], GaussianEvent(1.0, 2.0), "after-kill")  # and it can be appended to
    assert Ledger.load(path).has_release("after-kill")


def test_refresh_merges_what_another_writer_appended(tmp_path):
    from privacy.events import GaussianEvent
    from privacy.ledger import Ledger

    mine, theirs = Ledger(tmp_path / "h.jsonl"), Ledger(tmp_path / "h.jsonl")
    mine.record(["h"], GaussianEvent(sensitivity=1.0, sigma=2.0), "a")
    before = mine.spent("h", 1e-3).epsilon
    theirs.refresh()
    theirs.record(["h"], GaussianEvent(sensitivity=1.0, sigma=2.0), "b")
    assert mine.refresh() == 1 and mine.refresh() == 0
    assert len(mine) == 2 and mine.spent("h", 1e-3).epsilon > before
    assert mine.spent("h", 1e-3).epsilon == Ledger.load(tmp_path / "h.jsonl").spent("h", 1e-3).epsilon
