"""The real-scan check: every model a run releases, scored on labelled real cases beside its phantom Dice.

Why: a method can win on the phantom test set and lose on real tumours (the phantoms' per-voxel intensity
rules can be learned by a model that then does not transfer), so a comparison that ranks methods only on
phantoms can pick the wrong one. With ``--real-check DIR`` (repeatable; any layout the readers know: MSD
Task01, BraTS 2021, BraTS 2023, ``task.data.reader.read_dataset``, or one BraTS case folder) every model a
run writes is also scored on those cases, exactly as ``fedpate evaluate`` scores a bundle: the scan is
preprocessed as in training, segmented (``task.reporting.predict.segment_preprocessed``), the probabilities are mapped
back to the scan's own grid and compared with its label map there, in our classes (``task.data.layouts``
maps each release's codes). Dice per class (1 oedema, 2 non-enhancing core, 3 enhancing), their mean, and
the BraTS regions WT, TC, ET, per case and averaged.

How it reaches every model: the command opens the check (:func:`open_check`, which refuses a bad folder in
one line naming the option and the folder, before anything trains) and hands it down with the run's settings
(``task.settings.runconfig.RunSettings.real_check``, a comparison's cell context, a central run's config) to the code
that releases a model; :func:`task.reporting.results.write_run`, the one writer of ``results.json``, is given it, scores
the model it releases (:func:`score_release`) and stores the result under the record's ``real_check`` key.
No module-level state: whatever runs a release, in whichever thread, is told the check it scores on. Worker
processes re-open the check from its folders.

Cost: reading and preprocessing a 240 x 240 x 155 case takes seconds; it is done once per case and working
grid (kept in memory, and on disk under the cache, ``task.io.cache_root() / "real-check"``, keyed by the
files' names, sizes and modification times), so each further model costs one forward pass and the mapping
back to the scan's grid. The seconds each model's scoring took are recorded with its scores.

The references are what the user gives: fedpate cannot tell a radiologist's segmentation from an algorithm's
output, and reads nothing but the image and label files (a README beside the cases is ignored). So the user may
say it per folder, ``--real-check expert=DIR`` or ``--real-check algorithm=DIR`` (:class:`task.options.Reference`;
a plain ``DIR`` leaves it unstated), and every case carries its folder and that label into ``results.json`` and
the report. The cases of every folder are pooled, each known by its folder and id.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import nibabel as nib
import numpy as np

from task.data.brats import brats_case
from task.data.errors import DataError
from task.data.layouts import case_folder_layout
from task.data.msd import Case, load_case
from task.data.preprocess import PreprocessConfig, PreprocessRecord, brain_mask, preprocess_case
from task.data.reader import read_dataset, require_labels
from task.errors import UserError
from task.learning.inference import DESCRIPTION
from task.io import atomic_write_bytes, cache_root
from task.learning.metrics import (DICE_KEYS, REGIONS as REGION_CLASSES, class_volumes_ml, per_case_dice_counted,
                                   summarise)
from task.options import Reference, look_up_option

#: the command-line option (repeatable) and the demo's environment variable (folders separated by os.pathsep)
OPTION = "--real-check"
ENVIRONMENT = "FEDPATE_REAL_CHECK"
#: preprocessed cases kept in memory (each holds its label map and brain mask inside the box around the brain
#: and the labels, a few MB for a 240 x 240 x 155 BraTS case); more are re-read from the disk cache
MEMORY_CASES = 16
#: what a cached preprocessed case holds (bumped when that changes, so older entries are not read)
CACHE_VERSION = 2
#: the regions the report compares (BraTS's own)
REGIONS = ("WT", "TC", "ET")


@dataclass(frozen=True)
class RealCase:
    """One labelled real case: its id, the ``--real-check`` folder it came from, its layout, the
    :class:`task.data.msd.Case` that reads it, and who drew its reference (None: not stated)."""

    case_id: str
    folder: str
    layout: str
    case: Case
    reference: Reference | None = None


@dataclass(frozen=True)
class RealCheck:
    """The labelled real cases of one run (``--real-check`` folders, in the order given)."""

    folders: tuple[str, ...]
    cases: tuple[RealCase, ...]
    cache_dir: str | None = None        # None: preprocessed cases kept in memory only
    references: tuple[Reference | None, ...] = ()   # per folder (empty: none stated)

    def reference_of(self, folder: str) -> Reference | None:
        return dict(zip(self.folders, self.references)).get(folder)

    @property
    def specs(self) -> tuple[str, ...]:
        """The folders as ``--real-check`` takes them (``KIND=DIR`` where a reference was stated): what a worker
        process or a comparison's settings re-open the check from."""
        return tuple(folder_spec(folder, self.reference_of(folder)) for folder in self.folders)

    def describe(self) -> list[dict]:
        """Per folder: its path, layout, case ids and who drew the references (results.json and the report's
        header state them)."""
        described = []
        for folder in self.folders:
            found = [c for c in self.cases if c.folder == folder]
            reference = self.reference_of(folder)
            described.append({"folder": folder, "layout": found[0].layout if found else None,
                              "cases": [c.case_id for c in found], "reference": reference and str(reference)})
        return described


