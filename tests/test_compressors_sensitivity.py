"""Each compressor's claimed replace-one sensitivity against the worst teacher outputs we can construct.

Replace-one: K teachers answer, one of them is replaced, so the mean changes by (z_k - z'_k)/K.
"""

import math

import numpy as np
import pytest
import torch

from task.codecs import AutoencoderCompressor, AutoencoderSettings, IdentityCompressor, PCACompressor
from task import codecs

GRID, CLASSES, K = (4, 4, 4), 4, 8
pytest.importorskip("privacy.sensitivity")


def label_maps(n, seed=0):
    """Synthetic tumour label maps: oedema ball with a core, rim of enhancing tumour, random centres."""
    rng = np.random.default_rng(seed)
    axes = np.stack(np.meshgrid(*[np.arange(g) for g in GRID], indexing="ij"), axis=-1)
    labels = np.zeros((n, *GRID), np.int64)
    for i in range(n):
        centre, radius = rng.uniform(1, 3, size=3), rng.uniform(0.8, 2.0)
        distance = np.linalg.norm(axes - centre, axis=-1)
        labels[i][distance < radius] = 1
        labels[i][distance < 0.7 * radius] = 3
        labels[i][distance < 0.4 * radius] = 2
    return labels


def public_onehot(n=30, seed=0):
    return codecs.one_hot(label_maps(n, seed), CLASSES)


def replace_one_gap(state, others, y, y_prime):
    """|| mean(others + [y]) - mean(others + [y']) || with the hospitals' own encode."""
    base = codecs.encode(state, others).astype(np.float64)
    a = np.concatenate([base, codecs.encode(state, y[None]).astype(np.float64)]).mean(axis=0)
    b = np.concatenate([base, codecs.encode(state, y_prime[None]).astype(np.float64)]).mean(axis=0)
    return float(np.linalg.norm(a - b))


def adversarial_box_direction(components, iterations=50, seed=0):
    """Heuristic maximiser of ||A_l u|| over u in [-1,1]^d: u <- sign(A^T A u) (a power iteration on the box)."""
    u = np.sign(np.random.default_rng(seed).normal(size=components.shape[1]))
    for _ in range(iterations):
        u = np.sign(components.T @ (components @ u))
        u[u == 0] = 1
    return u


def candidate_pairs(pca, seed=0):
    rng = np.random.default_rng(seed)
    shape = (CLASSES, *GRID)
    background = codecs.one_hot(np.zeros((1, *GRID)), CLASSES)[0]
    enhancing = codecs.one_hot(np.full((1, *GRID), 3), CLASSES)[0]
    pairs = [(background, enhancing)]
    for _ in range(20):
        labels = rng.integers(0, CLASSES, size=(2, *GRID))
        onehot = codecs.one_hot(labels, CLASSES)
        pairs.append((onehot[0], onehot[1]))
    u = adversarial_box_direction(pca.components).reshape(shape)
    pairs.append(((1 + u) / 2, (1 - u) / 2))  # both in [0,1]^d, difference u
    return pairs


@pytest.mark.parametrize("mode", ["paper", "public"])
def test_pca_bounded_modes_hold_on_worst_pairs(mode):
    pca = PCACompressor(n_components=6, sensitivity_mode=mode).fit(public_onehot())
    state, claimed = pca.state(), pca.sensitivity(K)
    others = public_onehot(K - 1, seed=5)
    gaps = [replace_one_gap(state, others, y, y2) for y, y2 in candidate_pairs(pca)]
    assert max(gaps) <= claimed * (1 + 1e-6)
    if mode == "public":
        d = CLASSES * int(np.prod(GRID))
        assert claimed <= math.sqrt(d) / K + 1e-12
        # the adversarial box vertex gets within a factor 2 of the public bound
        assert max(gaps) >= 0.5 * claimed


def test_pca_public_bound_is_tight_for_one_component():
    pca = PCACompressor(n_components=1, sensitivity_mode="public").fit(public_onehot())
    a = pca.components[0]
    u = np.sign(a).reshape(CLASSES, *GRID)
    gap = replace_one_gap(pca.state(), public_onehot(K - 1, seed=5), (1 + u) / 2, (1 - u) / 2)
    assert gap == pytest.approx(pca.sensitivity(K), rel=1e-5)


def test_pca_clip_mode_bound_is_reached_with_arbitrary_outputs():
    pca = PCACompressor(n_components=4, sensitivity_mode="clip", clip=0.7).fit(public_onehot())
    direction = pca.components[0].reshape(CLASSES, *GRID)
    y, y2 = pca.mean.reshape(direction.shape) + 50 * direction, pca.mean.reshape(direction.shape) - 50 * direction
    gap = replace_one_gap(pca.state(), public_onehot(K - 1, seed=5), y.astype(np.float32), y2.astype(np.float32))
    assert gap <= pca.sensitivity(K) * (1 + 1e-6)
    assert gap >= 0.999 * pca.sensitivity(K)
    assert pca.sensitivity(K) == pytest.approx(2 * 0.7 / K)


def test_identity_bound_is_tight_for_background_vs_enhancing():
    identity = IdentityCompressor().fit(public_onehot())
    background = codecs.one_hot(np.zeros((1, *GRID)), CLASSES)[0]
    enhancing = codecs.one_hot(np.full((1, *GRID), 3), CLASSES)[0]
    gap = replace_one_gap(identity.state(), public_onehot(K - 1, seed=5), background, enhancing)
    assert gap <= identity.sensitivity(K) * (1 + 1e-9)
    assert gap >= 0.999 * identity.sensitivity(K)
    assert identity.bytes_per_query_per_teacher == 4 * CLASSES * int(np.prod(GRID))


def test_autoencoder_bound_holds_on_extreme_pairs():
    torch.manual_seed(0)
    ae = AutoencoderCompressor(AutoencoderSettings(latent_dim=3, train_sigma=0.1, epochs=2, seed=0)).fit(public_onehot(12))
    state, claimed = ae.state(), ae.sensitivity(K)
    assert claimed == pytest.approx(2 / K)
    rng = np.random.default_rng(1)
    candidates = [codecs.one_hot(np.full((1, *GRID), c), CLASSES)[0] for c in range(CLASSES)]
    candidates += list(codecs.one_hot(rng.integers(0, CLASSES, size=(40, *GRID)), CLASSES))
    z = codecs.encode(state, np.stack(candidates)).astype(np.float64)
    distances = np.linalg.norm(z[:, None] - z[None], axis=-1)
    i, j = np.unravel_index(np.argmax(distances), distances.shape)
    gap = replace_one_gap(state, public_onehot(K - 1, seed=5), candidates[i], candidates[j])
    assert gap <= claimed * (1 + 1e-6)
    assert np.all(np.linalg.norm(z, axis=1) <= 1.0 + 1e-6)
