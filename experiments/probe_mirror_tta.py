"""Does averaging a model's probabilities over mirrored copies of the scan (test-time mirroring) carry more of its
gain to real scans? nnU-Net predicts every case as the mean softmax over the 8 mirrorings of its three spatial
axes by default (Isensee et al. 2021, "nnU-Net: a self-configuring method for deep learning-based biomedical image
segmentation", arXiv 1809.10486): a fixed rule from the literature, no setting to choose. It is post-processing of
a released model, so it costs no privacy.

    .venv/bin/python -m experiments.probe_mirror_tta RUN SEED REAL_DIR
    e.g. python -m experiments.probe_mirror_tta runs/demo-s1 1 /data/real-dev

RUN is a finished `fedpate demo` / `compare` folder of the quick preset at seed SEED (its models are read from the
bundles it wrote; nothing is retrained). Every model, without and with mirroring, is scored three ways: the public
validation set (another centre's labelled phantoms -- the only set a choice may read), the phantom test set, and
the labelled real cases in REAL_DIR as the report scores them (a check, never a choice). One JSON row per
(model, mirroring).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    run, seed, real_dir = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from task.settings import presets
    from task.reporting.bundle import load_bundle
    from task.reporting.predict import preprocess_config_of
    from task.reporting.realcheck import open_check, score_model
    from task.learning.training import evaluate_segmentation_per_case
    from task.world import build_world, load_world

    prepared, split = build_world(presets.get_preset("quick"), None, seed, False)
    world = load_world(prepared, split)
    check = open_check([real_dir])
    models = sorted(p.parent.relative_to(run) for p in run.glob("**/model/bundle.json"))
    for where in models:
        if str(where).startswith("predict"):
            continue
        bundle = load_bundle(run / where, verify_ledger=False)
        config = preprocess_config_of(bundle.preprocessing)
        for mirrored in (False, True):
            started = time.perf_counter()
            validation, test = (evaluate_segmentation_per_case(bundle.model, images, labels, device="cpu",
                                                               mirror=mirrored)[0]["mean"]
                                for images, labels in ((world.validation_images, world.validation_labels),
                                                       (world.test_images, world.test_labels)))
            real = score_model(bundle.model, config, check, mirror=mirrored)["dice"]
            row = {"seed": seed, "model": str(where), "mirrored": mirrored,
                   "public_validation": round(validation, 4), "phantom_test": round(test, 4),
                   **{f"real_{k}": None if real[k] is None else round(float(real[k]), 4)
                      for k in ("mean", "WT", "TC", "ET")},
                   "seconds": round(time.perf_counter() - started, 1)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
