"""``fedpate evaluate --model RUN_DIR --data MSD_DIR`` -- Dice of a saved model on labelled scans, in their grid."""

from __future__ import annotations


def register(subparsers) -> None:
    from sim.commands.common import add_compute_options

    parser = subparsers.add_parser(
        "evaluate",
        help="score a saved model on a labelled MSD or BraTS folder (Dice in each scan's own grid)",
        description="Segment every labelled case of an MSD Task01 folder (imagesTr + labelsTr) or a BraTS folder "
                    "(case folders with their seg file) exactly as `fedpate predict` would, and compare with its "
                    "label map in the scan's own grid: Dice per class (ours: 1 oedema, 2 non-enhancing core, "
                    "3 enhancing; BraTS codes are mapped), their mean, and WT/TC/ET.",
    )
    parser.add_argument("--model", required=True, help="run folder (or its model/ subfolder) with a model bundle")
    parser.add_argument("--data", required=True, help="MSD Task01 folder with labelsTr, or a folder of labelled "
                                                      "BraTS case folders")
    parser.add_argument("--layout", default=None, choices=("msd", "brats2021", "brats2023"),
                        help="the --data folder's layout (default: detected)")
    parser.add_argument("--labels", default=None, choices=("msd", "brats2021", "brats2023"),
                        help="label codes of the maps written to --out (default: the folder's own)")
    parser.add_argument("--out", default=None, help="also write each label map here")
    parser.add_argument("--json", default=None, help="write the summary and per-case rows to this JSON file")
    from sim.commands.common import positive_integer

    parser.add_argument("--limit", type=positive_integer, default=None,
                        help="evaluate only the first N cases (default: every labelled case)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--no-mirroring", action="store_true",
                        help="one forward pass per scan instead of the mean over its 8 mirrorings (nnU-Net's "
                             "test-time mirroring, the default: how every model is scored), 8 times faster")
    add_compute_options(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from task.io import atomic_write_json, ensure_file_folder, ensure_folder
    from sim.commands.common import resolved_device
    from task.learning.compute import Compute
    from task.reporting.predict import EvaluationOptions, evaluate_scans

    device = resolved_device(args)
    if args.out:
        ensure_folder(args.out)
    if args.json:
        ensure_file_folder(args.json, "--json")
    result = evaluate_scans(args.model, args.data, EvaluationOptions(
        out_dir=args.out, layout=args.layout, labels=args.labels, limit=args.limit,
        compute=Compute(device=str(device), precision=args.precision, progress=not args.no_progress),
        mirror=not args.no_mirroring))
    for row in result["cases"]:
        print(f"{row['case']}: mean Dice {_fmt(row['mean'])} (WT {_fmt(row['WT'])}, TC {_fmt(row['TC'])}, "
              f"ET {_fmt(row['ET'])}); tumour {row['volume_ml']:.1f} ml predicted, {row['true_volume_ml']:.1f} ml true")
    dice = result["dice"]
    print(f"{len(result['cases'])} cases: mean Dice {_fmt(dice['mean'])} (1: {_fmt(dice['1'])}, 2: {_fmt(dice['2'])}, "
          f"3: {_fmt(dice['3'])}; WT {_fmt(dice['WT'])}, TC {_fmt(dice['TC'])}, ET {_fmt(dice['ET'])})")
    if args.json:
        atomic_write_json(args.json, result)
    return 0


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"
