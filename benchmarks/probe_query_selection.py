"""An upper bound for disagreement-driven queries (issue 28, item 5: "queries spent where teachers and public model
disagree"): with the head-fit decoder, would answering only the query scans where the teachers disagree most with
the public model, at the same epsilon, teach the student more?

    .venv/bin/python benchmarks/probe_query_selection.py PUBLIC_MODEL.pt SEED [EPSILONS]

The selection here is an *oracle*: queries are ranked by the norm of the teachers' noise-free mean latent, a private
quantity that a real mechanism would have to charge (e.g. a noisy threshold test per query, as confident-GNMax does).
Not charging it makes this an upper bound on what any charged selection could gain. For M of the 40 query scans (the
top M by that norm; M = 40 is today's PATE) sigma is recalibrated for M Gaussian queries at the same epsilon
(``pate_sigma``), one seeded draw is added, the release is decoded by the head fit and the adopted voxel-head student is
trained on it (plus the reference maps) and scored on the test set. Steps as benchmarks/probe_headfit_decoder.py.
"""
import json
import sys
import time

import numpy as np
import torch


def main() -> None:
    public_path, seed = sys.argv[1], int(sys.argv[2])
    epsilons = [float(e) for e in (sys.argv[3] if len(sys.argv) > 3 else "8,1").split(",")]
    import sim.presets as presets
    from privacy.calibration import pate_sigma
    from server.compressors import PublicFit, make_compressor
    from server.student import train_student
    from sim import codecs
    from sim.codecs.headfit import fit_head_decode
    from sim.metrics import dice_scores
    from sim.networks import VOXEL_HEAD, build_unet
    from sim.training import per_sample_loss, predict_probs
    from sim.world import build_world, load_world

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
    compressor = make_compressor("pate-anchored", preset, decoder="head-fit")   # the product's codec
    compressor.fit_release(PublicFit(reference_maps=codecs.one_hot(world.reference_labels, 4),
                                     reference_probs=reference_probs, query_probs=query_probs,
                                     reference_is_query=False, with_predictions=False,
                                     reference_scans=world.reference_images), 1.0, 128)
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
    mean_latent = latent_sum / len(partitions)
    print(json.dumps({"teachers": len(partitions), "seconds": round(time.time() - started),
                      "public model, query": dice(query_probs, world.query_labels)}), flush=True)
    sensitivity = compressor.sensitivity(len(partitions))
    rank = np.argsort(-np.linalg.norm(mean_latent, axis=1))          # the oracle's order (private: not charged here)
    count = compressor.latent_dim // 3
    for epsilon in epsilons:
        for chosen in (40, 20, 10):
            index = np.sort(rank[:chosen])
            sigma = pate_sigma(epsilon, 1e-3, chosen, sensitivity)
            rng = np.random.default_rng(seed + 100 + chosen)
            z = mean_latent[index] + rng.normal(0.0, sigma, mean_latent[index].shape)
            pseudo = fit_head_decode(z, query_probs[index], world.query_images[index], regions[index], count)
            student = train_student(world, pseudo, list(index), preset, seed=seed,
                                    init={k: v.clone() for k, v in state.items()}, include_reference=True,
                                    trainable=VOXEL_HEAD, learning_rate=1e-2)
            print(json.dumps({"epsilon": epsilon, "queries": chosen, "sigma": round(sigma, 4),
                              "pseudo-labels, chosen queries": dice(pseudo, world.query_labels[index]),
                              "student, test": dice(predict_probs(student, world.test_images), world.test_labels)}),
                  flush=True)

if __name__ == "__main__":
    main()
