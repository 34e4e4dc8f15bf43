"""Crop to the brain, normalise per channel inside the brain, resample to the working grid -- and back.

The paper works on 64^3 volumes; smaller grids (16^3, 32^3) keep CPU runs short. The same
steps must be applied to training data and to any scan given to ``fedpate predict``, and
a prediction on the grid must map back onto the scan's own voxels (same shape and affine, so ITK-SNAP
overlays it). :class:`PreprocessRecord` holds exactly what that inversion needs.

Geometry: the crop box ``[lo, hi)`` (voxel indices) is resampled to ``grid`` with
``torch.nn.functional.interpolate(..., align_corners=False)`` (trilinear for images, ``nearest-exact`` for
labels), i.e. grid voxel ``j`` sits at crop coordinate ``(j + 0.5) * crop / grid - 0.5``. The inverse uses the
same convention in the other direction, so a round trip is geometrically consistent.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage
from tqdm import tqdm

from task.data.errors import DataError
from task.data.layouts import PHANTOMS_SOURCE, LayoutName
from task.data.msd import load_case, patient_id
from task.data.reader import dataset_fingerprint, read_dataset, require_labels
from task.data.phantoms import _file_lock
from task.io import atomic_write_json, atomic_write_with

PREPARED_FORMAT = 1


@dataclass(frozen=True)
class PreprocessConfig:
    """Working grid (voxels), the margin kept around the brain's box, and anti-aliasing before downsampling.

    ``antialias``: smooth each channel inside the brain (normalised convolution, Gaussian sigma = (f - 1) / 2
    voxels for a downsampling factor f, as ``skimage.transform.rescale``) before the trilinear resize. Without
    it, a 1 mm scan squeezed onto a 32^3 grid keeps its voxel noise un-averaged (trilinear reads 8 voxels of
    ~125), so it looks noisier than the 3 mm phantoms a model was trained on. Artefacts written before this
    option existed load with ``antialias=False`` (:meth:`from_dict`), so they are repeated exactly.
    """

    grid: tuple[int, int, int]
    margin_voxels: int = 2
    antialias: bool = True

    def __post_init__(self):
        grid = tuple(int(g) for g in (self.grid if np.ndim(self.grid) else (self.grid,) * 3))
        if len(grid) != 3 or min(grid) < 2:
            raise DataError(f"--grid={self.grid}: expected three sizes >= 2 (e.g. 32 or 32,32,32)")
        if int(self.margin_voxels) < 0:
            raise DataError(f"margin_voxels={self.margin_voxels}: expected >= 0")
        object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "margin_voxels", int(self.margin_voxels))
        object.__setattr__(self, "antialias", bool(self.antialias))

    def to_dict(self) -> dict:
        return {"grid": list(self.grid), "margin_voxels": self.margin_voxels, "antialias": self.antialias}

    @classmethod
    def from_dict(cls, d: dict) -> "PreprocessConfig":
        return cls(grid=tuple(d["grid"]), margin_voxels=int(d.get("margin_voxels", 2)),
                   antialias=bool(d.get("antialias", False)))


@dataclass(frozen=True)
class PreprocessRecord:
    """What was done to one scan: enough to map a grid prediction back onto the scan's voxels."""

    original_shape: tuple[int, int, int]
    affine: tuple                     # 4x4 voxel-to-world matrix of the original scan (nested tuples)
    bbox_lo: tuple[int, int, int]     # crop box [lo, hi) in original voxel indices
    bbox_hi: tuple[int, int, int]
    grid: tuple[int, int, int]
    channel_mean: tuple = ()          # per-channel mean / std inside the brain (z-score normalisation)
    channel_std: tuple = ()

    @property
    def crop_shape(self) -> tuple[int, int, int]:
        return tuple(h - l for l, h in zip(self.bbox_lo, self.bbox_hi))

    @property
    def zoom(self) -> tuple[float, float, float]:
        """Grid voxels per original voxel along each axis."""
        return tuple(g / c for g, c in zip(self.grid, self.crop_shape))

    @property
    def affine_array(self) -> np.ndarray:
        return np.asarray(self.affine, dtype=np.float64)

    def grid_affine(self) -> np.ndarray:
        """Voxel-to-world matrix of the working grid (for writing grid-sized NIfTI files)."""
        scale = np.diag([c / g for c, g in zip(self.crop_shape, self.grid)] + [1.0])
        # grid voxel j -> crop coordinate (j + 0.5) * c / g - 0.5 -> original lo + that
        offset = np.eye(4)
        offset[:3, 3] = [l + 0.5 * c / g - 0.5 for l, c, g in zip(self.bbox_lo, self.crop_shape, self.grid)]
        return self.affine_array @ offset @ scale

    def to_dict(self) -> dict:
        d = asdict(self)
        d["affine"] = [list(map(float, row)) for row in self.affine]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PreprocessRecord":
        return cls(original_shape=tuple(d["original_shape"]), affine=tuple(tuple(r) for r in d["affine"]),
                   bbox_lo=tuple(d["bbox_lo"]), bbox_hi=tuple(d["bbox_hi"]), grid=tuple(d["grid"]),
                   channel_mean=tuple(d.get("channel_mean", ())), channel_std=tuple(d.get("channel_std", ())))


