"""Lever "teachers worth asking" (docs/RESULTS.md): PATE (public-anchored codec) with fewer teacher fine-tuning epochs.

    .venv/bin/python -m experiments.lever_teacher_epochs --out runs/lever-teacher-epochs 2 1

Runs one pate-anchored cell (quick preset, K = 128, eps = 8, seed 0 by default) per teacher-epoch count
and prints, per count, the teachers' mean test Dice, their probability average, the noise-free decoded
ensemble, the pseudo-labels (noisy, as the student sees them) and the public model on the query scans,
and the student's test Dice. Each cell spends its own eps: this is a measurement of a lever, not a
release. A preset change chosen from these numbers would be chosen on the test set: a default must be
chosen on public validation (docs/RESULTS.md).
"""
import argparse
import json
from pathlib import Path

from task.settings.presets import get_preset
from sim.runners.inprocess import InProcessPateRun, run_pate_inprocess
from task.learning.compute import Compute

KEYS = ("teacher_dice_mean", "ensemble_probability_average_dice_mean", "ensemble_dice_mean",
        "pseudo_label_dice_mean", "public_model_query_dice_mean", "public_only_dice_mean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("epochs", nargs="+", type=int, help="teacher fine-tuning epochs to try")
    parser.add_argument("--out", required=True)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    for epochs in args.epochs:
        preset = get_preset("quick").with_changes(teacher=dict(epochs=epochs))
        result = run_pate_inprocess(InProcessPateRun(preset, "pate-anchored", root / f"E{epochs}", args.epsilon,
                                                     seed=args.seed, hospitals_root=root / f"hospitals-E{epochs}",
                                                     compute=Compute(progress=False),
                                                     options={"shared_dir": root / "shared"}))
        row = {"teacher_epochs": epochs, "student": result["dice"]["mean"], **{k: result.get(k) for k in KEYS}}
        print(json.dumps(row), flush=True)
        with open(root / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
