"""``fedpate predict --model RUN_DIR --image SCAN.nii.gz [--image ...] --out DIR``."""

from __future__ import annotations


def register(subparsers) -> None:
    from sim.commands.common import add_compute_options

    parser = subparsers.add_parser(
        "predict",
        help="segment new 4D NIfTI scans with a saved model (label maps in each scan's own grid)",
        description="Segment scans (4D NIfTI, channels FLAIR, T1w, t1gd, T2w) with the model a run saved. "
                    "Checks the bundle's integrity and privacy card first. Writes <scan>_seg.nii.gz (labels 0-3, "
                    "same shape and affine as the scan) and prints tumour volumes per class.",
    )
    parser.add_argument("--model", required=True, help="run folder (or its model/ subfolder) with a model bundle")
    parser.add_argument("--image", action="append", required=True,
                        help="a 4D NIfTI scan, or an MSD-layout folder (imagesTs/imagesTr); repeat for more")
    parser.add_argument("--out", required=True, help="folder for the label maps")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_compute_options(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from sim.bundle import load_bundle
    from sim.commands.common import resolved_device
    from sim.predict import predict_scans

    device = resolved_device(args)
    card = load_bundle(args.model).card
    if card["private"]:
        print(f"model: {card['method']}, ({card['epsilon']:.3g}, {card['delta']:g})-DP, {card['relation']}, "
              f"accountant {card['accountant']}")
    else:
        print(f"model: {card['method']}, not private")
    for prediction in predict_scans(args.model, args.image, args.out, progress=not args.no_progress,
                                    device=str(device), precision=args.precision):
        print(prediction.summary())
    return 0
