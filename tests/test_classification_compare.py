"""A tiny seed-system compare on mnist5k writes schema-complete cells, a CSV, a report and a plot."""

import csv
import json

import pytest

from task.learning.compute import Compute

SCHEMA_KEYS = ("method", "dice", "epsilon", "epsilon_budget", "delta", "relation", "accountant", "teachers",
             "hospitals", "queries", "sigma", "teacher_dice_mean", "ensemble_dice_mean",
             "bytes_up_per_query_per_teacher", "wall_seconds", "seed")


@pytest.mark.slow
def test_tiny_compare_on_mnist5k_writes_schema_complete_cells(tmp_path, monkeypatch):
    from sim.runners import classification_compare as runner

    # keep the test small: fewer epochs/queries than the tiny preset
    monkeypatch.setitem(runner.PRESET_SETTINGS, "tiny", {"epochs": 1, "adlm_epochs": 1, "teachers_per_hospital": 2,
                                                         "queries": 20, "teacher_epochs": 2})
    cells = runner.run_classification_compare(runner.ClassificationCompareConfig(
        "mnist5k", "nonprivate,adlm,ilm,pate-gnmax,dp-mac", [2.0], tmp_path, seed=0, delta=1e-5, hospitals=2,
        compute=Compute(progress=False)))
    # the reference rows come with every report: public-only always, AdLM's noise-free row beside AdLM/ILM
    assert [c["method"] for c in cells] == ["nonprivate", "adlm", "ilm", "pate-gnmax", "dp-mac", "adlm-noise-free",
                                            "public-only"]
    no_budget = ("nonprivate", "adlm-noise-free", "public-only")
    for cell in cells:
        folder = tmp_path / cell["method"] / ("eps-inf" if cell["method"] in no_budget else "eps-2")
        result = json.loads((folder / "results.json").read_text())
        for key in SCHEMA_KEYS + ("accuracy",):
            assert key in result, (cell["method"], key)
        assert result["error"] is None, result["error"]
        assert result["dice"] is None
        assert 0.0 <= result["accuracy"] <= 1.0
        assert (folder / "ledger.jsonl").exists()
        if cell["method"] in no_budget:          # nothing released: no ε is claimed and the ledger is empty
            assert result["epsilon"] is None and (folder / "ledger.jsonl").read_text() == ""
        else:
            assert 0 < result["epsilon"] <= 2.0
            assert result["relation"] in ("replace-one", "add-remove") and result["accountant"]
    assert cells[0]["accuracy"] > 0.5          # the non-private net learns mnist5k
    rows = list(csv.DictReader((tmp_path / "cells.csv").open()))
    assert len(rows) == 7
    report = (tmp_path / "report.md").read_text()
    assert "| pate-gnmax | 2 |" in report
    assert "| public-only | — | — | — |" in report and "| adlm-noise-free | — | — | — |" in report
    assert "NOT PRIVATE" in report and "## Verdicts against public-only" in report
    assert "- pate-gnmax at ε = 2:" in report
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 1000


def test_unknown_task_and_method_are_user_errors(tmp_path):
    from task.errors import UserError
    from sim.runners.classification_compare import ClassificationCompareConfig, run_classification_compare

    with pytest.raises(UserError, match="--methods"):
        run_classification_compare(ClassificationCompareConfig("mnist5k", "dp-mac,bogus", [1], tmp_path))
    with pytest.raises(UserError, match="--task"):
        run_classification_compare(ClassificationCompareConfig("cifar", "dp-mac", [1], tmp_path))


def test_mnist5k_split_is_deterministic_disjoint_and_bounded():
    import numpy as np

    from task.classification.tasks import load_mnist5k

    a, b = load_mnist5k(hospitals=3, seed=0), load_mnist5k(hospitals=3, seed=0)
    assert np.array_equal(a.x_private, b.x_private) and np.array_equal(a.y_test, b.y_test)
    assert len(a.y_private) + len(a.y_test) + len(a.x_query) + len(a.y_reference) == 5000
    assert len(a.y_test) == 1000 and a.x_private.min() >= 0 and a.x_private.max() <= 1
    counts = np.bincount(a.hospital_of)
    assert counts.max() - counts.min() <= 1
    # each hospital gets every digit (stratified)
    for h in a.hospitals:
        assert len(np.unique(a.y_private[a.hospital_indices(h)])) == 10


