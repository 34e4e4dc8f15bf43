"""The simulated world, built in one place: which data, prepared at which grid, split how, and what each
party sees of it.

* :func:`build_world` -- the preset's phantoms (generated once and cached; one fixed world, generator seed
  :data:`PHANTOM_SEED`) or an MSD folder, prepared at the preset's grid, split by ``seed`` into hospitals'
  teacher partitions and the public sets: ``(PreparedDataset, Split)``.

  Who holds what (as a consortium looks; docs/decisions/world.md): the hospitals' population -- the patients the model
  is for -- gives every hospital's patients, the public unlabelled query scans (an unlabelled public archive of that
  population) and the held-out test patients, whom nobody sees during training or selection. The public labelled data
  (reference maps and the validation set, which makes every public choice) are scarce and come from *another centre*
  (``preset.world.public_cases > 0``): other generator seed (:data:`PUBLIC_PHANTOM_SEED`), other scanners
  (``public_institutions``) and another lesion regime (``public_shift``, task/data/shifts.py). Its case ids carry the
  prefix :data:`PUBLIC_PREFIX`, so they never collide with the population's (both phantom folders name cases
  ``BRATS_001...``). An MSD folder (``data``) is one population: all sets are then drawn from it
  (:func:`describe_world` says so).
* :func:`describe_world` -- that, as a record for reports: sources, sizes, patients per hospital.
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
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from task.data.brats import PHANTOMS_MARKER
from task.data.layouts import PHANTOMS_SOURCE, LayoutName
from task.data.partitions import PUBLIC_SOURCE, Split, SplitPlan, make_split
from task.data.phantoms import PhantomCollection, ensure_phantoms
from task.data.preprocess import PreparedDataset, PreprocessConfig, combine_prepared, prepare_dataset
from task.errors import UserError
from task.io import atomic_write_json, cache_root
from task.options import AUTO, SplitScheme

#: The simulated dataset is one fixed world whatever a run's seed, which drives the split and training:
#: runs with different seeds are comparable on the same patients.
PHANTOM_SEED = 0
#: The other centre's public labelled collection: its own generator seed (other subjects, other scanner
#: profiles), fixed like :data:`PHANTOM_SEED`.
PUBLIC_PHANTOM_SEED = 1001
#: case-id prefix of the other centre's cases (the population's cases keep their own names)
PUBLIC_PREFIX = "other-"
POPULATION_SOURCE = "hospitals-population"


#: how many processes generate the phantoms (same bytes as one process): a whole number or ``auto`` (one per
#: core). 1 unless set: a spawned worker imports the caller's main module again, and a script without an
#: ``if __name__ == "__main__":`` guard would re-run itself there and wait forever on the phantom cache's
#: lock its parent holds (seen with a scratch script calling ``run_central``). The ``fedpate`` command, whose
#: entry point is guarded, sets ``auto``: the demo's first 100 s were mostly one-core phantom generation.
PHANTOM_WORKERS_ENV = "FEDPATE_PHANTOM_WORKERS"


def phantom_workers() -> int:
    """Processes that generate phantoms (``$FEDPATE_PHANTOM_WORKERS``; always 1 inside a worker process)."""
    text = os.environ.get(PHANTOM_WORKERS_ENV, "1").strip()
    if multiprocessing.parent_process() is not None:
        return 1
    if text == AUTO:
        return os.cpu_count() or 1
    try:
        return max(1, int(text))
    except ValueError:
        raise UserError(f"${PHANTOM_WORKERS_ENV}: expected a whole number or auto, got {text!r}") from None


def _prepared_population(preset, data, progress: bool, layout: str | None = None) -> PreparedDataset:
    """The preset's two-source world (population + other centre) when it has one and no ``data`` is given,
    else the one population (phantoms, or the MSD / BraTS folder in ``layout``, None = detected)."""
    grid = "x".join(map(str, preset.grid))
    config = PreprocessConfig(grid=tuple(preset.grid))
    workers = phantom_workers()
    root = Path(data) if data is not None else ensure_phantoms(preset, cache_root() / "phantoms",
                                                               seed=PHANTOM_SEED, progress=progress, workers=workers)
    prepared = prepare_dataset(root, cache_root() / "prepared" / f"{root.name}-{grid}", config, progress=progress,
                               layout=layout if data is not None else None)
    if data is not None or not preset.world.public_cases:
        return prepared
    other = ensure_phantoms(preset, cache_root() / "phantoms", seed=PUBLIC_PHANTOM_SEED, progress=progress,
                            workers=workers, collection=PhantomCollection(
                                cases=preset.world.public_cases, institutions=preset.world.public_institutions,
                                test_cases=0, shift=preset.world.public_shift))
    other_prepared = prepare_dataset(other, cache_root() / "prepared" / f"{other.name}-{grid}", config,
                                     progress=progress)
    # the folder names carry every generation setting of both sources: a changed world gets a new cache
    return combine_prepared([(POPULATION_SOURCE, "", prepared), (PUBLIC_SOURCE, PUBLIC_PREFIX, other_prepared)],
                            cache_root() / "prepared" / f"world-{root.name}+{other.name}-{grid}")


def build_world(preset, data=None, seed: int = 0, progress: bool = True, hospitals=None,
                teachers_per_hospital=None, layout: str | None = None,
                partition_file: str | None = None) -> tuple[PreparedDataset, Split]:
    """(prepared dataset, split) for a preset: phantoms generated once and cached when ``data`` is None.

    Deterministic: the data depend only on the preset (fixed generator seeds), the split only on ``seed``.

    Args:
        preset: the :class:`task.settings.presets.Preset` (grid, phantoms, split sizes and scheme, public centre).
        data: an MSD Task01 or BraTS folder (None = the preset's phantoms, with its other centre's public
            collection when it has one).
        seed: the split.
        progress: progress bars while generating and preparing.
        hospitals / teachers_per_hospital: override the preset's (None = the preset's).
        layout: the data folder's layout (``task.data.layouts``; None = detected).
        partition_file: a FeTS partition CSV whose partitions are the hospitals (:func:`partition_split`;
            needs ``data``).
    """
    if partition_file and data is None:
        raise UserError("--partition-file: needs --data (the partitions name the subjects of a data folder)")
    prepared = _prepared_population(preset, data, progress, layout)
    hospitals = hospitals or preset.hospitals
    teachers = teachers_per_hospital or preset.teachers_per_hospital
    if partition_file:
        return prepared, partition_split(prepared, preset, partition_file, hospitals, teachers, seed)
    split = make_split(prepared, SplitPlan(hospitals, teachers, preset.world.split_scheme, preset.federation.n_query,
                                           preset.world.n_reference, preset.world.n_validation, preset.world.n_test,
                                           seed, public_pool=prepared.cases_from(PUBLIC_SOURCE) or None))
    return prepared, split


def partition_split(prepared, preset, partition_file, hospitals: int, teachers: int, seed: int) -> Split:
    """The split when a FeTS partition file names the institutions (rule: ``task.data.fets.RULE``).

    Each of the ``hospitals`` largest partitions is one hospital (the ``institution`` scheme with one
    partition per hospital); the test and public sets are drawn first, stratified over those partitions (so
    held out from each hospital proportionally); partitions beyond the largest H and cases the file does not
    list are left out. ``split.params["partition_file"]`` records the rule and the counts for the World
    section.

    Args:
        prepared: the prepared data folder (its case ids and patients).
        preset: the preset (public and test set sizes).
        partition_file: the FeTS partition CSV.
        hospitals: how many of the largest partitions become hospitals.
        teachers: teacher partitions per hospital.
        seed: the split's draws.
    """
    from task.data.fets import assign_partitions

    institutions, info = assign_partitions(partition_file, prepared.case_ids, prepared.patient, hospitals)
    split = make_split(institutions, SplitPlan(hospitals, teachers, SplitScheme.INSTITUTION, preset.federation.n_query,
                                               preset.world.n_reference, preset.world.n_validation,
                                               preset.world.n_test, seed), patients=prepared.patient)
    split.params["partition_file"] = info
    split.params["institutions"] = institutions       # each case's partition: who the World section names
    return split


def _collection(root: str | None, cases: int, fallback: dict) -> dict[str, Any]:
    """What generated a collection: the phantom generator's settings from its dataset.json (or, for phantoms
    written in a BraTS layout, the marker beside their case folders), else its name."""
    block = None
    for name, get in (("dataset.json", lambda d: d.get("phantoms")), (PHANTOMS_MARKER, lambda d: d)):
        try:
            block = get(json.loads((Path(root) / name).read_text())) if root else None
        except (OSError, ValueError, AttributeError):
            continue
        break
    if isinstance(block, dict):
        return {"kind": PHANTOMS_SOURCE, "cases": cases, **{k: block.get(k) for k in (
            "seed", "institutions", "shift", "resolution_mm", "generator_version")}}
    return {**fallback, "cases": cases}


def describe_world(prepared, split) -> dict[str, Any]:
    """Who holds what, how many, from which distribution (the report's World section)."""
    parts = {p.get("name"): p for p in (prepared.source.get("parts") or [])}

    def origin(ids) -> str:
        names = sorted({prepared.source_of(c) or POPULATION_SOURCE for c in ids})
        return ", ".join(names) if names else "—"

    named = (split.params or {}).get("institutions") or {}   # a partition file's, else the dataset's own

    def institutions(ids) -> list[str]:
        return sorted({str(named.get(c) or prepared.institution(c) or "unknown") for c in ids})

    sources = {}
    for name in (POPULATION_SOURCE, PUBLIC_SOURCE):
        part = parts.get(name)
        if part is not None:
            sources[name] = _collection((prepared.manifest.get("part_roots") or {}).get(name),
                                        int(part.get("cases", 0)), part)
    if not sources:
        sources[POPULATION_SOURCE] = _collection(prepared.manifest.get("source_root"), len(prepared),
                                                 dict(prepared.source))
    holdings = {h: {"patients": len(split.patients_of(split.hospital_cases(h))),
                    "scans": len(split.hospital_cases(h)), "teachers": len(split.hospitals[h]),
                    "institutions": institutions(split.hospital_cases(h))}
                for h in sorted(split.hospitals)}
    sets = {}
    for name, ids, role in (
            ("public_reference", split.public_reference, "labelled: public pre-training, PCA / autoencoder fitting"),
            ("public_validation", split.public_validation, "labelled: every public choice (model selection)"),
            ("public_query", split.public_query, "unlabelled: the PATE student's inputs"),
            ("test", split.test, "held out: scores every method; seen by nobody in training or selection")):
        sets[name] = {"patients": len(split.patients_of(ids)), "source": origin(ids),
                      "institutions": institutions(ids), "role": role}
    return {
        "two_sources": PUBLIC_SOURCE in parts, "sources": sources,
        "hospitals": holdings, "sets": sets, "split_seed": split.seed, "scheme": split.scheme,
        "reference_is_query": bool(split.reference_is_query),
        "private_patients": sum(h["patients"] for h in holdings.values()),
        "layout": prepared.manifest.get("layout", LayoutName.MSD),
        "partition_file": (split.params or {}).get("partition_file"),
    }


def materialise_world(preset, data: str | Path | None, seed: int, progress: bool = True,
                      root: str | Path | None = None, layout: str | None = None,
                      partition_file: str | None = None) -> Path:
    """Prepare the data and the split for ``preset`` (hospitals x teachers already applied); return the folder.

    Args:
        preset: the preset, its ``hospitals`` and ``teachers_per_hospital`` already as wanted.
        data: an MSD Task01 or BraTS folder (None = the preset's phantoms).
        seed: the split.
        progress: progress bars while generating and preparing.
        root: the world folder (None = a cache folder named after everything that decides the world).
        layout: the data folder's layout (``task.data.layouts``; None = detected).
        partition_file: a FeTS partition CSV whose partitions are the hospitals (its content, not its name,
            decides the split).
    """
    prepared, split = build_world(preset, data, seed, progress, layout=layout, partition_file=partition_file)
    partitions = None
    if partition_file:   # the file's content, not its name, decides the split
        partitions = hashlib.sha256(Path(partition_file).read_bytes()).hexdigest()[:16]
    key = json.dumps({"prepared": str(prepared.path), "hospitals": preset.hospitals,
                      "teachers": preset.teachers_per_hospital, "scheme": preset.world.split_scheme, "seed": seed,
                      "sizes": [preset.federation.n_query, preset.world.n_reference, preset.world.n_validation,
                                preset.world.n_test],
                      **({"partitions": partitions} if partitions else {})},
                     sort_keys=True)
    folder = Path(root) if root else cache_root() / "worlds" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    split.to_json(folder / "split.json")
    atomic_write_json(folder / "world.json", {
        "prepared": str(prepared.path), "data": str(data) if data else None, "grid": list(preset.grid),
        "preset": preset.name, "seed": seed, "hospitals": sorted(split.hospitals),
        "description": describe_world(prepared, split),
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
    """Build the public world from ``task.data`` objects (``PreparedDataset`` + ``Split``)."""
    query = _ids(split.public_query)
    reference = _ids(split.public_reference)
    validation = _ids(getattr(split, "public_validation", None))
    test = _ids(split.test)
    if not query:
        raise UserError("split: the public query set is empty (PATE needs query scans)")
    if not reference:  # the paper's choice: the labels of the student partition (Fay et al.)
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
