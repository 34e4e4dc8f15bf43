"""results.json records the commit of the code that ran (task.reporting.provenance), and finding it never fails a run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from task.reporting import provenance
from task.reporting.results import RunResults, write_run

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path):
    """A git checkout with one commit of one tracked file."""
    folder = tmp_path / "checkout"
    folder.mkdir()
    _git(folder, "init", "-q")
    (folder / "code.py").write_text("x = 1\n")
    _git(folder, "add", "code.py")
    _git(folder, "-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    return folder, head


def test_results_json_records_the_commit_the_code_ran_from(tmp_path):
    written = write_run(tmp_path, RunResults(method="public-only"))
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["commit"] == written["commit"] == provenance.code_commit()
    assert stored["commit"] == provenance.UNKNOWN or provenance._COMMIT.fullmatch(
        stored["commit"].removesuffix(provenance.DIRTY))


def test_the_commit_a_producer_recorded_is_kept(tmp_path):
    assert write_run(tmp_path, RunResults(method="public-only", commit="abc"))["commit"] == "abc"


@needs_git
def test_the_commit_of_a_checkout_and_a_tracked_change_marked_dirty(checkout):
    folder, head = checkout
    assert provenance.commit_of(folder) == head
    (folder / "untracked.txt").write_text("a run's output\n")
    assert provenance.commit_of(folder) == head              # untracked files are no change to the code
    (folder / "code.py").write_text("x = 2\n")
    assert provenance.commit_of(folder) == head + provenance.DIRTY


@needs_git
def test_a_folder_inside_a_checkout_is_not_that_checkout(checkout):
    """A package installed into a folder below another repository (a venv inside a checkout) ran no commit of it."""
    folder, _ = checkout
    (folder / "site-packages").mkdir()
    assert provenance.commit_of(folder / "site-packages") == provenance.UNKNOWN


def test_unknown_without_git_or_without_a_checkout(tmp_path, monkeypatch):
    assert provenance.commit_of(tmp_path) == provenance.UNKNOWN             # no repository here
    monkeypatch.setattr(provenance.shutil, "which", lambda name: None)
    assert provenance.commit_of(provenance.CHECKOUT) == provenance.UNKNOWN   # git absent: no failure either

    def broken(*args, **kwargs):
        raise subprocess.TimeoutExpired("git", 10)

    monkeypatch.setattr(provenance.shutil, "which", lambda name: "/usr/bin/git")
    monkeypatch.setattr(provenance.subprocess, "run", broken)
    assert provenance.commit_of(provenance.CHECKOUT) == provenance.UNKNOWN


def test_a_pinned_run_commit_labels_every_result_and_a_later_pin_keeps_it(tmp_path, monkeypatch):
    # a long run records the commit it started from, even when the checkout moves on while it runs
    started = "a" * 40
    monkeypatch.setenv(provenance.RUN_COMMIT_VARIABLE, started)
    assert provenance.pin_run_commit() == started                       # an outer command's pin is kept
    written = write_run(tmp_path, RunResults(method="public-only"))
    assert written["commit"] == started
    # the checkout is elsewhere now: what it is at is recorded beside the commit the run started from
    assert written["commit_when_written"] == provenance.commit_of(provenance.CHECKOUT) != started
    monkeypatch.setenv(provenance.RUN_COMMIT_VARIABLE, provenance.commit_of(provenance.CHECKOUT))
    assert "commit_when_written" not in write_run(tmp_path / "same", RunResults(method="public-only"))
    monkeypatch.setenv(provenance.RUN_COMMIT_VARIABLE, started + provenance.DIRTY)
    assert provenance.code_commit() == started + provenance.DIRTY


def test_a_malformed_pin_is_ignored_and_replaced_by_the_checkouts_commit(monkeypatch):
    monkeypatch.setenv(provenance.RUN_COMMIT_VARIABLE, "not a commit; rm -rf")
    assert provenance.code_commit() == provenance.commit_of(provenance.CHECKOUT)
    assert provenance.pin_run_commit() == provenance.commit_of(provenance.CHECKOUT)
    assert os.environ[provenance.RUN_COMMIT_VARIABLE] == provenance.commit_of(provenance.CHECKOUT)
