"""Where a cell's wall time goes: named phases, recorded as intervals, summed per cell into ``phase_seconds``.

Code that does a phase's work runs under ``with phase("accounting"):`` (or ``default_phase``, which names the work
only when no caller has named it: ``train_segmentation`` is "training" unless it trains a PATE student, say). Phases
nest exclusively -- time in an inner phase is the inner one's, not its caller's -- and only the main thread records
(worker threads' time is already inside a phase of the thread waiting for them). :func:`seconds_since` sums the
intervals inside a cell's window ``[started, now]`` (``task.reporting.results.write_run`` writes them into results.json);
``imports`` is the process's start-up before the first cell (interpreter, command line, torch / MONAI / Opacus
imports), given to the first cell a process runs. The report's cost table reads them (``sim.report``).

Phases a run may record: ``imports``, ``data`` (world and splits), ``public model``, ``training`` (a pooled or
federated model), ``teachers``, ``queries`` (answers, encoding and aggregation), ``decoding``, ``student``,
``evaluation`` (test and validation scoring), ``accounting`` (calibration, budget checks, ε), ``writing``;
``other`` is the rest of the window.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Iterator

#: the phases' order in results.json and the report's cost table
PHASES = ("imports", "data", "public model", "training", "teachers", "queries", "decoding", "student", "evaluation",
          "accounting", "writing", "other")

#: the clock of every interval (``time.perf_counter``, the clock ``write_run``'s ``started`` reads)
_clock = time.perf_counter

#: ``time.perf_counter()`` when this module was first imported (``sim.cli`` imports it first): the process start
PROCESS_START = _clock()

_intervals: list[tuple[str, float, float]] = []   # (phase, start, end), exclusive of nested phases
_stack: list[list] = []                            # open phases: [name, started, time inside nested phases]
_first_window: list[float] = []                    # the start of the first cell window this process reported
_MAIN = threading.main_thread()
_MAX_INTERVALS = 200_000


def _recording() -> bool:
    return threading.current_thread() is _MAIN


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the wall time inside as ``name`` (minus the time of phases nested in it)."""
    if not _recording():
        yield
        return
    frame = [name, _clock(), 0.0]
    _stack.append(frame)
    try:
        yield
    finally:
        _stack.pop()
        end = _clock()
        inside = end - frame[1]
        if len(_intervals) < _MAX_INTERVALS:
            # exclusive: an interval that covers the nested phases' time is shortened by it at its end
            _intervals.append((name, frame[1], end - frame[2]))
        if _stack:
            _stack[-1][2] += inside


@contextlib.contextmanager
def default_phase(name: str) -> Iterator[None]:
    """``phase(name)`` unless a caller already named the phase this work belongs to."""
    if _stack or not _recording():
        yield
        return
    with phase(name):
        yield


def seconds_since(started: float, now: float | None = None) -> dict[str, float]:
    """Seconds per phase inside ``[started, now]`` (rounded to ms), ``other`` for the rest, and ``imports`` for the
    first window a process reports: the time from the process start to ``started``."""
    now = _clock() if now is None else now
    totals: dict[str, float] = {}
    for name, start, end in _intervals:
        # an exclusive interval is (start, end - nested): clip both ends to the window
        overlap = min(end, now) - max(start, started)
        if overlap > 0:
            totals[name] = totals.get(name, 0.0) + overlap
    if not _first_window or _first_window[0] == started:
        if not _first_window:
            _first_window.append(started)
        totals["imports"] = totals.get("imports", 0.0) + max(0.0, started - PROCESS_START)
    window = now - started
    totals["other"] = max(0.0, window - sum(value for key, value in totals.items() if key != "imports"))
    return {name: round(totals[name], 3) for name in PHASES if name in totals} | {
        name: round(value, 3) for name, value in totals.items() if name not in PHASES}


def timed(name: str, default: bool = False):
    """Decorator: the function's calls run under ``phase(name)`` (``default_phase`` with ``default=True``)."""
    def wrap(function):
        @functools.wraps(function)
        def run(*args, **kwargs):
            with (default_phase(name) if default else phase(name)):
                return function(*args, **kwargs)
        return run
    return wrap
