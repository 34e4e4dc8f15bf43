"""Reader and validator for the Medical Segmentation Decathlon Task01_BrainTumour layout.

The folder as distributed::
    dataset.json      {"modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
                       "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor",
                                  "3": "enhancing tumour"},
                       "training": [{"image": "./imagesTr/BRATS_001.nii.gz",
                                     "label": "./labelsTr/BRATS_001.nii.gz"}, ...],
                       "test": ["./imagesTs/BRATS_485.nii.gz", ...]}
    imagesTr/*.nii.gz 4D NIfTI (x, y, z, 4 modalities)
    labelsTr/*.nii.gz 3D label maps with values 0..3
    imagesTs/*.nii.gz 4D NIfTI without labels

The phantom generator (``task.data.phantoms``) writes the same layout plus an ``"institution"`` and a
``"patient"`` field per training entry and a ``"phantoms"`` block describing how it was generated; all are
optional here. Which scans belong to one patient is decided by :func:`patient_id` (the one place that rule
lives).

Every problem with the user's data becomes a one-line :class:`~task.data.errors.DataError` naming the file
and what was expected -- never a raw nibabel/gzip/zlib traceback.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from task.data.errors import DataError
from task.data.layouts import get_layout, to_ours

MODALITIES = ("FLAIR", "T1w", "t1gd", "T2w")
LABELS = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
N_CHANNELS = 4
N_CLASSES = 4
AFFINE_TOLERANCE = 1e-3   # mm; image and label affines must agree to this (rounding in headers is ~1e-6)
PATIENT_KEY = "patient"   # optional per-entry key of dataset.json: the patient the scan belongs to

# Released naming schemes that put a subject and a timepoint in the case id (checked against their public
# file lists). The subject keeps its site or cohort, since subject numbers are only unique within one.
_PATIENT_SCHEMES = (
    # BraTS 2017-2019: <Brats17|Brats18|BraTS19>_<site>_<subject>_<timepoint>, e.g. BraTS19_TCIA01_131_1,
    # Brats18_2013_10_1, BraTS19_CBICA_AAB_1 -> TCIA01_131, 2013_10, CBICA_AAB (release prefix and timepoint
    # dropped)
    re.compile(r"^brats\d{2}_(?P<subject>[a-z0-9]+_[a-z0-9]+)_\d+$", re.IGNORECASE),
    # BraTS 2023-2025 (GLI, MEN, MET, PED, SSA, MEN-RT, ...): BraTS-<cohort>-<subject:5 digits>-<timepoint:3
    # digits>, e.g. BraTS-GLI-00008-000 and BraTS-GLI-00008-001 -> GLI-00008 (post-treatment GLI 2024: -100,
    # -101, ...); a cohort name may carry one hyphen (MEN-RT)
    re.compile(r"^brats-(?P<subject>[a-z]+(?:-[a-z]+)?-\d{5})-\d{3}$", re.IGNORECASE),
)


def patient_id(case_id: str, declared: str | None = None) -> str:
    """The patient a scan belongs to -- the unit of privacy (docs/PRIVACY.md) and of every split.

    The rule, in order: the ``"patient"`` a dataset.json entry declares; else the subject of a known naming
    scheme with timepoints (:data:`_PATIENT_SCHEMES`: BraTS 2017-2019 ``BraTS19_TCIA01_131_1`` -> ``TCIA01_131``,
    BraTS 2023-2024 ``BraTS-GLI-00008-001`` -> ``GLI-00008``); else the case id itself (one volume, one patient).
    Names without a subject/timepoint structure stay their own patient: MSD Task01 ``BRATS_001``, BraTS 2020
    ``BraTS20_Training_001`` and BraTS 2021 ``BraTS2021_00000`` (anonymised, one scan each). Why it matters:
    two scans of one patient at two teachers (or one public and one private) would let that patient
    influence more than one teacher, and the 2/K sensitivity would no longer hold.
    """
    if declared is not None:
        return declared
    for scheme in _PATIENT_SCHEMES:
        match = scheme.match(case_id)
        if match:
            return match.group("subject")
    return case_id


@dataclass(frozen=True)
class Case:
    """One scan: its id (file name without ``.nii.gz``), image path, label path (None for test scans).

    ``patient``: the id dataset.json declares, resolved by :func:`patient_id` (None -> from the case id).
    ``modalities``: a BraTS case's per-modality files in our channel order (``task.data.layouts.CHANNELS``);
    empty for an MSD 4D image. ``image`` is then the case folder. ``layout``: whose label codes ``label`` uses
    (converted to ours on reading, ``task.data.layouts``).
    """

    case_id: str
    image: Path
    label: Path | None = None
    institution: str | None = None
    patient: str | None = None
    modalities: tuple = ()
    layout: str = "msd"

    def __post_init__(self):
        object.__setattr__(self, "patient", patient_id(self.case_id, self.patient))


@dataclass
class MSDDataset:
    """A parsed ``dataset.json`` with resolved paths (files are checked to exist, not yet read)."""

    root: Path
    training: list[Case]
    test: list[Case]
    labels: dict
    modalities: dict
    name: str = ""
    extra: dict = field(default_factory=dict)   # other dataset.json keys (e.g. the "phantoms" block)
    layout: str = "msd"                           # task.data.layouts: which release's files and label codes

    @property
    def institutions(self) -> list[str]:
        """Sorted distinct institutions of the training cases (empty when dataset.json does not say)."""
        return sorted({c.institution for c in self.training if c.institution is not None})

    @property
    def patients(self) -> list[str]:
        """Sorted distinct patients of the training cases (:func:`patient_id`)."""
        return sorted({c.patient for c in self.training})

    def case(self, case_id: str) -> Case:
        for case in self.training + self.test:
            if case.case_id == case_id:
                return case
        raise DataError(f"{self.root / 'dataset.json'}: no case {case_id!r}")


def display_path(path: str | os.PathLike) -> str:
    """Short, unambiguous form of a path for one-line messages (relative to the cwd when inside it)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def case_id_from_path(path: str | os.PathLike) -> str:
    name = Path(path).name
    for suffix in (".nii.gz", ".nii"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# ------------------------------------------------------------------------------------------ dataset.json
def _declared_patient(entry: Any, where: str, what: str) -> str | None:
    """The entry's ``"patient"`` (None when absent); an empty or non-string id is a DataError."""
    if not isinstance(entry, dict) or PATIENT_KEY not in entry:
        return None
    value = entry[PATIENT_KEY]
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: {what} has {PATIENT_KEY!r} {value!r}; expected a non-empty patient id shared "
                        f"by all scans of one patient (or no {PATIENT_KEY!r} key: one scan, one patient)")
    return value.strip()


