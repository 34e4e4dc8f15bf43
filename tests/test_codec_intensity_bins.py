"""The anchored codec's intensity bins (docs/decisions/intensity-bins.md): each shell around the public tumour split
by quantiles of one channel of the query scan, so the code can say *where* a class goes that the public model never
predicts. Sensitivity 2C/K on worst-case pairs for any anchor and any bin map, a malicious one included; the
hospital verifies the shipped bin map and encodes exactly as the reference; fitting and the bins read public
arrays only."""

import numpy as np
import pytest

from task.codecs import AnchoredResidualCompressor
from task import codecs
from task.errors import UserError
from task.learning.metrics import dice_scores

GRID = (12, 12, 12)


def _rim_lesions(n, seed=0):
    """Scans and labels with a rim-enhancing lesion: a dark (low T1-Gd) non-enhancing centre (class 2) inside a
    bright enhancing rim (class 3) inside oedema (class 1), at random positions."""
    rng = np.random.default_rng(seed)
    labels = np.zeros((n, *GRID), np.int64)
    scans = rng.normal(0.0, 0.05, size=(n, 4, *GRID)).astype(np.float32)
    zz, yy, xx = np.meshgrid(*(np.arange(g) for g in GRID), indexing="ij")
    for i in range(n):
        c = rng.integers(5, GRID[0] - 5, size=3)
        r = np.sqrt((zz - c[0]) ** 2 + (yy - c[1]) ** 2 + (xx - c[2]) ** 2)
        labels[i][r < 4.5] = 1
        labels[i][r < 3.2] = 3
        labels[i][r < 1.8] = 2
        scans[i, codecs.T1GD_CHANNEL] += np.where(labels[i] == 3, 1.0, np.where(labels[i] == 2, -1.0, 0.0))
    return scans, labels


def _public_without_class_2(labels, weight=0.8):
    """The public model's view: the same lesion, but its centre called enhancing (it has never seen class 2)."""
    seen = np.where(labels == 2, 3, labels)
    onehot = codecs.one_hot(seen).astype(np.float32)
    return (weight * onehot + (1 - weight) / 4).astype(np.float32)


@pytest.fixture(scope="module")
def world():
    scans, labels = _rim_lesions(6)
    return scans, labels, codecs.one_hot(labels).astype(np.float32), _public_without_class_2(labels)


def _fitted(world, bins):
    scans, _, onehot, anchor = world
    return AnchoredResidualCompressor((-2, 3), intensity_bins=bins).fit(onehot, anchor, scans)


def test_bins_let_the_code_place_a_class_the_public_model_never_predicts(world):
    """Teachers who know the dark centre is class 2: without bins the decoder can only spread class 2 by the
    public model's (meaningless) class-2 ranking inside the deepest shell; with T1-Gd bins the code says it."""
    scans, labels, onehot, anchor = world
    assert dice_scores(anchor.argmax(1), labels)["2"] == 0.0
    found = {}
    for bins in (1, 3):
        compressor = _fitted(world, bins)
        z = compressor.encode(onehot, anchor, scans)            # noise-free teachers who know the truth
        assert z.shape == (len(scans), 3 * 6 * bins)
        found[bins] = dice_scores(compressor.decode(z, anchor, scans=scans).argmax(1), labels)["2"]
    assert found[3] > 0.8 and found[3] > found[1] + 0.2, found


@pytest.mark.parametrize("bin_kind", ["scan", "constant", "adversarial"])
def test_replace_one_sensitivity_holds_for_worst_case_pairs_and_any_bin_map(world, bin_kind):
    scans, _, onehot, anchor = world
    compressor = _fitted(world, 3)
    state = compressor.batch_state(compressor.state(), anchor, scans)
    n = len(scans)
    if bin_kind == "constant":          # every voxel in bin 0: a useless (or malicious) map
        state[codecs.BINS_KEY] = np.zeros((n, *GRID), np.uint8)
    elif bin_kind == "adversarial":     # arbitrary bins chosen by a server that wants large rows
        state[codecs.BINS_KEY] = np.random.default_rng(3).integers(0, 3, (n, *GRID)).astype(np.uint8)
    state = codecs.verify_codec(state, scans_shape=scans.shape)
    C = compressor.clip
    for K in (1, 8, 128):
        assert codecs.codec_sensitivity(state, K) == pytest.approx(2 * C / K)
    rng = np.random.default_rng(7)
    candidates = [codecs.one_hot(np.full((n, *GRID), c, np.int64)) for c in range(4)] + [onehot] + [
        rng.dirichlet(np.full(4, a), size=(n, *GRID)).transpose(0, 4, 1, 2, 3).astype(np.float32)
        for a in (0.05, 1.0)]
    rows = [codecs.encode(state, y).astype(np.float64) for y in candidates]
    worst = max(float(np.linalg.norm(a - b, axis=1).max()) for a in rows for b in rows)
    assert worst <= 2 * C * (1 + 1e-6)


