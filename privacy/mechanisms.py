"""Gaussian and Laplace noise for numpy arrays and torch tensors.

Flow everywhere (docs/ARCHITECTURE.md): ``guard.charge(...)`` (ledger written) → add noise → release.
These classes only add noise; they do not account.

Where the randomness of a release comes from is a :class:`NoiseSource` (docs/PRIVACY.md, "Noise"): by default
every stream is drawn from the operating system's cryptographically secure generator (``secrets`` /
``os.urandom``), so nobody can regenerate the noise and subtract it. Seeded, reproducible noise exists
only for simulations that ask for it explicitly (``--reproducible-noise``); its streams are then derived
from the seed *and the release's name* through :class:`numpy.random.SeedSequence`, so two releases (two
cells of a comparison, two queries, two epochs) never share a stream. A reproducible source is not a
private release: whoever knows the seed can remove the noise; runners never write that seed into an
artefact.

The secure generator turns the CSPRNG's bytes into standard normals with the Box–Muller transform (Box &
Muller 1958): 64 random bits for the radius (53 used: the tails reach 8.6 standard deviations, beyond the
8.3 of the inverse-CDF sampler it replaced) and 32 for the angle, for every pair of normals; cosine and
sine of the angle come from a 1024-entry table and a short Taylor series, accurate to float64 rounding.
The transform is a fixed function of the bytes (:func:`box_muller`), so it can be tested against a
reference, and vectorised in chunks so a DP-SGD step's millions of normals stay cheap.

Security note: noise is drawn in floating point. Floating-point samplers are *not* hardened against
Mironov's floating-point attack on the Laplace mechanism (CCS 2012) or its Gaussian analogues (Jin et al.
2022, precision-based attacks); the secure source only makes the randomness unpredictable, not the
sampler exact.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import numpy as np

from privacy.errors import PrivacyError
from privacy.options import NoiseKind
from privacy.validation import positive_number


class NoiseGenerator:
    """Source of standard normal and Laplace noise (float64 numpy arrays)."""

    secure = False

    def __init__(self, rng: np.random.Generator | None = None) -> None:
        self.rng = rng

    def standard_normal(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.rng.standard_normal(shape)

    def fill_standard_normal(self, out: np.ndarray) -> np.ndarray:
        """Fill the 1-d float array ``out`` with standard normals, drawn in its order (each rounded once to its
        dtype) in chunks that bound the temporaries; returns ``out``. The same stream fills the same values
        whatever the chunking: it draws what ``standard_normal((out.size,))`` would."""
        for start in range(0, out.size, _CHUNK):
            part = out[start:start + _CHUNK]
            part[...] = self.rng.standard_normal(part.size)
        return out

    def laplace(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        return self.rng.laplace(0.0, scale, shape)

    def uniform(self, shape: tuple[int, ...]) -> np.ndarray:
        """Uniform doubles in [0, 1) (Poisson sampling and shuffling of private records)."""
        return self.rng.random(shape)

    def spawn(self) -> "NoiseGenerator":
        """An independent stream derived from this one without drawing from it (``SeedSequence.spawn``: the
        child's spawn key extends this stream's), so one release may draw from two streams in parallel -- DP-SGD's
        batches on the training thread, its noise on a thread of its own -- each in its own fixed order. Each
        call gives the next child."""
        return NoiseGenerator(self.rng.spawn(1)[0])


#: normals per Box–Muller chunk: bounds the transform's temporaries (about 30 bytes a normal) to a few MB
_CHUNK = 1 << 18

#: the angle's table: cos and sin of 2 pi i / 2^_TABLE_BITS; the remaining angle is under 2 pi / 1024
_TABLE_BITS = 10
_TABLE_COS = np.cos(2.0 * np.pi * np.arange(1 << _TABLE_BITS) / (1 << _TABLE_BITS))
_TABLE_SIN = np.sin(2.0 * np.pi * np.arange(1 << _TABLE_BITS) / (1 << _TABLE_BITS))


def box_muller(radius_words: np.ndarray, angle_words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two independent standard normals (float64) per pair of random words (Box & Muller 1958).

    ``radius_words`` (uint64): the top 53 bits k give u = (k + 1) / 2^53 in (0, 1] and the radius
    r = sqrt(-2 ln u), so |z| <= sqrt(106 ln 2) = 8.57; ``angle_words`` (uint32): j gives the angle
    theta = 2 pi (j + 1/2) / 2^32. Returns (r cos theta, r sin theta). cos and sin come from the table entry
    of the top 10 bits of j and the Taylor series of the remaining angle b < 2 pi / 1024 (cos to b^6, sin to
    b^5: truncation errors under 1e-19, below float64 rounding), several times cheaper than numpy's float64
    cos and sin and as accurate (tests/test_privacy_noise.py checks both against math.cos / math.sin).
    """
    u = ((radius_words >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    radius = np.sqrt(-2.0 * np.log(u))
    high = (angle_words >> np.uint32(32 - _TABLE_BITS)).astype(np.intp)
    low = (angle_words & np.uint32((1 << (32 - _TABLE_BITS)) - 1)).astype(np.float64)
    b = (low + 0.5) * (2.0 * np.pi / 2.0 ** 32)
    b2 = b * b
    cos_b = 1.0 + b2 * (-0.5 + b2 * (1.0 / 24.0 - b2 * (1.0 / 720.0)))
    sin_b = b * (1.0 + b2 * (-1.0 / 6.0 + b2 * (1.0 / 120.0)))
    cos_a, sin_a = _TABLE_COS[high], _TABLE_SIN[high]
    return radius * (cos_a * cos_b - sin_a * sin_b), radius * (sin_a * cos_b + cos_a * sin_b)


class SecureNoiseGenerator(NoiseGenerator):
    """Noise from ``secrets`` (os.urandom): normals by Box–Muller (:func:`box_muller`), uniform doubles from 53
    random bits, Laplace by the inverse CDF.

    Not seedable and stateless (so several threads may fill parts of one buffer); see the module note on
    floating-point attacks.
    """

    secure = True

    def __init__(self) -> None:
        super().__init__(None)

    @staticmethod
    def _uniform_open(size: int) -> np.ndarray:
        # 53-bit uniforms in (0, 1): (k + 0.5) / 2^53 never hits 0 or 1, so the inverse CDFs stay finite.
        raw = np.frombuffer(secrets.token_bytes(8 * size), dtype=np.uint64) >> np.uint64(11)
        return (raw.astype(np.float64) + 0.5) / float(2**53)

    @staticmethod
    def _normal_pairs(pairs: int) -> tuple[np.ndarray, np.ndarray]:
        """``pairs`` pairs of standard normals from 12 fresh bytes each (8 for the radius, 4 for the angle)."""
        raw = secrets.token_bytes(12 * pairs)
        radius_words = np.frombuffer(raw, dtype=np.uint64, count=pairs)
        angle_words = np.frombuffer(raw, dtype=np.uint32, offset=8 * pairs, count=pairs)
        return box_muller(radius_words, angle_words)

    def fill_standard_normal(self, out: np.ndarray) -> np.ndarray:
        for start in range(0, out.size, _CHUNK):
            part = out[start:start + _CHUNK]
            pairs = (part.size + 1) // 2
            first, second = self._normal_pairs(pairs)
            part[:pairs] = first
            part[pairs:] = second[:part.size - pairs]
        return out

    def standard_normal(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64))
        return self.fill_standard_normal(np.empty(size, dtype=np.float64)).reshape(shape)

    def laplace(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64))
        u = self._uniform_open(size) - 0.5
        return (-scale * np.sign(u) * np.log1p(-2.0 * np.abs(u))).reshape(shape)

    def uniform(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape, dtype=np.int64))
        return self._uniform_open(size).reshape(shape)

    def spawn(self) -> "SecureNoiseGenerator":
        return SecureNoiseGenerator()


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