def read_msd(root: str | os.PathLike) -> MSDDataset:
    """Parse and check ``root/dataset.json``; every listed file must exist. Raises :class:`DataError`."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{display_path(root)}: expected an MSD Task01 folder (dataset.json, imagesTr/, labelsTr/), "
                        "but it is not a folder")
    meta_path = root / "dataset.json"
    where = display_path(meta_path)
    if not meta_path.is_file():
        raise DataError(f"{where}: missing; expected the MSD dataset description (a half-generated phantom folder "
                        "has no dataset.json until it is complete)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{where}: expected UTF-8 JSON text, got binary data") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    missing = [key for key in ("modality", "labels", "training") if key not in meta]
    if missing:
        raise DataError(f"{where}: missing key(s) {', '.join(map(repr, missing))}; "
                        "expected 'modality', 'labels', 'training' (and optionally 'test')")
    modalities, labels = meta["modality"], meta["labels"]
    if not isinstance(modalities, dict) or sorted(modalities) != [str(i) for i in range(N_CHANNELS)]:
        raise DataError(f"{where}: 'modality' must map '0'..'3' to the four MRI sequences "
                        f"{dict(enumerate(MODALITIES))}, got {modalities!r}")
    if not isinstance(labels, dict) or not set(LABELS) <= set(map(str, labels)):
        raise DataError(f"{where}: 'labels' must name classes '0'..'3' {LABELS}, got {labels!r}")
    training_entries = meta["training"]
    if not isinstance(training_entries, list) or not training_entries:
        raise DataError(f"{where}: 'training' must be a non-empty list of {{'image', 'label'}} entries, "
                        f"got {'an empty list' if training_entries == [] else type(training_entries).__name__}")
    training: list[Case] = []
    for index, entry in enumerate(training_entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("image"), str) \
                or not isinstance(entry.get("label"), str):
            raise DataError(f"{where}: training[{index}] must be an object with string 'image' and 'label' paths, "
                            f"got {entry!r:.80}")
        institution = entry.get("institution")
        case_id = case_id_from_path(entry["image"])
        training.append(Case(case_id, root / entry["image"], root / entry["label"],
                             None if institution is None else str(institution),
                             _declared_patient(entry, where, f"training[{index}] ({case_id})")))
    test_entries = meta.get("test", [])
    if not isinstance(test_entries, list):
        raise DataError(f"{where}: 'test' must be a list of image paths, got {type(test_entries).__name__}")
    test: list[Case] = []
    for index, entry in enumerate(test_entries):
        image = entry.get("image") if isinstance(entry, dict) else entry
        if not isinstance(image, str):
            raise DataError(f"{where}: test[{index}] must be an image path string, got {entry!r:.80}")
        case_id = case_id_from_path(image)
        test.append(Case(case_id, root / image, None, None,
                         _declared_patient(entry, where, f"test[{index}] ({case_id})")))
    seen: dict[str, str] = {}
    for kind, cases in (("training", training), ("test", test)):
        for case in cases:
            if case.case_id in seen:
                raise DataError(f"{where}: duplicate case id {case.case_id!r} (in {seen[case.case_id]} and {kind}); "
                                "expected every image file name to be unique")
            seen[case.case_id] = kind
    for case in training + test:
        if not case.image.is_file():
            raise DataError(f"{display_path(case.image)}: missing image file listed in {where}")
        if case.label is not None and not case.label.is_file():
            raise DataError(f"{display_path(case.label)}: missing label file listed in {where}")
    extra = {k: v for k, v in meta.items() if k not in ("modality", "labels", "training", "test")}
    return MSDDataset(root=root, training=training, test=test, labels=dict(labels), modalities=dict(modalities),
                      name=str(meta.get("name") or root.name), extra=extra)


# ------------------------------------------------------------------------------------------------ NIfTI
def _open_nifti(path: Path, what: str):
    """Load header and voxel array, turning every nibabel/gzip/zlib failure into a one-line DataError."""

    where = display_path(path)
    if not path.is_file():
        raise DataError(f"{where}: missing {what} file")
    if path.name.endswith(".gz"):
        with open(path, "rb") as handle:
            magic = handle.read(2)
        if magic != b"\x1f\x8b":
            raise DataError(f"{where}: not a gzip file; expected a gzip-compressed NIfTI (.nii.gz) {what}")
    try:
        img = nib.load(str(path))
    except (gzip.BadGzipFile, zlib.error, EOFError) as exc:
        raise DataError(f"{where}: corrupted or truncated gzip data ({_one_line(exc)}); "
                        f"expected a readable .nii.gz {what}") from None
    except Exception as exc:  # nibabel raises ImageFileError, HeaderDataError, ValueError, struct.error...
        raise DataError(f"{where}: not a NIfTI {what} ({_one_line(exc)})") from None
    if not isinstance(img, (nib.Nifti1Image, nib.Nifti2Image)):
        raise DataError(f"{where}: expected a NIfTI {what}, got {type(img).__name__}")
    try:
        data = np.asanyarray(img.dataobj)
    except (gzip.BadGzipFile, zlib.error, EOFError, OSError) as exc:
        raise DataError(f"{where}: corrupted or truncated gzip data ({_one_line(exc)}); "
                        f"expected a readable .nii.gz {what}") from None
    except Exception as exc:
        raise DataError(f"{where}: unreadable voxel data ({_one_line(exc)}); expected a NIfTI {what}") from None
    affine = np.asarray(img.affine, dtype=np.float64)
    return data, affine


def _check_affine(affine: np.ndarray, where: str) -> None:
    if affine.shape != (4, 4) or not np.all(np.isfinite(affine)):
        raise DataError(f"{where}: affine is not a finite 4x4 matrix")
    if abs(np.linalg.det(affine[:3, :3])) < 1e-9:
        raise DataError(f"{where}: affine is not invertible (zero voxel size or degenerate axes); "
                        "expected a voxel-to-world matrix with non-zero determinant")


def load_image(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """Read and check a 4D MSD-order scan: returns (image float32 (X, Y, Z, 4), affine (4, 4)).

    Used for training cases and for scans given to ``fedpate predict``.
    """
    path = Path(path)
    where = display_path(path)
    data, affine = _open_nifti(path, "image")
    if data.ndim != 4:
        raise DataError(f"{where}: expected a 4D image (x, y, z, {N_CHANNELS} modalities: "
                        f"{', '.join(MODALITIES)}), got a {data.ndim}D array of shape {tuple(data.shape)}")
    if data.shape[3] != N_CHANNELS:
        raise DataError(f"{where}: expected {N_CHANNELS} channels ({', '.join(MODALITIES)}) on the last axis, "
                        f"got {data.shape[3]} (shape {tuple(data.shape)})")
    if not np.issubdtype(data.dtype, np.number) or np.issubdtype(data.dtype, np.complexfloating):
        raise DataError(f"{where}: expected real-valued voxels, got dtype {data.dtype}")
    image = np.asarray(data, dtype=np.float32)
    if not np.all(np.isfinite(image)):
        bad = int(np.size(image) - np.count_nonzero(np.isfinite(image)))
        raise DataError(f"{where}: {bad} non-finite voxel(s) (NaN or inf); expected finite intensities")
    if not np.any(image):
        raise DataError(f"{where}: empty brain (every voxel is zero); expected a skull-stripped scan with "
                        "non-zero intensities inside the brain")
    _check_affine(affine, where)
    return image, affine


def load_label(path: str | os.PathLike, shape: tuple[int, ...] | None = None,
               affine: np.ndarray | None = None, image_path: str | os.PathLike | None = None,
               layout: str = "msd") -> np.ndarray:
    """Read and check a 3D label map (optionally against its image's shape/affine); returns our classes 0..3.

    ``layout``: whose codes the file uses (``task.data.layouts``); they are converted to ours there, the only
    place label codes are mapped."""
    path = Path(path)
    where = display_path(path)
    data, label_affine = _open_nifti(path, "label")
    against = f" of {display_path(image_path)}" if image_path is not None else ""
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"{where}: expected a 3D label map (x, y, z), got shape {tuple(data.shape)}")
    if shape is not None and tuple(data.shape) != tuple(shape[:3]):
        raise DataError(f"{where}: label shape {tuple(data.shape)} does not match the image shape "
                        f"{tuple(shape[:3])}{against}")
    _check_affine(label_affine, where)
    if affine is not None and not np.allclose(label_affine, affine, atol=AFFINE_TOLERANCE):
        raise DataError(f"{where}: label affine differs from the image affine{against} "
                        f"(max difference {np.max(np.abs(label_affine - affine)):.3g}); expected the same grid")
    if not np.issubdtype(data.dtype, np.number):
        raise DataError(f"{where}: expected integer labels 0..3, got dtype {data.dtype}")
    if np.issubdtype(data.dtype, np.floating):
        values = np.asarray(data, dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise DataError(f"{where}: non-finite label values (NaN or inf); expected integers 0..3")
        if np.any(values != np.round(values)):
            raise DataError(f"{where}: non-integer label values (e.g. {values[values != np.round(values)][0]:g}); "
                            "expected integers 0..3")
        data = values
    if not get_layout(layout).per_modality:   # MSD's codes are ours: range-checked here (a release's, by to_ours)
        lo, hi = int(np.min(data)), int(np.max(data))
        if lo < 0 or hi >= N_CLASSES:
            found = sorted(int(v) for v in np.unique(data) if not 0 <= v < N_CLASSES)[:5]
            raise DataError(f"{where}: label values {found} outside 0..3; expected 0 background, 1 edema, "
                            "2 non-enhancing tumour, 3 enhancing tumour")
    return to_ours(np.asarray(data).astype(np.int64), layout, where)


def load_modalities(paths, case_id: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Stack one 3D file per modality (our channel order) into (image float32 (X, Y, Z, 4), affine).

    Why here: BraTS ships one file per modality, and the rest of the pipeline (preprocessing, predict) takes
    the 4-channel array an MSD 4D image gives; stacking in one place means both layouts give the same array.
    Every modality must be on the first one's grid (shape and affine): a one-line DataError names the case
    and the file that differs.
    """
    paths = [Path(p) for p in paths]
    if len(paths) != N_CHANNELS:
        raise DataError(f"{case_id or 'case'}: expected {N_CHANNELS} modality files, got {len(paths)}")
    channels, first_affine = [], None
    for path in paths:
        where = display_path(path)
        data, affine = _open_nifti(path, "modality image")
        if data.ndim == 4 and data.shape[3] == 1:
            data = data[..., 0]
        if data.ndim != 3:
            raise DataError(f"{where}: expected a 3D image (x, y, z) of one modality, got shape {tuple(data.shape)}")
        if not np.issubdtype(data.dtype, np.number) or np.issubdtype(data.dtype, np.complexfloating):
            raise DataError(f"{where}: expected real-valued voxels, got dtype {data.dtype}")
        _check_affine(affine, where)
        if first_affine is None:
            first_affine, first = affine, path
        elif tuple(data.shape) != tuple(channels[0].shape):
            raise DataError(f"{where}: shape {tuple(data.shape)} differs from {display_path(first)} "
                            f"{tuple(channels[0].shape)}; expected every modality of {case_id} on one grid")
        elif not np.allclose(affine, first_affine, atol=AFFINE_TOLERANCE):
            raise DataError(f"{where}: affine differs from {display_path(first)} (max difference "
                            f"{np.max(np.abs(affine - first_affine)):.3g}); expected every modality of {case_id} "
                            "on one grid (co-registered, as BraTS distributes them)")
        channel = np.asarray(data, dtype=np.float32)
        if not np.all(np.isfinite(channel)):
            bad = int(np.size(channel) - np.count_nonzero(np.isfinite(channel)))
            raise DataError(f"{where}: {bad} non-finite voxel(s) (NaN or inf); expected finite intensities")
        channels.append(channel)
    image = np.stack(channels, axis=-1)
    if not np.any(image):
        raise DataError(f"{case_id}: empty brain (every voxel of every modality is zero); expected a skull-stripped "
                        "scan with non-zero intensities inside the brain")
    return image, first_affine


def load_case(case: Case) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Read one case: (image float32 (X, Y, Z, 4), label uint8 (X, Y, Z) in our classes or None, affine (4, 4))."""
    if case.modalities:
        image, affine = load_modalities(case.modalities, case.case_id)
        image_path = case.modalities[0]
    else:
        image, affine = load_image(case.image)
        image_path = case.image
    label = None
    if case.label is not None:
        label = load_label(case.label, image.shape, affine, image_path=image_path, layout=case.layout)
    return image, label, affine


def validate_case(case: Case, loaded: tuple | None = None) -> dict[str, Any]:
    """Read and check one case; return a summary (shape, spacing, label voxel counts per class).
    ``loaded``: the case's :func:`load_case` result when the caller has read it already."""
    image, label, affine = loaded if loaded is not None else load_case(case)
    summary: dict[str, Any] = {
        "case_id": case.case_id,
        "shape": tuple(int(s) for s in image.shape),
        "spacing": tuple(float(s) for s in np.sqrt((affine[:3, :3] ** 2).sum(axis=0))),
        "institution": case.institution,
    }
    if label is not None:
        counts = np.bincount(label.ravel(), minlength=N_CLASSES)
        summary["label_counts"] = {str(k): int(counts[k]) for k in range(N_CLASSES)}
    return summary


def validate_dataset(root: str | os.PathLike, include_test: bool = True) -> MSDDataset:
    """Check ``dataset.json`` and read every listed case; raise the first :class:`DataError` found."""
    dataset = read_msd(root)
    for case in dataset.training + (dataset.test if include_test else []):
        validate_case(case)
    return dataset
