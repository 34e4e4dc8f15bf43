"""``fedpate predict`` / ``evaluate`` on BraTS data as distributed: a case folder or its four modality
files give the same segmentation as the MSD 4D file of the same scan, written in the scan's grid with the
chosen label convention; evaluate on a BraTS folder scores what it scores on the MSD folder."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from sim.cli import main
from task.learning.compute import Compute

CASES = ("BRATS_001", "BRATS_002")


@pytest.fixture(scope="module")
def model_run(tiny_prepared, tmp_path_factory):
    """A tiny U-Net trained briefly on the tiny phantoms (it must predict some tumour of every class)."""
    import torch

    from task.reporting.bundle import preprocessing_of, privacy_card, save_bundle
    from task.learning.networks import build_unet, network_config
    from task.learning.training import TrainConfig, train_segmentation

    torch.manual_seed(0)
    model = train_segmentation(build_unet("tiny"), tiny_prepared.images(), tiny_prepared.labels(),
                               TrainConfig(epochs=8, batch_size=4, learning_rate=5e-3, seed=0, augment=False,
                                           compute=Compute(progress=False))).model
    run = tmp_path_factory.mktemp("run")
    card = privacy_card(method="nonprivate-central", ledger_path=None,
                        data_source=tiny_prepared.source)
    save_bundle(run, model, network_config("tiny"), preprocessing_of(tiny_prepared), card)
    return run


@pytest.fixture(scope="module")
def small_msd(tiny_phantoms, tmp_path_factory):
    """Two cases of the tiny phantoms as their own MSD folder, and the same two in both BraTS layouts."""
    from task.data.brats import convert_msd_folder

    root = tmp_path_factory.mktemp("small")
    meta = json.loads((tiny_phantoms / "dataset.json").read_text())
    msd = root / "msd"
    for sub in ("imagesTr", "labelsTr"):
        (msd / sub).mkdir(parents=True)
    for case in CASES:
        for sub in ("imagesTr", "labelsTr"):
            (msd / sub / f"{case}.nii.gz").write_bytes((tiny_phantoms / sub / f"{case}.nii.gz").read_bytes())
    meta["training"] = [e for e in meta["training"] if e["image"].endswith(tuple(f"{c}.nii.gz" for c in CASES))]
    meta["test"] = []
    (msd / "dataset.json").write_text(json.dumps(meta))
    for layout in ("brats2021", "brats2023"):
        convert_msd_folder(msd, root / layout, layout)
    return root


def _labels(path):
    image = nib.load(path)
    return np.asarray(image.dataobj), image.affine


def test_a_case_folder_and_its_files_segment_like_the_4d_scan(model_run, small_msd, tmp_path, capsys):
    from task.data.layouts import to_ours

    scan = small_msd / "msd" / "imagesTr" / "BRATS_001.nii.gz"
    assert main(["predict", "--model", str(model_run), "--image", str(scan), "--out", str(tmp_path / "msd"),
                 "--no-progress"]) == 0
    reference, affine = _labels(tmp_path / "msd" / "BRATS_001_seg.nii.gz")
    # oedema and enhancing are the codes that move between conventions (1 -> 2, 3 -> 4 in BraTS 2021)
    assert {1, 3} <= set(np.unique(reference).tolist()), "the model must predict oedema and enhancing tumour"

    folder = small_msd / "brats2021" / "BRATS_001"
    assert main(["predict", "--model", str(model_run), "--image", str(folder), "--out", str(tmp_path / "b21"),
                 "--no-progress"]) == 0
    assert "brats2021 label codes" in capsys.readouterr().out
    written, written_affine = _labels(tmp_path / "b21" / "BRATS_001_seg.nii.gz")
    assert written.shape == nib.load(folder / "BRATS_001_flair.nii.gz").shape and np.allclose(written_affine, affine)
    codes = set(np.unique(written).tolist())                             # the input's own convention by default
    assert codes <= {0, 1, 2, 4} and {2, 4} <= codes
    assert np.array_equal(to_ours(written, "brats2021"), reference)

    files = sorted((small_msd / "brats2023" / "BRATS_001").glob("*-t*.nii.gz"))   # t1c, t1n, t2f, t2w: any order
    args = [a for f in files for a in ("--image", str(f))]
    assert main(["predict", "--model", str(model_run), *args, "--out", str(tmp_path / "b23"), "--labels", "msd",
                 "--no-progress"]) == 0
    assert np.array_equal(_labels(tmp_path / "b23" / "BRATS_001_seg.nii.gz")[0], reference)   # --labels msd


def test_a_brats_folder_of_cases_predicts_every_case(model_run, small_msd, tmp_path, capsys):
    assert main(["predict", "--model", str(model_run), "--image", str(small_msd / "brats2023"),
                 "--out", str(tmp_path), "--labels", "brats2021", "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.glob("*_seg.nii.gz")) == [f"{c}_seg.nii.gz" for c in CASES]
    assert set(np.unique(_labels(tmp_path / "BRATS_002_seg.nii.gz")[0]).tolist()) <= {0, 1, 2, 4}


@pytest.mark.parametrize("given, message", [
    (["BRATS_001-t2f.nii.gz", "BRATS_001-t1n.nii.gz", "BRATS_001-t1c.nii.gz"],
     "case BRATS_001 lacks its T2 file (BRATS_001-t2w.nii.gz)"),
    (["BRATS_001-seg.nii.gz"], "is the label map (seg) of case BRATS_001, not a scan"),
])
def test_incomplete_or_wrong_modality_files_are_one_line_errors(model_run, small_msd, tmp_path, capsys, given,
                                                                 message):
    args = [a for name in given for a in ("--image", str(small_msd / "brats2023" / "BRATS_001" / name))]
    assert main(["predict", "--model", str(model_run), *args, "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_a_case_folder_missing_a_modality_names_the_file(model_run, small_msd, tmp_path, capsys):
    import shutil

    folder = tmp_path / "BRATS_002"
    shutil.copytree(small_msd / "brats2021" / "BRATS_002", folder)
    (folder / "BRATS_002_t1ce.nii.gz").unlink()
    assert main(["predict", "--model", str(model_run), "--image", str(folder), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "BRATS_002_t1ce.nii.gz: missing T1-Gd file of case BRATS_002" in err and len(err.splitlines()) == 1


def test_evaluate_reads_brats_folders_and_scores_as_on_msd(model_run, small_msd, tmp_path):
    from task.reporting.predict import EvaluationOptions, evaluate_scans

    msd = evaluate_scans(model_run, small_msd / "msd", EvaluationOptions(compute=Compute(progress=False)))
    for layout in ("brats2021", "brats2023"):
        result = evaluate_scans(model_run, small_msd / layout,
                                EvaluationOptions(out_dir=tmp_path / layout, compute=Compute(progress=False)))
        assert [r["case"] for r in result["cases"]] == list(CASES)
        assert result["dice"] == pytest.approx(msd["dice"])
        seg = layout == "brats2021" and _labels(tmp_path / layout / "BRATS_001_seg.nii.gz")[0]
        if layout == "brats2021":
            assert 4 in seg and 3 not in seg                            # written in the folder's own codes


def test_inspect_and_evaluate_accept_one_case_folder_as_predict_does(model_run, small_msd, tmp_path, capsys):
    """One BraTS case folder given by itself: `predict` segments it, and `data inspect` and `evaluate` read it as a
    dataset of that one case (it scores as that case does inside its folder)."""
    from task.reporting.predict import EvaluationOptions, evaluate_scans

    case = small_msd / "brats2023" / CASES[0]
    assert main(["data", "inspect", str(case)]) == 0
    assert "1 labelled" in capsys.readouterr().out
    whole = evaluate_scans(model_run, small_msd / "brats2023", EvaluationOptions(compute=Compute(progress=False)))
    alone = evaluate_scans(model_run, case, EvaluationOptions(compute=Compute(progress=False)))
    assert [r["case"] for r in alone["cases"]] == [CASES[0]]
    assert alone["cases"][0]["mean"] == pytest.approx(whole["cases"][0]["mean"])
    assert main(["evaluate", "--model", str(model_run), "--data", str(case), "--no-progress",
                 "--no-mirroring"]) == 0
    assert f"{CASES[0]}: mean Dice" in capsys.readouterr().out
