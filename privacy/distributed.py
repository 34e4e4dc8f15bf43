"""Distributed discrete Gaussian noise on the integer grid, for sums that only a secure aggregation reveals.

Kairouz, Liu & Steinke 2021, "The distributed discrete Gaussian mechanism for federated learning with
secure aggregation" (arXiv 2102.06387), Algorithm 1, client side; each step here is one function:

1. **scale** a vector of L2 norm at most ``c`` by ``1/granularity`` (:class:`IntegerGrid`);
2. **conditional randomized rounding** (:func:`conditional_round`): round every coordinate up with
   probability equal to its fractional part, and draw again until the rounded vector's norm is at most
   :func:`rounded_norm_bound` -- so the bound holds for every released vector, and the rounding error is
   inside the sensitivity the accountant sees;
3. **noise**: add the party's share of discrete Gaussian noise ``N_Z(0, v)`` per coordinate, drawn exactly
   (:func:`sample_discrete_gaussian`, Canonne, Kamath & Steinke 2020, arXiv 2004.00010, Algorithms 1-3,
   integers only; no floating point touches the noise);
4. **wrap** modulo ``2^bits``: the secure sum adds modulo ``2^bits``; :func:`modulus_bits` picks the bits so
   the true sum does not wrap except with a stated probability. Wrapping is post-processing of the noisy
   sum (the server only sees the sum modulo ``2^bits``), so it costs utility, never privacy: its
   probability is reported, not charged.

Privacy of the sum: :class:`privacy.events.DistributedDiscreteGaussianEvent` (their Prop. 14).

Neighbouring contributions: a party's vector is the sum of independently rounded rows, one per teacher (or
per patient), each of norm at most ``c`` before rounding and at most ``Δ = rounded_norm_bound(c, d)``
after. Replacing one patient changes one row; whatever the two roundings were, the integer sums differ by
a vector ``w`` with ``||w||_2 <= 2Δ`` and ``||w||_1 <= 2Δ min(sqrt(d), 2Δ)`` (an integer vector's L1 norm
is at most its squared L2 norm). The released distribution is a mixture over the roundings, and Rényi
divergence is jointly quasi-convex (van Erven & Harremoës 2014, Thm. 13), so the mixture is no less private
than the worst pair: :func:`row_sensitivity` gives these bounds per relation.

Randomness: noise and rounding draw from a :class:`privacy.mechanisms.NoiseGenerator`; a secure one (the
default everywhere) reads the operating system's CSPRNG, a reproducible one a seeded stream (simulation
only, exactly as for the continuous mechanisms).
"""

from __future__ import annotations

import math
import random
import secrets
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from privacy.errors import PrivacyError
from privacy.events import DistributedDiscreteGaussianEvent
from privacy.mechanisms import SecureNoiseGenerator
from privacy.validation import positive_integer, positive_number, probability

#: Kairouz et al.'s choice: the conditional rounding's norm bound fails with probability at most β per
#: draw; with β = exp(-1/2) the bound's extra term is sqrt(2 ln 1/β) = 1 (and each draw passes with
#: probability >= 1 - β ≈ 0.39; in practice nearly every draw passes, see tests).
DEFAULT_BETA = math.exp(-0.5)

#: bits of the secure sum's modulus at most: masks and sums are held in 64-bit integers
MAX_BITS = 62

#: how often a rounding is redrawn before giving up (failure probability at most β^tries)
MAX_ROUNDING_TRIES = 200


# ------------------------------------------------------------------------------------------ exact sampler
class IntegerRandomness:
    """Uniform integers for the exact samplers: ``below(n)`` is uniform on {0, ..., n-1}.

    Secure: ``secrets.SystemRandom`` (operating-system CSPRNG); reproducible: ``random.Random`` seeded
    from the given numpy stream (simulation only)."""

    def __init__(self, source: random.Random) -> None:
        self._below = source.randrange

    @classmethod
    def of(cls, generator) -> "IntegerRandomness":
        """The integer randomness of a ``privacy.mechanisms.NoiseGenerator`` (secure stays secure)."""
        if generator is None or getattr(generator, "secure", False):
            return cls(secrets.SystemRandom())
        seed = int(generator.rng.integers(0, 2**63 - 1))
        return cls(random.Random(seed))

    def below(self, n: int) -> int:
        return self._below(n)


def _bernoulli_exp_neg_at_most_one(num: int, den: int, rng: IntegerRandomness) -> bool:
    """Bernoulli(exp(-num/den)) for 0 <= num/den <= 1: Canonne et al. Algorithm 1 (von Neumann's trick)."""
    k = 1
    while rng.below(den * k) < num:   # Bernoulli(γ/k)
        k += 1
    return k % 2 == 1


