"""Segment new scans with a saved model bundle (``fedpate predict``).

For each scan -- a 4D NIfTI (x, y, z, 4 channels in MSD order), or a BraTS case as distributed (its folder,
or its four per-modality files) -- crop to the brain, normalise and resample exactly as in training
(the bundle's preprocessing record), run the network (MONAI sliding-window inference, a single window when
the working grid covers the cropped brain), map the probabilities back to the scan's own grid, and write a
label map with the scan's shape and affine, so ITK-SNAP or 3D Slicer overlays it on the scan. The label codes
are the convention asked for (``labels``: msd, brats2021, brats2023), by default the input's own: a BraTS 2021
case gets 4 for enhancing tumour, as its own ``seg`` files do (``task.data.layouts``, the one mapping table).

Device and precision (``task.learning.device``): the network runs on ``device`` (auto = CUDA when there is one),
under bf16 autocast with ``precision="bf16"``; preprocessing and the mapping back stay on the host (numpy).
"""

from __future__ import annotations

import gzip
import sys
import zlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterable, Sequence

import nibabel as nib
import numpy as np
import torch
from tqdm import tqdm

from task.reporting.bundle import load_bundle
from task.data.brats import skull_strip_warnings
from task.data.layouts import CHANNELS, case_folder_layout, detect_layout, from_ours, get_layout, split_modality_name
from task.data.msd import Case, display_path, load_case, load_modalities
from task.data.reader import read_dataset, require_labels
from task.data.preprocess import PreprocessConfig, brain_mask, crop_box, preprocess_case, probs_in_crop
from task.learning.compute import Compute, check_compute
from task.learning.device import autocast, model_device, resolve_device
from task.errors import UserError
from task.learning.inference import mirrored_probabilities
from task.io import atomic_write_bytes
from task.learning.metrics import class_volumes_ml, per_case_dice, summarise

CLASS_NAMES = {1: "oedema", 2: "non-enhancing core", 3: "enhancing"}


@dataclass
class Prediction:
    scan: Path
    output: Path
    volumes_ml: dict[int, float]
    labels: str = "msd"               # the label convention written (task.data.layouts)
    warnings: list[str] = field(default_factory=list)   # the scan's data checks (as `fedpate data inspect`)

    def summary(self) -> str:
        parts = ", ".join(f"{CLASS_NAMES[c]} {v:.1f} ml" for c, v in self.volumes_ml.items())
        total = sum(self.volumes_ml.values())
        note = ("; UNRELIABLE: the scan does not look skull-stripped (warning above), and the model was "
                "trained on skull-stripped scans" if self.warnings else "")
        return f"{self.scan.name} -> {self.output}: tumour {total:.1f} ml ({parts}; {self.labels} label codes{note})"


@dataclass(frozen=True)
class ScanInput:
    """One scan to segment: a 4D file (``files`` has one path, ``layout`` msd), or a BraTS case's four
    modality files in our channel order (``layout`` its release). ``scan``: what names it (file or folder)."""

    name: str
    scan: Path
    files: tuple
    layout: str = "msd"


def load_scan(path: str | Path):
    """Read one scan; one-line UserError naming the file for anything a user could have got wrong."""

    path = Path(path)
    if not path.is_file():
        raise UserError(f"--image {path}: file not found")
    try:
        img = nib.load(str(path))
        data = np.asarray(img.dataobj, dtype=np.float32)
    except (OSError, EOFError, zlib.error, gzip.BadGzipFile, ValueError, nib.filebasedimages.ImageFileError) as exc:
        raise UserError(f"--image {path}: not a readable NIfTI file ({exc.__class__.__name__}: {str(exc)[:80]})") from None
    if data.ndim != 4:
        raise UserError(f"--image {path}: expected a 4D image (x, y, z, 4 modalities), got {data.ndim}D shape {data.shape}")
    if data.shape[3] != 4:
        raise UserError(f"--image {path}: expected 4 channels (FLAIR, T1w, t1gd, T2w), got {data.shape[3]}")
    if not np.isfinite(data).all():
        raise UserError(f"--image {path}: contains non-finite voxels (NaN or inf)")
    affine = np.asarray(img.affine, dtype=np.float64)
    if not np.isfinite(affine).all() or abs(np.linalg.det(affine[:3, :3])) < 1e-9:
        raise UserError(f"--image {path}: the affine is not invertible")
    if not (np.abs(data).sum(axis=3) > 0).any():
        raise UserError(f"--image {path}: the image is empty (no brain voxels)")
    return data, affine, img.header


