"""Where a cell's wall time goes (task.learning.phases): exclusive nested phases, per-cell windows, results.json's
``phase_seconds`` and the report's cost table."""

import time

import pytest

from task.learning import phases


@pytest.fixture(autouse=True)
def fresh_clock(monkeypatch):
    monkeypatch.setattr(phases, "_intervals", [])
    monkeypatch.setattr(phases, "_stack", [])
    monkeypatch.setattr(phases, "_first_window", [])


class _Clock:
    """A perf_counter that moves only when told (the test's timings then cannot depend on the machine's load)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def test_nested_phases_count_once_and_the_rest_is_other(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(phases, "_clock", clock)
    monkeypatch.setattr(phases, "PROCESS_START", clock() - 3.0)
    started = clock()
    with phases.phase("training"):
        clock.advance(5)
        with phases.phase("evaluation"):
            clock.advance(2)
        with phases.default_phase("writing"):    # named already: stays training
            clock.advance(1)
    clock.advance(0.5)
    assert phases.seconds_since(started) == {"imports": 3.0, "training": 6.0, "evaluation": 2.0, "other": 0.5}
    later = clock()
    with phases.default_phase("accounting"):
        clock.advance(4)
    # the start-up goes to a process's first window only; the earlier phases are outside this one
    assert phases.seconds_since(later) == {"accounting": 4.0, "other": 0.0}


def test_a_worker_threads_phases_are_its_callers():
    import threading

    started = time.perf_counter()

    def work():
        with phases.phase("queries"):
            time.sleep(0.01)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "queries" not in phases.seconds_since(started)


def test_results_carry_phase_seconds_and_the_report_shows_them(tmp_path):
    from sim.report import cost_table
    from task.reporting.results import RunResults, write_run

    started = time.perf_counter()
    with phases.phase("training"):
        time.sleep(0.01)
    results = RunResults(method="dp-sgd-central", epsilon_budget=8.0)
    results.extras["not_private_diagnostics"] = ["wall_seconds"]
    written = write_run(tmp_path, results, started=started)
    assert written["phase_seconds"]["training"] > 0
    assert written["not_private_diagnostics"] == ["wall_seconds", "phase_seconds"]   # the same privacy note
    table = cost_table([written, {"method": "public-only"}])
    header = table.splitlines()[0]
    assert "training" in header and "wall s" in header and "evaluation" not in header
    assert len(table.splitlines()) == 3          # header, rule, the one cell that recorded phases