def test_a_hospital_refuses_a_bin_map_it_cannot_use_before_charging(world):
    scans, _, _, anchor = world
    compressor = _fitted(world, 3)
    good = compressor.batch_state(compressor.state(), anchor, scans)
    codecs.verify_codec(good, scans_shape=scans.shape)
    bad_maps = {"missing": None, "out of range": np.full((len(scans), *GRID), 3, np.uint8),
                "wrong shape": np.zeros((len(scans) - 1, *GRID), np.uint8),
                "not integers": np.zeros((len(scans), *GRID), np.float32)}
    for what, bin_map in bad_maps.items():
        state = {k: v for k, v in good.items() if k != codecs.BINS_KEY}
        if bin_map is not None:
            state[codecs.BINS_KEY] = bin_map
        with pytest.raises(codecs.CodecRefused, match="intensity bins"):
            codecs.verify_codec(state, scans_shape=scans.shape)
    with pytest.raises(codecs.CodecRefused, match="latent_dim"):   # l must be 3 x shells x bins
        codecs.verify_codec(dict(good, intensity_bins=np.array(2)), scans_shape=scans.shape)
    with pytest.raises(codecs.CodecRefused, match="intensity_bins"):
        codecs.verify_codec(dict(good, intensity_bins=np.array(0)), scans_shape=scans.shape)
    with pytest.raises(Exception, match="public scans"):          # the server cannot ship bins without scans
        compressor.batch_state(compressor.state(), anchor)


def test_the_hospital_encoder_uses_the_shipped_bins_and_matches_the_reference(world):
    scans, labels, onehot, anchor = world
    compressor = _fitted(world, 3)
    state = codecs.verify_codec(compressor.batch_state(compressor.state(), anchor, scans), scans_shape=scans.shape)
    encode = codecs.make_encoder(state)
    shells = codecs.anchor_regions(anchor, (-2, 3))
    bins = codecs.intensity_bin_map(scans, shells, codecs.T1GD_CHANNEL, 3)
    assert np.array_equal(state[codecs.BINS_KEY], bins)
    reference = codecs.anchored_encode(onehot, anchor, (-2, 3), compressor.clip, bins=bins, intensity_bins=3)
    assert np.allclose(encode(onehot), reference)
    # the bins are within-shell terciles of T1-Gd: each (scan, shell) region splits into three near-equal parts
    for i in range(len(scans)):
        for shell in np.unique(shells[i][shells[i] >= 0]):
            sizes = np.bincount(bins[i][shells[i] == shell], minlength=3)
            assert sizes.max() - sizes.min() <= max(2, sizes.sum() // 10), (i, shell, sizes)


@pytest.mark.parametrize("bins", [1, 3])
def test_many_teachers_encoded_together_are_each_teacher_encoded_alone(world, bins):
    """A hospital encodes every teacher's output of a query batch at once where the outputs lie (region sums as one
    matrix product per scan, one transfer of rows): the rows each teacher's own encoding gives, to float32, the
    same clip; a non-finite output is refused as the one-teacher encoder refuses it."""
    import torch

    scans, _, onehot, anchor = world
    compressor = _fitted(world, bins)
    state = codecs.verify_codec(compressor.batch_state(compressor.state(), anchor, scans), scans_shape=scans.shape)
    encode = codecs.make_encoder(state, "cpu")
    rng = np.random.default_rng(11)
    teachers = np.stack([onehot] + [rng.dirichlet(np.full(4, a), size=(len(scans), *GRID)).transpose(0, 4, 1, 2, 3)
                                    for a in (0.05, 1.0)]).astype(np.float32)
    together = encode.many(torch.from_numpy(teachers))
    alone = np.stack([encode(probs) for probs in teachers])
    assert together.shape == alone.shape == (3, len(scans), compressor.latent_dim) and together.dtype == np.float32
    np.testing.assert_allclose(together, alone, rtol=1e-6, atol=1e-7)
    assert np.linalg.norm(together, axis=-1).max() <= compressor.clip
    teachers[1, 0, 0, 0, 0, 0] = np.nan
    with pytest.raises(UserError, match="NaN"):
        encode.many(torch.from_numpy(teachers))


def test_one_bin_is_the_codec_as_it_was(world):
    """intensity_bins=1 ships the state it shipped before bins existed (no bin entries) and encodes the same rows."""
    scans, _, onehot, anchor = world
    plain = AnchoredResidualCompressor((-2, 3)).fit(onehot, anchor)
    one = _fitted(world, 1)
    assert "intensity_bins" not in one.state() and codecs.BINS_KEY not in one.batch_state(one.state(), anchor, scans)
    assert one.clip == pytest.approx(plain.clip)
    assert np.allclose(one.encode(onehot, anchor), plain.encode(onehot, anchor))


def test_a_binned_batch_state_travels_through_flower_records_unchanged(world):
    """What a Flower ServerApp ships: the uint8 bin map and the bin counts survive ArrayRecord packing, and the
    hospital encodes the received state exactly as the server's."""
    from task.wire.flower_wire import arrays_to_record, record_to_arrays

    scans, _, onehot, anchor = world
    compressor = _fitted(world, 3)
    shipped = compressor.batch_state(compressor.state(), anchor, scans)
    received = record_to_arrays(arrays_to_record(shipped))
    assert set(received) == set(shipped)
    assert received[codecs.BINS_KEY].dtype == np.uint8
    assert np.array_equal(received[codecs.BINS_KEY], shipped[codecs.BINS_KEY])
    state = codecs.verify_codec(received, scans_shape=scans.shape)
    assert np.allclose(codecs.encode(state, onehot), compressor.encode(onehot, anchor, scans))
