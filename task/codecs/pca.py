"""PCA-PATE's codec (Fay et al., Algorithm 1): ``z = A_l (y - mu)`` with the public basis
``A_l`` (l x d, orthonormal rows) and mean ``mu``; both sides: the hospitals' encoder, and the server's
:class:`PCACompressor`, which fits the basis on public maps, chooses l (eq. 7) and decodes.

Sensitivity (replace-one): one patient changes one teacher's output ``y`` into any ``y'``.
* ``paper`` / ``public`` mode: probabilities are verified in [0, 1]^d, so ``y - y' in [-1, 1]^d`` and
  ``||z - z'|| = ||A_l (y - y')|| <= R`` with ``R = sqrt(d)`` (eq. 3-4; ``||A_l||_op <= 1`` for orthonormal rows) or
  the tighter public ``R = min(sqrt(d), sqrt(sum_j ||a_j||_1^2))``; the mean of K rows moves by ``R/K``.
* ``clip`` mode: rows clipped to ``||z|| <= C``, so ``||z - z'|| <= 2C`` and S = 2C/K.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from privacy import sensitivity as sens
from task.codecs.contract import Compressor, PublicFit, answering_teachers
from task.codecs.core import (PROBABILITY_TOLERANCE, ROW_TOLERANCE, CodecKind, CodecRefused, check_finite,
                             check_probabilities, clip_rows, normalise_probabilities, register_codec, row_bound, scalar,
                             zero_rows)
from task.errors import UserError
from task.options import PcaMode, look_up_option
from task.settings.presets import Codec

ORTHONORMAL_TOLERANCE = 1e-3
#: the modes whose bound assumes the rows are images of probabilities (eq. 3-4), not clipped rows
PROBABILITY_MODES = (PcaMode.PAPER, PcaMode.PUBLIC)


def mode_of(state: Mapping[str, np.ndarray]) -> PcaMode:
    """The state's sensitivity mode (:class:`task.options.PcaMode`); an unknown one is refused."""
    mode = str(scalar(state, "mode"))
    try:
        return PcaMode(mode)
    except ValueError:
        raise CodecRefused(f"codec: unknown PCA mode {mode!r}") from None


def verify(state: Mapping[str, np.ndarray], classes: int, grid: tuple, latent: int, scans_shape) -> float:
    """Shapes agree with ``classes x grid``; rows orthonormal (the ``sqrt(d)`` and public bounds need
    ``||A_l||_op <= 1``); the mean in [0, 1]^d (so ``y - mu`` lies in [-1, 1]^d); a positive finite clip in
    clip mode. Returns the row bound recomputed from the basis (public), sqrt(d) (paper) or C (clip)."""
    components = np.asarray(state.get("components"), dtype=np.float64)
    mean = np.asarray(state.get("mean"), dtype=np.float64)
    d = classes * int(np.prod(grid))
    if components.shape != (latent, d) or mean.shape != (d,):
        raise CodecRefused(f"codec: PCA components {components.shape} / mean {mean.shape} do not match "
                           f"latent_dim {latent} and d = {classes} x {int(np.prod(grid))}")
    if not (np.all(np.isfinite(components)) and np.all(np.isfinite(mean))):
        raise CodecRefused("codec: PCA components or mean are not finite")
    gram = components @ components.T
    if np.abs(gram - np.eye(latent)).max() > ORTHONORMAL_TOLERANCE:
        raise CodecRefused("codec: PCA basis rows are not orthonormal (the sensitivity bound needs "
                           "||A_l||_op <= 1)")
    if mean.min() < -PROBABILITY_TOLERANCE or mean.max() > 1 + PROBABILITY_TOLERANCE:
        raise CodecRefused("codec: PCA mean is not a probability map in [0, 1]")
    mode = mode_of(state)
    if mode is PcaMode.CLIP:
        clip = float(scalar(state, "clip"))
        if not (math.isfinite(clip) and clip > 0):
            raise CodecRefused(f"codec: PCA clip must be a positive number, got {clip}")
        return clip
    if mode is PcaMode.PAPER:
        return math.sqrt(d)
    return min(math.sqrt(d), float(np.sqrt(np.sum(np.abs(components).sum(axis=1) ** 2))))


def sensitivity(state: Mapping[str, np.ndarray], teachers: int) -> float:
    """``2C/K`` in clip mode; ``R/K`` for probabilities (the difference of two rows is itself bounded by R)."""
    if mode_of(state) is PcaMode.CLIP:
        return float(sens.clipped_bound(row_bound(state), teachers))
    return float(sens.pca_row_bound(row_bound(state), teachers))