def parse_folder(text: str | os.PathLike, option: str = OPTION) -> tuple[str, Reference | None]:
    """``[KIND=]DIR`` -> (DIR, KIND or None), KIND a :class:`task.options.Reference`. A folder that exists under the
    whole text is that folder (a path may hold ``=``); a KIND that is not one is a one-line error naming ``option``."""
    text = str(text)
    kind, equals, folder = text.partition("=")
    if not equals or os.sep in kind or Path(text).exists():
        return text, None
    if not folder.strip():
        raise UserError(f"{option} {text}: no folder after {kind}=")
    return folder, look_up_option(kind, Reference, f"{option} {text}: reference kind")


def folder_spec(folder: str, reference: Reference | str | None) -> str:
    """The ``--real-check`` text of ``folder`` with its reference kind (:func:`parse_folder`'s inverse)."""
    return f"{reference}={folder}" if reference else str(folder)


def folders_from_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """The folders named by :data:`ENVIRONMENT` (separated by ``os.pathsep``; empty entries ignored)."""
    text = (os.environ if environ is None else environ).get(ENVIRONMENT, "")
    return [part for part in text.split(os.pathsep) if part.strip()]


def open_check(folders: Sequence[str | os.PathLike] | None, option: str = OPTION,
               cache_dir: str | os.PathLike | None | bool = True, read: bool = True) -> RealCheck | None:
    """The check of ``folders`` (None when there are none), every case's files checked now.

    A folder that is missing, of no known layout, holds an unlabelled case or a file that is not a readable
    NIfTI of the right shape -- its header or any of its voxels (every file is read whole) -- is a one-line
    UserError naming ``option`` and the folder: refused before any training starts, not after an hour of it.

    Args:
        folders: MSD Task01 folders, folders of BraTS case folders, or single BraTS case folders, each as
            ``[KIND=]DIR`` (:func:`parse_folder`: KIND says who drew its references, ``expert`` or ``algorithm``).
        option: the option named in errors.
        cache_dir: where preprocessed cases are kept (True: ``cache_root() / "real-check"``; None or False:
            memory only).
        read: read every file whole (False: headers only, for a worker re-opening what its parent read).
    """
    parsed = [parse_folder(f, option) for f in (folders or []) if str(f).strip()]
    if not parsed:
        return None
    folders = [folder for folder, _ in parsed]
    if len(set(folders)) != len(folders):
        raise UserError(f"{option}: the same folder given twice ({', '.join(folders)})")
    cases: list[RealCase] = []
    for folder, reference in parsed:
        for case in _labelled_cases(Path(folder), option):
            _check_files(case, folder, option, read)
            cases.append(RealCase(case.case_id, folder, case.layout or "msd", case, reference))
    if cache_dir is True:
        cache_dir = cache_root() / "real-check"
    return RealCheck(tuple(folders), tuple(cases), str(cache_dir) if cache_dir else None,
                     tuple(reference for _, reference in parsed))


def _labelled_cases(folder: Path, option: str) -> list[Case]:
    if not folder.exists():
        raise UserError(f"{option} {folder}: no such folder")
    if not folder.is_dir():
        raise UserError(f"{option} {folder}: expected a folder of labelled cases (MSD Task01, BraTS 2021 or BraTS "
                        "2023 case folders), got a file")
    try:
        layout = case_folder_layout(folder)
        if layout is not None:   # one BraTS case folder given by itself
            case = brats_case(folder, layout)
            if case.label is None:
                raise DataError(f"{layout.seg_file(folder, folder.name).name}: missing label map of case "
                                f"{folder.name}; the real-scan check needs labelled cases")
            return [case]
        dataset = require_labels(read_dataset(folder), "score models on real scans")
    except DataError as exc:
        message = str(exc)
        if message.startswith(f"{folder}: "):   # the reader names the folder too: once is enough
            message = message[len(f"{folder}: "):]
        raise UserError(f"{option} {folder}: {message}") from None
    if not dataset.training:
        raise UserError(f"{option} {folder}: no labelled cases")
    return list(dataset.training)


