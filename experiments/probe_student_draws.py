"""How much of PATE's seed-to-seed swing is the student's own training, and does averaging over the student's
training draws remove it? Every student here trains on one and the same release (post-processing: no privacy cost
beyond the release's own, charged by the run as usual).

    .venv/bin/python -m experiments.probe_student_draws OUT SEED EPSILON REAL_SPEC [REAL_SPEC ...] [--no-ema]
    e.g. python -m experiments.probe_student_draws runs/draws-s0 0 8 expert=/data/real-gt-dev algorithm=/data/real-dev

Steps: a real `fedpate compare --methods pate-anchored --epsilons EPSILON --seed SEED` (the quick preset; teachers,
queries, noise, ledger charges and the head-fit decoding exactly as the product runs them) into OUT, stopped where
the product would train its student. On that release:

* ``product``  -- the product's student (``server.student.train_student``: a voxel head, then every weight; seed SEED);
* ``draw-1``, ``draw-2`` -- the same student from the same initialisation (network seed SEED) with other batch orders
  and augmentation draws (training seeds SEED + 7919 k): what the student's own draws move;
* ``soup-3``  -- the uniform weight average of ``product``, ``draw-1`` and ``draw-2``, which share their start
  (a "uniform soup": Wortsman et al. 2022, "Model soups", arXiv 2203.05482; fine-tuned models from one pretrained
  start lie in one basin, so their average is a model of that basin, not a mixture);
* ``ema``, ``ema-draw-1``, ``ema-draw-2`` -- ``product`` and the two draws with an exponential moving average of
  their iterates in both stages, decay 0.99 (a horizon of ~100 steps, the last three of ten epochs; Polyak
  averaging), and ``soup-ema-3`` their uniform soup (``--no-ema``: none of these).

Each is scored on the public validation set (another centre's labelled phantoms: the only set a choice may read),
the phantom test set and, as a check never used to choose, the real cases (the report's scoring, mirrored).
One JSON row per student in OUT/students.jsonl and on stdout.
"""
from __future__ import annotations

import copy
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

DRAW_STRIDE = 7919
EMA_DECAY = 0.99


class _Stop(BaseException):
    """Raised by the hook once the students are scored: nothing after the student is needed."""


def train_drawn(world, targets, query_indices, preset, training, init, data_seed: int, ema_decay=None):
    """``server.student.train_student`` with the network built at ``training.seed`` but batches and augmentation
    drawn from ``data_seed`` (and an optional EMA of the iterates)."""
    from server import student as S
    from task.learning.networks import VOXEL_HEAD_AND_UNET, WITH_VOXEL_HEAD, build_unet
    from task.learning.training import TrainConfig, train_segmentation
    from task.options import Trainable

    epochs = preset.student.epochs if training.epochs is None else training.epochs
    images, labels = S._student_data(world, targets, query_indices, training.include_reference)

    def stage(trainable, start, learning_rate):
        torch.manual_seed(training.seed)
        model = build_unet(preset.unet, trainable=trainable)
        config = TrainConfig(epochs=int(epochs), batch_size=preset.batch_size, learning_rate=learning_rate,
                             seed=int(data_seed), init_from=start, description="student draw",
                             trainable=trainable, compute=training.compute, ema_decay=ema_decay)
        return train_segmentation(model, images, labels, config).model

    lr = preset.learning_rate if training.learning_rate is None else float(training.learning_rate)
    probe = stage(training.trainable, init, lr)
    if not training.finetune or training.trainable == Trainable.ALL:
        return probe
    whole = VOXEL_HEAD_AND_UNET if training.trainable in WITH_VOXEL_HEAD else Trainable.ALL
    return stage(whole, {k: v.detach().clone() for k, v in probe.state_dict().items()}, preset.learning_rate)


def soup(models):
    """The uniform weight average of ``models`` (one architecture, one start), as a new model."""
    states = [m.state_dict() for m in models]
    averaged = {}
    for name, value in states[0].items():
        averaged[name] = (torch.stack([s[name].float() for s in states]).mean(0).to(value.dtype)
                          if value.is_floating_point() else value.clone())
    averaged_model = copy.deepcopy(models[0])
    averaged_model.load_state_dict(averaged)
    return averaged_model


def main() -> None:
    with_ema = "--no-ema" not in sys.argv
    args = [a for a in sys.argv[1:] if a != "--no-ema"]
    out, seed, epsilon, specs = Path(args[0]), int(args[1]), args[2], args[3:]
    out.mkdir(parents=True, exist_ok=True)
    import server.pate as pate
    from sim.cli import main as fedpate
    from task.learning.training import evaluate_release, public_validation_dice
    from task.reporting.bundle import preprocessing_of
    from task.reporting.predict import preprocess_config_of
    from task.reporting.realcheck import open_check, score_model

    check = open_check(specs)
    rows_path = out / "students.jsonl"
    original = pate.train_student

    def hook(world, targets, query_indices, preset, training, init=None):
        config = preprocess_config_of(preprocessing_of(world))
        done = {}

        def score(name, model, seconds):
            model = model.cpu().eval()
            real = score_model(model, config, check)
            row = {"seed": seed, "epsilon": float(epsilon), "student": name, "seconds": round(seconds),
                   "public_validation": round(float(public_validation_dice(model, world)), 4),
                   "phantom_test": round(float(evaluate_release(model, world.test_images, world.test_labels)[0]["mean"]), 4),
                   **{f"real_{k}": None if real["dice"][k] is None else round(float(real["dice"][k]), 4)
                      for k in ("mean", "WT", "TC", "ET")},
                   "real_cases": {r["case"]: {k: None if r.get(k) is None else round(float(r[k]), 3)
                                              for k in ("WT", "TC", "ET")} for r in real["cases"]}}
            with rows_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)

        def timed(name, build):
            started = time.perf_counter()
            model = build()
            done[name] = model
            score(name, model, time.perf_counter() - started)

        fresh = lambda: {k: v.clone() for k, v in init.items()}   # noqa: E731
        timed("product", lambda: original(world, targets, query_indices, preset, replace(training, checkpoint=None),
                                          init=fresh()))
        for k in (1, 2):
            timed(f"draw-{k}", lambda k=k: train_drawn(world, targets, query_indices, preset, training, fresh(),
                                                       training.seed + DRAW_STRIDE * k))
        started = time.perf_counter()
        score("soup-3", soup([done["product"], done["draw-1"], done["draw-2"]]), time.perf_counter() - started)
        if not with_ema:
            raise _Stop()
        for k in (0, 1, 2):
            timed("ema" if k == 0 else f"ema-draw-{k}",
                  lambda k=k: train_drawn(world, targets, query_indices, preset, training, fresh(),
                                          training.seed + DRAW_STRIDE * k, ema_decay=EMA_DECAY))
        started = time.perf_counter()
        score("soup-ema-3", soup([done["ema"], done["ema-draw-1"], done["ema-draw-2"]]), time.perf_counter() - started)
        raise _Stop()

    pate.train_student = hook
    try:
        fedpate(["compare", "--out", str(out / "run"), "--seed", str(seed), "--methods", "pate-anchored",
                 "--epsilons", str(epsilon), "--no-progress", "--workers", "1"])
    except _Stop:
        pass


if __name__ == "__main__":
    main()
