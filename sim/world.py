"""The public world the PATE server holds (SPEC section 1): loaded from a prepared dataset + split.

* query scans (the student's inputs, unlabelled for training; their labels are kept only for the
  pseudo-label diagnostic, which a real deployment may not have — then ``query_labels`` is None);
* public reference label maps (and their images): fit the PCA basis / train the autoencoder, and
  pre-train the public model (the ``public-only`` baseline and the teachers' initialisation);
* public validation and test sets (test labels are public here: they score every method).

Nothing in a PublicWorld comes from a hospital's partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PublicWorld:
    grid: tuple
    query_ids: list
    query_images: np.ndarray                      # (N, 4, *grid)
    reference_ids: list
    reference_images: np.ndarray | None           # (n_ref, 4, *grid) or None (labels only)
    reference_labels: np.ndarray                  # (n_ref, *grid) int
    test_ids: list
    test_images: np.ndarray
    test_labels: np.ndarray
    validation_images: np.ndarray | None = None
    validation_labels: np.ndarray | None = None
    query_labels: np.ndarray | None = None        # diagnostics only (pseudo-label Dice), never trained on
    prepared: Any = None                          # for going back to each scan's own grid (NIfTI)
    source: dict = field(default_factory=dict)

    @property
    def classes(self) -> int:
        return 4


def _ids(value) -> list:
    return list(value or [])


def load_world(prepared, split, *, with_query_labels: bool = True) -> PublicWorld:
    """Build the public world from ``sim.data`` objects (``PreparedDataset`` + ``Split``)."""
    query = _ids(split.public_query)
    reference = _ids(split.public_reference)
    validation = _ids(getattr(split, "public_validation", None))
    test = _ids(split.test)
    if not query:
        from sim.errors import UserError

        raise UserError("split: the public query set is empty (PATE needs query scans)")
    if not reference:  # the paper's choice: the labels of the student partition (SPEC section 1)
        reference = list(query)
    return PublicWorld(
        grid=tuple(int(g) for g in prepared.grid),
        query_ids=query, query_images=np.asarray(prepared.images(query), np.float32),
        reference_ids=reference, reference_images=np.asarray(prepared.images(reference), np.float32),
        reference_labels=np.asarray(prepared.labels(reference)).astype(np.int64),
        test_ids=test, test_images=np.asarray(prepared.images(test), np.float32),
        test_labels=np.asarray(prepared.labels(test)).astype(np.int64),
        validation_images=np.asarray(prepared.images(validation), np.float32) if validation else None,
        validation_labels=np.asarray(prepared.labels(validation)).astype(np.int64) if validation else None,
        query_labels=np.asarray(prepared.labels(query)).astype(np.int64) if with_query_labels else None,
        prepared=prepared, source=dict(getattr(prepared, "source", {}) or {}),
    )


def public_validation_dice(model, world: PublicWorld) -> float | None:
    """Mean Dice of ``model`` on the public validation set (public labels: free to use for choosing a
    model or a setting; the test set never is). None when the world has no validation set."""
    if world.validation_images is None or not len(world.validation_images):
        return None
    from sim.training import evaluate_segmentation

    return evaluate_segmentation(model, world.validation_images, world.validation_labels).get("mean")