def encoder(state: Mapping[str, np.ndarray], device=None):
    mode = mode_of(state)
    components = np.asarray(state["components"], dtype=np.float32)
    mean = np.asarray(state["mean"], dtype=np.float32)

    def encode(probs: np.ndarray) -> np.ndarray:
        if mode in PROBABILITY_MODES:
            check_probabilities(probs)
            probs = np.clip(probs, 0.0, 1.0)
        else:
            check_finite(probs)
        z = (probs.reshape(len(probs), -1) - mean) @ components.T
        if mode is PcaMode.CLIP:
            return clip_rows(z, float(scalar(state, "clip")))
        # [-1,1]^d difference bound also bounds the row itself (y - mu in [-1,1]^d since mu in [0,1]^d);
        # clipping to it is a no-op for valid input and guards float round-off.
        return clip_rows(z, row_bound(state) * (1 + 1e-6))

    return encode


def implausible_rows(state: Mapping[str, np.ndarray], rows: np.ndarray) -> str | None:
    """Paper / public mode: the bound R/K needs the rows to be images of probabilities, which the hospital's
    encoder verifies; the server can only check the necessary condition ``||z|| <= R``. A longer row proves the
    reply was not produced by the codec (clipping it to R would only give 2R/K, twice the sensitivity the noise
    was calibrated for). Clip mode: any row, re-clipped to C, keeps 2C/K."""
    if mode_of(state) not in PROBABILITY_MODES:
        return None
    bound = row_bound(state)
    norms = np.linalg.norm(rows, axis=1)
    if np.any(norms > bound * (1 + ROW_TOLERANCE)):
        return (f"encoding norm {norms.max():.4g} exceeds {bound:.4g}, so it was not produced from probabilities "
                "by the public codec")
    return None


# --------------------------------------------------------------------------------------------------
# the server's side: fit the public basis, choose l, decode
# --------------------------------------------------------------------------------------------------
def choose_components(eigenvalues: np.ndarray, sigma: float) -> int:
    """Eq. 7 of Fay et al.: keep the components whose variance exceeds the noise variance,
    ``l = #{j : lambda_j > sigma^2}`` (at least 1), which minimises ``sum_{j>l} lambda_j + l sigma^2``
    for a sigma that does not depend on l."""
    eigenvalues = np.asarray(eigenvalues, dtype=np.float64)
    return max(1, int(np.sum(eigenvalues > float(sigma) ** 2)))


