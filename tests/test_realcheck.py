"""The real-scan check (task.realcheck, sim.report_real): every released model scored on labelled real cases.

Most tests write small synthetic cases in the BraTS layouts with nibabel, so they run everywhere; one test
uses the real development case when it is there (FEDPATE_REAL_DEV, else the folder CI lays out beside the
repository's root: :func:`real_dev_folder`) and is skipped otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from task.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def synthetic_case(seed: int = 0, shape=(40, 44, 36)):
    """(image (X, Y, Z, 4) in our channel order, label in our classes): an ellipsoid brain, a nested tumour."""
    rng = np.random.default_rng(seed)
    axes = np.meshgrid(*[np.arange(s, dtype=np.float32) for s in shape], indexing="ij")
    centre = np.array(shape) / 2
    brain = sum(((a - c) / r) ** 2 for a, c, r in zip(axes, centre, (16, 18, 14))) < 1
    distance = np.sqrt((axes[0] - centre[0] - 3) ** 2 + (axes[1] - centre[1]) ** 2 + (axes[2] - centre[2] + 2) ** 2)
    label = np.zeros(shape, np.uint8)
    label[(distance < 7) & brain] = 1
    label[distance < 4] = 2
    label[distance < 2.5] = 3
    image = np.zeros(shape + (4,), np.float32)
    for channel in range(4):
        image[..., channel] = np.where(brain, 1 + 0.2 * rng.random(shape) + 0.3 * (channel + 1) * label, 0)
    return image, label


def write_cases(folder: Path, layout: str, count: int = 1, seed: int = 0) -> Path:
    from task.data.brats import write_case

    for index in range(count):
        image, label = synthetic_case(seed + index)
        write_case(folder, f"Case{seed + index:03d}", image, label, np.diag([1.0, 1.0, 1.0, 1.0]), layout)
    return folder


@pytest.fixture()
def tiny_model():
    import torch

    from task.networks import build_unet

    torch.manual_seed(0)
    return build_unet("tiny").eval()


# ------------------------------------------------------------------------------------------ folders
def test_bad_folders_are_one_line_errors_naming_the_option_and_the_folder(tmp_path):
    from task.realcheck import open_check

    unlabelled = tmp_path / "unlabelled"
    from task.data.brats import write_case

    image, _ = synthetic_case()
    write_case(unlabelled, "Case000", image, None, np.eye(4), "brats2023")
    broken = write_cases(tmp_path / "broken", "brats2023")
    (broken / "Case000" / "Case000-t2w.nii.gz").write_bytes(b"not a nifti")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for folder, expected in [(tmp_path / "absent", "no such folder"), (tmp_path / "file.txt", "got a file"),
                             (tmp_path / "empty", "no dataset.json"), (unlabelled, "missing label map"),
                             (broken, "not a readable NIfTI")]:
        with pytest.raises(UserError) as caught:
            open_check([folder])
        message = str(caught.value)
        assert message.startswith(f"--real-check {folder}: ") and expected in message and "\n" not in message
    assert open_check([]) is None and open_check(None) is None


def truncated_cases(folder: Path, file: str = "Case000-t2w.nii.gz") -> Path:
    """A labelled case whose file's header reads but whose data is cut short (a copy that stopped half-way)."""
    write_cases(folder, "brats2023")
    path = folder / "Case000" / file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return folder


@pytest.mark.parametrize("file", ["Case000-t2w.nii.gz", "Case000-seg.nii.gz"])
def test_a_case_whose_header_reads_but_whose_data_is_truncated_is_refused_when_opened(tmp_path, file):
    import nibabel as nib

    from task.realcheck import open_check

    folder = truncated_cases(tmp_path / "cut", file)
    assert len(nib.load(str(folder / "Case000" / file)).shape) == 3          # the header alone passes
    with pytest.raises(UserError, match=rf"^--real-check {folder}: {file} of case Case000 is not a readable NIfTI"):
        open_check([folder], cache_dir=None)
    assert open_check([folder], cache_dir=None, read=False) is not None      # a worker re-opening reads headers


