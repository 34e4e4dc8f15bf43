"""Does PATE carry what the hospitals know? One command, one run, one line per compressor:

    decoded/probavg  -- the noise-free decoded ensemble's test Dice over the teachers' probability average
                        (what the codec keeps of what the teachers agree on; goal >= 0.9);
    pseudo/public    -- the noisy pseudo-labels' Dice on the query scans over the public model's own Dice
                        on the same scans (what the student is taught beyond public data; goal: +0.05).

    .venv/bin/python benchmarks/bench_pate_signal.py --preset tiny --epsilon 8 [--methods pate-anchored pate-ae]
    .venv/bin/python benchmarks/bench_pate_signal.py --from runs/demo      # read a compare/demo folder

Both are simulation-only diagnostics (the probability average needs every teacher's full-resolution output,
which never leaves a hospital; the query labels exist only in simulation): not covered by any guarantee.
Running mode: the in-process engine (the probability average needs the hospitals in this process), the
methods sharing one set of teachers (one folder of hospitals).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = ("method", "epsilon", "teachers", "sigma", "components", "ensemble_dice_mean",
        "ensemble_probability_average_dice_mean", "ensemble_decoded_over_probability_average",
        "pseudo_label_dice_mean", "public_model_query_dice_mean", "pseudo_label_minus_public_model_query_dice",
        "public_only_dice_mean")


def row(results: dict) -> dict:
    out = {key: results.get(key) for key in KEYS}
    out["student"] = (results.get("dice") or {}).get("mean")
    pseudo, public = out["pseudo_label_dice_mean"], out["public_model_query_dice_mean"]
    out["pseudo_over_public"] = None if pseudo is None or not public else pseudo / public
    return out


def table(rows: list[dict]) -> str:
    fmt = lambda v: "—" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| method | eps | K | decoded | prob. avg | decoded/probavg | pseudo | public (query) | "
             "pseudo/public | pseudo-public | student | public-only |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['method']} | {fmt(r['epsilon'])} | {r['teachers']} | {fmt(r['ensemble_dice_mean'])} | "
                     f"{fmt(r['ensemble_probability_average_dice_mean'])} | "
                     f"{fmt(r['ensemble_decoded_over_probability_average'])} | {fmt(r['pseudo_label_dice_mean'])} | "
                     f"{fmt(r['public_model_query_dice_mean'])} | {fmt(r['pseudo_over_public'])} | "
                     f"{fmt(r['pseudo_label_minus_public_model_query_dice'])} | {fmt(r['student'])} | "
                     f"{fmt(r['public_only_dice_mean'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--methods", nargs="+", default=["pate-anchored", "pate-ae", "pate-pca"])
    parser.add_argument("--teachers-per-hospital", type=int, default=None)
    parser.add_argument("--from", dest="source", default=None, help="read the PATE cells of this run folder")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    if args.source:
        for path in sorted(Path(args.source).rglob("results.json")):
            results = json.loads(path.read_text())
            if str(results.get("method", "")).startswith("pate-"):
                rows.append(row(results))
    else:
        from sim.runners.inprocess import InProcessPateRun, run_pate_inprocess
        from task.learning.compute import Compute

        out = Path(args.out or tempfile.mkdtemp(prefix="bench_pate_signal_"))
        for method in args.methods:
            results = run_pate_inprocess(InProcessPateRun(
                args.preset, method, out / method, args.epsilon, teachers_per_hospital=args.teachers_per_hospital,
                hospitals_root=out / "hospitals", compute=Compute(progress=False),
                options={"shared_dir": out / "shared"}))
            rows.append(row(results))
            print(json.dumps(rows[-1]), flush=True)
    if not rows:
        raise SystemExit("no PATE results found")
    print(table(rows))


if __name__ == "__main__":
    main()
