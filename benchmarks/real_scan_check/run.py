"""Exploratory check on real tumour MRI: does a phantom-trained model find the tumour?

The only real brain-tumour MRI reachable from these machines' registries is 3D Slicer's MRBrainTumor1/2
(T1 post-contrast only, skull on, one lesion, threshold-style label) inside the qtim-tools 0.1.12 source
archive on PyPI. This script skull-strips them (nilearn's MNI152 brain placed with dipy, refined by
intensity; or, with ``--colin``, the Colin27 atlas from Debian's mricron-data alone), trains a T1-Gd-only
phantom model (the scans have no other sequence), segments the scans exactly as ``fedpate predict`` does
(:func:`task.reporting.predict.segment_scan`), and scores the result against the label. Nothing here downloads;
fetch the inputs first (see README.md in this folder).

Run: ``PYTHONPATH=/tmp/realcheck/site .venv/bin/python benchmarks/real_scan_check/run.py --qtim DIR --train CACHE``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SCANS = {  # name: (scan, label, label value) inside qtim_tools/test_data/test_data_features
    "MRBrainTumor2": ("MRBrainTumor2.nii.gz", "MRBrainTumor2-label.nii.gz", 1),
    "MRBrainTumor1": ("MR_Tumor_Size/MR_BrainTumor_SizeTest.nii.gz",
                      "MR_Tumor_Shape/MR_BrainTumor_ShapeTest-label.nii.gz", 9),
}


def skull_strip_colin(scan, colin_dir: Path):
    """Brain mask of ``scan``: Colin27 head registered (translation, rigid, affine; MI), ch2bet warped.

    The first method tried; it leaves skull-base tissue inside the mask (docs/GENERALISATION.md).
    """
    import nibabel as nib
    from dipy.align.imaffine import AffineRegistration, MutualInformationMetric, transform_centers_of_mass
    from dipy.align.transforms import AffineTransform3D, RigidTransform3D, TranslationTransform3D
    from scipy import ndimage

    head, bet = nib.load(colin_dir / "ch2.nii.gz"), nib.load(colin_dir / "ch2bet.nii.gz")
    static, static_affine = scan.get_fdata().astype(np.float32), scan.affine
    moving = head.get_fdata().astype(np.float32)
    start = transform_centers_of_mass(static, static_affine, moving, head.affine).affine
    registration = AffineRegistration(metric=MutualInformationMetric(32, 0.3), level_iters=[200, 50, 0],
                                      sigmas=[3, 1, 0], factors=[4, 2, 1])
    for transform in (TranslationTransform3D(), RigidTransform3D(), AffineTransform3D()):
        mapping = registration.optimize(static, moving, transform, None, static_affine, head.affine,
                                        starting_affine=start)
        start = mapping.affine
    brain = mapping.transform((bet.get_fdata() > 0).astype(np.float32), interpolation="linear") > 0.5
    return ndimage.binary_fill_holes(ndimage.binary_dilation(brain, iterations=2))


def _ball(radius_mm: float, zooms) -> np.ndarray:
    radii = [max(1, int(round(radius_mm / z))) for z in zooms]
    grid = np.ogrid[tuple(slice(-r, r + 1) for r in radii)]
    return sum((g / r) ** 2 for g, r in zip(grid, radii)) <= 1


def _otsu(values: np.ndarray) -> float:
    counts, edges = np.histogram(values, 256)
    centres = (edges[:-1] + edges[1:]) / 2
    below, weighted = np.cumsum(counts), np.cumsum(counts * centres)
    n_low, n_high = below[:-1], below[-1] - below[:-1]
    mean_low = weighted[:-1] / np.maximum(n_low, 1)
    mean_high = (weighted[-1] - weighted[:-1]) / np.maximum(n_high, 1)
    return float(centres[np.argmax(n_low * n_high * (mean_low - mean_high) ** 2)])


def skull_strip(scan):
    """Brain mask of ``scan`` (a T1-weighted head): atlas placement refined by intensity. Default method.

    1. nilearn's brain-only MNI152 template is placed by centre of mass, translation and rigid registration
       (dipy, mutual information) on a 2x-downsampled scan;
    2. the scan is masked by that placement dilated 8 mm (drops most scalp) and registered rigidly again
       (an affine stage is pulled outwards by scalp and was found to grow the brain ~1.3x);
    3. the warped MNI152 brain mask is trimmed by intensity: voxels above half an Otsu threshold, eroded
       4 mm to cut the brain from the scalp through dark skull and CSF, the largest component dilated back,
       holes filled (in 3D and per slice), and dilated by two voxels.
    Written for this check (docs/GENERALISATION.md); not a product feature.
    """
    import warnings

    from dipy.align.imaffine import (AffineMap, AffineRegistration, MutualInformationMetric,
                                     transform_centers_of_mass)
    from dipy.align.transforms import RigidTransform3D, TranslationTransform3D
    from scipy import ndimage

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from nilearn import datasets

        template_img = datasets.load_mni152_template(resolution=1)
        template_mask = (datasets.load_mni152_brain_mask(resolution=1).get_fdata() > 0).astype(np.float32)
    template, template_affine = template_img.get_fdata().astype(np.float32), template_img.affine
    small, small_affine = template[::2, ::2, ::2], template_affine.copy()
    small_affine[:3, :3] *= 2
    data, affine, zooms = scan.get_fdata().astype(np.float32), scan.affine, scan.header.get_zooms()[:3]
    step = (2, 2, 1) if zooms[2] > 1.1 else (2, 2, 2)
    coarse, coarse_affine = data[::step[0], ::step[1], ::step[2]], affine.copy()
    coarse_affine[:3, :3] = affine[:3, :3] * np.array(step)
    registration = AffineRegistration(metric=MutualInformationMetric(nbins=32, sampling_proportion=0.3),
                                      level_iters=[200, 100, 30], sigmas=[3.0, 1.0, 0.0], factors=[4, 2, 1],
                                      verbosity=0)
    grids = dict(static_grid2world=coarse_affine, moving_grid2world=small_affine)
    place = transform_centers_of_mass(coarse, coarse_affine, small, small_affine).affine
    for transform in (TranslationTransform3D(), RigidTransform3D()):
        place = registration.optimize(coarse, small, transform, None, starting_affine=place, **grids).affine
    placed = AffineMap(place, coarse.shape, coarse_affine, template_mask.shape,
                       template_affine).transform(template_mask, interpolation="linear") > 0.5
    rough = ndimage.binary_dilation(placed, _ball(8.0, np.array(zooms) * np.array(step)))
    place = registration.optimize(coarse * rough, small, RigidTransform3D(), None, starting_affine=place,
                                  **grids).affine
    warped = AffineMap(place, data.shape, affine, template_mask.shape,
                       template_affine).transform(template_mask, interpolation="linear") > 0.5
    candidate = ndimage.binary_dilation(ndimage.binary_fill_holes(warped), iterations=2)
    smooth = ndimage.gaussian_filter(data, 1.0)
    tissue = candidate & (smooth > 0.5 * _otsu(smooth[candidate]))
    ball = _ball(4.0, zooms)
    parts, _ = ndimage.label(ndimage.binary_erosion(tissue, ball))
    largest = parts == (np.argmax(np.bincount(parts.ravel())[1:]) + 1)
    brain = ndimage.binary_fill_holes(ndimage.binary_dilation(largest, ball) & candidate)
    for z in range(brain.shape[2]):            # ventricles can open to the outside in 3D: fill per slice too
        brain[:, :, z] = ndimage.binary_fill_holes(brain[:, :, z])
    return ndimage.binary_dilation(brain, ndimage.generate_binary_structure(3, 1), iterations=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qtim", required=True, type=Path, help=".../qtim_tools/test_data/test_data_features")
    parser.add_argument("--colin", type=Path, help="folder with ch2.nii.gz and ch2bet.nii.gz: strip with the "
                                                   "Colin27 atlas only (the first, cruder method)")
    parser.add_argument("--train", required=True, type=Path, action="append",
                        help="prepared phantom cache (32^3) to train on, e.g. bench_domain_gap.py's OUT/prepared; "
                             "repeat to train on several (e.g. shifted regimes too)")
    parser.add_argument("--out", default="runs/real-scan-check", type=Path)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--augment", default="domain")
    args = parser.parse_args()

    import nibabel as nib
    import torch
    from scipy import ndimage

    from task.data.preprocess import PreparedDataset, PreprocessConfig
    from task.learning.networks import build_unet_from_config, network_config
    from task.reporting.predict import segment_scan
    from task.learning.compute import Compute
    from task.learning.training import TrainConfig, train_segmentation

    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    caches = [PreparedDataset.open(path) for path in args.train]
    images = np.concatenate([c.images()[:, 2:3] for c in caches])                   # t1gd only
    labels = np.concatenate([c.labels() for c in caches])
    torch.manual_seed(0)
    model = train_segmentation(build_unet_from_config(network_config("small", in_channels=1)), images, labels,
                               TrainConfig(epochs=args.epochs, batch_size=2, learning_rate=2e-3, seed=0,
                                           augment=args.augment, compute=Compute(progress=True))).model.eval()
    report = {}
    for name, (scan_file, label_file, value) in SCANS.items():
        scan = nib.load(args.qtim / scan_file)
        truth = np.asarray(nib.load(args.qtim / label_file).dataobj) == value
        mask_file = args.out / f"{name}_brainmask.nii.gz"        # registration takes a minute: reuse it
        if mask_file.exists():
            brain = np.asarray(nib.load(mask_file).dataobj) > 0
        else:
            brain = skull_strip_colin(scan, args.colin) if args.colin else skull_strip(scan)
            nib.save(nib.Nifti1Image(brain.astype(np.uint8), scan.affine), mask_file)
        inside = float((brain & truth).sum() / truth.sum())
        brain |= ndimage.binary_dilation(truth, iterations=2)     # never cut the lesion off (reported)
        data = np.where(brain, scan.get_fdata(), 0).astype(np.float32)[..., None]
        labels = segment_scan(model, PreprocessConfig(grid=(32, 32, 32)), data, scan.affine)   # = fedpate predict
        nib.save(nib.Nifti1Image(labels.astype(np.uint8), scan.affine), args.out / f"{name}_seg.nii.gz")
        ml = abs(np.linalg.det(scan.affine[:3, :3])) / 1000
        whole, core = labels >= 1, labels >= 2
        away = whole & ~ndimage.binary_dilation(truth, iterations=10)

        def dice(a, b):
            return float(2 * (a & b).sum() / max(a.sum() + b.sum(), 1))

        report[name] = {"tumour_inside_registered_brain_mask": round(inside, 3),
                        "dice_whole_vs_label": dice(whole, truth), "dice_core_vs_label": dice(core, truth),
                        "predicted_ml": float(whole.sum() * ml), "label_ml": float(truth.sum() * ml),
                        "predicted_ml_over_1cm_from_label": float(away.sum() * ml)}
        print(name, json.dumps(report[name]))
    (args.out / "real_scan_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