def _resize(volume: np.ndarray, size: Sequence[int], mode: str) -> np.ndarray:
    """(C, *shape) -> (C, *size) with torch interpolate (align_corners=False conventions)."""

    tensor = torch.from_numpy(np.ascontiguousarray(volume, dtype=np.float32))[None]
    if tuple(tensor.shape[2:]) == tuple(size):
        return tensor[0].numpy().copy()
    if mode == "nearest":
        out = F.interpolate(tensor, size=tuple(int(s) for s in size), mode="nearest-exact")
    else:
        out = F.interpolate(tensor, size=tuple(int(s) for s in size), mode="trilinear", align_corners=False)
    return out[0].numpy()


def _smooth_inside(volume: np.ndarray, mask: np.ndarray, sigmas: Sequence[float]) -> np.ndarray:
    """Gaussian-smooth each channel of (C, *shape) inside ``mask`` only (normalised convolution).

    Dividing by the smoothed mask keeps edge voxels unbiased by the zero background; outside stays 0.
    Axes with sigma <= 0.3 (no real downsampling) are left alone.
    """

    sigmas = [s if s > 0.3 else 0.0 for s in sigmas]
    if not any(sigmas):
        return volume
    weight = ndimage.gaussian_filter(mask.astype(np.float32), sigmas, truncate=3.0)
    out = np.zeros_like(volume)
    for c in range(volume.shape[0]):
        smoothed = ndimage.gaussian_filter(volume[c] * mask, sigmas, truncate=3.0)
        out[c] = np.where(mask, smoothed / np.maximum(weight, 1e-6), 0.0)
    return out


def brain_mask(image: np.ndarray) -> np.ndarray:
    """The brain of a skull-stripped scan (X, Y, Z, C): voxels non-zero in any channel (MSD/BraTS convention)."""
    return np.any(image != 0, axis=-1)


