"""A tiny pooled world for the central runner's tests, standing in for ``load_central_data`` (no phantoms)."""

from dataclasses import dataclass

import numpy as np


@dataclass
class _Config:
    grid: tuple
    margin_voxels: int = 2


def pooled_world(preset, seed: int = 0, *, n_train: int, n_test: int, n_validation: int = 0) -> dict:
    """Random 4-channel volumes on the preset's grid, labels thresholded from two channels; hospitals h0/h1.
    ``n_validation`` > 0 adds a public validation set (public labels)."""
    rng = np.random.default_rng(seed)
    n = n_train + n_test + n_validation
    x = rng.normal(size=(n, 4, *preset.grid)).astype(np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64) + (x[:, 1] > 1.2).astype(np.int64)
    ids = [chr(ord("a") + i) for i in range(n_train + n_test)]
    test = slice(n_train, n_train + n_test)
    return {"config": _Config(tuple(preset.grid)), "train_ids": ids[:n_train], "test_ids": ids[n_train:],
            "train_images": x[:n_train], "train_labels": y[:n_train], "test_images": x[test], "test_labels": y[test],
            "validation": (x[n_train + n_test:], y[n_train + n_test:]) if n_validation else None,
            "hospitals": 2, "hospital_ids": ["h0", "h1"], "source": {"kind": "synthetic-test"}}