def test_cases_of_every_layout_and_a_lone_case_folder_are_read_and_a_readme_beside_them_ignored(tmp_path):
    from task.realcheck import open_check

    write_cases(tmp_path / "b21", "brats2021", count=2)
    write_cases(tmp_path / "b23", "brats2023")
    (tmp_path / "b23" / "README.md").write_text("# whatever the user wrote: not parsed")
    check = open_check([tmp_path / "b21", tmp_path / "b23", tmp_path / "b23" / "Case000"], cache_dir=None)
    assert [(d["layout"], d["cases"]) for d in check.describe()] == [
        ("brats2021", ["Case000", "Case001"]), ("brats2023", ["Case000"]), ("brats2023", ["Case000"])]


# ------------------------------------------------------------------------------------------ scoring
def test_scores_equal_evaluate_in_each_case_own_grid_whatever_the_layout(tmp_path, tiny_model):
    """The check scores as `fedpate evaluate` does (segment_scan in the scan's grid, Dice in our classes): the
    same numbers, and the same for a case in BraTS 2021 codes (ET = 4) as in BraTS 2023 codes (ET = 3)."""
    from task.data.msd import load_case
    from task.data.preprocess import PreprocessConfig
    from task.metrics import per_case_dice, summarise
    from task.predict import segment_scan
    from task.realcheck import open_check, score_model

    check = open_check([write_cases(tmp_path / "b21", "brats2021"), write_cases(tmp_path / "b23", "brats2023")],
                       cache_dir=tmp_path / "cache")
    config = PreprocessConfig(grid=(16, 16, 16))
    scored = score_model(tiny_model, config, check)
    image, truth, affine = load_case(check.cases[0].case)
    assert truth.shape == (40, 44, 36) and set(np.unique(truth)) == {0, 1, 2, 3}
    expected = summarise(*per_case_dice(segment_scan(tiny_model, config, image, affine)[None], truth[None]))
    rows = [{k: v for k, v in row.items() if k not in ("case", "folder", "layout")} for row in scored["cases"]]
    assert rows[0] == pytest.approx(expected) and rows[1] == pytest.approx(expected)
    assert scored["dice"]["WT"] == pytest.approx(expected["WT"]) and scored["seconds"] >= 0


def test_each_case_is_preprocessed_once_and_cached_on_disk(tmp_path, tiny_model, monkeypatch):
    from task import realcheck
    from task.data.preprocess import PreprocessConfig

    check = realcheck.open_check([write_cases(tmp_path / "b23", "brats2023")], cache_dir=tmp_path / "cache")
    config = PreprocessConfig(grid=(16, 16, 16))
    calls = []
    original = realcheck.load_case
    monkeypatch.setattr(realcheck, "load_case", lambda case: calls.append(case.case_id) or original(case))
    monkeypatch.setattr(realcheck, "_MEMORY", type(realcheck._MEMORY)())
    first = realcheck.score_model(tiny_model, config, check)
    second = realcheck.score_model(tiny_model, config, check)
    assert calls == ["Case000"] and first["cases"] == second["cases"]
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    realcheck._MEMORY.clear()                  # another process: from the disk cache, the same scores
    assert realcheck.score_model(tiny_model, config, check)["cases"] == first["cases"] and calls == ["Case000"]
    realcheck.score_model(tiny_model, PreprocessConfig(grid=(8, 8, 8)), check)   # another grid: prepared anew
    assert calls == ["Case000", "Case000"]