def brain_bbox(image: np.ndarray, margin: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bounding box [lo, hi) of :func:`brain_mask` of ``image`` (X, Y, Z, C), plus ``margin``."""
    brain = brain_mask(image)
    if not brain.any():
        raise DataError("image: empty brain (every voxel is zero); expected a skull-stripped scan")
    lo, hi = [], []
    for axis in range(3):
        other = tuple(a for a in range(3) if a != axis)
        present = np.flatnonzero(brain.any(axis=other))
        lo.append(max(int(present[0]) - margin, 0))
        hi.append(min(int(present[-1]) + 1 + margin, brain.shape[axis]))
    return tuple(lo), tuple(hi)


def channel_centre_and_scale(values: np.ndarray) -> tuple[float, float]:
    """The centre and scale that z-score one channel, from its voxels inside the brain: the mean and the
    standard deviation; a constant channel (scale under 1e-6) is only centred. :func:`preprocess_case` calls it
    once per channel and records both, so a prediction can be mapped back and a probe can swap the statistic."""
    mean, std = float(values.mean()), float(values.std())
    return mean, (std if std > 1e-6 else 1.0)


def preprocess_case(image: np.ndarray, label: np.ndarray | None, affine: np.ndarray,
                    config: PreprocessConfig) -> tuple[np.ndarray, np.ndarray | None, PreprocessRecord]:
    """Crop to the brain, z-score each channel inside the brain (background stays 0), resample to the grid.

    ``image`` is (X, Y, Z, 4) as read by :func:`task.data.msd.load_case`. Returns the image (4, *grid) float32,
    the label (*grid) uint8 (nearest neighbour) or None, and the record to invert the mapping.
    """
    image = np.asarray(image, dtype=np.float32)
    if image.ndim != 4:
        raise DataError(f"image: expected (x, y, z, channels), got shape {image.shape}")
    lo, hi = brain_bbox(image, config.margin_voxels)
    box = tuple(slice(l, h) for l, h in zip(lo, hi))
    crop = np.moveaxis(image[box], -1, 0).copy()                        # (C, cx, cy, cz)
    brain = brain_mask(image[box])
    means, stds = [], []
    for c in range(crop.shape[0]):
        mean, std = channel_centre_and_scale(crop[c][brain])
        crop[c] = np.where(brain, (crop[c] - mean) / std, 0.0)
        means.append(mean), stds.append(std)
    if config.antialias:
        crop = _smooth_inside(crop, brain, [(c / g - 1.0) / 2.0 for c, g in zip(crop.shape[1:], config.grid)])
    grid_image = _resize(crop, config.grid, "linear").astype(np.float32)
    grid_label = None
    if label is not None:
        grid_label = _resize(np.asarray(label)[box][None].astype(np.float32), config.grid, "nearest")[0]
        grid_label = np.rint(grid_label).astype(np.uint8)
    record = PreprocessRecord(
        original_shape=tuple(int(s) for s in image.shape[:3]),
        affine=tuple(tuple(float(v) for v in row) for row in np.asarray(affine, dtype=np.float64)),
        bbox_lo=tuple(lo), bbox_hi=tuple(hi), grid=tuple(config.grid),
        channel_mean=tuple(means), channel_std=tuple(stds))
    return grid_image, grid_label, record


def _check_grid(array: np.ndarray, record: PreprocessRecord, what: str) -> None:
    if tuple(array.shape[-3:]) != tuple(record.grid):
        raise DataError(f"{what}: expected the working grid {tuple(record.grid)}, got shape {tuple(array.shape)}")


def invert_label(label_grid: np.ndarray, record: PreprocessRecord) -> np.ndarray:
    """Label map on the grid -> uint8 label map in the original scan's voxels (nearest neighbour)."""
    label_grid = np.asarray(label_grid)
    _check_grid(label_grid, record, "label")
    crop = _resize(label_grid[None].astype(np.float32), record.crop_shape, "nearest")[0]
    out = np.zeros(record.original_shape, np.uint8)
    out[tuple(slice(l, h) for l, h in zip(record.bbox_lo, record.bbox_hi))] = np.rint(crop).astype(np.uint8)
    return out


def invert_probs(probs: np.ndarray, record: PreprocessRecord) -> np.ndarray:
    """Class probabilities (C, *grid) -> (C, X, Y, Z) float32 in the original voxels (trilinear).

    Outside the crop box the scan is background: probability 1 for class 0 and 0 for the others.
    """
    crop = probs_in_crop(probs, record)
    out = np.zeros((crop.shape[0], *record.original_shape), np.float32)
    out[0] = 1.0
    out[(slice(None), *crop_box(record))] = crop
    return out


def crop_box(record: PreprocessRecord) -> tuple[slice, slice, slice]:
    """The crop box [lo, hi) of ``record`` as slices of the original scan's voxels."""
    return tuple(slice(l, h) for l, h in zip(record.bbox_lo, record.bbox_hi))


def probs_in_crop(probs: np.ndarray, record: PreprocessRecord) -> np.ndarray:
    """Class probabilities (C, *grid) -> (C, *crop shape) float32 over the crop box (trilinear): what
    :func:`invert_probs` places in the original voxels, without the background around it. Why apart: a label
    map only needs the argmax inside the box (outside it every voxel is background), and on a 240 x 240 x 155
    scan the full probability volume is 140 MB to fill and search."""
    probs = np.asarray(probs, dtype=np.float32)
    if probs.ndim != 4:
        raise DataError(f"probs: expected (classes, *grid), got shape {tuple(probs.shape)}")
    _check_grid(probs, record, "probs")
    return _resize(probs, record.crop_shape, "linear")


# ------------------------------------------------------------------------------------------ prepared cache
def _atomic_save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write_with(path, lambda handle: np.save(handle, array), private=True)   # patient volumes: owner-only


def describe_source(dataset) -> dict:
    """Source description recorded in manifests and model cards (phantoms: seed + version; MSD or a BraTS
    layout: its name)."""
    block = dataset.extra.get("phantoms")
    if isinstance(block, dict):
        return {"kind": PHANTOMS_SOURCE, "seed": block.get("seed"), "generator_version": block.get("generator_version")}
    return {"kind": getattr(dataset, "layout", LayoutName.MSD), "name": dataset.root.resolve().name}


class PreparedDataset:
    """Preprocessed training cases on the working grid, memory-mapped from a cache folder.

    Files: ``images.npy`` (n, 4, *grid) float32, ``labels.npy`` (n, *grid) uint8, ``records.json``
    (one :class:`PreprocessRecord` per case), ``manifest.json`` (written last; its ``"patients"`` maps each
    case to its patient, :func:`task.data.msd.patient_id`, so splits can keep a patient's scans together).
    """

    def __init__(self, path: Path, manifest: dict, images: np.ndarray, labels: np.ndarray,
                 records: dict[str, PreprocessRecord]):
        self.path = Path(path)
        self.manifest = manifest
        self._images = images
        self._labels = labels
        self.case_ids: list[str] = list(manifest["case_ids"])
        self._index = {cid: i for i, cid in enumerate(self.case_ids)}
        self._institutions: dict[str, str | None] = dict(manifest.get("institutions") or {})
        self._patients: dict[str, str] = dict(manifest.get("patients") or {})
        self._sources: dict[str, str] = dict(manifest.get("sources") or {})
        self.records = records

    @classmethod
    def open(cls, path: str | os.PathLike) -> "PreparedDataset":
        path = Path(path)
        manifest_path = path / "manifest.json"
        if not manifest_path.is_file():
            raise DataError(f"{manifest_path}: missing; expected a prepared dataset (run `fedpate data prepare`)")
        try:
            manifest = json.loads(manifest_path.read_text())
            images = np.load(path / "images.npy", mmap_mode="r")
            labels = np.load(path / "labels.npy", mmap_mode="r")
            records = {cid: PreprocessRecord.from_dict(r)
                       for cid, r in json.loads((path / "records.json").read_text()).items()}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: unreadable prepared dataset ({' '.join(str(exc).split())[:120]}); "
                            "expected images.npy, labels.npy, records.json, manifest.json") from None
        n = len(manifest.get("case_ids", []))
        if images.shape[0] != n or labels.shape[0] != n:
            raise DataError(f"{path}: prepared arrays hold {images.shape[0]} cases but manifest.json lists {n}")
        return cls(path, manifest, images, labels, records)

    # --- metadata
    def __len__(self) -> int:
        return len(self.case_ids)

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(self.manifest["config"]["grid"])

    @property
    def config(self) -> PreprocessConfig:
        return PreprocessConfig.from_dict(self.manifest["config"])

    @property
    def source(self) -> dict:
        return dict(self.manifest["source"])

    def institution(self, case_id: str) -> str | None:
        self._position(case_id)
        return self._institutions.get(case_id)

    @property
    def institutions(self) -> list[str]:
        return sorted({v for v in self._institutions.values() if v is not None})

    def patient(self, case_id: str) -> str:
        """The patient of ``case_id``; manifests written before patients were recorded fall back to the
        naming rule on the case id (:func:`task.data.msd.patient_id`: the case id itself for MSD/phantom names)."""

        self._position(case_id)
        return self._patients.get(case_id) or patient_id(case_id)

    def record(self, case_id: str) -> PreprocessRecord:
        self._position(case_id)
        return self.records[case_id]

    def source_of(self, case_id: str) -> str | None:
        """Which collection ``case_id`` comes from in a dataset made by :func:`combine_prepared` (None otherwise)."""
        self._position(case_id)
        return self._sources.get(case_id)

    def cases_from(self, source: str) -> list[str]:
        """The case ids of one collection of a combined dataset, in dataset order."""
        return [c for c in self.case_ids if self._sources.get(c) == source]

    # --- arrays
    def _position(self, case_id: str) -> int:
        try:
            return self._index[case_id]
        except KeyError:
            raise DataError(f"{self.path}: no case {case_id!r} in the prepared dataset") from None

    def _rows(self, ids: Iterable[str] | None) -> list[int]:
        return list(range(len(self.case_ids))) if ids is None else [self._position(c) for c in ids]

    def images(self, ids: Iterable[str] | None = None) -> np.ndarray:
        """Stacked images (n, 4, *grid) float32 of ``ids`` (all cases when None), in the given order."""
        rows = self._rows(ids)
        if not rows:
            return np.zeros((0, 4, *self.grid), np.float32)
        return np.asarray(self._images[rows], dtype=np.float32)

    def labels(self, ids: Iterable[str] | None = None) -> np.ndarray:
        """Stacked labels (n, *grid) int64 of ``ids`` (all cases when None), in the given order."""
        rows = self._rows(ids)
        if not rows:
            return np.zeros((0, *self.grid), np.int64)
        return np.asarray(self._labels[rows], dtype=np.int64)

    def __repr__(self) -> str:
        return f"PreparedDataset({str(self.path)!r}, cases={len(self)}, grid={self.grid}, source={self.source})"


