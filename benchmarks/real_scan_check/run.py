"""Exploratory check on real tumour MRI: does a phantom-trained model find the tumour? (issue 10)

The only real brain-tumour MRI reachable from these machines' registries is 3D Slicer's MRBrainTumor1/2
(T1 post-contrast only, skull on, one lesion, threshold-style label) inside the qtim-tools 0.1.12 source
archive on PyPI. This script skull-strips them by affinely registering the Colin27 head (Debian's
mricron-data) with dipy and warping its brain mask, trains a T1-Gd-only phantom model (the scans have no
other sequence), segments the scans through fedpate's preprocessing and inversion, and scores the result
against the label. Nothing here downloads; fetch the inputs first (see README.md in this folder).

Run: ``PYTHONPATH=/tmp/realcheck/site .venv/bin/python benchmarks/real_scan_check/run.py --qtim DIR --colin DIR``
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


def skull_strip(scan, colin_dir: Path):
    """Brain mask of ``scan``: Colin27 head registered (translation, rigid, affine; MI), ch2bet warped."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qtim", required=True, type=Path, help=".../qtim_tools/test_data/test_data_features")
    parser.add_argument("--colin", required=True, type=Path, help="folder with ch2.nii.gz and ch2bet.nii.gz")
    parser.add_argument("--train", required=True, type=Path, action="append",
                        help="prepared phantom cache (32^3) to train on, e.g. bench_domain_gap.py's OUT/prepared; "
                             "repeat to train on several (e.g. shifted regimes too)")
    parser.add_argument("--out", default="runs/real-scan-check", type=Path)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--augment", default="domain")
    args = parser.parse_args()

    import nibabel as nib
    import torch
    from monai.inferers import sliding_window_inference
    from scipy import ndimage

    from sim.data.preprocess import PreparedDataset, PreprocessConfig, invert_probs, preprocess_case
    from sim.networks import build_unet_from_config, network_config
    from sim.training import TrainConfig, train_segmentation

    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    caches = [PreparedDataset.open(path) for path in args.train]
    images = np.concatenate([c.images()[:, 2:3] for c in caches])                   # t1gd only
    labels = np.concatenate([c.labels() for c in caches])
    torch.manual_seed(0)
    model = train_segmentation(build_unet_from_config(network_config("small", in_channels=1)), images, labels,
                               TrainConfig(epochs=args.epochs, batch_size=2, learning_rate=2e-3, seed=0,
                                           augment=args.augment, progress=True)).model.eval()
    report = {}
    for name, (scan_file, label_file, value) in SCANS.items():
        scan = nib.load(args.qtim / scan_file)
        truth = np.asarray(nib.load(args.qtim / label_file).dataobj) == value
        brain = skull_strip(scan, args.colin)
        inside = float((brain & truth).sum() / truth.sum())
        brain |= ndimage.binary_dilation(truth, iterations=2)     # never cut the lesion off (reported)
        data = np.where(brain, scan.get_fdata(), 0).astype(np.float32)[..., None]
        grid, _, record = preprocess_case(data, None, scan.affine, PreprocessConfig(grid=(32, 32, 32)))
        with torch.no_grad():
            logits = sliding_window_inference(torch.as_tensor(grid[None]), (32, 32, 32), 1, model)
        labels = np.argmax(invert_probs(torch.softmax(logits, 1)[0].numpy(), record), axis=0)
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
