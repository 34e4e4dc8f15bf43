"""The probe behind the head-fit decoder and the voxel-head student (docs/decisions/head-fit-decoder.md): what the
anchored release carries from voxel-head teachers, decoded per region (mass matching) or by one head fitted to every
query (task.codecs.headfit), and which student learns the decoded labels.

    .venv/bin/python -m experiments.probe_headfit_decoder PUBLIC_MODEL.pt SEED [EPSILONS]
    e.g. python -m experiments.probe_headfit_decoder runs/s0/_shared/K-128/public-model.pt 0 8,1,0.25

Steps: the quick preset's world at SEED; 128 voxel-head teachers (60 full-batch steps at lr 1e-2 on the frozen
public model's cached logits, as the hospitals train them); each teacher's probabilities on the 40 query scans
encoded by the quick preset's anchored codec (3 T1-Gd bins, C fitted on the public reference maps) and averaged;
for each epsilon (default 8, 1) one Gaussian draw at the product's sigma (numpy's seeded RNG: a probe, not a release -- no
ledger); both decoders' pseudo-label Dice on the query scans; the head fit's loss after 100, 300 (the product's) and 600 steps
(the likelihood's convergence: a function of the release, public), how much of |z|^2 the fit explains and how much
it explains of a release of pure noise at the same sigma; four students (``server.student.train_student``:
every weight or a voxel head, with or without the reference maps) scored on the test set; and the control: the
voxel-head student trained on the public model's own predictions of the query scans (no hospital at all).
Test-set numbers: a probe, stated as such in docs/RESULTS.md, not a way to choose a default.
"""
import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch


def teachers_release(public_path: str, seed: int, decoder: str = "head-fit") -> SimpleNamespace:
    """The quick world at ``seed``, its public model, the product's anchored codec (``decoder``) fitted on public data,
    and the 128 voxel-head teachers' noise-free mean latent on the 40 query scans (shared with
    experiments/probe_query_selection.py)."""
    import task.settings.presets as presets
    from task.codecs import PublicFit, make_compressor
    from task import codecs
    from task.learning.metrics import dice_scores
    from task.learning.networks import VOXEL_HEAD, build_unet
    from task.learning.training import per_sample_loss
    from task.world import build_world, load_world

    preset = presets.get_preset("quick")
    prepared, split = build_world(preset, None, seed, False)
    world = load_world(prepared, split)
    public = build_unet(preset.unet)
    checkpoint = torch.load(public_path, weights_only=False)
    state = checkpoint.get("model", checkpoint)
    public.load_state_dict(state)
    public.eval()

    def logits(x):
        with torch.no_grad():
            x = torch.as_tensor(np.asarray(x, np.float32))
            return torch.cat([public(x[i:i + 4]) for i in range(0, len(x), 4)])

    def dice(probs, labels):
        scores = dice_scores(torch.as_tensor(probs).argmax(1), torch.as_tensor(labels))
        return {k: round(v, 3) for k, v in scores.items() if v is not None and k in ("mean", "1", "2", "3")}

    query_logits = logits(world.query_images)
    query_probs = torch.softmax(query_logits, 1).numpy()
    reference_probs = torch.softmax(logits(world.reference_images), 1).numpy()

    def fitted(name):
        compressor = make_compressor("pate-anchored", preset, decoder=name)   # the product's codec
        return compressor.fit_release(PublicFit(reference_maps=codecs.one_hot(world.reference_labels, 4),
                                                reference_probs=reference_probs, query_probs=query_probs,
                                                reference_is_query=False, with_predictions=False,
                                                reference_scans=world.reference_images), 1.0, 128)

    compressor = fitted(decoder)
    regions = compressor._regions(query_probs, world.query_images)
    partitions = [part for h in sorted(split.hospitals) for part in split.hospitals[h]]
    features = torch.cat([query_logits, torch.as_tensor(world.query_images)], 1)
    latent_sum, started = 0.0, time.time()
    for part in partitions:
        x = torch.as_tensor(np.asarray(prepared.images(part), np.float32))
        y = torch.as_tensor(np.asarray(prepared.labels(part), np.int64))
        inputs = torch.cat([logits(x), x], 1)
        head = build_unet(preset.unet, trainable=VOXEL_HEAD).voxel_head
        optimiser = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(60):
            optimiser.zero_grad()
            per_sample_loss(inputs[:, :4] + head(inputs), y).mean().backward()
            optimiser.step()
        with torch.no_grad():
            teacher = torch.softmax(query_logits + head(features), 1).numpy()
        latent_sum = latent_sum + codecs.anchored_encode(teacher, query_probs, compressor.shells, compressor.clip,
                                                         regions=regions, intensity_bins=compressor.intensity_bins)
    print(json.dumps({"teachers": len(partitions), "seconds": round(time.time() - started),
                      "public model, query": dice(query_probs, world.query_labels)}), flush=True)
    return SimpleNamespace(preset=preset, world=world, public=public, state=state, query_probs=query_probs,
                           compressor=compressor, fitted=fitted, regions=regions, dice=dice,
                           mean_latent=latent_sum / len(partitions), teachers=len(partitions),
                           count=compressor.latent_dim // (compressor.classes - 1))


def main() -> None:
    public_path, seed = sys.argv[1], int(sys.argv[2])
    epsilons = [float(e) for e in (sys.argv[3] if len(sys.argv) > 3 else "8,1").split(",")]
    from privacy.calibration import pate_sigma
    from server.student import ModelTraining, train_student
    from task.codecs.headfit import HeadFitSettings, fit_head_decode
    from task.learning.networks import VOXEL_HEAD
    from task.learning.training import predict_probs

    release = teachers_release(public_path, seed)
    preset, world, public, state, dice = release.preset, release.world, release.public, release.state, release.dice
    query_probs, compressor, regions, mean_latent = (release.query_probs, release.compressor, release.regions,
                                                     release.mean_latent)
    mass_matching = release.fitted("mass-matching")
    sensitivity = compressor.sensitivity(release.teachers)
    rng = np.random.default_rng(seed + 100)
    count = release.count
    students = [("all + reference", "all", None, True), ("voxel-head + reference", VOXEL_HEAD, 1e-2, True),
                ("voxel-head", VOXEL_HEAD, 1e-2, False), ("all", "all", None, False)]
    for epsilon in epsilons:
        sigma = pate_sigma(epsilon, 1e-3, len(query_probs), sensitivity)
        z = mean_latent + rng.normal(0.0, sigma, mean_latent.shape)
        row = {"epsilon": epsilon, "sigma": round(sigma, 4),
               "mass-matching, query": dice(mass_matching.decode(z, query_probs, sigma=sigma,
                                                                 scans=world.query_images), world.query_labels)}
        for steps in (100, 300, 600):
            history, started = [], time.time()
            decoded = fit_head_decode(z, query_probs, world.query_images, regions, count,
                                      settings=HeadFitSettings(steps=steps), history=history)
            row[f"head-fit {steps} steps: loss, seconds"] = [round(history[-1], 1), round(time.time() - started, 1)]
            if steps == 300:        # the product's setting (FIT_STEPS)
                pseudo = decoded
                row["head-fit (300 steps), query"] = dice(pseudo, world.query_labels)
                row["|z|^2, what the fit explained"] = [round(history[0], 1), round(history[0] - history[-1], 1)]
        noise_only, history = rng.normal(0.0, sigma, mean_latent.shape), []
        fit_head_decode(noise_only, query_probs, world.query_images, regions, count, history=history)
        row["a release of pure noise: what the fit explained"] = round(history[0] - history[-1], 1)
        print(json.dumps(row), flush=True)
        for name, trainable, learning_rate, reference in students:
            student = train_student(world, pseudo, list(range(len(pseudo))), preset,
                                    ModelTraining(seed=seed, include_reference=reference, trainable=trainable,
                                                  learning_rate=learning_rate),
                                    init={k: v.clone() for k, v in state.items()})
            print(json.dumps({"epsilon": epsilon, "student": name,
                              "test": dice(predict_probs(student, world.test_images), world.test_labels)}), flush=True)
    control = train_student(world, predict_probs(public, world.query_images), list(range(len(query_probs))), preset,
                            ModelTraining(seed=seed, include_reference=True, trainable=VOXEL_HEAD, learning_rate=1e-2),
                            init={k: v.clone() for k, v in state.items()})
    print(json.dumps({"control": "voxel-head student on the public model's own query predictions + reference",
                      "test": dice(predict_probs(control, world.test_images), world.test_labels),
                      "public model, test": dice(predict_probs(public, world.test_images), world.test_labels)}),
          flush=True)


if __name__ == "__main__":
    main()
