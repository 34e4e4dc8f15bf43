"""Which PATE student carries the release's gain to real scans: students of more capacity on the same decoded
pseudo-labels, scored on the phantom test set, the public validation set (another centre's labelled phantoms --
the only set a choice may look at) and, as a check never used to choose, labelled real cases.

    .venv/bin/python -m experiments.probe_student_transfer PUBLIC_MODEL.pt SEED REAL_DIR [EPSILON] [STUDENTS]
    e.g. python -m experiments.probe_student_transfer runs/s0/_shared/K-128/public-model.pt 0 /data/real-dev 8

Steps: the release of experiments/probe_headfit_decoder.py (the quick world at SEED, 128 voxel-head teachers as the
hospitals train them, the product's anchored codec) with one seeded Gaussian draw at the product's sigma (a probe,
not a release: no ledger); the head-fit decoder's pseudo-labels; then each student (``server.student.train_student``
with the product's student epochs, the reference maps included) and the public model itself, each scored three
ways. Students (comma-separated names, default all):

* ``voxel-head`` -- the quick preset's student (213 parameters re-scoring each voxel from its scores and
  intensities, lr 1e-2);
* ``all`` -- every U-Net weight from the public model, the preset's learning rate (features adapted);
* ``lp-ft`` -- the voxel-head student, then every weight of it (U-Net and head) at the preset's learning rate on the
  same targets: linear probing then fine-tuning (Kumar et al. 2022, arXiv 2202.10054: a head fitted first keeps
  fine-tuning from distorting the pretrained features, which transfers better out of distribution);
* ``all-selftrain`` -- ``all`` with the public-selftrain targets (the public model's sharpened predictions of the
  query scans, T = 0.5) added as a second copy of the query scans: public information only.
"""
import json
import sys
import time

import numpy as np
import torch

from experiments.probe_headfit_decoder import teachers_release   # run from the repository root with -m

STUDENTS = ("voxel-head", "all", "lp-ft", "all-selftrain")


def real_scorer(real_dir: str, world):
    """Mean Dice / WT / TC / ET of a model on every labelled case of ``real_dir``, as `fedpate evaluate` scores it."""
    from task.reporting.bundle import preprocessing_of
    from task.data.msd import load_case
    from task.data.preprocess import PreprocessConfig
    from task.data.reader import read_dataset, require_labels
    from task.learning.metrics import per_case_dice, summarise
    from task.reporting.predict import segment_scan

    config = PreprocessConfig.from_dict(preprocessing_of(world)["config"])
    cases = [load_case(case) for case in require_labels(read_dataset(real_dir), "probe").training]

    def score(model):
        model.eval()
        classes, regions = [], []
        for image, truth, affine in cases:
            labels = segment_scan(model, config, image, affine, "cpu")
            class_dice, region_dice = per_case_dice(labels[None], np.asarray(truth)[None])
            classes.append(class_dice[0]), regions.append(region_dice[0])
        summary = summarise(np.stack(classes), np.stack(regions))
        return {k: (None if summary[k] is None else round(float(summary[k]), 3)) for k in ("mean", "WT", "TC", "ET")}
    return score


def main() -> None:
    public_path, seed, real_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    epsilon = float(sys.argv[4]) if len(sys.argv) > 4 else 8.0
    names = sys.argv[5].split(",") if len(sys.argv) > 5 else list(STUDENTS)
    from privacy.calibration import pate_sigma
    from server.selftrain import DEFAULT_TEMPERATURE, sharpen
    from server.student import ModelTraining, train_student
    from task.codecs.headfit import fit_head_decode
    from task.learning.metrics import dice_scores
    from task.learning.networks import VOXEL_HEAD
    from task.learning.training import predict_probs

    release = teachers_release(public_path, seed)
    preset, world, public, state = release.preset, release.world, release.public, release.state
    real = real_scorer(real_dir, world)

    def phantom(model, images, labels):
        scores = dice_scores(torch.as_tensor(predict_probs(model, images)).argmax(1), torch.as_tensor(labels))
        return {k: round(v, 3) for k, v in scores.items() if v is not None and k in ("mean", "2", "WT", "TC", "ET")}

    def report(name, model, seconds=0.0):
        print(json.dumps({"seed": seed, "epsilon": epsilon, "student": name, "seconds": round(seconds),
                          "test": phantom(model, world.test_images, world.test_labels),
                          "validation": phantom(model, world.validation_images, world.validation_labels),
                          "real": real(model)}), flush=True)

    report("public model", public)
    sigma = pate_sigma(epsilon, 1e-3, len(release.query_probs), release.compressor.sensitivity(release.teachers))
    rng = np.random.default_rng(seed + 100)
    z = release.mean_latent + rng.normal(0.0, sigma, release.mean_latent.shape)
    pseudo = fit_head_decode(z, release.query_probs, world.query_images, release.regions, release.count)
    print(json.dumps({"epsilon": epsilon, "sigma": round(sigma, 4),
                      "pseudo-labels, query": release.dice(pseudo, world.query_labels)}), flush=True)
    queries = list(range(len(pseudo)))
    init = lambda: {k: v.clone() for k, v in state.items()}  # noqa: E731
    for name in names:
        started = time.time()
        if name in ("voxel-head", "lp-ft"):   # the product's code path (server.student.train_student)
            model = train_student(world, pseudo, queries, preset,
                                  ModelTraining(seed=seed, trainable=VOXEL_HEAD, learning_rate=1e-2,
                                                finetune=name == "lp-ft"), init=init())
        elif name == "all":
            model = train_student(world, pseudo, queries, preset, ModelTraining(seed=seed), init=init())
        elif name == "all-selftrain":
            own = sharpen(release.query_probs, DEFAULT_TEMPERATURE)
            doubled = world.__class__.__new__(world.__class__)
            doubled.__dict__.update(world.__dict__)
            doubled.query_images = np.concatenate([world.query_images, world.query_images])
            model = train_student(doubled, np.concatenate([pseudo, own]), list(range(2 * len(pseudo))), preset,
                                  ModelTraining(seed=seed), init=init())
        else:
            raise SystemExit(f"unknown student {name!r}; expected one of {', '.join(STUDENTS)}")
        report(name, model, time.time() - started)


if __name__ == "__main__":
    main()
