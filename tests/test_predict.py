"""``fedpate predict``: label maps in each scan's own grid, overlapping the phantom's labels; bad input
gets a one-line error naming the file, and outputs already written survive a later failure."""

import gzip
import json

import nibabel as nib
import numpy as np
import pytest

from sim.cli import main
from task.learning.compute import Compute
from task.errors import UserError


@pytest.fixture(scope="module")
def trained_run(tiny_prepared, tmp_path_factory):
    """A small U-Net trained on the tiny phantoms, saved as a (non-private) bundle."""
    import torch

    from task.reporting.bundle import preprocessing_of, privacy_card, save_bundle
    from task.learning.networks import build_unet, network_config
    from task.learning.training import TrainConfig, train_segmentation

    torch.manual_seed(0)
    images, labels = tiny_prepared.images(), tiny_prepared.labels()
    model = train_segmentation(build_unet("tiny"), images, labels,
                               TrainConfig(epochs=12, batch_size=4, learning_rate=5e-3, seed=0, augment=False,
                                           compute=Compute(progress=False))).model
    run = tmp_path_factory.mktemp("run")
    card = privacy_card(method="nonprivate-central", ledger_path=None,
                        data_source=tiny_prepared.source)
    save_bundle(run, model, network_config("tiny"), preprocessing_of(tiny_prepared), card)
    return run


def _training_scans(root, n=2):
    dataset = json.loads((root / "dataset.json").read_text())
    return [(root / e["image"], root / e["label"]) for e in dataset["training"][:n]]


def test_predictions_land_in_the_scan_grid_and_overlap_the_tumour(trained_run, tiny_phantoms, tmp_path):
    from task.reporting.predict import predict_scans

    scans = _training_scans(tiny_phantoms)
    predictions = predict_scans(trained_run, [s for s, _ in scans], tmp_path, progress=False)
    for (scan, label_path), prediction in zip(scans, predictions):
        image, out, truth = nib.load(scan), nib.load(prediction.output), nib.load(label_path)
        assert out.shape == image.shape[:3]
        np.testing.assert_allclose(out.affine, image.affine)
        predicted = np.asarray(out.dataobj)
        assert predicted.dtype == np.uint8 and set(np.unique(predicted)) <= {0, 1, 2, 3}
        truth = np.asarray(truth.dataobj) > 0
        whole = predicted > 0
        dice = 2 * (whole & truth).sum() / (whole.sum() + truth.sum())
        assert dice > 0.3, f"{scan.name}: whole-tumour Dice {dice:.2f}"
        voxel_ml = abs(np.linalg.det(image.affine[:3, :3])) / 1000
        assert prediction.volumes_ml[1] == pytest.approx((predicted == 1).sum() * voxel_ml)


def test_a_shifted_affine_is_preserved(trained_run, tiny_phantoms, tmp_path):
    from task.reporting.predict import predict_scans

    scan, _ = _training_scans(tiny_phantoms, 1)[0]
    image = nib.load(scan)
    shifted_affine = image.affine.copy()
    shifted_affine[:3, 3] += [12.5, -7.0, 30.0]
    shifted = tmp_path / "shifted.nii.gz"
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj), shifted_affine, image.header), shifted)
    original, moved = predict_scans(trained_run, [scan, shifted], tmp_path / "out", progress=False)
    moved_image = nib.load(moved.output)
    np.testing.assert_allclose(moved_image.affine, shifted_affine)
    assert np.array_equal(np.asarray(moved_image.dataobj), np.asarray(nib.load(original.output).dataobj))