def scan_paths(images: Sequence[str | Path]) -> list[Path]:
    """Expand ``--image`` arguments: files, or an MSD-layout folder (its imagesTs, else imagesTr)."""
    return [scan.scan for scan in scan_inputs(images)]


def _brats_case_input(folder: Path, layout) -> ScanInput:
    files = []
    for channel in range(len(CHANNELS)):
        path = layout.modality_file(folder, folder.name, channel)
        if not path.is_file():
            raise UserError(f"--image {path}: missing {CHANNELS[channel]} file of case {folder.name}; expected "
                            f"{folder.name}{layout.separator}{{{','.join(layout.modalities)}}}.nii.gz ({layout.title})")
        files.append(path)
    return ScanInput(folder.name, folder, tuple(files), layout.name)


def scan_inputs(images: Sequence[str | Path]) -> list[ScanInput]:
    """Expand ``--image`` arguments into scans: a 4D file; a BraTS case folder; a BraTS case's four modality
    files (given together, in any order); a folder of BraTS case folders (every case); an MSD-layout folder
    (its imagesTs, else imagesTr). A BraTS case missing a modality, or a ``seg`` file given as a scan, is a
    one-line UserError naming the case and the file."""
    scans: list[ScanInput] = []
    groups: dict[tuple, dict[int, Path]] = {}
    for item in images:
        item = Path(item)
        if item.is_dir():
            layout = case_folder_layout(item)
            if layout is not None:
                scans.append(_brats_case_input(item, layout))
                continue
            try:
                found_layout = detect_layout(item)
            except UserError:
                found_layout = None
            if found_layout is not None and found_layout.per_modality:
                dataset = read_dataset(item, found_layout.name)
                scans += [ScanInput(c.case_id, c.image, tuple(c.modalities), c.layout)
                          for c in dataset.training + dataset.test]
                continue
            for sub in ("imagesTs", "imagesTr", "."):
                found = sorted((item / sub).glob("*.nii*"))
                if found:
                    scans += [ScanInput(p.name, p, (p,)) for p in found]
                    break
            else:
                raise UserError(f"--image {item}: folder has no .nii/.nii.gz scans (looked in imagesTs, imagesTr, "
                                "and for BraTS case folders)")
            continue
        parsed = split_modality_name(item)
        if parsed is None:
            scans.append(ScanInput(item.name, item, (item,)))
            continue
        case_id, layout, channel = parsed
        if channel is None:
            raise UserError(f"--image {item}: is the label map (seg) of case {case_id}, not a scan; expected its "
                            f"four modality files ({', '.join(layout.modalities)}) or its folder")
        key = (str(item.parent), case_id, layout.name)
        if key not in groups:
            groups[key] = {}
            scans.append(ScanInput(case_id, item.parent / case_id, (), layout.name))   # placeholder: keeps order
        groups[key][channel] = item
    for index, scan in enumerate(scans):
        if scan.files:
            continue
        layout = get_layout(scan.layout)
        given = groups[(str(scan.scan.parent), scan.name, scan.layout)]
        missing = [c for c in range(len(CHANNELS)) if c not in given]
        if missing:
            absent = layout.modality_file(scan.scan.parent, scan.name, missing[0])
            raise UserError(f"--image: case {scan.name} lacks its {CHANNELS[missing[0]]} file ({absent.name}); "
                            f"expected all four modality files ({', '.join(layout.modalities)}) or the case folder")
        scans[index] = ScanInput(scan.name, given[0], tuple(given[c] for c in range(len(CHANNELS))), scan.layout)
    if not scans:
        raise UserError("--image: no scans given")
    return scans


def load_scan_input(scan: ScanInput):
    """(image (x, y, z, 4) in our channel order, affine, header to copy) of one scan."""
    if len(scan.files) == 1:
        return load_scan(scan.files[0])
    for path in scan.files:
        if not Path(path).is_file():
            raise UserError(f"--image {path}: file not found (a modality of case {scan.name})")
    image, affine = load_modalities(scan.files, scan.name)
    return image, affine, nib.load(str(scan.files[0])).header


