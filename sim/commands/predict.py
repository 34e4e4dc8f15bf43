"""``fedpate predict --model RUN_DIR --image SCAN.nii.gz [--image ...] --out DIR``."""

from __future__ import annotations


def register(subparsers) -> None:
    from sim.commands.common import add_compute_options

    parser = subparsers.add_parser(
        "predict",
        help="segment new scans (4D NIfTI or BraTS case folders) with a saved model (label maps in each scan's grid)",
        description="Segment scans with the model a run saved: 4D NIfTI files (channels FLAIR, T1w, t1gd, T2w), "
                    "BraTS case folders as distributed (X/X_{flair,t1,t1ce,t2}.nii.gz or X/X-{t2f,t1n,t1c,t2w}.nii.gz) "
                    "or a case's four modality files. Checks the bundle's integrity and privacy card first. Writes "
                    "<scan>_seg.nii.gz (same shape and affine as the scan; label codes of --labels) and prints tumour "
                    "volumes per class.",
    )
    parser.add_argument("--model", required=True, help="run folder (or its model/ subfolder) with a model bundle")
    parser.add_argument("--image", action="append", required=True,
                        help="a 4D NIfTI scan, a BraTS case folder, one of a case's four modality files (give all "
                             "four), a folder of BraTS case folders, or an MSD-layout folder; repeat for more")
    parser.add_argument("--labels", default=None, choices=("msd", "brats2021", "brats2023"),
                        help="label codes of the written maps: msd (1 oedema, 2 non-enhancing/necrotic core, "
                             "3 enhancing), brats2021 (1 NCR/NET, 2 ED, 4 ET), brats2023 (1 NCR, 2 ED, 3 ET); "
                             "default: the input's own (BraTS cases: their release's; 4D files: msd)")
    parser.add_argument("--out", required=True, help="folder for the label maps")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--no-mirroring", action="store_true",
                        help="one forward pass per scan instead of the mean over its 8 mirrorings (nnU-Net's "
                             "test-time mirroring, the default: how every model is scored), 8 times faster")
    add_compute_options(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from task.reporting.bundle import load_bundle
    from sim.commands.common import resolved_device
    from task.io import ensure_folder
    from task.reporting.predict import predict_scans

    device = resolved_device(args)
    card = load_bundle(args.model).card
    ensure_folder(args.out)
    if card["private"]:
        print(f"model: {card['method']}, ({card['epsilon']:.3g}, {card['delta']:g})-DP, {card['relation']}, "
              f"accountant {card['accountant']}")
    else:
        print(f"model: {card['method']}, not private")
    for prediction in predict_scans(args.model, args.image, args.out, progress=not args.no_progress,
                                    labels=args.labels, device=str(device), precision=args.precision,
                                    mirror=not args.no_mirroring):
        print(prediction.summary())
    return 0
