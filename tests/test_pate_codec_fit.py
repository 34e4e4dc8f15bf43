"""Fit the compressor on all the public data there is: PCA and the autoencoder fit the
public reference labels plus the public model's label maps of the public query scans -- public arrays only."""

import numpy as np
import pytest

from task.learning.compute import Compute
from task import codecs


def _world(rng, grid=(16, 16, 16), reference_is_query=False):
    from task.world import PublicWorld

    images = lambda n: rng.normal(size=(n, 4, *grid)).astype(np.float32)  # noqa: E731
    query = images(3)
    return PublicWorld(grid=grid, query_ids=list(range(3)), query_images=query,
                       reference_ids=list(range(3)) if reference_is_query else [10, 11, 12, 13],
                       reference_images=query if reference_is_query else images(4),
                       reference_labels=rng.integers(0, 4, (3 if reference_is_query else 4, *grid)),
                       test_ids=list(range(2)), test_images=images(2), test_labels=rng.integers(0, 4, (2, *grid)),
                       query_labels=rng.integers(0, 4, (3, *grid)))


def _fitted_maps(monkeypatch, tmp_path, world, model, method="pate-pca", **config):
    from server import pate
    from task.codecs import PCACompressor
    from task.settings.presets import get_preset

    seen = []
    original = PCACompressor.fit
    monkeypatch.setattr(PCACompressor, "fit", lambda self, maps: seen.append(maps) or original(self, maps))
    settings = pate.PateConfig(method=method, epsilon=8.0, delta=1e-3, **config, compute=Compute(progress=False))
    plan = pate.plan_release(world, get_preset("tiny"), settings, pate.Teachers({"h0": 4}, {}), tmp_path, model)
    (maps,) = seen
    return maps, plan


@pytest.fixture
def public_model():
    import torch

    from task.learning.networks import build_unet

    torch.manual_seed(0)
    return build_unet("tiny").eval()


def test_pca_fits_reference_labels_and_the_public_models_query_maps_only(monkeypatch, tmp_path, public_model):
    from task.learning.training import predict_probs

    rng = np.random.default_rng(0)
    world = _world(rng)
    maps, plan = _fitted_maps(monkeypatch, tmp_path, world, public_model)
    predicted = predict_probs(public_model, world.query_images).argmax(axis=1)
    assert np.array_equal(maps, np.concatenate([codecs.one_hot(world.reference_labels), codecs.one_hot(predicted)]))
    assert plan.fit_maps == {"public_reference_labels": 4, "public_model_on_query_scans": 3}
    # the query and test labels (simulation diagnostics) never reach the fit: changing them changes nothing
    world.query_labels = rng.integers(0, 4, world.query_labels.shape)
    world.test_labels = rng.integers(0, 4, world.test_labels.shape)
    again, plan_again = _fitted_maps(monkeypatch, tmp_path, world, public_model)
    assert np.array_equal(maps, again)
    differ = [k for k in plan.codec
              if not np.array_equal(plan.codec[k], plan_again.codec[k], equal_nan=plan.codec[k].dtype.kind == "f")]
    assert differ == []


def test_the_lever_can_be_switched_off_and_is_moot_when_the_reference_set_is_the_query_set(monkeypatch, tmp_path,
                                                                                         public_model):
    rng = np.random.default_rng(1)
    world = _world(rng)
    maps, plan = _fitted_maps(monkeypatch, tmp_path, world, public_model, fit_on_public_predictions=False)
    assert np.array_equal(maps, codecs.one_hot(world.reference_labels))
    assert plan.fit_maps == {"public_reference_labels": 4, "public_model_on_query_scans": 0}
    paper_like = _world(rng, reference_is_query=True)      # the paper preset: the query scans' public labels
    maps, _ = _fitted_maps(monkeypatch, tmp_path, paper_like, public_model)
    assert np.array_equal(maps, codecs.one_hot(paper_like.reference_labels))