def _bad_scans(tmp_path, tiny_phantoms):
    scan, _ = _training_scans(tiny_phantoms, 1)[0]
    image = nib.load(scan)
    data = np.asarray(image.dataobj).astype(np.float32)
    cases = {}

    def save(name, array, affine=image.affine):
        path = tmp_path / name
        nib.save(nib.Nifti1Image(array, affine), path)
        cases[name] = path

    save("three_d.nii.gz", data[..., 0])
    save("three_channels.nii.gz", data[..., :3])
    with_nan = data.copy()
    with_nan[5, 5, 5, 0] = np.nan
    save("nan.nii.gz", with_nan)
    singular = image.affine.copy()
    singular[:3, :3] = 0
    broken = nib.Nifti1Image(data, None)   # only the sform carries the (singular) affine
    broken.set_sform(singular, code=1)
    broken.set_qform(None, code=0)
    nib.save(broken, tmp_path / "singular.nii.gz")
    cases["singular.nii.gz"] = tmp_path / "singular.nii.gz"
    save("empty.nii.gz", np.zeros_like(data))
    truncated = tmp_path / "truncated.nii.gz"
    truncated.write_bytes(scan.read_bytes()[:200])
    cases["truncated.nii.gz"] = truncated
    not_gzip = tmp_path / "text.nii.gz"
    not_gzip.write_text("not an image")
    cases["text.nii.gz"] = not_gzip
    cases["missing.nii.gz"] = tmp_path / "missing.nii.gz"
    return cases


