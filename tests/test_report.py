"""The comparison report re-checks each cell's epsilon against its ledger and renders every method."""

import csv
import io
import json

from privacy.events import GaussianEvent
from privacy.ledger import Ledger
from sim.report import load_cells, markdown_table, verdicts, write_report


def _cell(root, name, method, budget, dice_mean, teachers=8, tamper=0.0):
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
