"""``public-selftrain`` -- the public model self-trained on the public *unlabelled* query scans.

It is a public floor: it must read only public arrays (query scan images, public reference and validation,
the test set that scores every method), never a hospital's case nor a query scan's label, and charge
nothing. Its sharpening is the stated recipe (T = 1 is the identity, T -> 0 the argmax)."""

import json

import numpy as np
import pytest

from sim.runners.floors import FloorRun
from task.learning.compute import Compute


def test_sharpen_is_a_renormalised_power_of_the_probabilities():
    from server.selftrain import sharpen

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(4), size=(2, 3, 3, 3)).transpose(0, 4, 1, 2, 3).astype(np.float32)
    np.testing.assert_allclose(sharpen(probs, 1.0), probs, atol=1e-7)
    half = sharpen(probs, 0.5)
    expected = probs.astype(np.float64) ** 2 / (probs.astype(np.float64) ** 2).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(half, expected, rtol=1e-5)
    np.testing.assert_allclose(half.sum(axis=1), 1.0, rtol=1e-6)
    assert np.array_equal(half.argmax(axis=1), probs.argmax(axis=1))          # sharpening never flips a label
    assert (half.max(axis=1) >= probs.max(axis=1) - 1e-6).all()               # it only gains confidence
    cold = sharpen(probs, 0.01)
    assert np.array_equal(cold.argmax(axis=1), probs.argmax(axis=1))
    assert cold.max(axis=1).mean() > 0.95 and (cold.max(axis=1) >= half.max(axis=1) - 1e-6).all()
    with pytest.raises(ValueError):
        sharpen(probs, 0.0)


def test_public_selftrain_reads_only_public_arrays_and_charges_nothing(tmp_path, monkeypatch, tiny_prepared,
                                                                       tiny_split):
    import sim.runners.selftrain as selftrain
    from task.data.preprocess import PreparedDataset
    from task.settings.methods import SEGMENTATION_METHODS, method
    from task.settings.presets import get_preset

    assert "public-selftrain" in SEGMENTATION_METHODS and not method("public-selftrain").private
    assert method("public-selftrain").role == "floor"
    read = {"images": [], "labels": []}
    real = {"images": PreparedDataset.images, "labels": PreparedDataset.labels}

    def spy(kind):
        def read_arrays(self, ids=None):
            read[kind].append(None if ids is None else list(ids))   # None: every case at once
            return real[kind](self, ids)
        return read_arrays

    monkeypatch.setattr(PreparedDataset, "images", spy("images"))
    monkeypatch.setattr(PreparedDataset, "labels", spy("labels"))
    monkeypatch.setattr(selftrain, "build_world", lambda preset, data, seed, progress, **where: (tiny_prepared, tiny_split))
    preset = get_preset("tiny").with_changes(student=dict(epochs=1), pretrain_epochs=1,
                                             self_training=dict(rounds=2))
    results = selftrain.run_public_selftrain(FloorRun(preset, tmp_path / "public-selftrain", tmp_path / "_shared",
                                                      compute=Compute(progress=False)))

    assert None not in read["images"] and None not in read["labels"]        # never "everything"
    images = {c for ids in read["images"] for c in ids}
    labels = {c for ids in read["labels"] for c in ids}
    private = set(tiny_split.private_cases())
    query = set(tiny_split.public_query)
    public_labelled = set(tiny_split.public_reference) | set(tiny_split.public_validation) | set(tiny_split.test)
    assert private and not (images | labels) & private                      # no hospital array at all
    assert query <= images and not labels & query                          # query scans: images, never labels
    assert labels <= public_labelled and images <= query | public_labelled

    # nothing charged: an empty ledger, no epsilon, no hospital ledger anywhere
    out = tmp_path / "public-selftrain"
    assert (out / "ledger.jsonl").read_text() == ""
    assert results["epsilon"] is None and results["epsilon_budget"] is None and results["method"] == "public-selftrain"
    assert not list(tmp_path.rglob("hospital-ledgers"))
    record = json.loads((out / "results.json").read_text())
    # the round was chosen on public validation, and that choice is recorded
    chosen = record["selftrain"]["round_chosen"]
    scores = record["selftrain"]["validation_dice_per_round"]
    assert len(scores) == 2 and record["validation_dice_mean"] == scores[chosen - 1] == max(scores)
    assert len(record["dice_per_case"]) == len(tiny_split.test)
    assert set(record["dice_per_case_class"]) == {"1", "2", "3", "WT", "TC", "ET"}
    from task.reporting.bundle import load_bundle

    assert "no privacy cost" in (out / "model" / "MODEL_CARD.md").read_text()
    load_bundle(out)   # a verifiable bundle (its card agrees with its empty ledger)


