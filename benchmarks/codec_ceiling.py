"""What the anchored codec could carry if the teachers knew the truth: a simulation-only ceiling.

    .venv/bin/python benchmarks/codec_ceiling.py --seed 0 [--public-model runs/codec-ceiling/public-model-s0.pt]

"Perfect teachers" answer the query scans' true one-hot labels (which no deployment has: a diagnostic, never a
mechanism); their latents are decoded without noise against the public model's anchor, with the shells alone
(``intensity_bins`` 1, the codec before bins) and with each shell split into quantile bins of one channel of
the query scan (T1-Gd, FLAIR, T2). Prints Dice of the decoded pseudo-labels against those labels, per class; the
first row is the public model itself. No test patient is read.
"""
import argparse
from pathlib import Path

import numpy as np

from server.student import ModelTraining, train_public_model
from task import codecs
from task.learning.metrics import dice_scores
from task.settings.presets import get_preset
from task.learning.training import predict_probs
from task.world import build_world, load_world

CHANNELS = {"FLAIR": 0, "T1-Gd": codecs.T1GD_CHANNEL, "T2": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shells", default="-2,5")
    parser.add_argument("--public-model", default=None, help="checkpoint (trained there when missing)")
    args = parser.parse_args()
    preset = get_preset(args.preset)
    prepared, split = build_world(preset, None, args.seed, progress=False)
    world = load_world(prepared, split)
    checkpoint = Path(args.public_model or f"runs/codec-ceiling/public-model-s{args.seed}.pt")
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    model = train_public_model(world, preset, ModelTraining(seed=args.seed, checkpoint=checkpoint))
    anchor = predict_probs(model, world.query_images)
    truth = codecs.one_hot(world.query_labels, world.classes).astype(np.float64)
    shells = tuple(int(v) for v in args.shells.split(","))
    shell_map = codecs.anchor_regions(anchor, shells)

    def row(name: str, probs: np.ndarray, latent: int | None = None) -> None:
        d = dice_scores(probs.argmax(1), world.query_labels)
        size = "" if latent is None else f" (l = {latent})"
        print(f"| {name}{size} | {d['mean']:.3f} | {d['1']:.3f} | {d['2']:.3f} | {d['3']:.3f} | {d['TC']:.3f} |",
              flush=True)

    print("| decoded from perfect teachers' latents (no noise) | mean | class 1 | class 2 | class 3 | TC |")
    print("|---|---|---|---|---|---|")
    row("the public model itself", anchor)
    for channel, bins in [(None, 1)] + [(name, b) for name in CHANNELS for b in (3, 5)]:
        bin_map = None if channel is None else codecs.intensity_bin_map(world.query_images, shell_map,
                                                                         CHANNELS[channel], bins)
        z = codecs.anchored_encode(truth, anchor, shells, None, bins=bin_map, intensity_bins=bins)
        decoded = codecs.anchored_decode(z, anchor, shells, bins=bin_map, intensity_bins=bins)
        row("shells only" if channel is None else f"shells x {bins} {channel} bins", decoded, z.shape[1])


if __name__ == "__main__":
    main()
