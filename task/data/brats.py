"""BraTS folders as distributed: one case folder per scan, one NIfTI per modality.

::
    BraTS 2021 / FeTS 2022   <root>/<case>/<case>_{flair,t1,t1ce,t2,seg}.nii.gz   labels 1 NCR/NET, 2 ED, 4 ET
    BraTS 2023 and later     <root>/<case>/<case>-{t2f,t1n,t1c,t2w,seg}.nii.gz    labels 1 NCR, 2 ED, 3 ET
    optional                 <root>/partitioning_1.csv   (FeTS 2022: Partition_ID,Subject_ID = institutions)

:func:`read_brats` gives the same :class:`~task.data.msd.MSDDataset` the MSD reader gives (cases with a
``seg`` file are training cases, the others test cases), so preprocessing, the world and every command read
both alike; which file is which modality and what the label codes mean comes from the one table in
``task.data.layouts``. :func:`write_brats` writes a folder in either BraTS layout (the phantoms in every
layout, ``fedpate data phantoms --layout``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path

import nibabel as nib
import numpy as np

from task.data.errors import DataError
from task.data.fets import institutions_from
from task.data.layouts import CHANNELS, Layout, from_ours, get_layout
from task.data.msd import LABELS, MODALITIES, Case, MSDDataset, display_path, load_label, read_msd
from task.io import atomic_write_bytes, atomic_write_text

#: FeTS 2022 ships this beside the case folders: its Partition_ID is each subject's institution
INSTITUTIONS_FILE = "partitioning_1.csv"


def case_folders(root: Path) -> list[Path]:
    """Every non-hidden sub-folder of ``root``: in a BraTS download each one is a case."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def brats_case(folder: Path, layout: Layout) -> Case:
    """The :class:`Case` of one case folder; a missing modality is a one-line DataError naming case and file."""
    case_id = folder.name
    files = []
    for channel in range(len(layout.modalities)):
        path = layout.modality_file(folder, case_id, channel)
        if not path.is_file():
            raise DataError(f"{display_path(path)}: missing {CHANNELS[channel]} file of case {case_id}; expected "
                            f"{case_id}{layout.separator}{{{','.join(layout.modalities)}}}.nii.gz ({layout.title})")
        files.append(path)
    seg = layout.seg_file(folder, case_id)
    return Case(case_id, folder, seg if seg.is_file() else None, None, None, tuple(files), layout.name)


def read_brats(root: str | os.PathLike, layout: str | Layout) -> MSDDataset:
    """Every case folder of ``root`` in ``layout``; the first problem is a one-line DataError naming the file."""
    root = Path(root)
    layout = get_layout(layout)
    if not layout.per_modality:
        raise DataError(f"--layout={layout.name}: not a BraTS per-modality layout")
    if not root.is_dir():
        raise DataError(f"{display_path(root)}: expected a folder of BraTS case folders, but it is not a folder")
    folders = case_folders(root)
    if not folders:
        raise DataError(f"{display_path(root)}: no case folders; expected <case>/<case>{layout.separator}"
                        f"{layout.modalities[0]}.nii.gz ... ({layout.title})")
    cases = [brats_case(folder, layout) for folder in folders]
    sidecar = root / INSTITUTIONS_FILE
    if sidecar.is_file():
        institution_of = institutions_from(sidecar, [c.case_id for c in cases])
        cases = [Case(c.case_id, c.image, c.label, institution_of.get(c.case_id), None, c.modalities, c.layout)
                 for c in cases]
    extra = {}
    marker = root / PHANTOMS_MARKER
    if marker.is_file():
        try:
            extra["phantoms"] = json.loads(marker.read_text())
        except (OSError, ValueError):
            raise DataError(f"{display_path(marker)}: unreadable phantom settings; expected the JSON "
                            "`fedpate data phantoms --layout` writes (delete it if the folder is not phantoms)") from None
    return MSDDataset(root=root, training=[c for c in cases if c.label is not None],
                      test=[c for c in cases if c.label is None],
                      labels=dict(LABELS), modalities={str(i): m for i, m in enumerate(MODALITIES)},
                      name=root.name, extra=extra, layout=layout.name)


def read_brats_case(folder: str | os.PathLike, layout: str | Layout) -> MSDDataset:
    """One BraTS case folder given by itself (``X/X-t2f.nii.gz ...``), as a dataset of that one case: what
    ``fedpate predict`` accepts, ``data inspect``, ``data prepare``, ``data gallery`` and ``evaluate`` accept too."""
    folder = Path(folder)
    layout = get_layout(layout)
    case = brats_case(folder, layout)
    return MSDDataset(root=folder, training=[case] if case.label is not None else [],
                      test=[] if case.label is not None else [case],
                      labels=dict(LABELS), modalities={str(i): m for i, m in enumerate(MODALITIES)},
                      name=folder.name, extra={}, layout=layout.name)