def test_write_run_stores_the_check_in_results_and_cells_csv_only_while_active(tmp_path, tiny_model):
    from task.data.preprocess import PreprocessConfig
    from task.realcheck import open_check, scoring
    from sim.report import cells_to_csv, load_cells
    from task.results import ModelRelease, RunResults, write_run

    check = open_check([write_cases(tmp_path / "b23", "brats2023")], cache_dir=None)
    preprocessing = {"grid": [16, 16, 16], "config": PreprocessConfig(grid=(16, 16, 16)).to_dict()}

    def release():
        return ModelRelease(tiny_model, {"preset": "tiny"}, preprocessing, {"kind": "test"})

    with scoring(check):
        written = write_run(tmp_path / "cells" / "with", RunResults("public-only"), release())
    plain = write_run(tmp_path / "cells" / "without", RunResults("public-only"), release())
    assert plain["real_check"] is None
    stored = json.loads((tmp_path / "cells" / "with" / "results.json").read_text())["real_check"]
    assert stored == written["real_check"] and stored["cases"][0]["case"] == "Case000"
    assert stored["folders"] == [{"folder": str(tmp_path / "b23"), "layout": "brats2023", "cases": ["Case000"]}]
    rows = {r.split(",")[0]: r for r in cells_to_csv(load_cells(tmp_path / "cells")).splitlines()}
    header = rows["cell"].split(",")
    assert {"real_cases", "real_dice_WT", "real_dice_TC", "real_dice_ET"} <= set(header)
    with_row = dict(zip(header, rows["with"].split(",")))
    assert with_row["real_cases"] == "1" and float(with_row["real_dice_WT"]) == pytest.approx(stored["dice"]["WT"])
    assert dict(zip(header, rows["without"].split(",")))["real_dice_WT"] == ""


