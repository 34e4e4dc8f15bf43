"""Does interpolating a fine-tuned model's weights back towards the public model carry more of its gain to real
scans? Weight-space ensembling of the fine-tuned and the zero-shot model (WiSE-FT: Wortsman et al. 2022, "Robust
fine-tuning of zero-shot models", arXiv 2109.01903) keeps most of the fine-tuning gain in distribution and recovers
robustness under distribution shift; it is post-processing of a released model, so it costs no privacy.

    .venv/bin/python -m experiments.probe_wise_ft RUN SEED REAL_DIR [ALPHAS]
    e.g. python -m experiments.probe_wise_ft runs/demo-s1 1 /data/real-dev 0,0.25,0.5,0.75,1

RUN is a finished `fedpate demo` / `compare` folder of the quick preset at seed SEED (its models are read from the
bundles it wrote; nothing is retrained). For each model that started from the public model (every private cell, the
self-trained and the non-private one) and each α, the interpolated model is

    U-Net weights  α · θ_fine-tuned + (1 − α) · θ_public,
    voxel head     its last layer scaled by α (the head is zero at its start, so α = 0 is the public model exactly),

scored three ways: the public validation set (another centre's labelled phantoms -- the only set a choice may read),
the phantom test set, and the labelled real cases in REAL_DIR as the report scores them (a check, never a choice).
Prints one JSON row per (model, α) and, per model, the α that public validation picks.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def interpolate(public_state: dict, tuned_state: dict, alpha: float) -> dict:
    """The WiSE-FT weights at ``alpha`` (1 = the tuned model, 0 = the public model), as described above."""
    out = {}
    for name, tuned in tuned_state.items():
        if name.startswith("voxel_head."):
            last = name.startswith("voxel_head.2.")            # task.learning.networks.voxel_head: zero-initialised layer 2
            out[name] = tuned * alpha if last else tuned.clone()
            continue
        base = public_state[name]
        out[name] = tuned.clone() if not tuned.is_floating_point() else alpha * tuned + (1 - alpha) * base
    return out


def main() -> None:
    run, seed, real_dir = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    alphas = tuple(float(a) for a in sys.argv[4].split(",")) if len(sys.argv) > 4 else ALPHAS
    from task.settings import presets
    from task.reporting.bundle import load_bundle
    from task.reporting.predict import preprocess_config_of
    from task.reporting.realcheck import open_check, score_model
    from task.learning.training import evaluate_segmentation
    from task.world import build_world, load_world

    prepared, split = build_world(presets.get_preset("quick"), None, seed, False)
    world = load_world(prepared, split)
    check = open_check([real_dir])
    public = load_bundle(run / "public-only", verify_ledger=False)
    public_state = {k: v.clone() for k, v in public.model.state_dict().items()}
    config = preprocess_config_of(public.preprocessing)
    models = sorted(p.parent.relative_to(run) for p in run.glob("**/model/bundle.json"))
    for where in models:
        if str(where) in ("public-only",) or str(where).startswith("predict"):
            continue
        bundle = load_bundle(run / where, verify_ledger=False)
        tuned_state = {k: v.clone() for k, v in bundle.model.state_dict().items()}
        rows = []
        for alpha in alphas:
            started = time.perf_counter()
            bundle.model.load_state_dict(interpolate(public_state, tuned_state, alpha))
            validation = evaluate_segmentation(bundle.model, world.validation_images, world.validation_labels,
                                               device="cpu")["mean"]
            test = evaluate_segmentation(bundle.model, world.test_images, world.test_labels, device="cpu")["mean"]
            real = score_model(bundle.model, config, check)["dice"]
            row = {"seed": seed, "model": str(where), "alpha": alpha, "public_validation": round(validation, 4),
                   "phantom_test": round(test, 4),
                   **{f"real_{k}": None if real[k] is None else round(float(real[k]), 4)
                      for k in ("mean", "WT", "TC", "ET")},
                   "seconds": round(time.perf_counter() - started, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        best = max(rows, key=lambda r: r["public_validation"])
        print(json.dumps({"seed": seed, "model": str(where), "chosen_on_public_validation": best["alpha"]}),
              flush=True)


if __name__ == "__main__":
    main()