def test_public_selftrain_says_it_read_the_query_labels_when_the_reference_set_is_the_query_set(
        tmp_path, monkeypatch, tiny_prepared, tiny_split):
    """Under a preset without a separate public reference set (``paper``, Fay et al.) the reference maps are the
    query scans' labels: ``labels_used`` must say so, not that the query labels are never read."""
    import dataclasses

    import sim.runners.selftrain as selftrain
    from task.settings.presets import get_preset

    reference_is_query = dataclasses.replace(tiny_split, public_reference=[], reference_is_query=True)
    monkeypatch.setattr(selftrain, "build_world",
                        lambda preset, data, seed, progress, **where: (tiny_prepared, reference_is_query))
    preset = get_preset("tiny").with_changes(student=dict(epochs=1), pretrain_epochs=1,
                                             self_training=dict(rounds=1))
    record = selftrain.run_public_selftrain(FloorRun(preset, tmp_path / "cell", tmp_path / "_shared",
                                                     compute=Compute(progress=False)))
    said = record["selftrain"]["labels_used"]
    assert "query scans' labels" in said and "never read" not in said
    assert "query scans' labels" in (tmp_path / "cell" / "model" / "MODEL_CARD.md").read_text()
    # with a separate reference set (the tiny preset's own split) it says the query labels were not read
    from task.world import load_world

    assert "never read" in selftrain.labels_used(load_world(tiny_prepared, tiny_split, with_query_labels=False))


def test_the_start_model_is_the_reference_model_or_it_self_trained_and_is_resumed(tmp_path, tiny_prepared,
                                                                                 tiny_split):
    """``public_start``: ``reference`` hands every method the reference-trained public model itself;
    ``self-trained`` hands them that model self-trained on the query scans, checkpointed beside it (a second call
    loads the rounds instead of training them) and the very model the ``public-selftrain`` baseline reports."""
    import torch

    from server.selftrain import selftrain_checkpoints, train_public_models
    from task.settings.presets import get_preset
    from task.world import load_world

    world = load_world(tiny_prepared, tiny_split, with_query_labels=False)
    preset = get_preset("tiny").with_changes(student=dict(epochs=1), pretrain_epochs=1,
                                             self_training=dict(rounds=1))
    checkpoint = tmp_path / "public-model.pt"
    plain = train_public_models(world, preset, checkpoint=checkpoint)
    assert plain.start is plain.reference and plain.selftrain is None

    adapted = train_public_models(world, preset.with_changes(public_start="self-trained"), checkpoint=checkpoint)
    reference, start = adapted.reference.state_dict(), adapted.start.state_dict()
    assert all(torch.equal(reference[k], plain.reference.state_dict()[k]) for k in reference)   # resumed, not retrained
    assert any(not torch.equal(reference[k], start[k]) for k in reference)                      # it moved
    assert adapted.selftrain.chosen_round == 1 and (selftrain_checkpoints(checkpoint) / "round-1.pt").exists()
    again = train_public_models(world, preset.with_changes(public_start="self-trained"), checkpoint=checkpoint).start
    assert all(torch.equal(start[k], again.state_dict()[k]) for k in start)


def test_an_unknown_public_start_is_refused_in_one_line_listing_the_choices():
    from task.settings.presets import get_preset

    with pytest.raises(ValueError, match=r"^public_start: unknown value 'selftrained'; expected one of reference, "
                                         r"self-trained$"):
        get_preset("tiny", public_start="selftrained")
