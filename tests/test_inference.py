"""Test-time mirroring (``task.learning.inference``): the mean softmax over the 8 mirrorings of the spatial axes, as every
released model is scored (phantom test set, real-scan check) and as ``fedpate predict`` / ``evaluate`` run it."""

import itertools

import numpy as np
import pytest
import torch

from task.learning.inference import DESCRIPTION, MIRRORINGS, mirrored_probabilities


class Lopsided(torch.nn.Module):
    """A network whose output is not mirror-symmetric: a random 3x3x3 convolution plus a ramp along every axis."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv3d(4, 4, 3, padding=1)

    def forward(self, x):
        ramp = sum(torch.linspace(0, 1, n).reshape([1, 1] + [n if a == d else 1 for a in range(3)])
                   for d, n in enumerate(x.shape[2:]))
        return self.conv(x) + 3 * ramp


def _images(n=3, size=8):
    return torch.randn(n, 4, size, size, size, generator=torch.Generator().manual_seed(1))


def test_the_mirrorings_are_the_eight_subsets_of_the_spatial_axes():
    assert len(MIRRORINGS) == 8 and MIRRORINGS[0] == ()
    assert set(MIRRORINGS) == {c for r in range(4) for c in itertools.combinations((2, 3, 4), r)}


def test_mirrored_probabilities_are_the_mean_of_the_flipped_back_passes():
    model, x = Lopsided().eval(), _images()
    with torch.no_grad():
        expected = sum(torch.flip(torch.softmax(model(torch.flip(x, axes)), dim=1), axes) if axes else
                       torch.softmax(model(x), dim=1) for axes in MIRRORINGS) / 8
        got = mirrored_probabilities(model, x)
        one_pass = torch.softmax(model(x), dim=1)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(dim=1), torch.ones_like(got[:, 0]))
    assert (got - one_pass).abs().max() > 1e-2   # the network is lopsided: mirroring changes its answer


def test_a_voxelwise_network_is_unchanged_by_mirroring():
    torch.manual_seed(0)
    model, x = torch.nn.Conv3d(4, 4, 1).eval(), _images()
    with torch.no_grad():
        torch.testing.assert_close(mirrored_probabilities(model, x), torch.softmax(model(x), dim=1))


def test_predict_probs_and_evaluate_release_use_mirroring_and_one_pass_is_unchanged():
    from task.learning.training import evaluate_release, evaluate_segmentation_per_case, predict_probs

    model, x = Lopsided(), _images(n=5)
    with torch.no_grad():
        one_pass = torch.softmax(model(x), dim=1).numpy()
        mirrored = mirrored_probabilities(model, x).numpy()
    np.testing.assert_allclose(predict_probs(model, x), one_pass, atol=1e-6)   # batches of 2 against 5
    np.testing.assert_allclose(predict_probs(model, x, mirror=True), mirrored, atol=1e-6)
    labels = mirrored.argmax(axis=1)
    dice, per_case = evaluate_release(model, x, labels)
    assert dice["mean"] == pytest.approx(1.0) and all(v == pytest.approx(1.0) for v in per_case)
    assert evaluate_segmentation_per_case(model, x, labels)[0]["mean"] < 0.999


def test_the_mirrorings_as_one_batch_give_the_mirrorings_one_by_one():
    """On a GPU the 8 mirrorings go through the network as one batch (8 times fewer kernels); a network that
    treats the scans of a batch independently gives the same probabilities up to float summation order."""
    model, x = Lopsided().eval(), _images(n=2)
    with torch.no_grad():
        torch.testing.assert_close(mirrored_probabilities(model, x, together=True),
                                   mirrored_probabilities(model, x, together=False), rtol=1e-5, atol=1e-6)
    seen = []
    model.register_forward_hook(lambda module, inputs, output: seen.append(len(inputs[0])))
    with torch.no_grad():
        mirrored_probabilities(model, x, together=True)
    assert seen == [16]                      # one pass of 8 x 2 scans
    seen.clear()
    with torch.no_grad():
        mirrored_probabilities(model, x)     # on the CPU: one mirroring after the other
    assert seen == [2] * 8


def test_a_release_is_scored_and_its_test_predictions_come_from_the_same_pass():
    """What a run writes as its test predictions are the label maps its test Dice scored (evaluate_release with
    test-time mirroring), not a second mirrored prediction of the test set."""
    from task.learning.training import evaluate_release, evaluate_release_predicting, predict_probs

    model, x = Lopsided(), _images(n=5)
    labels = np.random.default_rng(0).integers(0, 4, size=(5, 8, 8, 8))
    passes = []
    model.register_forward_hook(lambda module, inputs, output: passes.append(len(inputs[0])))
    dice, per_case, predicted = evaluate_release_predicting(model, x, labels)
    assert sum(passes) == 8 * 5                 # every scan's 8 mirrorings, once
    assert predicted.dtype == np.uint8
    np.testing.assert_array_equal(predicted, predict_probs(model, x, mirror=True).argmax(axis=1))
    assert (dice, list(per_case)) == tuple(map(lambda v: v if isinstance(v, dict) else list(v),
                                               evaluate_release(model, x, labels)))


def test_segment_scan_mirrors_by_default_and_one_pass_on_request(tiny_phantoms):
    from task.data.msd import load_case, read_msd
    from task.data.preprocess import PreprocessConfig
    from task.reporting.predict import segment_scan

    image, _, affine = load_case(read_msd(tiny_phantoms).training[0])
    config, model = PreprocessConfig(grid=(16, 16, 16)), Lopsided().eval()
    mirrored = segment_scan(model, config, image, affine)
    one_pass = segment_scan(model, config, image, affine, mirror=False)
    assert mirrored.shape == one_pass.shape == image.shape[:3]
    assert (mirrored != one_pass).any()


def test_results_name_the_inference_of_a_segmentation_release(tmp_path):
    from task.reporting.results import RunResults, write_run

    record = write_run(tmp_path / "seg", RunResults(method="public-only", dice={"mean": 0.5}))
    assert record["inference"] == DESCRIPTION
    assert write_run(tmp_path / "cls", RunResults(method="x", accuracy=0.9))["inference"] is None


def test_predict_and_evaluate_take_no_mirroring(monkeypatch, tmp_path, tiny_phantoms):
    """``--no-mirroring`` reaches the segmentation of every scan, in both commands; the default mirrors."""
    import nibabel as nib

    import task.reporting.predict
    from sim.cli import main

    seen = []
    monkeypatch.setattr(task.reporting.predict, "segment_scan", lambda *args: seen.append(args[-1]) or 1 / 0)
    monkeypatch.setattr(task.reporting.predict, "_bundle_model", lambda *a: (None, None, None))
    monkeypatch.setattr("task.reporting.bundle.load_bundle", lambda *a, **k: type("B", (), {"card": {"private": False,
                                                                                         "method": "m"}})())
    scan = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((4, 4, 4, 4), np.float32), np.eye(4)), scan)
    commands = (["predict", "--model", str(tmp_path), "--image", str(scan), "--out", str(tmp_path / "o")],
                ["evaluate", "--model", str(tmp_path), "--data", str(tiny_phantoms), "--limit", "1"])
    for command in commands:
        for extra, expected in (([], True), (["--no-mirroring"], False)):
            with pytest.raises(ZeroDivisionError):
                main([*command, "--no-progress", "--device", "cpu", *extra])
            assert seen.pop() is expected, (command[0], extra)


def test_the_report_says_how_its_models_were_scored():
    from sim.report import scoring_line

    mirrored, old = {"inference": DESCRIPTION}, {}
    assert scoring_line([mirrored, mirrored]) == f"Scoring: {DESCRIPTION}."
    assert scoring_line([old]) == "Scoring: one forward pass per scan."
    mixed = scoring_line([mirrored, old, old])
    assert "for 1 cell(s); one forward pass for 2" in mixed and "with care" in mixed
