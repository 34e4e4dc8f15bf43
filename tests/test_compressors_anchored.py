"""The anchored residual codec: replace-one sensitivity 2C/K for worst-case teacher pairs and any
anchor, latent zero decodes to the public model's prediction, the hospital path charges 2C/K, and fitting
reads public arrays only."""

import numpy as np
import pytest

from task.learning.compute import Compute
from task.codecs import AnchoredResidualCompressor
from task import codecs
from task.learning.metrics import dice_scores

GRID = (12, 12, 12)


def _tumour_labels(n, seed=0, radius=3):
    """Label maps with a cube tumour (classes 1-3 mixed) at random positions."""
    rng = np.random.default_rng(seed)
    labels = np.zeros((n, *GRID), np.int64)
    for i in range(n):
        c = rng.integers(radius, GRID[0] - radius, size=3)
        window = tuple(slice(int(x) - radius, int(x) + radius) for x in c)
        labels[i][window] = rng.integers(1, 4, size=(2 * radius,) * 3)
    return labels


def _soft(onehot, weight=0.6, seed=1):
    rng = np.random.default_rng(seed)
    noise = rng.dirichlet(np.ones(4), size=(len(onehot), *GRID)).transpose(0, 4, 1, 2, 3)
    return (weight * onehot + (1 - weight) * noise).astype(np.float32)


@pytest.fixture(scope="module")
def fitted():
    labels = _tumour_labels(6)
    onehot = codecs.one_hot(labels)
    return AnchoredResidualCompressor((-2, 3)).fit(onehot, _soft(onehot)), onehot


def test_latent_zero_decodes_to_the_public_prediction(fitted):
    compressor, onehot = fitted
    anchor = _soft(onehot, 0.4, seed=5)
    decoded = compressor.decode(np.zeros((len(anchor), compressor.latent_dim)), anchor)
    assert np.array_equal(decoded, anchor)
    # a broken teacher's fixed answer is latent zero too: it says "as the public model"
    state = codecs.verify_codec(codecs.with_anchor(compressor.state(), anchor))
    assert not np.any(codecs.fallback_encoding(state, len(anchor)))


def test_noise_free_mean_carries_what_the_teachers_agree_on(fitted):
    """Teachers who all see a larger tumour than the public model: decoding their mean latent moves the
    pseudo-label towards them (Dice against the teachers' answer rises well above the anchor's)."""
    compressor, _ = fitted
    truth = np.zeros((4, *GRID), np.int64)
    truth[:, 3:9, 3:9, 3:9] = 1                            # a 6^3 oedema cube
    public = np.zeros_like(truth)
    public[:, 4:8, 4:8, 4:8] = 1                           # the public model sees only its 4^3 core
    anchor = _soft(codecs.one_hot(public), 0.7, seed=4)
    teachers = [_soft(codecs.one_hot(truth), 0.7, seed=10 + k) for k in range(5)]
    z = np.mean([compressor.encode(t, anchor) for t in teachers], axis=0)
    before = dice_scores(anchor.argmax(1), truth)["WT"]
    after = dice_scores(compressor.decode(z, anchor).argmax(1), truth)["WT"]
    assert after > before + 0.15, (before, after)


@pytest.mark.parametrize("anchor_kind", ["sharp", "uniform", "half"])
def test_replace_one_sensitivity_holds_for_worst_case_pairs_and_any_anchor(fitted, anchor_kind):
    compressor, onehot = fitted
    n = len(onehot)
    if anchor_kind == "sharp":
        anchor = _soft(onehot, 0.9)
    elif anchor_kind == "uniform":     # a useless (or malicious) anchor: every voxel 1/4
        anchor = np.full(onehot.shape, 0.25, np.float32)
    else:                              # tumour class 1 at probability 1/2 in every voxel
        anchor = np.zeros(onehot.shape, np.float32)
        anchor[:, :2] = 0.5
    state = codecs.verify_codec(codecs.with_anchor(compressor.state(), anchor))
    C = compressor.clip
    for K in (1, 8, 128):
        assert codecs.codec_sensitivity(state, K) == pytest.approx(2 * C / K)
        assert compressor.sensitivity(K) == pytest.approx(2 * C / K)
    # worst-case pairs: all class 1 vs all background (antipodal residuals where the anchor is 1/2),
    # and arbitrary probability maps; rows are clipped to C whatever y and the anchor are
    all_one = codecs.one_hot(np.ones((n, *GRID), np.int64))
    all_bg = codecs.one_hot(np.zeros((n, *GRID), np.int64))
    rng = np.random.default_rng(7)
    random_maps = [rng.dirichlet(np.full(4, a), size=(n, *GRID)).transpose(0, 4, 1, 2, 3).astype(np.float32)
                   for a in (0.05, 1.0)]
    candidates = [all_one, all_bg, onehot] + random_maps
    rows = [codecs.encode(state, y).astype(np.float64) for y in candidates]
    worst = max(float(np.linalg.norm(a - b, axis=1).max()) for a in rows for b in rows)
    assert worst <= 2 * C * (1 + 1e-6)
    if anchor_kind == "half":          # the bound is attained: the pair is antipodal and both rows clipped
        assert float(np.linalg.norm(rows[0] - rows[1], axis=1).max()) == pytest.approx(2 * C, rel=1e-5)


