"""The naive per-voxel codec (the baseline of Fay et al.'s comparison): ``z = onehot(argmax y)`` flattened,
``l = C x voxels``. Opt-in at every hospital (node config ``allow-identity``): its sensitivity is correct, but the
trusted aggregator then sees every teacher's full-resolution segmentation.

Sensitivity (replace-one): one teacher's votes change in at most two entries per voxel, so its row moves by at
most ``sqrt(2 voxels)`` and the mean of K rows by ``sqrt(2 voxels)/K``. The server's side is
:class:`IdentityCompressor` (it learns only the grid; the noisy mean of the votes is the pseudo-label).
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from privacy import sensitivity as sens
from task.codecs.contract import Compressor, answering_teachers
from task.codecs.core import (CodecKind, CodecRefused, latent_dim, normalise_probabilities, one_hot, register_codec,
                             scalar)
from task.errors import UserError
from task.settings.presets import Codec


def verify(state: Mapping[str, np.ndarray], classes: int, grid: tuple, latent: int, scans_shape) -> float:
    voxels = int(np.prod(grid))
    if latent != classes * voxels:
        raise CodecRefused(f"codec: identity latent_dim {latent} must be classes x voxels")
    return math.sqrt(voxels)


def sensitivity(state: Mapping[str, np.ndarray], teachers: int) -> float:
    return float(sens.onehot_vote_bound(latent_dim(state) // int(scalar(state, "classes")), teachers))


def encoder(state: Mapping[str, np.ndarray], device=None):
    classes = int(scalar(state, "classes"))
    return lambda probs: one_hot(probs.argmax(axis=1), classes).reshape(len(probs), -1).astype(np.float32)


def fallback(state: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    """Background votes: a fixed, data-independent one-hot map."""
    classes = int(scalar(state, "classes"))
    votes = np.zeros((n, classes, latent_dim(state) // classes), np.float32)
    votes[:, 0] = 1.0
    return votes.reshape(n, -1)


def implausible_rows(state: Mapping[str, np.ndarray], rows: np.ndarray) -> str | None:
    """Every row must be exact one-hot votes (checked exactly): the sensitivity counts votes, not norms."""
    votes = rows.reshape(len(rows), int(scalar(state, "classes")), -1)
    if not (np.all((votes == 0) | (votes == 1)) and np.all(votes.sum(axis=1) == 1)):
        return "identity codec expects one-hot votes"
    return None


# --------------------------------------------------------------------------------------------------
# the server's side
# --------------------------------------------------------------------------------------------------
class IdentityCompressor(Compressor):
    """The naive baseline: each teacher uploads its d = C x voxels one-hot votes; the noisy mean of the
    votes is the pseudo-label. Replace-one sensitivity ``onehot_vote_bound(voxels, K)`` (one teacher's
    vote can move in every voxel). Shows what compression buys."""

    name = "identity"

    def fit(self, public_onehot: np.ndarray) -> "IdentityCompressor":
        self._check_fit_input(public_onehot)
        self.latent_dim = int(self.classes * np.prod(self.grid))
        return self

    @property
    def voxels(self) -> int:
        return int(np.prod(self.grid))

    def sensitivity(self, teachers: int) -> float:
        return float(sens.onehot_vote_bound(self.voxels, answering_teachers(teachers)))

    def state(self) -> dict:
        if not self.grid:
            raise UserError("IdentityCompressor: call fit(public reference maps) first")
        state = self._base_state("identity")
        state.update({"clip": np.array(float("nan")), "row_bound": np.array(math.sqrt(self.voxels))})
        return state

    def decode(self, z: np.ndarray) -> np.ndarray:
        z = np.asarray(z, dtype=np.float32).reshape(-1, self.classes, *self.grid)
        return normalise_probabilities(z)


def compressor(settings: Codec, *, seed, checkpoint, progress, device=None, **options) -> IdentityCompressor:
    """The identity codec has no settings."""
    return IdentityCompressor()


IDENTITY = register_codec(CodecKind("identity", verify, sensitivity, encoder, fallback, opt_in=True,
                                    unbounded_latent=True, compressor=compressor, implausible_rows=implausible_rows,
                                    exact_rows=True))