class PCACompressor(Compressor):
    """PCA-PATE (Fay et al., Algorithm 1): ``z = A_l (y - mu)``, ``y_hat = A_l^T z_bar + mu``.

    Fitted on one-hot public reference maps with the Gram-matrix trick (n << d: eigen-decompose the
    n x n matrix ``X X^T / (n-1)`` of the centred maps; ``a_j = X^T v_j / sqrt((n-1) lambda_j)``), which
    is exact and costs O(n^2 d). At most n-1 components exist; ``eigenvalues`` are the sample covariance's.

    Sensitivity (replace-one, Fay et al. Sec. 3, via :mod:`privacy.sensitivity`):
      * ``"paper"``  — ``sqrt(d)/K`` (eq. 4),
      * ``"public"`` — ``min(sqrt(d), sqrt(sum_j ||a_j||_1^2))/K`` (tighter, depends on l),
      * ``"clip"``   — rows clipped to ``C`` at the hospital, ``2C/K``. ``clip=None`` takes C = the
        largest norm of the public reference encodings (public, so free).

    Automatic l (``n_components=None``): :meth:`resolve_components`. For "paper" and "clip" S does not
    depend on l and the choice is exactly eq. 7 at ``sigma = c S``. For "public" S(l) grows with l, so
    sigma(l) = c S(l) does too, and "keep lambda_j > sigma^2" has no fixed point in general; we instead
    minimise the quantity eq. 7 minimises, ``E(l) = sum_{j>l} lambda_j + l c^2 S(l)^2``, over l directly
    (every kept component then satisfies lambda_j >= lambda_l > sigma(l)^2 only if that is optimal; the
    returned l is reported with its sigma).
    """

    name = "pca"

    def __init__(self, n_components: int | None = None, sensitivity_mode: str = "public",
                 clip: float | None = None):
        if n_components is not None and int(n_components) < 1:
            raise UserError(f"n_components: expected a positive integer or None, got {n_components}")
        self.n_components = None if n_components is None else int(n_components)
        self.sensitivity_mode = look_up_option(sensitivity_mode, PcaMode, "sensitivity_mode")
        self.clip = None if clip is None else float(clip)
        self.eigenvalues: np.ndarray | None = None
        self.basis: np.ndarray | None = None   # all fitted components (r, d), orthonormal rows
        self.mean: np.ndarray | None = None
        self.latent_dim = 0

    # -- fitting -----------------------------------------------------------------------------------
    def fit(self, public_onehot: np.ndarray) -> "PCACompressor":
        maps = self._check_fit_input(public_onehot)
        n = len(maps)
        flat = maps.reshape(n, -1)
        self.mean = flat.mean(axis=0).astype(np.float32)
        centred = (flat - self.mean).astype(np.float32)
        if flat.shape[1] <= n:  # more maps than dimensions: the d x d covariance is the smaller problem
            covariance = (centred.T.astype(np.float64) @ centred.astype(np.float64)) / (n - 1)
            values, vectors = np.linalg.eigh(covariance)
            order = np.argsort(values)[::-1]
            values, basis = values[order], vectors[:, order].T
            keep = values > max(values[0], 0.0) * 1e-10
            values, basis = values[keep], basis[keep]
        else:  # n << d (the usual case): eigen-decompose the n x n Gram matrix instead
            gram = (centred @ centred.T).astype(np.float64) / (n - 1)
            values, vectors = np.linalg.eigh(gram)
            order = np.argsort(values)[::-1]
            values, vectors = values[order], vectors[:, order]
            keep = values > max(values[0], 0.0) * 1e-10
            values, vectors = values[keep], vectors[:, keep]
            basis = (vectors.T @ centred.astype(np.float64)) / np.sqrt((n - 1) * values)[:, None]
        # Re-orthonormalise (round-off in float32 centring) so ||A_l u|| <= ||u|| holds exactly.
        q, r = np.linalg.qr(basis.T)
        basis = (q * np.sign(np.diag(r))).T
        self.basis = basis.astype(np.float64)
        self.eigenvalues = values.astype(np.float64)
        # Only n-1 directions exist: a larger n_components is capped (reported by describe()).
        self.latent_dim = min(self.n_components or len(values), len(values))
        if self.sensitivity_mode is PcaMode.CLIP and self.clip is None:
            z = (flat - self.mean) @ self.basis[: self.latent_dim].T
            self.clip = float(np.linalg.norm(z, axis=1).max()) or 1.0
            self._clip_auto = True
        self._fit_norms = None
        return self

    @property
    def d(self) -> int:
        return int(self.classes * np.prod(self.grid))

    @property
    def components(self) -> np.ndarray:
        """A_l: the first ``latent_dim`` principal directions (l, d)."""
        self._require_fit()
        return self.basis[: self.latent_dim]

    def _require_fit(self):
        if self.basis is None:
            raise UserError("PCACompressor: call fit(public reference maps) first")

    # -- sensitivity and the choice of l -------------------------------------------------------------
    def norm_bound(self, l: int | None = None) -> float:
        """Per-teacher bound R on ``||A_l (y - y')||`` for ``y, y' in [0,1]^d`` (paper/public modes)
        or the clip C; the replace-one sensitivity of the mean is R/K (paper/public) or 2C/K (clip)."""

        self._require_fit()
        l = self.latent_dim if l is None else int(l)
        if self.sensitivity_mode is PcaMode.PAPER:
            return float(sens.pca_paper_bound(self.d, 1))
        if self.sensitivity_mode is PcaMode.PUBLIC:
            return float(sens.pca_public_bound(self.basis[:l], 1))
        return float(self.clip)

    def sensitivity(self, teachers: int) -> float:
        teachers = answering_teachers(teachers)
        self._require_fit()
        if self.sensitivity_mode is PcaMode.PAPER:
            return float(sens.pca_paper_bound(self.d, teachers))
        if self.sensitivity_mode is PcaMode.PUBLIC:
            return float(sens.pca_public_bound(self.components, teachers))
        return float(sens.clipped_bound(self.clip, teachers))

    def expected_error(self, l: int, sigma: float) -> float:
        """Eq. 7 (from eq. 6): expected squared reconstruction error ``sum_{j>l} lambda_j + l sigma^2``.

        The sum runs over the fitted eigenvalues only (at most n-1): variance the public sample never
        showed is not in it."""
        self._require_fit()
        l = int(l)
        return float(self.eigenvalues[l:].sum() + l * float(sigma) ** 2)

    def fit_release(self, public: PublicFit, noise_per_sensitivity: float, teachers: int) -> "PCACompressor":
        """Fit on the public label maps (:meth:`PublicFit.label_maps`), then keep the components eq. 7 says."""
        maps, self.fit_counts = public.label_maps()
        self.fit(maps)
        self.resolve_components(noise_per_sensitivity, teachers)
        return self

    def resolve_components(self, noise_per_sensitivity: float, teachers: int) -> tuple[int, float]:
        """Choose l automatically (eq. 7) when ``n_components`` is None, for a calibration in which
        ``sigma = noise_per_sensitivity * S`` (true for the exact GDP and the paper's eq. 15
        calibrations: both are linear in S). Returns ``(l, sigma at that l)`` and sets ``latent_dim``.

        For the "public" mode S depends on l; see the class docstring for why we minimise
        ``E(l) = sum_{j>l} lambda_j + l (c S(l))^2`` instead of iterating eq. 7 to a fixed point.
        """

        self._require_fit()
        c = float(noise_per_sensitivity)
        teachers = answering_teachers(teachers)
        if self.n_components is not None:
            self.latent_dim = min(self.n_components, len(self.eigenvalues))
        elif self.sensitivity_mode in (PcaMode.PAPER, PcaMode.CLIP):
            sigma = c * self.sensitivity(teachers)
            self.latent_dim = choose_components(self.eigenvalues, sigma)
        else:
            # S(l) for every l at once: sqrt(cumulative sum of ||a_j||_1^2), capped at sqrt(d).
            l1_squared = np.cumsum(np.abs(self.basis).sum(axis=1) ** 2)
            bound = np.minimum(math.sqrt(self.d), np.sqrt(l1_squared)) / teachers
            ls = np.arange(1, len(self.eigenvalues) + 1)
            tails = np.concatenate([np.cumsum(self.eigenvalues[::-1])[::-1][1:], [0.0]])
            errors = tails + ls * (c * bound) ** 2
            self.latent_dim = int(ls[int(np.argmin(errors))])
            assert abs(bound[self.latent_dim - 1] - sens.pca_public_bound(self.components, teachers)) < 1e-6
        return self.latent_dim, c * self.sensitivity(teachers)

    # -- codec ---------------------------------------------------------------------------------------
    def state(self) -> dict:
        self._require_fit()
        state = self._base_state("pca")
        state.update({
            "mode": np.array(self.sensitivity_mode.value),
            "components": self.components.astype(np.float32),
            "mean": self.mean.astype(np.float32),
            "clip": np.array(float(self.clip) if self.clip is not None else float("nan")),
            "row_bound": np.array(self.norm_bound()),
        })
        return state

    def decode(self, z: np.ndarray) -> np.ndarray:
        """``y_hat = A_l^T z + mu`` (Algorithm 1), projected back onto per-voxel probabilities."""
        self._require_fit()
        z = np.asarray(z, dtype=np.float64).reshape(-1, self.latent_dim)
        flat = z @ self.components + self.mean
        return normalise_probabilities(flat.reshape(len(z), self.classes, *self.grid))

    def reconstruct_raw(self, maps: np.ndarray, sigma: float = 0.0, rng=None) -> np.ndarray:
        """``A_l^T (A_l (y - mu) + gamma) + mu`` without the probability projection (eq. 6), for tests."""
        flat = np.asarray(maps, dtype=np.float64).reshape(len(maps), -1)
        z = (flat - self.mean) @ self.components.T
        if sigma > 0:
            rng = rng or np.random.default_rng(0)
            z = z + rng.normal(0.0, sigma, size=z.shape)
        return z @ self.components + self.mean

    def describe(self) -> dict:
        return {"name": self.name, "latent_dim": int(self.latent_dim), "sensitivity_mode": self.sensitivity_mode.value,
                "clip": self.clip, "fitted_components": None if self.eigenvalues is None else len(self.eigenvalues),
                "explained_variance": None if self.eigenvalues is None else
                float(self.eigenvalues[: self.latent_dim].sum() / self.eigenvalues.sum())}


def compressor(settings: Codec, *, seed, checkpoint, progress, device=None, **options) -> PCACompressor:
    """The PCA compressor of a preset's codec settings (``pca_components``; options: ``n_components``,
    ``sensitivity_mode`` or ``pca_mode``, ``clip``)."""
    return PCACompressor(options.get("n_components", settings.pca_components),
                         options.get("sensitivity_mode", options.get("pca_mode", PcaMode.PUBLIC)), options.get("clip"))


PCA = register_codec(CodecKind("pca", verify, sensitivity, encoder, zero_rows, compressor=compressor,
                               implausible_rows=implausible_rows))
