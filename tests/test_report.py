"""The comparison report re-checks each cell's epsilon against its ledger and renders every method."""

import csv
import io
import json

import numpy as np
import pytest

from privacy.events import GaussianEvent
from privacy.ledger import Ledger
from sim.report import load_cells, markdown_table, verdicts, write_report


def _cell(root, name, method, budget, dice_mean, teachers=8, tamper=0.0, per_case=None):
    cell = root / name
    cell.mkdir(parents=True)
    epsilon = None
    if budget is not None:
        ledger = Ledger(cell / "ledger.jsonl")
        for i in range(4):
            ledger.record(["h0", "h1"], GaussianEvent(sensitivity=2 / teachers, sigma=0.5), f"q{i}")
        epsilon = ledger.spent("h0", 1e-3).epsilon + tamper
    result = {
        "method": method, "dice": {k: dice_mean for k in ("1", "2", "3", "mean", "WT", "TC", "ET")},
        "epsilon": epsilon, "epsilon_budget": budget, "delta": 1e-3 if budget else None,
        "relation": "replace-one" if budget else None, "accountant": "gdp-exact" if budget else None,
        "teachers": teachers, "hospitals": 2, "queries": 4, "sigma": 0.5, "teacher_dice_mean": 0.4,
        "ensemble_dice_mean": 0.6, "bytes_up_per_query_per_teacher": 64, "wall_seconds": 3.0, "seed": 0,
    }
    if per_case is not None:
        result["dice_per_case"] = per_case
    (cell / "results.json").write_text(json.dumps(result))


def test_report_tables_csv_plots_and_ledger_check(tmp_path):
    _cell(tmp_path, "pate-ae/eps-8/K-8", "pate-ae", 8.0, 0.30, teachers=8)
    _cell(tmp_path, "pate-ae/eps-8/K-32", "pate-ae", 8.0, 0.50, teachers=32)
    _cell(tmp_path, "pate-pca/eps-8/K-8", "pate-pca", 8.0, 0.20, tamper=0.5)
    _cell(tmp_path, "public-only", "public-only", None, 0.40)
    report = write_report(tmp_path, "test comparison")
    text = report.read_text()
    assert "| pate-ae |" in text and "| public-only |" in text
    assert "ledger says" in text  # the tampered pate-pca cell is flagged
    rows = list(csv.DictReader(io.StringIO((tmp_path / "cells.csv").read_text())))
    assert len(rows) == 4
    assert {r["ledger_check"] for r in rows if r["method"] == "pate-ae"} == {"ok"}
    assert (tmp_path / "plot_vs_epsilon.png").stat().st_size > 1000
    assert (tmp_path / "plot_dice_vs_teachers.png").exists()  # K sweep present
    lines = verdicts(load_cells(tmp_path))
    assert any("beats public-only" in line and "K = 32" in line for line in lines)


def test_verdict_says_when_pate_does_not_beat_public_only(tmp_path):
    _cell(tmp_path, "pate-ae/eps-1", "pate-ae", 1.0, 0.10)
    _cell(tmp_path, "public-only", "public-only", None, 0.40)
    lines = verdicts(load_cells(tmp_path))
    assert any("does NOT beat public-only" in line for line in lines)


def test_accuracy_table(tmp_path):
    _cell(tmp_path, "adlm/eps-1", "adlm", 1.0, 0.0)
    cells = load_cells(tmp_path)
    cells[0]["accuracy"] = 0.91
    assert "0.910" in markdown_table(cells, accuracy=True)


def test_verdicts_use_the_paired_difference_on_the_same_test_cases(tmp_path):
    """A 0.02 gap in the means is 'level' when per-case differences are noisy, 'beats' when consistent."""
    import numpy as np

    rng = np.random.default_rng(0)
    public = rng.uniform(0.4, 0.9, 30)
    noisy = public + 0.02 + 0.15 * np.resize([1.0, -1.0], 30)   # mean gap exactly 0.02, se ~ 0.028
    steady = public + 0.02 + rng.normal(0, 0.005, 30)          # se ~ 0.001
    _cell(tmp_path, "public-only", "public-only", None, float(public.mean()), per_case=public.tolist())
    _cell(tmp_path, "pate-ae/eps-1", "pate-ae", 1.0, float(noisy.mean()), per_case=noisy.tolist())
    _cell(tmp_path, "pate-ae/eps-8", "pate-ae", 8.0, float(steady.mean()),
          per_case=steady.tolist()[:-1] + [None])               # a case with no valid class is skipped
    lines = {line.split(":")[0]: line for line in verdicts(load_cells(tmp_path)) if line.startswith("ε")}
    assert "is level with public-only" in lines["ε = 1"] and "within two standard errors" in lines["ε = 1"]
    assert "it beats public-only" in lines["ε = 8"] and "over 29 test cases" in lines["ε = 8"]
    diff = steady[:-1] - public[:-1]
    assert f"{diff.mean():+.3f} ± {diff.std(ddof=1) / np.sqrt(29):.3f}" in lines["ε = 8"]


def test_headroom_recovered_is_a_paired_ratio_with_its_standard_error():
    from sim.report import headroom_recovered

    public = [0.40, 0.50, 0.60, 0.50]
    nonprivate = [0.60, 0.70, 0.80, 0.70]
    assert headroom_recovered(public, public, nonprivate) == (0.0, 0.0, 4)
    ratio, se, n = headroom_recovered(nonprivate, public, nonprivate)
    assert (ratio, n) == (pytest.approx(1.0), 4) and se == pytest.approx(0.0, abs=1e-12)
    # d = (0.2, 0.0, 0.1, 0.1) against h = 0.2 everywhere: R = 0.1 / 0.2, SE = std(d) / sqrt(4) / 0.2
    ratio, se, n = headroom_recovered([0.60, 0.50, 0.70, 0.60], public, nonprivate)
    assert ratio == pytest.approx(0.5) and se == pytest.approx(0.0816497 / 2 / 0.2, rel=1e-5)
    assert headroom_recovered([0.5] * 3, [0.5] * 3, [0.4] * 3) is None       # no headroom: no ratio
    assert headroom_recovered([0.5, 0.6], [0.4, 0.5], [0.6, 0.7]) is None     # too few paired cases


def test_report_opens_with_headroom_recovered_and_where_each_method_started(tmp_path):
    from sim.report import write_report

    per_case = {"public-only": [0.4, 0.5, 0.6, 0.5], "nonprivate-central": [0.6, 0.7, 0.8, 0.7],
                "dp-sgd-central": [0.5, 0.6, 0.7, 0.6]}
    for method, values in per_case.items():
        cell = tmp_path / method
        cell.mkdir()
        (cell / "ledger.jsonl").write_text("")
        result = {"method": method, "dice": {"mean": float(np.mean(values))}, "dice_per_case": values,
                  "epsilon": None, "epsilon_budget": None, "delta": None}
        if method == "dp-sgd-central":
            result.update(init="public", settings_grid=[{"learning_rate": 2e-3}, {"learning_rate": 5e-4}],
                          setting_chosen=1)
        (cell / "results.json").write_text(json.dumps(result))
    text = write_report(tmp_path, "t").read_text()
    assert "headroom recovered (± SE)" in text
    row = next(line for line in text.splitlines() if line.startswith("| dp-sgd-central") and "public model" in line)
    assert "+0.50 ± 0.00" in row and "learning_rate 0.0005 (2 of 2)" in row
