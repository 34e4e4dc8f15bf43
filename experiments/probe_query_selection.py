"""An upper bound for disagreement-driven queries (queries spent where teachers and the public model disagree;
docs/RESULTS.md): with the head-fit decoder, would answering only the query scans where the teachers disagree most
with the public model, at the same epsilon, teach the student more?

    .venv/bin/python -m experiments.probe_query_selection PUBLIC_MODEL.pt SEED [EPSILONS]

The selection here is an *oracle*: queries are ranked by the norm of the teachers' noise-free mean latent, a private
quantity that a real mechanism would have to charge (e.g. a noisy threshold test per query, as confident-GNMax does).
Not charging it makes this an upper bound on what any charged selection could gain. For M of the 40 query scans (the
top M by that norm; M = 40 is today's PATE) sigma is recalibrated for M Gaussian queries at the same epsilon
(``pate_sigma``), one seeded draw is added, the release is decoded by the head fit and the adopted voxel-head student is
trained on it (plus the reference maps) and scored on the test set. Steps as experiments/probe_headfit_decoder.py.
"""
import json
import sys

import numpy as np

from experiments.probe_headfit_decoder import teachers_release   # the same teachers and release (run with -m)


def main() -> None:
    public_path, seed = sys.argv[1], int(sys.argv[2])
    epsilons = [float(e) for e in (sys.argv[3] if len(sys.argv) > 3 else "8,1").split(",")]
    from privacy.calibration import pate_sigma
    from server.student import ModelTraining, train_student
    from task.codecs.headfit import fit_head_decode
    from task.learning.networks import VOXEL_HEAD
    from task.learning.training import predict_probs

    release = teachers_release(public_path, seed)
    preset, world, state, dice = release.preset, release.world, release.state, release.dice
    query_probs, compressor, regions, mean_latent = (release.query_probs, release.compressor, release.regions,
                                                     release.mean_latent)
    sensitivity = compressor.sensitivity(release.teachers)
    rank = np.argsort(-np.linalg.norm(mean_latent, axis=1))          # the oracle's order (private: not charged here)
    count = release.count
    for epsilon in epsilons:
        for chosen in (40, 20, 10):
            index = np.sort(rank[:chosen])
            sigma = pate_sigma(epsilon, 1e-3, chosen, sensitivity)
            rng = np.random.default_rng(seed + 100 + chosen)
            z = mean_latent[index] + rng.normal(0.0, sigma, mean_latent[index].shape)
            pseudo = fit_head_decode(z, query_probs[index], world.query_images[index], regions[index], count)
            student = train_student(world, pseudo, list(index), preset,
                                    ModelTraining(seed=seed, include_reference=True, trainable=VOXEL_HEAD,
                                                  learning_rate=1e-2),
                                    init={k: v.clone() for k, v in state.items()})
            print(json.dumps({"epsilon": epsilon, "queries": chosen, "sigma": round(sigma, 4),
                              "pseudo-labels, chosen queries": dice(pseudo, world.query_labels[index]),
                              "student, test": dice(predict_probs(student, world.test_images), world.test_labels)}),
                  flush=True)


if __name__ == "__main__":
    main()