def test_slice_task_follows_the_segmentation_split(tiny_prepared, tiny_split):
    import numpy as np

    from task.classification.gnmax import teacher_partitions
    from task.classification.tasks import slice_task_from_split

    task = slice_task_from_split(tiny_prepared, tiny_split, pool=4)
    assert task.input_dim == 4 * 4 * 4 and task.n_classes == 2
    assert task.hospitals == list(tiny_split.hospitals)
    assert 0 <= task.x_private.min() and task.x_private.max() <= 1
    assert set(np.unique(task.y_private)) <= {0, 1} and len(task.y_test) > 0
    # a patient's slices all belong to one hospital and, in PATE, to exactly one teacher
    for g in np.unique(task.group_of):
        assert len(np.unique(task.hospital_of[task.group_of == g])) == 1
    owners = {}
    for k, (_, idx) in enumerate(teacher_partitions(task, 3)):
        for g in np.unique(task.group_of[idx]):
            assert owners.setdefault(int(g), k) == k
            assert set(np.flatnonzero(task.group_of == g)) <= set(idx)     # with all of its slices
    # the privacy unit is the patient: one unit per private case, holding exactly that case's slices
    cases = [c for parts in tiny_split.hospitals.values() for part in parts for c in part]
    units = task.unit_records()
    assert task.privacy_unit == "patient" and task.summary()["privacy_unit"] == "patient"
    assert len(units) == len(cases) and all(len(np.unique(task.group_of[r])) == 1 for r in units)
    assert max(len(r) for r in units) <= tiny_prepared.grid[2] and min(len(r) for r in units) > 1


def test_reproducible_noise_reaches_the_classification_cells_and_the_seed_is_written_nowhere(tmp_path, monkeypatch):
    """``fedpate compare --task ... --reproducible-noise`` seeds the cells' noise (two runs agree) but no file
    of the comparison names the seed; without the flag the cells say their noise is secure. The CLI's
    --hospitals / --teachers-per-hospital reach the cells too."""
    import json

    from sim.cli import main
    from sim.runners import classification_compare as runner

    monkeypatch.setitem(runner.PRESET_SETTINGS, "tiny", {"epochs": 1, "adlm_epochs": 1, "teachers_per_hospital": 2,
                                                         "queries": 20, "teacher_epochs": 2})
    args = ["compare", "--task", "mnist5k", "--methods", "pate-gnmax", "--epsilons", "1", "--preset", "tiny",
            "--seed", "424242", "--no-progress", "--hospitals", "3", "--teachers-per-hospital", "2"]
    runs = {}
    for name, extra in (("a", ["--reproducible-noise"]), ("b", ["--reproducible-noise"]), ("secure", [])):
        assert main(args + extra + ["--out", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "pate-gnmax" / "eps-1" / "results.json").read_text())
    for name in ("a", "b"):
        assert runs[name]["seed"] is None and runs[name]["noise"] == "reproducible"
        for path in (tmp_path / name).rglob("*"):
            if path.is_file() and path.suffix != ".png":
                assert "424242" not in path.read_text(), path
    assert runs["a"]["accuracy"] == runs["b"]["accuracy"]
    assert runs["a"]["details"]["label_accuracy"] == runs["b"]["details"]["label_accuracy"]
    assert runs["secure"]["noise"] == "secure" and runs["secure"]["seed"] == 424242
    # --hospitals and --teachers-per-hospital reach the classification cells (they were ignored)
    assert all(r["hospitals"] == 3 and r["teachers"] == 6 for r in runs.values())
    assert main(args[:-1] + ["1,2", "--out", str(tmp_path / "sweep")]) == 2


# --- resuming a classification comparison: every release stays on a ledger ------------------------------------

