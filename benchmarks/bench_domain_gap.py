"""How far does a phantom-trained model carry? Dice under held-out phantom regimes (docs/GENERALISATION.md).

No real BraTS scan can be downloaded here, so the phantom-to-real gap is judged by proxies: a model is
trained on the default phantom regime and scored, through the same path as ``fedpate predict`` (preprocess,
network, map back to each scan's own grid), on *new* subjects from *new* scanner sites rendered

* in the training regime ("none", at the training resolution), at 1 mm ("1mm", BraTS' grid), and
* with one factor moved beyond the training range (``task.data.phantoms.SHIFTS``): scanner physics, tissue
  contrast, multifocal lesions, imperfect skull stripping, and all at once.

Each model is trained with each augmentation level (``geometric``: flips and rotations; ``domain``: plus
SynthSeg-style intensity randomisation), so the table shows how much the randomisation closes each gap.
``--real DIR`` adds any labelled MSD-layout folder (e.g. real BraTS cases) as one more row.

Run: ``.venv/bin/python benchmarks/bench_domain_gap.py [--epochs 20] [--train-cases 64]`` (about 15 min on
2 CPU cores at the defaults). Prints the table (mean Dice over classes 1-3, WT, and the ratio to the
in-distribution row, all measured in one run) and writes ``--out``/domain_gap.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-cases", type=int, default=64)
    parser.add_argument("--test-cases", type=int, default=12, help="cases per evaluation set")
    parser.add_argument("--institutions", type=int, default=4)
    parser.add_argument("--train-resolution", type=float, default=3.0, help="mm (the quick preset's)")
    parser.add_argument("--grid", type=int, default=32)
    parser.add_argument("--unet", default="small")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--augment", default="geometric,domain", help="comma-separated levels")
    parser.add_argument("--shifts", default="none,1mm,scanner,contrast,lesions,skull,all")
    parser.add_argument("--real", action="append", default=[], help="labelled MSD-layout folder to add")
    parser.add_argument("--out", default="runs/domain-gap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2, help="processes generating phantoms")
    args = parser.parse_args()

    import torch

    from task.reporting.bundle import privacy_card, save_bundle
    from task.data.phantoms import GENERATOR_VERSION, PhantomSpec, generate_phantoms
    from task.data.shifts import Shift
    from task.data.preprocess import PreprocessConfig, prepare_dataset
    from task.io import atomic_write_json, atomic_write_text
    from task.learning.networks import build_unet_from_config, network_config
    from task.learning.compute import Compute
    from task.reporting.predict import EvaluationOptions, evaluate_scans
    from task.learning.training import TrainConfig, train_segmentation

    torch.set_num_threads(2)
    out = Path(args.out)
    data = out / "data"
    started = time.perf_counter()
    train_dir = generate_phantoms(data / "train", PhantomSpec(cases=args.train_cases, institutions=args.institutions,
                                                              seed=args.seed, resolution_mm=args.train_resolution),
                                  workers=args.workers)
    test_dirs: dict[str, Path] = {}
    for shift in [s for s in args.shifts.split(",") if s]:
        resolution = 1.0 if shift == "1mm" else args.train_resolution
        spec = PhantomSpec(cases=args.test_cases, institutions=args.institutions, seed=args.seed + 1,
                           resolution_mm=resolution, shift=Shift.NONE if shift == "1mm" else shift)
        test_dirs[shift] = generate_phantoms(data / f"test-{shift}", spec, workers=args.workers)
    for real in args.real:
        test_dirs[f"real:{Path(real).name}"] = Path(real)
    data_seconds = time.perf_counter() - started

    config = PreprocessConfig(grid=(args.grid,) * 3)
    prepared = prepare_dataset(train_dir, out / "prepared", config)
    images, labels = prepared.images(), prepared.labels()
    net_cfg = network_config(args.unet)
    results: dict[str, dict] = {}
    train_seconds = {}
    for level in [a for a in args.augment.split(",") if a]:
        model_dir = out / "models" / level
        if not (model_dir / "model" / "bundle.json").exists():
            torch.manual_seed(args.seed)
            model = build_unet_from_config(net_cfg)
            start = time.perf_counter()
            trained = train_segmentation(model, images, labels, TrainConfig(
                epochs=args.epochs, batch_size=2, learning_rate=args.learning_rate, seed=args.seed,
                augment=level, description=f"train ({level})",
                checkpoint=model_dir / "checkpoint.pt")).model
            train_seconds[level] = time.perf_counter() - start
            card = privacy_card(method=f"nonprivate-central ({level} augmentation)", ledger_path=None,
                                data_source={"kind": "phantoms", "seed": args.seed, "cases": args.train_cases,
                                             "generator_version": GENERATOR_VERSION,
                                             "resolution_mm": args.train_resolution})
            save_bundle(model_dir, trained, net_cfg, {"grid": list(config.grid), "config": config.to_dict()}, card)
        results[level] = {name: evaluate_scans(model_dir, folder, EvaluationOptions(compute=Compute(progress=False)))
                          for name, folder in test_dirs.items()}

    table = _table(results, list(test_dirs))
    print(table)
    print(f"data {data_seconds:.0f} s; training {', '.join(f'{k} {v:.0f} s' for k, v in train_seconds.items())}")
    report = {"settings": vars(args), "results": results, "train_seconds": train_seconds,
              "data_seconds": data_seconds}
    atomic_write_json(out / "domain_gap.json", json.loads(json.dumps(report, default=str)))
    atomic_write_text(out / "domain_gap.md", "# Domain gap (bench_domain_gap.py)\n\n" + table + "\n")


def _table(results: dict[str, dict], sets: list[str]) -> str:
    """Mean Dice ± its standard error over cases, WT Dice, and the ratio to the in-distribution set."""
    import numpy as np

    levels = list(results)
    paired = len(levels) >= 2     # same cases for every model: the per-case difference is the sharper statistic
    head = "| evaluation set | " + " | ".join(f"{lv}: mean ± se | {lv}: WT | {lv}: mean / none" for lv in levels)
    head += f" | {levels[-1]} − {levels[0]}, paired ± se | cases {levels[-1]} better |" if paired else " |"
    rule = "|---" * (1 + 3 * len(levels) + 2 * paired) + "|"
    lines = [head, rule]
    for name in sets:
        cells = []
        for level in levels:
            dice = results[level][name]["dice"]
            per_case = np.array([row["mean"] for row in results[level][name]["cases"] if row["mean"] is not None])
            se = per_case.std(ddof=1) / np.sqrt(len(per_case)) if len(per_case) > 1 else float("nan")
            base = results[level].get("none", {}).get("dice", {}).get("mean")
            ratio = f"{dice['mean'] / base:.2f}" if base and dice["mean"] is not None else "n/a"
            cells += [f"{_fmt(dice['mean'])} ± {se:.3f}", _fmt(dice["WT"]), ratio]
        if paired:
            first, last = ([np.nan if row["mean"] is None else row["mean"] for row in results[lv][name]["cases"]]
                           for lv in (levels[0], levels[-1]))
            diff = np.array(last) - np.array(first)
            diff = diff[~np.isnan(diff)]
            se = diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
            cells += [f"{diff.mean():+.3f} ± {se:.3f}", f"{int((diff > 0).sum())}/{len(diff)}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
