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

import itertools
import json
import sys
import time
from pathlib import Path

import torch


class MirrorAveraged(torch.nn.Module):
    """``log`` of the mean softmax of ``model`` over the 8 mirrorings of the three spatial axes (each output
    flipped back), so that a softmax of this module's output is that mean, as every scorer here takes one."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = None
        combos = [c for r in range(4) for c in itertools.combinations((2, 3, 4), r)]
        for axes in combos:
            flipped = torch.flip(x, axes) if axes else x
            probs = torch.softmax(self.model(flipped).float(), dim=1)
            probs = torch.flip(probs, axes) if axes else probs
            total = probs if total is None else total + probs
        return torch.log((total / len(combos)).clamp_min(1e-12))


def main() -> None:
    run, seed, real_dir = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from task import presets
    from task.bundle import load_bundle
    from task.predict import preprocess_config_of
    from task.realcheck import open_check, score_model
    from task.training import evaluate_segmentation
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
            model = MirrorAveraged(bundle.model).eval() if mirrored else bundle.model
            started = time.perf_counter()
            validation = evaluate_segmentation(model, world.validation_images, world.validation_labels,
                                               device="cpu")["mean"]
            test = evaluate_segmentation(model, world.test_images, world.test_labels, device="cpu")["mean"]
            real = score_model(model, config, check)["dice"]
            row = {"seed": seed, "model": str(where), "mirrored": mirrored,
                   "public_validation": round(validation, 4), "phantom_test": round(test, 4),
                   **{f"real_{k}": None if real[k] is None else round(float(real[k]), 4)
                      for k in ("mean", "WT", "TC", "ET")},
                   "seconds": round(time.perf_counter() - started, 1)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
