"""What a run publishes (reports, results, predictions, bundles) is readable as the user's umask allows, so
colleagues on a shared machine can read it under umask 022; ledgers and what was trained on patients without
a guarantee stay owner-only (0600) under any umask."""

import os
import stat

import pytest

from privacy.events import GaussianEvent
from privacy.ledger import Ledger
from task.io import atomic_save_torch, atomic_write_bytes, atomic_write_json, atomic_write_text

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")


@pytest.fixture(params=[0o022, 0o077], ids=["umask-022", "umask-077"])
def umask(request):
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_published_files_follow_the_umask(tmp_path, umask):
    expected = 0o666 & ~umask            # 0644 under 022, 0600 under 077
    for path in (atomic_write_text(tmp_path / "report.md", "# report\n"),
                 atomic_write_json(tmp_path / "run" / "results.json", {"dice": 0.5}),
                 atomic_write_bytes(tmp_path / "predictions" / "case_seg.nii.gz", b"\x1f\x8b")):
        assert _mode(path) == expected, path
    # replacing a file gives the new one the same mode (not the temporary file's)
    assert _mode(atomic_write_text(tmp_path / "report.md", "# again\n")) == expected
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_private_files_are_owner_only_under_any_umask(tmp_path, umask):
    assert _mode(atomic_write_bytes(tmp_path / "ledger.jsonl", b"", private=True)) == 0o600
    assert _mode(atomic_save_torch(tmp_path / "teacher-0.pt", {"w": 1}, private=True)) == 0o600


def test_a_ledger_is_owner_only_under_any_umask(tmp_path, umask):
    ledger = Ledger(tmp_path / "hospital" / "ledger.jsonl")
    ledger.record(["h0"], GaussianEvent(sensitivity=1.0, sigma=2.0), "release-1")
    assert _mode(tmp_path / "hospital" / "ledger.jsonl") == 0o600


def test_a_report_written_by_the_report_code_is_readable_by_colleagues(tmp_path, umask):
    from sim.report import write_report

    (tmp_path / "public-only").mkdir()
    atomic_write_json(tmp_path / "public-only" / "results.json",
                      {"method": "public-only", "dice": {"mean": 0.5, "WT": 0.6, "TC": 0.5, "ET": 0.4}})
    report = write_report(tmp_path, "file modes")
    assert _mode(report) == 0o666 & ~umask
    assert _mode(tmp_path / "cells.csv") == 0o666 & ~umask


def test_a_hospitals_answer_book_is_owner_only_under_any_umask(tmp_path, umask):
    """PATE's kept answers are every teacher's un-noised rows: like the teachers, they stay with their owner."""
    import numpy as np

    from clients.replay import AnswerBook

    book = AnswerBook(tmp_path / "answers")
    assert book.store("k" * 64, {"rows": np.ones((3, 2, 4), np.float32)}, {"fallback_teachers": 0})
    kept = sorted((tmp_path / "answers").iterdir())
    assert [p.suffix for p in kept] == [".json", ".npz"]
    assert all(_mode(p) == 0o600 for p in kept) and _mode(tmp_path / "answers") == 0o700
    # a book an earlier version kept with the umask's modes is closed to others when it is next read
    older = tmp_path / "older"
    older.mkdir(mode=0o755)
    os.chmod(older, 0o755)
    atomic_write_bytes(older / "answer.npz", b"")
    assert AnswerBook(older).lookup("0" * 64) is None and _mode(older) == 0o700