def _bernoulli_exp_neg(num: int, den: int, rng: IntegerRandomness) -> bool:
    """Bernoulli(exp(-num/den)) for any rational num/den >= 0 (Canonne et al. Algorithm 1, γ > 1 part)."""
    while num > den:
        if not _bernoulli_exp_neg_at_most_one(1, 1, rng):
            return False
        num -= den
    return _bernoulli_exp_neg_at_most_one(num, den, rng)


def _discrete_laplace(t: int, rng: IntegerRandomness) -> int:
    """P[x] ∝ exp(-|x|/t) on the integers (Canonne et al. Algorithm 2, integer scale t)."""
    while True:
        u = rng.below(t)
        if not _bernoulli_exp_neg(u, t, rng):
            continue
        v = 0
        while _bernoulli_exp_neg_at_most_one(1, 1, rng):
            v += 1
        x = u + t * v
        negative = rng.below(2) == 1
        if negative and x == 0:
            continue
        return -x if negative else x


def _discrete_gaussian(p: int, q: int, t: int, rng: IntegerRandomness) -> int:
    """One draw of N_Z(0, p/q) (Canonne et al. Algorithm 3): a discrete Laplace of scale t = floor(σ)+1,
    accepted with probability exp(-(|y| - σ²/t)² / (2σ²)) = exp(-(|y| q t - p)² / (2 p q t²))."""
    den = 2 * p * q * t * t
    while True:
        y = _discrete_laplace(t, rng)
        if _bernoulli_exp_neg((abs(y) * q * t - p) ** 2, den, rng):
            return y


