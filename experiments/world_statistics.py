"""The working grid's intensities, real scans against phantoms: where a world differs from real skull-stripped scans
after the product's preprocessing (z-scores inside the brain, 32³).

    .venv/bin/python -m experiments.world_statistics --real DIR [--real DIR] --phantoms FOLDER [--cases 60]
        [--seed 5] [--variant current[+LEVER...]]

FOLDER is generated (3 mm, 4 institutions) when it holds no ``dataset.json``; VARIANT patches the generator first
(``experiments.world_levers``). Printed, per statistic: the phantoms' 5th-95th percentiles and each real case's
value with its rank among the phantoms. Statistics: healthy tissue's percentiles per sequence; each tumour class's
mean z per sequence; the classes' shares of the brain; T1-Gd of the healthy tissue by depth (the outermost grid
layer, the next two, and deeper), with the share of the bright healthy T1-Gd voxels (z > 1.5) in the outermost two
layers; and FLAIR and T2 across the whole tumour's border (the two grid layers outside it, the oedema's first two
layers inside it and deeper, each less the healthy tissue's median). The real cases only measure the world: no setting of a method is chosen on them.
"""
import argparse
from pathlib import Path

import numpy as np
from scipy import ndimage

SEQUENCES = ("FLAIR", "T1", "T1Gd", "T2")
CLASSES = ((1, "oedema"), (2, "core"), (3, "enhancing"))


def statistics(image, label, config) -> dict[str, float]:
    from task.data.preprocess import preprocess_case

    grid, labels, _ = preprocess_case(image, label, np.eye(4), config)
    brain = np.abs(grid).sum(0) > 0
    healthy = brain & (labels == 0)
    depth = ndimage.distance_transform_edt(brain)
    out = {}
    for c, name in enumerate(SEQUENCES):
        for q in (1, 5, 25, 50, 75, 95, 99):
            out[f"healthy {name} p{q}"] = float(np.percentile(grid[c][healthy], q))
        for k, cls in CLASSES:
            inside = labels == k
            out[f"{cls} {name}"] = float(grid[c][inside].mean()) if inside.sum() >= 3 else float("nan")
    for k, cls in CLASSES:
        out[f"share {cls}"] = float((labels == k).sum() / brain.sum())
    t1gd = grid[SEQUENCES.index("T1Gd")]
    for name, layer in (("layer 1", depth <= 1), ("layer 2", (depth > 1) & (depth <= 2)),
                        ("layer 3", (depth > 2) & (depth <= 3)), ("deeper", depth > 3)):
        values = t1gd[healthy & layer]
        out[f"T1Gd {name} p50"] = float(np.median(values))
        out[f"T1Gd {name} p90"] = float(np.percentile(values, 90))
        out[f"T1Gd {name} share>1"] = float((values > 1.0).mean())
    bright = healthy & (t1gd > 1.5)
    out["T1Gd bright healthy in layers 1-2"] = float((bright & (depth <= 2)).sum() / max(int(bright.sum()), 1))
    # the whole tumour's border as the model sees it: oedema by grid layer inside the border, healthy tissue by layer
    # outside it, each less the healthy tissue's median (is the edge the model learns to cut at the real one?)
    tumour = labels > 0
    inside, outside = ndimage.distance_transform_edt(tumour), ndimage.distance_transform_edt(~tumour)
    for c, name in ((0, "FLAIR"), (3, "T2")):
        centre = float(np.median(grid[c][healthy]))
        for where, mask in (("outside layer 2", brain & (outside > 1) & (outside <= 2)),
                            ("outside layer 1", brain & (outside > 0) & (outside <= 1)),
                            ("oedema layer 1", (labels == 1) & (inside == 1)),
                            ("oedema layer 2", (labels == 1) & (inside > 1) & (inside <= 2)),
                            ("oedema deeper", (labels == 1) & (inside > 2))):
            values = grid[c][mask]
            out[f"border {name} {where}"] = float(np.median(values) - centre) if values.size >= 5 else float("nan")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="append", required=True)
    parser.add_argument("--phantoms", required=True)
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--variant", default="current")
    args = parser.parse_args()

    import task.data.phantoms as phantoms
    from task.data.msd import load_case, read_msd
    from task.data.preprocess import PreprocessConfig
    from task.reporting.realcheck import open_check

    if args.variant.startswith("current+"):
        from experiments.world_levers import apply
        apply(args.variant, phantoms)
    config = PreprocessConfig(grid=(32, 32, 32))
    folder = Path(args.phantoms)
    if not (folder / "dataset.json").exists():
        spec = phantoms.PhantomSpec(cases=args.cases, institutions=4, seed=args.seed, resolution_mm=3.0)
        phantoms.generate_phantoms(folder, spec, progress=False)
    real = {}
    for case in open_check(args.real, cache_dir=None).cases:
        image, truth, _ = load_case(case.case)
        real[case.case_id] = statistics(image, truth, config)
    phantom_rows = []
    for case in read_msd(folder).training[: args.cases]:
        image, label, _ = load_case(case)
        phantom_rows.append(statistics(image, label, config))
    print(f"generator {phantoms.GENERATOR_VERSION} ({args.variant}), {len(phantom_rows)} phantoms")
    print(f"{'statistic':34s} {'p5':>6s} {'p25':>6s} {'p50':>6s} {'p75':>6s} {'p95':>6s} | "
          + "  ".join(f"{name[-14:]:>14s}" for name in real))
    for key in phantom_rows[0]:
        values = np.array([row[key] for row in phantom_rows])
        values = values[~np.isnan(values)]
        cells = []
        for row in real.values():
            value = row[key]
            rank = "  " if np.isnan(value) else f"{(values < value).mean() * 100:3.0f}%"
            cells.append(f"{value:+7.2f} ({rank})")
        print(f"{key:34s} " + " ".join(f"{q:+6.2f}" for q in np.percentile(values, (5, 25, 50, 75, 95)))
              + " | " + "  ".join(cells))


if __name__ == "__main__":
    main()