def prepare_dataset(msd_root: str | os.PathLike, cache_dir: str | os.PathLike, config: PreprocessConfig,
                    progress: bool = True, layout: str | None = None) -> PreparedDataset:
    """Preprocess every training case of a data folder into ``cache_dir`` (reused when config and source match).

    The folder is MSD Task01 or BraTS (``layout``; None = detected, :func:`task.data.reader.read_dataset`).
    The cache is valid when ``manifest.json`` records the same config and the same source fingerprint
    (``dataset.json`` for MSD, the files for BraTS; the layout is not part of the key beyond that: the same
    scans in two layouts give the same arrays). Files are written atomically, the manifest last; a lock
    serialises concurrent callers.
    """

    if not isinstance(config, PreprocessConfig):
        config = PreprocessConfig.from_dict(config) if isinstance(config, dict) else PreprocessConfig(grid=config)
    root = Path(msd_root)
    cache = Path(cache_dir)
    dataset = require_labels(read_dataset(root, layout), "train (prepare the dataset)")
    fingerprint = dataset_fingerprint(dataset)
    wanted = {"format": PREPARED_FORMAT, "config": config.to_dict(), "source_fingerprint": fingerprint}

    def valid() -> PreparedDataset | None:
        manifest_path = cache / "manifest.json"
        if not manifest_path.is_file():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if any(manifest.get(k) != v for k, v in wanted.items()):
            return None
        if "patients" not in manifest:
            # prepared before patients were recorded: add them (the arrays do not depend on them), so that ids
            # dataset.json declares count here too and not only in caches prepared from now on

            atomic_write_json(manifest_path, {**manifest, "patients": {c.case_id: c.patient for c in dataset.training}})
        return PreparedDataset.open(cache)

    def write() -> None:   # under the cache's lock, once valid() has failed twice
        cases = dataset.training
        images = np.zeros((len(cases), 4, *config.grid), np.float32)
        labels = np.zeros((len(cases), *config.grid), np.uint8)
        records: dict[str, Any] = {}
        for i, case in enumerate(tqdm(cases, desc=f"prepare {root.name} -> {'x'.join(map(str, config.grid))}",
                                      unit="case", disable=not progress, leave=False)):
            image, label, affine = load_case(case)
            images[i], labels[i], record = preprocess_case(image, label, affine, config)
            records[case.case_id] = record.to_dict()
        try:
            (cache / "manifest.json").unlink()                 # invalidate before overwriting the arrays
        except FileNotFoundError:
            pass
        _atomic_save_npy(cache / "images.npy", images)
        _atomic_save_npy(cache / "labels.npy", labels)

        atomic_write_json(cache / "records.json", records)
        manifest = {
            **wanted,
            "source": describe_source(dataset),
            "source_root": str(root.resolve()),
            "layout": dataset.layout,
            "case_ids": [c.case_id for c in cases],
            "institutions": {c.case_id: c.institution for c in cases},
            "patients": {c.case_id: c.patient for c in cases},
            "shapes": {"images": list(images.shape), "labels": list(labels.shape)},
        }
        atomic_write_json(cache / "manifest.json", manifest)

    return _prepared_once(cache, valid, write)