def _small_compare(monkeypatch, out, *extra):
    """``fedpate compare --task mnist5k`` with one AdLM cell, its reference rows and one-epoch training."""
    from sim.cli import main
    from sim.runners import classification_compare as runner

    monkeypatch.setitem(runner.PRESET_SETTINGS, "tiny", {"epochs": 1, "adlm_epochs": 1, "teacher_epochs": 1})
    return main(["compare", "--task", "mnist5k", "--methods", "adlm", "--epsilons", "1", "--preset", "tiny",
                 "--hospitals", "2", "--no-progress", "--out", str(out), *extra])


def test_rerun_with_the_same_settings_charges_nothing_and_keeps_the_ledger(tmp_path, monkeypatch):
    out = tmp_path / "cls"
    assert _small_compare(monkeypatch, out) == 0
    ledger = out / "adlm" / "eps-1" / "ledger.jsonl"
    before, inode = ledger.read_bytes(), ledger.stat().st_ino
    result = (out / "adlm" / "eps-1" / "results.json").read_bytes()
    assert before and json.loads(result)["epsilon"] > 0
    assert _small_compare(monkeypatch, out) == 0
    # the finished cell was skipped: the same ledger file, nothing appended, the same results
    assert ledger.stat().st_ino == inode and ledger.read_bytes() == before
    assert (out / "adlm" / "eps-1" / "results.json").read_bytes() == result
    assert not list(out.rglob("*.interrupted-*"))


def test_rerun_with_another_seed_is_refused_naming_the_flag(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cls"
    assert _small_compare(monkeypatch, out) == 0
    ledger = out / "adlm" / "eps-1" / "ledger.jsonl"
    before = ledger.read_bytes()
    capsys.readouterr()
    assert _small_compare(monkeypatch, out, "--seed", "1") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--seed 0 there, 1 now" in err, err
    assert ledger.read_bytes() == before
    # another δ is refused too (each flag named); so is the same folder under reproducible noise
    assert _small_compare(monkeypatch, out, "--delta", "1e-6") == 2
    assert "--delta" in capsys.readouterr().err
    assert _small_compare(monkeypatch, out, "--reproducible-noise") == 2
    assert "--reproducible-noise" in capsys.readouterr().err
    # under reproducible noise the seed is recorded nowhere; the split it chose still tells another seed apart
    noisy = tmp_path / "reproducible"
    assert _small_compare(monkeypatch, noisy, "--reproducible-noise", "--seed", "5") == 0
    capsys.readouterr()
    assert _small_compare(monkeypatch, noisy, "--reproducible-noise", "--seed", "6") == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "6" not in err.replace(str(noisy), "") and "5" not in err.replace(str(noisy), "")


def test_no_ledger_is_deleted_and_an_interrupted_cells_spend_stays_in_the_report(tmp_path, monkeypatch):
    out = tmp_path / "cls"
    assert _small_compare(monkeypatch, out) == 0
    cell = out / "adlm" / "eps-1"
    before = (cell / "ledger.jsonl").read_bytes()
    spent = json.loads((cell / "results.json").read_text())["epsilon"]
    (cell / "results.json").unlink()          # as if the run had stopped after releasing
    assert _small_compare(monkeypatch, out) == 0
    aside = list(out.glob("adlm/eps-1.interrupted-*"))
    assert len(aside) == 1 and (aside[0] / "ledger.jsonl").read_bytes() == before
    assert (cell / "results.json").exists() and (cell / "ledger.jsonl").read_bytes()
    report = (out / "report.md").read_text()
    assert "## Interrupted cells" in report and f"| {aside[0].relative_to(out)} |" in report
    assert f"{spent:.3f}" in report.split("## Interrupted cells")[1]


def test_a_cell_folder_that_released_is_not_run_again(tmp_path):
    """``run_cell`` on a folder whose ledger holds releases refuses: it neither deletes nor adds to that ledger."""
    from task.errors import UserError
    from sim.runners.classification_compare import CellSettings, run_cell

    (tmp_path / "ledger.jsonl").write_text('{"event": "an earlier release"}\n')
    with pytest.raises(UserError, match="earlier run"):
        run_cell(None, "adlm", 1.0, tmp_path, CellSettings(delta=1e-5, seed=0, preset="tiny", progress=False))
    assert (tmp_path / "ledger.jsonl").read_text() == '{"event": "an earlier release"}\n'