def sample_discrete_gaussian(variance: float, size: int, generator=None) -> np.ndarray:
    """``size`` independent draws of the discrete Gaussian ``N_Z(0, variance)`` (P[x] ∝ exp(-x²/(2 variance))),
    exactly: the float ``variance`` is read as the exact rational it stores, and only integer arithmetic
    follows (Canonne, Kamath & Steinke 2020, Algorithms 1-3). int64 array.

    ``generator``: a ``privacy.mechanisms.NoiseGenerator`` (None or secure: the operating system's CSPRNG).
    Cost: about 10-30 µs per draw in Python (tests/test_distributed_dp.py).
    """
    variance = positive_number("variance", variance, "sample_discrete_gaussian")
    size = int(size)
    if size < 0:
        raise PrivacyError(f"sample_discrete_gaussian: size must be >= 0, got {size}")
    exact = Fraction(variance)
    p, q = exact.numerator, exact.denominator
    t = math.isqrt(p // q) + 1
    rng = IntegerRandomness.of(generator)
    return np.fromiter((_discrete_gaussian(p, q, t, rng) for _ in range(size)), dtype=np.int64, count=size)


# ------------------------------------------------------------------------------------------ rounding
def rounded_norm_bound(c: float, dimension: int, beta: float = DEFAULT_BETA) -> float:
    """Norm bound of a conditionally rounded vector whose scaled norm is at most ``c`` (Kairouz et al.,
    Sec. 4, the conditional rounding's bound): ``Δ² = min{c² + d/4 + sqrt(2 ln 1/β)(c + sqrt(d)/2),
    (c + sqrt(d))²}``. The second term holds for every rounding; the first fails with probability at most β
    for one draw, which is why the rounding is redrawn until it holds."""
    c = positive_number("c", c, "rounded_norm_bound")
    d = positive_integer("dimension", dimension, "rounded_norm_bound")
    beta = probability("beta", beta)
    first = c * c + d / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (c + math.sqrt(d) / 2.0)
    return math.sqrt(min(first, (c + math.sqrt(d)) ** 2))


def conditional_round(scaled: np.ndarray, bound: float, generator=None,
                      max_tries: int = MAX_ROUNDING_TRIES) -> np.ndarray:
    """Randomized rounding of each row of ``scaled`` (shape (..., d)) to the integers, each row redrawn
    until its L2 norm is at most ``bound`` (Kairouz et al., Algorithm 1, "conditional randomized rounding").

    Every coordinate x is rounded to ceil(x) with probability x - floor(x), else floor(x) (unbiased). The
    norm is checked exactly on the integers (sum of squares against floor(bound²)), so the bound the
    sensitivity relies on holds for every row returned. PrivacyError after ``max_tries`` failed draws of a
    row (a row that was not clipped to the norm the bound was computed for)."""
    values = np.asarray(scaled, dtype=np.float64)
    if values.ndim < 1 or not np.all(np.isfinite(values)):
        raise PrivacyError("conditional_round: expected a finite array of rows")
    rows = values.reshape(-1, values.shape[-1])
    limit = math.floor(float(bound) ** 2)
    floors = np.floor(rows)
    fractions = rows - floors
    if np.max(np.abs(floors), initial=0) > 2**31:
        raise PrivacyError("conditional_round: values too large for the integer grid (granularity too fine)")
    floors = floors.astype(np.int64)
    out = np.empty_like(floors)
    pending = np.arange(len(rows))
    uniform = (generator if generator is not None else SecureNoiseGenerator()).uniform
    for _ in range(max_tries):
        if len(pending) == 0:
            return out.reshape(values.shape)
        draw = floors[pending] + (uniform(fractions[pending].shape) < fractions[pending]).astype(np.int64)
        ok = np.sum(draw * draw, axis=1) <= limit
        out[pending[ok]] = draw[ok]
        pending = pending[~ok]
    if len(pending) == 0:
        return out.reshape(values.shape)
    raise PrivacyError(f"conditional_round: {len(pending)} row(s) never met the norm bound {bound:.6g} in "
                       f"{max_tries} draws (were they clipped to the norm the bound assumes?)")


def row_sensitivity(row_bound: float, dimension: int, relation: str = "replace-one") -> tuple[float, float]:
    """(L2, L1) bounds of the integer shift of a sum of rounded rows when one row changes (module docstring):
    a replaced row moves the sum by at most 2Δ (replace-one), an added, removed or zeroed-out one by at
    most Δ. L1 <= L2 · min(sqrt(d), L2) for an integer vector."""
    factor = {"replace-one": 2.0, "add-remove": 1.0, "zero-out": 1.0}.get(relation)
    if factor is None:
        raise PrivacyError(f"row_sensitivity: unknown relation {relation!r}")
    l2 = factor * float(row_bound)
    return l2, l2 * min(math.sqrt(int(dimension)), l2)


# ------------------------------------------------------------------------------------------ modulus
def modulus_bits(max_abs_sum: float, noise_variance_total: float, coordinates: int,
                 wrap_probability: float = 1e-9) -> int:
    """Bits b such that a sum of absolute value at most ``max_abs_sum`` per coordinate plus discrete
    Gaussian noise of total variance ``noise_variance_total`` per coordinate stays inside
    (-2^(b-1), 2^(b-1)) on all ``coordinates`` except with probability ``wrap_probability``.

    The discrete Gaussian N_Z(0, v) is v-subgaussian (Canonne, Kamath & Steinke 2020, Cor. 9), sums of
    independent ones add their parameters, so P[|noise| > s] <= 2 exp(-s²/(2 v_total)) per coordinate and
    a union bound over coordinates gives s. PrivacyError if more than :data:`MAX_BITS` would be needed."""
    wrap_probability = probability("wrap_probability", wrap_probability)
    spread = math.sqrt(2.0 * float(noise_variance_total) * math.log(2.0 * int(coordinates) / wrap_probability))
    half = float(max_abs_sum) + spread
    bits = max(2, math.ceil(math.log2(2.0 * half + 2.0)))
    if bits > MAX_BITS:
        raise PrivacyError(f"the secure sum would need {bits} bits per coordinate (> {MAX_BITS}); use a coarser "
                           "granularity")
    return bits


def wrap_bound(bits: int, max_abs_sum: float, noise_variance_total: float, coordinates: int) -> float:
    """Upper bound on the probability that the sum wraps modulo 2^bits on any of ``coordinates`` (the
    subgaussian tail of :func:`modulus_bits`, read the other way); 1 when the signal alone can wrap."""
    room = 2.0 ** (int(bits) - 1) - 1 - float(max_abs_sum)
    if room <= 0:
        return 1.0
    return float(min(1.0, 2.0 * int(coordinates) * math.exp(-room * room / (2.0 * float(noise_variance_total)))))


def centered(values: np.ndarray, bits: int) -> np.ndarray:
    """Residues modulo 2^bits read as integers in [-2^(bits-1), 2^(bits-1))."""
    modulus = np.int64(1) << np.int64(bits)
    residues = np.asarray(values, dtype=np.int64) & (modulus - 1)
    return np.where(residues >= modulus // 2, residues - modulus, residues)


# ------------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class IntegerGrid:
    """How real rows of norm at most ``clip`` go onto the integers, and what one release then is.

    ``granularity`` γ: one integer step is γ in the rows' units; ``row_bound`` Δ: the norm of a rounded row
    (:func:`rounded_norm_bound` of ``clip/γ``); ``dimension``: a row's length d (one release);
    ``rows``: how many rows one sum adds at most (every party's teachers together), for the modulus."""

    clip: float
    granularity: float
    dimension: int
    beta: float = DEFAULT_BETA

    @property
    def scaled_clip(self) -> float:
        return self.clip / self.granularity

    @property
    def row_bound(self) -> float:
        return rounded_norm_bound(self.scaled_clip, self.dimension, self.beta)

    def to_integers(self, rows: np.ndarray, generator=None) -> np.ndarray:
        """Rows (..., d) of norm <= clip (re-clipped here, a float safety margin) to rounded integer rows."""
        rows = np.asarray(rows, dtype=np.float64)
        norms = np.linalg.norm(rows, axis=-1, keepdims=True)
        rows = rows * np.minimum(1.0, self.clip / np.maximum(norms, 1e-300))
        return conditional_round(rows / self.granularity, self.row_bound, generator)

    def to_reals(self, integers: np.ndarray) -> np.ndarray:
        return np.asarray(integers, dtype=np.float64) * self.granularity

    @classmethod
    def for_rows(cls, clip: float, dimension: int, inflation: float = 1e-3, beta: float = DEFAULT_BETA
                 ) -> "IntegerGrid":
        """The coarsest power-of-two grid (γ = clip / 2^k) whose rounding inflates the row norm bound by at
        most ``inflation`` (Δ·γ <= clip·(1 + inflation)): the rounding then costs at most that much noise."""
        clip = positive_number("clip", clip, "IntegerGrid")
        for k in range(4, 40):
            grid = cls(clip, clip / 2.0**k, int(dimension), beta)
            if grid.row_bound <= grid.scaled_clip * (1.0 + inflation):
                return grid
        raise PrivacyError(f"IntegerGrid: no grid reaches inflation {inflation} for d={dimension}")


def share_count(participants: int, colluders: int, dropouts: int) -> int:
    """Honest shares a party can count on: ``participants - colluders - dropouts`` (its own included)."""
    n = int(participants) - int(colluders) - int(dropouts)
    if int(colluders) < 0 or int(dropouts) < 0 or n < 1:
        raise PrivacyError(f"{participants} participants with {colluders} colluders and {dropouts} dropouts "
                           "leave no honest share to count on")
    return n


def ddg_event(grid: IntegerGrid, local_variance: float, shares: int, count: int = 1,
              relation: str = "replace-one") -> DistributedDiscreteGaussianEvent:
    """The event of ``count`` releases of a sum of rounded rows on ``grid`` (one row changes per neighbour)
    with ``shares`` counted noise shares of ``local_variance`` each."""
    l2, l1 = row_sensitivity(grid.row_bound, grid.dimension, relation)
    return DistributedDiscreteGaussianEvent(l2_sensitivity=l2, l1_sensitivity=l1, local_variance=local_variance,
                                            shares=int(shares), dimension=grid.dimension, count=int(count),
                                            relation=relation)


def calibrate_local_variance(epsilon: float, delta: float, releases: int, grid: IntegerGrid, shares: int,
                             relation: str = "replace-one", accountant: str = "rdp") -> float:
    """The smallest local variance v (a float, sampled exactly as stored) such that ``releases`` releases
    with ``shares`` counted shares of N_Z(0, v) are (ε, δ)-DP: :func:`privacy.calibration.calibrate` on the
    noise's standard deviation, safe side.

    Args:
        epsilon / delta: the budget all ``releases`` together may spend.
        releases: how many secure sums are released (one per query).
        grid: the integer grid the rows are rounded onto (its row bound and dimension give the sensitivity).
        shares: the noise shares each release can count on (the honest survivors' shares).
        relation: the neighbouring relation the sensitivity is taken under.
        accountant: the accountant the calibration composes with.
    """
    from privacy.calibration import calibrate

    epsilon = positive_number("epsilon", epsilon)
    releases = positive_integer("releases", releases)
    l2, _ = row_sensitivity(grid.row_bound, grid.dimension, relation)
    # the continuous Gaussian's zCDP answer as the starting bracket
    rho = epsilon * epsilon / (4.0 * math.log(1.0 / delta) + 4.0 * epsilon)
    guess = l2 * math.sqrt(releases / (2.0 * rho) / shares)
    sigma = calibrate(lambda s: ddg_event(grid, s * s, shares, releases, relation), epsilon, delta, accountant,
                      guess / 4.0, guess * 4.0)
    return sigma * sigma
