"""PCA-PATE's codec (Fay et al., Algorithm 1): ``z = A_l (y - mu)`` with the public basis
``A_l`` (l x d, orthonormal rows) and mean ``mu``; the hospital side (the server's
:class:`server.compressors.PCACompressor` fits the basis on public maps).

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
from task.codecs.core import (PROBABILITY_TOLERANCE, CodecKind, CodecRefused, check_finite, check_probabilities,
                             clip_rows, register_codec, row_bound, scalar, zero_rows)

ORTHONORMAL_TOLERANCE = 1e-3


def verify(state: Mapping[str, np.ndarray], classes: int, grid: tuple, latent: int, scans_shape) -> float:
    """Shapes agree with ``classes x grid``; rows orthonormal (the ``sqrt(d)`` and public bounds need
    ``||A_l||_op <= 1``); the mean in [0, 1]^d (so ``y - mu`` lies in [-1, 1]^d); a positive finite clip in
    clip mode. Returns the row bound recomputed from the basis (public), sqrt(d) (paper) or C (clip)."""
    mode = str(scalar(state, "mode"))
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
    if mode == "clip":
        clip = float(scalar(state, "clip"))
        if not (math.isfinite(clip) and clip > 0):
            raise CodecRefused(f"codec: PCA clip must be a positive number, got {clip}")
        return clip
    if mode == "paper":
        return math.sqrt(d)
    if mode == "public":
        return min(math.sqrt(d), float(np.sqrt(np.sum(np.abs(components).sum(axis=1) ** 2))))
    raise CodecRefused(f"codec: unknown PCA mode {mode!r}")


def sensitivity(state: Mapping[str, np.ndarray], teachers: int) -> float:
    """``2C/K`` in clip mode; ``R/K`` for probabilities (the difference of two rows is itself bounded by R)."""
    if str(scalar(state, "mode")) == "clip":
        return float(sens.clipped_bound(row_bound(state), teachers))
    return float(sens.pca_row_bound(row_bound(state), teachers))


def encoder(state: Mapping[str, np.ndarray], device=None):
    mode = str(scalar(state, "mode"))
    components = np.asarray(state["components"], dtype=np.float32)
    mean = np.asarray(state["mean"], dtype=np.float32)

    def encode(probs: np.ndarray) -> np.ndarray:
        if mode in ("paper", "public"):
            check_probabilities(probs)
            probs = np.clip(probs, 0.0, 1.0)
        else:
            check_finite(probs)
        z = (probs.reshape(len(probs), -1) - mean) @ components.T
        if mode == "clip":
            return clip_rows(z, float(scalar(state, "clip")))
        # [-1,1]^d difference bound also bounds the row itself (y - mu in [-1,1]^d since mu in [0,1]^d);
        # clipping to it is a no-op for valid input and guards float round-off.
        return clip_rows(z, row_bound(state) * (1 + 1e-6))

    return encode


PCA = register_codec(CodecKind("pca", verify, sensitivity, encoder, zero_rows))
