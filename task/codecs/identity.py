"""The naive per-voxel codec (the baseline of Fay et al.'s comparison): ``z = onehot(argmax y)`` flattened,
``l = C x voxels``. Opt-in at every hospital (node config ``allow-identity``): its sensitivity is correct, but the
trusted aggregator then sees every teacher's full-resolution segmentation.

Sensitivity (replace-one): one teacher's votes change in at most two entries per voxel, so its row moves by at
most ``sqrt(2 voxels)`` and the mean of K rows by ``sqrt(2 voxels)/K``.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from privacy import sensitivity as sens
from task.codecs.core import CodecKind, CodecRefused, latent_dim, one_hot, register_codec, scalar


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


IDENTITY = register_codec(CodecKind("identity", verify, sensitivity, encoder, fallback, opt_in=True,
                                    unbounded_latent=True))