def _check_files(case: Case, folder: str, option: str, read: bool = True) -> None:
    """Every file a readable NIfTI, read whole (``read``; a file whose header reads but whose data is cut short
    is found now, not when the first model is scored after training), one 3D grid for the modalities and the
    label. ``read=False``: headers only (a worker re-opening folders its parent read)."""
    images = list(case.modalities) or [case.image]
    shapes = {}
    for path in [*images, case.label]:
        try:
            image = nib.load(str(path))
            shapes[Path(path).name] = tuple(int(s) for s in image.shape)
            if read:
                np.asanyarray(image.dataobj)   # every voxel decompressed: a truncated file raises here
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix, in one line
            said = " ".join(str(exc).split())
            raise UserError(f"{option} {folder}: {Path(path).name} of case {case.case_id} is not a readable NIfTI "
                            f"file ({exc.__class__.__name__}{': ' + said if said else ''})") from None
    grids = {name: shape[:3] for name, shape in shapes.items()}
    if len(set(grids.values())) != 1:
        raise UserError(f"{option} {folder}: case {case.case_id} has files on different grids "
                        f"({', '.join(f'{n} {s}' for n, s in grids.items())})")


# ------------------------------------------------------------------------------------------ scoring a release
def score_release(check: RealCheck | None, model, preprocessing: Mapping[str, Any],
                  precision: str | None = None) -> dict | None:
    """``check``'s scores of a model about to be released (None without a check).

    A failure here must not lose a trained (and, for a private method, paid-for) model: it is recorded as
    ``{"error": ...}`` and said on the console, and the run goes on."""
    if check is None:
        return None
    from task.reporting.predict import preprocess_config_of

    try:
        return score_model(model, preprocess_config_of(preprocessing), check, precision=precision or "32")
    except Exception as exc:  # noqa: BLE001 - see the docstring
        message = f"{exc.__class__.__name__}: {_shortened(str(exc))}"
        print(f"real-scan check: scoring failed ({message}); the model is kept", flush=True)
        return {"error": message, "folders": check.describe()}


