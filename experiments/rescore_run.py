"""Re-score a finished comparison's released models with the product's current scoring, nothing retrained.

    .venv/bin/python -m experiments.rescore_run RUN OUT [REAL_DIR ...]
    e.g. python -m experiments.rescore_run runs/demo-s1 runs/demo-s1-mirrored /data/real-dev

Why: test-time mirroring (``task.learning.inference``) changed how every released model is scored, not how any model is
trained (training, the teachers' answers, the pseudo-labels and every choice still use one pass). The models a
comparison released before that change are therefore the models it would release now, up to the fresh noise of a
new run; scoring them again isolates the change, paired case by case, and keeps the privacy spent once.

RUN is copied to OUT. In the copy, every cell's ``results.json`` gets its Dice on the phantom test set
(``task.learning.training.evaluate_release``: ``dice``, ``dice_per_case``, ``dice_per_case_class``), its test label maps
(``predictions/``), its real-scan check (``task.reporting.realcheck.score_model`` on REAL_DIR; none given: the check is
removed) and ``inference``; a PATE cell's record of its public-only baseline is re-scored from the ``public-only``
cell's bundle when its old numbers show it is that model. Then the report is written again; the overlay plot
(one-pass predictions) is dropped. Everything else -- ledgers, ε, wall times, validation Dice, diagnostics -- is
the original run's.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def main() -> None:
    run, out, real_dirs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    from sim.report import write_report
    from sim.runners.compare import REPORT_SETTINGS, combined_release
    from task.settings import presets
    from task.reporting.bundle import load_bundle
    from task.learning.inference import DESCRIPTION
    from task.io import atomic_write_json
    from task.reporting.predict import preprocess_config_of
    from task.reporting.realcheck import open_check, score_model
    from task.reporting.results import write_test_predictions
    from task.learning.training import evaluate_release, per_class_of, predict_probs
    from task.world import build_world, load_world

    if out.exists():
        raise SystemExit(f"{out}: exists; give a new folder")
    shutil.copytree(run, out)
    compare = json.loads((out / "compare.json").read_text())
    prepared, split = build_world(presets.get_preset(compare["preset"]), None, compare["seed"], False)
    world = load_world(prepared, split)
    check = open_check(real_dirs) if real_dirs else None
    rescored = {}
    for results_path in sorted(out.glob("**/results.json")):
        cell = results_path.parent
        if not (cell / "model" / "bundle.json").exists():
            continue
        record = json.loads(results_path.read_text())
        model = load_bundle(cell, verify_ledger=False)
        dice, per_case = evaluate_release(model.model, world.test_images, world.test_labels)
        name = str(cell.relative_to(out))
        rescored[name] = (record["dice"]["mean"], dice["mean"])
        record.update(dice=dice, dice_per_case=list(per_case), dice_per_case_class=per_class_of(per_case),
                      inference=DESCRIPTION,
                      real_check=score_model(model.model, preprocess_config_of(model.preprocessing), check)
                      if check else None)
        if record.get("predictions"):
            shutil.rmtree(cell / "predictions", ignore_errors=True)
            labels = predict_probs(model.model, world.test_images, mirror=True).argmax(axis=1).astype("uint8")
            record["predictions"] = write_test_predictions(cell / "predictions", labels, world)
        atomic_write_json(results_path, record)
        print(json.dumps({"cell": name, "mean_dice_before": round(rescored[name][0], 4),
                          "mean_dice_now": round(dice["mean"], 4)}), flush=True)
    public = json.loads((out / "public-only" / "results.json").read_text())
    public_before = rescored["public-only"][0]
    for results_path in sorted(out.glob("**/results.json")):
        record = json.loads(results_path.read_text())
        if record.get("public_only_dice") is None:
            continue
        if abs(record["public_only_dice_mean"] - public_before) > 1e-9:
            raise SystemExit(f"{results_path}: its public-only baseline is not the public-only cell's model")
        record.update(public_only_dice=public["dice"], public_only_dice_mean=public["dice"]["mean"],
                      public_only_dice_per_case=public["dice_per_case"])
        atomic_write_json(results_path, record)
    (out / "overlays.png").unlink(missing_ok=True)
    saved = json.loads((out / REPORT_SETTINGS).read_text())
    saved["overlays"] = []
    atomic_write_json(out / REPORT_SETTINGS, saved)
    report = write_report(out, saved["title"], settings={**saved["settings"], "re-scored from": str(run)},
                          overlays=[], release=combined_release(out, compare["delta"]))
    print(f"rescore: {len(rescored)} models; report {report}", flush=True)


if __name__ == "__main__":
    main()
