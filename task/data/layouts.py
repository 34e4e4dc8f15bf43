"""The one table of dataset layouts: which file holds which modality, and what each label code means.

Why one table: every BraTS release since 2018 ships one NIfTI per modality and its own label codes, and the
codes disagree (BraTS 2021 calls enhancing tumour 4, BraTS 2023 calls it 3, MSD Task01 calls oedema 1 where
BraTS calls it 2). A mapping written by hand in two places drifts, and a swapped code silently turns "tumour
core" into "oedema" in every Dice score. So readers, writers, ``predict`` and ``evaluate`` all convert through
:func:`to_ours` / :func:`from_ours` here, and nowhere else.

Our convention (MSD Task01): channels (FLAIR, T1, T1-Gd, T2); labels 0 background,
1 oedema, 2 necrotic / non-enhancing core, 3 enhancing; regions WT = {1, 2, 3}, TC = {2, 3}, ET = {3} -- what
BraTS means by whole tumour, tumour core (NCR + ET) and enhancing tumour.

=============  ==========================================  ==========================
layout         case folder files                           labels -> ours
=============  ==========================================  ==========================
msd            ``imagesTr/X.nii.gz`` 4D, ``labelsTr/X``    1->1, 2->2, 3->3
brats2021      ``X/X_{flair,t1,t1ce,t2,seg}.nii.gz``       2->1, 1->2, 4->3
brats2023      ``X/X-{t2f,t1n,t1c,t2w,seg}.nii.gz``        2->1, 1->2, 3->3
=============  ==========================================  ==========================

This module only looks at names and converts arrays (numpy); reading files is ``task.data.msd`` /
``task.data.brats``, choosing a reader ``task.data.reader.read_dataset``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from task.data.errors import DataError

#: our channel order (the MSD 4D image's last axis), the order every layout's modality files are stacked in
CHANNELS = ("FLAIR", "T1", "T1-Gd", "T2")
#: our label classes
CLASSES = {0: "background", 1: "oedema", 2: "necrotic / non-enhancing core", 3: "enhancing"}
NIFTI_SUFFIXES = (".nii.gz", ".nii")


class LayoutName(StrEnum):
    """The releases a dataset folder may follow (``--layout``; the keys of :data:`LAYOUTS`)."""
    MSD = "msd"               # MSD Task01: one 4D image per case, our label codes
    BRATS2021 = "brats2021"   # BraTS 2021 / FeTS 2022 case folders
    BRATS2023 = "brats2023"   # BraTS 2023+ case folders


@dataclass(frozen=True)
class Layout:
    """How one release stores a case.

    ``modalities``: file suffix per channel, in :data:`CHANNELS` order (empty for the 4D MSD image);
    ``separator``: between case id and suffix (``X_flair`` / ``X-t2f``); ``labels``: the release's code ->
    our class (background 0 -> 0 included); ``names``: the release's own name of each code.
    """

    name: LayoutName
    title: str
    modalities: tuple[str, ...]
    separator: str
    labels: dict
    names: dict
    seg: str = "seg"

    @property
    def per_modality(self) -> bool:
        return bool(self.modalities)

    @property
    def inverse(self) -> dict:
        """Our class -> the release's code (for writing label maps in its convention)."""
        return {ours: code for code, ours in self.labels.items()}

    def codes_text(self) -> str:
        return ", ".join(f"{code} {self.names[code]}" for code in sorted(self.labels))

    def modality_file(self, case_dir: Path, case_id: str, channel: int) -> Path:
        return Path(case_dir) / f"{case_id}{self.separator}{self.modalities[channel]}.nii.gz"

    def seg_file(self, case_dir: Path, case_id: str) -> Path:
        return Path(case_dir) / f"{case_id}{self.separator}{self.seg}.nii.gz"


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout(LayoutName.MSD, "MSD Task01 (BraTS 2016-17)", (), "",
           {0: 0, 1: 1, 2: 2, 3: 3},
           {0: "background", 1: "edema", 2: "non-enhancing tumour", 3: "enhancing tumour"}),
    Layout(LayoutName.BRATS2021, "BraTS 2021 / FeTS 2022", ("flair", "t1", "t1ce", "t2"), "_",
           {0: 0, 2: 1, 1: 2, 4: 3},
           {0: "background", 1: "NCR/NET", 2: "ED", 4: "ET"}),
    Layout(LayoutName.BRATS2023, "BraTS 2023+ (GLI, MEN, METS, PED, SSA)", ("t2f", "t1n", "t1c", "t2w"), "-",
           {0: 0, 2: 1, 1: 2, 3: 3},
           {0: "background", 1: "NCR", 2: "ED", 3: "ET"}),
)}
LAYOUT_NAMES = tuple(LAYOUTS)
#: the ``kind`` of a generated phantom collection's source description (a dataset folder's kind is its layout's
#: name; ``task.data.preprocess.describe_source``)
PHANTOMS_SOURCE = "phantoms"