def fingerprint(dataset: MSDDataset) -> str:
    """What the prepared cache is keyed on for a BraTS folder (it has no dataset.json): the layout, every
    file's name, size and modification time, and the institutions file. A folder rewritten in another layout
    gets a new key (it is re-prepared, and gives the same arrays: tests/test_data_brats.py)."""
    digest = hashlib.sha256(dataset.layout.encode())
    for case in dataset.training + dataset.test:
        for path in (*case.modalities, *([case.label] if case.label else [])):
            stat = path.stat()
            digest.update(f"{path.parent.name}/{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    sidecar = dataset.root / INSTITUTIONS_FILE
    if sidecar.is_file():
        digest.update(sidecar.read_bytes())
    return digest.hexdigest()[:16]


def _nifti_gz(data: np.ndarray, affine: np.ndarray, header=None) -> bytes:
    image = nib.Nifti1Image(data, affine, header=header)
    image.set_qform(affine, code=1)
    image.set_sform(affine, code=1)
    image.header.set_xyzt_units("mm", "sec")
    return gzip.compress(image.to_bytes(), compresslevel=1, mtime=0)   # same inputs, same bytes


def write_case(out: Path, case_id: str, image: np.ndarray, label: np.ndarray | None, affine: np.ndarray,
               layout: str | Layout, dtype=None) -> Path:
    """Write one case (image (X, Y, Z, 4) in our channel order, label in our classes) as a BraTS case folder.

    The ``seg`` file is written last, so a folder with it is complete; returns the case folder.

    Args:
        out: the dataset folder the case folder ``out/<case_id>`` is written into.
        case_id: the case's id (its folder's and files' names).
        image: (X, Y, Z, 4) modalities in our channel order, one NIfTI file each.
        label: (X, Y, Z) label map in our classes, converted to the layout's codes
            (:func:`task.data.layouts.from_ours`); None = an unlabelled case (no ``seg`` file).
        affine: the voxel-to-world affine of every file.
        layout: the BraTS layout (a name or :class:`task.data.layouts.Layout`): file names and label codes.
        dtype: the modalities' stored dtype (None = the image's own, so that reading them back gives the same
            array).
    """
    layout = get_layout(layout)
    folder = Path(out) / case_id
    folder.mkdir(parents=True, exist_ok=True)
    for channel in range(len(layout.modalities)):
        data = image[..., channel] if dtype is None else image[..., channel].astype(dtype)
        atomic_write_bytes(layout.modality_file(folder, case_id, channel), _nifti_gz(np.asarray(data), affine))
    if label is not None:
        atomic_write_bytes(layout.seg_file(folder, case_id), _nifti_gz(from_ours(label, layout), affine))
    return folder


def write_institutions(out: Path, institutions: dict[str, str]) -> None:
    """The FeTS-style ``partitioning_1.csv`` naming each case's institution (read back by :func:`read_brats`)."""
    lines = ["Partition_ID,Subject_ID"] + [f"{inst},{cid}" for cid, inst in institutions.items()]
    atomic_write_text(Path(out) / INSTITUTIONS_FILE, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------- skull-stripping check
#: a skull-stripped scan (as MSD and BraTS distribute them) has zero background: non-zero voxels on more
#: than this fraction of the volume's outer faces mean skull, scalp or noise around the head
BORDER_FRACTION = 0.05


def border_fraction(volume: np.ndarray) -> float:
    """Fraction of the voxels on the 6 outer faces of a 3D volume that are non-zero."""
    volume = np.asarray(volume)
    faces = [volume[0], volume[-1], volume[:, 0], volume[:, -1], volume[:, :, 0], volume[:, :, -1]]
    return float(sum(np.count_nonzero(f) for f in faces) / sum(f.size for f in faces))


def skull_strip_warnings(case: Case, image: np.ndarray) -> list[str]:
    """One line per modality whose background is not zero at the volume's border (a warning: the scan may
    still be usable, but preprocessing crops to the non-zero voxels, so it would keep the whole head)."""
    warnings = []
    for channel in range(image.shape[-1]):
        fraction = border_fraction(image[..., channel])
        if fraction > BORDER_FRACTION:
            where = display_path(case.modalities[channel]) if case.modalities else \
                f"{display_path(case.image)} channel {channel} ({CHANNELS[channel]})"
            warnings.append(f"warning: {where}: {fraction:.0%} of the border voxels are non-zero; expected a "
                            "skull-stripped scan with zero background (as BraTS distributes them)")
    return warnings



# ---------------------------------------------------------------------------------- MSD folder -> BraTS
#: marker a converted phantom folder carries (hidden, so it is no case folder): the generator's settings, read
#: back into ``extra["phantoms"]`` so model cards and reports describe the phantoms as the MSD layout does
PHANTOMS_MARKER = ".phantoms.json"


def convert_msd_folder(src: str | os.PathLike, out: str | os.PathLike, layout: str | Layout,
                       progress: bool = False) -> Path:
    """Write every case of the MSD folder ``src`` as BraTS case folders under ``out`` in ``layout``.

    Why: the phantoms exist in the MSD layout; converting them (same voxels, same dtype, same affine; labels
    through :func:`task.data.layouts.from_ours`) gives the same phantoms in every layout, so the BraTS path is
    tested end to end against the MSD one. Institutions go to ``partitioning_1.csv`` and the phantom settings
    to :data:`PHANTOMS_MARKER`, both written last.
    """
    layout = get_layout(layout)
    dataset = read_msd(src)
    out = Path(out)
    for case in dataset.training + dataset.test:
        image = nib.load(str(case.image))
        data = np.asanyarray(image.dataobj)
        if data.ndim != 4 or data.shape[3] != len(CHANNELS):
            raise DataError(f"{display_path(case.image)}: expected a 4D image with {len(CHANNELS)} channels to convert")
        affine = np.asarray(image.affine, dtype=np.float64)
        label = None if case.label is None else load_label(case.label, data.shape, affine, case.image)
        write_case(out, case.case_id, data, label, affine, layout)
    institutions = {c.case_id: c.institution for c in dataset.training if c.institution is not None}
    if institutions:
        write_institutions(out, institutions)
    if isinstance(dataset.extra.get("phantoms"), dict):
        atomic_write_text(out / PHANTOMS_MARKER, json.dumps({**dataset.extra["phantoms"], "layout": layout.name},
                                                            sort_keys=True))
    return out
