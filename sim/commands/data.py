"""``fedpate data phantoms|inspect|prepare|gallery`` -- make, check, preprocess and look at tumour data.

Data problems raise :class:`task.data.errors.DataError`; ``sim/cli.py`` prints them as one line and exits 2.
"""

from __future__ import annotations

import argparse
import time


#: what ``fedpate data --help`` says (the module docstring is for readers of the code)
DESCRIPTION = ("Make, check, preprocess and look at tumour data: `phantoms` writes synthetic multi-institution "
               "cases, `inspect` validates an MSD Task01 or BraTS folder and summarises it, `prepare` crops, "
               "normalises and resamples its cases into a cache, `gallery` draws a few cases to a PNG. A problem "
               "with the data is reported in one line naming the file. `fedpate data ACTION --help` for each.")


def register(subparsers) -> None:
    from sim.commands.common import non_negative_integer, positive_integer, positive_number
    from task.data.layouts import LAYOUT_NAMES, LayoutName
    from task.data.shifts import SHIFT_HELP

    layout_help = ("data layout: msd (Task01 4D images), brats2021 (X/X_{flair,t1,t1ce,t2,seg}, FeTS 2022 too), "
                   "brats2023 (X/X-{t2f,t1n,t1c,t2w,seg}); default: detected from the folder")

    parser = subparsers.add_parser("data", help="generate, inspect, preprocess and draw tumour data (MSD or BraTS folders)",
                                   description=DESCRIPTION)
    sub = parser.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    p = sub.add_parser("phantoms", help="write deterministic multi-institution phantoms (MSD Task01 or a BraTS layout)")
    p.add_argument("--out", required=True, help="output folder (created; an incomplete one is resumed)")
    p.add_argument("--cases", type=positive_integer, required=True, help="labelled cases (imagesTr + labelsTr)")
    p.add_argument("--institutions", type=positive_integer, default=4, help="scanner profiles / sites (default: 4)")
    p.add_argument("--seed", type=non_negative_integer, default=0,
                   help="world seed; case i depends only on (seed, i) (default: 0)")
    p.add_argument("--resolution", type=positive_number, default=2.0, help="voxel size in mm (default: 2)")
    p.add_argument("--test-cases", type=non_negative_integer, default=0,
                   help="unlabelled cases in imagesTs (default: 0; MSD layout only)")
    p.add_argument("--workers", type=positive_integer, default=1, help="processes to generate with (default: 1)")
    p.add_argument("--shift", default="none",
                   help="held-out regime for measuring generalisation (docs/GENERALISATION.md): "
                        + "; ".join(f"{name} = {text}" for name, text in SHIFT_HELP.items())
                        + "; factors combine with '+' (e.g. scanner+lesions) (default: none)")
    p.add_argument("--layout", default=LayoutName.MSD, choices=LAYOUT_NAMES,
                   help="write the phantoms as this release ships its data (default: msd); the same phantoms, "
                        "voxel for voxel, in every layout (BraTS: one file per modality, its label codes)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_phantoms)

    p = sub.add_parser("inspect", help="validate an MSD or BraTS folder and summarise it")
    p.add_argument("dir", help="MSD Task01 folder, or a folder of BraTS case folders")
    p.add_argument("--layout", default=None, choices=LAYOUT_NAMES, help=layout_help)
    p.add_argument("--quick", action="store_true", help="check the folder's listing and the first case only")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("prepare", help="crop, normalise and resample every training case into a cache")
    p.add_argument("dir", help="MSD Task01 folder, or a folder of BraTS case folders")
    p.add_argument("--layout", default=None, choices=LAYOUT_NAMES, help=layout_help)
    p.add_argument("--grid", default="32", help="working grid: N or X,Y,Z (default: 32)")
    p.add_argument("--margin", type=non_negative_integer, default=2,
                   help="voxels kept around the brain's box (default: 2)")
    p.add_argument("--out", required=True, help="cache folder (images.npy, labels.npy, records.json, manifest.json)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_prepare)

    p = sub.add_parser("gallery", help="draw mid axial slices (4 modalities + labels) of a few cases to a PNG")
    p.add_argument("dir", help="MSD Task01 folder, or a folder of BraTS case folders")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--cases", type=positive_integer, default=4, help="how many cases (default: 4)")
    p.add_argument("--case", action="append", default=None, help="draw this case id (repeatable)")
    p.set_defaults(func=_gallery)


def parse_grid(text: str) -> tuple[int, int, int]:
    from task.data.errors import DataError

    try:
        sizes = [int(v) for v in str(text).replace("x", ",").split(",") if v.strip()]
    except ValueError:
        sizes = []
    if len(sizes) == 1:
        sizes *= 3
    if len(sizes) != 3 or min(sizes) < 2:
        raise DataError(f"--grid={text}: expected N or X,Y,Z with sizes >= 2 (e.g. 32 or 32,32,24)")
    return tuple(sizes)


def _phantoms(args: argparse.Namespace) -> int:
    from task.data.phantoms import PhantomSpec, generate_phantoms
    from task.data.shifts import Shift
    from task.io import ensure_folder

    spec = PhantomSpec(cases=args.cases, institutions=args.institutions, seed=args.seed,
                       resolution_mm=args.resolution, test_cases=args.test_cases, shift=args.shift)
    ensure_folder(args.out)   # after the settings are checked: a refused command leaves no folder
    start = time.perf_counter()
    out = generate_phantoms(args.out, spec, progress=not args.no_progress, workers=args.workers,
                            layout=args.layout)
    seconds = time.perf_counter() - start
    total = args.cases + args.test_cases
    shifted = "" if args.shift == Shift.NONE else f", shift {args.shift}"
    print(f"wrote {args.cases} labelled + {args.test_cases} test phantoms ({args.institutions} institutions, "
          f"{args.resolution:g} mm, seed {args.seed}{shifted}, layout {args.layout}) to {out} in {seconds:.1f} s "
          f"({seconds / max(total, 1):.2f} s/case)")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import numpy as np

    from task.data.brats import skull_strip_warnings
    from task.data.layouts import CHANNELS, CLASSES, LayoutName, get_layout
    from task.data.msd import load_case, validate_case
    from task.data.reader import read_dataset

    dataset = read_dataset(args.dir, args.layout)
    layout = get_layout(dataset.layout)
    cases = dataset.training[:1] if args.quick else dataset.training
    warnings: list[str] = []

    def check(case):   # a DataError (one line, naming case and file) stops here; warnings are collected
        loaded = load_case(case)
        warnings.extend(skull_strip_warnings(case, loaded[0]))
        return validate_case(case, loaded)

    summaries = [check(c) for c in cases]
    test_summaries = [check(c) for c in ([] if args.quick else dataset.test)]
    print(f"{dataset.root}: {dataset.name}")
    print(f"  layout:     {layout.name} ({layout.title}; label codes {layout.codes_text()}, read as ours: "
          "1 oedema, 2 necrotic / non-enhancing core, 3 enhancing)")
    if layout.per_modality:
        print(f"  modalities: {', '.join(f'{m} <- {layout.separator}{f}' for m, f in zip(CHANNELS, layout.modalities))}")
    else:
        print(f"  modalities: {', '.join(dataset.modalities[str(i)] for i in range(4))}")
    if layout.name == LayoutName.MSD:   # what its dataset.json states (MSD spells them its own way)
        print(f"  labels:     {', '.join(f'{k} {v}' for k, v in sorted(dataset.labels.items()))} (its dataset.json)")
    else:
        print(f"  labels:     {', '.join(f'{k} {v}' for k, v in sorted(CLASSES.items()))} (ours)")
    unlabelled = "test" if layout.name == LayoutName.MSD else "without seg (usable by `fedpate predict` only)"
    print(f"  cases:      {len(dataset.training)} labelled, {len(dataset.test)} {unlabelled}"
          + (" (checked: first case only)" if args.quick else " (all checked)"))
    shapes = sorted({s["shape"] for s in summaries + test_summaries})
    spacings = sorted({tuple(round(v, 3) for v in s["spacing"]) for s in summaries + test_summaries})
    print(f"  shapes:     {', '.join('x'.join(map(str, s)) for s in shapes)}")
    print(f"  spacing mm: {', '.join('x'.join(f'{v:g}' for v in s) for s in spacings)}")
    counts = np.array([[s["label_counts"][str(k)] for k in range(4)] for s in summaries]).reshape(-1, 4)
    names = {key: name.split(" / ")[-1] for key, name in CLASSES.items()}   # our names, as every report gives them
    for k in (1, 2, 3) if len(counts) else ():
        column = counts[:, k]
        print(f"  label {k} {names[k]:<18} voxels/case: mean {column.mean():9.1f}  min {column.min():7d}  "
              f"max {column.max():7d}  present in {int((column > 0).sum())}/{len(column)}")
    if dataset.institutions:
        per_site = {inst: sum(c.institution == inst for c in dataset.training) for inst in dataset.institutions}
        print(f"  institutions: {', '.join(f'{k} ({v})' for k, v in per_site.items())}")
    else:
        print("  institutions: not recorded")
    patients = len(dataset.patients)
    print(f"  patients:   {patients}" + ("" if patients == len(dataset.training) else
                                          f" ({len(dataset.training)} scans; a patient's scans stay together)"))
    phantoms = dataset.extra.get("phantoms")
    if isinstance(phantoms, dict):
        print(f"  phantoms:   seed {phantoms.get('seed')}, generator v{phantoms.get('generator_version')}, "
              f"{phantoms.get('resolution_mm')} mm")
    for line in warnings:
        print(line)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from task.data.preprocess import PreprocessConfig, prepare_dataset
    from task.io import ensure_folder

    config = PreprocessConfig(grid=parse_grid(args.grid), margin_voxels=args.margin)
    ensure_folder(args.out)   # after the settings are checked: a refused command leaves no folder
    start = time.perf_counter()
    prepared = prepare_dataset(args.dir, args.out, config, progress=not args.no_progress, layout=args.layout)
    print(f"prepared {len(prepared)} cases on the {'x'.join(map(str, prepared.grid))} grid in {prepared.path} "
          f"({time.perf_counter() - start:.1f} s; source {prepared.source})")
    return 0


def _gallery(args: argparse.Namespace) -> int:
    from task.data.gallery import render_gallery
    from task.io import ensure_file_folder

    ensure_file_folder(args.out)
    out = render_gallery(args.dir, args.out, cases=args.cases, case_ids=args.case)
    print(f"wrote {out}")
    return 0