def get_layout(name: str | None, option: str = "--layout") -> Layout:
    """The layout called ``name``; a one-line DataError naming the option otherwise."""
    if isinstance(name, Layout):
        return name
    try:
        return LAYOUTS[str(name).lower()]
    except KeyError:
        raise DataError(f"{option}={name}: unknown layout; expected one of {', '.join(LAYOUT_NAMES)}") from None


def _lookup(table: dict, values: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Map integer ``values`` through ``table``; returns (mapped uint8, sorted values the table lacks)."""
    values = np.asarray(values)
    present = np.unique(values)
    unknown = [int(v) for v in present if int(v) not in table]
    out = np.zeros(values.shape, np.uint8)
    for code in present:
        if int(code) in table:
            out[values == code] = table[int(code)]
    return out, unknown


def to_ours(labels: np.ndarray, layout: str | Layout, where: str = "labels") -> np.ndarray:
    """A label map in ``layout``'s codes -> ours (uint8). Unknown codes are a one-line DataError naming
    ``where`` and the codes the layout has (e.g. a BraTS 2021 map read as BraTS 2023 shows its 4s)."""
    layout = get_layout(layout)
    out, unknown = _lookup(layout.labels, labels)
    if unknown:
        raise DataError(f"{where}: label values {unknown[:5]} unknown to the {layout.name} layout; expected "
                        f"{layout.codes_text()}" + _hint(unknown, layout))
    return out


def from_ours(labels: np.ndarray, layout: str | Layout) -> np.ndarray:
    """Our label map (0..3) -> ``layout``'s codes (uint8), for writing files in a release's convention."""
    layout = get_layout(layout)
    out, unknown = _lookup(layout.inverse, labels)
    if unknown:
        raise DataError(f"labels: values {unknown[:5]} are not our classes 0..3")
    return out


def _hint(unknown: list[int], layout: Layout) -> str:
    others = [other.name for other in LAYOUTS.values() if other is not layout and set(unknown) <= set(other.labels)]
    return f" (the codes of {' / '.join(others)}: pass --layout?)" if others else ""


# ------------------------------------------------------------------------------------------ detection
def strip_nifti(name: str) -> str | None:
    for suffix in NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def split_modality_name(path: str | os.PathLike) -> tuple[str, Layout, int | None] | None:
    """(case id, layout, channel or None for ``seg``) when ``path`` is named like one BraTS file, else None.

    ``BraTS2021_00000_t1ce.nii.gz`` -> (``BraTS2021_00000``, brats2021, 2);
    ``BraTS-GLI-00000-000-seg.nii.gz`` -> (``BraTS-GLI-00000-000``, brats2023, None).
    """
    stem = strip_nifti(Path(path).name)
    if stem is None:
        return None
    for layout in LAYOUTS.values():
        if not layout.per_modality:
            continue
        for channel, suffix in [*enumerate(layout.modalities), (None, layout.seg)]:
            tail = f"{layout.separator}{suffix}"
            if stem.endswith(tail) and len(stem) > len(tail):
                return stem[: -len(tail)], layout, channel
    return None


def case_folder_layout(folder: str | os.PathLike) -> Layout | None:
    """The BraTS layout of one case folder ``X/`` (files ``X_flair...`` or ``X-t2f...``), else None."""
    folder = Path(folder)
    if not folder.is_dir() or folder.name.startswith("."):
        return None
    for layout in LAYOUTS.values():
        if layout.per_modality and any(layout.modality_file(folder, folder.name, c).is_file()
                                       or layout.seg_file(folder, folder.name).is_file()
                                       for c in range(len(layout.modalities))):
            return layout
    return None


def detect_layout(root: str | os.PathLike) -> Layout:
    """MSD (``dataset.json`` or ``imagesTr/``), BraTS 2021 or BraTS 2023 (case folders named by their files).

    Why detect: a user passes ``--data`` with whatever they downloaded; asking them to name its release is a
    chance to get it wrong. A folder mixing both BraTS namings is refused (one convention per dataset), and
    an unrecognisable folder is a one-line DataError saying what was looked for. ``--layout`` overrides.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: expected a data folder (MSD Task01 or BraTS case folders), but it is not a folder")
    if (root / "dataset.json").is_file() or (root / "imagesTr").is_dir():
        return LAYOUTS[LayoutName.MSD]
    found: dict[str, str] = {}
    for folder in sorted(root.iterdir()):
        layout = case_folder_layout(folder)
        if layout is not None:
            found.setdefault(layout.name, folder.name)
    if len(found) > 1:
        raise DataError(f"{root}: case folders in two BraTS namings ({', '.join(f'{k}: {v}/' for k, v in found.items())}); "
                        "expected one layout per dataset")
    if found:
        return LAYOUTS[next(iter(found))]
    if case_folder_layout(root) is not None:
        raise DataError(f"{root}: is one BraTS case folder; expected the folder that holds the case folders")
    raise DataError(f"{root}: no dataset.json and no BraTS case folders (X/X_flair.nii.gz ... or "
                    "X/X-t2f.nii.gz ...); expected an MSD Task01 or BraTS folder as distributed")