def test_a_failed_scoring_keeps_the_model_and_says_why(tmp_path, tiny_model, monkeypatch, capsys):
    from task import realcheck
    from task.realcheck import open_check, scoring

    check = open_check([write_cases(tmp_path / "b23", "brats2023")], cache_dir=None)

    def fail(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(realcheck, "score_model", fail)
    with scoring(check):
        found = realcheck.score_release(tiny_model, {"grid": [16, 16, 16]})
    assert found["error"] == "MemoryError: no room" and "scoring failed" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ the report
def _cell(method, phantom, real, epsilon=None, per_case=None):
    """A results record with phantom mean Dice ``phantom`` and real (WT, TC, ET, mean) Dice ``real``."""
    wt, tc, et, mean = real
    dice = {"1": mean, "2": mean, "3": mean, "mean": mean, "WT": wt, "TC": tc, "ET": et}
    cases = per_case or [{"case": "c0", "folder": "/real", "layout": "brats2023", **dice}]
    return {"method": method, "epsilon_budget": epsilon, "dice": {"mean": phantom}, "_cell": method,
            "real_check": {"dice": dice, "cases": cases, "seconds": 1.5,
                           "folders": [{"folder": "/real", "layout": "brats2023", "cases": ["c0"]}]}}


def test_the_real_scans_section_gives_headroom_and_every_ranking_disagreement():
    from sim.report_real import header_line, real_section

    cells = [_cell("public-only", 0.40, (0.50, 0.05, 0.05, 0.20)),
             _cell("public-selftrain", 0.42, (0.80, 0.25, 0.20, 0.42)),
             _cell("nonprivate-central", 0.70, (0.90, 0.56, 0.50, 0.65)),
             _cell("pate-anchored", 0.58, (0.63, 0.22, 0.10, 0.30), epsilon=8.0),
             _cell("dp-fedavg", 0.41, (0.75, 0.41, 0.30, 0.50), epsilon=8.0)]
    text = "\n".join(real_section(cells, lambda cell: None))
    assert "## Real scans" in text
    assert "WT 0.500 → 0.900 (+0.400), TC 0.050 → 0.560 (+0.510), ET 0.050 → 0.500 (+0.450)" in text
    # pate-anchored on real WT: (0.63 - 0.50) / 0.40 = +0.33; dp-fedavg: (0.75 - 0.50) / 0.40 = +0.62
    assert "| pate-anchored | 8.00 |" in text and "+0.33 / " in text and "+0.62 / " in text
    assert ("At ε = 8 the best private method on phantoms is pate-anchored (mean Dice 0.580 on phantoms, 0.300 on "
            "real scans with WT 0.630, TC 0.220, ET 0.100); on real scans it is dp-fedavg (mean Dice 0.410" in text)
    assert "pate-anchored ε=8 is above public-selftrain on phantoms but below it on real scans" in text
    assert "dp-fedavg ε=8 is below public-selftrain on phantoms but above it on real scans" in text
    assert header_line(cells).startswith("Real-scan check: 1 labelled real case(s): c0 (brats2023 layout, in /real)")


def test_without_real_cases_the_report_says_so_in_one_line():
    from sim.report_real import NONE_GIVEN, header_line, real_section

    cells = [{"method": "public-only", "dice": {"mean": 0.4}, "real_check": None}]
    assert header_line(cells) == NONE_GIVEN and "\n" not in NONE_GIVEN and real_section(cells) == []


def test_real_headroom_pairs_cases_and_gives_a_standard_error_from_three_cases():
    from sim.report_real import ratio_over_cases

    def cell(values):
        return {"real_check": {"cases": [{"case": f"c{i}", "folder": "/r", "WT": v} for i, v in enumerate(values)]}}

    floor, ceiling, mine = cell([0.5, 0.4, 0.6]), cell([0.9, 0.8, 0.9]), cell([0.7, 0.6, 0.75])
    ratio, se, n = ratio_over_cases(mine, floor, ceiling, "WT")
    assert n == 3 and ratio == pytest.approx((0.2 + 0.2 + 0.15) / (0.4 + 0.4 + 0.3)) and se is not None and se > 0
    assert ratio_over_cases(cell([0.7]), cell([0.5]), cell([0.9]), "WT")[1] is None   # one case: no SE
    assert ratio_over_cases(mine, ceiling, floor, "WT") is None                        # no positive headroom


def test_the_seeds_report_aggregates_the_real_check_across_seeds(tmp_path):
    from sim.report_seeds import _format_interval, t_interval
    from sim.report_real import seeds_section

    per_seed = {seed: [_cell("public-only", 0.40, (0.50 + d, 0.05, 0.05, 0.20)),
                       _cell("nonprivate-central", 0.70, (0.90, 0.56, 0.50, 0.65)),
                       _cell("pate-anchored", 0.58, (0.70 + d, 0.22, 0.10, 0.30), epsilon=8.0)]
                for seed, d in ((0, 0.0), (1, 0.1))}
    text = "\n".join(seeds_section(per_seed, t_interval, _format_interval))
    row = next(line for line in text.splitlines() if line.startswith("| pate-anchored"))
    # real WT 0.70 and 0.80 -> mean 0.750; real headroom WT (0.2 / 0.4, 0.2 / 0.3) -> mean +0.583
    assert "| 0,1 |" in row and "0.750 ± " in row and "+0.583 ± " in row
    assert "The phantom and real-scan rankings agree at every seed." in text


# ------------------------------------------------------------------------------------------ the command line
def test_demo_reads_the_environment_and_names_it_in_errors(tmp_path, monkeypatch):
    import argparse

    from sim.commands.common import open_real_check

    folder = write_cases(tmp_path / "b23", "brats2023")
    monkeypatch.setenv("FEDPATE_REAL_CHECK", f"{folder}{os.pathsep}")
    args = argparse.Namespace(real_check=None)
    assert open_real_check(args, environment=True).folders == (str(folder),)
    assert open_real_check(args) is None                                    # compare reads no environment
    monkeypatch.setenv("FEDPATE_REAL_CHECK", str(tmp_path / "absent"))
    with pytest.raises(UserError, match=r"^FEDPATE_REAL_CHECK .*absent: no such folder$"):
        open_real_check(args, environment=True)


@pytest.mark.parametrize("command", [["compare", "--methods", "public-only", "--epsilons", "8"],
                                     ["central", "--method", "nonprivate"],
                                     ["simulate", "--method", "pate-ae", "--engine", "inprocess"], ["demo"]])
def test_a_bad_folder_is_refused_before_anything_runs(tmp_path, capsys, command):
    from sim.cli import main

    out = tmp_path / "out"
    code = main([*command, "--preset", "tiny", "--out", str(out), "--real-check", str(tmp_path / "absent")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].endswith(f"error: --real-check {tmp_path / 'absent'}: no such folder")
    assert not out.exists()
    cut = truncated_cases(tmp_path / "cut")   # every command that takes --real-check reads every case whole first
    code = main([*command, "--preset", "tiny", "--out", str(out), "--real-check", str(cut)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Case000-t2w.nii.gz of case Case000 is not a readable NIfTI" in err[0]
    assert not out.exists()


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_tiny_comparison_scores_every_model_on_the_real_cases(tmp_path, monkeypatch):
    from sim.cli import main

    monkeypatch.setenv("FEDPATE_CACHE", str(tmp_path / "cache"))
    folder = write_cases(tmp_path / "real", "brats2021")
    out = tmp_path / "cmp"
    assert main(["compare", "--preset", "tiny", "--methods", "public-only,nonprivate-central", "--epsilons", "8",
                 "--out", str(out), "--no-progress", "--workers", "1", "--real-check", str(folder)]) == 0
    for cell in ("public-only", "nonprivate-central"):
        found = json.loads((out / cell / "results.json").read_text())["real_check"]
        assert found["cases"][0]["case"] == "Case000" and found["cases"][0]["layout"] == "brats2021"
        assert all(0.0 <= found["dice"][k] <= 1.0 for k in ("WT", "TC", "ET") if found["dice"][k] is not None)
    report = (out / "report.md").read_text()
    assert "## Real scans" in report and "Real-scan check: 1 labelled real case(s): Case000 (brats2021 layout" in report
    assert json.loads((out / "compare.json").read_text())["real_check"] == [str(folder)]


def real_dev_folder() -> Path | None:
    """The real development case: FEDPATE_REAL_DEV, else CI's layout (a folder beside the repository's root)."""
    folder = Path(os.environ.get("FEDPATE_REAL_DEV") or ROOT.parent / "shared" / "data" / "real-dev")
    return folder if folder.is_dir() else None


@pytest.mark.skipif(real_dev_folder() is None, reason="no real development case (FEDPATE_REAL_DEV)")
def test_the_real_development_case_is_read_in_its_own_grid_and_scored(tmp_path, tiny_model):
    from task.data.preprocess import PreprocessConfig
    from task.realcheck import open_check, score_model

    check = open_check([real_dev_folder()], cache_dir=tmp_path)
    assert check.cases and {c.layout for c in check.cases} <= {"msd", "brats2021", "brats2023"}
    scored = score_model(tiny_model, PreprocessConfig(grid=(16, 16, 16)), check)
    assert len(scored["cases"]) == len(check.cases)
    assert all(v is None or 0.0 <= v <= 1.0 for row in scored["cases"] for k, v in row.items()
               if k in ("1", "2", "3", "mean", "WT", "TC", "ET"))


def test_counted_dice_and_the_class_argmax_agree_with_monai_and_numpy():
    """The real-scan check's fast paths give the one metric's numbers (task.metrics.per_case_dice, MONAI) and
    numpy's argmax, ties included, on label maps with empty classes and both-empty cases."""
    from task.metrics import per_case_dice, per_case_dice_counted
    from task.predict import class_argmax

    rng = np.random.default_rng(3)
    pred = rng.integers(0, 4, (4, 9, 8, 7)).astype(np.uint8)
    true = rng.integers(0, 4, (4, 9, 8, 7)).astype(np.uint8)
    pred[1][pred[1] == 3] = 0                       # a class the prediction lacks
    true[2][true[2] >= 2] = 1                       # a truth without core
    pred[3], true[3] = 0, 0                         # both empty: excluded (NaN)
    for fast, slow in zip(per_case_dice_counted(pred, true), per_case_dice(pred, true)):
        np.testing.assert_allclose(fast, slow, rtol=1e-6, equal_nan=True)
    assert np.isnan(per_case_dice_counted(pred, true)[0][3]).all()
    probs = rng.integers(0, 3, (4, 6, 5, 4)).astype(np.float32)   # many ties
    assert (class_argmax(probs) == np.argmax(probs, axis=0)).all()