def _name_words(name: str) -> list[int]:
    """A release name as four 32-bit words (sha256 prefix): a SeedSequence spawn key per name."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


class NoiseSource:
    """Where every noisy release gets its randomness (docs/PRIVACY.md, "Noise"): secure unless asked otherwise.

    ``NoiseSource()`` (the default everywhere) hands out :class:`SecureNoiseGenerator` streams: nothing
    about them can be reproduced. ``NoiseSource.reproducible(seed)`` is for simulations that must repeat
    exactly; its stream for a name path ``(a, b, ...)`` is ``PCG64(SeedSequence(seed, spawn_key=words of
    a, b, ...))`` (the ``SeedSequence.spawn`` mechanism keyed by names rather than by call order), so
    streams of different names are independent and a resumed run draws what it drew before.

    ``child(*names)`` narrows the namespace (a comparison cell, a hospital, a training run);
    ``generator(*names)`` is the stream of one release. ``describe()`` is what results and model cards
    may say about the noise -- never the seed.
    """

    def __init__(self, seed: int | None = None, _path: tuple[str, ...] = ()) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise PrivacyError(f"reproducible noise needs a non-negative integer seed, got {seed!r}")
        self._seed = None if seed is None else int(seed)
        self.path = tuple(str(p) for p in _path)

    @classmethod
    def secure(cls) -> "NoiseSource":
        return cls(None)

    @classmethod
    def reproducible(cls, seed: int) -> "NoiseSource":
        if seed is None:
            raise PrivacyError("reproducible noise needs a seed")
        return cls(seed)

    @property
    def is_reproducible(self) -> bool:
        return self._seed is not None

    def child(self, *names: Any) -> "NoiseSource":
        if not names:
            raise PrivacyError("NoiseSource.child: give at least one name")
        return NoiseSource(self._seed, self.path + tuple(str(n) for n in names))

    def generator(self, *names: Any) -> NoiseGenerator:
        """The noise stream of the release named ``names`` under this source's namespace."""
        if self._seed is None:
            return SecureNoiseGenerator()
        path = self.path + tuple(str(n) for n in names)
        if not path:
            raise PrivacyError("a reproducible noise stream needs a name (release or run)")
        key = [word for part in path for word in _name_words(part)]
        sequence = np.random.SeedSequence(self._seed, spawn_key=key)
        return NoiseGenerator(np.random.Generator(np.random.PCG64(sequence)))

    def describe(self) -> dict:
        if self._seed is None:
            return {"noise": NoiseKind.SECURE, "noise_source": "operating-system CSPRNG (secrets/os.urandom); "
                                                        "every release draws its own stream"}
        return {"noise": NoiseKind.REPRODUCIBLE, "noise_source": "seeded PCG64 per release name (simulation only: "
                                                          "whoever knows the seed can remove the noise)"}

    def __repr__(self) -> str:
        kind = NoiseKind.REPRODUCIBLE if self._seed is not None else NoiseKind.SECURE
        return f"NoiseSource({kind}, path={'/'.join(self.path) or '-'})"


def _is_torch(x: Any) -> bool:
    module = type(x).__module__
    return module.startswith("torch") and hasattr(x, "detach")


def _add_noise(x: Any, noise_fn) -> Any:
    if _is_torch(x):
        # torch only for torch inputs: privacy/ stays framework-free (docs/ARCHITECTURE.md)
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
        self.sigma = positive_number("sigma", sigma, "GaussianMechanism")
        self.generator = generator

    def __call__(self, x: Any) -> Any:
        return _add_noise(x, lambda shape: self.sigma * self.generator.standard_normal(shape))


class LaplaceMechanism:
    """``x + Lap(b)`` coordinate-wise (density ``exp(-|t|/b)/(2b)``); ε = S₁/b."""

    def __init__(self, scale: float, generator: NoiseGenerator) -> None:
        self.scale = positive_number("scale", scale, "LaplaceMechanism")
        self.generator = generator

    def __call__(self, x: Any) -> Any:
        return _add_noise(x, lambda shape: self.generator.laplace(shape, self.scale))