def combine_prepared(parts: Sequence[tuple[str, str, PreparedDataset]],
                     cache_dir: str | os.PathLike) -> PreparedDataset:
    """One dataset of several prepared collections (``parts``: (source name, case-id prefix, dataset)).

    Why: the simulated world draws its public labelled data from another centre than the hospitals' population,
    yet every party reads one dataset by case id. Both phantom folders name their cases
    ``BRATS_001...``, so each part's case ids, patients and institutions are qualified by its prefix (one part
    may keep an empty prefix); colliding ids are refused. ``manifest.json`` records each case's source
    (:meth:`PreparedDataset.source_of`) and every part's own source description. Reused when the parts'
    manifests are unchanged; a lock serialises concurrent callers.
    """
    cache = Path(cache_dir)
    if not parts:
        raise DataError("combine_prepared: expected at least one prepared dataset")
    configs = {json.dumps(d.manifest["config"], sort_keys=True) for _, _, d in parts}
    if len(configs) != 1:
        raise DataError("combine_prepared: the datasets were prepared with different settings; expected one grid")
    digest = hashlib.sha256(json.dumps([[name, prefix, d.manifest.get("source_fingerprint"),
                                         d.manifest.get("case_ids")] for name, prefix, d in parts],
                                       sort_keys=True).encode()).hexdigest()[:16]
    config = dict(parts[0][2].manifest["config"])
    wanted = {"format": PREPARED_FORMAT, "config": config, "source_fingerprint": digest, "combined_format": 1}

    def valid() -> PreparedDataset | None:
        try:
            manifest = json.loads((cache / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return PreparedDataset.open(cache) if all(manifest.get(k) == v for k, v in wanted.items()) else None

    def write() -> None:   # under the cache's lock, once valid() has failed twice
        case_ids, institutions, patients, sources, records, described, roots = [], {}, {}, {}, {}, [], {}
        for name, prefix, dataset in parts:
            for cid in dataset.case_ids:
                qualified = prefix + cid
                if qualified in sources:
                    raise DataError(f"combine_prepared: case {qualified!r} is in {sources[qualified]} and {name}; "
                                    "expected a distinct id prefix per collection")
                case_ids.append(qualified)
                sources[qualified] = name
                institution = dataset.institution(cid)
                institutions[qualified] = prefix + institution if institution is not None else None
                patients[qualified] = prefix + dataset.patient(cid)
                records[qualified] = dataset.record(cid).to_dict()
            described.append({"name": name, "prefix": prefix, "cases": len(dataset), **dataset.source})
            roots[name] = dataset.manifest.get("source_root")
        try:
            (cache / "manifest.json").unlink()                 # invalidate before overwriting the arrays
        except FileNotFoundError:
            pass
        images = np.concatenate([np.asarray(d.images(), np.float32) for _, _, d in parts])
        labels = np.concatenate([np.asarray(d._labels, np.uint8) for _, _, d in parts])
        _atomic_save_npy(cache / "images.npy", images)
        _atomic_save_npy(cache / "labels.npy", labels)
        atomic_write_json(cache / "records.json", records)
        # "source" (model cards): the first part's description -- the population a model is for -- plus every
        # part's; local folders only in "part_roots" (a card names no path of this machine)
        atomic_write_json(cache / "manifest.json", {
            **wanted, "source": {**parts[0][2].source, "parts": described},
            "source_root": parts[0][2].manifest.get("source_root"), "part_roots": roots, "case_ids": case_ids,
            "institutions": institutions, "patients": patients, "sources": sources,
            "shapes": {"images": list(images.shape), "labels": list(labels.shape)},
        })

    return _prepared_once(cache, valid, write)


def _prepared_once(cache: Path, valid, write) -> "PreparedDataset":
    """The prepared cache at ``cache``: ``valid()`` when it holds; else ``write()`` under the cache's file lock,
    checking ``valid()`` again inside it (another process may have written it meanwhile), then open it."""
    cached = valid()
    if cached is not None:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / ".prepare.lock"):
        cached = valid()
        if cached is not None:
            return cached
        write()
    return PreparedDataset.open(cache)
