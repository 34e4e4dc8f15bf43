"""The real-scan check (task.reporting.realcheck, sim.report_real): every released model scored on labelled real cases.

Most tests write small synthetic cases in the BraTS layouts with nibabel, so they run everywhere; one test
uses the real development case when it is there (FEDPATE_REAL_DEV, else the folder CI lays out beside the
repository's root: :func:`real_dev_folder`) and is skipped otherwise.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest

from task.errors import UserError
from task.reporting.realcheck import REGIONS

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

    from task.learning.networks import build_unet

    torch.manual_seed(0)
    return build_unet("tiny").eval()


# ------------------------------------------------------------------------------------------ folders
def test_bad_folders_are_one_line_errors_naming_the_option_and_the_folder(tmp_path):
    from task.reporting.realcheck import open_check

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

    from task.reporting.realcheck import open_check

    folder = truncated_cases(tmp_path / "cut", file)
    assert len(nib.load(str(folder / "Case000" / file)).shape) == 3          # the header alone passes
    with pytest.raises(UserError, match=rf"^--real-check {folder}: {file} of case Case000 is not a readable NIfTI"):
        open_check([folder], cache_dir=None)
    assert open_check([folder], cache_dir=None, read=False) is not None      # a worker re-opening reads headers


def test_cases_of_every_layout_and_a_lone_case_folder_are_read_and_a_readme_beside_them_ignored(tmp_path):
    from task.reporting.realcheck import open_check

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
    from task.learning.metrics import per_case_dice, summarise
    from task.reporting.predict import segment_scan
    from task.reporting.realcheck import open_check, score_model

    check = open_check([write_cases(tmp_path / "b21", "brats2021"), write_cases(tmp_path / "b23", "brats2023")],
                       cache_dir=tmp_path / "cache")
    config = PreprocessConfig(grid=(16, 16, 16))
    scored = score_model(tiny_model, config, check)
    image, truth, affine = load_case(check.cases[0].case)
    assert truth.shape == (40, 44, 36) and set(np.unique(truth)) == {0, 1, 2, 3}
    expected = summarise(*per_case_dice(segment_scan(tiny_model, config, image, affine)[None], truth[None]))
    rows = [{k: v for k, v in row.items() if k not in ("case", "folder", "layout", "reference", "volume_ml")}
            for row in scored["cases"]]
    assert rows[0] == pytest.approx(expected) and rows[1] == pytest.approx(expected)
    assert scored["dice"]["WT"] == pytest.approx(expected["WT"]) and scored["seconds"] >= 0
    # each region's volume, the reference's and the model's, in ml of the scan's own voxels
    predicted, voxel_ml = segment_scan(tiny_model, config, image, affine), abs(np.linalg.det(affine[:3, :3])) / 1000
    for row in scored["cases"]:
        for region, classes in {"WT": (1, 2, 3), "TC": (2, 3), "ET": (3,)}.items():
            assert row["volume_ml"][region] == pytest.approx(
                [np.isin(truth, classes).sum() * voxel_ml, np.isin(predicted, classes).sum() * voxel_ml], abs=0.05)


def test_each_case_is_preprocessed_once_and_cached_on_disk(tmp_path, tiny_model, monkeypatch):
    from task.reporting import realcheck
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


def test_write_run_stores_the_check_in_results_and_cells_csv_only_when_given_one(tmp_path, tiny_model):
    from task.data.preprocess import PreprocessConfig
    from task.reporting.realcheck import open_check
    from sim.report import cells_to_csv, load_cells
    from task.reporting.results import ModelRelease, RunResults, write_run

    folder = write_cases(tmp_path / "b23", "brats2023", count=2)
    check = open_check([f"algorithm={folder}"], cache_dir=None)
    preprocessing = {"grid": [16, 16, 16], "config": PreprocessConfig(grid=(16, 16, 16)).to_dict()}

    def release():
        return ModelRelease(tiny_model, {"preset": "tiny"}, preprocessing, {"kind": "test"})

    written = write_run(tmp_path / "cells" / "with", RunResults("public-only"), release(), real_check=check)
    plain = write_run(tmp_path / "cells" / "without", RunResults("public-only"), release())
    assert plain["real_check"] is None
    stored = json.loads((tmp_path / "cells" / "with" / "results.json").read_text())["real_check"]
    assert stored == written["real_check"] and [c["case"] for c in stored["cases"]] == ["Case000", "Case001"]
    assert stored["cases"][0]["reference"] == "algorithm" and stored["cases"][0]["folder"] == str(folder)
    assert stored["folders"] == [{"folder": str(folder), "layout": "brats2023", "cases": ["Case000", "Case001"],
                                  "reference": "algorithm"}]
    rows = {row["cell"]: row for row in csv.DictReader(io.StringIO(cells_to_csv(load_cells(tmp_path / "cells"))))}
    with_row = rows["with"]
    assert with_row["real_cases"] == "2" and float(with_row["real_dice_WT"]) == pytest.approx(stored["dice"]["WT"])
    assert float(with_row["real_dice_region_mean"]) == pytest.approx(np.mean([stored["dice"][k] for k in REGIONS]))
    for key in REGIONS:   # every case's Dice, by case
        per_case = dict(item.split("=") for item in with_row[f"real_per_case_{key}"].split(";"))
        assert per_case.keys() == {"Case000", "Case001"}
        assert float(per_case["Case001"]) == pytest.approx(stored["cases"][1][key], abs=1e-4)
    assert with_row["real_case_references"] == "Case000=algorithm;Case001=algorithm"
    assert rows["without"]["real_dice_WT"] == "" and rows["without"]["real_per_case_WT"] == ""


def test_a_failed_scoring_keeps_the_model_and_says_why(tmp_path, tiny_model, monkeypatch, capsys):
    from task.reporting import realcheck
    from task.reporting.realcheck import open_check

    check = open_check([write_cases(tmp_path / "b23", "brats2023")], cache_dir=None)

    def fail(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(realcheck, "score_model", fail)
    found = realcheck.score_release(check, tiny_model, {"grid": [16, 16, 16]})
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
    assert ("WT 0.500 → 0.900 (+0.400, 1 cases), TC 0.050 → 0.560 (+0.510, 1 cases), ET 0.050 → 0.500 (+0.450, "
            "1 cases). In WT, TC, ET the headroom is not above zero by two standard errors (or too few cases") in text
    # pate-anchored on real WT: (0.63 - 0.50) / 0.40 = +0.33; dp-fedavg: (0.75 - 0.50) / 0.40 = +0.62
    assert "| pate-anchored | 8.00 |" in text and "+0.33 / " in text and "+0.62 / " in text
    # the real ranking is by the mean of WT, TC and ET: pate-anchored (0.63 + 0.22 + 0.10) / 3 = 0.317
    assert ("At ε = 8 the best private method on phantoms is pate-anchored (mean Dice 0.580 on phantoms, 0.317 on "
            "real scans with WT 0.630, TC 0.220, ET 0.100); on real scans it is dp-fedavg (mean Dice 0.410" in text)
    assert "pate-anchored ε=8 is above public-selftrain on phantoms but below it on real scans" in text
    assert "dp-fedavg ε=8 is below public-selftrain on phantoms but above it on real scans" in text
    assert header_line(cells).startswith("Real-scan check: 1 labelled real case(s), pooled: c0 (brats2023 layout, "
                                         "reference not stated, in /real)")


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
    assert "At every seed the phantom and real-scan rankings agree on the best private method" in text


#: four pooled real cases: three with expert references in /gt, one whose reference is an algorithm's in /dev
CASES = (("g0", "/gt", "brats2021", "expert"), ("g1", "/gt", "brats2021", "expert"),
         ("g2", "/gt", "brats2021", "expert"), ("d0", "/dev", "brats2023", "algorithm"))


def _cases_cell(method, phantom, wt, tc, et, epsilon=None, cases=CASES):
    """A results record scored on ``cases``, with per-case WT, TC and ET Dice ``wt``, ``tc``, ``et``."""
    rows = [{"case": c, "folder": f, "layout": layout, "reference": reference, "WT": a, "TC": b, "ET": e,
             "mean": (a + b + e) / 3} for (c, f, layout, reference), a, b, e in zip(cases, wt, tc, et)]
    dice = {k: float(np.mean([r[k] for r in rows])) for k in ("WT", "TC", "ET", "mean")}
    folders = [{"folder": f, "layout": layout, "reference": reference,
                "cases": [c for c, g, _, _ in cases if g == f]} for _, f, layout, reference in
               dict((f, (c, f, layout, reference)) for c, f, layout, reference in cases).values()]
    return {"method": method, "epsilon_budget": epsilon, "dice": {"mean": phantom}, "_cell": method,
            "real_check": {"dice": dice, "cases": rows, "seconds": 2.0, "folders": folders}}


FLOOR_WT, CEILING_WT = [0.50, 0.40, 0.60, 0.50], [0.90, 0.80, 0.90, 0.85]


def _private(method, epsilon, phantom, real_mean):
    """A private model whose real mean of WT, TC and ET is ``real_mean`` (constant over the cases)."""
    return _cases_cell(method, phantom, [real_mean + 0.2] * 4, [real_mean - 0.1] * 4, [real_mean - 0.1] * 4, epsilon)


def _world():
    """Floors and ceiling ranked as on phantoms (they would raise τ if counted), and four private models whose
    phantom and real rankings agree on 4 of 6 pairs (τ = (4 − 2) / 6)."""
    return [_cases_cell("public-only", 0.40, FLOOR_WT, [0.1, 0.2, 0.0, 0.1], [0.1, 0.1, 0.2, 0.0]),
            _cases_cell("public-selftrain", 0.45, [0.55] * 4, [0.15] * 4, [0.15] * 4),
            _cases_cell("nonprivate-central", 0.75, CEILING_WT, [0.6, 0.5, 0.5, 0.6], [0.5, 0.6, 0.4, 0.5]),
            _private("pate-anchored", 1.0, 0.50, 0.30), _private("pate-anchored", 8.0, 0.60, 0.35),
            _private("dp-sgd-central", 1.0, 0.55, 0.45), _private("dp-sgd-central", 8.0, 0.65, 0.40)]


def test_kendall_tau_is_tau_b_with_ties_as_scipy_gives_it():
    from scipy import stats

    from sim.report_real import kendall_tau

    found = kendall_tau([0.50, 0.60, 0.55, 0.65], [0.30, 0.35, 0.45, 0.40])
    assert found["tau"] == pytest.approx(2 / 6) and (found["concordant"], found["discordant"]) == (4, 2)
    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = rng.integers(0, 4, 7).astype(float), rng.integers(0, 4, 7).astype(float)   # many ties
        expected = stats.kendalltau(x, y).statistic
        found = kendall_tau(x, y)
        assert (found is None and np.isnan(expected)) or found["tau"] == pytest.approx(expected)
    assert kendall_tau([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])["tau"] == pytest.approx(-1.0)
    assert kendall_tau([0.5], [0.4]) is None and kendall_tau([0.5, 0.6], [0.4, 0.4]) is None


def test_tau_ranks_every_private_model_and_leaves_out_the_floors_and_the_ceiling():
    from sim.report_real import rank_agreement

    found = rank_agreement(_world())
    assert found["n"] == 4 and found["tau"] == pytest.approx(2 / 6) and found["left_out"] == 0
    assert [label for label, _, _ in found["models"]] == ["dp-sgd-central ε=1", "dp-sgd-central ε=8",
                                                          "pate-anchored ε=1", "pate-anchored ε=8"]
    # a private model scored on other cases than the rest is not comparable: left out, and said so
    other = _private("dp-fedavg", 8.0, 0.9, 0.9)
    other["real_check"]["cases"] = other["real_check"]["cases"][:2]
    assert rank_agreement(_world() + [other])["left_out"] == 1


def test_tau_can_rank_the_phantoms_by_the_real_sides_metric():
    """The phantom side scored as the real side (the mean of the phantom WT, TC and ET) can rank the private models
    otherwise than the mean over the classes: here the class mean reverses every pair, the region mean none."""
    from sim.report_real import phantom_region_mean, rank_agreement

    cells = _world()
    for cell in cells:
        if cell["method"] in ("pate-anchored", "dp-sgd-central"):
            real = cell["real_check"]["dice"]
            # phantom regions in the real order; the class mean in the reverse one
            cell["dice"] = {"WT": real["WT"], "TC": real["TC"], "ET": real["ET"], "mean": 1.0 - real["WT"]}
    assert rank_agreement(cells)["tau"] == pytest.approx(-1.0)
    assert rank_agreement(cells, regions=True)["tau"] == pytest.approx(1.0)
    assert phantom_region_mean({"dice": {"WT": 0.9, "TC": 0.6, "ET": 0.3}}) == pytest.approx(0.6)
    assert phantom_region_mean({"dice": {"mean": 0.5}}) is None


def test_paired_differences_and_headroom_are_paired_over_the_cases_with_their_standard_errors():
    from sim.report_real import paired_over_cases, ratio_over_cases

    cells = {c["method"] + str(c["epsilon_budget"]): c for c in _world()}
    floor, ceiling, pate = cells["public-onlyNone"], cells["nonprivate-centralNone"], cells["pate-anchored8.0"]
    d = np.array([0.55] * 4) - FLOOR_WT
    mean, se, n = paired_over_cases(pate, floor, "WT")
    assert n == 4 and mean == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / 2)
    h = np.array(CEILING_WT) - FLOOR_WT
    ratio, se, n = ratio_over_cases(pate, floor, ceiling, "WT")
    assert ratio == pytest.approx(d.mean() / h.mean())
    assert se == pytest.approx(np.std(d - ratio * h, ddof=1) / 2 / h.mean())
    two = [dict(row) for row in pate["real_check"]["cases"][:2]]   # two cases: a mean, no standard error
    assert paired_over_cases({"real_check": {"cases": two}}, floor, "WT")[1:] == (None, 2)
    # a headroom not above zero by two standard errors (+0.03 ± 0.15 over the cases) gives no share
    flat = _cases_cell("nonprivate-central", 0.7, np.array(FLOOR_WT) + [0.3, -0.2, 0.0, 0.0], [0.1] * 4, [0.1] * 4)
    assert ratio_over_cases(pate, floor, flat, "WT") is None


def test_the_real_scans_section_pools_the_cases_with_their_origin_and_gives_means_tau_and_every_case():
    from sim.report_real import real_section

    text = "\n".join(real_section(_world(), lambda cell: None))
    # every case with its folder and reference; the algorithm's marked wherever it appears
    assert "The 4 real case(s), pooled (every mean below is over all of them; † marks the 1 whose reference" in text
    assert "| g0 | /gt | brats2021 | expert |" in text and "| d0† | /dev | brats2023 | an algorithm's output |" in text
    # headroom per region, paired over the four cases: WT +0.363 ± SE
    h = np.array(CEILING_WT) - FLOOR_WT
    assert f"WT 0.500 → 0.863 (+{h.mean():.3f} ± {h.std(ddof=1) / 2:.3f}, 4 cases)" in text
    # the mean table: real mean of WT, TC, ET; each region's mean with its paired difference to public-only
    row = next(line for line in text.splitlines() if line.startswith("| pate-anchored | 8.00 |"))
    d = np.array([0.55] * 4) - FLOOR_WT
    assert f"| 0.350 | 0.550 ({d.mean():+.3f} ± {d.std(ddof=1) / 2:.3f}) |" in row
    assert f"| {d.mean() / h.mean():+.2f} ± " in row and row.endswith("| 4 | 2.0 |")
    # τ stated with its value, over the private models only, beside both ranks
    assert "**Kendall τ = +0.33**" in text and "of the 4 private models" in text
    assert "| dp-sgd-central ε=8 | 0.650 | 1 | 0.400 | 2 |" in text
    # every case's Dice per method x ε, the algorithm's case marked
    assert "| method | ε budget | K | g0 WT / TC / ET | g1 WT / TC / ET | g2 WT / TC / ET | d0† WT / TC / ET |" in text
    assert "| public-only | — | — | 0.500 / 0.100 / 0.100 | 0.400 / 0.200 / 0.100 | 0.600 / 0.000 / 0.200 | " \
           "0.500 / 0.100 / 0.000 |" in text
    # the best private method at each budget and the order against the floors agree; τ shows the pairs that do not
    assert "The phantom and real-scan rankings agree on the best private method at each budget" in text
    assert "Volume per case" not in text   # results written before volumes were recorded: no table


def test_the_real_scans_section_gives_each_cases_volumes_the_references_first():
    from sim.report_real import real_section

    cells = _world()
    for cell in cells:
        for i, row in enumerate(cell["real_check"]["cases"]):
            row["volume_ml"] = {"WT": [100.0 + i, 80.0], "TC": [30.0, 31.4], "ET": [20.0, 9.6]}
    text = "\n".join(real_section(cells, lambda cell: None))
    assert "Volume per case (ml, the reference's first)" in text
    assert "| method | ε budget | K | g0 WT / TC / ET ml | g1 WT / TC / ET ml | g2 WT / TC / ET ml | " \
           "d0† WT / TC / ET ml |" in text
    assert "| **reference** | | | **100 / 30 / 20** | **101 / 30 / 20** | **102 / 30 / 20** | **103 / 30 / 20** |" in text
    assert "| public-only | — | — | 80 / 31 / 10 | 80 / 31 / 10 | 80 / 31 / 10 | 80 / 31 / 10 |" in text


def test_the_seeds_report_gives_tau_and_the_real_headroom_seed_by_seed():
    from sim.report_seeds import _format_interval, t_interval
    from sim.report_real import seeds_section

    second = _world()
    second[-1] = _private("dp-sgd-central", 8.0, 0.65, 0.50)   # now ranked first on both: τ = (5 − 1) / 6
    text = "\n".join(seeds_section({0: _world(), 1: second}, t_interval, _format_interval))
    assert "| 0 | 4 | +0.33 | 4 / 2 / 0 |" in text and "| 1 | 4 | +0.67 | 5 / 1 / 0 |" in text
    mean_tau = t_interval([2 / 6, 4 / 6])
    assert f"mean τ over seeds **{_format_interval(mean_tau, digits=2, signed=True)}** over 2 seed(s)" in text
    assert "| seed 0: WT / TC / ET | seed 1: WT / TC / ET |" in text
    row = next(line for line in text.splitlines() if line.startswith("| dp-sgd-central | 8 |") and "seeds" not in line
               and line.count("/") >= 4)
    h = (np.array(CEILING_WT) - FLOOR_WT).mean()
    shares = [(0.60 - np.mean(FLOOR_WT)) / h, (0.70 - np.mean(FLOOR_WT)) / h]
    assert f"{shares[0]:+.2f} / " in row and f"{shares[1]:+.2f} / " in row
    assert "| d0† | /dev | brats2023 | an algorithm's output |" in text


def test_folders_take_a_reference_kind_and_a_bad_kind_is_one_line(tmp_path):
    from task.options import Reference
    from task.reporting.realcheck import open_check, parse_folder

    gt, dev = write_cases(tmp_path / "gt", "brats2021", count=2), write_cases(tmp_path / "dev", "brats2023", seed=5)
    check = open_check([f"expert={gt}", f"algorithm={dev}"], cache_dir=None)
    assert [(c.case_id, c.reference) for c in check.cases] == [
        ("Case000", Reference.EXPERT), ("Case001", Reference.EXPERT), ("Case005", Reference.ALGORITHM)]
    assert [d["reference"] for d in check.describe()] == ["expert", "algorithm"]
    assert open_check(check.specs, cache_dir=None) == check          # what workers re-open it from
    assert open_check([gt], cache_dir=None).describe()[0]["reference"] is None
    odd = tmp_path / "a=b"                                          # a folder whose name holds '=' is that folder
    write_cases(odd, "brats2021")
    assert parse_folder(str(odd)) == (str(odd), None)
    with pytest.raises(UserError) as caught:
        open_check([f"robot={gt}"])
    assert str(caught.value).startswith(f"--real-check robot={gt}: reference kind: unknown value 'robot'")
    assert "expert" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UserError, match=r"no folder after algorithm="):
        open_check(["algorithm="])


def test_the_demo_summary_names_every_case_its_folder_and_tau():
    from sim.commands.demo import real_check_summary

    text = "\n".join(real_check_summary(_world()))
    assert "real-scan check on 4 labelled real case(s), pooled" in text
    assert "d0 from /dev (reference: an algorithm's output)" in text and "g1 from /gt (reference: expert)" in text
    assert "Kendall tau, phantom against real ranking of the private models: +0.33 over 4 models" in text


# ------------------------------------------------------------------------------------------ the command line
def test_demo_reads_the_environment_and_names_it_in_errors(tmp_path, monkeypatch):
    import argparse

    from sim.commands.common import open_real_check

    folder = write_cases(tmp_path / "b23", "brats2023")
    monkeypatch.setenv("FEDPATE_REAL_CHECK", f"{folder}{os.pathsep}")
    args = argparse.Namespace(real_check=None)
    assert open_real_check(args, environment=True).folders == (str(folder),)
    assert open_real_check(args) is None                                    # compare reads no environment
    other = write_cases(tmp_path / "dev", "brats2023", seed=3)              # every folder, each with its reference
    monkeypatch.setenv("FEDPATE_REAL_CHECK", f"expert={folder}{os.pathsep}algorithm={other}")
    opened = open_real_check(args, environment=True)
    assert opened.specs == (f"expert={folder}", f"algorithm={other}") and len(opened.cases) == 2
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
    folder, other = write_cases(tmp_path / "real", "brats2021"), write_cases(tmp_path / "dev", "brats2023", seed=7)
    out = tmp_path / "cmp"
    assert main(["compare", "--preset", "tiny", "--methods", "public-only,nonprivate-central", "--epsilons", "8",
                 "--out", str(out), "--no-progress", "--workers", "1", "--real-check", str(folder),
                 "--real-check", f"algorithm={other}"]) == 0
    for cell in ("public-only", "nonprivate-central"):
        found = json.loads((out / cell / "results.json").read_text())["real_check"]
        assert [(c["case"], c["layout"], c["reference"]) for c in found["cases"]] == [
            ("Case000", "brats2021", None), ("Case007", "brats2023", "algorithm")]
        assert all(0.0 <= found["dice"][k] <= 1.0 for k in ("WT", "TC", "ET") if found["dice"][k] is not None)
    report = (out / "report.md").read_text()
    assert "## Real scans" in report and ("Real-scan check: 2 labelled real case(s), pooled: Case000 (brats2021 "
                                          "layout, reference not stated") in report
    assert f"| Case007† | {other} | brats2023 | an algorithm's output |" in report
    assert "| method | ε budget | K | Case000 WT / TC / ET | Case007† WT / TC / ET |" in report
    assert json.loads((out / "compare.json").read_text())["real_check"] == [str(folder), f"algorithm={other}"]


def real_dev_folder() -> Path | None:
    """The real development case: FEDPATE_REAL_DEV, else CI's layout (a folder beside the repository's root)."""
    folder = Path(os.environ.get("FEDPATE_REAL_DEV") or ROOT.parent / "shared" / "data" / "real-dev")
    return folder if folder.is_dir() else None


@pytest.mark.skipif(real_dev_folder() is None, reason="no real development case (FEDPATE_REAL_DEV)")
def test_the_real_development_case_is_read_in_its_own_grid_and_scored(tmp_path, tiny_model):
    from task.data.preprocess import PreprocessConfig
    from task.reporting.realcheck import open_check, score_model

    check = open_check([real_dev_folder()], cache_dir=tmp_path)
    assert check.cases and {c.layout for c in check.cases} <= {"msd", "brats2021", "brats2023"}
    scored = score_model(tiny_model, PreprocessConfig(grid=(16, 16, 16)), check)
    assert len(scored["cases"]) == len(check.cases)
    assert all(v is None or 0.0 <= v <= 1.0 for row in scored["cases"] for k, v in row.items()
               if k in ("1", "2", "3", "mean", "WT", "TC", "ET"))


def test_counted_dice_and_the_class_argmax_agree_with_monai_and_numpy():
    """The real-scan check's fast paths give the one metric's numbers (task.learning.metrics.per_case_dice, MONAI) and
    numpy's argmax, ties included, on label maps with empty classes and both-empty cases."""
    from task.learning.metrics import per_case_dice, per_case_dice_counted
    from task.reporting.predict import class_argmax

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
