"""L2 sensitivities of PATE aggregation (Fay, Sjölund & Oechtering, *Private Learning for High-Dimensional
Targets with PATE*, Sec. 3-4).

All bounds are for the *mean* of K teachers' answers under the **replace-one** relation (one patient
changes, so at most one teacher's answer changes — each patient is in exactly one teacher's partition):
the mean moves by ``(y_k - y'_k)/K``, so S = (max ||y_k - y'_k||_2) / K.
"""

from __future__ import annotations

import math

import numpy as np

from privacy.errors import PrivacyError
from privacy.options import Relation

RELATION = Relation.REPLACE_ONE


def _teachers(teachers) -> int:
    if isinstance(teachers, bool) or not float(teachers).is_integer() or int(teachers) < 1:
        raise PrivacyError(f"teachers must be a positive integer, got {teachers!r}")
    return int(teachers)


def _positive(name: str, value) -> float:
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise PrivacyError(f"{name} must be a positive finite number, got {value!r}")
    return number


def pca_paper_bound(dim: int, teachers: int) -> float:
    """``sqrt(d)/K`` — Fay et al. Alg. 1 / Sec. 3 (replace-one).

    Teacher outputs y ∈ [0,1]^d, so y_k - y'_k ∈ [-1,1]^d, and with orthonormal rows
    ``||A_l u||_2 ≤ ||u||_2 ≤ sqrt(d)``. Valid only if what is aggregated is bounded in [0,1]^d
    (probabilities), never for raw logits.
    """
    if isinstance(dim, bool) or not float(dim).is_integer() or int(dim) < 1:
        raise PrivacyError(f"dim must be a positive integer, got {dim!r}")
    return math.sqrt(int(dim)) / _teachers(teachers)


def pca_public_bound(basis, teachers: int) -> float:
    """``min(sqrt(d), sqrt(Σ_j ||a_j||_1²)) / K`` for the public l×d basis with rows a_j (replace-one).

    Tighter version of Fay et al.'s Sec. 3 bound computed from the public basis only:
    ``|a_j·u| ≤ ||a_j||_1`` for u ∈ [-1,1]^d, so ``||A u||_2 ≤ sqrt(Σ_j ||a_j||_1²)``; the paper's
    ``sqrt(d)`` bound (orthonormal rows) still applies, and the minimum of two bounds is a bound.
    """
    matrix = np.asarray(basis, dtype=np.float64)
    if matrix.ndim != 2 or matrix.size == 0:
        raise PrivacyError(f"basis must be a non-empty 2-D array (l, d), got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise PrivacyError("basis must be finite")
    l1_rows = np.abs(matrix).sum(axis=1)
    bound = min(math.sqrt(matrix.shape[1]), float(np.sqrt(np.sum(l1_rows**2))))
    return bound / _teachers(teachers)


def pca_row_bound(norm_bound: float, teachers: int) -> float:
    """``R/K`` for PCA of probabilities whose per-teacher difference ``||A_l (y - y')||`` is at most R
    (R = sqrt(d) or the public bound of :func:`pca_public_bound` times K) -- replace-one; used by the
    hospital, which recomputes R from the basis it was sent (task.codecs.verify_codec)."""
    return _positive("norm_bound", norm_bound) / _teachers(teachers)


def unit_ball_bound(teachers: int) -> float:
    """``2/K`` — Fay et al. Alg. 2 (autoencoded PATE; replace-one).

    Latents are mapped into the unit l-ball by φ (Fay et al., Sec. 4), so ``||z_k - z'_k||_2 ≤ 2``.
    """
    return 2.0 / _teachers(teachers)


def clipped_bound(clip: float, teachers: int) -> float:
    """``2C/K`` for encodings clipped to L2 norm C (replace-one; the clipped mode, as Fay et al. Alg. 2)."""
    return 2.0 * _positive("clip", clip) / _teachers(teachers)


def onehot_vote_bound(voxels: int, teachers: int) -> float:
    """``sqrt(2·voxels)/K`` for averaging one-hot votes (naive PATE on every voxel; replace-one).

    One teacher's one-hot vector changes in at most 2 entries per voxel (one 1 moves), each by 1, so
    ``||y_k - y'_k||_2 ≤ sqrt(2·voxels)`` (the d = classes × voxels baseline of Fay et al. Sec. 3).
    """
    if isinstance(voxels, bool) or not float(voxels).is_integer() or int(voxels) < 1:
        raise PrivacyError(f"voxels must be a positive integer, got {voxels!r}")
    return math.sqrt(2.0 * int(voxels)) / _teachers(teachers)
