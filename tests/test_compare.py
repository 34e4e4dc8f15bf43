"""``fedpate compare``: cells, report and CSV whose epsilons agree with the ledgers; finished cells are
skipped on a second run; the classification task path writes accuracy cells."""

import csv
import json
import os

import pytest

from sim.cli import main


@pytest.fixture()
def cache(tmp_path, monkeypatch, tiny_phantoms):
    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow
def test_segmentation_compare_is_complete_consistent_and_resumable(cache, tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny", "--epsilons", "2,8", "--methods", "pate-pca,public-only,nonprivate-central",
            "--engine", "inprocess", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    cells = {p.parent.relative_to(out).as_posix() for p in out.rglob("results.json")}
    assert cells == {"pate-pca/eps-2", "pate-pca/eps-8", "public-only", "nonprivate-central"}
    rows = list(csv.DictReader((out / "cells.csv").open()))
    assert {r["ledger_check"] for r in rows} == {"ok"}
    report = (out / "report.md").read_text()
    assert "| pate-pca | 2.00 |" in report and "public-only" in report and "Where PATE helps" in report
    assert (out / "plot_vs_epsilon.png").exists() and (out / "overlays.png").exists()
    for cell in cells:  # every cell has a verifiable model bundle
        assert (out / cell / "model" / "MODEL_CARD.md").exists()
    # teachers were trained once for both epsilons
    assert len(list((out / "_shared").glob("K-8/public-model.pt"))) == 1
    results = [json.loads((out / c / "results.json").read_text()) for c in ("pate-pca/eps-2", "pate-pca/eps-8")]
    assert results[0]["teacher_dice_mean"] == results[1]["teacher_dice_mean"]
    teachers = list(cache.glob("worlds/*/nodes/*/teachers/teacher-*.pt"))
    assert len(teachers) == 8 and not list(out.rglob("hospitals"))  # one set of teachers, in the world
    assert json.loads(next(cache.glob("worlds/*/nodes/*/teachers/training.json")).read_text())["fingerprint"]
    # releases add up: each hospital's own ledger holds both cells' queries; the report and every card
    # state the combined epsilon, which exceeds each cell's
    from privacy.ledger import Ledger
    from task.reporting.bundle import load_bundle

    ledgers = sorted((out / "hospital-ledgers").glob("*.jsonl"))
    assert len(ledgers) == 2
    combined = max(Ledger.load(p).spent(p.stem, 1e-3).epsilon for p in ledgers)
    assert max(r["epsilon"] for r in results) < combined <= 2 + 8
    assert len(Ledger.load(ledgers[0]).records()) == sum(r["queries"] for r in results)
    assert f"ε = {combined:.3g} per patient" in report and "One neighbouring relation" in report
    card = load_bundle(out / "pate-pca/eps-8").card       # verifies the combined epsilon too
    assert card["released_with"]["combined_epsilon"] == pytest.approx(combined)
    # each card states its own method's trust model, in the report's words for that method
    for cell in ("pate-pca/eps-8", "nonprivate-central", "public-only"):
        said = (out / cell / "model" / "MODEL_CARD.md").read_text()
        line = next(line for line in said.splitlines() if line.startswith("**Trust model.**"))
        assert line.split("**Trust model.** ", 1)[1].split(". Differential privacy")[0] + "." in report, line
    assert "aggregation: **trusted**" in (out / "pate-pca/eps-8/model/MODEL_CARD.md").read_text()
    assert "aggregation: **pooled**" in (out / "nonprivate-central/model/MODEL_CARD.md").read_text()
    # selection never looks at the test set: every cell reports its public validation Dice
    assert all(r["validation_dice_mean"] is not None for r in results)
    stamps = {c: os.path.getmtime(out / c / "results.json") for c in cells}
    assert main(args) == 0  # resumed: nothing recomputed
    assert stamps == {c: os.path.getmtime(out / c / "results.json") for c in cells}
    # a cell interrupted after releasing is kept aside and run again; the hospitals keep counting both
    (out / "pate-pca/eps-2/results.json").unlink()
    before = len(Ledger.load(ledgers[0]).records())
    assert main(args) == 0
    assert len(list(out.glob("pate-pca/eps-2.interrupted-*"))) == 1
    assert len(Ledger.load(ledgers[0]).records()) == before + results[0]["queries"]


def test_classification_task_path(tmp_path):
    out = tmp_path / "cls"
    assert main(["compare", "--task", "mnist5k", "--methods", "adlm,nonprivate", "--epsilons", "1", "--preset", "tiny",
                 "--out", str(out), "--no-progress"]) == 0
    results = [json.loads(p.read_text()) for p in out.rglob("results.json")]
    # the reference rows come along: public-only in every report, AdLM's noise-free row beside AdLM
    assert {r["method"] for r in results} == {"adlm", "nonprivate", "public-only", "adlm-noise-free"}
    assert all(r["dice"] is None and 0 <= r["accuracy"] <= 1 for r in results)
    assert (out / "report.md").exists()


def test_bad_lists_are_one_line_errors(tmp_path, capsys):
    assert main(["compare", "--epsilons", "one,two", "--out", str(tmp_path)]) == 2
    assert "--epsilons" in capsys.readouterr().err
    assert main(["compare", "--methods", "pate-xyz", "--epsilons", "1", "--out", str(tmp_path)]) == 2
    assert "unknown" in capsys.readouterr().err


def test_compare_refuses_a_single_epsilon_and_points_at_epsilons(capsys):
    """``--epsilon`` (one budget, from the common run options) was once accepted and silently ignored."""
    assert main(["compare", "--preset", "tiny", "--epsilon", "3", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "--epsilon" in err and "--epsilons 3" in err and len(err.strip().splitlines()) == 1
