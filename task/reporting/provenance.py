"""Which code a run ran: the commit of the checkout the ``task`` package was imported from.

Every ``results.json`` records it (``task.reporting.results.write_run``), so a number in a report or in docs/RESULTS.md can be
traced to the code that produced it. The commit is ``git rev-parse HEAD`` of the checkout this package lives in,
with ``-dirty`` appended when a tracked file differs from that commit, or git cannot tell (the number then came
from code no commit holds); it is ``unknown`` whenever it cannot be known: git is not installed, the package was
installed from a wheel (its folder is no checkout's root), or git refuses the folder. Finding it never fails a run.

A run that lasts (a comparison or a demo: an hour of cells) records the commit it *started* from, not the one checked
out when each cell writes: ``fedpate`` pins it at a command's start (:func:`pin_run_commit`) in
``FEDPATE_RUN_COMMIT``, which every process the command starts inherits, so a commit made in the checkout while a run
goes on does not relabel its remaining cells. A process started after such a commit may run the newer code, so
a result written when the checkout is no longer at the pinned commit records that too (:func:`commit_moved`).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

#: the folder holding the ``task`` package: a checkout's root when the code runs from one (an editable install)
CHECKOUT = Path(__file__).resolve().parents[2]   # task/reporting/provenance.py -> the checkout
UNKNOWN = "unknown"
DIRTY = "-dirty"
#: git's own variables that would point it at another repository than the one asked about
_GIT_REDIRECTS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_COMMON_DIR")
_COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")   # SHA-1, or SHA-256 object names
_TIMEOUT_S = 10
#: the environment variable holding the commit a running command started from (:func:`pin_run_commit`)
RUN_COMMIT_VARIABLE = "FEDPATE_RUN_COMMIT"


def commit_of(checkout: Path) -> str:
    """The commit ``checkout`` is at (``-dirty`` when a tracked file differs from it), or ``unknown`` when
    ``checkout`` is not the root of a git checkout or git cannot say."""
    git = shutil.which("git")
    if git is None:
        return UNKNOWN
    environment = {key: value for key, value in os.environ.items() if key not in _GIT_REDIRECTS}
    # --no-optional-locks: never take the index lock of a checkout someone may be committing in
    command = [git, "--no-optional-locks", "-C", str(checkout)]
    try:
        found = subprocess.run(command + ["rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True,
                               timeout=_TIMEOUT_S, env=environment, check=True).stdout.split("\n")
        top, commit = found[0].strip(), found[1].strip()
        if Path(top).resolve() != Path(checkout).resolve() or not _COMMIT.fullmatch(commit):
            return UNKNOWN   # the package sits inside another repository (a wheel in a venv in a checkout)
        differs = subprocess.run(command + ["diff", "--quiet", "HEAD", "--"], capture_output=True,
                                 timeout=_TIMEOUT_S, env=environment).returncode
    except (OSError, IndexError, subprocess.SubprocessError):
        return UNKNOWN
    return commit + ("" if differs == 0 else DIRTY)   # a diff git could not finish is no clean tree


@functools.lru_cache(maxsize=1)
def _checkout_commit() -> str:
    return commit_of(CHECKOUT)


def _pinned() -> str | None:
    """The commit a running command pinned (:func:`pin_run_commit`); None when none is, or the value is no commit."""
    text = os.environ.get(RUN_COMMIT_VARIABLE, "")
    return text if text == UNKNOWN or _COMMIT.fullmatch(text.removesuffix(DIRTY)) else None


def code_commit() -> str:
    """The commit of the code this process runs: the one its command started from when it was pinned
    (:func:`pin_run_commit`), else :func:`commit_of` of :data:`CHECKOUT`, asked once per process."""
    return _pinned() or _checkout_commit()


def commit_moved() -> str | None:
    """The checkout's commit now (asked afresh), when a command pinned another one at its start; else None."""
    pinned = _pinned()
    now = commit_of(CHECKOUT) if pinned else None
    return now if now != pinned else None


def pin_run_commit() -> str:
    """Pin the commit this command starts from for every process it starts (kept when a parent already pinned
    one: a command inside a command belongs to the outer run); returns it."""
    if _pinned() is None:
        os.environ[RUN_COMMIT_VARIABLE] = _checkout_commit()
    return os.environ[RUN_COMMIT_VARIABLE]
