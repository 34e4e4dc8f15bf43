"""Shared test configuration.

Tests run on 2 CPU cores next to other work: keep torch on one thread so test timings are stable and
parallel helpers do not oversubscribe the machine.
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# the calibrations the tests make are never memoised in the user's cache (task.learning.accounting; and see
# own_accounting_memo below: each test has its own memo)
if "FEDPATE_ACCOUNTING_CACHE" not in os.environ:
    import tempfile

    os.environ["FEDPATE_ACCOUNTING_CACHE"] = tempfile.mkdtemp(prefix="fedpate-test-accounting-")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the privacy tests do not need torch
    pass


# ------------------------------------------------------------------ shared data fixtures (task/data)
import pytest


@pytest.fixture(autouse=True)
def own_accounting_memo(monkeypatch, tmp_path_factory):
    """Every test memoises its calibrations in a folder of its own (task.learning.accounting): a test that replaces a
    calibration by a stand-in never hands its value to another test."""
    monkeypatch.setenv("FEDPATE_ACCOUNTING_CACHE", str(tmp_path_factory.mktemp("accounting-memo")))


@pytest.fixture(autouse=True)
def commit_pin_of_its_own(monkeypatch):
    """A command run in-process pins the commit it starts from (task.reporting.provenance.pin_run_commit): the
    pin ends with the test that ran it."""
    monkeypatch.setenv("FEDPATE_RUN_COMMIT", "")


@pytest.fixture(scope="session")
def tiny_phantoms(tmp_path_factory):
    """A phantom MSD folder for the ``tiny`` preset (48 cases, 2 institutions, 4 mm), generated once."""
    from task.data.phantoms import ensure_phantoms
    from task.settings.presets import get_preset

    return ensure_phantoms(get_preset("tiny"), cache_root=tmp_path_factory.mktemp("phantom-cache"), seed=0,
                           progress=False)


@pytest.fixture(scope="session")
def tiny_prepared(tiny_phantoms, tmp_path_factory):
    """The tiny phantoms preprocessed to the tiny grid (16^3): a ``PreparedDataset``."""
    from task.data.preprocess import PreprocessConfig, prepare_dataset
    from task.settings.presets import get_preset

    grid = get_preset("tiny").grid
    return prepare_dataset(tiny_phantoms, tmp_path_factory.mktemp("prepared-tiny"), PreprocessConfig(grid=grid),
                           progress=False)


@pytest.fixture(scope="session")
def tiny_split(tiny_prepared):
    """The tiny preset's split (institution scheme, 2 hospitals x 4 teachers) of ``tiny_prepared``, seed 0."""
    from task.data.partitions import split_for_preset
    from task.settings.presets import get_preset

    return split_for_preset(tiny_prepared, get_preset("tiny"), seed=0)