def resolve_labels(labels: str | None, layout: str) -> str:
    """The label convention to write: the one asked for, else the input's own (MSD for a 4D file)."""
    return get_layout(labels or layout, "--labels").name


def _bundle_model(model_dir: str | Path, device):
    """(bundle, preprocessing config, network on ``device``) of a verified bundle."""
    device = resolve_device(device)

    bundle = load_bundle(model_dir)
    return bundle, preprocess_config_of(bundle.preprocessing), bundle.model.to(device).eval()


def preprocess_config_of(preprocessing) -> PreprocessConfig:
    """The :class:`PreprocessConfig` a model was trained with, from its bundle's ``preprocessing`` record
    (``task.reporting.bundle.preprocessing_of``)."""
    # bundles made before anti-aliasing existed carry no "antialias" key: from_dict repeats their preprocessing
    if "config" in preprocessing:
        return PreprocessConfig.from_dict(preprocessing["config"])
    return PreprocessConfig(grid=tuple(preprocessing["grid"]), antialias=False)


def segment_scan(model, config, data: np.ndarray, affine: np.ndarray, device=None,
                 precision: str = "32", mirror: bool = True) -> np.ndarray:
    """Label map (uint8, MSD labels 0-3) of one scan (x, y, z, 4) in the scan's own grid.

    Args:
        model: the segmentation network (a bundle's).
        config: the bundle's :class:`task.data.preprocess.PreprocessConfig` (the working grid is the sliding
            window's size).
        data: the scan, (x, y, z, 4) in our channel order.
        affine: the scan's voxel-to-world affine.
        device: where the network runs (None: where the model is).
        precision: ``"bf16"``: its forward pass under autocast (``"32"`` = float32).
        mirror: test-time mirroring (``task.learning.inference``, nnU-Net's default); False = one pass.
    """
    image_grid, _, record = preprocess_case(data, None, affine, config)
    return segment_preprocessed(model, config, image_grid, record, brain_mask(data), device, precision, mirror)


def segment_preprocessed(model, config, image_grid: np.ndarray, record, brain: np.ndarray | None, device=None,
                         precision: str = "32", mirror: bool = True) -> np.ndarray:
    """:func:`segment_scan` from a scan already preprocessed. Why apart: the real-scan check
    (``task.reporting.realcheck``) preprocesses each case once and scores many models.

    Args:
        model: the segmentation network (a bundle's).
        config: the bundle's :class:`task.data.preprocess.PreprocessConfig`.
        image_grid: the preprocessed scan (4, *grid) (:func:`task.data.preprocess.preprocess_case`).
        record: its :class:`task.data.preprocess.PreprocessRecord` (maps the probabilities back).
        brain: the scan's :func:`brain_mask` in its own grid (no tumour outside it; None: the caller masks).
        device: where the network runs (None: where the model is).
        precision: ``"bf16"``: its forward pass under autocast (``"32"`` = float32).
        mirror: as :func:`segment_scan`.
    """
    # MONAI (~10 s to import) only when a scan is segmented
    from monai.inferers import sliding_window_inference

    device = model_device(model) if device is None else resolve_device(device)
    with torch.no_grad():
        x = torch.as_tensor(image_grid[None], dtype=torch.float32, device=device)
        # mirrored: each window's probabilities averaged over its mirrorings, then the windows blended
        predictor = partial(mirrored_probabilities, model) if mirror else model
        with autocast(device, precision):
            out = sliding_window_inference(x, roi_size=tuple(config.grid), sw_batch_size=1, predictor=predictor,
                                           overlap=0.25)
        probs = (out.float() if mirror else torch.softmax(out.float(), dim=1))[0].cpu().numpy()
    # Resample probabilities (not labels) back to the scan grid, then take the argmax there:
    # smoother boundaries than nearest-neighbour upsampling of a coarse label map. Outside the crop box every
    # voxel is background (invert_probs), so the argmax is taken inside it only.
    labels = np.zeros(record.original_shape, np.uint8)
    labels[crop_box(record)] = class_argmax(probs_in_crop(probs, record))
    # Tumour lies inside the brain: MSD/BraTS scans are skull-stripped with zero background, and the brain is
    # the voxels where any channel is non-zero (brain_mask, as preprocessing crops and normalises). Without this
    # rule the coarse grid's smooth probabilities spill into the zero background at the brain's edge (about 2 ml per
    # scan on Slicer's real scans; docs/GENERALISATION.md).
    if brain is not None:
        labels[~brain] = 0
    return labels


