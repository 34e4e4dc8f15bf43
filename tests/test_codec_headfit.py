"""The anchored release decoded by one fitted voxel head (task.codecs.headfit): post-processing of
the released latents and public arrays only. It decodes z = 0 to the anchor, changes nothing outside the regions,
is deterministic without moving the caller's torch stream, places a class the public model never predicts, and
pools the noise of every query (beats per-region mass matching on a noisy release)."""

import numpy as np
import pytest
import torch

from task.codecs import ANCHORED_DECODERS, AnchoredResidualCompressor, make_compressor
from task import codecs
from task.codecs.headfit import fit_head_decode
from task.errors import UserError
from task.learning.metrics import dice_scores
from tests.test_codec_intensity_bins import _public_without_class_2, _rim_lesions


@pytest.fixture(scope="module")
def world():
    scans, labels = _rim_lesions(12, seed=4)
    return scans, labels, codecs.one_hot(labels).astype(np.float32), _public_without_class_2(labels)


def _compressor(world, decoder):
    scans, _, onehot, anchor = world
    return AnchoredResidualCompressor((-2, 3), intensity_bins=3, decoder=decoder, device="cpu").fit(onehot, anchor, scans)


def test_zero_latents_decode_to_the_anchor_exactly(world):
    scans, _, _, anchor = world
    compressor = _compressor(world, "head-fit")
    decoded = compressor.decode(np.zeros((len(scans), compressor.latent_dim)), anchor, scans=scans)
    np.testing.assert_array_equal(decoded, anchor)


def test_a_class_the_public_model_never_predicts_is_placed_and_only_inside_the_regions(world):
    scans, labels, onehot, anchor = world
    compressor = _compressor(world, "head-fit")
    z = compressor.encode(onehot, anchor, scans)                 # noise-free teachers who know the truth
    history = []
    regions = compressor._regions(anchor, scans)
    decoded = fit_head_decode(z, anchor, scans, regions, compressor.latent_dim // 3, device="cpu", history=history)
    assert dice_scores(anchor.argmax(1), labels)["2"] == 0.0
    assert dice_scores(decoded.argmax(1), labels)["2"] > 0.8
    assert history[-1] < 0.1 * history[0]                          # the likelihood was fitted, not just moved
    outside = regions < 0
    assert outside.any()
    np.testing.assert_array_equal(np.moveaxis(decoded, 1, -1)[outside], np.moveaxis(anchor, 1, -1)[outside])


def test_the_decode_is_deterministic_and_leaves_the_callers_torch_stream_alone(world):
    scans, _, onehot, anchor = world
    compressor = _compressor(world, "head-fit")
    z = compressor.encode(onehot, anchor, scans)
    torch.manual_seed(11)
    expected_next = torch.rand(3)
    torch.manual_seed(11)
    first = compressor.decode(z, anchor, scans=scans)
    assert torch.equal(torch.rand(3), expected_next)
    np.testing.assert_array_equal(first, compressor.decode(z, anchor, scans=scans))


def test_the_fit_pools_the_noise_that_per_region_decoding_keeps(world):
    """A release as noisy as the quick preset's at small epsilon (sigma about the teachers' row norm / 3): the
    head, fitted to every query at once, keeps the class the public model misses; per-region mass matching
    (shrunk towards the public model) loses most of it."""
    scans, labels, onehot, anchor = world
    compressors = {name: _compressor(world, name) for name in ("mass-matching", "head-fit")}
    z = compressors["head-fit"].encode(onehot, anchor, scans)
    sigma = float(np.median(np.linalg.norm(z, axis=1))) / 3
    noisy = z + np.random.default_rng(0).normal(0.0, sigma, z.shape)
    found = {name: dice_scores(c.decode(noisy, anchor, sigma=sigma, scans=scans).argmax(1), labels)["2"]
             for name, c in compressors.items()}
    assert found["head-fit"] > 0.7 and found["head-fit"] > found["mass-matching"] + 0.2, found


def test_decoders_are_registered_and_a_wrong_name_or_missing_scans_are_refused(world):
    scans, _, onehot, anchor = world
    assert set(ANCHORED_DECODERS) == {"mass-matching", "head-fit"}
    with pytest.raises(UserError, match="^anchored codec: decoder: unknown value 'median'; expected one of "
                                        "mass-matching, head-fit$"):
        AnchoredResidualCompressor(decoder="median")
    compressor = _compressor(world, "head-fit")
    z = compressor.encode(onehot, anchor, scans)
    with pytest.raises(UserError, match="needs the query scans"):
        compressor.decode(z, anchor)
    with pytest.raises(UserError, match="do not match"):
        fit_head_decode(z, anchor, scans[:2], compressor._regions(anchor, scans), compressor.latent_dim // 3)


def test_the_preset_names_the_decoder():
    from task.settings.presets import get_preset
    quick = get_preset("quick")
    compressor = make_compressor("pate-anchored", quick)
    assert compressor.decoder == quick.codec.anchored_decoder == "head-fit"
    assert make_compressor("pate-anchored", quick, decoder="mass-matching").describe()["decoder"] == "mass-matching"
