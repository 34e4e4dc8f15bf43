"""Shared test configuration.

Tests run on 2 CPU cores next to other work: keep torch on one thread so test timings are stable and
parallel helpers do not oversubscribe the machine.
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the privacy tests do not need torch
    pass


# ------------------------------------------------------------------ shared data fixtures (task/data)
import pytest


@pytest.fixture(scope="session")
def tiny_phantoms(tmp_path_factory):
    """A phantom MSD folder for the ``tiny`` preset (48 cases, 2 institutions, 4 mm), generated once."""
    from task.data.phantoms import ensure_phantoms

    return ensure_phantoms("tiny", cache_root=tmp_path_factory.mktemp("phantom-cache"), seed=0, progress=False)


@pytest.fixture(scope="session")
def tiny_prepared(tiny_phantoms, tmp_path_factory):
    """The tiny phantoms preprocessed to the tiny grid (16^3): a ``PreparedDataset``."""
    from task.data.preprocess import PreprocessConfig, prepare_dataset
    from task.presets import get_preset

    grid = get_preset("tiny").grid
    return prepare_dataset(tiny_phantoms, tmp_path_factory.mktemp("prepared-tiny"), PreprocessConfig(grid=grid),
                           progress=False)


@pytest.fixture(scope="session")
def tiny_split(tiny_prepared):
    """The tiny preset's split (institution scheme, 2 hospitals x 4 teachers) of ``tiny_prepared``, seed 0."""
    from task.data.partitions import split_for_preset
    from task.presets import get_preset

    return split_for_preset(tiny_prepared, get_preset("tiny"), seed=0)