def class_argmax(probs: np.ndarray) -> np.ndarray:
    """``np.argmax(probs, axis=0)`` as uint8, the first maximum on ties, by comparing one class at a time:
    an argmax over the leading (class) axis of a scan-sized volume strides through memory and takes seconds
    (numpy and torch alike); this takes a few element-wise passes."""
    best = probs[0].copy()
    labels = np.zeros(best.shape, np.uint8)
    for index in range(1, len(probs)):
        higher = probs[index] > best      # strictly: an earlier class keeps a tie
        labels[higher] = index
        np.maximum(best, probs[index], out=best)
    return labels


def predict_scans(model_dir: str | Path, images: Sequence[str | Path], out_dir: str | Path,
                  progress: bool = True, device="auto", labels: str | None = None,
                  precision: str = "32", mirror: bool = True) -> list[Prediction]:
    """Segment each scan with the bundle in ``model_dir``; returns one :class:`Prediction` per scan.

    Every output is written atomically as soon as it is ready, so an error on a later scan loses nothing
    already written.

    Args:
        model_dir: a run folder (or its ``model`` subfolder) holding a verified bundle.
        images: ``--image`` arguments (:func:`scan_inputs`: 4D files, BraTS case folders or modality files,
            folders of cases, MSD-layout folders).
        out_dir: where the label maps are written (created when missing).
        progress: a progress bar.
        device: where the network runs (``task.learning.device``; default auto).
        labels: the label convention written (msd, brats2021, brats2023; default: each input's own, MSD for a
            4D file).
        precision: ``"bf16"``: the forward passes under autocast (``"32"`` = float32).
        mirror: test-time mirroring (``task.learning.inference``; False = one pass, 8 times faster).
    """
    if labels is not None:
        get_layout(labels, "--labels")
    _, config, model = _bundle_model(model_dir, device)
    out_dir = Path(out_dir)
    scans = scan_inputs(images)
    outputs = output_names(scans)   # refused before anything is segmented or written
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[Prediction] = []
    iterator: Iterable[ScanInput] = scans
    if progress:
        iterator = tqdm(scans, desc="predict", unit="scan")
    for scan, name in zip(iterator, outputs):
        data, affine, header = load_scan_input(scan)
        # the checks `fedpate data inspect` makes: a scan that is not skull-stripped is segmented, but said so
        warnings = skull_strip_warnings(_as_case(scan), data)
        for line in warnings:   # above the progress bar, not through it
            tqdm.write(line, file=sys.stderr)
        segmentation = segment_scan(model, config, data, affine, device, precision, mirror)
        convention = resolve_labels(labels, scan.layout)
        output = out_dir / name
        _write_label_map(output, from_ours(segmentation, convention), affine, header)
        results.append(Prediction(scan=scan.scan, output=output, volumes_ml=class_volumes_ml(segmentation, affine),
                                  labels=convention, warnings=warnings))
    return results


def _as_case(scan: ScanInput) -> Case:
    """The scan as the data checks name it: its 4D file, or its case folder and four modality files."""
    if len(scan.files) == 1:
        return Case(scan.name, Path(scan.files[0]))
    return Case(scan.name, scan.scan, modalities=tuple(scan.files), layout=scan.layout)


def output_names(scans: Sequence[ScanInput]) -> list[str]:
    """Each scan's label map's file name (``<scan>_seg.nii.gz``, or ``<case>_seg.nii.gz`` for a BraTS case).
    Two inputs that would write the same file (compared case-insensitively, as some file systems do) are a
    one-line UserError naming both: the later would silently replace the earlier."""
    names, seen = [], {}
    for scan in scans:
        # a 4D file is named by its file; a BraTS case (one file per modality) by its case
        name = f"{scan.name}_seg.nii.gz" if get_layout(scan.layout).per_modality else _output_name(scan.scan)
        earlier = seen.setdefault(name.casefold(), scan)
        if earlier is not scan:
            raise UserError(f"--image: {display_path(earlier.scan)} and {display_path(scan.scan)} would both write "
                            f"{name}; give them in separate runs with different --out folders")
        names.append(name)
    return names


