"""How far oedema reaches from the tumour core, on real cases and phantoms, and where a model finds it.

    .venv/bin/python -m experiments.oedema_reach --real DIR [--real DIR] [--phantoms MSD_FOLDER] [--model MODEL.pt]

For each real case (its own grid, 1 mm): the oedema's volume, the share of it more than 10 and 15 mm from the
core (labels 2 and 3) and the 95th percentile of that distance; with ``--phantoms`` the same over the first 60
phantoms of an MSD folder (percentiles across phantoms); with ``--model`` (a U-Net saved with ``torch.save``, e.g.
by ``experiments.probe_world --save-model``) the share of each case's oedema the model labels as tumour, by
distance from the core, with the oedema's FLAIR contrast there (z inside the brain less the healthy tissue's
median), and the whole tumour the model labels against the reference's: both volumes, the false-positive and
false-negative millilitres and the share of each within 3 mm of the other side's border (a grid border's errors)
or further. Measures the world only: no setting of a method is chosen on the real cases.
"""
import argparse
import glob

import numpy as np

BINS_MM = (0, 5, 10, 15, 20, 30, 40, 60)


def reach(label: np.ndarray, spacing) -> tuple[np.ndarray, np.ndarray, float]:
    """(distance of every oedema voxel from the core in mm, the oedema mask, one voxel's ml)."""
    from scipy import ndimage

    distance = ndimage.distance_transform_edt(label < 2, sampling=spacing)
    oedema = label == 1
    return distance[oedema], oedema, float(np.prod(spacing)) / 1000.0


def summary(distance: np.ndarray, ml: float) -> dict:
    return {"oedema_ml": distance.size * ml, "beyond_10mm": float(np.mean(distance > 10)),
            "beyond_15mm": float(np.mean(distance > 15)), "p95_mm": float(np.percentile(distance, 95))}


def border_errors(truth: np.ndarray, predicted: np.ndarray, spacing) -> None:
    """Print the whole tumour's volumes, false positives and false negatives (ml), and the share of each within 3 mm
    of the other side's border: the reference's for a false positive, the prediction's for a false negative."""
    from scipy import ndimage

    ml = float(np.prod(spacing)) / 1000.0
    near_truth = ndimage.distance_transform_edt(~truth, sampling=spacing) <= 3
    near_prediction = ndimage.distance_transform_edt(~predicted, sampling=spacing) <= 3
    false_positive, false_negative = predicted & ~truth, truth & ~predicted
    print(f"    whole tumour: reference {truth.sum() * ml:5.1f} ml, model {predicted.sum() * ml:5.1f} ml; "
          f"false positive {false_positive.sum() * ml:4.1f} ml ({(false_positive & near_truth).sum() * ml:4.1f} within "
          f"3 mm), false negative {false_negative.sum() * ml:4.1f} ml "
          f"({(false_negative & near_prediction).sum() * ml:4.1f} within 3 mm)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="append", required=True)
    parser.add_argument("--phantoms")
    parser.add_argument("--model")
    args = parser.parse_args()

    from task.data.msd import load_case
    from task.reporting.realcheck import open_check

    check = open_check(args.real, cache_dir=None)
    model = None
    if args.model:
        import torch

        from task.data.preprocess import PreprocessConfig
        from task.reporting.predict import segment_preprocessed
        from task.reporting.realcheck import prepared_case

        config = PreprocessConfig(grid=(32, 32, 32))
        model = torch.load(args.model, weights_only=False)
        model.eval()
    for real in check.cases:
        image, truth, affine = load_case(real.case)
        distance, oedema, ml = reach(truth, np.abs(np.diag(affine)[:3]))
        row = summary(distance, ml)
        print(f"{real.case_id:22s} oedema {row['oedema_ml']:5.0f} ml, beyond 10 mm {row['beyond_10mm']:.2f}, "
              f"beyond 15 mm {row['beyond_15mm']:.2f}, 95th percentile {row['p95_mm']:.1f} mm")
        if model is None:
            continue
        prepared = prepared_case(real, config, None)
        box = tuple(slice(lo, hi) for lo, hi in prepared["box"])
        with torch.no_grad():
            labels = segment_preprocessed(model, config, prepared["image"], prepared["record"], None,
                                          precision="32", mirror=True)[box]
        brain = prepared["brain"]
        labels[~brain] = 0
        truth_box, flair = prepared["truth"], image[box][..., 0].astype(np.float32)
        border_errors(truth_box > 0, labels > 0, np.abs(np.diag(affine)[:3]))
        z = (flair - flair[brain].mean()) / flair[brain].std()
        healthy = np.median(z[brain & (truth_box == 0)])
        # the box holds every labelled voxel: its oedema, in C order, is the scan's, with the same distances
        distance_box, oedema_box = distance, truth_box == 1
        found = labels[oedema_box] > 0
        contrast = z[oedema_box] - healthy
        for lo, hi in zip(BINS_MM[:-1], BINS_MM[1:]):
            inside = (distance_box > lo) & (distance_box <= hi)
            if inside.sum() * ml >= 0.5:
                print(f"    {lo:2d}-{hi:2d} mm from the core: {inside.sum() * ml:5.1f} ml, FLAIR contrast "
                      f"{np.median(contrast[inside]):+.2f} z, found {found[inside].mean():.2f}")
    if args.phantoms:
        import nibabel as nib

        rows = []
        for path in sorted(glob.glob(f"{args.phantoms}/labelsTr/*.nii.gz"))[:60]:
            label_image = nib.load(path)
            distance, _, ml = reach(np.asarray(label_image.dataobj), label_image.header.get_zooms()[:3])
            if distance.size:
                rows.append(summary(distance, ml))
        for key in rows[0]:
            values = np.array([row[key] for row in rows])
            print(f"phantoms ({len(rows)}) {key:12s} " + ", ".join(
                f"p{q} {np.percentile(values, q):.2f}" for q in (10, 25, 50, 75, 90)))


if __name__ == "__main__":
    main()