@pytest.mark.parametrize("name, message", [
    ("three_d.nii.gz", "expected a 4D image"), ("three_channels.nii.gz", "expected 4 channels"),
    ("nan.nii.gz", "non-finite"), ("singular.nii.gz", "not invertible"), ("empty.nii.gz", "empty"),
    ("truncated.nii.gz", "not a readable NIfTI"), ("text.nii.gz", "not a readable NIfTI"),
    ("missing.nii.gz", "not found"),
])
def test_bad_scans_get_one_line_errors_naming_the_file(trained_run, tiny_phantoms, tmp_path, capsys, name, message):
    bad = _bad_scans(tmp_path, tiny_phantoms)[name]
    status = main(["predict", "--model", str(trained_run), "--image", str(bad), "--out", str(tmp_path / "o"),
                   "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and name in err and message in err, err


def test_outputs_written_before_a_failing_scan_are_kept(trained_run, tiny_phantoms, tmp_path):
    from task.reporting.predict import predict_scans

    good, _ = _training_scans(tiny_phantoms, 1)[0]
    bad = _bad_scans(tmp_path, tiny_phantoms)["nan.nii.gz"]
    with pytest.raises(UserError, match="nan.nii.gz"):
        predict_scans(trained_run, [good, bad], tmp_path / "out", progress=False)
    written = list((tmp_path / "out").glob("*_seg.nii.gz"))
    assert [p.name for p in written] == [good.name.replace(".nii.gz", "_seg.nii.gz")]
    assert nib.load(written[0]).shape == nib.load(good).shape[:3]


def test_missing_model_is_a_one_line_error(tmp_path, capsys, tiny_phantoms):
    scan, _ = _training_scans(tiny_phantoms, 1)[0]
    assert main(["predict", "--model", str(tmp_path / "nope"), "--image", str(scan), "--out", str(tmp_path)]) == 2
    assert "no model bundle" in capsys.readouterr().err


def test_msd_folder_as_input(trained_run, tiny_phantoms, tmp_path, capsys):
    assert main(["predict", "--model", str(trained_run), "--image", str(tiny_phantoms), "--out", str(tmp_path),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "not private" in out and out.count(" ml (") == len(list((tiny_phantoms / "imagesTs").glob("*.nii.gz")))
    assert gzip.open(next(tmp_path.glob("*_seg.nii.gz"))).read(4)  # real gzip-compressed NIfTI


def test_evaluate_scores_the_predicted_label_maps_in_each_scan_grid(trained_run, tiny_phantoms, tmp_path, capsys):
    """`fedpate evaluate` = predict + Dice against labelsTr in the scan's own grid, checked independently."""
    from task.learning.metrics import dice_scores

    report = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(trained_run), "--data", str(tiny_phantoms), "--out", str(tmp_path / "seg"),
                 "--json", str(report), "--limit", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "3 cases: mean Dice" in out
    result = json.loads(report.read_text())
    assert [row["case"] for row in result["cases"]] == ["BRATS_001", "BRATS_002", "BRATS_003"]
    for (scan, label_path), row in zip(_training_scans(tiny_phantoms, 3), result["cases"]):
        predicted = np.asarray(nib.load(tmp_path / "seg" / f"{row['case']}_seg.nii.gz").dataobj)
        truth = np.asarray(nib.load(label_path).dataobj)
        assert predicted.shape == truth.shape
        expected = dice_scores(predicted[None], truth[None])
        assert row["WT"] == pytest.approx(expected["WT"]) and row["mean"] == pytest.approx(expected["mean"])
    assert result["dice"]["WT"] > 0.3


def test_bundles_from_before_antialiasing_repeat_their_preprocessing(trained_run, tmp_path):
    import shutil

    from task.reporting.predict import _bundle_model

    assert _bundle_model(trained_run, "cpu")[1].antialias is True
    old = tmp_path / "old"
    shutil.copytree(trained_run, old)
    from task.reporting.bundle import seal_bundle

    bundle = json.loads((old / "model" / "bundle.json").read_text())
    del bundle["preprocessing"]["config"]["antialias"]
    seal_bundle(old / "model", bundle)   # as such a bundle was written (its digest covers the preprocessing)
    assert _bundle_model(old, "cpu")[1].antialias is False


def test_no_tumour_is_predicted_outside_the_brain(tiny_phantoms):
    """segment_scan keeps labels inside the brain (voxels where any channel is non-zero), even for a network
    that calls every voxel of its working grid enhancing tumour."""
    import torch

    from task.data.msd import load_case, read_msd
    from task.data.preprocess import PreprocessConfig
    from task.reporting.predict import segment_scan

    class EverythingEnhancing(torch.nn.Module):
        def forward(self, x):
            logits = torch.zeros((x.shape[0], 4, *x.shape[2:]))
            logits[:, 3] = 10.0
            return logits

    image, _, affine = load_case(read_msd(tiny_phantoms).training[0])
    labels = segment_scan(EverythingEnhancing(), PreprocessConfig(grid=(16, 16, 16)), image, affine)
    brain = np.any(image != 0, axis=-1)
    assert labels.shape == brain.shape and 0 < brain.mean() < 1
    assert (labels[brain] == 3).all() and not labels[~brain].any()


def test_two_inputs_writing_one_file_are_refused_before_anything_is_written(trained_run, tiny_phantoms, tmp_path,
                                                                           capsys):
    """Two scans named alike in different folders would write one ``<scan>_seg.nii.gz``: the later silently
    replaced the earlier. Refused up front, naming both."""
    scan, _ = _training_scans(tiny_phantoms, 1)[0]
    other = tmp_path / "copy" / scan.name
    other.parent.mkdir()
    other.write_bytes(scan.read_bytes())
    status = main(["predict", "--model", str(trained_run), "--image", str(scan), "--image", str(other),
                   "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert str(other.parent.name) in err and "would both write" in err and scan.name.replace(".nii.gz", "") in err
    assert not list((tmp_path / "o").glob("*_seg.nii.gz"))


def test_a_scan_that_is_not_skull_stripped_is_segmented_with_a_warning(trained_run, tiny_phantoms, tmp_path,
                                                                      capsys):
    """The check `fedpate data inspect` makes (non-zero background at the volume's border) runs on every scan
    predict segments: a warning on stderr naming the file, and the printed volume is marked unreliable."""
    scan, _ = _training_scans(tiny_phantoms, 1)[0]
    image = nib.load(scan)
    data = np.asarray(image.dataobj).astype(np.float32)
    head = data.copy()
    head[data == 0] = 0.05 * float(data.max())   # a scalp around the brain: no zero background
    unstripped = tmp_path / "head.nii.gz"
    nib.save(nib.Nifti1Image(head, image.affine), unstripped)
    assert main(["predict", "--model", str(trained_run), "--image", str(unstripped), "--image", str(scan),
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 4 and all("head.nii.gz" in w and "skull-stripped" in w for w in warnings)
    lines = [line for line in captured.out.splitlines() if " ml (" in line]
    assert "UNRELIABLE" in lines[0] and "skull-stripped" in lines[0]
    assert "UNRELIABLE" not in lines[1]   # the skull-stripped scan gets no note
