"""Levers for pooled DP-SGD (docs/RESULTS.md, "More steps"): one `run_central` per variant on one shared public model,
one JSON line each.

    .venv/bin/python -m experiments.lever_dpsgd --out runs/lever-dpsgd baseline ema private-selection

Variants: baseline (the preset's settings: today the non-private ceiling's, lr 2e-3 and 10 epochs),
public-validation-grid (the grid the quick preset had before: lr 2e-3 or 5e-4, 5 epochs each, chosen on public
validation), head / decoder / bias (``--trainable``),
augmult4 (augmentation multiplicity 4), ema (EMA of the weights, decay 0.9), private-selection
(``--selection private``), ceiling-settings (no grid: the non-private ceiling's learning rate and epochs, 2e-3 and
10), epochs20 (lr 2e-3, 20 epochs), batch64-epochs20, head-epochs20, decoder-epochs10. Each variant is a full DP-SGD run that spends its own ε: a measurement of a lever, not
a release, and a choice made from its test Dice would be a choice on the test set (docs/RESULTS.md). Run it
alone on a 2-core machine: two 2-thread torch processes oversubscribe OpenMP and run many times slower.
"""
import argparse
import json
import time
from pathlib import Path

from task.settings.presets import get_preset
from sim.runners.central import CentralConfig, run_central

#: the quick preset's grid before DP-SGD trained with the ceiling's settings (chosen on public validation)
OLD_GRID = ({"learning_rate": 2e-3, "epochs": 5}, {"learning_rate": 5e-4, "epochs": 5})
VARIANTS = {"baseline": {}, "public-validation-grid": {"dpsgd_grid": OLD_GRID}, "head": {"levers": {"trainable": "head"}},
            "decoder": {"levers": {"trainable": "decoder"}}, "bias": {"levers": {"trainable": "bias"}},
            "augmult4": {"levers": {"augmentation_multiplicity": 4}}, "ema": {"levers": {"ema_decay": 0.9}},
            "private-selection": {"selection": "private"},
            # more steps at the same epsilon: one setting, sigma calibrated for its epochs
            "ceiling-settings": {"learning_rate": 2e-3, "epochs": 10},
            "epochs20": {"learning_rate": 2e-3, "epochs": 20},
            "batch64-epochs20": {"learning_rate": 2e-3, "epochs": 20, "batch_size": 64},
            "head-epochs20": {"learning_rate": 2e-3, "epochs": 20, "levers": {"trainable": "head"}},
            "decoder-epochs10": {"learning_rate": 2e-3, "epochs": 10, "levers": {"trainable": "decoder"}},
            # a voxel head on the frozen public model (task.learning.networks.VoxelHeadUNet): lr ~ 1/T for its T ~ 120 steps
            "voxel-head": {"learning_rate": 1e-2, "epochs": 10, "levers": {"trainable": "voxel-head"}},
            "voxel-head-lr2e-3": {"learning_rate": 2e-3, "epochs": 10, "levers": {"trainable": "voxel-head"}},
            # a larger expected batch for the head (De et al. 2022), sigma recalibrated for it: measured, not adopted
            "voxel-head-batch64": {"learning_rate": 1e-2, "epochs": 10, "batch_size": 64,
                                   "levers": {"trainable": "voxel-head"}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", choices=tuple(VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--public-model", default=None,
                        help="a public-model checkpoint to share (default: trained once into OUT/public-model.pt)")
    args = parser.parse_args()
    root = Path(args.out)
    shared = Path(args.public_model) if args.public_model else root / "public-model.pt"
    base = get_preset(args.preset)
    for name in args.variants:
        started = time.time()
        options = dict(VARIANTS[name])
        # a grid is the preset's: the run gets a variant of it (task.settings.presets), rebuilt from its reference
        grid = options.pop("dpsgd_grid", None)
        preset = base.with_changes(dp_sgd=dict(grid=grid)) if grid is not None else base
        result = run_central(CentralConfig.of(method="dp-sgd", preset=preset, out=root / name,
                                              epsilon=args.epsilon, seed=args.seed, progress=False,
                                              public_model_checkpoint=shared, **options))
        dice = result["dice"]
        print(json.dumps({"variant": name, **{k: v for k, v in VARIANTS[name].items() if k != "dpsgd_grid"}, "mean": dice["mean"], "class 1": dice["1"],
                          "class 2": dice["2"], "class 3": dice["3"], "epsilon": result["epsilon"],
                          "accountant": result["accountant"], "sigma": result["sigma"],
                          "setting_chosen": result.get("setting_chosen"),
                          "validation_dice_mean": result.get("validation_dice_mean"),
                          "minutes": round((time.time() - started) / 60, 1)}), flush=True)


if __name__ == "__main__":
    main()