def test_hospital_refuses_anchored_codecs_it_cannot_bound(fitted):
    compressor, onehot = fitted
    good = codecs.with_anchor(compressor.state(), _soft(onehot))
    with pytest.raises(codecs.CodecRefused, match="probability map"):
        codecs.verify_codec(dict(good, anchor=good["anchor"] * 5.0))
    with pytest.raises(codecs.CodecRefused, match="latent_dim"):
        codecs.verify_codec(dict(good, latent_dim=np.array(compressor.latent_dim + 3)))
    with pytest.raises(codecs.CodecRefused, match="clip"):
        codecs.verify_codec(dict(good, clip=np.array(-1.0)))
    lying = codecs.verify_codec(dict(good, row_bound=np.array(1e-6)))
    assert codecs.codec_sensitivity(lying, 4) == pytest.approx(2 * compressor.clip / 4)
    with pytest.raises(Exception, match="anchor"):     # encoding without the batch's anchor is refused
        codecs.encode(compressor.state(), onehot)


def test_hospital_charges_2c_over_k_for_the_anchored_codec(fitted, tmp_path):
    from tests.test_hospital_privacy import FixedTeachers, _query   # teachers answering fixed probabilities
    from privacy.ledger import Ledger

    compressor, _ = fitted
    small = AnchoredResidualCompressor((-1, 2), clip=0.3).fit(codecs.one_hot(np.zeros((2, 8, 8, 8), np.int64)))
    hospital = FixedTeachers(tmp_path, teachers=3)
    anchor = np.full((2, 4, 8, 8, 8), 0.25, np.float32)
    rows, _ = hospital.answer_query(np.zeros((2, 4, 8, 8, 8), np.float32), codecs.with_anchor(small.state(), anchor),
                                    _query(["a", "b"], teachers=6))
    assert rows.shape == (3, 2, small.latent_dim)
    assert np.linalg.norm(rows, axis=-1).max() <= 0.3 * (1 + 1e-6)
    events = Ledger.load(hospital.privacy_ledger).events("h0")
    assert len(events) == 2 and all(e.sensitivity == pytest.approx(2 * 0.3 / 6) for e in events)


def test_fitting_reads_public_arrays_only(monkeypatch, tmp_path):
    """plan_release fits the anchored codec on the public reference labels and the public model's output on
    the public reference scans; the query and test labels (simulation diagnostics) never reach it."""
    import torch

    from server import pate
    from task.learning.networks import build_unet
    from task.settings.presets import get_preset
    from task.learning.training import predict_probs
    from task.world import PublicWorld

    rng = np.random.default_rng(0)
    grid = (16, 16, 16)
    images = lambda n: rng.normal(size=(n, 4, *grid)).astype(np.float32)  # noqa: E731
    world = PublicWorld(grid=grid, query_ids=list(range(3)), query_images=images(3), reference_ids=list(range(4)),
                        reference_images=images(4), reference_labels=rng.integers(0, 4, (4, *grid)),
                        test_ids=list(range(2)), test_images=images(2), test_labels=rng.integers(0, 4, (2, *grid)),
                        query_labels=rng.integers(0, 4, (3, *grid)))
    torch.manual_seed(0)
    model = build_unet("tiny").eval()
    seen = []
    original = AnchoredResidualCompressor.fit
    monkeypatch.setattr(AnchoredResidualCompressor, "fit",
                        lambda self, maps, probs=None, scans=None: seen.append((maps, probs, scans))
                        or original(self, maps, probs, scans))
    config = pate.PateConfig(method="pate-anchored", epsilon=8.0, delta=1e-3, compute=Compute(progress=False))
    teachers = pate.Teachers({"h0": 4}, {})
    plan = pate.plan_release(world, get_preset("tiny"), config, teachers, tmp_path, model)
    (maps, probs, scans), = seen
    assert np.array_equal(maps, codecs.one_hot(world.reference_labels))
    assert np.allclose(probs, predict_probs(model, world.reference_images))
    assert scans is world.reference_images            # the public reference scans (intensity bins), nothing else
    world.query_labels = rng.integers(0, 4, (3, *grid))      # other private/diagnostic labels: same codec
    world.test_labels = rng.integers(0, 4, (2, *grid))
    again = pate.plan_release(world, get_preset("tiny"), config, teachers, tmp_path, model)
    assert all(np.array_equal(plan.codec[k], again.codec[k]) for k in plan.codec)
    assert plan.sensitivity == pytest.approx(2 * plan.compressor.clip / 4)


def test_a_hospital_encoder_computes_the_anchor_regions_once_and_encodes_as_the_reference(fitted, monkeypatch):
    """make_encoder is used for every teacher of a query batch: its rows equal anchored_encode's from scratch,
    while the anchor's regions (a function of the anchor alone) are computed once for all of them."""
    from task.codecs import anchored as anchored_module

    compressor, onehot = fitted
    anchor = _soft(onehot, 0.5, seed=7)
    state = codecs.verify_codec(codecs.with_anchor(compressor.state(), anchor))
    teachers = [_soft(onehot, 0.3 + 0.1 * k, seed=20 + k) for k in range(4)]
    expected = [codecs.anchored_encode(t, anchor, codecs.anchored_shells(state), float(state["row_bound"]))
                for t in teachers]
    calls = []
    real = anchored_module.anchor_regions
    monkeypatch.setattr(anchored_module, "anchor_regions", lambda *a, **k: calls.append(1) or real(*a, **k))
    encode = codecs.make_encoder(state)
    rows = [encode(t) for t in teachers]
    assert len(calls) == 1
    for got, want in zip(rows, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    with pytest.raises(Exception, match="regions of shape"):
        codecs.anchored_encode(teachers[0], anchor, codecs.anchored_shells(state), 1.0, regions=np.zeros((1, 2, 2, 2)))
