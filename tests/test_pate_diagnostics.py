"""The server's simulation-only diagnostic of the un-noised ensemble (``server.pate.noise_free_ensemble_dice``): it
does not depend on epsilon, so a comparison decodes it once per (teachers, codec, test scans) and its other cells
read it back; a compressor that cannot say what its decode depends on is decoded every time."""

from types import SimpleNamespace

import numpy as np

from server.pate import ReleasePlan, noise_free_ensemble_dice
from task import codecs
from task.codecs import AnchoredResidualCompressor, PCACompressor

GRID = (8, 8, 8)


def _world(n=3, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.zeros((n, *GRID), np.int64)
    labels[:, 2:6, 2:6, 2:6] = rng.integers(1, 4, size=(n, 4, 4, 4))
    scans = rng.normal(size=(n, 4, *GRID)).astype(np.float32)
    anchor = (0.7 * codecs.one_hot(labels) + 0.3 / 4).astype(np.float32)
    return SimpleNamespace(test_images=scans, test_labels=labels), anchor


def _plan(compressor, world, anchor):
    return ReleasePlan(compressor, codecs.verify_codec(compressor.state()), queries=1, noise_per_sensitivity=1.0,
                       sensitivity=1.0, sigma=1.0, collapse=None, public_test_probs=anchor,
                       public_test_scans=world.test_images)


def _counting(compressor):
    calls = []
    decode = compressor.decode_release
    compressor.decode_release = lambda *args, **kwargs: calls.append(args[2]) or decode(*args, **kwargs)
    return calls


def test_the_noise_free_decode_is_read_back_for_the_same_latents_codec_and_scans(tmp_path):
    world, anchor = _world()
    compressor = AnchoredResidualCompressor((-1, 2), decoder="mass-matching").fit(codecs.one_hot(world.test_labels),
                                                                                  anchor)
    calls = _counting(compressor)
    plan = _plan(compressor, world, anchor)
    latents = np.random.default_rng(1).normal(0.0, 0.3, size=(3, compressor.latent_dim))
    first = noise_free_ensemble_dice(plan, latents, world, tmp_path)
    assert calls == [0.0]                                      # decoded once, as if sigma were 0
    assert noise_free_ensemble_dice(plan, latents, world, tmp_path) == first   # another epsilon's cell
    assert calls == [0.0] and len(list((tmp_path / "noise-free-decodes").glob("*.json"))) == 1
    noise_free_ensemble_dice(plan, latents + 0.1, world, tmp_path)           # other teachers' latents
    other_world, other_anchor = _world(seed=2)
    noise_free_ensemble_dice(_plan(compressor, other_world, other_anchor), latents, other_world, tmp_path)
    assert len(calls) == 3
    noise_free_ensemble_dice(plan, latents, world, None)                     # a single run keeps nothing
    assert len(calls) == 4


def test_a_compressor_that_cannot_name_what_its_decode_reads_is_decoded_every_time(tmp_path):
    world, anchor = _world()
    compressor = PCACompressor(2, "clip", clip=1.0).fit(codecs.one_hot(world.test_labels))
    assert compressor.noise_free_decode_key() is None
    calls = _counting(compressor)
    plan = _plan(compressor, world, None)
    latents = np.zeros((3, 2))
    assert noise_free_ensemble_dice(plan, latents, world, tmp_path) == noise_free_ensemble_dice(plan, latents, world,
                                                                                                tmp_path)
    assert len(calls) == 2 and not (tmp_path / "noise-free-decodes").exists()
