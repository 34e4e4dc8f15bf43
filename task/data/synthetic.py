"""A synthetic spherical-tumour dataset with the interface of :class:`task.data.preprocess.PreparedDataset`
that the protocols use (``case_ids``, ``grid``, ``source``, ``images(ids)``, ``labels(ids)``): concentric
oedema / enhancing / core spheres with contrast on every channel, in milliseconds and without the phantom
generator. For protocol tests and ``benchmarks/bench_pate.py --synthetic``.
"""

from __future__ import annotations

import numpy as np

SYNTHETIC_GRID = (16, 16, 16)


class SyntheticPrepared:
    """``n`` cases on :data:`SYNTHETIC_GRID`, reproducible from ``seed``."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        axes = np.stack(np.meshgrid(*[np.arange(g) for g in SYNTHETIC_GRID], indexing="ij"), axis=-1)
        self.grid, self.source = SYNTHETIC_GRID, {"synthetic": True}
        self.case_ids = [f"case{i:03d}" for i in range(n)]
        self._labels, self._images = {}, {}
        for case in self.case_ids:
            centre, radius = rng.uniform(5, 11, size=3), rng.uniform(2.5, 4.5)
            distance = np.linalg.norm(axes - centre, axis=-1)
            label = np.zeros(SYNTHETIC_GRID, np.int64)
            label[distance < radius] = 1
            label[distance < 0.7 * radius] = 3
            label[distance < 0.4 * radius] = 2
            image = rng.normal(0, 0.3, size=(4, *SYNTHETIC_GRID)).astype(np.float32)
            for c in range(4):
                image[c] += (label == (c % 3) + 1) * 1.5 + (label > 0) * 0.5
            self._labels[case], self._images[case] = label, image

    def images(self, ids):
        return np.stack([self._images[i] for i in ids])

    def labels(self, ids):
        return np.stack([self._labels[i] for i in ids])
