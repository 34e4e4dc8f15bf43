"""Gaussian and Laplace noise for numpy arrays and torch tensors.

Flow everywhere (docs/ARCHITECTURE.md): ``guard.charge(...)`` (ledger written) → add noise → release.
These classes only add noise; they do not account.

Security note: noise is drawn in floating point (PCG64 when seeded; ``secrets``/os.urandom bits when
``secure=True``). Floating-point samplers are *not* hardened against Mironov's floating-point attack on
the Laplace mechanism (CCS 2012) or its Gaussian analogues (Jin et al. 2022, precision-based attacks);
``secure=True`` only makes the randomness unpredictable, not the sampler exact.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import numpy as np
from scipy import special

from privacy.errors import PrivacyError


class NoiseGenerator:
    """Source of standard normal and Laplace noise (float64 numpy arrays)."""

    secure = False

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self.rng = rng

    def standard_normal(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.rng.standard_normal(shape)

    def laplace(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        return self.rng.laplace(0.0, scale, shape)


class SecureNoiseGenerator(NoiseGenerator):
    """Noise from ``secrets`` (os.urandom): uniform doubles from 53 random bits, then inverse CDFs.

    Not seedable; see the module note on floating-point attacks.
    """

    secure = True

    def __init__(self) -> None:
        super().__init__(None)

    @staticmethod
    def _uniform_open(size: int) -> np.ndarray:
        # 53-bit uniforms in (0, 1): (k + 0.5) / 2^53 never hits 0 or 1, so the inverse CDFs stay finite.
        raw = np.frombuffer(secrets.token_bytes(8 * size), dtype=np.uint64) >> np.uint64(11)
        return (raw.astype(np.float64) + 0.5) / float(2**53)

    def standard_normal(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64))
        return special.ndtri(self._uniform_open(size)).reshape(shape)

    def laplace(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64))
        u = self._uniform_open(size) - 0.5
        return (-scale * np.sign(u) * np.log1p(-2.0 * np.abs(u))).reshape(shape)


def make_generator(seed: int | None, secure: bool = False) -> NoiseGenerator:
    """``NoiseGenerator`` over numpy ``Generator(PCG64(seed))``; ``secure=True`` ⇒ ``secrets``-based source.

    ``seed=None`` (not secure) seeds PCG64 from OS entropy. A seed together with ``secure=True`` is refused:
    a reproducible stream is by definition predictable.
    """
    if secure:
        if seed is not None:
            raise PrivacyError("make_generator: secure=True cannot be seeded (seed must be None)")
        return SecureNoiseGenerator()
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
        raise PrivacyError(f"seed must be a non-negative integer or None, got {seed!r}")
    return NoiseGenerator(np.random.Generator(np.random.PCG64(seed)))


def _is_torch(x: Any) -> bool:
    module = type(x).__module__
    return module.startswith("torch") and hasattr(x, "detach")


def _add_noise(x: Any, noise_fn) -> Any:
    if _is_torch(x):
        import torch

        if not torch.is_floating_point(x):
            raise PrivacyError(f"noise needs a floating-point tensor, got dtype {x.dtype}")
        noise = torch.from_numpy(noise_fn(tuple(x.shape))).to(device=x.device, dtype=x.dtype)
        return x + noise
    array = np.asarray(x)
    if not np.issubdtype(array.dtype, np.floating):
        raise PrivacyError(f"noise needs a floating-point array, got dtype {array.dtype}")
    noisy = array + noise_fn(array.shape)
    return noisy.astype(array.dtype, copy=False)


class GaussianMechanism:
    """``x + N(0, σ² I)``; σ comes from calibration for an already charged event."""

    def __init__(self, sigma: float, generator: NoiseGenerator) -> None:
        sigma = float(sigma)
        if not math.isfinite(sigma) or sigma <= 0:
            raise PrivacyError(f"GaussianMechanism: sigma must be a positive finite number, got {sigma!r}")
        self.sigma = sigma
        self.generator = generator

    def __call__(self, x: Any) -> Any:
        return _add_noise(x, lambda shape: self.sigma * self.generator.standard_normal(shape))


class LaplaceMechanism:
    """``x + Lap(b)`` coordinate-wise (density ``exp(-|t|/b)/(2b)``); ε = S₁/b."""

    def __init__(self, scale: float, generator: NoiseGenerator) -> None:
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise PrivacyError(f"LaplaceMechanism: scale must be a positive finite number, got {scale!r}")
        self.scale = scale
        self.generator = generator

    def __call__(self, x: Any) -> Any:
        return _add_noise(x, lambda shape: self.generator.laplace(shape, self.scale))