@dataclass(frozen=True)
class EvaluationOptions:
    """How :func:`evaluate_scans` reads the folder, runs the network and writes label maps.

    Args:
        out_dir: also receives each label map (None = none written).
        layout: the folder's layout (``task.data.layouts``; None = detected).
        labels: the convention of the label maps written to ``out_dir`` (None = the folder's own).
        limit: score only the first ``limit`` labelled cases (None = all).
        compute: a progress bar (``progress``), where the network runs (``device``: ``task.learning.device``; default
            auto) and ``precision`` (``"bf16"``: the forward passes under autocast; ``"32"`` = float32) --
            :class:`task.learning.compute.Compute`.
        mirror: test-time mirroring (``task.learning.inference``; False = one pass).
    """

    out_dir: str | Path | None = None
    layout: str | None = None
    labels: str | None = None
    limit: int | None = None
    compute: Compute = Compute()
    mirror: bool = True

    def __post_init__(self) -> None:
        if self.layout:
            get_layout(self.layout, "--layout")
        if self.labels:
            get_layout(self.labels, "--labels")
        check_compute(self.compute)


def evaluate_scans(model_dir: str | Path, data_dir: str | Path,
                   options: EvaluationOptions = EvaluationOptions()) -> dict:
    """Dice of the bundle's segmentations of every labelled case of a data folder, in each scan's grid.

    The folder is MSD Task01 or BraTS; Dice is computed in our classes (WT, TC, ET as BraTS defines them)
    whatever the folder's codes. Scores what a user of ``fedpate predict`` gets (preprocessing, network,
    mapping back to the scan), not the working-grid Dice of training. Returns
    ``{"dice": summary, "cases": [per-case rows]}`` with :func:`task.learning.metrics.summarise`'s keys.

    Args:
        model_dir: a run folder (or its ``model`` subfolder) holding a verified bundle.
        data_dir: the MSD Task01 or BraTS folder whose labelled cases are scored.
        options: where label maps go, the folder's layout and their convention, how many cases, and how it
            computes: progress bar, device, precision (:class:`EvaluationOptions`).
    """
    out_dir, device, precision = options.out_dir, options.compute.device, options.compute.precision
    dataset = require_labels(read_dataset(data_dir, options.layout), "evaluate")
    convention = resolve_labels(options.labels, dataset.layout)
    _, config, model = _bundle_model(model_dir, device)
    cases = dataset.training[:options.limit]
    if not cases:
        raise UserError(f"--data {data_dir}: no labelled cases (imagesTr with labelsTr) to evaluate")
    iterator: Iterable = cases
    if options.compute.progress:
        iterator = tqdm(cases, desc="evaluate", unit="scan")
    class_rows, region_rows, rows = [], [], []
    for case in iterator:
        image, truth, affine = load_case(case)
        labels = segment_scan(model, config, image, affine, device, precision, options.mirror)
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            _write_label_map(Path(out_dir) / f"{case.case_id}_seg.nii.gz", from_ours(labels, convention), affine,
                             nib.load(str(case.label)).header)
        class_dice, region_dice = per_case_dice(labels[None], np.asarray(truth)[None])
        class_rows.append(class_dice[0]), region_rows.append(region_dice[0])
        rows.append({"case": case.case_id, "institution": case.institution,
                     **summarise(class_dice, region_dice),
                     "volume_ml": sum(class_volumes_ml(labels, affine).values()),
                     "true_volume_ml": sum(class_volumes_ml(np.asarray(truth), affine).values())})
    return {"dice": summarise(np.stack(class_rows), np.stack(region_rows)), "cases": rows}


def _output_name(scan: Path) -> str:
    name = scan.name
    for suffix in (".nii.gz", ".nii"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return f"{name}_seg.nii.gz"


def _write_label_map(path: Path, labels: np.ndarray, affine: np.ndarray, header) -> None:
    out_header = header.copy()
    out_header.set_data_dtype(np.uint8)
    image = nib.Nifti1Image(labels, affine, header=out_header)
    image.header.set_xyzt_units(*header.get_xyzt_units())
    # Write via bytes so the file appears atomically (no half-written .nii.gz if interrupted).
    buffer = image.to_bytes() if not str(path).endswith(".gz") else gzip.compress(image.to_bytes(), 6)
    atomic_write_bytes(path, buffer)
