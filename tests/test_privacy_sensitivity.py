"""Sensitivity helpers (Fay et al. Sec. 3-4), including a brute-force check of the public PCA bound."""

import math

import numpy as np
import pytest

from privacy.errors import PrivacyError
from privacy.sensitivity import (
    clipped_bound,
    onehot_vote_bound,
    pca_paper_bound,
    pca_public_bound,
    unit_ball_bound,
)


def test_closed_forms():
    assert pca_paper_bound(100, 8) == pytest.approx(10 / 8)
    assert unit_ball_bound(8) == 0.25
    assert clipped_bound(3.0, 6) == 1.0
    assert onehot_vote_bound(50, 10) == pytest.approx(math.sqrt(100) / 10)


def test_public_bound_never_exceeds_paper_bound_and_is_valid():
    rng = np.random.default_rng(0)
    d, l, k = 12, 3, 4
    q, _ = np.linalg.qr(rng.standard_normal((d, l)))
    basis = q.T  # orthonormal rows
    bound = pca_public_bound(basis, k)
    assert bound <= pca_paper_bound(d, k) + 1e-12
    # max over u in [-1,1]^d of ||A u|| is attained at a vertex: brute force all 2^12 sign vectors
    signs = np.array(np.meshgrid(*[[-1.0, 1.0]] * d)).reshape(d, -1)
    worst = np.linalg.norm(basis @ signs, axis=0).max() / k
    assert worst <= bound + 1e-12


def test_public_bound_is_tighter_for_sparse_basis():
    basis = np.zeros((2, 100))
    basis[0, 0] = 1.0
    basis[1, 1] = 1.0
    assert pca_public_bound(basis, 2) == pytest.approx(math.sqrt(2) / 2)
    assert pca_paper_bound(100, 2) == 5.0


@pytest.mark.parametrize("call", [
    lambda: unit_ball_bound(0), lambda: clipped_bound(-1, 2), lambda: pca_paper_bound(0, 2),
    lambda: onehot_vote_bound(0, 2), lambda: pca_public_bound(np.zeros(3), 2),
])
def test_invalid(call):
    with pytest.raises(PrivacyError):
        call()
