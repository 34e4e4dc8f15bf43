"""The simulated world, built in one place: which data, prepared at which grid, split how, and what each
party sees of it (SPEC sections 1, 8).

* :func:`build_world` -- the preset's phantoms (generated once and cached; one fixed world, generator seed
  :data:`PHANTOM_SEED`) or an MSD folder, prepared at the preset's grid, split by ``seed`` into hospitals'
  teacher partitions and the public sets: ``(PreparedDataset, Split)``.
* :func:`materialise_world` / :func:`open_world` -- that world on disk (``world.json`` + ``split.json``),
  the folder every party of a simulation reads (the server for the public sets, each simulated hospital
  for its own partitions). The prepared cases stay in the shared preparation cache; ``world.json`` says
  where. In a deployment there is no shared world: each hospital prepares its own folder
  (clients/node.py) and the server's world holds only public data.
* :class:`PublicWorld` / :func:`load_world` -- what the PATE server holds:

  - query scans (the student's inputs, unlabelled for training; their labels are kept only for the
    pseudo-label diagnostic, which a real deployment may not have -- then ``query_labels`` is None);
  - public reference label maps (and their images): fit the PCA basis / train the autoencoder, and
    pre-train the public model (the ``public-only`` baseline and the teachers' initialisation);
  - public validation and test sets (test labels are public here: they score every method).

  Nothing in a PublicWorld comes from a hospital's partition.
* :func:`pooled_private_data` -- every hospital's partitions pooled, for the centralised baselines (the
  upper bound no federation can beat, and the seed paper's DP-SGD baseline), with the same test set.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sim.data.partitions import Split, make_split
from sim.data.phantoms import ensure_phantoms
from sim.data.preprocess import PreparedDataset, PreprocessConfig, prepare_dataset
from sim.errors import UserError
from sim.io import atomic_write_json, cache_root

#: The simulated dataset is one fixed world whatever a run's seed, which drives the split and training:
#: runs with different seeds are comparable on the same patients.
PHANTOM_SEED = 0


def build_world(preset, data=None, seed: int = 0, progress: bool = True, hospitals=None,
                teachers_per_hospital=None) -> tuple[PreparedDataset, Split]:
    """(prepared dataset, split) for a preset: phantoms generated once and cached when ``data`` is None."""
    root = Path(data) if data is not None else ensure_phantoms(preset, cache_root() / "phantoms",
                                                               seed=PHANTOM_SEED, progress=progress)
    cache = cache_root() / "prepared" / f"{root.name}-{'x'.join(map(str, preset.grid))}"
    prepared = prepare_dataset(root, cache, PreprocessConfig(grid=tuple(preset.grid)), progress=progress)
    split = make_split(prepared, hospitals or preset.hospitals, teachers_per_hospital or preset.teachers_per_hospital,
                       preset.split_scheme, preset.n_query, preset.n_reference, preset.n_validation, preset.n_test,
                       seed)
    return prepared, split


def materialise_world(preset, data: str | Path | None, seed: int, progress: bool = True,
                      root: str | Path | None = None) -> Path:
    """Prepare the data and the split for ``preset`` (hospitals x teachers already applied); return the folder."""
    prepared, split = build_world(preset, data, seed, progress)
    key = json.dumps({"prepared": str(prepared.path), "hospitals": preset.hospitals,
                      "teachers": preset.teachers_per_hospital, "scheme": preset.split_scheme, "seed": seed,
                      "sizes": [preset.n_query, preset.n_reference, preset.n_validation, preset.n_test]},
                     sort_keys=True)
    folder = Path(root) if root else cache_root() / "worlds" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    split.to_json(folder / "split.json")
    atomic_write_json(folder / "world.json", {
        "prepared": str(prepared.path), "data": str(data) if data else None, "grid": list(preset.grid),
        "preset": preset.name, "seed": seed, "hospitals": sorted(split.hospitals),
    })
    return folder


def open_world(folder: str | Path) -> tuple[PreparedDataset, Split]:
    """(prepared dataset, split) of a world folder written by :func:`materialise_world`."""
    folder = Path(folder)
    meta = json.loads((folder / "world.json").read_text())
    return PreparedDataset.open(meta["prepared"]), Split.from_json(folder / "split.json")


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


def pooled_private_data(prepared, split, root: Path | None = None) -> dict[str, Any]:
    """Every hospital's teacher partitions pooled (the centralised baselines' training data), the test
    set and the public validation set, as arrays."""
    train_ids = [case for partitions in split.hospitals.values() for part in partitions for case in part]
    test_ids = list(split.test)
    if not train_ids:
        raise UserError("central: the split has no private (hospital) cases to train on")
    if not test_ids:
        raise UserError("central: the split has no test cases")
    validation_ids = list(getattr(split, "public_validation", None) or [])
    pooled = {
        "prepared": prepared, "split": split, "config": prepared.config, "train_ids": train_ids,
        "test_ids": test_ids,
        "train_images": np.asarray(prepared.images(train_ids), np.float32),
        "train_labels": np.asarray(prepared.labels(train_ids), np.int64),
        "test_images": np.asarray(prepared.images(test_ids), np.float32),
        "test_labels": np.asarray(prepared.labels(test_ids), np.int64),
        "validation": None, "hospitals": len(split.hospitals), "hospital_ids": sorted(split.hospitals),
        "source": dict(getattr(prepared, "source", {}) or {"root": str(root)}),
    }
    if validation_ids:
        pooled["validation"] = (np.asarray(prepared.images(validation_ids), np.float32),
                                np.asarray(prepared.labels(validation_ids), np.int64))
    return pooled
