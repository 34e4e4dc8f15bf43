"""PCA-PATE compressor (Fay et al., Algorithm 1, eq. 6-7)."""

import numpy as np
import pytest

from task.codecs import PCACompressor, choose_components
from task import codecs
from task.errors import UserError


def soft_maps(n, grid=(4, 4, 4), classes=4, rank=8, seed=0):
    """Low-rank-ish probability maps: per-voxel softmax of a rank-``rank`` Gaussian field."""
    rng = np.random.default_rng(seed)
    d = classes * int(np.prod(grid))
    basis = np.random.default_rng(123).normal(size=(rank, d)) * (0.8 ** np.arange(rank))[:, None]
    logits = (rng.normal(size=(n, rank)) @ basis).reshape(n, classes, *grid)
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    return (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)


def test_gram_trick_basis_is_orthonormal_and_eigenvalues_match_covariance():
    maps = soft_maps(60)
    pca = PCACompressor(n_components=None).fit(maps)
    basis = pca.basis
    assert np.allclose(basis @ basis.T, np.eye(len(basis)), atol=1e-8)
    flat = maps.reshape(60, -1).astype(np.float64)
    covariance = np.cov(flat, rowvar=False)
    top = np.sort(np.linalg.eigvalsh(covariance))[::-1][: len(pca.eigenvalues)]
    assert np.allclose(pca.eigenvalues[:10], top[:10], rtol=1e-4)
    assert np.all(np.diff(pca.eigenvalues) <= 1e-12)
    assert len(pca.eigenvalues) <= 59  # at most n-1 directions from n maps


@pytest.fixture(scope="module")
def fitted_on_many():
    return PCACompressor(n_components=None).fit(soft_maps(2000, seed=1)), soft_maps(2000, seed=2)


@pytest.mark.parametrize("l,sigma", [(2, 0.0), (5, 0.05), (12, 0.2)])
def test_heldout_reconstruction_error_matches_eq7(fitted_on_many, l, sigma):
    """E||y - A_l^T(A_l (y-mu) + gamma) - mu||^2 = sum_{j>l} lambda_j + l sigma^2 (eq. 6-7)."""
    pca, held_out = fitted_on_many
    pca.latent_dim = l
    rng = np.random.default_rng(7)
    flat = held_out.reshape(len(held_out), -1).astype(np.float64)
    errors = ((flat - pca.reconstruct_raw(held_out, sigma, rng)) ** 2).sum(axis=1)
    expected = pca.expected_error(l, sigma)
    standard_error = errors.std() / np.sqrt(len(errors))
    assert abs(errors.mean() - expected) < 4 * standard_error + 0.02 * expected


def test_choose_components_is_eq7_and_minimises_the_error():
    eigenvalues = np.array([5.0, 2.0, 1.0, 0.3, 0.1, 0.01])
    assert choose_components(eigenvalues, 0.5) == 4      # lambda_j > 0.25: 5, 2, 1, 0.3
    assert choose_components(eigenvalues, 10.0) == 1     # at least one
    pca = PCACompressor(n_components=None).fit(soft_maps(200))
    sigma = float(np.sqrt(pca.eigenvalues[4] * 1.01))
    l = choose_components(pca.eigenvalues, sigma)
    errors = [pca.expected_error(k, sigma) for k in range(1, len(pca.eigenvalues) + 1)]
    assert l == int(np.argmin(errors)) + 1


def test_decode_returns_probabilities_and_roundtrips_training_maps():
    maps = soft_maps(20)
    pca = PCACompressor(n_components=None, sensitivity_mode="paper").fit(maps)
    z = codecs.encode(pca.state(), maps)
    assert z.shape == (20, pca.latent_dim) and z.dtype == np.float32
    decoded = pca.decode(z)
    assert decoded.shape == maps.shape
    assert np.allclose(decoded.sum(axis=1), 1.0, atol=1e-5) and decoded.min() >= 0
    assert np.abs(decoded - maps).max() < 1e-3  # all n-1 components: exact on the fitted maps
    assert pca.bytes_per_query_per_teacher == 4 * pca.latent_dim


def test_fit_refuses_non_probability_reference_maps():
    with pytest.raises(UserError):
        PCACompressor().fit(np.random.default_rng(0).normal(size=(5, 4, 2, 2, 2)))
