"""The model every method starts from against the floor its headroom is measured from: the public model
(``public-model.pt``, the preset's 50 pre-training epochs on the public reference maps) and ``public-only``
(``public-only.pt``: the same model trained on the same maps for the student's 10 more epochs), scored on the phantom
test set, public validation (another centre's labelled phantoms: the only set a choice may read) and, as a check,
labelled real cases -- with test-time mirroring, as the product scores every model.

    .venv/bin/python -m experiments.probe_start_and_floor SHARED_DIR SEED REAL_DIR
    e.g. python -m experiments.probe_start_and_floor runs/demo/_shared/K-128 0 /data/real-dev

Both checkpoints are trained into SHARED_DIR when missing, by the calls a comparison makes
(``sim.runners.cells.shared_public_models``), so a comparison's ``_shared/K-128`` folder is read as it is.
"""
import json
import sys
from pathlib import Path


def main() -> None:
    shared, seed, real_dir = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import task.settings.presets as presets
    from sim.runners.cells import shared_public_models
    from task.reporting.bundle import preprocessing_of
    from task.learning.compute import Compute
    from task.reporting.predict import preprocess_config_of
    from task.reporting.realcheck import open_check, score_model
    from task.learning.training import evaluate_release
    from task.world import build_world, load_world

    preset = presets.get_preset("quick")
    prepared, split = build_world(preset, None, seed, False)
    world = load_world(prepared, split)
    start, public_only = shared_public_models(world, preset, seed, shared, Compute(progress=False))
    check = open_check([real_dir], cache_dir=None)
    config = preprocess_config_of(preprocessing_of(prepared))

    def phantom(model, images, labels):   # mean Dice as a released model is scored: with test-time mirroring
        return round(float(evaluate_release(model, images, labels)[0]["mean"]), 3)

    for name, model in (("start (public-model.pt)", start), ("public-only (public-only.pt)", public_only)):
        real = score_model(model, config, check)["dice"]
        print(json.dumps({"seed": seed, "model": name,
                          "phantom": phantom(model, world.test_images, world.test_labels),
                          "validation": phantom(model, world.validation_images, world.validation_labels),
                          **{f"real_{k}": round(float(real[k]), 3) for k in ("mean", "WT", "TC", "ET")}}), flush=True)


if __name__ == "__main__":
    main()
