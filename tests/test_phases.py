"""Where a cell's wall time goes (task.phases): exclusive nested phases, per-cell windows, results.json's
``phase_seconds`` and the report's cost table."""

import time

import pytest

from task import phases


@pytest.fixture(autouse=True)
def fresh_clock(monkeypatch):
    monkeypatch.setattr(phases, "_intervals", [])
    monkeypatch.setattr(phases, "_stack", [])
    monkeypatch.setattr(phases, "_first_window", [])


def test_nested_phases_count_once_and_the_rest_is_other():
    started = time.perf_counter()
    with phases.phase("training"):
        time.sleep(0.05)
        with phases.phase("evaluation"):
            time.sleep(0.05)
        with phases.default_phase("writing"):    # named already: stays training
            time.sleep(0.02)
    time.sleep(0.03)
    seconds = phases.seconds_since(started)
    assert seconds["training"] == pytest.approx(0.07, abs=0.03)
    assert seconds["evaluation"] == pytest.approx(0.05, abs=0.03)
    assert "writing" not in seconds
    assert seconds["other"] == pytest.approx(0.03, abs=0.03)
    assert seconds["imports"] >= 0.0             # the process start-up goes to the first window only
    later = time.perf_counter()
    with phases.default_phase("accounting"):
        time.sleep(0.02)
    second = phases.seconds_since(later)
    assert "imports" not in second and "training" not in second and second["accounting"] >= 0.015


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
    from task.results import RunResults, write_run

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
