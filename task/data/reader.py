"""One entry for every data folder a user gives (``--data``, ``data inspect|prepare``, ``evaluate``).

:func:`read_dataset` detects the layout (``task.data.layouts.detect_layout``; ``layout`` overrides) and returns
the same :class:`~task.data.msd.MSDDataset` whichever release the folder is, so preprocessing, the world and
the comparison never need to know it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from task.data.brats import fingerprint as brats_fingerprint, read_brats, read_brats_case
from task.data.errors import DataError
from task.data.layouts import case_folder_layout, detect_layout, get_layout
from task.data.msd import MSDDataset, display_path, read_msd


def read_dataset(root: str | os.PathLike, layout: str | None = None) -> MSDDataset:
    """The dataset at ``root`` in ``layout`` (``msd``, ``brats2021``, ``brats2023``; None = detect): a folder of
    cases, or one BraTS case folder by itself (a dataset of that case, as ``fedpate predict`` reads it)."""
    lone = case_folder_layout(root)
    if lone is not None and (not layout or get_layout(layout) is lone):
        return read_brats_case(root, lone)
    chosen = get_layout(layout) if layout else detect_layout(root)
    if chosen.per_modality:
        return read_brats(root, chosen)
    return read_msd(root)


def require_labels(dataset: MSDDataset, purpose: str) -> MSDDataset:
    """Refuse a BraTS folder in which some case has no ``seg`` file when labels are needed (training,
    evaluation): a one-line DataError naming the case and the missing file. Why: in a BraTS download a case
    without seg is a validation case or a lost file, and silently training without it would hide either.
    (An MSD folder's unlabelled scans live apart, in imagesTs, and stay allowed.)"""
    if get_layout(dataset.layout).per_modality and dataset.test:
        case = dataset.test[0]
        layout = get_layout(dataset.layout)
        more = f" (and {len(dataset.test) - 1} more case(s))" if len(dataset.test) > 1 else ""
        raise DataError(f"{display_path(layout.seg_file(case.image, case.case_id))}: missing label map of case "
                        f"{case.case_id}{more}; labels are needed to {purpose} (unlabelled cases are for "
                        "`fedpate predict`)")
    if not dataset.training:
        raise DataError(f"{display_path(dataset.root)}: no labelled cases; labels are needed to {purpose}")
    return dataset


def dataset_fingerprint(dataset: MSDDataset) -> str:
    """What a prepared cache is keyed on: dataset.json's bytes for MSD (as before), the files for BraTS."""
    if not get_layout(dataset.layout).per_modality:
        return hashlib.sha256((Path(dataset.root) / "dataset.json").read_bytes()).hexdigest()[:16]
    return brats_fingerprint(dataset)
