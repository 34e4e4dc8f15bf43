"""Mechanisms: empirical std and KS tests against N(0, σ²) / Laplace(b), numpy and torch, seeding."""

import math

import numpy as np
import pytest
from scipy import stats

from privacy.errors import PrivacyError
from privacy.mechanisms import GaussianMechanism, LaplaceMechanism, make_generator

N = 200_000


def _noise_numpy(mechanism):
    return mechanism(np.zeros(N)).astype(np.float64)


def _check_gaussian(sample, sigma):
    std_err = sigma / math.sqrt(2 * (len(sample) - 1))  # standard error of the sample std
    assert abs(sample.std(ddof=1) - sigma) < 4 * std_err
    assert abs(sample.mean()) < 4 * sigma / math.sqrt(len(sample))
    assert stats.kstest(sample / sigma, "norm").pvalue > 1e-3


def _check_laplace(sample, scale):
    std = math.sqrt(2) * scale
    std_err = std * math.sqrt(5 / 4 / len(sample))  # Laplace: excess kurtosis 3 ⇒ var(s) ≈ σ²(κ-1)/(4n)
    assert abs(sample.std(ddof=1) - std) < 4 * std_err
    assert stats.kstest(sample, "laplace", args=(0, scale)).pvalue > 1e-3


@pytest.mark.parametrize("secure", [False, True])
def test_gaussian_numpy(secure):
    generator = make_generator(None if secure else 7, secure=secure)
    _check_gaussian(_noise_numpy(GaussianMechanism(1.7, generator)), 1.7)


@pytest.mark.parametrize("secure", [False, True])
def test_laplace_numpy(secure):
    generator = make_generator(None if secure else 8, secure=secure)
    _check_laplace(_noise_numpy(LaplaceMechanism(0.6, generator)), 0.6)


def test_torch_same_type_dtype_and_distribution():
    torch = pytest.importorskip("torch")
    x = torch.zeros(N, dtype=torch.float32)
    out = GaussianMechanism(2.5, make_generator(3))(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device == x.device
    assert out.shape == x.shape
    _check_gaussian(out.double().numpy(), 2.5)
    lap = LaplaceMechanism(1.2, make_generator(4))(torch.zeros(N, dtype=torch.float64))
    assert lap.dtype == torch.float64
    _check_laplace(lap.numpy(), 1.2)
    with pytest.raises(PrivacyError, match="floating"):
        GaussianMechanism(1.0, make_generator(0))(torch.zeros(3, dtype=torch.int64))


def test_numpy_dtype_shape_and_signal_preserved():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = GaussianMechanism(1e-3, make_generator(0))(x)
    assert out.dtype == np.float32 and out.shape == (3, 4)
    assert np.allclose(out, x, atol=0.01)
    with pytest.raises(PrivacyError, match="floating"):
        LaplaceMechanism(1.0, make_generator(0))(np.arange(3))


def test_same_seed_same_noise_and_different_seed_differs():
    a = GaussianMechanism(1.0, make_generator(42))(np.zeros(100))
    b = GaussianMechanism(1.0, make_generator(42))(np.zeros(100))
    c = GaussianMechanism(1.0, make_generator(43))(np.zeros(100))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    torch = pytest.importorskip("torch")
    t1 = LaplaceMechanism(1.0, make_generator(5))(torch.zeros(50))
    t2 = LaplaceMechanism(1.0, make_generator(5))(torch.zeros(50))
    assert torch.equal(t1, t2)


def test_secure_generator_is_not_reproducible_and_not_seedable():
    s1 = GaussianMechanism(1.0, make_generator(None, secure=True))(np.zeros(64))
    s2 = GaussianMechanism(1.0, make_generator(None, secure=True))(np.zeros(64))
    assert not np.array_equal(s1, s2)
    with pytest.raises(PrivacyError, match="seed"):
        make_generator(1, secure=True)


def test_invalid_parameters():
    with pytest.raises(PrivacyError, match="sigma"):
        GaussianMechanism(0.0, make_generator(0))
    with pytest.raises(PrivacyError, match="scale"):
        LaplaceMechanism(math.nan, make_generator(0))
    with pytest.raises(PrivacyError, match="seed"):
        make_generator(-1)
