"""MODEL_CARD.md reads in words a privacy officer reads (task.reporting.model_card): ε with δ and its relation in words, the
data, the network in one line, the preprocessing, and the test Dice on the held-out test patients and on the
real-scan check where one ran; bundle.json keeps the same fields as JSON, sealed, so the card still verifies."""

import json

import pytest

from privacy.events import GaussianEvent
from privacy.ledger import Ledger
from task.reporting import realcheck
from task.reporting.bundle import load_bundle
from task.reporting.model_card import data_words, network_words, preprocessing_words
from task.learning.networks import build_unet, network_config
from task.reporting.results import ModelRelease, RunResults, write_run

PHANTOMS = {"kind": "phantoms", "seed": 0, "generator_version": "3", "parts": [
    {"name": "hospitals-population", "prefix": "", "cases": 260, "kind": "phantoms", "seed": 0,
     "generator_version": "3"},
    {"name": "other-centre", "prefix": "other-", "cases": 34, "kind": "phantoms", "seed": 1001,
     "generator_version": "3"}]}
PREPROCESSING = {"grid": [16, 16, 16], "config": {"grid": [16, 16, 16], "margin_voxels": 2, "antialias": True}}
DICE = {"1": 0.7, "2": 0.5, "3": 0.6, "mean": 0.6, "WT": 0.8, "TC": 0.65, "ET": 0.6}
REAL = {"dice": {"1": 0.5, "2": 0.4, "3": 0.6, "mean": 0.5, "WT": 0.83, "TC": 0.49, "ET": 0.63},
        "cases": [{"case": "a", "reference": "expert"}, {"case": "b", "reference": "expert"},
                  {"case": "c", "reference": "algorithm"}]}


def _write(folder, real_check=None, monkeypatch=None, dice=DICE):
    """A private PATE run with a voxel-head student, written by write_run; the real check, if given, is what the
    active check scores (so the card is resealed after the bundle was written, as in a run)."""
    Ledger(folder / "ledger.jsonl").record(["h0", "h1"], GaussianEvent(sensitivity=0.25, sigma=1.0), "query-0")
    results = RunResults(method="pate-anchored", dice=dice, epsilon_budget=8.0, teachers=128, hospitals=4,
                         queries=40)
    results.account(Ledger.load(folder / "ledger.jsonl"), 1e-3, "replace-one")
    results.extras = {"dice_per_case": [0.6] * 40}
    if monkeypatch is not None:
        monkeypatch.setattr(realcheck, "score_release", lambda *args, **kwargs: real_check)
    written = write_run(folder, results, ModelRelease(build_unet("tiny", trainable="voxel-head"),
                                                      network_config("tiny", trainable="voxel-head"),
                                                      PREPROCESSING, PHANTOMS))
    return written, (folder / "model" / "MODEL_CARD.md").read_text()


def test_the_card_states_privacy_data_network_preprocessing_and_test_dice_in_words(tmp_path, monkeypatch):
    written, card = _write(tmp_path, REAL, monkeypatch)
    epsilon = f"{written['epsilon']:.4g}"
    assert f"**({epsilon}, 0.001)-differential privacy per patient**" in card
    assert "budget of 8" in card and "**replace-one** neighbouring relation" in card
    assert "two training sets are neighbours when one patient's data is replaced by another patient's" in card
    assert ("- **Data:** the hospitals' population (the hospitals' patients, the public query scans and the held-out "
            "test patients): 260 synthetic brain-tumour phantoms") in card
    assert "another centre's collection (the public labelled data): 34 synthetic" in card
    assert "held by 4 hospitals, 128 teachers in all" in card
    network = next(line for line in card.splitlines() if line.startswith("- **Network:**"))
    assert "3-D U-Net" in network and "8, 16 and 32 channels" in network and "voxel head" in network
    assert "margin of 2 voxels" in card and "z-scored inside the brain" in card and "16x16x16 voxels" in card
    assert ("| held-out test patients (synthetic phantoms), never trained on | 40 | 0.800 | 0.650 | 0.600 | 0.600 |"
            in card)
    assert ("| real-scan check: labelled real tumours, mean over the cases (1 with an algorithm's reference, 2 with "
            "an expert's reference) | 3 | 0.830 | 0.490 | 0.630 | 0.500 |") in card
    assert "{" not in card and '"' not in card                 # words, not JSON
    # the same fields stay machine-readable in bundle.json, and the resealed bundle still verifies
    bundle = load_bundle(tmp_path)
    assert bundle.card["test_dice"]["real_check"]["cases"] == 3
    assert bundle.card["test_dice"]["test"]["WT"] == pytest.approx(0.8)
    assert bundle.card["data_source"] == PHANTOMS and bundle.card["commit"] == written["commit"]
    assert json.loads((tmp_path / "model" / "bundle.json").read_text())["network"]["voxel_head_hidden"]


def test_without_a_real_check_or_when_it_failed_the_card_shows_the_test_patients_alone(tmp_path, monkeypatch):
    for folder, check in ((tmp_path / "none", None), (tmp_path / "failed", {"error": "OSError: unreadable"})):
        folder.mkdir()
        _, card = _write(folder, check, monkeypatch)
        assert "| held-out test patients" in card and "real-scan check" not in card
        load_bundle(folder)


def test_a_card_without_test_dice_says_so(tmp_path):
    _, card = _write(tmp_path, dice=None)
    assert "No test Dice was recorded for this model." in card


def test_real_data_and_other_networks_in_words():
    assert data_words({"kind": "msd", "name": "Task01_BrainTumour"}, hospitals=8) == (
        "the scans of the folder `Task01_BrainTumour` (Medical Segmentation Decathlon Task01 layout); the private "
        "patients held by 8 hospitals")
    assert data_words({}) == "not recorded"
    assert "no patient's data" in data_words({"synthetic": True})
    one_line = network_words(network_config("small"), {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"})
    assert "\n" not in one_line and "(FLAIR, T1w, t1gd, T2w)" in one_line and "PReLU" in one_line
    assert "voxel head" not in one_line
    assert preprocessing_words({"grid": [8, 8, 8]}) == ("the scan is resampled to 8x8x8 voxels (no further "
                                                       "preprocessing was recorded)")
