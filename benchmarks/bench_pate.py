"""PATE utility table: teacher mean, noise-free ensembles, student and public-only Dice per compressor
at several epsilons, with bytes uploaded per query per teacher. One command:

    .venv/bin/python benchmarks/bench_pate.py --preset tiny --epsilons 1 8 [--synthetic]

Uses the preset's phantom world (task.data) unless --synthetic (or task.data is unavailable): then a
synthetic spherical-tumour world at 16^3 (task.data.synthetic) with the preset's budgets.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def synthetic_world(preset, seed=0):
    from task.data.partitions import Split
    from task.data.synthetic import SyntheticPrepared

    per_hospital = preset.teachers_per_hospital
    sets = preset.world
    needed = preset.hospitals * per_hospital + preset.federation.n_query + sets.n_reference + sets.n_test
    prepared = SyntheticPrepared(needed, seed=seed)
    ids = iter(prepared.case_ids)
    hospitals = {f"h{h}": [[next(ids)] for _ in range(per_hospital)] for h in range(preset.hospitals)}
    take = lambda n: [next(ids) for _ in range(n)]  # noqa: E731
    return prepared, Split(hospitals=hospitals, public_query=take(preset.federation.n_query),
                           public_reference=take(sets.n_reference), public_validation=[],
                           test=take(sets.n_test))


def main() -> None:
    from task.settings.presets import get_preset
    from sim.runners.inprocess import InProcessPateRun, run_pate_inprocess
    from task.learning.compute import Compute

    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    parser.add_argument("--methods", nargs="+", default=["pate-pca", "pate-ae", "pate-naive"])
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    preset = get_preset(args.preset)
    world = {}
    if args.synthetic:
        preset = preset.with_changes(grid=(16, 16, 16))
        world = dict(zip(("prepared", "split"), synthetic_world(preset)))
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_pate_"))
    rows = []
    for epsilon in args.epsilons:
        for method in args.methods:
            r = run_pate_inprocess(InProcessPateRun(preset, method, out / f"{method}-eps{epsilon:g}", epsilon,
                                                    preset.delta, compute=Compute(progress=False), **world))
            rows.append({k: r.get(k) for k in ("method", "epsilon", "sigma", "components", "teacher_dice_mean",
                                                "ensemble_dice_mean", "ensemble_vote_dice_mean",
                                                "pseudo_label_dice_mean", "public_only_dice_mean",
                                                "bytes_up_per_query_per_teacher", "ae_collapsed", "wall_seconds")}
                        | {"student": r["dice"]["mean"]})
            print(json.dumps(rows[-1]), flush=True)
    print("| method | eps | sigma | l | teacher | ens(latent) | ens(probs) | pseudo | student | public-only | bytes |")
    fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        print(f"| {r['method']} | {r['epsilon']:.2f} | {r['sigma']:.3g} | {r['components']} | "
              f"{fmt(r['teacher_dice_mean'])} | {fmt(r['ensemble_dice_mean'])} | {fmt(r['ensemble_vote_dice_mean'])} | "
              f"{fmt(r['pseudo_label_dice_mean'])} | {fmt(r['student'])} | {fmt(r['public_only_dice_mean'])} | "
              f"{r['bytes_up_per_query_per_teacher']} |")


if __name__ == "__main__":
    main()
