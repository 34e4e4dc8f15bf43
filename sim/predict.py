"""Segment new scans with a saved model bundle (``fedpate predict``; SPEC section 10, issue 10).

For each 4D NIfTI scan (x, y, z, 4 channels in MSD order): crop to the brain, normalise and resample
exactly as in training (the bundle's preprocessing record), run the network (MONAI sliding-window
inference, a single window when the working grid covers the cropped brain), map the probabilities back
to the scan's own grid, and write a label map (MSD labels 0-3) with the scan's shape and affine, so
ITK-SNAP or 3D Slicer overlays it on the scan.

Device and precision (issue 30, ``sim.device``): the network runs on ``device`` (auto = CUDA when there is one),
under bf16 autocast with ``precision="bf16"``; preprocessing and the mapping back stay on the host (numpy).
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import nibabel as nib
import numpy as np
import torch
from tqdm import tqdm

from sim.bundle import load_bundle
from sim.data.msd import load_case, read_msd
from sim.data.preprocess import PreprocessConfig, brain_mask, invert_probs, preprocess_case
from sim.device import autocast, model_device, resolve_device
from sim.errors import UserError
from sim.io import atomic_write_bytes
from sim.metrics import per_case_dice, summarise

CLASS_NAMES = {1: "oedema", 2: "non-enhancing core", 3: "enhancing"}


@dataclass
class Prediction:
    scan: Path
    output: Path
    volumes_ml: dict[int, float]

    def summary(self) -> str:
        parts = ", ".join(f"{CLASS_NAMES[c]} {v:.1f} ml" for c, v in self.volumes_ml.items())
        total = sum(self.volumes_ml.values())
        return f"{self.scan.name} -> {self.output}: tumour {total:.1f} ml ({parts})"


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
    paths: list[Path] = []
    for item in images:
        item = Path(item)
        if item.is_dir():
            for sub in ("imagesTs", "imagesTr", "."):
                found = sorted((item / sub).glob("*.nii*"))
                if found:
                    paths += found
                    break
            else:
                raise UserError(f"--image {item}: folder has no .nii/.nii.gz scans (looked in imagesTs, imagesTr)")
        else:
            paths.append(item)
    if not paths:
        raise UserError("--image: no scans given")
    return paths


def _bundle_model(model_dir: str | Path, device):
    """(bundle, preprocessing config, network on ``device``) of a verified bundle."""
    device = resolve_device(device)

    bundle = load_bundle(model_dir)
    # bundles made before anti-aliasing existed carry no "antialias" key: from_dict repeats their preprocessing
    config = PreprocessConfig.from_dict(bundle.preprocessing["config"]) if "config" in bundle.preprocessing else \
        PreprocessConfig(grid=tuple(bundle.preprocessing["grid"]), antialias=False)
    return bundle, config, bundle.model.to(device).eval()


def segment_scan(model, config, data: np.ndarray, affine: np.ndarray, device=None,
                 precision: str = "32") -> np.ndarray:
    """Label map (uint8, MSD labels 0-3) of one scan (x, y, z, 4) in the scan's own grid. ``device``: where the
    network runs (None: where the model is); ``precision`` "bf16": its forward pass under autocast."""
    # MONAI (~10 s to import) only when a scan is segmented
    from monai.inferers import sliding_window_inference

    device = model_device(model) if device is None else resolve_device(device)
    image_grid, _, record = preprocess_case(data, None, affine, config)
    with torch.no_grad():
        x = torch.as_tensor(image_grid[None], dtype=torch.float32, device=device)
        with autocast(device, precision):
            logits = sliding_window_inference(x, roi_size=tuple(config.grid), sw_batch_size=1, predictor=model,
                                              overlap=0.25)
        probs = torch.softmax(logits.float(), dim=1)[0].cpu().numpy()
    # Resample probabilities (not labels) back to the scan grid, then take the argmax there:
    # smoother boundaries than nearest-neighbour upsampling of a coarse label map.
    labels = np.argmax(invert_probs(probs, record), axis=0).astype(np.uint8)
    # Tumour lies inside the brain: MSD/BraTS scans are skull-stripped with zero background, and the brain is
    # the voxels where any channel is non-zero (brain_mask, as preprocessing crops and normalises). Without this
    # rule the coarse grid's smooth probabilities spill into the zero background at the brain's edge (about 2 ml per
    # scan on Slicer's real scans; docs/GENERALISATION.md).
    labels[~brain_mask(data)] = 0
    return labels


def predict_scans(model_dir: str | Path, images: Sequence[str | Path], out_dir: str | Path,
                  progress: bool = True, device="auto", precision: str = "32") -> list[Prediction]:
    """Segment each scan with the bundle in ``model_dir``; returns one :class:`Prediction` per scan.

    Every output is written atomically as soon as it is ready, so an error on a later scan loses
    nothing already written.
    """
    _, config, model = _bundle_model(model_dir, device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = scan_paths(images)
    results: list[Prediction] = []
    iterator: Iterable[Path] = paths
    if progress:
        iterator = tqdm(paths, desc="predict", unit="scan")
    for path in iterator:
        data, affine, header = load_scan(path)
        labels = segment_scan(model, config, data, affine, device, precision)
        output = out_dir / _output_name(path)
        _write_label_map(output, labels, affine, header)
        results.append(Prediction(scan=path, output=output, volumes_ml=_volumes_ml(labels, affine)))
    return results


def _volumes_ml(labels: np.ndarray, affine: np.ndarray) -> dict[int, float]:
    voxel_ml = abs(np.linalg.det(affine[:3, :3])) / 1000.0
    return {c: float((labels == c).sum() * voxel_ml) for c in (1, 2, 3)}


def evaluate_scans(model_dir: str | Path, data_dir: str | Path, out_dir: str | Path | None = None,
                   progress: bool = True, device="auto", limit: int | None = None, precision: str = "32") -> dict:
    """Dice of the bundle's segmentations of every labelled case of an MSD-layout folder, in each scan's grid.

    Scores what a user of ``fedpate predict`` gets (preprocessing, network, mapping back to the scan), not
    the working-grid Dice of training. Returns ``{"dice": summary, "cases": [per-case rows]}`` with
    :func:`sim.metrics.summarise`'s keys; ``out_dir`` also receives each label map.
    """

    _, config, model = _bundle_model(model_dir, device)
    cases = read_msd(data_dir).training[:limit]
    if not cases:
        raise UserError(f"--data {data_dir}: no labelled cases (imagesTr with labelsTr) to evaluate")
    iterator: Iterable = cases
    if progress:
        iterator = tqdm(cases, desc="evaluate", unit="scan")
    class_rows, region_rows, rows = [], [], []
    for case in iterator:
        image, truth, affine = load_case(case)
        labels = segment_scan(model, config, image, affine, device, precision)
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            _write_label_map(Path(out_dir) / f"{case.case_id}_seg.nii.gz", labels, affine,
                             nib.load(str(case.label)).header)
        class_dice, region_dice = per_case_dice(labels[None], np.asarray(truth)[None])
        class_rows.append(class_dice[0]), region_rows.append(region_dice[0])
        rows.append({"case": case.case_id, "institution": case.institution,
                     **summarise(class_dice, region_dice),
                     "volume_ml": sum(_volumes_ml(labels, affine).values()),
                     "true_volume_ml": sum(_volumes_ml(np.asarray(truth), affine).values())})
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