def _shortened(text: str, limit: int = 300) -> str:
    """One line of at most ``limit`` characters, cut at a word boundary with an ellipsis (never mid-word)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def score_model(model, config: PreprocessConfig, check: RealCheck, precision: str = "32",
                mirror: bool = True) -> dict:
    """Dice of ``model`` on every case of ``check``, each in its own grid, with test-time mirroring
    (``task.learning.inference``; ``mirror=False``: one pass).

    Returns ``{"dice": mean over cases (task.learning.metrics.summarise's keys), "cases": [per-case rows: case,
    folder, layout, reference (who drew it, or None) and the same keys], "folders": check.describe(),
    "seconds": this scoring's wall time (preprocessing included when a case was not cached yet)}``.
    """
    # MONAI's first import (~10 s) is not the check's cost: paid before the clock starts
    import monai.inferers  # noqa: F401

    from task.reporting.predict import segment_preprocessed

    started = time.perf_counter()
    was_training = getattr(model, "training", False)
    model.eval()
    rows, class_rows, region_rows = [], [], []
    try:
        for real in check.cases:
            prepared = prepared_case(real, config, check.cache_dir)
            # Dice inside the box that holds every labelled voxel and every voxel the model can label: the same
            # Dice as over the whole scan, in a third of the voxels
            box = tuple(slice(lo, hi) for lo, hi in prepared["box"])
            labels = segment_preprocessed(model, config, prepared["image"], prepared["record"], None,
                                          precision=precision, mirror=mirror)[box]
            labels[~prepared["brain"]] = 0      # segment_scan's rule: no tumour outside the brain
            class_dice, region_dice = per_case_dice_counted(labels[None], prepared["truth"][None])
            class_rows.append(class_dice[0]), region_rows.append(region_dice[0])
            rows.append({"case": real.case_id, "folder": real.folder, "layout": real.layout,
                         "reference": real.reference and str(real.reference), **summarise(class_dice, region_dice),
                         "volume_ml": region_volumes(labels, prepared["truth"], prepared["record"])})
    finally:
        model.train(was_training)
    return {"dice": summarise(np.stack(class_rows), np.stack(region_rows)), "cases": rows,
            "folders": check.describe(), "grid": "each case's own grid",
            "inference": DESCRIPTION if mirror else "one pass",
            "seconds": round(time.perf_counter() - started, 2)}


def region_volumes(labels: np.ndarray, truth: np.ndarray, record: PreprocessRecord) -> dict[str, list[float]]:
    """``{region: [reference ml, model ml]}`` for WT, TC and ET of one case in its own grid (the voxel volume
    from its affine): whether a model under- or over-calls a region, which Dice alone does not say."""
    reference, model = (class_volumes_ml(volume, record.affine_array) for volume in (truth, labels))
    return {region: [round(sum(reference[c] for c in classes), 1), round(sum(model[c] for c in classes), 1)]
            for region, classes in REGION_CLASSES.items()}


# ------------------------------------------------------------------------------------------ preprocessed cases
_MEMORY: "OrderedDict[str, dict]" = OrderedDict()


def case_key(real: RealCase, config: PreprocessConfig) -> str:
    """What a preprocessed case is keyed on: its files (path, size, modification time) and the preprocessing."""
    digest = hashlib.sha256(f"{CACHE_VERSION}\n".encode() + json.dumps(config.to_dict(), sort_keys=True).encode())
    for path in (*(real.case.modalities or (real.case.image,)), real.case.label):
        path = Path(path).resolve()
        stat = path.stat()
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    digest.update((real.layout or "msd").encode())
    return digest.hexdigest()[:24]


def prepared_case(real: RealCase, config: PreprocessConfig, cache_dir: str | None = None) -> dict:
    """``{"image": (4, *grid) float32, "record": PreprocessRecord, "box": ((lo, hi) per axis), "brain": bool,
    "truth": uint8 in our classes}`` of one case, ``brain`` and ``truth`` inside ``box``: the smallest box of the
    scan's own grid holding the preprocessing's crop box (outside it a model labels nothing) and every labelled
    voxel. From memory, else the disk cache, else read and preprocessed (and cached)."""
    key = case_key(real, config)
    if key in _MEMORY:
        _MEMORY.move_to_end(key)
        return _MEMORY[key]
    path = Path(cache_dir) / f"{key}.npz" if cache_dir else None
    prepared = _read_cached(path) if path is not None else None
    if prepared is None:
        image, truth, affine = load_case(real.case)
        grid_image, _, record = preprocess_case(image, None, affine, config)
        box = _box(record, truth)
        inside = tuple(slice(lo, hi) for lo, hi in box)
        prepared = {"image": grid_image, "record": record, "box": box, "brain": brain_mask(image[inside]),
                    "truth": np.ascontiguousarray(truth[inside], np.uint8)}
        del image
        if path is not None:
            _write_cached(path, prepared)
    _MEMORY[key] = prepared
    while len(_MEMORY) > MEMORY_CASES:
        _MEMORY.popitem(last=False)
    return prepared


def _box(record: PreprocessRecord, truth: np.ndarray) -> tuple[tuple[int, int], ...]:
    lo, hi = list(record.bbox_lo), list(record.bbox_hi)
    labelled = np.nonzero(truth)
    for axis, where in enumerate(labelled):
        if where.size:
            lo[axis], hi[axis] = min(lo[axis], int(where.min())), max(hi[axis], int(where.max()) + 1)
    return tuple((int(a), int(b)) for a, b in zip(lo, hi))


def _write_cached(path: Path, prepared: dict) -> None:
    buffer = io.BytesIO()
    brain = prepared["brain"]
    np.savez_compressed(buffer, image=prepared["image"], truth=prepared["truth"], box=np.asarray(prepared["box"]),
                        brain=np.packbits(brain.ravel()), brain_shape=np.asarray(brain.shape),
                        record=np.frombuffer(json.dumps(prepared["record"].to_dict()).encode(), np.uint8))
    atomic_write_bytes(path, buffer.getvalue(), private=True)   # a patient's labels and brain: owner-only


def _read_cached(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        with np.load(path) as data:
            shape = tuple(int(s) for s in data["brain_shape"])
            brain = np.unpackbits(data["brain"])[: int(np.prod(shape))].astype(bool).reshape(shape)
            record = PreprocessRecord.from_dict(json.loads(bytes(data["record"]).decode()))
            box = tuple((int(lo), int(hi)) for lo, hi in data["box"])
            return {"image": data["image"], "record": record, "box": box, "brain": brain, "truth": data["truth"]}
    except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt, never trusted
        return None


# ------------------------------------------------------------------------------------------ reading results
def real_dice(cell: Mapping[str, Any], key: str = "mean") -> float | None:
    """A results record's mean real-scan Dice for ``key`` (a :data:`task.learning.metrics.DICE_KEYS` entry), or None."""
    found = cell.get("real_check") or {}
    return (found.get("dice") or {}).get(key)


def real_per_case(cell: Mapping[str, Any], key: str) -> dict[tuple[str, str], float | None] | None:
    """``{(folder, case): Dice for key}`` of a results record's real-scan check, or None without one."""
    found = cell.get("real_check") or {}
    if not found.get("cases"):
        return None
    return {(row.get("folder"), row.get("case")): row.get(key) for row in found["cases"]}


def real_region_mean(cell: Mapping[str, Any]) -> float | None:
    """The mean of a results record's real-scan WT, TC and ET Dice (each a mean over the cases): what the reports
    rank real scans by (those of the three that were scored; None without any)."""
    found = [real_dice(cell, key) for key in REGIONS]
    found = [value for value in found if value is not None]
    return float(np.mean(found)) if found else None


def case_name(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """A case's id, prefixed with its folder's name where another folder holds a case of that id."""
    repeated = sum(1 for other in rows if other.get("case") == row.get("case")) > 1
    return f"{Path(str(row.get('folder'))).name}/{row.get('case')}" if repeated else str(row.get("case"))


def _per_case_text(rows: Sequence[Mapping[str, Any]], key: str) -> str | None:
    """``case=value;...`` (value empty where the case has none) for a cells.csv column."""
    if not rows:
        return None
    return ";".join(f"{case_name(row, rows)}={'' if row.get(key) is None else f'{row[key]:.4f}'}" for row in rows)


def csv_fields(results: Mapping[str, Any]) -> dict[str, Any]:
    """The ``cells.csv`` columns of a record's check (:data:`CSV_COLUMNS`); empty without one: the means over the
    cases, the mean of WT, TC and ET, each case's WT / TC / ET Dice as ``case=value;...`` and each case's
    reference as ``case=expert|algorithm|;...`` (empty: not stated)."""
    found = results.get("real_check") or {}
    rows = found.get("cases") or []
    row: dict[str, Any] = {"real_cases": len(rows) if rows else None}
    row.update({f"real_dice_{key}": (found.get("dice") or {}).get(key) for key in DICE_KEYS})
    row["real_dice_region_mean"] = real_region_mean(results) if found.get("dice") else None
    row.update({f"real_per_case_{key}": _per_case_text(rows, key) for key in REGIONS})
    row["real_case_references"] = (";".join(f"{case_name(r, rows)}={r.get('reference') or ''}" for r in rows)
                                   if rows else None)
    row["real_check_seconds"] = found.get("seconds")
    return row


#: the check's columns in cells.csv (task.reporting.results.CSV_COLUMNS appends them)
CSV_COLUMNS = (("real_cases",) + tuple(f"real_dice_{key}" for key in DICE_KEYS) + ("real_dice_region_mean",)
               + tuple(f"real_per_case_{key}" for key in REGIONS) + ("real_case_references", "real_check_seconds"))


def prepare_cases(check: RealCheck | None, config: PreprocessConfig | None) -> None:
    """Read and preprocess every case of ``check`` for ``config`` now (into the caches), so that the cells,
    whichever process runs them, only segment; says how long it took. Nothing without a check or a config."""
    if check is None or config is None:
        return
    started = time.perf_counter()
    for real in check.cases:
        try:
            prepared_case(real, config, check.cache_dir)
        except DataError as exc:
            raise UserError(f"{OPTION} {real.folder}: {exc}") from None
    print(f"real-scan check: {len(check.cases)} labelled real case(s) ready in "
          f"{time.perf_counter() - started:.1f} s (read and preprocessed once, then cached)", flush=True)
